"""The node plan and the audit, table-driven on fixture topologies: no QEMU, no host writes.

Each case builds an Observation by hand (what observe would read: sandboxes, VMM threads with
their actual affinity, runc containers, kubelet's checkpoint) and checks the plan against
issue 9's invariants 1-5, then what the audit of that same observation reports.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from tests.support.make_sysfs import SYSFS_FIXTURES
from vmpin.core.cpuset import CpuSet
from vmpin.core.planner import Policy
from vmpin.core.topology import Topology
from vmpin.linux.sysfs import read_topology
from vmpin.reconcile.audit import audit
from vmpin.reconcile.observe import ContainerObs, Observation, SandboxObs, ThreadObs, VmmObs
from vmpin.reconcile.plan import NodePlan, plan_node
from vmpin.runtimes.kubelet import Checkpoint
from vmpin.state.records import ContainerRec, SandboxRec


def cs(text: str) -> CpuSet:
    return CpuSet.parse(text)


def topo(name: str) -> Topology:
    return read_topology(str(SYSFS_FIXTURES / name))


def vmm_threads(base: int, nvcpus: int, actual: str, original: str | None = None) -> VmmObs:
    threads = [ThreadObs(base, "emulator", None, "qemu", "", "qemu", cs(actual),
                         cs(original) if original else None)]
    threads += [
        ThreadObs(base + 1 + i, "vcpu", i, f"CPU {i}/KVM", "", f"CPU {i}/KVM", cs(actual),
                  cs(original) if original else None)
        for i in range(nvcpus)
    ]
    return VmmObs(base, 1000 + base, tuple(threads))


def kata(sid: str, cpus: str | None, vmm: VmmObs | None, pod: str | None = None,
         tracked: bool = True) -> SandboxObs:
    pod = pod or f"pod-{sid}"
    rec = SandboxRec(sid, "kata", vmm.pid if vmm else None, vmm.start if vmm else None,
                     pod_uid=pod) if tracked else None
    ctrs = (
        ContainerObs(ContainerRec(f"{sid}-pause", sid, True, "pause", pod)),
        ContainerObs(ContainerRec(f"{sid}-app", sid, False, "app", pod,
                                  cpus=cs(cpus) if cpus else None, cpus_source="spec")),
    ) if tracked else ()
    return SandboxObs(sid, "kata", Policy(), rec, ctrs, vmm)


def runc(sid: str, cpus: str, actual: str, tid: int, pod: str | None = None) -> SandboxObs:
    pod = pod or f"pod-{sid}"
    rec = ContainerRec(sid, sid, False, "app", pod, cpus=cs(cpus), cpus_source="spec",
                       pid=tid, pid_start=5)
    c = ContainerObs(rec, True, cpus, None, None, cs(actual),
                     (ThreadObs(tid, "container", actual=cs(actual), layer="cgroup"),))
    return SandboxObs(sid, "runc", Policy(), SandboxRec(sid, "runc", pod_uid=pod), (c,))


def static(pool: str, entries: dict[str, dict[str, str]] | None = None) -> Checkpoint:
    return Checkpoint("static", cs(pool),
                      {p: {n: cs(c) for n, c in e.items()} for p, e in (entries or {}).items()}, 1)


@dataclass
class Case:
    name: str
    machine: str
    sandboxes: list[SandboxObs]
    check: Callable[[NodePlan, dict], None]  # type: ignore[type-arg]
    checkpoint: Checkpoint | None = None
    kinds: set[str] = field(default_factory=set)


def modes(plan: NodePlan) -> dict[str, str]:
    return {s.id: s.mode for s in plan.sandboxes}


def desired(plan: NodePlan, sid: str) -> dict[int, str | None]:
    sp = plan.sandbox(sid)
    assert sp is not None
    return {t.tid: None if t.desired is None else t.desired.to_list() for t in sp.threads}


def _inv1_floating_tracked(plan: NodePlan, result: dict) -> None:  # type: ignore[type-arg]
    # B has no CPU set and no pool is known: it floats over every CPU, so A may not go 1:1
    assert modes(plan)["a"] == "float"
    assert plan.sandbox("a").pinned_cpus == {}  # type: ignore[union-attr]


def _inv1_pool_allows_1to1(plan: NodePlan, result: dict) -> None:  # type: ignore[type-arg]
    # with kubelet's pool known, B floats over the pool only: A's exclusive CPUs are A's alone
    assert modes(plan)["a"] == "1:1"
    assert set(desired(plan, "b").values()) == {"0-1"}
    assert set(plan.sandbox("a").pinned_cpus) == {2, 3}  # type: ignore[union-attr]


def _inv1_untracked_vmm(plan: NodePlan, result: dict) -> None:  # type: ignore[type-arg]
    assert modes(plan)["a"] == "float"
    assert set(desired(plan, "stranger").values()) == {None}  # never touched: not vmpin's


def _inv1_runc_task_on_cpu(plan: NodePlan, result: dict) -> None:  # type: ignore[type-arg]
    # a runc container holds CPU 3: A's mask 2-3 is not A's alone
    assert modes(plan)["a"] == "float"


def _inv2_undo_to_pool(plan: NodePlan, result: dict) -> None:  # type: ignore[type-arg]
    # B lost its CPU set; its threads were on 4 (now pod X's): they float over the pool, and
    # the thread of a VMM vmpin no longer tracks is given the pool too, never its old CPUs
    assert set(desired(plan, "b").values()) == {"0-1"}
    assert set(desired(plan, "gone").values()) == {"0-1"}
    assert {t.kind for _, t in plan.undo} == {"undo"} and len(plan.undo) == 2
    assert plan.problems == ()


def _inv2_foreign(plan: NodePlan, result: dict) -> None:  # type: ignore[type-arg]
    kinds = [v for v in result["violations"] if v["kind"] == "foreign-on-exclusive"]
    assert kinds and kinds[0]["claimant"]["pod"] == "pod-x"


def _inv3_drift(plan: NodePlan, result: dict) -> None:  # type: ignore[type-arg]
    drift = [v for v in result["violations"] if v["kind"] == "drift"]
    assert {v["tid"] for v in drift} == {100, 101, 102}


def _inv4_undo(plan: NodePlan, result: dict) -> None:  # type: ignore[type-arg]
    assert modes(plan)["b"] == "none"
    assert set(desired(plan, "b").values()) == {"0-15"}
    stale = [v for v in result["violations"] if v["kind"] == "stale-pin"]
    assert {v["tid"] for v in stale} == {200, 201}


def _inv4_forgotten(plan: NodePlan, result: dict) -> None:  # type: ignore[type-arg]
    assert set(desired(plan, "gone").values()) == {"0-15"}
    assert {t for _, t in ((s, t.tid) for s, t in plan.undo)} == {300, 301}


def _inv5_conflict(plan: NodePlan, result: dict) -> None:  # type: ignore[type-arg]
    assert len(plan.conflicts) == 1
    c = plan.conflicts[0]
    assert c.cpus == cs("2")
    assert {c.first.sandbox, c.second.sandbox} == {"a", "r"}
    assert modes(plan)["a"] != "1:1"  # never merged into a pin
    [v] = [v for v in result["violations"] if v["kind"] == "conflict"]
    assert {cl["sandbox"] for cl in v["claimants"]} == {"a", "r"}


def _all_ok(plan: NodePlan, result: dict) -> None:  # type: ignore[type-arg]
    assert result["ok"], result["violations"]
    assert plan.problems == ()


CASES = [
    Case("inv1-floating-tracked-sandbox", "no-smt-server",
         [kata("a", "2-3", vmm_threads(100, 2, "2-3")),
          kata("b", None, vmm_threads(200, 1, "0-15"))],
         _inv1_floating_tracked),
    Case("inv1-pool-known", "no-smt-server",
         [kata("a", "2-3", vmm_threads(100, 2, "2-3")),
          kata("b", None, vmm_threads(200, 1, "0-1"))],
         _inv1_pool_allows_1to1, static("0-1")),
    Case("inv1-untracked-vmm-in-vm-dir", "no-smt-server",
         [kata("a", "2-3", vmm_threads(100, 2, "2-3")),
          kata("stranger", None, vmm_threads(400, 1, "0-15"), tracked=False)],
         _inv1_untracked_vmm),
    Case("inv1-runc-task", "no-smt-server",
         [kata("a", "2-3", vmm_threads(100, 2, "2-3")), runc("r", "3", "3", 500)],
         _inv1_runc_task_on_cpu),
    Case("inv2-undo-goes-to-pool", "no-smt-server",
         [kata("b", None, vmm_threads(200, 1, "4", original="0-15")),
          kata("gone", None, vmm_threads(300, 1, "4", original="4-15"), tracked=False)],
         _inv2_undo_to_pool, static("0-1", {"pod-x": {"app": "4"}})),
    Case("inv2-foreign-on-exclusive", "no-smt-server",
         [kata("b", None, vmm_threads(200, 1, "0-15"))],
         _inv2_foreign, static("0-1", {"pod-x": {"app": "4"}})),
    Case("inv3-drift", "xeon-gold-6258r-2s",
         [kata("a", "2-3", vmm_threads(100, 2, "0-111"))],
         _inv3_drift),
    Case("inv4-undo-when-no-cpu-set-left", "no-smt-server",
         [kata("b", None, vmm_threads(200, 1, "5", original="0-15"))],
         _inv4_undo),
    Case("inv4-forgotten-sandbox", "no-smt-server",
         [kata("gone", None, vmm_threads(300, 1, "5", original="0-15"), tracked=False)],
         _inv4_forgotten),
    Case("inv5-conflict", "no-smt-server",
         [kata("a", "2", vmm_threads(100, 1, "2"), pod="pod-a"), runc("r", "2", "2", 500, "pod-r")],
         _inv5_conflict, static("0-1")),
    Case("healthy-node", "offline-isolated",
         [kata("a", "2-3", vmm_threads(100, 2, "2-3")), runc("r", "4", "4", 500)],
         lambda plan, result: None),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_node_plan(case: Case) -> None:
    obs = Observation(tuple(case.sandboxes), case.checkpoint)
    plan = plan_node(obs, topo(case.machine))
    result = audit(plan)
    case.check(plan, result)
    # the node-wide rules hold on every plan (successor of planner.check_global)
    if not case.name.startswith("inv5"):
        assert plan.problems == ()


def test_healthy_node_audits_clean_after_plan_is_applied() -> None:
    """Feed the plan's desired sets back as actual: audit is ok (exit 0 iff invariants hold)."""
    t = topo("no-smt-server")
    obs = Observation((kata("a", "2-3", vmm_threads(100, 2, "0-15")),
                       kata("b", "4-5", vmm_threads(200, 2, "0-15")), runc("r", "6", "6", 500)))
    plan = plan_node(obs, t)
    assert not audit(plan)["ok"]
    fixed = []
    for s in obs.sandboxes:
        want = desired(plan, s.id)
        if s.vmm is None:
            fixed.append(s)
            continue
        threads = tuple(
            ThreadObs(x.tid, x.role, x.index, x.label, x.layer, x.name,
                      cs(want[x.tid]) if want[x.tid] else x.actual)
            for x in s.vmm.threads
        )
        fixed.append(SandboxObs(s.id, s.runtime, s.policy, s.record, s.containers,
                                VmmObs(s.vmm.pid, s.vmm.start, threads)))
    plan2 = plan_node(Observation(tuple(fixed)), t)
    assert modes(plan2) == {"a": "1:1", "b": "1:1", "r": "cgroup"}
    assert audit(plan2)["ok"], audit(plan2)["violations"]
    _all_ok(plan2, audit(plan2))


def _incomplete_vmm(seen: set[int], actual: Callable[[int], str]) -> VmmObs:
    """A 3-vCPU VMM (vCPU i = tid 101+i, main loop 100, KVM's named helper 110) as a pass that
    identified only the vCPUs ``seen`` reports it; ``actual(tid)``: each thread's affinity."""
    threads = [ThreadObs(100, "emulator", None, "qemu", "none", "qemu", cs(actual(100)))]
    threads += [
        ThreadObs(101 + i, "vcpu", i, None, "kvm-syscall", "qemu", cs(actual(101 + i)))
        if i in seen
        else ThreadObs(101 + i, "emulator", None, None, "none", "qemu", cs(actual(101 + i)))
        for i in range(3)
    ]  # fmt: skip
    threads.append(ThreadObs(110, "emulator", None, "kvm-nx-lpage-re", "names", None,
                             cs(actual(110))))  # fmt: skip
    missing = tuple(i for i in range(3) if i not in seen)
    return VmmObs(100, 1100, tuple(threads), True, missing)


@pytest.mark.parametrize("helpers", ["share", "isolate"])
def test_incomplete_classification_never_flips_between_processes(helpers: str) -> None:
    """Issue 25: the hook's pass saw vCPUs 1 and 2 (vCPU 0 busy in the guest) and applied its
    plan; audit's pass then saw 0 and 1, the agent's 0 and 2, another none: each plans the
    same, so audit finds no drift.  Before, each counted what it saw (2 vCPUs on 2 CPUs: 1:1
    of whichever two), so audit wanted vCPU 0 alone on a CPU the hook had let float."""
    t = topo("no-smt-server")
    policy = Policy(helpers, cs("0") if helpers == "isolate" else CpuSet())

    def node(seen: set[int], actual: Callable[[int], str]) -> NodePlan:
        sb = kata("a", "2-3", _incomplete_vmm(seen, actual))
        return plan_node(Observation((SandboxObs(sb.id, sb.runtime, policy, sb.record,
                                                 sb.containers, sb.vmm),)), t)  # fmt: skip

    hook = node({1, 2}, lambda tid: "0-15")
    want = desired(hook, "a")
    helper = "0" if helpers == "isolate" else "2-3"
    assert want == {100: "2-3", 101: "2-3", 102: "2-3", 103: "2-3", 110: helper}
    for seen in ({0, 1}, {0, 2}, {0}, set()):
        later = node(seen, lambda tid: "0-15")
        assert desired(later, "a") == want, seen
        # the hook's plan applied: this process's audit finds every thread where it should be
        applied = node(seen, lambda tid: want[tid] or "0-15")
        assert audit(applied)["ok"], audit(applied)["violations"]
    assert modes(hook) == {"a": "float"} and hook.sandbox("a").pinned_cpus == {}  # type: ignore[union-attr]
    assert "vCPU 0 not identified" in hook.sandbox("a").reason  # type: ignore[union-attr]
    # once every vCPU is known: the usual rules (3 on 2 CPUs: partial), the one change
    assert modes(node({0, 1, 2}, lambda tid: "0-15")) == {"a": "partial"}


def test_runc_update_is_adopted_and_vanished_container_forgotten() -> None:
    r = runc("r", "2", "2", 500)
    c = r.containers[0]
    moved = ContainerObs(c.rec, True, "3", None, None, cs("2"), c.tasks)
    dead = ContainerObs(ContainerRec("dead", "r", False, "x", cpus=cs("5"), pid=9, pid_start=1),
                        False, None)
    obs = Observation((SandboxObs("r", "runc", Policy(), r.record, (moved, dead)),))
    plan = plan_node(obs, topo("no-smt-server"))
    assert [(a.container, a.cpus, a.adopt) for a in plan.adoptions] == [("r", cs("3"), True)]
    assert plan.forget_containers == ("dead",)
    [cp] = plan.sandbox("r").containers  # type: ignore[union-attr]
    assert cp.desired == cs("3")


@pytest.mark.parametrize("follows", [False, True])
def test_kubelet_options_the_plan_follows(follows: bool) -> None:
    """The node row of vmpin's allocations carries what the plan follows of kubelet's
    configuration file (vmpin.reconcile.allocations.node_via): under strict-cpu-reservation
    the reserved CPUs (0 and its sibling 32 here) leave the shared pool and take the helper
    threads of a sandbox that isolates them; under prefer-align-cpus-by-uncorecache vCPUs
    fewer than their CPUs float inside one L3 group (EPYC 7313: 1-3,33-35 is group 0's part
    of 1-4,33-36; 4,36 are group 4's)."""
    from vmpin.core.allocate import Options
    from vmpin.reconcile.allocations import NODE_ROW, node_via
    from vmpin.state.allocations import Allocation

    t = topo("amd-epyc-7313-2s")
    opts = Options(strict_reservation=True, prefer_uncore=True) if follows else Options()
    node = Allocation(NODE_ROW, None, cs("0,32") if follows else None, None, node_via(opts),
                      None, 1.0, 1.0)  # fmt: skip
    held = Allocation("a", "pod-a", cs("1-4,33-36"), 8, "vmpin.io/exclusive-cpus=8", None, 1.0,
                      1.0)  # fmt: skip
    a = kata("a", None, vmm_threads(100, 4, "0-63"))
    a = SandboxObs(a.id, a.runtime, Policy("isolate", cs("8")), a.record, a.containers, a.vmm)
    b = kata("b", None, vmm_threads(200, 2, "0-63"))
    plan = plan_node(Observation((a, b), allocations=(node, held)), t)
    assert modes(plan) == {"a": "float", "b": "float"}
    got = desired(plan, "a")
    if follows:
        assert plan.shared_pool == cs("5-31,37-63")
        assert got == {100: "0,32", **{101 + i: "1-3,33-35" for i in range(4)}}
        assert any("one L3 group" in n for n in plan.sandbox("a").notes)  # type: ignore[union-attr]
    else:
        assert plan.shared_pool == cs("0,5-32,37-63")
        assert got == {100: "8", **{101 + i: "1-4,33-36" for i in range(4)}}
    assert plan.shared_pool is not None
    assert set(desired(plan, "b").values()) == {plan.shared_pool.to_list()}
