"""Hook events: built in the hook, journaled as files, applied to the store exactly once.

Why a journal in front of SQLite: the hook delays every container start, and on this kind of
node ``python3 -c pass`` takes 13 ms while merely importing ``re`` (which pip's console-script
wrapper does), ``json`` and ``sqlite3`` takes 28 ms.  A hook that opened the database could
not stay within 2.5x of a bare interpreter.  So the hook does everything that needs the
*moment* -- read the bundle (it may be gone later), read the pid's start time (the pid may be
reused later), detect the runtime, validate -- and appends the result as one small JSON file
(write, fsync, rename: all or nothing).  Whoever opens the store next (the agent, the CLI, a
Kata hook) applies pending events in order (:meth:`vmpin.state.store.Store.ingest`), inside a
transaction that also records each event's name, so an event is applied exactly once even
when two processes ingest at once. This module owns the event's format and the journal's
files; it never imports the store.

For a plain runc container nothing is lost by applying later: at create runc has already
written the spec's cpuset into the container's cgroup, which is exactly vmpin's plan for it,
and a plain container's poststop changes no other container's placement.  A Kata sandbox is
different (its QEMU floats until pinned), so its hooks ingest and reconcile in-process.
"""

from __future__ import annotations

import contextlib
import json
import os
import time

from vmpin.core.errors import IdError, SpecError, VmpinError
from vmpin.core.ids import check_id
from vmpin.linux.paths import HostPaths
from vmpin.runtimes.oci import Identity, State, identify, read_config

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.core._lean)
if TYPE_CHECKING:
    from typing import Any


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
        from vmpin.runtimes import vmm

        if vmm.is_vmm_of(paths, hint_pid, sandbox_id):
            return "kata"
    return "runc"


def _start_time(paths: HostPaths, pid: int) -> int | None:
    from vmpin.linux import procfs

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
    except BaseException:
        # a failed write (ENOSPC, EIO, anything) leaves no temp file behind in the state dir
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
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
