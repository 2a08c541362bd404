"""Ids that name their creator, and the sweep of what dead test sessions left behind.

Several engineers run test sessions on this machine at once, so a leftover may never be
recognised by its name alone (a live session's QEMU looks just like a dead one's).  Every id
a test gives to something outside its tmp dir (a QEMU's ``-name sandbox-ID``, a runc
container and so its cgroup, a cgroup directory) comes from :func:`new_id`, which embeds the
creating process's identity, ``p<pid>s<start time>``; :func:`sweep` removes only things whose
creator is gone: no process with that pid and that start time (pid_max is 32768 here and
wraps within minutes, so the pid alone proves nothing).

What is swept: processes whose ``-name sandbox-ID`` carries a dead creator's tag (QEMUs and
fake VMMs: they are daemonised or orphaned and outlive a killed pytest), and cgroup
directories whose name carries one (in every v1 hierarchy and the v2 root, at any depth),
after their remaining tasks (a dead session's container inits) are killed.  Files stay under
pytest's tmp dirs, which pytest itself rotates.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import signal
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from vmpin.linux.paths import ENVVARS, HostPaths

#: ``p<pid>s<start time in clock ticks since boot>``: which process created an id.
TAG_RE = re.compile(r"(?:^|-)p(\d+)s(\d+)-[0-9a-f]{8}")


def vmpin_env(paths: HostPaths) -> dict[str, str]:
    """The environment of a vmpin process that works on ``paths`` (every root, as the
    ``VMPIN_*`` variables say them), with no Kubernetes API and no libvirt domains unless a
    test brings its own (tests/support/kubeserver.py, tests/support/libvirt_util.py): domains
    on this host's libvirtd (another test's, another engineer's) are not this test's."""
    e = dict(os.environ)
    e.update({var: getattr(paths, key) for key, var in ENVVARS.items()})
    e.update(KUBECONFIG=str(Path(paths.state_dir) / "no-kubeconfig"), VMPIN_LIBVIRT="none")
    for key in ("KUBERNETES_SERVICE_HOST", "VMPIN_KUBECONFIG"):
        e.pop(key, None)
    return e


def start_time(pid: int, proc: str = "/proc") -> int | None:
    """Field 22 of /proc/PID/stat (after the parenthesised comm, which may hold spaces)."""
    try:
        with open(f"{proc}/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
    except OSError:
        return None
    return int(raw.rpartition(")")[2].split()[19])


def _own_tag() -> str:
    pid = os.getpid()
    return f"p{pid}s{start_time(pid)}"


def new_id(prefix: str = "vmpin-test") -> str:
    """A fresh id, unique and naming this process: ``PREFIX-p<pid>s<start>-<8 hex>``."""
    return f"{prefix}-{_own_tag()}-{uuid.uuid4().hex[:8]}"


def creator_alive(name: str, proc: str = "/proc") -> bool | None:
    """Whether the process that made ``name`` still runs; None when ``name`` has no tag."""
    m = TAG_RE.search(name)
    if m is None:
        return None
    pid, start = int(m.group(1)), int(m.group(2))
    return start_time(pid, proc) == start


@dataclass
class Swept:
    processes: list[str] = field(default_factory=list)
    cgroups: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.processes or self.cgroups or self.errors)


def _sandbox_name(pid: str, proc: str) -> str | None:
    """The ID of a ``-name sandbox-ID[,opts]`` argument in /proc/PID/cmdline, if any."""
    try:
        with open(f"{proc}/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return None
    for flag, value in itertools.pairwise(argv):
        if flag == b"-name" and value.startswith(b"sandbox-"):
            return value[len(b"sandbox-") :].split(b",", 1)[0].decode(errors="replace")
    return None


def _kill(pid: int, start: int, proc: str) -> None:
    """SIGKILL exactly (pid, start), then wait a little for it to go."""
    if start_time(pid, proc) != start:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while start_time(pid, proc) == start and time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        time.sleep(0.02)


def _sweep_processes(out: Swept, proc: str) -> None:
    for name in os.listdir(proc):
        if not name.isdigit():
            continue
        sid = _sandbox_name(name, proc)
        if sid is None or creator_alive(sid, proc) is not False:
            continue
        start = start_time(int(name), proc)
        if start is not None:
            _kill(int(name), start, proc)
            out.processes.append(f"{name} (sandbox-{sid})")


def _cgroup_roots(cgroup_root: Path) -> list[Path]:
    """Every hierarchy mounted under the cgroup root: each v1 controller (runc makes the
    container's cgroup in all of them) and, on a v2 or hybrid host, the unified root."""
    roots: dict[Path, Path] = {}
    if (cgroup_root / "cgroup.controllers").exists():
        roots[cgroup_root.resolve()] = cgroup_root
    with contextlib.suppress(OSError):
        for d in sorted(cgroup_root.iterdir()):
            if (d / "cgroup.procs").exists():
                roots.setdefault(d.resolve(), d)  # cpu,cpuacct may be one mount, two names
    return list(roots.values())


def _remove_cgroup(d: Path, proc: str, out: Swept) -> None:
    """Kill the tasks left in ``d`` (and below), then remove the directories bottom-up."""
    for sub in sorted((p for p in d.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        _remove_one(sub, proc, out)
    _remove_one(d, proc, out)


def _remove_one(d: Path, proc: str, out: Swept) -> None:
    procs_file = d / "cgroup.procs"
    try:
        pids = [int(p) for p in procs_file.read_text().split()]
    except (OSError, ValueError):
        pids = []
    for pid in pids:
        start = start_time(pid, proc)
        if start is not None:
            _kill(pid, start, proc)
    for _ in range(50):  # a killed task leaves the cgroup a moment after it is gone
        try:
            d.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.02)
    out.errors.append(f"cannot remove cgroup {d}")


def _sweep_cgroups(out: Swept, proc: str, cgroup_root: Path) -> None:
    for root in _cgroup_roots(cgroup_root):
        for dirpath, dirnames, _ in os.walk(root):
            keep = []
            for name in dirnames:
                if creator_alive(name, proc) is False:
                    _remove_cgroup(Path(dirpath) / name, proc, out)
                    out.cgroups.append(str(Path(dirpath) / name))
                else:
                    keep.append(name)
            dirnames[:] = keep


def sweep(proc: str = "/proc", cgroup_root: Path = Path("/sys/fs/cgroup")) -> Swept:
    """Remove what dead sessions left: their sandbox processes, then their cgroups."""
    out = Swept()
    if os.geteuid() != 0:
        return out
    _sweep_processes(out, proc)
    _sweep_cgroups(out, proc, cgroup_root)
    return out
