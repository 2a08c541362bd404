"""Hook events: built in the hook, journaled as files, applied to the store exactly once.

Why a journal in front of SQLite: the hook delays every container start, and on this kind of
node importing ``sqlite3`` alone costs a third of a bare interpreter's start, and opening
the database, with its durable commits, more (the hook's budget is 1.5x a bare interpreter;
it reads and writes JSON through :mod:`vmpin.wire.jsonio`, without ``json`` and ``re``).  So
the hook does everything that needs the
*moment* -- read the bundle (it may be gone later), read the pid's start time (the pid may be
reused later), detect the runtime, validate -- and appends the result as one small JSON file
(every write checked, fsync, rename, fsync the directory: all or nothing).  Whoever opens the
store next (the agent, the CLI, a Kata hook without an agent) applies pending events in order
(:meth:`vmpin.state.store.Store.ingest`), inside a
transaction that also records each event's name, so an event is applied exactly once even
when two processes ingest at once. This module owns the event's format and the journal's
files; it never imports the store.

For a plain runc container nothing is lost by applying later: at create runc has already
written the spec's cpuset into the container's cgroup, which is exactly vmpin's plan for it,
and a plain container's poststop changes no other container's placement.  A Kata sandbox is
different (its QEMU floats until pinned): its hooks wait for the agent's pass (which ingests),
or ingest and reconcile in-process when no agent answers.

Hostile input stops here, not in the store: :func:`build` refuses what could not be stored
(a pid beyond ``PID_MAX``, text that is not valid UTF-8, oversized documents: see
vmpin.runtimes.oci), :func:`check_event` re-checks every file at ingest (a journal file is a
file: anyone with access to the state dir may have put it there), and what still cannot be
applied is quarantined under ``journal/bad/`` by the store, never retried and never fatal.

The backlog stays small without an agent: a plain container's hook that finds more than
:data:`INGEST_THRESHOLD` pending events applies a batch itself (within
:data:`INGEST_BUDGET` seconds), so the journal holds at most about that many events plus
what concurrent hooks are writing; the agent, the CLI and Kata hooks apply it too.
"""

from __future__ import annotations

import os
import time

from vmpin.core.errors import IdError, SpecError, StateError, VmpinError
from vmpin.core.ids import check_id
from vmpin.linux.files import fsync_path, load_json, read_bytes, stale_stamp
from vmpin.linux.paths import HostPaths
from vmpin.runtimes.oci import PID_MAX, STAGES, Identity, State, identify, read_config
from vmpin.wire.jsonio import dumps

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.core._lean)
if TYPE_CHECKING:
    from typing import Any


CREATE_STAGES = ("prestart", "createRuntime", "createContainer")
#: only these run in the host's pid namespace (createContainer sees the container's pid 1)
HOST_PID_STAGES = ("prestart", "createRuntime", "poststart")
JOURNAL = "journal"
BAD = "bad"
VERSION = 1
#: the largest event file written or applied (a Kata event with every annotation: ~20 KiB).
MAX_EVENT = 256 << 10
#: a plain hook applies the journal itself past this many pending events (see the docstring).
INGEST_THRESHOLD = 256
#: seconds a hook may spend applying the journal (containerd's default hook timeout is far
#: longer, Kata's shipped one 10 s: a hook must never be the reason a start times out).
INGEST_BUDGET = 2.0
#: a ``.tmp`` file older than this was left by a killed hook (a live one writes in ~1 ms and
#: no hook outlives its runtime's timeout); the next ingest removes it.
TMP_MAX_AGE = 60.0
#: the largest int SQLite stores (a start time in clock ticks is far below it).
_INT64 = (1 << 63) - 1


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
            limit = config.resources.whole_cpus
            if limit is not None:  # (only then: an event without a limit is as it was)
                event["cpu_limit"] = limit
    elif state.bundle:
        # what a container gives up when it goes (its spec's CPUs, when its bundle is still
        # there): whether a VM may have them to itself now (vmpin.state.summary)
        try:
            cpus = read_config(state.bundle).resources.cpus
        except SpecError:
            cpus = None
        event["cpus"] = None if cpus is None else cpus.to_list()
    try:
        ident = identity(state, annotations)
    except VmpinError:
        if stage in CREATE_STAGES:
            raise
        ident = None  # poststop/poststart: the store may know it by bundle
    if ident is not None:
        event["ident"] = ident._asdict()
        event["runtime"] = detect_runtime(paths, ident.sandbox_id, host_pid)
    encode(event)  # refuse now what could not be written or applied later
    return event


def encode(event: dict[str, Any]) -> bytes:
    """The event as journal bytes; SpecError when it is not storable (bad text, too big)."""
    try:
        data = dumps(event, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    except (UnicodeEncodeError, ValueError, TypeError) as err:
        raise SpecError(f"hook event for {event.get('id')!r} cannot be stored: {err}") from None
    if len(data) > MAX_EVENT:
        raise SpecError(f"hook event for {event.get('id')!r}: {len(data)} bytes, over {MAX_EVENT}")
    return data


def _opt(ev: dict[str, Any], key: str, kind: type | tuple[type, ...]) -> None:
    value = ev.get(key)
    if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
        raise SpecError(f"field {key!r}: {value!r} is not a {kind}")


def check_event(ev: Any) -> dict[str, Any]:
    """A journal file's event, checked field by field before the store applies it.

    Everything :func:`build` guarantees is checked again (the file may not come from a hook):
    SpecError names the first field that is wrong.
    """
    if not isinstance(ev, dict):
        raise SpecError(f"not an event object: {type(ev).__name__}")
    if ev.get("v") != VERSION:
        raise SpecError(f"event version {ev.get('v')!r}, expected {VERSION}")
    if ev.get("stage") not in STAGES:
        raise SpecError(f"unknown stage {ev.get('stage')!r}")
    check_id(ev.get("id"), "field 'id'")  # type: ignore[arg-type]
    for key in ("bundle", "mems", "runtime"):
        _opt(ev, key, str)
    if ev.get("runtime") not in (None, "kata", "runc"):
        raise SpecError(f"field 'runtime': {ev.get('runtime')!r}")
    _opt(ev, "cpus", str)
    if ev.get("cpus") is not None:
        from vmpin.core.cpuset import CpuSet
        from vmpin.core.errors import CpuSetError

        try:
            CpuSet.parse(ev["cpus"])
        except CpuSetError as err:
            raise SpecError(f"field 'cpus': {err}") from None
    pid = ev.get("host_pid")
    _opt(ev, "host_pid", int)
    if pid is not None and not 0 < pid <= PID_MAX:
        raise SpecError(f"field 'host_pid': {pid!r} is not a process id")
    _opt(ev, "pid_start", int)
    _opt(ev, "cpu_limit", int)
    if ev.get("cpu_limit") is not None and not 0 < ev["cpu_limit"] <= 1 << 32:
        raise SpecError(f"field 'cpu_limit': {ev['cpu_limit']!r} out of range")
    if ev.get("pid_start") is not None and not 0 <= ev["pid_start"] <= _INT64:
        raise SpecError(f"field 'pid_start': {ev['pid_start']!r} out of range")
    ann = ev.get("annotations")
    if not isinstance(ann, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in ann.items()
    ):
        raise SpecError("field 'annotations': not a map of strings")
    ident = ev.get("ident")
    if ident is not None:
        if not isinstance(ident, dict) or set(ident) != set(Identity._fields):
            raise SpecError(f"field 'ident': {ident!r}")
        check_id(ident["container_id"], "ident container id")
        check_id(ident["sandbox_id"], "ident sandbox id")
        if not isinstance(ident["is_sandbox"], bool):
            raise SpecError("field 'ident.is_sandbox': not a boolean")
        for key in ("pod_uid", "pod_name", "pod_namespace", "name"):
            if ident[key] is not None and not isinstance(ident[key], str):
                raise SpecError(f"field 'ident.{key}': not a string")
    encode(ev)  # every text encodes as UTF-8, the whole fits the limit
    return ev


# -- the journal -------------------------------------------------------------------------------
def journal_dir(state_dir: str) -> str:
    return os.path.join(state_dir, JOURNAL)


def append(state_dir: str, event: dict[str, Any], *, durable: bool = True) -> str:
    """Write one event file, complete or not at all; its name sorts in the order events happened.

    Every write is checked (a nearly full filesystem gives short writes), the file is fsynced
    before the rename publishes it, and the directory after, so an event the hook reported
    as recorded survives a crash.  Any failure removes the temporary file and raises
    StateError naming the file (the hook prints it; ``--strict`` fails the start).

    ``durable=False`` renames the whole file into place without either sync: the caller must
    :func:`sync` it before it reports the event recorded (a Kata hook: while the agent's
    pass runs, or after its own when no agent answers; a disk's two syncs are ~0.5 ms of
    every start, issue 14).  Readers never see a partial file (the rename comes
    after the writes); a crash before the sync may lose the event, or leave its file empty
    or cut short, which ingest quarantines and never applies.  Nothing was promised then:
    the hook had not returned.
    """
    data = encode(event)
    d = journal_dir(state_dir)
    # CLOCK_MONOTONIC is system-wide: names from different hook processes sort by time.
    name = f"{time.monotonic_ns():020d}-{os.getpid()}.json"
    tmp = os.path.join(d, f".{name}.tmp")
    try:
        os.makedirs(d, mode=0o700, exist_ok=True)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tmp, flags, 0o600)
    except OSError as err:
        raise StateError(f"{tmp}: cannot journal the event: {err.strerror}") from None
    try:
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                if written <= 0:  # (POSIX: a full disk gives ENOSPC, but never loop forever)
                    raise OSError(28, os.strerror(28))
                view = view[written:]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, os.path.join(d, name))
        if durable:
            fsync_path(d)  # the rename itself survives a crash
    except BaseException as err:
        # whatever failed (ENOSPC, EIO, anything), no temp file is left in the state dir
        try:  # noqa: SIM105 (contextlib would cost every hook its import)
            os.unlink(tmp)
        except OSError:
            pass
        if not isinstance(err, OSError):
            raise
        # (the hint only where it is the cause: ENOSPC, EDQUOT, EROFS)
        hint = (
            " (the state dir's filesystem is full or read-only)"
            if err.errno in (28, 122, 30)
            else ""
        )
        raise StateError(
            f"{os.path.join(d, name)}: event not recorded: {err.strerror}{hint}"
        ) from None
    return name


def sync(state_dir: str, name: str) -> None:
    """Make the event ``name``, appended with ``durable=False``, survive a crash: fsync its
    file, then the journal directory (its rename); StateError naming what failed.

    A file already gone was applied and settled (its event is in the database file, which a
    checkpoint synced before the file was removed): nothing of it is left to sync.
    """
    d = journal_dir(state_dir)
    path = os.path.join(d, name)
    try:
        try:  # noqa: SIM105 (contextlib would cost every hook its import)
            fsync_path(path)
        except FileNotFoundError:
            pass
        path = d
        fsync_path(d)
    except OSError as err:
        raise StateError(f"{path}: event not recorded durably: {err.strerror}") from None


def sweep_tmp(state_dir: str, now_ns: int | None = None) -> int:
    """Remove temporary files of hooks killed mid-write; how many.

    Their age is read from their names: :func:`append` names a temp file after the
    ``CLOCK_MONOTONIC`` time it was made, a clock no one sets.  The file's mtime is wall-clock
    time, and a clock stepped forward made a live hook's file look a minute old: another
    process swept it mid-write and the hook blamed a full or read-only disk (issue 26).  A
    stamp ahead of the clock is from an earlier boot (a state dir on a disk).
    """
    d = journal_dir(state_dir)
    removed = 0
    try:
        names = [n for n in os.listdir(d) if n.startswith(".") and n.endswith(".tmp")]
    except OSError:
        return 0
    # The clock is read after the listing: a file listed was made, and its stamp taken,
    # before it.  Read before, a hook that named its file in between had a stamp "ahead of
    # the clock", taken for an earlier boot's, and its live file was swept from under it
    # ("event not recorded: No such file or directory"; seen with 50 hooks at once, issue 30).
    now_ns = time.monotonic_ns() if now_ns is None else now_ns
    for n in names:
        # None: not a name append() makes, not ours to remove; False: maybe a live hook's
        if not stale_stamp(n[1:].split("-", 1)[0], TMP_MAX_AGE, now_ns):
            continue
        try:
            os.unlink(os.path.join(d, n))
            removed += 1
        except OSError:
            pass  # gone meanwhile
    return removed


def bad_dir(state_dir: str) -> str:
    return os.path.join(journal_dir(state_dir), BAD)


def quarantined(state_dir: str) -> int:
    """How many journal entries were moved aside as unusable (``journal/bad/*.json``)."""
    try:
        return sum(1 for n in os.listdir(bad_dir(state_dir)) if n.endswith(".json"))
    except OSError:
        return 0


def read_event(state_dir: str, name: str) -> dict[str, Any]:
    """The event in the journal file ``name``, checked (:func:`check_event`).

    FileNotFoundError when another process applied and removed it; OSError or VmpinError
    (naming the entry) when it cannot be read or is not a valid event."""
    raw = read_bytes(os.path.join(journal_dir(state_dir), name), limit=MAX_EVENT,
                     what="journal entry")  # fmt: skip
    return check_event(load_json(raw, f"journal entry {name}"))


def backlog(state_dir: str) -> int:
    """How many events are pending (cheap: one listdir, no sort)."""
    try:
        names = os.listdir(journal_dir(state_dir))
    except OSError:
        return 0
    return sum(1 for n in names if n.endswith(".json") and not n.startswith("."))


def pending(state_dir: str) -> list[str]:
    """The pending events' file names, oldest first; a journal dir that cannot be listed
    (EMFILE, ENOMEM, EIO) is a StateError naming it: every ingest starts here, and an OSError
    from it ended the agent's main loop (issue 26)."""
    d = journal_dir(state_dir)
    try:
        names = os.listdir(d)
    except FileNotFoundError:
        return []
    except OSError as err:
        raise StateError(f"{d}: cannot list the journal: {err.strerror}") from err
    return sorted(n for n in names if n.endswith(".json") and not n.startswith("."))
