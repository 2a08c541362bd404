"""Hook events: built in the hook, journaled as files, applied to the store exactly once.

Why a journal in front of SQLite: the hook delays every container start, and on this kind of
node ``python3 -c pass`` takes 13 ms while merely importing ``re`` (which pip's console-script
wrapper does), ``json`` and ``sqlite3`` takes 28 ms.  A hook that opened the database could
not stay within 2.5x of a bare interpreter.  So the hook does everything that needs the
*moment* -- read the bundle (it may be gone later), read the pid's start time (the pid may be
reused later), detect the runtime, validate -- and appends the result as one small JSON file
(write, fsync, rename: all or nothing).  Whoever opens the store next (the agent, the CLI, a
Kata hook) applies pending events in order, inside a transaction that also records each
event's name, so an event is applied exactly once even when two processes ingest at once.

For a plain runc container nothing is lost by applying later: at create runc has already
written the spec's cpuset into the container's cgroup, which is exactly vmpin's plan for it,
and a plain container's poststop changes no other container's placement.  A Kata sandbox is
different (its QEMU floats until pinned), so its hooks ingest and reconcile in-process.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time

from vmpin.errors import IdError, SpecError, VmpinError
from vmpin.ids import check_id
from vmpin.oci import Identity, State, identify, read_config
from vmpin.paths import HostPaths

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin._lean)
if TYPE_CHECKING:
    from typing import Any

    from vmpin.store import Store

CREATE_STAGES = ("prestart", "createRuntime", "createContainer")
#: only these run in the host's pid namespace (createContainer sees the container's pid 1)
HOST_PID_STAGES = ("prestart", "createRuntime", "poststart")
JOURNAL = "journal"
VERSION = 1


def container_id_from_bundle(bundle: str) -> str | None:
    """containerd: .../<ns>/<id>; CRI-O: .../overlay-containers/<id>/userdata."""
    if not bundle:
        return None
    path = bundle.rstrip("/")
    base = os.path.basename(path)
    if base == "userdata":
        base = os.path.basename(os.path.dirname(path))
    try:
        return check_id(base)
    except IdError:
        return None


def identity(state: State, annotations: dict[str, str]) -> Identity:
    ident = identify(state.id, annotations)
    if not ident.is_sandbox and ident.sandbox_id == state.id:
        # Kata's poststart/poststop: the id is the sandbox's; the bundle names the container.
        cid = container_id_from_bundle(state.bundle)
        if cid is None or cid == state.id:
            raise SpecError(
                f"state id {state.id!r} is the sandbox id and bundle {state.bundle!r} names no"
                " container: cannot tell which container this is"
            )
        ident = identify(cid, annotations)
    return ident


def detect_runtime(paths: HostPaths, sandbox_id: str, hint_pid: int | None) -> str:
    """Kata when the sandbox has a VM dir or the state pid is its QEMU; plain otherwise."""
    if os.path.isdir(os.path.join(paths.vm_dir, sandbox_id)):
        return "kata"
    if hint_pid:
        from vmpin import vmm

        if vmm.is_vmm_of(paths, hint_pid, sandbox_id):
            return "kata"
    return "runc"


def _start_time(paths: HostPaths, pid: int) -> int | None:
    from vmpin import procfs

    try:
        return procfs.start_time(paths.proc, pid)
    except VmpinError:
        return None


def build(paths: HostPaths, stage: str, state: State) -> dict[str, Any]:
    """Everything about this hook call that must be read now; raises on bad input."""
    host_pid = state.pid if stage in HOST_PID_STAGES else None
    event: dict[str, Any] = {
        "v": VERSION,
        "stage": stage,
        "id": state.id,
        "bundle": state.bundle,
        "annotations": state.annotations,
        "host_pid": host_pid,
        "pid_start": _start_time(paths, host_pid) if host_pid else None,
        "ident": None,
        "cpus": None,
        "mems": None,
        "runtime": None,
    }
    annotations = dict(state.annotations)
    if stage != "poststop":
        if not state.bundle:
            raise SpecError(f"hook {stage}: state has no bundle")
        try:
            config = read_config(state.bundle)
        except SpecError:
            if stage in CREATE_STAGES:
                raise
            config = None  # a later stage of a container recorded at create: not needed
        if config is not None:
            annotations = {**config.annotations, **annotations}
            cpus = config.resources.cpus
            event["cpus"] = None if cpus is None else cpus.to_list()
            event["mems"] = config.resources.mems
            event["has_config"] = True
    try:
        ident = identity(state, annotations)
    except VmpinError:
        if stage in CREATE_STAGES:
            raise
        ident = None  # poststop/poststart: the store may know it by bundle
    if ident is not None:
        event["ident"] = ident._asdict()
        event["runtime"] = detect_runtime(paths, ident.sandbox_id, host_pid)
    return event


# -- the journal -------------------------------------------------------------------------------
def journal_dir(state_dir: str) -> str:
    return os.path.join(state_dir, JOURNAL)


def append(state_dir: str, event: dict[str, Any]) -> str:
    """Write one event file atomically; its name sorts in the order events happened."""
    d = journal_dir(state_dir)
    os.makedirs(d, mode=0o700, exist_ok=True)
    # CLOCK_MONOTONIC is system-wide: names from different hook processes sort by time.
    name = f"{time.monotonic_ns():020d}-{os.getpid()}.json"
    tmp = os.path.join(d, f".{name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, json.dumps(event, separators=(",", ":")).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, os.path.join(d, name))
    return name


def pending(state_dir: str) -> list[str]:
    try:
        return sorted(
            n
            for n in os.listdir(journal_dir(state_dir))
            if n.endswith(".json") and not n.startswith(".")
        )
    except FileNotFoundError:
        return []


# -- applying events ---------------------------------------------------------------------------
def apply(store: Store, ev: dict[str, Any]) -> str | None:
    """Apply one event; the sandbox it touched (None when nothing is left to re-pin)."""
    from vmpin.store import ContainerRec, SandboxRec

    if ev["stage"] == "poststop":
        return _forget(store, ev)
    bundle = ev["bundle"]
    existing = store.container_by_bundle(bundle) if bundle else None
    if existing is None and ev["stage"] in CREATE_STAGES:
        existing = store.container(ev["id"])
    if existing is not None:
        sandbox = store.sandbox(existing.sandbox_id)
        if ev["host_pid"] and existing.pid is None and sandbox and sandbox.runtime == "runc":
            store.put_container(existing._replace(pid=ev["host_pid"], pid_start=ev["pid_start"]))
        return existing.sandbox_id
    if ev["ident"] is None or not ev.get("has_config"):
        raise SpecError(f"hook {ev['stage']} for {ev['id']!r}: container unknown and no spec")
    ident = Identity(**ev["ident"])
    sandbox = store.sandbox(ident.sandbox_id)
    runtime = sandbox.runtime if sandbox else ev["runtime"]
    if sandbox is None:
        # For Kata the state pid may be the VMM: kept as an unverified hint (no start time).
        hint = ev["host_pid"] if runtime == "kata" else None
        store.put_sandbox(
            SandboxRec(
                ident.sandbox_id,
                runtime,
                hint,
                None,
                ident.pod_uid,
                ident.pod_name,
                ident.pod_namespace,
            )
        )
    from vmpin.cpuset import CpuSet

    pid = ev["host_pid"] if runtime == "runc" else None
    store.put_container(
        ContainerRec(
            id=ident.container_id,
            sandbox_id=ident.sandbox_id,
            is_sandbox=ident.is_sandbox,
            name=ident.name,
            pod_uid=ident.pod_uid,
            pod_name=ident.pod_name,
            pod_namespace=ident.pod_namespace,
            cpus=None if ev["cpus"] is None else CpuSet.parse(ev["cpus"]),
            cpus_source="spec",
            mems=ev["mems"],
            bundle=bundle,
            pid=pid,
            pid_start=ev["pid_start"] if pid else None,
        )
    )
    return ident.sandbox_id


def _forget(store: Store, ev: dict[str, Any]) -> str | None:
    """poststop: find the container by bundle (Kata sends the sandbox id), then forget it."""
    rec = store.container_by_bundle(ev["bundle"]) if ev["bundle"] else None
    if rec is None:
        candidate = store.container(ev["id"])
        # By id only when the id is the container's own: a Kata poststop of a non-sandbox
        # container carries the sandbox id, and must not tear the whole sandbox down.
        ann = ev["annotations"]
        ident = identify(ev["id"], ann) if ann else None
        if candidate is not None and (ident is None or ident.is_sandbox == candidate.is_sandbox):
            rec = candidate
    if rec is None:
        return None
    store.delete_container(rec.id)
    return None if rec.is_sandbox else rec.sandbox_id


def ingest(store: Store) -> list[str]:
    """Apply every pending event once, in order; the sandboxes they touched."""
    names = pending(store.state_dir)
    if not names:
        return []
    d = journal_dir(store.state_dir)
    touched: list[str] = []
    with store.transaction() as db:
        done = {r[0] for r in db.execute("SELECT name FROM journal")}
        for name in names:
            if name in done:
                continue
            try:
                with open(os.path.join(d, name), "rb") as f:
                    ev = json.loads(f.read())
            except FileNotFoundError:
                continue  # another process applied and removed it
            except (OSError, ValueError) as err:
                print(f"vmpin: journal {name}: unreadable, skipped: {err}", file=sys.stderr)
                ev = None
            if isinstance(ev, dict) and ev.get("v") == VERSION:
                try:
                    sid = apply(store, ev)
                except VmpinError as err:
                    print(f"vmpin: journal {name}: {err}", file=sys.stderr)
                    sid = None
                if sid and sid not in touched:
                    touched.append(sid)
            db.execute("INSERT OR IGNORE INTO journal VALUES (?)", (name,))
        # names sort by time: a recorded name older than every file still pending was
        # unlinked, and no process can come across it again
        db.execute("DELETE FROM journal WHERE name < ?", (names[0],))
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(d, name))
    return touched
