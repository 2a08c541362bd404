"""Kata's own vCPU pinning is never fought: the node plan, the audit and apply, on fixtures.

With ``[runtime] enable_vcpus_pinning = true`` Kata pins vCPU i to the i-th CPU (ascending) of
the sandbox's cpuset at each of its container events, when #vCPUs == |cpuset|.  Each case
lays the vCPUs out as Kata leaves them and shows that vmpin's plan agrees (no drift, no write)
where it pins 1:1 itself, and leaves them alone where it would not -- and, for contrast, that
without the Kata configuration the same layout is drift vmpin would undo.
"""

from __future__ import annotations

from pathlib import Path

from tests.reconcile.test_plan import cs, desired, kata, modes, topo, vmm_threads
from vmpin.core.cpuset import CpuSet
from vmpin.core.planner import Policy
from vmpin.linux.paths import HostPaths
from vmpin.reconcile.apply import Applier
from vmpin.reconcile.audit import audit
from vmpin.reconcile.observe import Observation, SandboxObs, ThreadObs, VmmObs
from vmpin.reconcile.plan import NodePlan, plan_node
from vmpin.runtimes.kataconfig import KataConfig, KataConfigs
from vmpin.state.store import Store

PINNING = KataConfigs((KataConfig("/etc/kata-containers/configuration.toml", True),))
OFF = KataConfigs((KataConfig("/etc/kata-containers/configuration.toml", False),))
XEON = "xeon-gold-6258r-2s"  # SMT siblings n and n+56: topology order pairs 8 with 64


class RecordingAffinity:
    """Affinities held in a map; every write recorded (what apply would do to the host)."""

    def __init__(self) -> None:
        self.writes: list[tuple[int, str]] = []

    def get(self, tid: int) -> CpuSet:
        raise AssertionError("apply reads nothing back but what it writes")

    def set(self, tid: int, cpus: CpuSet) -> CpuSet:
        self.writes.append((tid, cpus.to_list()))
        return cpus


def kata_layout(base: int, cpus: str, helpers: str, original: str | None = None) -> VmmObs:
    """A VMM whose vCPU i is on the i-th CPU of ``cpus``, as Kata pins it; emulator on
    ``helpers`` (where vmpin's plan puts it, so that only vCPUs are in question)."""
    mask = sorted(cs(cpus))
    orig = cs(original) if original else None
    threads = [ThreadObs(base, "emulator", None, "qemu", "", "qemu", cs(helpers), orig)]
    threads += [ThreadObs(base + 1 + i, "vcpu", i, f"CPU {i}/KVM", "", f"CPU {i}/KVM",
                          CpuSet([cpu]), orig) for i, cpu in enumerate(mask)]
    return VmmObs(base, 1000 + base, tuple(threads))


def with_policy(s: SandboxObs, policy: Policy) -> SandboxObs:
    return SandboxObs(s.id, s.runtime, policy, s.record, s.containers, s.vmm)


def writes(plan: NodePlan, tmp_path: Path) -> list[tuple[int, str]]:
    affinity = RecordingAffinity()
    paths = HostPaths(state_dir=str(tmp_path))
    with Store(str(tmp_path)) as store:
        Applier(paths, affinity, publish=False).apply(store, plan)
    return affinity.writes


def vcpus(plan: NodePlan, sid: str) -> dict[int | None, tuple[str | None, str]]:
    sp = plan.sandbox(sid)
    assert sp is not None
    return {t.index: (None if t.desired is None else t.desired.to_list(), t.kind)
            for t in sp.threads if t.role == "vcpu"}


def test_one_to_one_plan_is_kata_layout(tmp_path: Path) -> None:
    """vmpin pins 1:1 itself: in Kata's order, so Kata's pins are vmpin's plan -- no drift,
    no write; the guest map is Kata's layout too."""
    sandbox = kata("a", "8-9,64-65", kata_layout(100, "8-9,64-65", "8-9,64-65"))
    plan = plan_node(Observation((sandbox,), kata=PINNING), topo(XEON))
    sp = plan.sandbox("a")
    assert sp is not None and sp.mode == "1:1" and sp.kata == "follows"
    assert vcpus(plan, "a") == {0: ("8", "plan"), 1: ("9", "plan"), 2: ("64", "plan"),
                                3: ("65", "plan")}
    result = audit(plan, node_notes=PINNING.notes())
    assert result["ok"], result["violations"]
    assert result["notes"][0].startswith("Kata configuration /etc/kata-containers/")
    assert any(n.startswith("sandbox a: Kata pins the 4 vCPUs itself") for n in result["notes"])
    assert writes(plan, tmp_path) == []
    assert sp.guest_map is not None
    assert sp.guest_map["containers"]["a-app"]["guest_cpus"] == "0-3"
    # contrast: without Kata's pinning, vmpin's topology order moves three of them (the fight)
    fought = plan_node(Observation((sandbox,), kata=OFF), topo(XEON))
    drift = [v for v in audit(fought)["violations"] if v["kind"] == "drift"]
    assert {v["tid"] for v in drift} == {102, 103} and fought.sandbox("a").kata == ""  # type: ignore[union-attr]
    assert sorted(writes(fought, tmp_path)) == [(102, "64"), (103, "9")]


def test_vcpus_kata_pinned_are_left_where_vmpin_would_float(tmp_path: Path) -> None:
    """vmpin would float them (its float policy; or CPUs shared with another sandbox), and
    Kata has pinned them one per CPU: left there, never moved nor undone (even with an
    original affinity recorded from vmpin's earlier pin)."""
    a = with_policy(kata("a", "2-3", kata_layout(100, "2-3", "2-3", original="0-15")),
                    Policy(vcpus="float"))
    plan = plan_node(Observation((a,), kata=PINNING), topo("no-smt-server"))
    sp = plan.sandbox("a")
    assert sp is not None and sp.kata == "left" and modes(plan)["a"] == "float"
    assert vcpus(plan, "a") == {0: (None, "none"), 1: (None, "none")}
    assert desired(plan, "a")[100] == "2-3"  # helpers are still vmpin's
    result = audit(plan, node_notes=PINNING.notes())
    assert result["ok"], result["violations"]
    assert any("vCPUs left where Kata pinned them" in n for n in result["notes"])
    assert writes(plan, tmp_path) == []
    # contrast: without Kata's pinning those pins are drift, and vmpin floats them
    fought = plan_node(Observation((a,), kata=OFF), topo("no-smt-server"))
    assert sorted(writes(fought, tmp_path)) == [(101, "2-3"), (102, "2-3")]


def test_shared_cpus_kata_pinned_are_left() -> None:
    b = kata("b", None, vmm_threads(200, 1, "0-15"))  # floats over every CPU: 2-3 shared
    a = kata("a", "2-3", kata_layout(100, "2-3", "2-3"))
    plan = plan_node(Observation((a, b), kata=PINNING), topo("no-smt-server"))
    assert plan.sandbox("a").kata == "left"  # type: ignore[union-attr]
    assert vcpus(plan, "a") == {0: (None, "none"), 1: (None, "none")}
    assert [v for v in audit(plan)["violations"] if v["sandbox"] == "a"] == []


def test_kata_pins_not_in_place_yet_are_planned_as_usual() -> None:
    """Kata pins at its next container event; until then vmpin's plan stands (it writes
    nothing Kata would not overwrite, and once Kata has pinned them they are left)."""
    a = with_policy(kata("a", "2-3", vmm_threads(100, 2, "0-15")), Policy(vcpus="float"))
    plan = plan_node(Observation((a,), kata=PINNING), topo("no-smt-server"))
    assert plan.sandbox("a").kata == "expected"  # type: ignore[union-attr]
    assert vcpus(plan, "a") == {0: ("2-3", "plan"), 1: ("2-3", "plan")}


def test_counts_that_differ_are_vmpins_alone() -> None:
    """3 vCPUs on 2 CPUs: Kata does not pin (it puts them back over the cpuset); vmpin's
    partial plan applies as ever."""
    a = kata("a", "2-3", vmm_threads(100, 3, "2-3"))
    plan = plan_node(Observation((a,), kata=PINNING), topo("no-smt-server"))
    sp = plan.sandbox("a")
    assert sp is not None and sp.kata == "" and sp.mode == "partial"
    assert audit(plan)["notes"] == []


def test_untracked_sandbox_kata_pinned_is_left(tmp_path: Path) -> None:
    """A Kata VMM in the VM dir that vmpin does not track floats over the pool -- but not the
    vCPUs Kata pinned one per CPU (its cpuset is unknown to vmpin; the pins are Kata's)."""
    from tests.reconcile.test_plan import static

    stranger = kata("s", None, kata_layout(400, "4-5", "0-1"), tracked=False)
    obs = Observation((stranger,), static("0-1"), kata=PINNING)
    plan = plan_node(obs, topo("no-smt-server"))
    assert plan.sandbox("s").kata == "left"  # type: ignore[union-attr]
    assert vcpus(plan, "s") == {0: (None, "none"), 1: (None, "none")}
    assert desired(plan, "s")[400] == "0-1"
    assert writes(plan, tmp_path) == []
    # Kata's pinning off: they float over the pool like every thread of a stranger
    plan = plan_node(Observation((stranger,), static("0-1"), kata=OFF), topo("no-smt-server"))
    assert sorted(writes(plan, tmp_path)) == [(401, "0-1"), (402, "0-1")]
