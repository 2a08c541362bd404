"""Per-pod policy in the node plan: a pod's own policy is planned for its sandbox only, and
Crane's ``exclusive`` keeps other sandboxes off the pod's CPUs (fixture topology, no QEMU)."""

from __future__ import annotations

import dataclasses

from tests.reconcile.test_plan import cs, desired, kata, topo, vmm_threads
from vmpin.core.planner import Policy
from vmpin.reconcile.observe import Observation
from vmpin.reconcile.plan import plan_node


def node(exclusive: bool, vcpus_b: str = "auto"):  # type: ignore[no-untyped-def]
    a = kata("a", "2-3", vmm_threads(100, 2, "0-7"))
    b = kata("b", "0-3", vmm_threads(200, 2, "0-7"))
    if exclusive:
        a = dataclasses.replace(a, policy=Policy(cpuset="exclusive"))
    b = dataclasses.replace(b, policy=Policy(vcpus=vcpus_b))
    return plan_node(Observation((a, b)), topo("no-smt-server"))


def test_without_crane_exclusive_overlapping_masks_float() -> None:
    plan = node(exclusive=False)
    assert {s.id: s.mode for s in plan.sandboxes} == {"a": "float", "b": "float"}


def test_crane_exclusive_moves_the_others_off_and_lets_the_pod_pin() -> None:
    plan = node(exclusive=True)
    a, b = plan.sandbox("a"), plan.sandbox("b")
    assert a is not None and b is not None
    assert a.mode == "1:1" and set(a.pinned_cpus) == {2, 3}
    assert b.mask == cs("0-1") and b.mode == "1:1" and set(b.pinned_cpus) == {0, 1}
    assert any("kept free" in n and "2-3" in n for n in b.notes)
    assert not set(desired(plan, "b").values()) & {"2", "3", "2-3"}


def test_a_pods_policy_is_its_own() -> None:
    plan = node(exclusive=True, vcpus_b="float")
    assert plan.sandbox("a").mode == "1:1"  # type: ignore[union-attr]
    assert plan.sandbox("b").mode == "float"  # type: ignore[union-attr]
