"""An event's pass reads the host for the sandboxes it names, and plans again only what moved,
not the whole node (issue 28:
churn's update round trips had grown with the node since passes went node-wide).

Counted on real fake VMMs (tests/support/fakevmm.py), never timed (bench/bench_churn.py
times it): the /proc reads of another sandbox's threads, the affinity writes.  And what such
a pass must still do: plan every sandbox (a change in one moves another's plan), find a
sandbox whose records changed, and not pin again what the last pass pinned; what changed
behind vmpin's back is the periodic pass's, which reads everything.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from pytest_mock import MockerFixture

from tests.support import fakevmm
from tests.support.counting import CountingAffinity
from tests.support.session import new_id
from vmpin.core.cpuset import CpuSet
from vmpin.linux import procfs
from vmpin.linux.affinity import SchedAffinity
from vmpin.linux.paths import HostPaths
from vmpin.reconcile import plan as plan_module
from vmpin.reconcile.reconciler import Reconciler
from vmpin.state.records import ContainerRec, SandboxRec
from vmpin.state.store import Store


def _sandbox(store: Store, vmms: Callable[[str], fakevmm.FakeVmm], cpus: str) -> tuple[str, int]:
    sid = new_id("ev")
    vmm = vmms(sid, vcpus=1, iothreads=())
    store.put_sandbox(SandboxRec(sid, "kata"))
    store.put_container(ContainerRec(f"{sid}-app", sid, False, name="app",
                                     cpus=CpuSet.parse(cpus), cpus_source="spec"))  # fmt: skip
    return sid, vmm.pid


@pytest.mark.multi_cpu
def test_an_event_pass_reads_only_its_sandboxes_and_plans_the_node(
    paths: HostPaths, vmms: Callable[[str], fakevmm.FakeVmm], mocker: MockerFixture
) -> None:
    with Store(paths.state_dir) as store:
        a, _ = _sandbox(store, vmms, "0")
        b, b_pid = _sandbox(store, vmms, "1")
        counter = CountingAffinity()  # (b: its id and VMM pid)
        rec = Reconciler(paths, store, affinity=counter, publish=False)
        rec.reconcile()  # start-up: every thread pinned where its sandbox's mask is
        assert counter.sets > 0
        # the next event's pass finds what the last one pinned where it left it: no write
        counter.sets = 0
        rec.reconcile([a], fresh={a})
        assert counter.sets == 0
        # b's threads are not read for a's event, nor is b planned again (plan_node's memo:
        # the same observation under the same node-wide inputs)
        reads = mocker.spy(procfs, "affinity")
        planned = mocker.spy(plan_module, "_plan_sandbox")
        rec.reconcile([a], fresh={a})
        assert all(call.args[1] != b_pid for call in reads.call_args_list)
        assert reads.call_count > 0  # (a's are)
        assert all(call.args[0].id != b for call in planned.call_args_list)
        # a's container moved within its own CPU (same plan input for b): only a re-planned
        store.set_container_cpus(f"{a}-app", CpuSet.parse("0"), "update")
        planned.reset_mock()
        rec.reconcile([a], fresh={a})
        assert [call.args[0].id for call in planned.call_args_list] == [a]
        # ... but b is planned: a moving onto b's CPU makes b's vCPU leave its 1:1 pin
        store.set_container_cpus(f"{a}-app", CpuSet.parse("1"), "update")
        [report] = rec.reconcile([a], fresh={a})
        assert report.mask == CpuSet.parse("1")
        plan = rec.last_plan
        assert plan is not None
        b_plan = plan.sandbox(b)
        assert b_plan is not None and b_plan.mode == "float", b_plan


@pytest.mark.multi_cpu
def test_drift_behind_vmpins_back_waits_for_the_pass_that_reads_everything(
    paths: HostPaths, vmms: Callable[[str], fakevmm.FakeVmm]
) -> None:
    with Store(paths.state_dir) as store:
        a, _ = _sandbox(store, vmms, "0")
        _, b_pid = _sandbox(store, vmms, "1")
        rec = Reconciler(paths, store, publish=False)
        rec.reconcile()
        real = SchedAffinity()
        real.set(b_pid, CpuSet.parse("0-1"))  # by hand
        rec.reconcile([a], fresh={a})
        assert real.get(b_pid) == CpuSet.parse("0-1")  # not read: not seen
        rec.reconcile()  # the periodic pass
        assert real.get(b_pid) == CpuSet.parse("1")


@pytest.mark.multi_cpu
def test_a_sandbox_whose_records_changed_is_read_afresh(
    paths: HostPaths, vmms: Callable[[str], fakevmm.FakeVmm]
) -> None:
    with Store(paths.state_dir) as store:
        a, _ = _sandbox(store, vmms, "0")
        b, b_pid = _sandbox(store, vmms, "1")
        rec = Reconciler(paths, store, publish=False)
        rec.reconcile()
        store.set_container_cpus(f"{b}-app", CpuSet.parse("0"), "update")  # not named below
        rec.reconcile([a], fresh={a})
        assert SchedAffinity().get(b_pid) == CpuSet.parse("0")
