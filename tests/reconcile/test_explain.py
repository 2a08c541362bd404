"""``vmpin explain`` on a node with exclusive and shared pods: every CPU explained (issue 29).

The node (no-SMT 16-CPU server; kubelet's pool 0-1,6-15): a Guaranteed Kata pod ``a`` with
exclusive CPUs 2-3 (two vCPUs, 1:1), a Burstable Kata pod ``b`` on the pool, a Guaranteed
runc pod ``r`` with exclusive CPU 4, a runc pod ``s`` on the pool; CPU 5 is kubelet's but no
one's (reserved).  Built by hand as observe would read it, planned for real.
"""

from __future__ import annotations

import pytest

from tests.reconcile.test_plan import cs, kata, runc, static, topo, vmm_threads
from vmpin.core.errors import StateError
from vmpin.reconcile.explain import explain, explain_container, explain_cpu, explain_pod
from vmpin.reconcile.observe import Observation
from vmpin.reconcile.plan import NodePlan, plan_node

POOL = "0-1,6-15"


@pytest.fixture
def node() -> NodePlan:
    sandboxes = [
        kata("a", "2-3", vmm_threads(100, 2, "2-3"), pod="pod-a"),
        kata("b", POOL, vmm_threads(200, 1, POOL), pod="pod-b"),
        runc("r", "4", "4", 500, pod="pod-r"),
        runc("s", POOL, POOL, 600, pod="pod-s"),
    ]
    cp = static(POOL, {"pod-a": {"app": "2-3"}, "pod-r": {"app": "4"}})
    return plan_node(Observation(tuple(sandboxes), cp), topo("no-smt-server"))


def _who(out: dict) -> set[tuple[str, str]]:  # type: ignore[type-arg]
    return {(c["kind"], c["sandbox"]) for c in out["claimants"]}


# CPU -> (kubelet's rule starts with, the claimants: (kind, sandbox))
EXPECTED = {
    0: ("in kubelet's shared pool",
        {("sandbox", "b"), ("thread", "b"), ("sandbox", "s"), ("thread", "s")}),
    2: ("kubelet gives it to pod pod-a", {("sandbox", "a"), ("thread", "a")}),
    3: ("kubelet gives it to pod pod-a", {("sandbox", "a"), ("thread", "a")}),
    4: ("kubelet gives it to pod pod-r", {("sandbox", "r"), ("thread", "r")}),
    5: ("outside kubelet's shared pool and given to no container", set()),
}


@pytest.mark.parametrize("cpu", range(16))
def test_every_cpu_is_explained(node: NodePlan, cpu: int) -> None:
    out = explain_cpu(node, topo("no-smt-server"), cpu)
    assert out["cpu"] == cpu and out["online"] and out["kubelet"]["rule"]
    rule, who = EXPECTED.get(cpu, EXPECTED[0])
    assert out["kubelet"]["rule"].startswith(rule)
    assert _who(out) == who
    assert all(c["rule"] for c in out["claimants"])
    if cpu in (2, 3):
        (vcpu,) = [c for c in out["claimants"]
                   if c.get("role") == "vcpu" and c["desired"] == str(cpu)]
        assert "pinned 1:1" in vcpu["rule"]
        assert out["kubelet"]["exclusive"]["source"] == "kubelet"
        (mask,) = [c for c in out["claimants"] if c["kind"] == "sandbox"]
        assert "app: its CPU set 2-3, from its OCI spec" in mask["rule"]


def test_a_pod_and_a_container(node: NodePlan) -> None:
    pod = explain_pod(node, "pod-a")
    assert (pod["sandbox"], pod["mode"], pod["mask"]) == ("a", "1:1", "2-3")
    assert pod["policy"]["source"] == "node"
    assert sorted(t["desired"] for t in pod["threads"] if t["role"] == "vcpu") == ["2", "3"]
    ctr = explain_container(node, "r")
    assert (ctr["cpus"], ctr["source"], ctr["sandbox"]) == ("4", "spec", "r")
    assert ctr["cgroup"] == "4"
    # one entry point picks by shape: a number, a container id, else a pod
    assert set(explain(node, topo("no-smt-server"), "7")) == {"cpu"}
    assert set(explain(node, topo("no-smt-server"), "a-app")) == {"container"}
    assert set(explain(node, topo("no-smt-server"), "pod-b")) == {"pod"}


@pytest.mark.parametrize("what", ["99", "nobody"])
def test_unknown_is_one_error(node: NodePlan, what: str) -> None:
    with pytest.raises(StateError):
        explain(node, topo("no-smt-server"), what)


def test_drift_is_named(node: NodePlan) -> None:
    """A thread running where it is not planned says so on that CPU."""
    moved = [
        kata("b", POOL, vmm_threads(200, 1, "0-15"), pod="pod-b"),
    ]
    plan = plan_node(Observation(tuple(moved), static(POOL)), topo("no-smt-server"))
    out = explain_cpu(plan, topo("no-smt-server"), 3)
    assert any("drift: it runs here" in c["rule"] for c in out["claimants"])
    assert cs("3")  # (the fixture's helpers)
