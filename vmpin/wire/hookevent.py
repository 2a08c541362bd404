"""The hook event: what one ``vmpin hook STAGE`` call learned, as the journal keeps it.

The hook (:mod:`vmpin.service.hook`) has :mod:`vmpin.runtimes.oci` read the moment's facts
(the OCI state, the bundle's config.json, the pid's start time, the runtime) into a
:class:`HookEvent`; the journal (:mod:`vmpin.state.journal`) writes it as one file with
:meth:`HookEvent.to_json` and reads it back with :func:`from_json`, and the store applies it.
A journal file is a file: anyone with access to the state dir may have put it there, so
:func:`from_obj` checks every field again, and what fails is quarantined, never applied.

Format ``1``, one JSON object (files written since the journal exists read the same)::

    {"v": 1, "stage": STAGE, "id": ID, "bundle": PATH, "annotations": {K: V},
     "host_pid": PID|null, "pid_start": TICKS|null,
     "ident": {"container_id": ID, "sandbox_id": ID, "is_sandbox": BOOL, "pod_uid": TEXT|null,
               "pod_name": TEXT|null, "pod_namespace": TEXT|null, "name": TEXT|null}|null,
     "cpus": LIST|null, "mems": LIST|null, "runtime": "kata"|"runc"|null
     [, "has_config": true] [, "cpu_limit": N]}

``annotations`` are the OCI state's (the spec's went into ``ident``); ``host_pid`` only at the
stages that run in the host's pid namespace; ``has_config`` says the bundle's config.json was
read (only such an event may record a container the store does not know); ``runtime`` is
set whenever ``ident`` is; ``cpu_limit`` is the spec's CPU limit in whole CPUs.  Readers
ignore keys they do not know.

Lean (the hook writes it): stdlib and vmpin.core only, no ``typing`` at run time.
"""

from __future__ import annotations

from vmpin.core.cpuset import CpuSet
from vmpin.core.errors import CpuSetError, SpecError
from vmpin.core.ids import check_id
from vmpin.wire.jsonio import dumps, loads

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.lean.records)
if TYPE_CHECKING:
    from typing import Any, NamedTuple
else:
    from vmpin.lean.records import NamedTuple

#: the journal file's format version (its ``v``)
VERSION = 1
#: the OCI hook stages (runtime-spec config.md, "POSIX-platform Hooks")
STAGES = ("prestart", "createRuntime", "createContainer", "startContainer", "poststart", "poststop")
#: the largest event file written or applied (a Kata event with every annotation: ~20 KiB).
MAX_EVENT = 256 << 10
#: Linux's PID_MAX_LIMIT (include/linux/threads.h: 4 * 1024 * 1024 on 64-bit): no pid is larger.
PID_MAX = 4 * 1024 * 1024
#: the largest int SQLite stores (a start time in clock ticks is far below it).
INT64 = (1 << 63) - 1
#: the largest CPU limit kept, in whole CPUs
MAX_CPU_LIMIT = 1 << 32
RUNTIMES = ("kata", "runc")


class Identity(NamedTuple):
    """Who a container is, folded from any runtime's annotations (vmpin.runtimes.oci)."""

    container_id: str
    sandbox_id: str
    is_sandbox: bool
    pod_uid: str | None = None
    pod_name: str | None = None
    pod_namespace: str | None = None
    name: str | None = None


class HookEvent(NamedTuple):
    """One hook call's facts (the module docstring has the fields' meaning)."""

    stage: str
    id: str
    #: the OCI state's bundle ("" when it named none; None only in a file not a hook wrote)
    bundle: str | None
    annotations: dict[str, str]
    host_pid: int | None = None
    pid_start: int | None = None
    ident: Identity | None = None
    cpus: CpuSet | None = None
    mems: str | None = None
    runtime: str | None = None
    has_config: bool = False
    cpu_limit: int | None = None

    def to_json(self) -> bytes:
        """The journal file's bytes; SpecError when they could not be stored (text that is
        not UTF-8, over :data:`MAX_EVENT`)."""
        ident = self.ident
        obj: dict[str, Any] = {
            "v": VERSION,
            "stage": self.stage,
            "id": self.id,
            "bundle": self.bundle,
            "annotations": self.annotations,
            "host_pid": self.host_pid,
            "pid_start": self.pid_start,
            "ident": None if ident is None else ident._asdict(),
            "cpus": None if self.cpus is None else self.cpus.to_list(),
            "mems": self.mems,
            "runtime": self.runtime,
        }
        if self.has_config:
            obj["has_config"] = True
        if self.cpu_limit is not None:  # (only then: an event without a limit is as it was)
            obj["cpu_limit"] = self.cpu_limit
        try:
            data = dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        except (UnicodeEncodeError, ValueError, TypeError) as err:
            raise SpecError(f"hook event for {self.id!r} cannot be stored: {err}") from None
        if len(data) > MAX_EVENT:
            raise SpecError(f"hook event for {self.id!r}: {len(data)} bytes, over {MAX_EVENT}")
        return data


def from_json(data: bytes | str, where: str = "hook event") -> HookEvent:
    """A journal file's event, checked (:func:`from_obj`); SpecError naming ``where``."""
    if len(data) > MAX_EVENT:
        raise SpecError(f"{where}: {len(data)} bytes, over {MAX_EVENT}")
    try:
        obj = loads(data)
    except RecursionError:
        raise SpecError(f"{where}: JSON nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise SpecError(f"{where}: malformed JSON: {err}") from None
    return from_obj(obj)


def _opt(ev: dict[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    value = ev.get(key)
    if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
        raise SpecError(f"field {key!r}: {value!r} is not a {kind}")
    return value


def _identity(ident: Any) -> Identity | None:
    if ident is None:
        return None
    if not isinstance(ident, dict) or set(ident) != set(Identity._fields):
        raise SpecError(f"field 'ident': {ident!r}")
    check_id(ident["container_id"], "ident container id")
    check_id(ident["sandbox_id"], "ident sandbox id")
    if not isinstance(ident["is_sandbox"], bool):
        raise SpecError("field 'ident.is_sandbox': not a boolean")
    for key in ("pod_uid", "pod_name", "pod_namespace", "name"):
        if ident[key] is not None and not isinstance(ident[key], str):
            raise SpecError(f"field 'ident.{key}': not a string")
    return Identity(**ident)


def from_obj(ev: Any) -> HookEvent:
    """The event in a parsed journal file, checked field by field: everything the hook
    guarantees is checked again (the file may not come from a hook).  SpecError (IdError for
    an id) names the first field that is wrong."""
    if not isinstance(ev, dict):
        raise SpecError(f"not an event object: {type(ev).__name__}")
    if ev.get("v") != VERSION:
        raise SpecError(f"event version {ev.get('v')!r}, expected {VERSION}")
    missing = [k for k in HookEvent._fields[:10] if k not in ev]
    if missing:
        raise SpecError(f"field {missing[0]!r} missing")
    if ev["stage"] not in STAGES:
        raise SpecError(f"unknown stage {ev['stage']!r}")
    check_id(ev["id"], "field 'id'")
    for key in ("bundle", "mems", "runtime"):
        _opt(ev, key, str)
    if ev["runtime"] not in (None, *RUNTIMES):
        raise SpecError(f"field 'runtime': {ev['runtime']!r}")
    text = _opt(ev, "cpus", str)
    try:
        cpus = None if text is None else CpuSet.parse(text)
    except CpuSetError as err:
        raise SpecError(f"field 'cpus': {err}") from None
    pid = _opt(ev, "host_pid", int)
    if pid is not None and not 0 < pid <= PID_MAX:
        raise SpecError(f"field 'host_pid': {pid!r} is not a process id")
    start = _opt(ev, "pid_start", int)
    limit = _opt(ev, "cpu_limit", int)
    if limit is not None and not 0 < limit <= MAX_CPU_LIMIT:
        raise SpecError(f"field 'cpu_limit': {limit!r} out of range")
    if start is not None and not 0 <= start <= INT64:
        raise SpecError(f"field 'pid_start': {start!r} out of range")
    ann = ev["annotations"]
    if not isinstance(ann, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in ann.items()
    ):
        raise SpecError("field 'annotations': not a map of strings")
    ident = _identity(ev["ident"])
    if ident is not None and ev["runtime"] is None:
        raise SpecError("field 'runtime': missing for a container the event names")
    event = HookEvent(
        ev["stage"], ev["id"], ev["bundle"], ann, pid, start, ident, cpus, ev["mems"],
        ev["runtime"], bool(ev.get("has_config")), limit,
    )  # fmt: skip
    event.to_json()  # every text encodes as UTF-8, the whole fits the limit
    return event
