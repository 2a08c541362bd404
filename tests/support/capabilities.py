"""What this machine can run, probed once per session: the facts behind the tests' markers.

Every integration test carries the marker of each component it drives for real (see
:data:`MARKERS`); ``tests/conftest.py`` registers them, skips a test whose component is missing
(with the probe's reason) and, under ``VMPIN_TEST_STRICT=1`` (``.ci/run``), turns such a skip
into a failure, so a suite cannot stay green by not running.

Two kinds of capability:

- *installable* ones (qemu, tcg, runc, containerd, podman, libvirtd): CI installs what it
  needs, so in strict mode their absence is a failure;
- *host* ones (cgroup_v1, cgroup_v2, kvm, multi_cpu): properties of the machine no package
  gives (a v1 host has no cgroup v2 cpuset; a host without vmx/svm or a usable /dev/kvm has no
  KVM).  A test needing one that the host lacks is skipped even in strict mode, with a reason
  that starts with :data:`HOST_LACKS`; the summary shows those skips.

Probes look at what the tests need, not at what merely exists: ``kvm`` runs a vCPU to a HLT
through the real KVM ioctls (in a child with a timeout: ``/dev/kvm`` can open and answer
KVM_GET_API_VERSION and still run no vCPU), ``multi_cpu`` counts the *online* CPUs (every
process here starts with affinity {0}: tests widen their own affinity, see
:func:`widen_affinity`), ``cgroup_v1`` makes and removes a child of the v1 cpuset root.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

#: a skip reason with this prefix is a property of the host, tolerated in strict mode.
HOST_LACKS = "host lacks "

CGROUP_ROOT = Path("/sys/fs/cgroup")
V1_CPUSET = CGROUP_ROOT / "cpuset"
ONLINE = Path("/sys/devices/system/cpu/online")


def _cpu_list(text: str) -> set[int]:
    """A kernel CPU list ("0-3,8"): the format of /sys/devices/system/cpu/online."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
    return out


def online_cpus() -> set[int]:
    """The CPUs the kernel has online (not this process's affinity, which is {0} here)."""
    try:
        return _cpu_list(ONLINE.read_text())
    except (OSError, ValueError):
        return set(os.sched_getaffinity(0))


# -- probes: each returns None when usable, else why not -----------------------------------------
def _which(*names: str) -> str | None:
    for name in names:
        if found := shutil.which(name):
            return found
        for d in ("/usr/sbin", "/usr/bin", "/sbin"):  # root's PATH may lack the sbin dirs
            if os.access(f"{d}/{name}", os.X_OK):
                return f"{d}/{name}"
    return None


def _root() -> str | None:
    return None if os.geteuid() == 0 else "not root"


def probe_qemu() -> str | None:
    return None if _which("qemu-system-x86_64") else "qemu-system-x86_64 is not installed"


def probe_tcg() -> str | None:
    qemu = _which("qemu-system-x86_64")
    if qemu is None:
        return "qemu-system-x86_64 is not installed"
    try:
        out = subprocess.run(
            [qemu, "-accel", "help"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError) as err:
        return f"qemu-system-x86_64 -accel help: {err}"
    return None if "tcg" in out.split() else "this QEMU has no TCG accelerator"


#: run in a child: KVM_CREATE_VM, one 4 KiB slot at the reset vector holding HLT, one vCPU,
#: KVM_RUN; exit 0 iff the vCPU stopped on KVM_EXIT_HLT.  A vCPU starts at 0xFFFFFFF0 (CS base
#: 0xFFFF0000, IP 0xFFF0), so no register has to be set.
_KVM_PROBE = r"""
import ctypes, fcntl, mmap, os, struct, sys
KVM_CREATE_VM, KVM_GET_VCPU_MMAP_SIZE, KVM_CREATE_VCPU, KVM_RUN = 0xAE01, 0xAE04, 0xAE41, 0xAE80
KVM_SET_USER_MEMORY_REGION = 0x4020AE46
KVM_EXIT_HLT = 5
kvm = os.open("/dev/kvm", os.O_RDWR | os.O_CLOEXEC)
vm = fcntl.ioctl(kvm, KVM_CREATE_VM, 0)
mem = mmap.mmap(-1, 0x1000)
mem[0xFF0:0xFF1] = b"\xf4"  # hlt
addr = ctypes.addressof(ctypes.c_char.from_buffer(mem))
fcntl.ioctl(vm, KVM_SET_USER_MEMORY_REGION, struct.pack("IIQQQ", 0, 0, 0xFFFFF000, 0x1000, addr))
vcpu = fcntl.ioctl(vm, KVM_CREATE_VCPU, 0)
size = fcntl.ioctl(kvm, KVM_GET_VCPU_MMAP_SIZE, 0)
run = mmap.mmap(vcpu, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
fcntl.ioctl(vcpu, KVM_RUN, 0)
reason = struct.unpack_from("I", run, 8)[0]
print(reason)
sys.exit(0 if reason == KVM_EXIT_HLT else 3)
"""


def probe_kvm() -> str | None:
    if not os.path.exists("/dev/kvm"):
        return HOST_LACKS + "/dev/kvm"
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _KVM_PROBE], capture_output=True, text=True, timeout=20
        )
    except subprocess.TimeoutExpired:
        return HOST_LACKS + "a usable KVM: a vCPU did not reach HLT within 20 s"
    if proc.returncode != 0:
        why = (proc.stderr.strip().splitlines() or [f"exit reason {proc.stdout.strip()}"])[-1]
        return HOST_LACKS + f"a usable KVM: running a vCPU failed: {why}"
    return None


def linux_guest_accel() -> str:
    """The accelerator a real Linux guest boots under here: ``kvm`` only where KVM runs a
    vCPU AND the CPU offers vmx/svm.  These machines' /dev/kvm is PVM (no vmx/svm in
    /proc/cpuinfo): it runs an empty QEMU's BIOS (so the ``kvm`` marker holds) but Debian's
    kernel hangs early on it, so a guest must boot under TCG."""
    try:
        flags = {
            flag
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
            for flag in line.split(":", 1)[1].split()
        }
    except OSError:
        flags = set()
    return "kvm" if missing("kvm") is None and flags & {"vmx", "svm"} else "tcg"


def probe_multi_cpu() -> str | None:
    n = len(online_cpus())
    return None if n >= 2 else HOST_LACKS + f"2 online CPUs (has {n})"


def probe_cgroup_v1() -> str | None:
    """A writable v1 cpuset hierarchy: a child can be made (and is removed at once)."""
    if (why := _root()) is not None:
        return why
    if not (V1_CPUSET / "cpuset.cpus").exists():
        return HOST_LACKS + f"a cgroup v1 cpuset hierarchy at {V1_CPUSET}"
    probe = V1_CPUSET / f"vmpin-probe-{uuid.uuid4().hex[:10]}"
    try:
        probe.mkdir()
    except OSError as err:
        return HOST_LACKS + f"a writable cgroup v1 cpuset hierarchy ({err})"
    with contextlib.suppress(OSError):
        probe.rmdir()
    return None


def probe_cgroup_v2() -> str | None:
    """cgroup2 mounted at the cgroup root with the cpuset controller available."""
    if (why := _root()) is not None:
        return why
    controllers = CGROUP_ROOT / "cgroup.controllers"
    try:
        available = controllers.read_text().split()
    except OSError:
        return HOST_LACKS + f"cgroup v2 at {CGROUP_ROOT} (this host has cgroup v1)"
    if "cpuset" not in available:
        return HOST_LACKS + "the cpuset controller in cgroup v2"
    return None


def probe_runc() -> str | None:
    if _which("runc") is None:
        return "runc is not installed"
    if not os.access("/usr/bin/busybox", os.X_OK):
        return "/usr/bin/busybox is missing (apt-get install busybox-static)"
    return _root()


def probe_containerd() -> str | None:
    for tool in ("containerd", "ctr"):
        if _which(tool) is None:
            return f"{tool} is not installed (apt-get install containerd)"
    return probe_runc()


def probe_podman() -> str | None:
    if _which("podman") is None:
        return "podman is not installed (apt-get install podman)"
    return probe_runc()


def probe_libvirtd() -> str | None:
    for tool in ("libvirtd", "virsh", "virtlogd"):
        if _which(tool) is None:
            return f"{tool} is not installed (apt-get install libvirt-daemon-system)"
    return _root()


def probe_guest() -> str | None:
    """A real Linux guest can be built and booted (tests/support/guest_image.py)."""
    from tests.support import guest_image

    return probe_qemu() or guest_image.missing()


#: marker name -> (probe, is it a host property, what the marker means).
MARKERS: dict[str, tuple[Callable[[], str | None], bool, str]] = {
    "qemu": (probe_qemu, False, "starts real QEMU processes"),
    "tcg": (probe_tcg, False, "needs QEMU's TCG accelerator (a Linux guest boots only so here)"),
    "kvm": (probe_kvm, True, "needs KVM that really runs a vCPU (not merely /dev/kvm)"),
    "runc": (probe_runc, False, "starts real runc containers (root, runc, busybox-static)"),
    "containerd": (probe_containerd, False, "starts a private containerd"),
    "podman": (probe_podman, False, "runs podman containers"),
    "libvirtd": (probe_libvirtd, False, "starts a private libvirtd and real domains"),
    "cgroup_v1": (probe_cgroup_v1, True, "makes cgroups in the host's v1 cpuset hierarchy"),
    "cgroup_v2": (probe_cgroup_v2, True, "makes cgroups in the host's cgroup v2 (cpuset)"),
    "multi_cpu": (probe_multi_cpu, True, "needs >= 2 online CPUs (and widens its own affinity)"),
    "guest": (probe_guest, False,
              "boots a real Linux guest under QEMU (tests/support/guest_image.py)"),
}


#: markers of tests that create something outside their own processes and tmp dirs (VMs,
#: containers, daemons, cgroups): conftest adds the umbrella marker ``host`` to them.
TOUCHES_HOST = (
    "qemu", "tcg", "kvm", "runc", "containerd", "podman", "libvirtd", "cgroup_v1", "cgroup_v2",
    "guest",
)


@functools.cache
def missing(marker: str) -> str | None:
    """Why ``marker``'s component cannot run here (None when it can); probed once.

    ``VMPIN_TEST_DISABLE=kvm,runc`` makes the named capabilities missing, to see what a host
    without them runs (e.g. a TCG-only host: QEMUs start under TCG, kvm tests skip).
    """
    probe, host_property, _ = MARKERS[marker]
    if marker in os.environ.get("VMPIN_TEST_DISABLE", "").split(","):
        return (HOST_LACKS if host_property else "") + f"{marker} (VMPIN_TEST_DISABLE)"
    return probe()


def is_host_property(marker: str) -> bool:
    return MARKERS[marker][1]


@contextlib.contextmanager
def widen_affinity() -> Iterator[set[int]]:
    """Let this process (and what it starts from now on) run on every online CPU.

    Every process on these machines starts with affinity {0}, and children inherit it: a test
    that needs two CPUs must not count CPUs by affinity (and skip), it widens its own.  The
    previous affinity is restored afterwards.
    """
    before = os.sched_getaffinity(0)
    cpus = online_cpus()
    os.sched_setaffinity(0, cpus)
    try:
        yield cpus
    finally:
        os.sched_setaffinity(0, before)
