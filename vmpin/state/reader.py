"""Reading the store: every query, and nothing that writes.

kubelet's cpumanager ``state.Reader`` is the model: read-only views and the planner hold a
:class:`Reader`, so that a write from them is a type error, not a convention.
:meth:`vmpin.state.store.Store.open_readonly` returns one; :class:`vmpin.state.writer.Writer`
(and the full :class:`vmpin.state.store.Store`) add the writes on top of these reads.
"""

from __future__ import annotations

import os
from sys import intern as _intern

# (the module, not its package: "from vmpin.state import changes" in a function was a
# Python-level importlib call at each use, three an event's pass)
from vmpin.state.changes import since
from vmpin.state.records import (
    API_POLICY_META,
    CONTAINER_COLS,
    POLICY_META,
    SANDBOX_COLS,
    SHARED_THREAD,
    ContainerRec,
    PolicyRecord,
    SandboxRec,
    ThreadRec,
    container_row,
    policy_record,
    sandbox_row,
    shared,
)

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.lean.records)
if TYPE_CHECKING:
    import sqlite3
    from typing import TypeVar

    from vmpin.state.changes import Delta

    _R = TypeVar("_R", bound="Reader")

_CONTAINERS = f"SELECT {','.join(CONTAINER_COLS)} FROM containers"
_SANDBOXES = f"SELECT {','.join(SANDBOX_COLS)} FROM sandboxes"


class Reader:
    """One connection to the state database, for reading."""

    #: opened by :meth:`vmpin.state.store.Store.open_readonly`: nothing in the state dir is
    #: to be written
    readonly = True
    #: a read-only view of a node where vmpin has recorded nothing yet (empty, in memory)
    fresh = False
    #: the data_version a pass holds while it runs (:meth:`hold_version`), else None
    _held_version: int | None = None
    #: the change log as :meth:`changes_since` last read it: (version, from seq, delta)
    _changes_read: tuple[tuple[int, int], int, Delta | None] | None = None

    def __init__(self, state_dir: str, db: sqlite3.Connection, *, fresh: bool = False) -> None:
        self.state_dir = state_dir
        self.path = os.path.join(state_dir, "state.db")
        self.db = db
        self.fresh = fresh

    def close(self) -> None:
        self.db.close()

    def __enter__(self: _R) -> _R:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- containers ------------------------------------------------------------------------
    def container(self, container_id: str) -> ContainerRec | None:
        found = self.db.execute(f"{_CONTAINERS} WHERE id=?", (container_id,)).fetchone()
        return container_row(found) if found else None

    def container_by_bundle(self, bundle: str) -> ContainerRec | None:
        found = self.db.execute(f"{_CONTAINERS} WHERE bundle=?", (bundle,)).fetchone()
        return container_row(found) if found else None

    def containers(self, sandbox_id: str | None = None) -> list[ContainerRec]:
        if sandbox_id is None:
            rows = self.db.execute(f"{_CONTAINERS} ORDER BY sandbox_id, id")
        else:
            rows = self.db.execute(f"{_CONTAINERS} WHERE sandbox_id=? ORDER BY id", (sandbox_id,))
        return [container_row(r) for r in rows.fetchall()]

    # -- sandboxes -------------------------------------------------------------------------
    def sandbox(self, sandbox_id: str) -> SandboxRec | None:
        found = self.db.execute(f"{_SANDBOXES} WHERE id=?", (sandbox_id,)).fetchone()
        return sandbox_row(found) if found else None

    def sandboxes(self) -> list[SandboxRec]:
        rows = self.db.execute(f"{_SANDBOXES} ORDER BY id").fetchall()
        return [sandbox_row(r) for r in rows]

    def tracked(self) -> dict[str, tuple[str, int]]:
        """Sandbox id -> (runtime, how many of its containers are stored): what the agent's
        gauges and status count, read as two aggregates (the agent asks up to once a second;
        whole records of 2,000 sandboxes and their containers took ~20 ms)."""
        runtimes = self.db.execute("SELECT id, runtime FROM sandboxes").fetchall()
        counts = dict(
            self.db.execute("SELECT sandbox_id, count(*) FROM containers GROUP BY sandbox_id")
        )
        return {sid: (runtime, counts.get(sid, 0)) for sid, runtime in runtimes}

    def dirty(self) -> list[tuple[str, int]]:
        rows = self.db.execute("SELECT id, gen FROM sandboxes WHERE gen > done_gen ORDER BY id")
        return [(r[0], r[1]) for r in rows.fetchall()]

    # -- whether anything changed ----------------------------------------------------------
    def version(self) -> tuple[int, int]:
        """A value that moves whenever the database may have changed: ``PRAGMA
        data_version`` moves when another connection commits, ``total_changes`` when this
        one writes.  Equal versions mean equal tables, so what was read or derived from
        them under the first may be used again (one small query, where re-reading every
        table of a 2,000-sandbox node is ~25 ms of each pass).

        While a pass holds the ``data_version`` it read when it began (:meth:`hold_version`),
        that value stands for it: read before anything the pass reads, it can only make what
        is kept under it look older than it is (read again by the next pass), never newer --
        and every layer of the pass asking again was five reads of it per pass (issue 28)."""
        held = self._held_version
        if held is None:
            held = self.db.execute("PRAGMA data_version").fetchone()[0]
        return (held, self.db.total_changes)

    def changes_since(self, seq: int) -> Delta | None:
        """:func:`vmpin.state.changes.since` ``seq``, read once per :meth:`version` while a
        pass holds it (:meth:`hold_version`): a pass's layers that follow the log from the
        same point (the allocations' askers, the observation's tables) share one read of it
        rather than each reading it again (issue 28).  The Delta is shared: whoever takes it
        does not change it."""
        held = self._held_version
        if held is None:  # (outside a pass: read as asked, no version read to key it by)
            return since(self.db, seq)
        version = (held, self.db.total_changes)
        memo = self._changes_read
        if memo is not None and memo[0] == version and memo[1] == seq:
            return memo[2]
        delta = since(self.db, seq)
        self._changes_read = (version, seq, delta)
        return delta

    def hold_version(self, seen: int | None) -> None:
        """Until called with None, :meth:`version` answers with ``seen``: the
        :meth:`data_version` a pass read before it read anything else."""
        self._held_version = seen

    def data_version(self) -> int:
        """A value that moves when *another* connection commits (``PRAGMA data_version``):
        whether anyone wrote the store while this connection was planning from it."""
        return int(self.db.execute("PRAGMA data_version").fetchone()[0])

    # -- remembered thread roles -----------------------------------------------------------
    def threads(self, sandbox_id: str, vmm_pid: int, vmm_start: int) -> dict[int, ThreadRec]:
        rows = self.db.execute(
            "SELECT tid, role, idx, label, layer FROM threads"
            " WHERE sandbox_id=? AND vmm_pid=? AND vmm_start=? ORDER BY tid",
            (sandbox_id, vmm_pid, vmm_start),
        ).fetchall()
        return {r[0]: ThreadRec(*r) for r in rows}

    def all_threads(self) -> dict[tuple[str, int, int], dict[int, ThreadRec]]:
        """:meth:`threads` of every (sandbox, VMM pid, VMM start), in one query (a node pass
        reads them all: one query per sandbox made the pass's store time grow with them)."""
        out: dict[tuple[str, int, int], dict[int, ThreadRec]] = {}
        rows = self.db.execute(
            "SELECT sandbox_id, vmm_pid, vmm_start, tid, role, idx, label, layer FROM threads"
            " ORDER BY sandbox_id, tid"
        )
        make = ThreadRec._make
        for row in rows.fetchall():
            key = row[:3]  # (sandbox, pid, start)
            found = out.get(key)
            if found is None:
                found = out[tuple(shared(list(key), (0,)))] = {}
            found[row[3]] = make(shared(list(row[3:]), SHARED_THREAD))
        return out

    # -- meta ------------------------------------------------------------------------------
    def meta(self, key: str) -> str | None:
        row = self.db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def meta_prefix(self, prefix: str) -> list[tuple[str, str]]:
        """Every (key, value) whose key starts with ``prefix`` (no LIKE wildcards in it)."""
        rows = self.db.execute(
            "SELECT key, value FROM meta WHERE substr(key, 1, ?) = ?", (len(prefix), prefix)
        ).fetchall()
        # (the values repeat: an original affinity per thread, mostly the same few sets)
        return [(str(r[0]), _intern(str(r[1]))) for r in rows]

    # -- pods' policy inputs ---------------------------------------------------------------
    def policy_annotations(self, sandbox_id: str) -> dict[str, str]:
        """The per-pod policy annotations recorded from the sandbox's OCI specs (may be {})."""
        raw = self.meta(POLICY_META + sandbox_id)
        return dict(policy_record(raw, "oci").annotations) if raw else {}

    def policy_records(self) -> tuple[dict[str, PolicyRecord], dict[str, PolicyRecord]]:
        """Every recorded policy input, in two queries: the OCI specs' by sandbox id, and the
        Kubernetes API's by pod uid (what every process plans from: issue 25)."""
        oci = {
            key.removeprefix(POLICY_META): policy_record(raw, "oci")
            for key, raw in self.meta_prefix(POLICY_META)
            if raw
        }
        api = {
            key.removeprefix(API_POLICY_META): policy_record(raw, "api")
            for key, raw in self.meta_prefix(API_POLICY_META)
            if raw
        }
        return oci, api

    # -- one sandbox's records through the indexes (an event's pass: issue 28) ----------------
    def threads_of(self, sandbox_id: str) -> dict[tuple[str, int, int], dict[int, ThreadRec]]:
        """:meth:`all_threads` of one sandbox (the primary key's range)."""
        out: dict[tuple[str, int, int], dict[int, ThreadRec]] = {}
        rows = self.db.execute(
            "SELECT vmm_pid, vmm_start, tid, role, idx, label, layer FROM threads"
            " WHERE sandbox_id=? ORDER BY tid",
            (sandbox_id,),
        )
        for row in rows.fetchall():
            out.setdefault((sandbox_id, row[0], row[1]), {})[row[2]] = ThreadRec(*row[2:])
        return out

    def meta_under(self, prefix: str) -> list[tuple[str, str]]:
        """:meth:`meta_prefix` through the key's index (a range, not a scan): for a prefix
        that names one sandbox."""
        rows = self.db.execute(
            "SELECT key, value FROM meta WHERE key >= ? AND key < ?",
            (prefix, prefix[:-1] + chr(ord(prefix[-1]) + 1)),
        ).fetchall()
        return [(str(r[0]), _intern(str(r[1]))) for r in rows]
