"""Classify a VMM's threads: vCPU (with its index), iothread (with its id), vhost, emulator.

Pinning is only as good as this classification, and the best sources are often missing in
real Kata, so several sources are combined per thread, best first; each thread reports the
one that decided it (``layer``):

``qmp``
    ``query-cpus-fast`` (cpu-index -> thread id) and ``query-iothreads`` (id -> thread id).
    Exact and complete, but a QMP chardev serves one client and the Kata shim holds
    ``qmp.sock`` for the VM's life; so usually unavailable in production.  The socket's
    SO_PEERCRED pid must be the VMM's, or the answer is ignored.
``names``
    With ``-name ...,debug-threads=on`` QEMU names its threads "CPU <n>/KVM" (or /TCG),
    "IO <id>" (comm is cut at 15 bytes: long ids are completed from ``-object iothread``
    on the command line when unambiguous; "IO mon_iothread" is the monitor's own thread, an
    emulator thread).  Exact.  Kata leaves debug-threads off except in debug mode.  The names
    are trusted wherever they match, whatever ``Vmm.debug_threads`` says (``-readconfig`` can
    turn it on unseen): nothing else names a thread "CPU 0/KVM" inside a QEMU.
    Vhost workers are named by the kernel whatever QEMU does: "vhost-<owner
    tid>"; since Linux 6.4 they are threads of the QEMU process, before that (and again since
    6.17 when the vhost module is set to kthread mode) kernel threads outside it, children of
    kthreadd, found by name.  KVM's own helper "kvm-nx-lpage-recovery" also lives inside
    the QEMU process (a vhost_task): it is an emulator thread, never a vCPU.
``debugfs`` / ``debugfs-ns`` / ``kvm-syscall`` (the fallback for Kata's default: no names,
QMP held)
    ``/proc/<pid>/fd`` links ``anon_inode:kvm-vcpu:<N>`` say which vCPUs exist and which fd is
    vCPU N.  With debugfs mounted (root only), ``<sys>/kernel/debug/kvm/<pid>-<vm fd>/vcpuN/pid``
    holds vCPU N's thread id once it has run (0 before): exact, busy or idle (``debugfs``).
    Otherwise a thread whose ``syscall`` file reads ``<ioctl nr> 0x<fd> 0xae80 ...`` is
    blocked in ioctl(KVM_RUN) on that vCPU fd (halted in the guest): exact for that thread,
    including its index (``kvm-syscall``), but blind to a vCPU running guest code.  When the
    first look at the syscall files leaves a vCPU unaccounted for (remembered ones count), the
    sysfs root is the host's own ``/sys`` (never a fixture root) and debugfs is not mounted
    there, KVM's files are read through a debugfs mounted in a private mount namespace of a
    short-lived child (``debugfs-ns``, :mod:`vmpin.linux.debugfs`): exact again, and nothing is
    mounted on the host's tree.  It needs CAP_SYS_ADMIN and util-linux ``unshare``, costs one
    process (3.5 ms on a quiet CPU, 5-13 ms medians on this busy 2-CPU machine:
    bench/bench_debugfs.py) and is bounded by ``debugfs_ns_timeout``; when it fails (not
    permitted, no binary, timeout) a note says why and the pass goes on with the syscall files.
``remembered``
    A thread classified in an earlier pass of the same VMM (same pid and start time: the
    caller's job) keeps its role when this pass cannot tell.

Everything else is ``emulator`` (layer ``none``).

How sure the fallback is, and where it is blind:

- Without either debugfs (no CAP_SYS_ADMIN, no ``unshare``), the syscall files only show a
  vCPU while that vCPU sleeps in KVM_RUN.  A vCPU that is executing guest code, or in QEMU
  userspace emulating an exit, reads ``running`` in ``syscall``; such threads are re-read a
  few times (bounded: ``kvm_retries`` x ``kvm_retry_delay``, and only when a vCPU is still
  unaccounted for).  A guest that keeps a vCPU 100% busy may never show it: ``remembered``
  carries it over from any pass that did, and ``missing_vcpus`` says which indexes are still
  unknown; the planner then pins no vCPU 1:1 for that VMM (the same plan whichever vCPUs a
  pass happened to see: vmpin.core.planner).
- A VM started paused (``-S``) or not yet started has no vCPU in KVM_RUN at all (and debugfs
  reads pid 0): nothing is found until it runs.
- TCG has no KVM fds: without names or QMP, its vCPUs are emulator threads here.
- An iothread cannot be told from other emulator threads without names or QMP: both are
  ordinary QEMU threads sleeping in ppoll.  It comes out as ``emulator`` and is placed by
  the emulator policy.
- The ``syscall`` file of a vhost_task (the kvm-nx-lpage-recovery helper) shows the syscall
  of the thread that spawned it: on Linux 6.18 it reads ioctl(KVM_RUN) on vCPU 0's fd
  forever.  Such threads are excluded by name ("kvm-*") and by wchan ("vhost_task*"), and
  two threads claiming one vCPU are both rejected rather than guessed between.

Cost: the common passes read ``task/`` and one ``comm`` per thread (plus one QMP round trip
when QMP answers, plus the comm of each kthreadd child for pre-6.4-style vhost workers).
The fd table and ``syscall`` files are read only when QMP and names left vCPUs unknown; the
private debugfs child is spawned at most once per pass, only when one look at the syscall
files left a known vCPU index unaccounted for (a busy vCPU, in a VMM's first passes: never
once every vCPU is remembered), and there are no sleeps unless one is still missing after it.
"""

from __future__ import annotations

import os
import time

from vmpin.core.errors import HostError, PermissionDenied, ProcessGone, QmpError
from vmpin.linux import debugfs, procfs
from vmpin.linux.paths import HostPaths
from vmpin.runtimes.vmm import Vmm, iothread_ids

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.lean.records)
if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence
    from typing import NamedTuple, Protocol

    class ThreadLike(Protocol):
        """What a remembered thread must offer: ``store.ThreadRec`` and :class:`VmmThread` both do.

        The vCPU index is ``idx`` on ``store.ThreadRec`` (a NamedTuple field named ``index`` would
        shadow ``tuple.index``) and ``index`` on :class:`VmmThread`; :func:`_rec_index` reads
        either.  A protocol rather than an import of vmpin.state.store keeps sqlite3 off this path.
        """

        @property
        def tid(self) -> int: ...
        @property
        def role(self) -> str: ...
        @property
        def label(self) -> str | None: ...
        @property
        def layer(self) -> str: ...
else:
    from vmpin.lean.records import NamedTuple


ROLES = ("vcpu", "iothread", "vhost", "emulator")
#: best first; "none" = no evidence, role emulator by default.
LAYERS = ("qmp", "names", "debugfs", "debugfs-ns", "kvm-syscall", "remembered", "none")
#: seconds a private-namespace debugfs read may take (5-13 ms here: bench/bench_debugfs.py)
DEBUGFS_NS_TIMEOUT = 1.0
#: the host's own sysfs: only there may a debugfs be mounted in a private namespace (a
#: fixture root in a test never triggers it)
HOST_SYS = "/sys"

#: ioctl(2)'s number per architecture, as /proc/PID/syscall prints it (first field).
_IOCTL_NR = {
    "x86_64": "16",
    "aarch64": "29",
    "riscv64": "29",
    "loongarch64": "29",
    "ppc64le": "54",
    "ppc64": "54",
    "s390x": "54",
}
#: _IO(KVMIO=0xAE, 0x80): the same number on every architecture.
KVM_RUN = 0xAE80
#: comm is TASK_COMM_LEN-1 = 15 bytes.
COMM_LEN = 15



def _number_after(prefix: str, text: str) -> int | None:
    r"""The N of ``<prefix>N`` (``re.fullmatch(prefix + r"(\d+)")``), else None.

    Plain string tests, not ``re``: importing re (with enum) is ~3 ms of a Kata hook that
    pins in-process.  ``str.isdecimal`` is exactly ``\d`` for str patterns (Unicode Nd)."""
    if not text.startswith(prefix):
        return None
    digits = text[len(prefix) :]
    return int(digits) if digits and digits.isdecimal() else None


def _cpu_name(comm: str) -> int | None:
    r"""The vCPU index of a QEMU vCPU thread name ``CPU <n>/<accel>`` (``CPU 0/KVM``), else
    None: ``re.fullmatch(r"CPU (\d+)/(\w+)")`` without re (``\w`` is alnum or ``_``)."""
    head, slash, accel = comm.partition("/")
    index = _number_after("CPU ", head)
    if index is None or not slash or not accel:
        return None
    return index if all(c.isalnum() or c == "_" for c in accel) else None
_VM_FD = "anon_inode:kvm-vm"


def _rec_index(rec: ThreadLike) -> int | None:
    """The vCPU index of a remembered thread, whichever record type carries it."""
    for attr in ("idx", "index"):
        value = getattr(rec, attr, None)
        # isinstance: on a tuple without that field, ``index`` is tuple.index, a method
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


class VmmThread(NamedTuple):
    """One thread of a VMM (or a vhost kthread serving it) and what it is.

    NamedTuples, not dataclasses, here: the hook may reach this module through the reconciler,
    and ``dataclasses`` imports ``inspect`` (~10 ms).
    """

    tid: int
    role: str
    #: shadows tuple.index(), on purpose: the field name is the store's and the planner's.
    index: int | None  # type: ignore[assignment]
    label: str | None
    layer: str


class Classification(NamedTuple):
    """The threads of one VMM, which layers decided them, and what could not be decided."""

    threads: list[VmmThread]
    layers: list[str]
    notes: list[str]
    #: vCPU indexes known to exist (from QMP or the KVM fds) that no thread was found for.
    missing_vcpus: tuple[int, ...] = ()

    def vcpus(self) -> dict[int, int]:
        """vCPU index -> tid."""
        return {t.index: t.tid for t in self.threads if t.role == "vcpu" and t.index is not None}

    def by_role(self, role: str) -> list[VmmThread]:
        return [t for t in self.threads if t.role == role]

    def by_tid(self) -> dict[int, VmmThread]:
        return {t.tid: t for t in self.threads}


class _Verdict(NamedTuple):
    role: str
    index: int | None  # type: ignore[assignment]
    label: str | None
    layer: str


class _Pass:
    """The mutable state of one classification pass."""

    def __init__(self, paths: HostPaths, vmm: Vmm) -> None:
        self.paths = paths
        self.vmm = vmm
        self.tids: list[int] = []
        self.comms: dict[int, str] = {}
        self.verdicts: dict[int, _Verdict] = {}
        self.kthreads: dict[int, _Verdict] = {}
        self.notes: list[str] = []
        self.expected: set[int] | None = None  # vCPU indexes known to exist

    # -- bookkeeping ----------------------------------------------------------------------
    def alive(self, tid: int) -> bool:
        return tid in self.comms

    def drop(self, tid: int, why: str) -> None:
        """A thread that exited mid-pass: expected, skip it."""
        if self.comms.pop(tid, None) is not None:
            self.verdicts.pop(tid, None)
            self.notes.append(f"tid {tid} exited during classification ({why})")

    def decide(self, tid: int, role: str, index: int | None, label: str | None, layer: str) -> bool:
        """First (best) layer wins; a later layer that disagrees is noted, not applied."""
        if not self.alive(tid):
            return False
        have = self.verdicts.get(tid)
        if have is None:
            self.verdicts[tid] = _Verdict(role, index, label, layer)
            return True
        if (have.role, have.index) != (role, index) and role != "emulator":
            self.notes.append(
                f"tid {tid}: {layer} says {role}{'' if index is None else f' {index}'}, "
                f"kept {have.layer}'s {have.role}{'' if have.index is None else f' {have.index}'}"
            )
        return False

    def vcpu_indexes(self) -> dict[int, int]:
        return {
            v.index: tid
            for tid, v in self.verdicts.items()
            if v.role == "vcpu" and v.index is not None
        }


def classify(
    paths: HostPaths,
    vmm: Vmm,
    qmp_socket: str | None,
    remembered: Mapping[int, ThreadLike] | None = None,
    qmp_timeout: float | None = None,
    *,
    kvm_retries: int = 5,
    kvm_retry_delay: float = 0.01,
    vhost_kthreads: Mapping[int, Sequence[tuple[int, str]]] | None = None,
    tids: Iterable[int] | None = None,
    debugfs_ns_timeout: float | None = DEBUGFS_NS_TIMEOUT,
) -> Classification:
    """Classify every thread of ``vmm`` (see the module docstring for the layers).

    ``remembered`` is an earlier pass's result for this same VMM, keyed by tid.
    ``vhost_kthreads`` (from :func:`find_vhost_kthreads`) lets a caller classifying many VMMs
    scan the kernel threads once per pass; when None it is scanned here.  ``tids``: the
    VMM's ``task/`` as the caller just listed it (a node's first pass classifies every VMM:
    one listing each, not two); the start time checked here then vouches for it.
    ``debugfs_ns_timeout``: the bound on a private-namespace debugfs read (layer
    ``debugfs-ns``); None never does one.
    Raises :class:`ProcessGone` when the VMM itself is gone or its pid was reused; threads
    that exit during the pass are skipped with a note.
    """
    st = _Pass(paths, vmm)
    try:
        if procfs.start_time(paths.proc, vmm.pid) != vmm.start:
            raise ProcessGone(f"pid {vmm.pid} is no longer the VMM started at {vmm.start}")
        st.tids = sorted(tids) if tids is not None else procfs.tids(paths.proc, vmm.pid)
    except (ValueError, IndexError) as err:
        raise ProcessGone(f"pid {vmm.pid}: unreadable stat") from err
    for tid in st.tids:
        try:
            st.comms[tid] = procfs.comm(paths.proc, vmm.pid, tid)
        except ProcessGone:
            st.notes.append(f"tid {tid} exited during classification (comm)")
        except HostError as err:
            st.comms[tid] = ""
            st.notes.append(f"tid {tid}: comm unreadable: {err}")

    qmp_complete = _layer_qmp(st, qmp_socket, qmp_timeout)
    names_have_vcpus = _layer_names(st)
    _layer_vhost_kthreads(st, vhost_kthreads)
    # QEMU names every vCPU thread or none (debug-threads applies to all, hotplugged too):
    # one named vCPU means the names are complete, and the KVM layer has nothing to add.
    if not qmp_complete and not names_have_vcpus:
        _layer_kvm(st, remembered or {}, kvm_retries, kvm_retry_delay, debugfs_ns_timeout)
    _layer_remembered(st, remembered or {})

    threads: list[VmmThread] = []
    for tid in sorted(st.comms):
        v = st.verdicts.get(tid) or _Verdict("emulator", None, st.comms[tid] or None, "none")
        threads.append(VmmThread(tid, v.role, v.index, v.label, v.layer))
    for tid, v in sorted(st.kthreads.items()):
        threads.append(VmmThread(tid, v.role, v.index, v.label, v.layer))
    threads.sort(key=lambda t: t.tid)
    used = {t.layer for t in threads}
    missing = sorted(st.expected - set(st.vcpu_indexes())) if st.expected is not None else []
    if missing:
        st.notes.append(f"vCPU index(es) {_fmt(missing)} exist but no thread was identified")
    return Classification(
        threads=threads,
        layers=[layer for layer in LAYERS if layer in used and layer != "none"],
        notes=st.notes,
        missing_vcpus=tuple(missing),
    )


# -- layer (a): QMP --------------------------------------------------------------------------
def _layer_qmp(st: _Pass, qmp_socket: str | None, timeout: float | None) -> bool:
    """True when QMP answered (then it listed every vCPU: nothing left for the KVM layer)."""
    if qmp_socket is None:
        return False
    # Imported here: a pass that reuses remembered roles (every pass but a VMM's first) opens
    # no QMP session, and a Kata hook that pins in-process should not load the client.
    from vmpin.runtimes.qmp import DEFAULT_CONNECT_TIMEOUT, query_vmm

    try:
        peer, cpus, iothreads = query_vmm(
            qmp_socket, timeout=DEFAULT_CONNECT_TIMEOUT if timeout is None else timeout
        )
    except QmpError as err:
        st.notes.append(f"qmp unavailable: {err}")
        return False
    if peer is not None and peer != st.vmm.pid:
        st.notes.append(f"qmp: {qmp_socket} belongs to pid {peer}, not the VMM {st.vmm.pid}")
        return False
    by_tid: dict[int, list[int]] = {}
    for index, tid, _props in cpus:
        by_tid.setdefault(tid, []).append(index)
    # vCPUs sharing one thread (single-threaded TCG) are covered by their lowest index
    st.expected = {min(indexes) for indexes in by_tid.values()}
    for tid, indexes in by_tid.items():
        if not st.alive(tid):
            st.notes.append(f"qmp: vCPU {_fmt(indexes)} thread {tid} is not a thread of the VMM")
            continue
        if len(indexes) > 1:
            # single-threaded TCG: one thread runs every vCPU, 1:1 pinning is impossible
            st.notes.append(f"qmp: one thread {tid} runs vCPUs {_fmt(indexes)} (TCG, one thread)")
        st.decide(tid, "vcpu", min(indexes), st.comms[tid] or None, "qmp")
    for io_id, tid in iothreads:
        if st.alive(tid):
            st.decide(tid, "iothread", None, io_id, "qmp")
        else:
            st.notes.append(f"qmp: iothread {io_id} thread {tid} is not a thread of the VMM")
    return True


# -- layer (b): names ------------------------------------------------------------------------
def _layer_names(st: _Pass) -> bool:
    """Thread names; True when at least one vCPU was named."""
    known_ids = iothread_ids(st.vmm.cmdline)
    any_vcpu = False
    for tid, comm in list(st.comms.items()):
        cpu = _cpu_name(comm)
        if cpu is not None:
            st.decide(tid, "vcpu", cpu, comm, "names")
            any_vcpu = True
        elif comm == "IO mon_iothread":
            # the monitor's own iothread (out-of-band QMP), not an -object iothread: it
            # serves the control plane, like the main loop
            st.decide(tid, "emulator", None, comm, "names")
        elif comm.startswith("IO "):
            st.decide(tid, "iothread", None, _iothread_id(comm[3:], known_ids), "names")
        elif _number_after("vhost-", comm) is not None:
            st.decide(tid, "vhost", None, comm, "names")
        elif comm.startswith("kvm-"):
            # kvm-nx-lpage-recovery: KVM's helper inside the VMM, never a vCPU
            st.decide(tid, "emulator", None, comm, "names")
    return any_vcpu


def _iothread_id(shown: str, known: Iterable[str]) -> str:
    """Complete an id cut by the 15-byte comm limit from the command line's iothread ids."""
    if len("IO " + shown) < COMM_LEN:
        return shown
    matches = [i for i in known if i.startswith(shown)]
    return matches[0] if len(matches) == 1 else shown


#: the kernel modules a vhost worker belongs to (the core, which the others load, and each
#: device's own module, should a kernel carry the core inside one of them)
VHOST_MODULES = ("vhost", "vhost_net", "vhost_vsock", "vhost_scsi", "vhost_vdpa")
#: since Linux 6.4 a vhost worker is a thread of the process that owns the device (it is in
#: that process's ``task/``); a kernel thread again only where the kernel lets vhost choose
#: (CONFIG_VHOST_ENABLE_FORK_OWNER_CONTROL, 6.17), which shows as this module parameter
VHOST_TASKS_SINCE = (6, 4)
VHOST_KTHREAD_MODE_PARAM = "vhost/parameters/fork_from_owner_default"


def vhost_kthreads_possible(paths: HostPaths) -> bool:
    """Whether this kernel can have vhost workers that are kernel threads at all.

    Finding them reads the name of every kernel thread (:func:`find_vhost_kthreads`): ~60 here,
    thousands on a many-CPU host (a few per CPU), once per pass that classifies a VMM -- every
    new sandbox's.  Where no vhost module is there (``/sys/module/<name>`` exists for a loaded
    module and for a built-in one with parameters, as vhost's are), or the kernel runs every
    worker inside its owner (6.4 and later without the kthread-mode parameter), there is
    nothing to find.  An unreadable release counts as an old kernel: the scan is then made.
    """
    module_dir = os.path.join(paths.sys, "module")
    if not any(os.path.exists(os.path.join(module_dir, m)) for m in VHOST_MODULES):
        return False
    if os.path.exists(os.path.join(module_dir, VHOST_KTHREAD_MODE_PARAM)):
        return True
    release = procfs.kernel_release(paths.proc)
    return release is None or release < VHOST_TASKS_SINCE


def find_vhost_kthreads(paths: HostPaths) -> dict[int, list[tuple[int, str]]]:
    """Kernel threads named ``vhost-<owner tid>`` (pre-6.4 vhost, or kthread mode), by owner;
    none read where the kernel can have none (:func:`vhost_kthreads_possible`).

    kthreadd (pid 2) is every kernel thread's parent: its ``children`` file (CONFIG_PROC_CHILDREN)
    lists them without walking all of /proc; without it, every pid with ppid 2 is checked.
    """
    out: dict[int, list[tuple[int, str]]] = {}
    if not vhost_kthreads_possible(paths):
        return out
    children: list[int] | None
    try:
        with open(os.path.join(paths.proc, "2", "task", "2", "children"), "rb") as f:
            children = [int(p) for p in f.read().split()]
    except (OSError, ValueError):
        children = None
    try:
        candidates = children if children is not None else procfs.pids(paths.proc)
    except OSError:
        return out
    for kpid in candidates:
        try:
            comm = procfs.comm(paths.proc, kpid)
            owner = _number_after("vhost-", comm)
            if owner is None:
                continue
            if children is None and procfs.ppid(paths.proc, kpid) != 2:
                continue
        except (HostError, ValueError, IndexError):
            continue
        out.setdefault(owner, []).append((kpid, comm))
    return out


def _layer_vhost_kthreads(st: _Pass, index: Mapping[int, Sequence[tuple[int, str]]] | None) -> None:
    if index is None:
        index = find_vhost_kthreads(st.paths)
    for owner in {st.vmm.pid, *st.comms}:
        for kpid, comm in index.get(owner, ()):
            st.kthreads[kpid] = _Verdict("vhost", None, comm, "names")


# -- layer (c): KVM facts --------------------------------------------------------------------
def _kvm_fds(st: _Pass) -> tuple[dict[int, int], list[int]]:
    """(vCPU fd -> vCPU index, VM fds) from the VMM's fd table."""
    fd_dir = os.path.join(st.paths.proc, str(st.vmm.pid), "fd")
    vcpu_fds: dict[int, int] = {}
    vm_fds: list[int] = []
    try:
        names = os.listdir(fd_dir)
    except OSError as err:
        st.notes.append(f"kvm: cannot list {fd_dir}: {err.strerror}")
        return vcpu_fds, vm_fds
    for name in names:
        if not name.isdigit():
            continue
        target = procfs.fd_target(st.paths.proc, st.vmm.pid, int(name))
        if target is None:
            continue
        index = _number_after("anon_inode:kvm-vcpu:", target)
        if index is not None:
            vcpu_fds[int(name)] = index
        elif target == _VM_FD:
            vm_fds.append(int(name))
    return vcpu_fds, sorted(vm_fds)


def _layer_kvm(
    st: _Pass,
    remembered: Mapping[int, ThreadLike],
    retries: int,
    delay: float,
    debugfs_ns_timeout: float | None,
) -> None:
    vcpu_fds, vm_fds = _kvm_fds(st)
    if not vcpu_fds:
        st.notes.append("kvm: no kvm-vcpu fds (TCG, or not a KVM VMM): vCPUs need names or QMP")
        return
    known = set(vcpu_fds.values())
    st.expected = known if st.expected is None else st.expected | known

    def still_missing() -> set[int]:
        found = set(st.vcpu_indexes())
        for tid, rec in remembered.items():
            index = _rec_index(rec)
            if rec.role != "vcpu" or index is None or tid in st.verdicts:
                continue
            if st.alive(tid):
                found.add(index)
        return known - found

    # debugfs mounted on the host: exact, and sees running vCPUs too; root only
    mounted = os.path.isdir(debugfs.kvm_dir(st.paths.sys))
    if mounted:
        unknown = sorted(known - set(st.vcpu_indexes()))
        _apply_debugfs(st, debugfs.vcpu_pids(st.paths.sys, st.vmm.pid, vm_fds, unknown), "debugfs")
    if not still_missing():
        return
    # Not mounted: vmpin never mounts it on the host's tree, but a child may in a private
    # mount namespace (vmpin.linux.debugfs).  That costs a process (5-13 ms), so only for what
    # the first, cheap look at the syscall files leaves unaccounted for: a vCPU busy in the
    # guest, which no re-read would show for sure.
    private = (
        debugfs_ns_timeout
        if not mounted and vm_fds and os.path.normpath(st.paths.sys) == HOST_SYS
        else None
    )
    ioctl_nr = _IOCTL_NR.get(os.uname().machine)
    candidates = [
        tid for tid in st.comms if tid not in st.verdicts and not st.comms[tid].startswith("kvm-")
    ]
    claims: dict[int, list[int]] = {}
    for attempt in range(retries + 1):
        running: list[int] = []
        for tid in candidates:
            try:
                fields = procfs.syscall(st.paths.proc, st.vmm.pid, tid)
            except ProcessGone:
                st.drop(tid, "syscall")
                continue
            except PermissionDenied as err:
                st.notes.append(f"kvm: cannot read syscall files: {err}")
                return
            except HostError:
                continue
            if fields[:1] == ["running"]:
                running.append(tid)
                continue
            claim = _kvm_run_index(fields, ioctl_nr, vcpu_fds)
            if claim is None:
                continue
            if _wchan(st, tid).startswith("vhost_task"):
                # a kernel helper (vhost_task) shows its creator's registers: not a vCPU
                st.notes.append(f"tid {tid}: KVM_RUN in syscall but a vhost_task: not a vCPU")
                continue
            claims.setdefault(claim, [])
            if tid not in claims[claim]:
                claims[claim].append(tid)
        claimed = {ix for ix, tids in claims.items() if tids}
        if private is not None and still_missing() - claimed:
            _layer_debugfs_ns(st, vm_fds, private)
            private = None  # (once per pass)
            running = [tid for tid in running if tid not in st.verdicts]
        candidates = running
        if not running or not (still_missing() - claimed) or attempt == retries:
            break
        time.sleep(delay)

    for index, tids in sorted(claims.items()):
        tids = [t for t in tids if st.alive(t)]
        holder = st.vcpu_indexes().get(index)
        if holder is not None:  # debugfs named this vCPU's thread: it is the better witness
            if set(tids) - {holder}:
                st.notes.append(
                    f"kvm: threads {_fmt(tids)} claim vCPU {index}, debugfs names {holder}:"
                    " kept debugfs's"
                )
            continue
        if len(tids) == 1:
            st.decide(tids[0], "vcpu", index, st.comms[tids[0]] or None, "kvm-syscall")
        elif len(tids) > 1:
            st.notes.append(f"kvm: threads {_fmt(tids)} all claim vCPU {index}: none taken")
    missing = still_missing()
    if missing and not claims and not any(v.role == "vcpu" for v in st.verdicts.values()):
        st.notes.append(
            "kvm: no vCPU thread in KVM_RUN (VM paused with -S, not started, or every vCPU busy)"
        )


def _layer_debugfs_ns(st: _Pass, vm_fds: list[int], timeout: float) -> None:
    """KVM's vcpuN/pid files through a debugfs mounted in a child's private mount namespace."""
    try:
        found = debugfs.vcpu_pids_private(st.paths.sys, st.vmm.pid, timeout)
    except HostError as err:
        st.notes.append(f"debugfs-ns unavailable ({err}): vCPUs from the syscall files only")
        return
    _apply_debugfs(st, {fd: pids for fd, pids in found.items() if fd in vm_fds}, "debugfs-ns")


def _apply_debugfs(st: _Pass, found: debugfs.VcpuPids, layer: str) -> None:
    """vCPU index -> tid from KVM's debugfs (``vcpuN/pid``; 0 = has not run yet)."""
    for _vm_fd, pids in sorted(found.items()):
        for index, tid in sorted(pids.items()):
            if not tid:
                continue
            if st.alive(tid):
                st.decide(tid, "vcpu", index, st.comms[tid] or None, layer)
            elif tid not in st.tids:
                st.notes.append(f"{layer}: vCPU {index} thread {tid} is not a thread of the VMM")


def _kvm_run_index(
    fields: list[str], ioctl_nr: str | None, vcpu_fds: Mapping[int, int]
) -> int | None:
    """vCPU index if ``syscall`` fields read ioctl(<vcpu fd>, KVM_RUN, ...)."""
    if len(fields) < 3 or (ioctl_nr is not None and fields[0] != ioctl_nr):
        return None
    try:
        fd, request = int(fields[1], 16), int(fields[2], 16)
    except ValueError:
        return None
    if request != KVM_RUN:
        return None
    return vcpu_fds.get(fd)


def _wchan(st: _Pass, tid: int) -> str:
    try:
        return procfs.read_text(st.paths.proc, st.vmm.pid, "wchan", tid).strip()
    except HostError:
        return ""


# -- layer: remembered -----------------------------------------------------------------------
def _layer_remembered(st: _Pass, remembered: Mapping[int, ThreadLike]) -> None:
    taken = st.vcpu_indexes()
    for tid, rec in sorted(remembered.items()):
        if not st.alive(tid) or tid in st.verdicts:
            continue
        if rec.role not in ROLES or rec.role == "emulator":
            continue  # "emulator" is the default anyway: nothing to carry over
        index = _rec_index(rec) if rec.role == "vcpu" else None
        if rec.role == "vcpu":
            if index is None:
                continue  # a vCPU without its index is of no use to the planner
            if index in taken:
                st.notes.append(f"tid {tid}: remembered as vCPU {index}, now thread {taken[index]}")
                continue
            taken[index] = tid
        st.decide(tid, rec.role, index, rec.label, "remembered")


# -- helpers ---------------------------------------------------------------------------------
def _fmt(values: Iterable[int]) -> str:
    return ",".join(str(v) for v in values)
