"""vmpin.linux.affinity: every pin read back; what the kernel holds is what is returned."""

from __future__ import annotations

import os
import threading

import pytest
from pytest_mock import MockerFixture

from vmpin.core.cpuset import CpuSet
from vmpin.core.errors import ProcessGone
from vmpin.linux import affinity
from vmpin.linux.affinity import SchedAffinity


def _in_a_thread(fn: object) -> object:
    """``fn(tid)`` run in a thread of ours that lives only for it (its affinity is its own)."""
    out: list[object] = []
    t = threading.Thread(target=lambda: out.append(fn(threading.get_native_id())))  # type: ignore[operator]
    t.start()
    t.join()
    return out[0]


def test_a_pin_that_took_returns_the_set_asked_for(mocker: MockerFixture) -> None:
    """Read back, and the very set asked for returned (no CpuSet made and compared again)."""
    cpus = CpuSet([min(os.sched_getaffinity(0))])
    reads = mocker.spy(affinity.os, "sched_getaffinity")
    got = _in_a_thread(lambda tid: (SchedAffinity().set(tid, cpus), affinity.current(tid)))
    assert got[0] is cpus and got[1] == cpus  # type: ignore[index]
    assert reads.call_count == 2  # the read-back, then current()


def test_a_pin_the_kernel_narrowed_returns_what_it_holds(mocker: MockerFixture) -> None:
    """A mask the kernel narrowed (a cpuset cgroup's) is returned as held, not as asked."""
    base = min(os.sched_getaffinity(0))
    asked = CpuSet([base, base + 1])
    mocker.patch.object(affinity.os, "sched_setaffinity")
    reads = mocker.patch.object(affinity.os, "sched_getaffinity", return_value={base})
    got = SchedAffinity().set(12345, asked)
    assert got == CpuSet([base]) and got != asked
    assert reads.call_count == 1  # the read-back's mask itself: not read a second time
    assert got is affinity.current(12345)  # (shared with current's, as a node's masks are)


def test_a_thread_gone_is_process_gone(mocker: MockerFixture) -> None:
    mocker.patch.object(affinity.os, "sched_setaffinity")
    mocker.patch.object(affinity.os, "sched_getaffinity", side_effect=ProcessLookupError(3, "x"))
    with pytest.raises(ProcessGone):
        SchedAffinity().set(12345, CpuSet([0]))
