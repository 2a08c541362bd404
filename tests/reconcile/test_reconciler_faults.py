"""Faults at the syscall edge, injected with pytest-mock into a pass over a real QEMU.

A thread that exits mid-pass is skipped; EPERM and EINVAL are reported on that thread, clearly,
and do not stop the others from being pinned.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from pytest_mock import MockerFixture

from tests.support.qemu_util import QemuHandle, launch, require_qemu
from tests.support.session import new_id
from vmpin.core.cpuset import CpuSet
from vmpin.linux.paths import HostPaths
from vmpin.reconcile.reconciler import Reconciler
from vmpin.state.records import ContainerRec, SandboxRec
from vmpin.state.store import Store

#: real QEMUs under KVM (vCPU threads named "CPU N/KVM"), pinned to host CPU 1.
pytestmark = [pytest.mark.qemu, pytest.mark.kvm, pytest.mark.multi_cpu]


@pytest.fixture
def sandbox(vm_dir: Path, paths: HostPaths) -> Iterator[tuple[QemuHandle, Store]]:
    require_qemu()
    sid = new_id("flt")
    q = launch(vm_dir, sid, smp=2, debug_threads=True, accel="kvm")
    store = Store(paths.state_dir)
    try:
        store.put_sandbox(SandboxRec(sid, "kata"))
        store.put_container(ContainerRec("c-" + sid, sid, False, cpus=CpuSet.parse("1")))
        yield q, store
    finally:
        store.close()
        q.kill()


def vcpu_tids(q: QemuHandle) -> dict[str, int]:
    out = {}
    for tid in q.tids():
        with open(f"/proc/{q.pid}/task/{tid}/comm") as f:
            out[f.read().strip()] = tid
    return out


def test_eperm_esrch_einval_are_per_thread(
    sandbox: tuple[QemuHandle, Store], paths: HostPaths, mocker: MockerFixture
) -> None:
    q, store = sandbox
    names = vcpu_tids(q)
    denied, vanished, rejected = names["CPU 0/KVM"], names["CPU 1/KVM"], names["IO io0"]
    real = os.sched_setaffinity

    def fake(tid: int, cpus: object) -> None:
        code = {denied: errno.EPERM, vanished: errno.ESRCH, rejected: errno.EINVAL}.get(tid)
        if code:
            raise OSError(code, os.strerror(code))
        real(tid, cpus)  # type: ignore[arg-type]

    mocker.patch("vmpin.linux.affinity.os.sched_setaffinity", side_effect=fake)
    [report] = Reconciler(paths, store).reconcile()
    by_tid = {t.tid: t for t in report.threads}
    assert by_tid[denied].action == "error"
    assert "not permitted" in (by_tid[denied].error or "")
    assert by_tid[vanished].action == "gone"
    assert by_tid[rejected].action == "error"
    assert "cpuset cgroup" in (by_tid[rejected].error or "")
    # every other thread was pinned despite the three failures
    others = [t for t in report.threads if t.tid not in (denied, vanished, rejected)]
    assert others and all(t.action == "pinned" and t.actual == CpuSet.parse("1")
                          for t in others)
    assert not report.errors


def test_thread_exiting_between_read_and_pin(
    sandbox: tuple[QemuHandle, Store], paths: HostPaths, mocker: MockerFixture
) -> None:
    """The kernel says ESRCH on the read-back: the pass goes on, that thread is 'gone'."""
    q, store = sandbox
    victim = vcpu_tids(q)["CPU 1/KVM"]
    real_get = os.sched_getaffinity

    def fake_get(tid: int) -> set[int]:
        if tid == victim:
            raise OSError(errno.ESRCH, "No such process")
        return real_get(tid)

    mocker.patch("vmpin.linux.affinity.os.sched_getaffinity", side_effect=fake_get)
    [report] = Reconciler(paths, store).reconcile()
    states = {t.tid: t.action for t in report.threads}
    assert states[victim] == "gone"
    assert {a for t, a in states.items() if t != victim} == {"pinned"}


def test_second_pass_touches_nothing(
    sandbox: tuple[QemuHandle, Store], paths: HostPaths, mocker: MockerFixture
) -> None:
    _, store = sandbox
    Reconciler(paths, store).reconcile()
    spy = mocker.spy(os, "sched_setaffinity")
    [report] = Reconciler(paths, store).reconcile()
    assert spy.call_count == 0
    assert {t.action for t in report.threads} == {"ok"}
