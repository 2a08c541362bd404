"""Table-driven placement tests over the fixture topologies (tests/fixtures/sysfs)."""

from __future__ import annotations

from functools import cache

import pytest
from pytest_mock import MockerFixture

from tests.conftest import FIXTURES
from vmpin.core.cpuset import CpuSet
from vmpin.core.errors import PlanError
from vmpin.core.guestmap import guest_siblings, map_container, map_sandbox
from vmpin.core.planner import Policy, Thread, check_global, exclusive_cpus, plan_sandbox
from vmpin.core.topology import Topology
from vmpin.linux.sysfs import read_topology


@cache
def topo(name: str) -> Topology:
    return read_topology(str(FIXTURES / "sysfs" / name))


def threads(nvcpus: int, *, iothreads: int = 1, vhost: int = 0) -> list[Thread]:
    out = [Thread(1000, "emulator")]
    out += [Thread(2000 + i, "vcpu", i) for i in range(nvcpus)]
    out += [Thread(3000 + i, "iothread", None, f"io{i}") for i in range(iothreads)]
    out += [Thread(4000 + i, "vhost", None, f"vhost-{i}") for i in range(vhost)]
    return out


def cs(text: str) -> CpuSet:
    return CpuSet.parse(text)


def vcpu_pins(plan) -> dict[int, str]:  # type: ignore[no-untyped-def]
    return {p.idx: p.desired.to_list() for p in plan.placements if p.role == "vcpu"}


# name, topology, mask, nvcpus, expected mode, expected vCPU -> desired
CASES = [
    # Xeon: siblings are n and n+56; a 4-CPU mask of two whole cores maps vCPU pairs to cores.
    (
        "xeon-1to1-two-cores",
        "xeon-gold-6258r-2s",
        "8-9,64-65",
        4,
        "1:1",
        {0: "8", 1: "64", 2: "9", 3: "65"},
    ),
    ("xeon-single-cpu", "xeon-gold-6258r-2s", "30", 1, "1:1", {0: "30"}),
    # kubelet reserved CPU 0: 56 is a lone thread; guest pair (0,1) stays on core {1,57}
    ("xeon-half-core", "xeon-gold-6258r-2s", "1,56,57", 3, "1:1", {0: "1", 1: "57", 2: "56"}),
    ("4-core-half-core", "offline-isolated", "1,4,5", 3, "1:1", {0: "1", 1: "5", 2: "4"}),
    # Kata: boot vCPU 0 floats, hot-plugged 1..4; guest pair (2,3) on host core {8,64}
    (
        "kata-boot-whole-cores",
        "xeon-gold-6258r-2s",
        "8-9,64-65",
        5,
        "partial",
        {0: "8-9,64-65", 1: "9", 2: "8", 3: "64", 4: "65"},
    ),
    # Kata + half core: vCPU 1 (the boot vCPU's guest sibling) takes the lone thread
    (
        "kata-boot-half-core",
        "xeon-gold-6258r-2s",
        "1,56,57",
        4,
        "partial",
        {0: "1,56-57", 1: "56", 2: "1", 3: "57"},
    ),
    (
        "xeon-more-vcpus-partial",
        "xeon-gold-6258r-2s",
        "8,64",
        3,
        "partial",
        {0: "8,64", 1: "8", 2: "64"},
    ),
    ("xeon-fewer-vcpus-float", "xeon-gold-6258r-2s", "8-11", 2, "float", {0: "8-11", 1: "8-11"}),
    # across sockets: socket 0's CPUs come first in topology order.
    ("xeon-cross-socket", "xeon-gold-6258r-2s", "27,28", 2, "1:1", {0: "27", 1: "28"}),
    # EPYC 7313: several L3 groups per socket; siblings n and n+32.
    ("epyc-1to1", "amd-epyc-7313-2s", "0-1,32-33", 4, "1:1", {0: "0", 1: "32", 2: "1", 3: "33"}),
    ("epyc-two-ccx", "amd-epyc-7313-2s", "3-4", 2, "1:1", {0: "3", 1: "4"}),
    ("no-smt-1to1", "no-smt-server", "4-7", 4, "1:1", {0: "4", 1: "5", 2: "6", 3: "7"}),
    ("no-smt-partial", "no-smt-server", "4", 2, "partial", {0: "4", 1: "4"}),
    # offline CPUs in a mask are left out, with a note
    ("offline-dropped", "offline-isolated", "0,6", 1, "1:1", {0: "0"}),
]


@pytest.mark.parametrize(
    ("name", "tname", "mask", "n", "mode", "pins"), CASES, ids=[c[0] for c in CASES]
)
def test_vcpu_plans(
    name: str, tname: str, mask: str, n: int, mode: str, pins: dict[int, str]
) -> None:
    plan = plan_sandbox(topo(tname), "sb", cs(mask), threads(n))
    assert plan.mode == mode, plan.reason
    assert vcpu_pins(plan) == pins
    # every thread lands inside the (online part of the) mask under the default policy
    for p in plan.placements:
        assert p.desired is not None and p.desired.issubset(plan.mask)
    # never two vCPUs 1:1 on one CPU
    assert len(set(plan.vcpu_map.values())) == len(plan.vcpu_map)


def test_offline_cpus_are_noted() -> None:
    plan = plan_sandbox(topo("offline-isolated"), "sb", cs("0,6"), threads(1))
    assert plan.mask == cs("0")
    assert any("not online" in n for n in plan.notes)


def test_all_offline_is_none() -> None:
    plan = plan_sandbox(topo("offline-isolated"), "sb", cs("6-7"), threads(1))
    assert plan.mode == "none"
    assert all(p.desired is None for p in plan.placements)


def test_smt_pairs_follow_cores() -> None:
    t = topo("xeon-gold-6258r-2s")
    plan = plan_sandbox(t, "sb", cs("0-3,56-59"), threads(8))
    assert plan.mode == "1:1"
    # guest vCPUs (0,1), (2,3)... are host SMT pairs
    assert guest_siblings(plan, t) == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_no_mask_no_pool_leaves_alone() -> None:
    plan = plan_sandbox(topo("no-smt-server"), "sb", CpuSet(), threads(2))
    assert plan.mode == "none"
    assert all(p.desired is None for p in plan.placements)


def test_no_mask_floats_over_shared_pool() -> None:
    plan = plan_sandbox(topo("no-smt-server"), "sb", CpuSet(), threads(2), shared_pool=cs("0-3"))
    assert plan.mode == "float"
    assert all(p.desired == cs("0-3") for p in plan.placements)
    assert plan.vcpu_map == {}


def test_shared_cpus_never_pinned_1to1() -> None:
    # Two sandboxes on one shared pool: both float; neither claims a CPU 1:1.
    t = topo("no-smt-server")
    a = plan_sandbox(t, "a", cs("0-1"), threads(2), others=cs("0-1"))
    b = plan_sandbox(t, "b", cs("0-1"), threads(2), others=cs("0-1"))
    assert a.mode == b.mode == "float"
    assert check_global([a, b]) == []


def test_check_global_finds_double_pins() -> None:
    t = topo("no-smt-server")
    a = plan_sandbox(t, "a", cs("0-1"), threads(2))
    b = plan_sandbox(t, "b", cs("0-1"), threads(2))
    assert check_global([a, b]) == ["CPU 0: vCPU 0 of b and a/0", "CPU 1: vCPU 1 of b and a/1"]
    assert check_global([a, a]) == []  # (a plan is not its own rival)


@pytest.mark.parametrize(
    ("policy", "others_excl", "expected"),
    [
        (Policy("share"), "", "4-7"),
        (Policy("isolate", cs("0-1")), "", "0-1"),
        (Policy("isolate", cs("0-3")), "2-3", "0-1"),  # never on another sandbox's exclusive CPUs
        (Policy("isolate", cs("2-3")), "2-3", "4-7"),  # nothing left: falls back to the mask
        (Policy("none"), "", None),
    ],
)
def test_helper_policy(policy: Policy, others_excl: str, expected: str | None) -> None:
    plan = plan_sandbox(
        topo("no-smt-server"),
        "sb",
        cs("4-7"),
        threads(4, vhost=1),
        policy,
        others_exclusive=cs(others_excl),
    )
    for p in plan.placements:
        if p.role != "vcpu":
            assert (None if p.desired is None else p.desired.to_list()) == expected
    assert plan.mode == "1:1"


def test_policy_validation() -> None:
    with pytest.raises(PlanError):
        Policy("bogus").check()
    with pytest.raises(PlanError):
        Policy("isolate").check()
    with pytest.raises(PlanError):
        Policy(vcpus="sometimes").check()


def test_vcpu_float_policy() -> None:
    plan = plan_sandbox(topo("no-smt-server"), "sb", cs("4-7"), threads(4), Policy(vcpus="float"))
    assert plan.mode == "float"
    assert set(vcpu_pins(plan).values()) == {"4-7"}


def test_exclusive_cpus() -> None:
    ex = exclusive_cpus({"a": cs("0-3"), "b": cs("2-5"), "c": cs("8")}, cs("8-9"))
    assert ex == {"a": cs("0-1"), "b": cs("4-5"), "c": CpuSet()}


# -- guest map --------------------------------------------------------------------------------
def test_guest_map_exact_under_1to1() -> None:
    t = topo("xeon-gold-6258r-2s")
    plan = plan_sandbox(t, "sb", cs("8,64,9,65"), threads(4))
    a = map_container(plan, "a", cs("8,64"))
    b = map_container(plan, "b", cs("9,65"))
    assert (a.guest_cpus, a.exact) == (cs("0-1"), True)
    assert (b.guest_cpus, b.exact) == (cs("2-3"), True)


def test_guest_map_partial_is_exact_for_containers() -> None:
    plan = plan_sandbox(topo("no-smt-server"), "sb", cs("4-5"), threads(3))
    m = map_container(plan, "a", cs("4-5"))
    assert m.exact and m.guest_cpus == cs("1-2")


def test_guest_map_floating_is_honest() -> None:
    t = topo("no-smt-server")
    plan = plan_sandbox(t, "sb", cs("4-7"), threads(2))
    m = map_container(plan, "a", cs("4-5"))
    assert m.guest_cpus == cs("0-1") and not m.exact
    prop = map_container(
        plan, "a", cs("6-7"), float_policy="proportional", order=t.ordered(plan.mask)
    )
    assert prop.guest_cpus == cs("1") and not prop.exact


def test_guest_map_follows_updates() -> None:
    t = topo("no-smt-server")
    grow = plan_sandbox(t, "sb", cs("4-7"), threads(4))
    assert (
        map_sandbox(grow, {"a": cs("4-5"), "b": cs("6-7")}, t)["containers"]["b"]["guest_cpus"]
        == "2-3"
    )
    shrink = plan_sandbox(t, "sb", cs("4-5"), threads(4))  # mask shrank under 4 vCPUs
    m = map_sandbox(shrink, {"a": cs("4-5")}, t)["containers"]["a"]
    assert m["guest_cpus"] == "2-3" and m["exact"]
    assert shrink.mode == "partial"


def test_guest_map_orders_the_mask_only_for_a_proportional_share(mocker: MockerFixture) -> None:
    """The mask in topology order is a walk over the node's CPUs: made only for the one
    policy that reads it, not for every map an event's pass publishes."""
    t = topo("no-smt-server")
    plan = plan_sandbox(t, "sb", cs("4-7"), threads(4))
    ordered = mocker.spy(Topology, "ordered")
    assert map_sandbox(plan, {"a": cs("4-5")}, t)["containers"]["a"]["guest_cpus"] == "0-1"
    assert ordered.call_count == 0
    assert map_sandbox(plan, {"a": cs("4-5")}, t, "proportional")["containers"]["a"]["exact"]
    assert ordered.call_count == 1


def test_guest_map_no_cpus() -> None:
    plan = plan_sandbox(topo("no-smt-server"), "sb", cs("4-5"), threads(2))
    m = map_container(plan, "pause", None)
    assert m.guest_cpus == cs("0-1") and not m.exact


def test_helpers_avoid_isolated_cpus() -> None:
    # offline-isolated: isolcpus=2-3; helper threads keep off them when the mask allows
    t = topo("offline-isolated")
    plan = plan_sandbox(t, "sb", cs("1-3"), threads(3))
    helpers = {p.desired for p in plan.placements if p.role != "vcpu"}
    assert helpers == {cs("1")}
    only_isolated = plan_sandbox(t, "sb", cs("2-3"), threads(2))
    assert {p.desired for p in only_isolated.placements if p.role != "vcpu"} == {cs("2-3")}
    assert any("isolated" in n for n in only_isolated.notes)


# -- Kata's own vCPU pinning (enable_vcpus_pinning) -----------------------------------------
# Kata pins vCPU i to the i-th CPU of the sandbox's cpuset (ascending) when #vCPUs == |cpuset|.
# On the Xeon (siblings n, n+56) topology order pairs 8 with 64: the two layouts differ.
KATA_CASES = [
    # name, mask, nvcpus, runtime_pins, mode, vCPU -> desired, runtime_map
    ("kata-order-when-kata-pins", "8-9,64-65", 4, "8-9,64-65", "1:1",
     {0: "8", 1: "9", 2: "64", 3: "65"}, {0: 8, 1: 9, 2: 64, 3: 65}),
    ("topology-order-without", "8-9,64-65", 4, None, "1:1",
     {0: "8", 1: "64", 2: "9", 3: "65"}, {}),
    # more vCPUs than CPUs: Kata does not pin, vmpin's partial plan stands
    ("kata-does-not-pin-partial", "8,64", 3, "8,64", "partial",
     {0: "8,64", 1: "8", 2: "64"}, {}),
    # fewer vCPUs than CPUs: neither pins
    ("kata-does-not-pin-float", "8-11", 2, "8-11", "float", {0: "8-11", 1: "8-11"}, {}),
]


@pytest.mark.parametrize(
    ("name", "mask", "nvcpus", "runtime", "mode", "want", "runtime_map"), KATA_CASES,
    ids=[c[0] for c in KATA_CASES],
)
def test_kata_own_pinning_layout(
    name: str, mask: str, nvcpus: int, runtime: str | None, mode: str, want: dict[int, str],
    runtime_map: dict[int, int],
) -> None:
    plan = plan_sandbox(topo("xeon-gold-6258r-2s"), "s", cs(mask), threads(nvcpus),
                        runtime_pins=None if runtime is None else cs(runtime))
    assert plan.mode == mode
    assert vcpu_pins(plan) == want
    assert dict(plan.runtime_map) == runtime_map
    if runtime_map and mode == "1:1":
        assert dict(plan.vcpu_map) == runtime_map and "Kata's order" in plan.reason


def test_kata_layout_where_vmpin_floats() -> None:
    """CPUs shared with another sandbox: vmpin floats, but still says where Kata pins."""
    plan = plan_sandbox(topo("xeon-gold-6258r-2s"), "s", cs("8-9"), threads(2),
                        others=cs("9"), runtime_pins=cs("8-9"))
    assert plan.mode == "float" and plan.vcpu_map == {}
    assert dict(plan.runtime_map) == {0: 8, 1: 9}


def test_runtime_layout() -> None:
    from vmpin.core.planner import runtime_layout

    assert runtime_layout([1, 0, 2], cs("4,2,9")) == {0: 2, 1: 4, 2: 9}
    assert runtime_layout([0, 1], cs("4")) == {}  # counts differ: Kata does not pin
    assert runtime_layout([0, None], cs("4-5")) == {}  # an index unknown: cannot tell
    assert runtime_layout([], cs("")) == {}


# -- an incomplete classification (issue 25) ----------------------------------------------------
def seen_threads(nvcpus: int, seen: set[int]) -> tuple[list[Thread], list[int], list[int]]:
    """What a pass that identified only the vCPUs ``seen`` hands the planner: the others are
    emulator threads by default (layer none), as is the main loop (1000); the iothread (3000)
    was identified.  Returns (threads, missing indexes, unidentified tids)."""
    out = [Thread(1000, "emulator"), Thread(3000, "iothread", None, "io0")]
    out += [
        Thread(2000 + i, "vcpu", i) if i in seen else Thread(2000 + i, "emulator")
        for i in range(nvcpus)
    ]
    missing = [i for i in range(nvcpus) if i not in seen]
    return out, missing, [1000] + [2000 + i for i in missing]


def placements(plan) -> dict[int, str | None]:  # type: ignore[no-untyped-def]
    return {p.tid: None if p.desired is None else p.desired.to_list() for p in plan.placements}


@pytest.mark.parametrize(
    ("mask", "policy", "vcpu_set", "helper_set"),
    [
        ("8,64", Policy(), "8,64", "8,64"),  # 3 vCPUs on 2 CPUs: partial when complete
        ("8-9,64", Policy(), "8-9,64", "8-9,64"),  # 3 on 3: 1:1 when complete
        ("8-9,64", Policy("isolate", cs("0")), "8-9,64", "0"),
        ("8-9,64", Policy(vcpus="1to1"), "8-9,64", "8-9,64"),
        ("8-9,64", Policy(vcpus="none"), None, "8-9,64"),
    ],
)
def test_incomplete_classification_plans_the_same_whichever_vcpus_were_seen(
    mask: str, policy: Policy, vcpu_set: str | None, helper_set: str
) -> None:
    """A pass sees some vCPUs, another pass (the hook, audit, the agent) others: every such
    incomplete pass plans the same, tid by tid, and pins no vCPU 1:1.  Before, the planner
    counted what it saw: 2 of 3 vCPUs on 2 CPUs pinned vCPUs 0 and 1 (or 1 and 2) 1:1."""
    t = topo("xeon-gold-6258r-2s")
    plans = []
    for seen in ({0, 1}, {0, 2}, {1, 2}, {0}, {2}, set()):
        ths, missing, unidentified = seen_threads(3, seen)
        plan = plan_sandbox(t, "sb", cs(mask), ths, policy, missing_vcpus=missing,
                            unidentified=unidentified)  # fmt: skip
        assert plan.vcpu_map == {}
        assert plan.mode == ("none" if policy.vcpus == "none" else "float")
        if policy.vcpus in ("auto", "1to1"):
            assert f"vCPU {','.join(map(str, missing))} not identified" in plan.reason
        assert any("threads of unknown role are placed as vCPUs" in n for n in plan.notes)
        plans.append(placements(plan))
    assert plans == [plans[0]] * len(plans)
    # every vCPU (seen or not) and the main loop get the vCPUs' set; identified helpers theirs
    assert plans[0] == {1000: vcpu_set, 2000: vcpu_set, 2001: vcpu_set, 2002: vcpu_set,
                        3000: helper_set}  # fmt: skip
    # once every vCPU is known the usual rules apply again, and the main loop is a helper
    ths, _, _ = seen_threads(3, {0, 1, 2})
    complete = plan_sandbox(t, "sb", cs(mask), ths, policy, missing_vcpus=(), unidentified=[1000])
    assert placements(complete)[1000] == helper_set
    if policy.vcpus in ("auto", "1to1"):
        assert complete.mode == ("partial" if mask == "8,64" else "1:1")


# -- isolcpus (issue 30, item 4): no vCPU floats over several isolated CPUs ---------------------
@pytest.mark.parametrize(
    ("mask", "nvcpus", "others", "mode", "pins"),
    [
        # fewer vCPUs than CPUs: they would float; over isolated CPUs each gets one CPU
        ("2-3", 1, "", "float", {0: "2"}),
        # shared with another sandbox: no 1:1 pin, still one CPU each (not one to float over)
        ("2-3", 2, "3", "float", {0: "2", 1: "3"}),
        # more vCPUs than CPUs: the last two pinned 1:1, the first wraps round the mask
        ("2-3", 3, "", "partial", {0: "2", 1: "2", 2: "3"}),
        # as many as CPUs and alone: 1:1 as anywhere
        ("2-3", 2, "", "1:1", {0: "2", 1: "3"}),
        # one isolated CPU in the mask: floating over it and the rest is the scheduler's
        ("1-2", 1, "", "float", {0: "1-2"}),
    ],
)
def test_no_vcpu_floats_over_several_isolated_cpus(
    mask: str, nvcpus: int, others: str, mode: str, pins: dict[int, str]
) -> None:
    t = topo("offline-isolated")  # isolcpus=2-3
    assert t.isolated == cs("2-3")
    plan = plan_sandbox(t, "sb", cs(mask), threads(nvcpus), others=cs(others))
    assert plan.mode == mode, plan.reason
    got = vcpu_pins(plan)
    # (partial: which vCPUs are the 1:1 ones is the planner's; the wrapped one shares a CPU)
    assert sorted(got.values()) == sorted(pins.values()) if mode == "partial" else got == pins
    spread = mode != "1:1" and len(cs(mask) & t.isolated) > 1
    assert any("isolated (isolcpus)" in n for n in plan.notes) == spread
    assert all(len(cs(p)) == 1 for p in got.values()) == (spread or mode == "1:1")


# prefer-align-cpus-by-uncorecache (issue 30, item 3): machine, mask, vCPUs, where they float
UNCORE_CASES = [
    # EPYC 7313: L3 groups of 4 cores (4k..4k+3, siblings +32); 1-4,33-36 spans groups 0 and 4
    ("epyc: group 0's part holds all 4", "amd-epyc-7313-2s", "1-4,33-36", 4, "1-3,33-35"),
    ("epyc: 7 do not fit a part of 6", "amd-epyc-7313-2s", "1-4,33-36", 7, "1-4,33-36"),
    ("epyc: equal parts, the first", "amd-epyc-7313-2s", "2-5,34-37", 2, "2-3,34-35"),
    ("epyc: one group, nothing to narrow", "amd-epyc-7313-2s", "4-7,36-39", 2, "4-7,36-39"),
    # one L3 group per socket on the Xeon; none split on the no-SMT machine
    ("xeon: across the sockets", "xeon-gold-6258r-2s", "26-29,82-85", 3, "26-27,82-83"),
    ("no-smt: one L3 group", "no-smt-server", "4-11", 2, "4-11"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "machine", "mask", "n", "home"), UNCORE_CASES,
                         ids=[c[0] for c in UNCORE_CASES])  # fmt: skip
def test_floating_vcpus_stay_in_one_l3_group(
    name: str, machine: str, mask: str, n: int, home: str
) -> None:
    t = topo(machine)
    plan = plan_sandbox(t, "sb", cs(mask), threads(n), uncore=True)
    assert plan.mode == "float"
    assert set(vcpu_pins(plan).values()) == {home}
    # helper threads keep the whole mask (policy share); without the option, vCPUs do too
    assert {p.desired for p in plan.placements if p.role != "vcpu"} == {cs(mask)}
    plain = plan_sandbox(t, "sb", cs(mask), threads(n))
    assert set(vcpu_pins(plain).values()) == {cs(mask).to_list()}


def test_one_l3_group_only_for_the_sandboxs_own_cpus() -> None:
    """Not over the shared pool, nor a mask others float on: those float as they are."""
    t = topo("amd-epyc-7313-2s")
    pool = plan_sandbox(t, "sb", CpuSet(), threads(2), shared_pool=cs("1-4,33-36"), uncore=True)
    assert set(vcpu_pins(pool).values()) == {"1-4,33-36"}
    shared = plan_sandbox(t, "sb", cs("1-4,33-36"), threads(2), others=cs("4"), uncore=True)
    assert set(vcpu_pins(shared).values()) == {"1-4,33-36"}
