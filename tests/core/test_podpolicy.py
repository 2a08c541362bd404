"""Per-pod policy: the vmpin.io/ vocabulary, Crane's key, and what each does to a plan."""

from __future__ import annotations

import pytest

from tests.core.test_planner import cs, threads, topo, vcpu_pins
from vmpin.core.cpuset import CpuSet
from vmpin.core.errors import PlanError
from vmpin.core.planner import Policy, plan_sandbox
from vmpin.core.podpolicy import PodPolicy, parse, policy_for

NODE = Policy(helpers="isolate", housekeeping=CpuSet.parse("0-1"))

# annotations, expected PodPolicy, keys named in problems
CASES = [
    ("none", {}, PodPolicy(), []),
    ("cri-noise-ignored", {"io.kubernetes.cri.sandbox-id": "x"}, PodPolicy(), []),
    (
        "all-set",
        {"vmpin.io/vcpus": "1to1", "vmpin.io/helpers": "share", "vmpin.io/guest-pinning": "off",
         "qos.gocrane.io/cpu-manager": "exclusive"},
        PodPolicy("1to1", "share", "off", "exclusive"),
        [],
    ),
    ("case-and-space", {"vmpin.io/vcpus": " Float "}, PodPolicy(vcpus="float"), []),
    ("version-1", {"vmpin.io/version": "1", "vmpin.io/vcpus": "none"}, PodPolicy(vcpus="none"), []),
    (
        "bad-value-only-that-key",
        {"vmpin.io/vcpus": "2to1", "vmpin.io/helpers": "none"},
        PodPolicy(helpers="none"),
        ["vmpin.io/vcpus"],
    ),
    ("unknown-key", {"vmpin.io/vcpu": "float"}, PodPolicy(), ["vmpin.io/vcpu"]),
    (
        "unknown-version-drops-ours-keeps-crane",
        {"vmpin.io/version": "2", "vmpin.io/vcpus": "float", "qos.gocrane.io/cpu-manager": "share"},
        PodPolicy(cpuset="share"),
        ["vmpin.io/vcpus", "vmpin.io/version"],
    ),
    ("crane-bad", {"qos.gocrane.io/cpu-manager": "dedicated"}, PodPolicy(),
     ["qos.gocrane.io/cpu-manager"]),
    ("crane-empty-string-is-bad", {"qos.gocrane.io/cpu-manager": ""}, PodPolicy(),
     ["qos.gocrane.io/cpu-manager"]),
]


@pytest.mark.parametrize(("name", "ann", "want", "bad"), CASES, ids=[c[0] for c in CASES])
def test_parse(name: str, ann: dict[str, str], want: PodPolicy, bad: list[str]) -> None:
    got, problems = parse(ann)
    assert got == want
    assert sorted(p.key for p in problems) == bad
    for p in problems:
        assert p.key in str(p) and "node default" in str(p)


def test_pod_settings_override_only_what_they_set() -> None:
    pol, problems = policy_for({"vmpin.io/vcpus": "float", "vmpin.io/helpers": "bogus"}, NODE)
    assert (pol.vcpus, pol.helpers, pol.housekeeping, pol.guest) == ("float", "isolate",
                                                                     cs("0-1"), "on")
    assert [p.key for p in problems] == ["vmpin.io/helpers"]


def test_isolate_without_housekeeping_falls_back_to_share() -> None:
    pol, _ = policy_for({"vmpin.io/helpers": "isolate"}, Policy())
    assert pol.helpers == "share"


def test_policy_rejects_unknown_words() -> None:
    with pytest.raises(PlanError, match="cpu-manager"):
        Policy(cpuset="dedicated").check()
    with pytest.raises(PlanError, match="guest"):
        Policy(guest="maybe").check()


X = "xeon-gold-6258r-2s"


def plan(ann: dict[str, str], mask: str = "8-9,64-65", n: int = 4, **kw: object):  # type: ignore[no-untyped-def]
    pol, _ = policy_for(ann, Policy())
    return plan_sandbox(topo(X), "sb", cs(mask), threads(n), pol, **kw)  # type: ignore[arg-type]


def test_auto_and_1to1_pin_one_to_one_when_possible() -> None:
    for value in ("auto", "1to1"):
        p = plan({"vmpin.io/vcpus": value})
        assert p.mode == "1:1" and vcpu_pins(p) == {0: "8", 1: "64", 2: "9", 3: "65"}
        assert p.notes == ()


def test_1to1_notes_when_impossible() -> None:
    p = plan({"vmpin.io/vcpus": "1to1"}, mask="8-11", n=2)
    assert p.mode == "float" and any("1to1 not possible" in n for n in p.notes)


def test_vcpus_none_leaves_vcpus_alone_but_places_helpers() -> None:
    p = plan({"vmpin.io/vcpus": "none"})
    assert p.mode == "none"
    assert all(x.desired is None for x in p.placements if x.role == "vcpu")
    assert all(x.desired == cs("8-9,64-65") for x in p.placements if x.role != "vcpu")


def test_crane_share_floats_vcpus_and_none_floats_over_the_pool() -> None:
    p = plan({"qos.gocrane.io/cpu-manager": "share"})
    assert p.mode == "float" and set(vcpu_pins(p).values()) == {"8-9,64-65"}
    p = plan({"qos.gocrane.io/cpu-manager": "none"}, shared_pool=cs("0-7"))
    assert p.mode == "float" and p.mask == cs("0-7")
    assert set(vcpu_pins(p).values()) == {"0-7"}
    # with no shared pool known, "none" keeps the pod's own CPUs
    assert plan({"qos.gocrane.io/cpu-manager": "none"}).mode == "1:1"
