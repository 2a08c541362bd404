"""vmpin's own CPU allocations in the store: the ``allocations`` and ``cpu_limits`` tables.

Issue 30: on a node whose kubelet hands out no exclusive CPUs (CPU manager policy ``none``),
vmpin allocates them to annotated pods (:mod:`vmpin.reconcile.allocations` decides,
:mod:`vmpin.core.allocate` chooses).  What it decided must outlive every process -- the hook
that allocated, the agent, a reboot of the agent -- so it is a table of the store, written in
the same ``BEGIN IMMEDIATE`` transaction that read it: two processes allocating at once queue
on SQLite's write lock, and the second sees the first's rows before it chooses.

- ``allocations``: one row per sandbox (pod) that asked; ``cpus`` NULL while it waits
  (refused so far: ``reason`` says why), else its CPUs.
- ``cpu_limits``: each container's CPU limit in whole CPUs (OCI ``quota / period``), written
  when the hook's create event is applied (a count the pod's annotation may leave to them).

The state dir also holds :data:`vmpin.state.allocating.MARKER` while any row exists: a plain
container's hook, which otherwise never opens the store (docs/design.md), then takes the pass
path, so that a container started or stopped beside an allocation is planned against it
before the hook returns.  One ``stat``, in vmpin.state.allocating: the hook's tests are there,
and this module stays lean for a hook's pass.
"""

from __future__ import annotations

import os

from vmpin.core.cpuset import CpuSet
from vmpin.state.allocating import MARKER

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.lean.records)
if TYPE_CHECKING:
    import sqlite3
    from typing import NamedTuple
else:
    from vmpin.lean.records import NamedTuple

#: the tables (vmpin.state.schema appends them to its schema; version 3)
SCHEMA = """
CREATE TABLE IF NOT EXISTS allocations (
    sandbox_id TEXT PRIMARY KEY,
    pod_uid    TEXT,
    cpus       TEXT,
    size       INTEGER,
    via        TEXT NOT NULL,
    reason     TEXT,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS cpu_limits (
    container_id TEXT PRIMARY KEY,
    cpus         INTEGER NOT NULL
);
"""

_COLS = ("sandbox_id", "pod_uid", "cpus", "size", "via", "reason", "created_at", "updated_at")


class Allocation(NamedTuple):
    sandbox_id: str
    pod_uid: str | None
    #: None: waiting (``reason`` says why)
    cpus: CpuSet | None
    #: CPUs asked for; None: not known yet (no integer CPU limit seen)
    size: int | None
    #: the annotation that asked (``key=value``)
    via: str
    reason: str | None
    created_at: float
    updated_at: float


def record_limit(db: sqlite3.Connection, container_id: str, cpus: int | None) -> None:
    """A container's CPU limit as its create event carried it (in the event's transaction)."""
    if cpus is not None:
        db.execute("INSERT OR REPLACE INTO cpu_limits VALUES (?,?)", (container_id, cpus))


def read(db: sqlite3.Connection) -> list[Allocation]:
    """Every row, oldest first; [] for a store older than the tables (read-only view)."""
    from vmpin.state.sqlite import sqlite3

    try:
        rows = db.execute(
            f"SELECT {','.join(_COLS)} FROM allocations ORDER BY created_at, sandbox_id"
        ).fetchall()
    except sqlite3.OperationalError:
        return []  # schema 2, opened read-only: no table yet, no allocation
    return [
        Allocation(r[0], r[1], _cpus(r[2]), r[3], r[4], r[5], r[6], r[7])
        for r in rows
    ]


def _cpus(text: str | None) -> CpuSet | None:
    return CpuSet.parse(text) if text is not None else None


def limits(db: sqlite3.Connection) -> dict[str, int]:
    return {str(r[0]): int(r[1]) for r in db.execute("SELECT container_id, cpus FROM cpu_limits")}


def write(db: sqlite3.Connection, rows: list[Allocation], gone: list[str]) -> None:
    """Upsert ``rows`` and delete the sandboxes ``gone`` (inside the caller's transaction);
    the limits of containers no longer recorded go too."""
    db.executemany("DELETE FROM allocations WHERE sandbox_id=?", [(s,) for s in gone])
    marks = ",".join("?" for _ in _COLS)
    db.executemany(
        f"INSERT OR REPLACE INTO allocations ({','.join(_COLS)}) VALUES ({marks})",
        [(*r[:2], r.cpus.to_list() if r.cpus is not None else None, *r[3:]) for r in rows],
    )
    db.execute("DELETE FROM cpu_limits WHERE container_id NOT IN (SELECT id FROM containers)")


def mark(state_dir: str, allocations: list[Allocation]) -> None:
    """Keep :data:`MARKER` in step with the table (written only when its text changes)."""
    path = os.path.join(state_dir, MARKER)
    if not allocations:
        try:  # noqa: SIM105 (contextlib stays off the hook's path)
            os.unlink(path)
        except FileNotFoundError:
            pass
        return
    granted = CpuSet.union_all(a.cpus for a in allocations if a.cpus is not None)
    text = f"{granted.to_list()}\n"
    try:
        with open(path) as f:
            if f.read() == text:
                return
    except OSError:
        pass
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)
