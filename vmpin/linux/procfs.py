"""Read processes and threads from a procfs root.

``/proc/PID/task/TID`` has the layout of ``/proc/PID``, so every reader takes a ``pid`` and an
optional ``tid`` (python-linux-procfs's observation).  All OSErrors are translated here, once:
ENOENT/ESRCH (the task exited) become :class:`ProcessGone`, which callers treat as the
ordinary event it is; EACCES/EPERM become :class:`PermissionDenied`.

PIDs are reused.  A process is identified by (pid, start time): field 22 of ``stat``, in clock
ticks since boot, which never changes for a process and differs for the next one to get
the same pid.
"""

from __future__ import annotations

import os

from vmpin.core.cpuset import CpuSet
from vmpin.core.errors import HostError, PermissionDenied, ProcessGone

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.lean.records)
if TYPE_CHECKING:
    from collections.abc import Callable


def _task_dir(proc: str, pid: int, tid: int | None = None) -> str:
    # (f-strings: os.path.join was a tenth of an idle pass's procfs time)
    if tid is None or tid == pid:
        return f"{proc}/{pid}"
    return f"{proc}/{pid}/task/{tid}"


def _translate(err: OSError, pid: int, tid: int | None, what: str) -> HostError:
    who = f"pid {pid}" if tid is None or tid == pid else f"tid {tid} of pid {pid}"
    # (OSError's own subclasses, by errno: ENOENT, ESRCH; EACCES and EPERM.  Not the errno
    # module: 0.2 M of the runc hook's 46 M instructions, for four numbers)
    if isinstance(err, (FileNotFoundError, ProcessLookupError)):
        return ProcessGone(f"{who} is gone ({what})")
    if isinstance(err, PermissionError):
        return PermissionDenied(f"{who}: permission denied reading {what}")
    return HostError(f"{who}: {what}: {err.strerror}")


def read_text(proc: str, pid: int, name: str, tid: int | None = None) -> str:
    path = f"{_task_dir(proc, pid, tid)}/{name}"
    try:
        return _read(path).decode(errors="replace")
    except OSError as err:
        raise _translate(err, pid, tid, name) from err


def _read(path: str) -> bytes:
    """The whole file, by ``os.read`` until end of file.

    procfs generates a file on each read; an ``open()`` file object (its buffer, its fstat,
    its context manager) cost half again as much as the kernel's part of reading ``stat``,
    which a read command does once per VMM (issue 14)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        data = os.read(fd, 4096)
        while True:
            more = os.read(fd, 65536)
            if not more:
                return data
            data += more
    finally:
        os.close(fd)


def exists(proc: str, pid: int, tid: int | None = None) -> bool:
    return os.path.exists(_task_dir(proc, pid, tid))


def tids(proc: str, pid: int) -> list[int]:
    """The thread ids of a process, in creation order as far as tids tell."""
    path = f"{proc}/{pid}/task"
    try:
        return sorted([int(t) for t in os.listdir(path) if t.isdigit()])
    except OSError as err:
        raise _translate(err, pid, None, "task/") from err


def pids(proc: str) -> list[int]:
    return sorted(int(p) for p in os.listdir(proc) if p.isdigit())


def comm(proc: str, pid: int, tid: int | None = None) -> str:
    return read_text(proc, pid, "comm", tid).rstrip("\n")


def cmdline(proc: str, pid: int) -> list[str]:
    return split_cmdline(read_text(proc, pid, "cmdline"))


def split_cmdline(raw: str) -> list[str]:
    """The arguments in a ``cmdline`` file's text (NUL-terminated, or not after a rewrite)."""
    return [arg for arg in raw.split("\0")[:-1]] if raw.endswith("\0") else raw.split("\0")


def kernel_release(proc: str) -> tuple[int, int] | None:
    """The running kernel's (major, minor), from ``sys/kernel/osrelease`` under the procfs
    root (what ``uname -r`` prints, ``6.1.0-18-amd64``), so that a fixture tree can stand
    for another kernel; None when unreadable or not of that form."""
    try:
        text = _read(f"{proc}/sys/kernel/osrelease").decode(errors="replace")
        major, minor = text.split(".", 2)[:2]
        digits = ""
        for ch in minor:
            if not ch.isdigit():
                break
            digits += ch
        return int(major), int(digits)
    except (OSError, ValueError):
        return None


def stat_fields(proc: str, pid: int, tid: int | None = None) -> list[str]:
    """``stat`` split into fields, with field 2 (comm, may hold spaces and parens) kept whole."""
    raw = read_text(proc, pid, "stat", tid)
    head, _, tail = raw.rpartition(")")
    pid_part, _, name = head.partition(" (")
    return [pid_part, name, *tail.split()]


def start_time(proc: str, pid: int, tid: int | None = None) -> int:
    """Start time in clock ticks since boot (stat field 22): with the pid, a process's identity."""
    return int(stat_fields(proc, pid, tid)[21])


def ppid(proc: str, pid: int) -> int:
    return int(stat_fields(proc, pid)[3])


def status(proc: str, pid: int, tid: int | None = None) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in read_text(proc, pid, "status", tid).splitlines():
        key, sep, value = line.partition(":")
        if sep:
            out[key] = value.strip()
    return out


def cpus_allowed(proc: str, pid: int, tid: int | None = None) -> CpuSet:
    """The task's affinity as the kernel reports it (``Cpus_allowed_list``)."""
    return CpuSet.parse(status(proc, pid, tid)["Cpus_allowed_list"])


_OWN: dict[str, bool] = {}


def is_own(proc: str) -> bool:
    """True when ``proc`` is this process's own procfs (its ``self`` is our pid): then its
    pids and tids are the ones this process's system calls take."""
    own = _OWN.get(proc)
    if own is None:
        try:
            own = os.readlink(os.path.join(proc, "self")) == str(os.getpid())
        except OSError:
            own = False
        _OWN[proc] = own
    return own


def affinity(proc: str, pid: int, tid: int | None = None) -> CpuSet:
    """The task's affinity: ``sched_getaffinity(2)`` when ``proc`` is our own procfs (0.3 us),
    else ``Cpus_allowed_list`` parsed from ``status`` (24 us: 40 % of an idle pass).

    The syscall takes a bare tid, not (pid, tid): callers pass a tid they just listed in the
    pid's ``task/``, as ``sched_setaffinity`` does when it pins it.  ESRCH = gone
    (:class:`ProcessGone`, as ENOENT is for the file).
    """
    if not is_own(proc):
        return cpus_allowed(proc, pid, tid)
    return _current()(pid if tid is None else tid)


def thread_affinity(proc: str, pid: int) -> Callable[[int], CpuSet]:
    """:func:`affinity` of the threads of ``pid`` by tid, the way to read it chosen once (a
    pass reads every thread of a VMM in a row)."""
    if not is_own(proc):
        return lambda tid: cpus_allowed(proc, pid, tid)
    return _current()


def _current() -> Callable[[int], CpuSet]:
    if not _CURRENT:  # imported on first use (a hook that reads no affinity needs none of it)
        from vmpin.linux.affinity import current

        _CURRENT.append(current)
    return _CURRENT[0]


_CURRENT: list[Callable[[int], CpuSet]] = []


def syscall(proc: str, pid: int, tid: int | None = None) -> list[str]:
    """``syscall``: number and arguments of the call the task is blocked in, or "running"."""
    return read_text(proc, pid, "syscall", tid).split()


def fd_target(proc: str, pid: int, fd: int) -> str | None:
    try:
        return os.readlink(os.path.join(proc, str(pid), "fd", str(fd)))
    except OSError:
        return None


def cgroup_lines(proc: str, pid: int) -> list[tuple[str, str, str]]:
    """``/proc/PID/cgroup`` as (hierarchy id, controllers, path) triples."""
    out = []
    for line in read_text(proc, pid, "cgroup").splitlines():
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        out.append((hid, controllers, path))
    return out
