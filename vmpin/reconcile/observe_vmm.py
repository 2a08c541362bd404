"""A sandbox's VMM as the host shows it now: found, its threads' roles known, their affinity read.

:class:`VmmObserver` owns the per-VMM half of observing (:mod:`.observe` composes it through
:mod:`.observe_sandbox`): locating the QEMU of a tracked sandbox, telling its threads apart
(the roles the store remembers for the same VMM and thread ids, else
:func:`vmpin.runtimes.threads.classify`, which may ask QMP), and reading each thread's actual
affinity beside the one vmpin recorded before its first pin (the undo of invariant 4).  An
untracked VMM's threads are read unclassified: vmpin plans nothing for them but undo.

Identity is (pid, start time): roles remembered under a VMM's pid are reused only while its
start time is the one they were recorded with, so a pid reused by another process never
inherits them.  Reading only: the store, affinities and cgroups are not written here.
"""

from __future__ import annotations

import os

from vmpin.core.cpuset import parse_cpus
from vmpin.core.errors import HostError, ProcessGone
from vmpin.linux import procfs
from vmpin.reconcile.observation import (
    FULL,
    Scope,
    ThreadObs,
    VmmKey,
    VmmObs,
)
from vmpin.state.records import ThreadRec

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Container, Iterable, Mapping, Sequence

    from vmpin.core.cpuset import CpuSet
    from vmpin.linux.paths import HostPaths
    from vmpin.reconcile.observation import Recorded
    from vmpin.state.records import SandboxRec


class VmmObserver:
    """Reads VMMs and their threads; holds nothing between passes (the store remembers roles)."""

    __slots__ = ("paths", "qmp_timeout")

    def __init__(self, paths: HostPaths, qmp_timeout: float = 0.3) -> None:
        self.paths = paths
        self.qmp_timeout = qmp_timeout

    def tracked(
        self, recorded: Recorded, rec: SandboxRec, scope: Scope = FULL
    ) -> tuple[VmmObs | None, bool, list[str]]:
        """The VMM of the tracked sandbox ``rec``, whether the recorded one is gone, and notes.

        ``scope``: a VMM whose threads it does not read is only located."""
        # (imported here, not with the module: a pass over runc containers needs none of it;
        # "from <module> import" names, since "from <package> import <module>" costs a
        # Python-level importlib call on every sandbox)
        from vmpin.runtimes.vmm import Vmm, find_vmm, still_running

        # The QEMU a pass classified before (its threads are remembered under its pid and
        # start time, taken from a checked command line) is recognised by two small reads:
        # the pidfile still names it and its start time is unchanged.  Anything else goes
        # through find_vmm: the pidfile, then the recorded pid, then a scan of /proc.
        vmm: Vmm | None = None
        if rec.vmm_pid and rec.vmm_start is not None:
            key = (rec.id, rec.vmm_pid, rec.vmm_start)
            if key in recorded.threads and still_running(
                self.paths, rec.id, rec.vmm_pid, rec.vmm_start
            ):
                vmm = Vmm(rec.vmm_pid, rec.vmm_start, (), False)  # (cmdline unread)
        if vmm is None:
            vmm = find_vmm(self.paths, rec.id, hint_pid=rec.vmm_pid, scan=True)
        if vmm is None:
            if rec.vmm_pid and rec.vmm_start is not None:
                return None, True, [f"VMM pid {rec.vmm_pid} is gone"]
            return None, False, ["no VMM found yet for this sandbox"]
        if not scope.reads_threads(rec.id):
            return VmmObs(vmm.pid, vmm.start), False, []  # located, its threads not read
        originals = recorded.originals
        affinity = scope.affinity
        at = VmmKey(rec.id, vmm.pid, vmm.start).orig_prefix()
        remembered = recorded.threads.get((rec.id, vmm.pid, vmm.start), {})
        try:
            current = set(procfs.tids(self.paths.proc, vmm.pid))
        except ProcessGone:
            return None, False, [f"VMM pid {vmm.pid} exited during the pass"]
        missing_before = recorded.missing.get(VmmKey(rec.id, vmm.pid, vmm.start).missing())
        if (
            remembered
            and not missing_before
            and self._complete(remembered, current)
            and not self._new_kthreads(recorded, vmm.pid, remembered, current)
        ):
            # Fast path: the same threads as last time, their roles are known; no QMP.
            roles = list(remembered.values())
            threads = self._threads(vmm.pid, at, roles, originals, affinity)
            layers = tuple(sorted({t.layer for t in roles}))
            return VmmObs(vmm.pid, vmm.start, threads, False, (), layers), False, []
        from vmpin.runtimes.threads import VmmThread, classify

        listed: set[int] | None = current  # (the task/ listing classify may take over)
        if not vmm.cmdline:
            # classifying reads the command line (iothread ids, debug-threads)
            was = (vmm.pid, vmm.start)
            vmm = find_vmm(self.paths, rec.id, hint_pid=rec.vmm_pid, scan=True)
            if vmm is None:
                return None, False, [f"VMM pid {rec.vmm_pid} exited during the pass"]
            if (vmm.pid, vmm.start) != was:
                listed = None  # another process: its threads are listed anew
            at = VmmKey(rec.id, vmm.pid, vmm.start).orig_prefix()
            remembered = recorded.threads.get((rec.id, vmm.pid, vmm.start), {})
        sock = os.path.join(self.paths.vm_dir, rec.id, "qmp.sock")
        result = classify(
            self.paths,
            vmm,
            sock if os.path.exists(sock) else None,
            {t.tid: VmmThread(t.tid, t.role, t.idx, t.label, t.layer) for t in remembered.values()},
            qmp_timeout=self.qmp_timeout,
            vhost_kthreads=self._vhost_index(recorded),
            tids=listed,
        )
        recs = [ThreadRec(t.tid, t.role, t.index, t.label, t.layer) for t in result.threads]
        threads = self._threads(vmm.pid, at, recs, originals, affinity)
        obs = VmmObs(
            vmm.pid,
            vmm.start,
            threads,
            True,
            tuple(result.missing_vcpus),
            tuple(result.layers),
            tuple(result.notes),
            as_recorded=(
                missing_before == ",".join(map(str, result.missing_vcpus))
                and recs == list(remembered.values())
            ),
        )
        return obs, False, []

    def untracked_threads(
        self, sid: str, pid: int, start: int, originals: Mapping[str, str], affinity: bool = True
    ) -> tuple[ThreadObs, ...]:
        """An untracked VMM's threads, unclassified (vmpin plans nothing for them but undo)."""
        try:
            tids = procfs.tids(self.paths.proc, pid)
        except ProcessGone:
            return ()
        at = VmmKey(sid, pid, start).orig_prefix()
        recs = [ThreadRec(tid, "emulator", None, None, "") for tid in tids]
        return self._threads(pid, at, recs, originals, affinity)

    def still(self, rec: SandboxRec, obs: VmmObs | None) -> bool:
        """Whether :meth:`tracked` would find ``obs`` again now, the store's records as they
        were when it did (the caller knows they are): the VMM still the recorded process,
        the same threads, each with the affinity and name it had.  For the agent's ``audit``
        (issue 28), which it makes cheaper than a pass.

        ``obs`` None: no VMM was found, and none is now (find_vmm as :meth:`tracked` calls
        it).  Else only a VMM :meth:`tracked` found on its fast path is checked (the recorded
        VMM, roles remembered, every thread read): anything else is False, and a pass of its
        own finds what it is.  It builds nothing, and reads less than :meth:`tracked` (at 500
        sandboxes half the time of a pass's reads of the VMMs, a quarter of an observation):

        - the VMM: its pidfile still names it (one ``lstat``), and it has as many threads as
          it had (the link count of its ``task/``: procfs gives it one link per thread, so
          one ``stat`` where the listing costs more than twice as much), each of them answering
          below -- so it is the process they were read from (one that took its pid since
          would hold these very thread ids), and its ``stat`` (start time, state) is read
          only for a VMM of one thread, which that does not tell from a successor or a
          zombie;
        - each thread: its affinity (one syscall; a thread gone answers ESRCH) and, unless
          labelled, its comm.  Together with the count, the same threads: a thread gone
          and another come in its place is seen unless the gone one's id was taken by
          another process's thread meanwhile (ids come round only after ``pid_max`` of
          them: what a pass takes on trust too, a VMM's thread ids listed as they were
          being the threads it classified);
        - with a vhost thread (before Linux 6.4 a kernel thread outside ``task/``), or a
          /proc that is not this process's own, the ``task/`` listing, as a pass reads it.
        """
        from vmpin.runtimes.vmm import find_vmm, read_pidfile, still_running

        if obs is None:
            return find_vmm(self.paths, rec.id, hint_pid=rec.vmm_pid, scan=True) is None
        pid = obs.pid
        if obs.classified or (rec.vmm_pid, rec.vmm_start) != (pid, obs.start):
            return False
        if read_pidfile(f"{self.paths.vm_dir}/{rec.id}/pid") != pid:
            return False
        proc = self.paths.proc
        try:
            if not procfs.is_own(proc) or any(t.role == "vhost" for t in obs.threads):
                current = set(procfs.tids(proc, pid))
                if not self._complete({t.tid: t for t in obs.threads}, current):
                    return False
                count = len(current)
            else:
                count = os.stat(f"{proc}/{pid}/task").st_nlink - 2
                if count != len(obs.threads):
                    return False
        except (OSError, ProcessGone):  # (the VMM gone)
            return False
        if count < 2 and not still_running(self.paths, rec.id, pid, obs.start):
            return False
        read, affinity = self._read, procfs.thread_affinity(proc, pid)
        try:
            for t in obs.threads:
                if t.actual is None or read(pid, t.tid, t.role, t.label, affinity) != (
                    t.actual, t.name
                ):  # fmt: skip
                    return False
        except HostError:  # (ProcessGone too: a thread gone since)
            return False
        return True

    def _new_kthreads(
        self, recorded: Recorded, pid: int, remembered: Mapping[int, ThreadRec], current: set[int]
    ) -> bool:
        """Whether a pass that reads everything (``recorded.kthreads``) finds a vhost kernel
        thread of this VMM that its remembered threads lack: one whose device was set up
        after the VMM was classified leaves its ``task/`` as it was, so the fast path would
        keep it unpinned for good.  The kernel threads are listed once per such pass, and
        only where the kernel can have vhost kernel threads at all
        (:func:`~vmpin.runtimes.threads.vhost_kthreads_possible`)."""
        if not recorded.kthreads:
            return False
        return _kthread_unknown(self._vhost_index(recorded), pid, current, remembered)

    def _vhost_index(self, recorded: Recorded) -> Mapping[int, Sequence[tuple[int, str]]]:
        """The pass's vhost kernel threads by owner, listed at its first need."""
        if recorded.vhost is None:
            from vmpin.runtimes.threads import find_vhost_kthreads

            recorded.vhost = find_vhost_kthreads(self.paths)
        return recorded.vhost

    def kthreads_known(self, vmms: Sequence[VmmObs]) -> bool:
        """Whether every vhost kernel thread of these VMMs is among their observed threads:
        what a pass that reads everything looks for (:meth:`_new_kthreads`), for
        :meth:`.observe.Observer.still`.  One listing of the kernel threads, where the kernel
        can have vhost ones at all."""
        if not vmms:
            return True
        from vmpin.runtimes.threads import find_vhost_kthreads

        index = find_vhost_kthreads(self.paths)
        if not index:
            return True
        for vmm in vmms:
            tids = {t.tid for t in vmm.threads}
            if _kthread_unknown(index, vmm.pid, tids, tids):
                return False
        return True

    def _complete(self, known: Mapping[int, ThreadRec | ThreadObs], current: set[int]) -> bool:
        """The same threads as last time (``known``: by tid, as remembered or observed; vhost
        kthreads before Linux 6.4 live outside ``task/`` and must merely still exist)."""
        if known.keys() == current:
            return True
        outside = set(known) - current
        if set(known) - outside != current:
            return False
        return all(
            known[tid].role == "vhost" and os.path.exists(os.path.join(self.paths.proc, str(tid)))
            for tid in outside
        )

    def _read(
        self, pid: int, tid: int, role: str, label: str | None, affinity: Callable[[int], CpuSet]
    ) -> tuple[CpuSet, str]:
        """Thread ``tid`` of the VMM ``pid``: its actual affinity (``affinity``: the VMM's
        :func:`~vmpin.linux.procfs.thread_affinity`) and its name (a labelled thread is
        reported by its label: its comm is not read).  Raises ProcessGone or HostError as
        procfs does."""
        proc = self.paths.proc
        if role == "vhost" and not procfs.exists(proc, pid, tid):
            # vhost workers before Linux 6.4 are kernel threads of their own, not in task/
            return procfs.affinity(proc, tid), label or procfs.comm(proc, tid)
        return affinity(tid), label or procfs.comm(proc, pid, tid)

    def _threads(
        self,
        pid: int,
        orig_at: str,
        recs: Iterable[ThreadRec],
        originals: Mapping[str, str],
        affinity: bool = True,
    ) -> tuple[ThreadObs, ...]:
        """The threads ``recs`` of the VMM ``pid`` as they are now (``affinity`` False: their
        roles only, nothing read); ``orig_at``: the VMM's :meth:`VmmKey.orig_prefix`."""
        if not affinity:
            return tuple([ThreadObs(t.tid, t.role, t.idx, t.label, t.layer, t.label) for t in recs])
        read, reader = self._read, procfs.thread_affinity(self.paths.proc, pid)
        # a thread created after vmpin's first pin inherited the pin: what the VMM had before
        # (its main thread's record) is what it is to get back
        main = originals.get(f"{orig_at}{pid}")
        out = []
        for t in recs:
            orig_text = originals.get(f"{orig_at}{t.tid}") or main
            original = parse_cpus(orig_text) if orig_text else None
            try:
                actual, name = read(pid, t.tid, t.role, t.label, reader)
            except ProcessGone:
                out.append(ThreadObs(t.tid, t.role, t.idx, t.label, t.layer, original=original))
                continue
            except HostError as err:
                out.append(ThreadObs(
                    t.tid, t.role, t.idx, t.label, t.layer, original=original, error=str(err)
                ))  # fmt: skip
                continue
            out.append(ThreadObs(t.tid, t.role, t.idx, t.label, t.layer, name, actual, original))
        return tuple(out)


def _kthread_unknown(
    index: Mapping[int, Sequence[tuple[int, str]]],
    pid: int,
    tids: Iterable[int],
    known: Container[int],
) -> bool:
    """Whether ``index`` (vhost kernel threads by owner) holds one owned by the VMM ``pid``
    or one of its threads ``tids`` that ``known`` lacks."""
    return any(kpid not in known for owner in (pid, *tids) for kpid, _ in index.get(owner, ()))


__all__ = ["VmmObserver"]

