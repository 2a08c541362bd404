"""KVM's debugfs files: which thread runs vCPU N of a VM, exactly, busy or idle.

``<sys>/kernel/debug/kvm/<vmm pid>-<vm fd>/vcpuN/pid`` holds the thread id of vCPU N once that
vCPU has entered KVM_RUN (0 before; the pid is the global one, as hostPID sees it).  systemd
mounts debugfs on most distributions; where it is not mounted vmpin does NOT mount it on the
host's tree.  :func:`vcpu_pids_private` mounts it in a mount namespace of a short-lived child
of its own instead: the child unshares its mount namespace (propagation private, so nothing
reaches the host's tree), mounts debugfs at ``<sys>/kernel/debug`` there, prints what it
reads and exits; the mount dies with the namespace.  That needs CAP_SYS_ADMIN (a mount
namespace, a mount), not a host mount.

How the child is made, and why:

- ``os.posix_spawn`` of util-linux ``unshare --mount --propagation private`` running ``sh``:
  posix_spawn runs no Python between fork and exec (glibc: clone(CLONE_VFORK) + exec), so it
  is safe in the multi-threaded agent, where a fork+ctypes ``unshare(CLONE_NEWNS)`` child could
  deadlock on a lock another thread held (Python 3.11 has no ``os.unshare`` either);
- not ``subprocess``: it imports selectors, threading, signal and contextlib, which the Kata
  hook that pins in-process must not load (tests/service/test_hook_imports.py); this module
  needs ``select`` (a C module) only, and only when it spawns;
- the shell script forks once (``mount``) and reads the files with builtins; its output is
  ``<pid>-<fd>/vcpuN/pid:<tid>`` lines, parsed here.  Measured cost: bench/bench_debugfs.py
  (docs/benchmarks.md).

The child runs in its own process group and is killed with it (SIGKILL) past ``timeout``;
it is always reaped.  Every failure (no ``unshare`` binary, not permitted, no debugfs in the
kernel, timeout) is a :class:`HostError` with one line saying why: the caller falls back.

Stdlib only; the sysfs root is a parameter.
"""

from __future__ import annotations

import os
import time

from vmpin.core.errors import HostError

#: vm fd -> {vCPU index -> thread id (0: has not run yet)}, for one VMM pid
VcpuPids = dict[int, dict[int, int]]

#: where ``unshare`` (util-linux) is looked for, and the child's PATH (for ``sh``, ``mount``):
#: fixed, so a hook started by the container runtime with a short PATH finds them too
SEARCH_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
CHILD_PATH = SEARCH_PATH
#: output beyond this is not read (a VM has at most a few hundred vCPUs: ~30 bytes each)
MAX_OUTPUT = 1 << 20
#: exit statuses of the script's own failures
_EXIT_MOUNT, _EXIT_NO_KVM = 90, 91
#: ``$1`` = where to mount debugfs, ``$2`` = the VMM pid.  ``read`` and ``echo`` are builtins:
#: one fork (mount) in all.
SCRIPT = (
    'mount -t debugfs debugfs "$1" || exit 90\n'
    'cd "$1/kvm" || exit 91\n'
    'for f in "$2"-*/vcpu*/pid; do\n'
    '  [ -e "$f" ] && read -r v < "$f" && echo "$f:$v"\n'
    "done\n"
    "exit 0\n"
)
_SIGKILL, _SIGPIPE = 9, 13  # (signal imports enum: the numbers, the same on every Linux arch)


def kvm_dir(sys_root: str) -> str:
    """KVM's directory in a debugfs mounted at its usual place under ``sys_root``."""
    return os.path.join(sys_root, "kernel", "debug", "kvm")


def vcpu_pids(sys_root: str, pid: int, vm_fds: list[int], indexes: list[int]) -> VcpuPids:
    """Read the files on a mounted debugfs: ``indexes`` of each of ``vm_fds`` (absent: left out)."""
    out: VcpuPids = {}
    base = kvm_dir(sys_root)
    for vm_fd in vm_fds:
        found: dict[int, int] = {}
        for index in indexes:
            tid = _read_int(os.path.join(base, f"{pid}-{vm_fd}", f"vcpu{index}", "pid"))
            if tid is not None:
                found[index] = tid
        if found:
            out[vm_fd] = found
    return out


def find_binary(name: str, search: str | None = None) -> str | None:
    """The first executable ``name`` in ``search`` (default :data:`SEARCH_PATH`); not
    shutil.which, which imports fnmatch and re."""
    for d in (SEARCH_PATH if search is None else search).split(":"):
        path = f"{d}/{name}"
        if os.access(path, os.X_OK):
            return path
    return None


def vcpu_pids_private(
    sys_root: str, pid: int, timeout: float, *, unshare: str | None = None
) -> VcpuPids:
    """Read every ``<pid>-*/vcpu*/pid`` through a debugfs mounted in a private mount namespace.

    Raises :class:`HostError` (one line: why) when it cannot; never leaves a mount, a child
    or a zombie behind.
    """
    exe = unshare or find_binary("unshare")
    if exe is None:
        raise HostError(f"no unshare binary (util-linux) in {SEARCH_PATH}")
    target = os.path.join(sys_root, "kernel", "debug")
    argv = [exe, "--mount", "--propagation", "private", "--", "sh", "-c", SCRIPT, "sh",
            target, str(pid)]  # fmt: skip
    env = {"PATH": CHILD_PATH, "LC_ALL": "C"}
    r, w = os.pipe()  # (both close-on-exec: only the dup2'ed copies reach the child)
    try:
        child = os.posix_spawn(
            exe,
            argv,
            env,
            file_actions=[
                (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                (os.POSIX_SPAWN_DUP2, w, 1),
                (os.POSIX_SPAWN_DUP2, w, 2),
            ],
            setpgroup=0,  # its own group: a timeout kills mount too
            setsigdef=(_SIGPIPE,),  # Python ignores SIGPIPE; the child should not
        )
    except OSError as err:
        os.close(r)
        raise HostError(f"cannot start {exe}: {err.strerror}") from err
    finally:
        os.close(w)
    try:
        output, complete = _read_all(r, time.monotonic() + timeout)
    finally:
        os.close(r)
    if not complete:
        try:  # noqa: SIM105 (contextlib stays off the hook's path)
            os.killpg(child, _SIGKILL)
        except ProcessLookupError:
            pass  # (exited by itself meanwhile: reaped below)
    status = _reap(child)
    if not complete:
        raise HostError(f"private debugfs read timed out after {timeout:g} s")
    text = output.decode(errors="replace")
    found, other = _parse(text, pid)
    if status not in (0, None):
        code = os.waitstatus_to_exitcode(status)
        why = other[0] if other else f"exit status {code}"
        if code == _EXIT_MOUNT:
            why = f"mount -t debugfs failed: {why}"
        elif code == _EXIT_NO_KVM:
            why = "no kvm directory in debugfs (KVM not loaded?)"
        raise HostError(f"private debugfs: {why}")
    return found


def _read_all(fd: int, deadline: float) -> tuple[bytes, bool]:
    """Everything written to ``fd`` until end of file; (output, False) at the deadline."""
    import select  # (only here: this module is imported by the hook's classification path)

    chunks: list[bytes] = []
    size = 0
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(left * 1000):
            return b"".join(chunks), False
        chunk = os.read(fd, 65536)
        if not chunk:
            return b"".join(chunks), True
        if size < MAX_OUTPUT:
            chunks.append(chunk)
            size += len(chunk)


def _reap(child: int) -> int | None:
    """Wait for our child (it has exited or been killed); its wait status, None if unknown
    (SIGCHLD ignored by the embedding program: the kernel reaped it)."""
    while True:
        try:
            _, status = os.waitpid(child, 0)
            return status
        except InterruptedError:
            continue
        except ChildProcessError:
            return None


def _parse(text: str, pid: int) -> tuple[VcpuPids, list[str]]:
    """``<pid>-<fd>/vcpu<N>/pid:<tid>`` lines -> :data:`VcpuPids`; other lines returned apart."""
    found: VcpuPids = {}
    other: list[str] = []
    prefix = f"{pid}-"
    for line in text.splitlines():
        path, colon, value = line.partition(":")
        parts = path.split("/")
        if (
            colon
            and len(parts) == 3
            and parts[0].startswith(prefix)
            and parts[0][len(prefix) :].isdecimal()
            and parts[1].startswith("vcpu")
            and parts[1][4:].isdecimal()
            and parts[2] == "pid"
            and value.strip().isdecimal()
        ):
            vm_fd = int(parts[0][len(prefix) :])
            found.setdefault(vm_fd, {})[int(parts[1][4:])] = int(value)
        elif line.strip():
            other.append(line.strip())
    return found, other


def _read_int(path: str) -> int | None:
    try:
        with open(path, "rb") as f:
            return int(f.read().strip() or b"0")
    except (OSError, ValueError):
        return None
