"""Set and read thread affinity with sched_setaffinity(2), errors translated once.


``os.sched_setaffinity`` takes a thread id as well as a process id: on Linux it acts on one
task, so each QEMU thread is pinned on its own (the whole point: vCPU threads 1:1).

Errors: ESRCH = the thread exited (ProcessGone, expected mid-pass); EPERM = not ours to pin
(PermissionDenied); EINVAL = the mask has no CPU the task may use, usually because its cpuset
cgroup does not contain it (AffinityRejected, with that hint).

After every write the mask is read back (tuna's habit): the kernel may narrow a mask to the
task's cpuset, and a pin that did not take must not be reported as done.
"""

from __future__ import annotations

import errno
import os

from vmpin.core.cpuset import CpuSet
from vmpin.core.errors import AffinityRejected, HostError, PermissionDenied, ProcessGone

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.lean.records)
if TYPE_CHECKING:
    from typing import Protocol

    class AffinityBackend(Protocol):
        """What the reconciler needs; tests inject their own (a counting wrapper, faults)."""

        def get(self, tid: int) -> CpuSet: ...
        def set(self, tid: int, cpus: CpuSet) -> CpuSet: ...


def _translate(err: OSError, tid: int, cpus: CpuSet | None) -> HostError:
    if err.errno == errno.ESRCH:
        return ProcessGone(f"tid {tid} is gone")
    if err.errno == errno.EPERM:
        return PermissionDenied(f"tid {tid}: not permitted to change affinity (need CAP_SYS_NICE)")
    if err.errno == errno.EINVAL and cpus is not None:
        return AffinityRejected(
            f"tid {tid}: kernel rejected CPUs {cpus} (offline, or outside the task's cpuset cgroup)"
        )
    return HostError(f"tid {tid}: sched affinity: {err.strerror}")


_MASKS: dict[frozenset[int], CpuSet] = {}


def current(tid: int) -> CpuSet:
    """The task's affinity now (``sched_getaffinity``: 0.3 us, where parsing ``status`` takes 24).

    A node's threads hold few distinct masks, so each is built once as a CpuSet (its checks
    cost more than the system call) and shared.
    """
    try:
        cpus = frozenset(os.sched_getaffinity(tid))
    except OSError as err:
        raise _translate(err, tid, None) from err
    return _mask(cpus)


def _mask(cpus: frozenset[int]) -> CpuSet:
    """The shared CpuSet of the mask ``cpus`` (see :func:`current`)."""
    found = _MASKS.get(cpus)
    if found is None:
        if len(_MASKS) > 4096:
            _MASKS.clear()
        found = _MASKS[cpus] = CpuSet(cpus)
    return found


class SchedAffinity:
    """The real thing: sched_getaffinity / sched_setaffinity."""

    def get(self, tid: int) -> CpuSet:
        return current(tid)

    def set(self, tid: int, cpus: CpuSet) -> CpuSet:
        """Set, then read back and return what the kernel actually holds: ``cpus`` itself
        when it holds just those (told by the numbers set, not by a CpuSet made and
        compared: a pass pins every thread of a VM whose set moved, issue 28), else the
        mask read back, as :func:`current` gives it (not read a second time)."""
        wanted = cpus.sorted()
        try:
            os.sched_setaffinity(tid, wanted)
        except OSError as err:
            raise _translate(err, tid, cpus) from err
        try:
            held = os.sched_getaffinity(tid)
        except OSError as err:
            raise _translate(err, tid, None) from err
        if len(held) == len(wanted) and held.issuperset(wanted):
            return cpus
        return _mask(frozenset(held))
