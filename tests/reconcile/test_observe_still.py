"""``Observer.still``: whether observing the node now would give the last observation again, the
store unchanged -- what lets the agent answer ``vmpin audit`` without a pass (issue 28), so it
must be False whenever a pass would observe something else, and True on a node that has not
moved (else the agent's audit costs a pass, as before).

On real fake VMMs (tests/support/fakevmm.py) and a node of every shape an observation
distinguishes: VMMs pinned, one without a CPU set, one gone since it was recorded, one never
started, an untracked VMM in the VM dir, a runc sandbox.  Each change behind vmpin's back --
a thread moved by hand, a thread come, a VMM gone, a sandbox dir come, kubelet's checkpoint
written -- makes it False, and a new observation differs too; put back, True again.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pytest_mock import MockerFixture

from tests.support import fakevmm
from tests.support.kubelet_util import write_checkpoint
from tests.support.session import new_id
from vmpin.core.cpuset import CpuSet
from vmpin.linux.paths import HostPaths
from vmpin.reconcile.observe import FULL, Observer, Scope
from vmpin.reconcile.reconciler import Reconciler
from vmpin.state.records import ContainerRec, SandboxRec
from vmpin.state.store import Store


@pytest.fixture
def node(paths: HostPaths, vm_dir: Path) -> Iterator[dict[str, fakevmm.FakeVmm]]:
    started: dict[str, fakevmm.FakeVmm] = {}
    try:
        for sid in ("a", "b", "c", "g", "u"):
            started[sid] = fakevmm.start(vm_dir, sid, vcpus=2)
        with Store(paths.state_dir) as store:
            for sid, cpus, runtime in (
                ("a", "0", "kata"), ("b", "1", "kata"), ("c", None, "kata"),
                ("g", "1", "kata"), ("n", "0", "kata"), ("r", "0", "runc"),
            ):  # fmt: skip
                pod = f"pod-{sid}"
                store.put_sandbox(SandboxRec(sid, runtime, pod_uid=pod))
                store.put_container(ContainerRec(sid, sid, True, name="pause", pod_uid=pod))
                if cpus is not None:
                    store.put_container(
                        ContainerRec(
                            f"{sid}-app", sid, False, name="app", pod_uid=pod,
                            cpus=CpuSet.parse(cpus), cpus_source="spec",
                        )
                    )  # fmt: skip
        yield started
    finally:
        for v in started.values():
            v.kill()


def _settled(rec: Reconciler) -> None:
    """Passes until one observes what the last did (roles recorded, threads pinned)."""
    rec.reconcile()
    rec.reconcile()
    assert rec.observe() == rec.observe()


@pytest.mark.multi_cpu
def test_still_is_false_exactly_when_a_new_observation_differs(
    paths: HostPaths, node: dict[str, fakevmm.FakeVmm], vm_dir: Path
) -> None:
    with Store(paths.state_dir) as store:
        rec = Reconciler(paths, store, publish=False)
        _settled(rec)
        node["g"].kill()  # recorded, then gone: observed without its VMM, as "n" never had one
        _settled(rec)
        checker = Observer(paths, rec.policy)  # (the agent's views' own)

        def still() -> bool:
            obs = rec.observe()
            assert checker.still(obs)  # the node as it was observed
            return obs == rec.observe()

        obs = rec.observe()
        assert still() and checker.still(obs)
        assert {s.id for s in obs.sandboxes} == {"a", "b", "c", "g", "n", "r", "u"}

        # a vCPU moved by hand: drift the audit must report
        vcpu = next(t.tid for t in obs.sandbox("a").vmm.threads if t.role == "vcpu")  # type: ignore[union-attr]
        was = os.sched_getaffinity(vcpu)
        os.sched_setaffinity(vcpu, {0, 1} - was)
        assert not checker.still(obs) and rec.observe() != obs
        os.sched_setaffinity(vcpu, was)
        assert checker.still(obs) and rec.observe() == obs

        # an untracked VMM's thread moved too (it holds where it runs)
        other = next(t.tid for t in obs.sandbox("u").vmm.threads)  # type: ignore[union-attr]
        was = os.sched_getaffinity(other)
        os.sched_setaffinity(other, {0, 1} - was if len(was) == 1 else {0})
        assert not checker.still(obs) and rec.observe() != obs
        os.sched_setaffinity(other, was)
        assert checker.still(obs)

        # a thread come (a vCPU hot-plugged, a vhost worker): the pass classifies it; a VMM
        # with a vhost thread is checked by its task/ listing, not its thread count
        for come in (node["b"].hotplug_vcpu, node["b"].add_vhost):
            before = len(node["b"].tids())
            come()
            deadline = time.monotonic() + 10
            while len(node["b"].tids()) <= before and time.monotonic() < deadline:
                time.sleep(0.01)
            assert not checker.still(obs) and rec.observe() != obs
            _settled(rec)
            obs = rec.observe()
            assert checker.still(obs)
        vmm = obs.sandbox("b").vmm  # type: ignore[union-attr]
        assert vmm is not None and "vhost" in {t.role for t in vmm.threads}
        vhost = next(t.tid for t in vmm.threads if t.role == "vhost")
        was = os.sched_getaffinity(vhost)
        os.sched_setaffinity(vhost, {0, 1} - was if len(was) == 1 else {0})
        assert not checker.still(obs) and rec.observe() != obs
        os.sched_setaffinity(vhost, was)
        assert checker.still(obs)

        # kubelet's checkpoint written: every container's CPUs may come from it
        write_checkpoint(paths.kubelet_state, "0", {"pod-a": {"app": "1"}})
        assert not checker.still(obs) and rec.observe() != obs
        _settled(rec)
        obs = rec.observe()
        assert checker.still(obs)

        # a sandbox dir come into the VM dir (an untracked VMM): the pass observes it
        node["v"] = fakevmm.start(vm_dir, "v", vcpus=1)
        assert not checker.still(obs) and rec.observe() != obs
        node["v"].kill()
        os.unlink(vm_dir / "v" / "pid")
        obs = rec.observe()
        assert checker.still(obs)

        # a VMM gone: its sandbox is observed without one
        node["c"].kill()
        assert not checker.still(obs) and rec.observe() != obs


def test_what_it_cannot_check_is_false(paths: HostPaths, node: dict[str, fakevmm.FakeVmm]) -> None:
    """A narrower scope than a pass's, or libvirt's domains (read each pass): False."""
    with Store(paths.state_dir) as store:
        rec = Reconciler(paths, store, publish=False)
        _settled(rec)
        checker = Observer(paths, rec.policy)
        assert checker.still(rec.observe(FULL))
        assert not checker.still(rec.observe(Scope(guest_maps=False)))
        with_domains = Observer(paths, rec.policy, domains=object())  # type: ignore[arg-type]
        assert not with_domains.still(rec.observe(FULL))


@pytest.mark.multi_cpu
@pytest.mark.runc
@pytest.mark.cgroup_v1
def test_a_runc_cgroup_written_by_hand_is_seen(paths: HostPaths, tmp_path: Path) -> None:
    """A runc container's cgroup cpuset, written behind vmpin's back: False, as a pass sees."""
    from tests.support.runc_util import RuncSession

    with RuncSession(paths, tmp_path / "runc-work") as runc:
        cid = new_id("vmpin-still")
        runc.run(cid, cpus="1")
        cg = Path(f"/sys/fs/cgroup/cpuset/{cid}/cpuset.cpus")
        with Store(paths.state_dir) as store:
            rec = Reconciler(paths, store, publish=False)
            _settled(rec)
            obs = rec.observe()
            assert [c.cgroup_cpus for s in obs.sandboxes for c in s.containers] == [
                CpuSet.parse("1")
            ]
            checker = Observer(paths, rec.policy)
            assert checker.still(obs)
            cg.write_text("0")
            assert not checker.still(obs) and rec.observe() != obs
            cg.write_text("1")
            assert checker.still(obs) and rec.observe() == obs
        runc.delete(cid)


@pytest.mark.multi_cpu
def test_still_is_false_when_a_vhost_kernel_thread_came(
    paths: HostPaths, node: dict[str, fakevmm.FakeVmm], mocker: MockerFixture
) -> None:
    """A vhost worker that came as a kernel thread after its VMM was classified (before
    Linux 6.4; a sleeping process stands in for it behind the test's own index of kernel
    threads, this kernel having no vhost module): a new observation classifies it, so still
    is False; once observed, True again."""
    import subprocess

    from vmpin.runtimes import threads

    index: dict[int, list[tuple[int, str]]] = {}
    mocker.patch.object(threads, "find_vhost_kthreads", side_effect=lambda p: dict(index))
    with Store(paths.state_dir) as store:
        rec = Reconciler(paths, store, publish=False)
        _settled(rec)
        checker = Observer(paths, rec.policy)
        obs = rec.observe()
        assert checker.still(obs)
        worker = subprocess.Popen(["sleep", "60"])
        try:
            owner = node["a"].pid
            index[owner] = [(worker.pid, f"vhost-{owner}")]
            assert not checker.still(obs) and rec.observe() != obs
            _settled(rec)
            obs = rec.observe()
            assert checker.still(obs)
            vmm = obs.sandbox("a").vmm  # type: ignore[union-attr]
            assert vmm is not None and worker.pid in {t.tid for t in vmm.threads}
        finally:
            worker.kill()
            worker.wait()
