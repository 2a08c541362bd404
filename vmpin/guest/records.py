"""What the hook pinned, kept for the follower: one small JSON file per container.

The hook pins a container once, when it starts; the host may change the container's CPUs
later and republish the map, and only a record of where the pin landed (that cgroup, or
that process tree) lets ``vmpin guest follow`` re-pin it there.  A record names its process
by pid *and* start time, so a pid the kernel handed to another process is never pinned by
mistake; it is written atomically (the follower may read while the hook writes) and read
strictly (a file that is not a record is forgotten, never acted on).  The state dir is
guest-side runtime state: the host never reads it, and it goes with the VM.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import NamedTuple

from vmpin.core.errors import HostError
from vmpin.guest.cgroups import Cgroup
from vmpin.guest.common import GuestError, errno_text, format_cpus, parse_cpus, read_text
from vmpin.linux import procfs
from vmpin.wire.guestmap import Entry

#: the records' own format version (guest-side only: the host never reads them).
RECORD_VERSION = 1


def start_time(proc: str, pid: int) -> int | None:
    """Field 22 of ``/proc/PID/stat`` (clock ticks after boot), None when the pid is gone.

    A pid alone names a process only while it lives: once it exits the kernel may hand the
    number to another process.  Pid and start time together name one process for as long as
    the system runs, so a record never leads to pinning a stranger that reused the pid.
    """
    try:
        return procfs.start_time(proc, pid)
    except (HostError, IndexError, ValueError):
        return None


class Record(NamedTuple):
    """One container the guest side pinned (or is waiting to pin), as kept in the state dir.

    ``method`` None means nothing was applied yet (the hook found no entry, or pinning
    failed): the follower pins it the way the hook would once the map names it.  ``failed``
    is the (generation, vCPUs) whose pin failed last, so that a loop pass does not retry and
    re-report the same failure every few seconds (a full pass still retries).
    """

    container: str
    pid: int
    start_time: int
    method: str | None
    cgroup: Cgroup | None
    guest_cpus: frozenset[int] | None
    generation: int | None
    failed: tuple[int, frozenset[int]] | None = None
    by: str = ""

    def applied(self, entry: Entry) -> bool:
        """Whether ``entry`` is what this record says was applied (inequality, not "newer":
        the host's generation restarts at 1 when its map file is recreated)."""
        return (
            self.method is not None
            and self.generation == entry.generation
            and self.guest_cpus == entry.guest_cpus
        )


def record_path(state_dir: str, container_id: str) -> str:
    """``<state_dir>/<id>.json``; the id must be one plain path component.

    The id comes from the OCI state, i.e. from whoever created the container: it must not
    name a file elsewhere, nor one of the hidden temporary files (``.*``).
    """
    if (
        not container_id
        or len(container_id) > 200
        or container_id.startswith(".")
        or "/" in container_id
        or "\0" in container_id
    ):
        raise GuestError(f"container id {container_id!r} cannot name a record file")
    return os.path.join(state_dir, container_id + ".json")


def record_doc(rec: Record) -> dict[str, object]:
    """The record as JSON: a flat object, ids and CPU lists as in the published map."""
    cg = rec.cgroup
    return {
        "version": RECORD_VERSION,
        "container": rec.container,
        "pid": rec.pid,
        "start_time": rec.start_time,
        "method": rec.method,
        "cgroup": cg.path if cg is not None else None,
        "cgroup_version": cg.version if cg is not None else None,
        "cgroup_root": cg.root if cg is not None else None,
        "guest_cpus": format_cpus(rec.guest_cpus) if rec.guest_cpus is not None else None,
        "generation": rec.generation,
        "failed": (
            {"generation": rec.failed[0], "guest_cpus": format_cpus(rec.failed[1])}
            if rec.failed is not None
            else None
        ),
        "by": rec.by,
    }


def write_record(state_dir: str, rec: Record) -> str:
    """Write the record atomically (a temporary file renamed over it); its path.

    A reader (the follower, while the hook writes) sees the old record or the new one.  No
    fsync: the state dir is on tmpfs in a guest, and a record describes processes that do
    not outlive the VM anyway; the hook is on the container's start path and stays cheap.
    """
    path = record_path(state_dir, rec.container)
    data = json.dumps(record_doc(rec), sort_keys=True).encode() + b"\n"
    try:
        os.makedirs(state_dir, mode=0o700, exist_ok=True)
        tmp = os.path.join(
            state_dir, f".{rec.container}.json.{os.getpid()}.{os.urandom(4).hex()}.tmp"
        )
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError as err:
        raise GuestError(f"cannot write {path}: {errno_text(err)}") from None
    return path


def _opt_int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def read_record(path: str) -> Record:
    """Parse one record file, strictly: anything unexpected is a GuestError (and the
    follower then forgets the file rather than act on a guess)."""
    try:
        raw = json.loads(read_text(path))
    except OSError as err:
        raise GuestError(f"cannot read record {path}: {errno_text(err)}") from None
    except ValueError as err:
        raise GuestError(f"record {path} is not JSON: {err}") from None
    except RecursionError:
        raise GuestError(f"record {path} is JSON nested too deeply") from None
    if not isinstance(raw, dict) or raw.get("version") != RECORD_VERSION:
        raise GuestError(f"record {path} is not a version {RECORD_VERSION} record")
    cid, pid, born = raw.get("container"), _opt_int(raw.get("pid")), _opt_int(raw.get("start_time"))
    if not isinstance(cid, str) or os.path.basename(path) != f"{cid}.json":
        raise GuestError(f"record {path} names another container ({cid!r})")
    if pid is None or pid <= 0 or born is None:
        raise GuestError(f"record {path} has no pid and start time")
    method = raw.get("method")
    if method not in ("cgroup", "affinity", None):
        raise GuestError(f"record {path}: unknown method {method!r}")
    cg = None
    if method == "cgroup":
        where, root, version = raw.get("cgroup"), raw.get("cgroup_root"), raw.get("cgroup_version")
        if not (isinstance(where, str) and isinstance(root, str) and version in (1, 2)):
            raise GuestError(f"record {path}: method cgroup without its cgroup")
        rel = "/" + os.path.relpath(where, root).lstrip("/")
        if rel.startswith("/.."):
            raise GuestError(f"record {path}: cgroup {where} is not below {root}")
        cg = Cgroup(1 if version == 1 else 2, where, rel, root)
    cpus_text = raw.get("guest_cpus")
    cpus = parse_cpus(cpus_text) if isinstance(cpus_text, str) else None
    if method is not None and cpus is None:
        raise GuestError(f"record {path}: applied, but no guest_cpus")
    failed_raw = raw.get("failed")
    failed = None
    if isinstance(failed_raw, dict) and isinstance(failed_raw.get("guest_cpus"), str):
        gen = _opt_int(failed_raw.get("generation"))
        if gen is not None:
            failed = (gen, parse_cpus(failed_raw["guest_cpus"]))
    by = raw.get("by")
    return Record(
        cid,
        pid,
        born,
        method if isinstance(method, str) else None,
        cg,
        cpus,
        _opt_int(raw.get("generation")),
        failed,
        by if isinstance(by, str) else "",
    )


def list_records(state_dir: str) -> list[str]:
    """Paths of every record (``*.json``, not the hidden temporaries); [] without a dir."""
    try:
        names = os.listdir(state_dir)
    except FileNotFoundError:
        return []
    except OSError as err:
        raise GuestError(f"cannot list {state_dir}: {errno_text(err)}") from None
    return sorted(
        os.path.join(state_dir, n) for n in names if n.endswith(".json") and not n.startswith(".")
    )


def forget(path: str) -> bool:
    """Remove a record file; False when it was gone already."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def remove_stale_temps(state_dir: str, older_than: float) -> None:
    """Remove temporary files a writer left when it died between create and rename.

    ``older_than`` (seconds) is far longer than a live writer keeps one: it writes a few
    hundred bytes and renames.
    """
    try:
        names = [n for n in os.listdir(state_dir) if n.startswith(".") and n.endswith(".tmp")]
    except OSError:
        return
    now = time.time()
    for n in names:
        path = os.path.join(state_dir, n)
        with contextlib.suppress(OSError):
            if now - os.stat(path).st_mtime > older_than:
                os.unlink(path)
