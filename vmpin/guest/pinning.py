"""Pinning one container to its vCPUs: its cgroup when it has one, else every thread.

The hook and the follower both pin through :func:`pin_with`, so an update lands where the
start-time pin did -- the same cgroup, or the same process tree -- by the same code.  A
container without a cpuset cgroup of its own is pinned by ``sched_setaffinity`` on each
thread of its process tree, repeated until no new thread shows up (a thread inherits its
creator's mask, pinned or not), and every task is read back: a pin is only done when the
kernel says so.
"""

from __future__ import annotations

import os
from typing import NamedTuple

from vmpin.core.cpuset import CpuSet
from vmpin.core.errors import CpuSetError, HostError, ProcessGone
from vmpin.guest.cgroups import Cgroup, cgroup_tasks, find_cgroup, pin_cgroup
from vmpin.guest.common import GuestError, format_cpus
from vmpin.linux import procfs
from vmpin.linux.affinity import SchedAffinity


# -- procfs ------------------------------------------------------------------------------------
def task_ids(proc: str, pid: int) -> list[int]:
    """The thread ids of ``pid``; raises GuestError when the process is gone."""
    try:
        return procfs.tids(proc, pid)
    except HostError:
        raise GuestError(f"process {pid} is gone") from None


def children(proc: str, pid: int, tid: int) -> list[int]:
    """Children of one thread (``task/TID/children``, CONFIG_PROC_CHILDREN); [] if unknown."""
    try:
        # only under task/TID: /proc/PID has no children file, even for the main thread
        text = procfs.read_text(proc, pid, os.path.join("task", str(tid), "children"))
    except HostError:
        return []
    return [int(c) for c in text.split() if c.isdigit()]


def cpus_allowed(proc: str, tid: int) -> frozenset[int] | None:
    """``Cpus_allowed_list`` of a task (``/proc/TID`` works for any thread); None if gone."""
    try:
        return frozenset(procfs.cpus_allowed(proc, tid))
    except (HostError, CpuSetError):
        return None


# -- affinity ---------------------------------------------------------------------------------
def set_affinity(tid: int, cpus: frozenset[int]) -> bool:
    """sched_setaffinity on one thread; False when it exited meanwhile (nothing to pin).

    The read-back is :meth:`SchedAffinity.set`'s; :func:`verify_tasks` checks the result.
    """
    try:
        _AFFINITY.set(tid, CpuSet(cpus))
    except ProcessGone:
        return False
    except HostError as err:
        raise GuestError(str(err)) from None
    return True


_AFFINITY = SchedAffinity()


def process_tree(proc: str, pid: int) -> list[int]:
    """Every thread of ``pid`` and of its descendants (best effort for the latter)."""
    seen_pids = {pid}
    todo = [pid]
    tids: list[int] = []
    while todo:
        p = todo.pop()
        try:
            threads = task_ids(proc, p)
        except GuestError:
            if p == pid:
                raise
            continue
        tids.extend(threads)
        for t in threads:
            for child in children(proc, p, t):
                if child not in seen_pids:
                    seen_pids.add(child)
                    todo.append(child)
    return tids


def pin_threads(proc: str, pid: int, cpus: frozenset[int]) -> int:
    """Pin every thread of the process tree, again until no new thread shows up; how many.

    A thread created while we work inherits its creator's mask, pinned or not; a few rounds
    catch the ones that were born from a thread before it was pinned.
    """
    done: set[int] = set()
    for _ in range(5):
        new = [t for t in process_tree(proc, pid) if t not in done]
        if not new:
            break
        for tid in new:
            if set_affinity(tid, cpus):
                done.add(tid)
    return len(done)


def verify_tasks(proc: str, tids: list[int], cpus: frozenset[int], fix: bool) -> int:
    """Every live task's ``Cpus_allowed_list`` must be ``cpus``; with ``fix`` try once more."""
    checked = 0
    for tid in tids:
        actual = cpus_allowed(proc, tid)
        if actual is None:
            continue  # exited
        if actual != cpus and fix and set_affinity(tid, cpus):
            actual = cpus_allowed(proc, tid)
            if actual is None:
                continue
        if actual != cpus:
            raise GuestError(
                f"task {tid} runs on vCPUs {format_cpus(actual)} after pinning to "
                f"{format_cpus(cpus)}"
            )
        checked += 1
    return checked


# -- the pin -----------------------------------------------------------------------------------
class Result(NamedTuple):
    method: str  # "cgroup" | "affinity"
    where: str
    tasks: int
    notes: tuple[str, ...]
    #: the cgroup whose cpuset.cpus was written (None: affinity), for the follower's record
    cgroup: Cgroup | None = None


def pin(
    proc: str, cgroup_root: str, pid: int, cpus: frozenset[int], widen_parents: bool = False
) -> Result:
    """Pin process ``pid``'s container to ``cpus``: its cgroup when it has one, else threads.

    When the cgroup cannot be written for a reason affinity does not share (a read-only
    cgroupfs, say), the threads are pinned instead and a note says why.
    """
    if not cpus:
        raise GuestError("the map gives no vCPU")
    return pin_with(proc, pid, cpus, find_cgroup(proc, cgroup_root, pid), widen_parents)


def pin_with(
    proc: str, pid: int, cpus: frozenset[int], cg: Cgroup | None, widen_parents: bool = False
) -> Result:
    """:func:`pin` once the cgroup is known (None: pin the threads of ``pid``'s tree).

    The follower calls this with what the hook recorded, so that an update lands where the
    start-time pin did -- the same cgroup, or the same process tree -- by the same code.
    """
    if not cpus:
        raise GuestError("the map gives no vCPU")
    cg_err: GuestError | None = None
    if cg is not None:
        try:
            notes = pin_cgroup(cg, cpus, widen_parents)
            n = verify_tasks(proc, cgroup_tasks(cg), cpus, fix=True)
            return Result("cgroup", cg.path, n, tuple(notes), cg)
        except GuestError as err:
            if not err.fallback:
                raise
            cg_err = err
    try:
        pin_threads(proc, pid, cpus)
        n = verify_tasks(proc, process_tree(proc, pid), cpus, fix=True)
    except GuestError as err:
        if cg_err is None:
            raise
        raise GuestError(f"{cg_err}; pinning its threads failed too: {err}") from None
    notes = [] if cg_err is None else [f"cgroup not pinned ({cg_err}), threads were"]
    return Result("affinity", f"pid {pid}", n, tuple(notes))
