"""A QEMU-shaped process for benchmarks: a sandbox VMM without the VM.

Real QEMU costs ~22 MB and a BIOS spin per sandbox; 120 or 500 of them do not fit on a 2-CPU
machine.  vmpin only needs what it reads from /proc, so this stands in for one:

- argv[0] names a qemu binary (``qemu-fakevmm``) and the command line carries Kata's
  ``-name sandbox-<id>,debug-threads=on``, ``-smp N``, ``-object iothread,id=X`` and
  ``-pidfile <vm dir>/<id>/pid``: vmm.find_vmm accepts it as that sandbox's QEMU;
- one thread per vCPU named ``CPU <i>/KVM`` and one per iothread named ``IO <id>``, as QEMU
  names them with debug-threads=on (so the reconciler classifies them through its "names"
  layer: no QMP, no KVM fds needed), plus the main (emulator) thread;
- SIGUSR1 starts one more vCPU thread (vCPU hotplug), SIGUSR2 a ``vhost-<pid>`` thread (a
  vhost worker, a QEMU thread since Linux 6.4): drift the agent must notice on its own.

The program is ~80 lines of C, compiled on first use with ``cc`` into a cache dir (about 1 MB
RSS and 3-5 threads per process); without a compiler the same behaviour runs in Python
(~9 MB per process), started through a symlink named ``qemu-fakevmm-py`` so that argv[0]
still looks like QEMU.

Usage from a benchmark::

    vmm = fakevmm.start(vm_dir, "sb1", vcpus=2)
    ...
    vmm.kill()           # SIGKILL by pid, then reaped (it is our child)
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

C_SOURCE = r"""
#define _GNU_SOURCE
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void *idle(void *name) {
    pthread_setname_np(pthread_self(), (const char *)name);
    for (;;) pause();
    return NULL;
}

static void spawn(const char *name) {
    pthread_t t;
    pthread_attr_t a;
    pthread_attr_init(&a);
    pthread_attr_setstacksize(&a, 64 * 1024);
    if (pthread_create(&t, &a, idle, strdup(name)) != 0) { perror("pthread_create"); exit(1); }
}

int main(int argc, char **argv) {
    int smp = 1;
    const char *pidfile = NULL;
    char name[32];
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGUSR1);
    sigaddset(&set, SIGUSR2);
    pthread_sigmask(SIG_BLOCK, &set, NULL);   /* inherited: only main's sigwait sees them */
    for (int i = 1; i + 1 < argc; i++) {
        if (!strcmp(argv[i], "-smp")) smp = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "-pidfile")) pidfile = argv[i + 1];
    }
    for (int i = 0; i < smp; i++) { snprintf(name, sizeof name, "CPU %d/KVM", i); spawn(name); }
    for (int i = 1; i + 1 < argc; i++) {
        if (!strcmp(argv[i], "-object") && !strncmp(argv[i + 1], "iothread,id=", 12)) {
            snprintf(name, sizeof name, "IO %s", argv[i + 1] + 12);
            spawn(name);
        }
    }
    usleep(2000);  /* let the threads name themselves before the pidfile says "ready" */
    if (pidfile) {
        char tmp[4096];
        snprintf(tmp, sizeof tmp, "%s.tmp", pidfile);
        FILE *f = fopen(tmp, "w");
        if (!f) { perror(tmp); return 1; }
        fprintf(f, "%d\n", getpid());
        fclose(f);
        rename(tmp, pidfile);
    }
    for (;;) {
        int sig;
        if (sigwait(&set, &sig) != 0) continue;
        if (sig == SIGUSR1) { snprintf(name, sizeof name, "CPU %d/KVM", smp++); spawn(name); }
        else { snprintf(name, sizeof name, "vhost-%d", getpid()); spawn(name); }
    }
}
"""

CACHE = Path(os.environ.get("XDG_CACHE_HOME", str(Path.home() / ".cache"))) / "vmpin-bench"


def _compile() -> str | None:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    digest = hashlib.sha256(C_SOURCE.encode()).hexdigest()[:12]
    exe = CACHE / f"{digest}" / "qemu-fakevmm"
    if exe.exists():
        return str(exe)
    exe.parent.mkdir(parents=True, exist_ok=True)
    src = exe.parent / "fakevmm.c"
    src.write_text(C_SOURCE)
    tmp = exe.parent / "qemu-fakevmm.tmp"
    proc = subprocess.run(
        [cc, "-O2", "-pthread", "-o", str(tmp), str(src)],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        print(f"fakevmm: cc failed, using the Python fallback:\n{proc.stderr}", file=sys.stderr)
        return None
    tmp.rename(exe)
    return str(exe)


_argv0: list[str] = []


def command() -> list[str]:
    """The argv prefix that runs a fake VMM (compiled C, else this file under Python)."""
    if not _argv0:
        exe = _compile()
        if exe is not None:
            _argv0.extend([exe])
        else:
            link = CACHE / "py" / "qemu-fakevmm-py"
            link.parent.mkdir(parents=True, exist_ok=True)
            if not link.exists():
                link.symlink_to(sys.executable)
            _argv0.extend([str(link), os.path.abspath(__file__)])
    return list(_argv0)


class FakeVmm:
    def __init__(self, proc: subprocess.Popen[bytes], sandbox_id: str, vm_dir: Path) -> None:
        self.proc = proc
        self.pid = proc.pid
        self.sandbox_id = sandbox_id
        self.dir = vm_dir / sandbox_id

    def tids(self) -> list[int]:
        return sorted(int(t) for t in os.listdir(f"/proc/{self.pid}/task"))

    def hotplug_vcpu(self) -> None:
        os.kill(self.pid, signal.SIGUSR1)

    def add_vhost(self) -> None:
        os.kill(self.pid, signal.SIGUSR2)

    def kill(self) -> None:
        """SIGKILL by pid (only while it is still our unreaped child), then reap it."""
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()


def start(
    vm_dir: Path,
    sandbox_id: str,
    vcpus: int = 2,
    iothreads: tuple[str, ...] = ("io0",),
    debug_threads: bool = True,
    timeout: float = 10.0,
) -> FakeVmm:
    """Start one fake VMM with the dir layout Kata uses; returns once its pidfile is written."""
    d = vm_dir / sandbox_id
    d.mkdir(parents=True, exist_ok=True)
    pidfile = d / "pid"
    with contextlib.suppress(FileNotFoundError):
        pidfile.unlink()
    name = f"sandbox-{sandbox_id}" + (",debug-threads=on" if debug_threads else "")
    argv = [*command(), "-name", name, "-machine", "q35,accel=kvm", "-smp", str(vcpus)]
    argv += ["-m", "128", "-nodefaults", "-display", "none"]
    for io in iothreads:
        argv += ["-object", f"iothread,id={io}"]
    argv += ["-pidfile", str(pidfile)]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
    vmm = FakeVmm(proc, sandbox_id, vm_dir)
    deadline = time.monotonic() + timeout
    while True:
        try:
            if pidfile.read_text().strip() == str(proc.pid):
                return vmm
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            vmm.kill()
            raise RuntimeError(f"fake VMM for {sandbox_id} did not start (rc={proc.returncode})")
        time.sleep(0.002)


# -- the Python fallback: the same behaviour as the C program -------------------------------
def _name_self(name: str) -> None:
    with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
        f.write(name[:15])


def _idle(name: str) -> None:
    _name_self(name)
    threading.Event().wait()


def _spawn(name: str) -> None:
    threading.Thread(target=_idle, args=(name,), daemon=True).start()


def main(argv: list[str]) -> int:
    smp, pidfile, iothreads = 1, None, []
    for i, arg in enumerate(argv[:-1]):
        if arg == "-smp":
            smp = int(argv[i + 1])
        elif arg == "-pidfile":
            pidfile = argv[i + 1]
        elif arg == "-object" and argv[i + 1].startswith("iothread,id="):
            iothreads.append(argv[i + 1].removeprefix("iothread,id="))
    threading.stack_size(256 * 1024)
    for i in range(smp):
        _spawn(f"CPU {i}/KVM")
    for io in iothreads:
        _spawn(f"IO {io}")
    count = [smp]

    def hotplug(signum: int, frame: object) -> None:
        if signum == signal.SIGUSR1:
            _spawn(f"CPU {count[0]}/KVM")
            count[0] += 1
        else:
            _spawn(f"vhost-{os.getpid()}")

    signal.signal(signal.SIGUSR1, hotplug)
    signal.signal(signal.SIGUSR2, hotplug)
    time.sleep(0.01)
    if pidfile:
        tmp = pidfile + ".tmp"
        with open(tmp, "w") as f:
            f.write(f"{os.getpid()}\n")
        os.rename(tmp, pidfile)
    while True:
        signal.pause()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
