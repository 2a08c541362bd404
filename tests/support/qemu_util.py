"""Real QEMU processes started the way Kata starts them, for integration tests (not a conftest).

``start_qemu(vm_dir, sandbox_id, ...)`` runs::

    qemu-system-x86_64 -name sandbox-ID[,debug-threads=on] -machine q35,accel=kvm -cpu host
        -smp N -m 128 [-S] -nodefaults -display none -object iothread,id=io0
        -qmp unix:DIR/ID/qmp.sock,server=on,wait=off -pidfile DIR/ID/pid -daemonize

(``accel=tcg -cpu max`` where /dev/kvm is missing or unusable), waits for the pidfile and
the socket, and on exit kills that QEMU by the pid it wrote (checked against its start time),
never by name: SIGKILL, then wait until ``/proc/<pid>`` is gone.

Two facts of this machine shape the helper:

- ``-cpu host`` aborts here under nested KVM ("failed to set MSR 0x10a": the L1 hypervisor
  rejects IA32_ARCH_CAPABILITIES), so when it fails that way the launch is retried once with
  ``host,-arch-capabilities`` and that model is kept for the session.
- ``-daemonize`` orphans QEMU, and this machine's init reaps orphans only every ~2 s.  The
  launch therefore runs with PR_SET_CHILD_SUBREAPER set (just around the launch), so the
  daemon becomes the test process's child and is reaped at once by ``waitpid`` after the kill.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.support import capabilities

QEMU = shutil.which("qemu-system-x86_64")
PR_SET_CHILD_SUBREAPER = 36

#: the CPU model that works with KVM on this host, learned by the first launch.
_kvm_cpu_model: list[str] = []


def require_qemu() -> str:
    if QEMU is None:
        pytest.skip("qemu-system-x86_64 is not installed")
    return QEMU


def kvm_usable() -> bool:
    """KVM really runs a vCPU here (tests/support/capabilities.py's probe, run once)."""
    return capabilities.missing("kvm") is None


def _start_time(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode()
    except OSError:
        return None
    return int(raw.rpartition(")")[2].split()[19])


@contextlib.contextmanager
def _subreaper() -> Iterator[None]:
    """Adopt orphaned descendants while the block runs (the -daemonize'd QEMU)."""
    libc = ctypes.CDLL(None, use_errno=True)
    ok = libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    try:
        yield
    finally:
        if ok:
            libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


def wait_until(
    predicate: Callable[[], object], timeout: float = 10.0, interval: float = 0.02
) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def kill_pid(pid: int, start: int, timeout: float = 15.0) -> None:
    """SIGKILL exactly this process (pid + start time), then wait until it is gone.

    pid_max is 32768 here and busy test runs wrap it within minutes: a pid whose start time
    differs is someone else's process and is left alone, and so is a pid already gone.
    """

    def still_ours() -> bool:
        return _start_time(pid) == start

    if not still_ours():
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)  # ours when it was adopted at launch: reaped right away
    if not wait_until(lambda: not still_ours(), timeout):
        raise AssertionError(f"QEMU pid {pid} still present {timeout} s after SIGKILL")


def reap_if_child(pid: int) -> bool:
    """Reap ``pid`` if it is our exited child (e.g. after kill without wait); True if reaped."""
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return False
    return done == pid


@dataclass
class QemuHandle:
    pid: int
    start: int
    sandbox_id: str
    dir: Path
    qmp_sock: Path
    pidfile: Path
    accel: str
    argv: list[str] = field(default_factory=list)
    killed: bool = False

    def kill(self) -> None:
        if not self.killed:
            kill_pid(self.pid, self.start)
            self.killed = True

    def tids(self) -> list[int]:
        return sorted(int(t) for t in os.listdir(f"/proc/{self.pid}/task"))


def qemu_argv(
    vm_dir: Path,
    sandbox_id: str,
    smp: int,
    debug_threads: bool,
    paused: bool,
    iothreads: Sequence[str],
    accel: str,
    cpu: str,
    memory: int = 128,
    extra: Sequence[str] = (),
) -> list[str]:
    d = vm_dir / sandbox_id
    name = f"sandbox-{sandbox_id}" + (",debug-threads=on" if debug_threads else "")
    argv = [require_qemu(), "-name", name, "-machine", f"q35,accel={accel}", "-cpu", cpu]
    argv += ["-smp", str(smp), "-m", str(memory)]
    if paused:
        argv.append("-S")
    argv += ["-nodefaults", "-display", "none"]
    for io in iothreads:
        argv += ["-object", f"iothread,id={io}"]
    argv += ["-qmp", f"unix:{d}/qmp.sock,server=on,wait=off", "-pidfile", f"{d}/pid"]
    argv += [*extra, "-daemonize"]
    return argv


def _zombie_children() -> set[int]:
    """Our exited, unreaped children (State Z, ppid = us)."""
    me, out = str(os.getpid()), set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().decode().rpartition(")")[2].split()
        except OSError:
            continue
        if fields[:2] == ["Z", me]:
            out.add(int(name))
    return out


def _run(argv: list[str], pidfile: Path) -> subprocess.CompletedProcess[str]:
    """Run a -daemonize'd QEMU with us as subreaper; reap the intermediate it leaves.

    QEMU daemonizes by forking twice: the middle process exits at once and, adopted by us,
    would stay a zombie for the whole session.  Only zombies that appeared during this launch
    are reaped, by pid, so no other test's child is touched.
    """
    with contextlib.suppress(FileNotFoundError):
        pidfile.unlink()
    before = _zombie_children()
    with _subreaper():
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    for pid in _zombie_children() - before:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
    if proc.returncode != 0:
        # the daemon wrote its pidfile before it died: reap it, it was adopted by us
        with contextlib.suppress(OSError, ValueError):
            pid = int(pidfile.read_text().strip())
            wait_until(lambda: reap_if_child(pid) or not os.path.exists(f"/proc/{pid}"), 5.0)
    return proc


def launch(
    vm_dir: Path,
    sandbox_id: str,
    smp: int = 2,
    debug_threads: bool = False,
    paused: bool = False,
    iothreads: Sequence[str] = ("io0",),
    accel: str | None = None,
    memory: int = 128,
    extra: Sequence[str] = (),
) -> QemuHandle:
    """Start one daemonized QEMU and return once its pidfile and QMP socket exist.

    ``extra`` goes before ``-daemonize``: a guest kernel, initrd, shares (guest_image.py).
    """
    require_qemu()
    if accel is None:
        accel = "kvm" if kvm_usable() else "tcg"
    d = vm_dir / sandbox_id
    d.mkdir(parents=True, exist_ok=True)
    pidfile, sock = d / "pid", d / "qmp.sock"
    if accel == "tcg":
        models = ["max"]
    else:
        models = _kvm_cpu_model[:1] or ["host", "host,-arch-capabilities"]
    errors: list[str] = []
    for cpu in models:
        argv = qemu_argv(
            vm_dir, sandbox_id, smp, debug_threads, paused, iothreads, accel, cpu, memory, extra
        )
        proc = _run(argv, pidfile)
        if proc.returncode == 0:
            if accel == "kvm" and not _kvm_cpu_model:
                _kvm_cpu_model.append(cpu)
            break
        errors.append(f"-cpu {cpu}: rc={proc.returncode}: {proc.stderr.strip()}")
    else:
        raise RuntimeError("QEMU did not start:\n" + "\n".join(errors))
    if not wait_until(lambda: pidfile.exists() and pidfile.read_text().strip(), 10):
        raise RuntimeError(f"QEMU wrote no pidfile {pidfile}")
    pid = int(pidfile.read_text().strip())
    start = _start_time(pid)
    if start is None:
        raise RuntimeError(f"QEMU pid {pid} from {pidfile} died at once")
    handle = QemuHandle(pid, start, sandbox_id, d, sock, pidfile, accel, argv)
    if not wait_until(sock.exists, 10):
        handle.kill()
        raise RuntimeError(f"QEMU pid {pid} made no QMP socket {sock}")
    return handle


@contextlib.contextmanager
def start_qemu(
    vm_dir: Path,
    sandbox_id: str,
    smp: int = 2,
    debug_threads: bool = False,
    paused: bool = False,
    iothreads: Sequence[str] = ("io0",),
    accel: str | None = None,
) -> Iterator[QemuHandle]:
    """One QEMU for the block; killed by its pid on the way out, whatever happened."""
    handle = launch(vm_dir, sandbox_id, smp, debug_threads, paused, iothreads, accel)
    try:
        yield handle
    finally:
        handle.kill()


@contextlib.contextmanager
def qemu_factory(vm_dir: Path) -> Iterator[Callable[..., QemuHandle]]:
    """For a fixture: ``start(sandbox_id, **kw)`` any number of QEMUs, all killed at teardown."""
    handles: list[QemuHandle] = []

    def start(sandbox_id: str, **kw: object) -> QemuHandle:
        h = launch(vm_dir, sandbox_id, **kw)  # type: ignore[arg-type]
        handles.append(h)
        return h

    try:
        yield start
    finally:
        for h in handles:
            h.kill()


def _connect_unix(path: str, timeout: float) -> socket.socket:
    """Connect to a listening unix socket, retrying while its listen backlog is full.

    A socket with a timeout is non-blocking underneath, and connect(2) on a unix stream
    socket whose listener's backlog is full fails at once with EAGAIN (BlockingIOError)
    instead of waiting, as TCP would (unix(7)).  QEMU's QMP chardev accepts one client at a
    time with a small backlog, so while vmpin (or a previous test's client) is being served
    another connect may hit a full queue: retry with a short backoff until ``timeout``.
    """
    deadline = time.monotonic() + timeout
    delay = 0.005
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(max(deadline - time.monotonic(), 0.05))
        try:
            s.connect(path)
            return s
        except BlockingIOError:
            s.close()
            if time.monotonic() + delay >= deadline:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 0.1)
        except BaseException:
            s.close()
            raise


@contextlib.contextmanager
def hold_qmp(sock_path: Path | str, timeout: float = 5.0) -> Iterator[socket.socket]:
    """Be the Kata shim: a connected QMP client that has read its greeting and stays on."""
    s = _connect_unix(str(sock_path), timeout)
    try:
        s.settimeout(timeout)
        buf = b""
        while b"\n" not in buf:
            chunk = s.recv(4096)
            if not chunk:
                raise RuntimeError("QMP closed before its greeting (held by someone else?)")
            buf += chunk
        assert buf.startswith(b'{"QMP"'), buf
        s.sendall(b'{"execute": "qmp_capabilities"}\r\n')
        yield s
    finally:
        s.close()


#: x86 resets at 0xFFFFFFF0: offset 0xFFF0 of a 64 KiB BIOS (QEMU wants a multiple of 64 KiB)
BIOS_SIZE, RESET_OFFSET = 0x10000, 0xFFF0


def spin_bios(directory: Path) -> Path:
    """A 64 KiB BIOS whose reset vector is ``jmp $`` (EB FE): under KVM the boot vCPU (vCPU 0)
    spins in the guest for as long as the VM runs, never in KVM_RUN's sleep, so its ``syscall``
    file reads "running" every time; the other vCPUs wait for an INIT/SIPI that never comes,
    asleep in KVM_RUN.  Use it as ``extra=("-bios", str(path))``.  The rest is HLT (F4)."""
    image = bytearray(b"\xf4" * BIOS_SIZE)
    image[RESET_OFFSET : RESET_OFFSET + 2] = b"\xeb\xfe"
    path = directory / "spin-bios.bin"
    path.write_bytes(bytes(image))
    return path


def debugfs_mount_points() -> list[str]:
    """Where this process's mount namespace (the host's, here) has a debugfs mounted (other
    test sessions may mount one under their tmp dirs: mounted_debugfs)."""
    with open("/proc/self/mountinfo") as f:
        return [line.split()[4] for line in f if " - debugfs " in line]


@contextlib.contextmanager
def mounted_debugfs(root: Path) -> Iterator[Path]:
    """A private debugfs mount at ``root/kernel/debug``; yields ``root`` to use as the sys root.

    The host's own /sys/kernel/debug is left alone; the mount is undone on exit.
    """
    target = root / "kernel" / "debug"
    target.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        ["mount", "-t", "debugfs", "none", str(target)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        pytest.skip(capabilities.HOST_LACKS + f"a debugfs mount: {proc.stderr.strip()}")
    try:
        if not (target / "kvm").is_dir():
            pytest.skip(capabilities.HOST_LACKS + "a kvm directory in debugfs")
        yield root
    finally:
        rc = subprocess.run(["umount", str(target)], capture_output=True).returncode
        if rc != 0:
            subprocess.run(["umount", "-l", str(target)], capture_output=True)
