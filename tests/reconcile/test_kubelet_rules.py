"""kubelet's static policy as a node runs it, read through the real observer and store (issue 25).

kubelet's CPU manager assigns CPUs to a pod's app and init containers only: a lookup for the
infra container has no answer.  Before issue 25 vmpin asked the checkpoint for every
container with a name, so CRI-O's infra container ``POD`` got ``defaultCpuSet`` and a
Guaranteed Kata pod's mask became its exclusive CPUs plus the whole shared pool (16 CPUs,
exclusive 2-5: mask ``0-5,12-15``, no 1:1).  A v1 checkpoint (entries by container id) was
read and never applied.  And a VMM thread vmpin leaves alone (``vmpin.io/vcpus: none``)
claimed nothing, so a neighbour's vCPU was pinned 1:1 onto a CPU it runs on.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.support.kubelet_util import write_checkpoint
from tests.support.make_sysfs import SYSFS_FIXTURES
from vmpin.core.cpuset import CpuSet
from vmpin.core.planner import Policy
from vmpin.linux.paths import HostPaths
from vmpin.linux.sysfs import read_topology
from vmpin.reconcile.audit import audit
from vmpin.reconcile.observe import (
    ContainerObs,
    Observation,
    Observer,
    SandboxObs,
    Scope,
    ThreadObs,
    VmmObs,
)
from vmpin.reconcile.plan import plan_node
from vmpin.runtimes.kubelet import Checkpoint, _dump_v1, fnv32a
from vmpin.state.records import ContainerRec, SandboxRec
from vmpin.state.store import Store

XEON = "xeon-gold-6258r-2s"  # 2 sockets x 28 cores x 2 threads: siblings n / n+56


def cs(text: str) -> CpuSet:
    return CpuSet.parse(text)


def _crio_pod(store: Store, sid: str, uid: str, app_cpus: str | None, infra_cpus: str | None
              ) -> None:  # fmt: skip
    """A Kata pod as CRI-O records it: infra container ``POD`` (its id is the sandbox id)."""
    store.put_sandbox(SandboxRec(sid, "kata", pod_uid=uid, pod_name=f"p-{sid}",
                                 pod_namespace="default"))  # fmt: skip
    store.put_container(ContainerRec(sid, sid, True, "POD", uid,
                                     cpus=cs(infra_cpus) if infra_cpus else None,
                                     cpus_source="spec"))  # fmt: skip
    store.put_container(ContainerRec(f"{sid}-app", sid, False, "app", uid,
                                     cpus=cs(app_cpus) if app_cpus else None,
                                     cpus_source="spec"))  # fmt: skip


def _containerd_pod(store: Store, sid: str, uid: str, app_cpus: str | None) -> None:
    """The same pod as containerd records it: the sandbox container has no name."""
    store.put_sandbox(SandboxRec(sid, "kata", pod_uid=uid))
    store.put_container(ContainerRec(sid, sid, True, None, uid))
    store.put_container(ContainerRec(f"{sid}-app", sid, False, "app", uid,
                                     cpus=cs(app_cpus) if app_cpus else None,
                                     cpus_source="spec"))  # fmt: skip


def _observe(paths: HostPaths) -> Observation:
    with Store(paths.state_dir) as store:
        return Observer(paths, Policy()).observe(store)


def _kubelet(obs: Observation) -> dict[str, CpuSet | None]:
    return {c.rec.id: c.kubelet_cpus for s in obs.sandboxes for c in s.containers}


def test_infra_container_is_not_looked_up_in_the_checkpoint(paths: HostPaths) -> None:
    """CRI-O's ``POD`` and containerd's nameless sandbox container get no kubelet answer."""
    write_checkpoint(paths.kubelet_state, "0-1,6-111", {"uid-g": {"app": "2-5"}})
    with Store(paths.state_dir) as store:
        _crio_pod(store, "g", "uid-g", "2-5", None)
        _containerd_pod(store, "c", "uid-c", None)
    obs = _observe(paths)
    assert _kubelet(obs) == {
        "g": None,  # before issue 25: 0-1,6-111, the shared pool
        "g-app": cs("2-5"),
        "c": None,
        "c-app": cs("0-1,6-111"),  # a shared (Burstable) app container: the pool
    }
    plan = plan_node(obs, read_topology(str(SYSFS_FIXTURES / XEON)))
    g = plan.sandbox("g")
    assert g is not None and g.mask == cs("2-5")  # before: 0-111 (exclusive + the pool)
    # the infra container's record does not move to the pool by adoption either
    assert not [a for a in plan.adoptions if a.container in ("g", "c")]


def test_infra_cpus_from_an_older_vmpin_or_crio_never_widen_the_mask() -> None:
    """A pool adopted onto the infra record by an older vmpin, or CRI-O's
    ``infra_ctr_cpuset`` (the reserved CPUs) in its spec: neither is the pod's."""
    t = read_topology(str(SYSFS_FIXTURES / XEON))
    threads = [ThreadObs(100, "emulator", None, None, "", "qemu", cs("0-111"))]
    threads += [ThreadObs(101 + i, "vcpu", i, None, "", None, cs("0-111")) for i in range(4)]
    for infra_cpus, source in (("0-1,6-111", "kubelet"), ("0-1", "spec")):
        ctrs = (
            ContainerObs(ContainerRec("g", "g", True, "POD", "uid-g", cpus=cs(infra_cpus),
                                      cpus_source=source)),
            ContainerObs(ContainerRec("g-app", "g", False, "app", "uid-g", cpus=cs("2-5"),
                                      cpus_source="kubelet", kubelet_seen="2-5"),
                         kubelet_cpus=cs("2-5")),
        )
        g = SandboxObs("g", "kata", Policy(), SandboxRec("g", "kata", 100, 1, pod_uid="uid-g"),
                       ctrs, VmmObs(100, 1, tuple(threads)))  # fmt: skip
        cp = Checkpoint("static", cs("0-1,6-111"), {"uid-g": {"app": cs("2-5")}}, 1)
        plan = plan_node(Observation((g,), cp), t)
        sp = plan.sandbox("g")
        assert sp is not None and sp.mask == cs("2-5") and sp.mode == "1:1", (source, sp.reason)
        assert sorted(sp.pinned_cpus) == [2, 3, 4, 5]
        assert plan.conflicts == ()


def test_v1_checkpoint_entries_apply_by_container_id(paths: HostPaths) -> None:
    """kubelet < 1.12 keyed entries by container id: applied, and exclusive."""
    policy, default, entries = "static", "0-1,6-111", {"g-app": "2-5"}
    doc = {"policyName": policy, "defaultCpuSet": default, "entries": entries,
           "checksum": fnv32a(_dump_v1("CPUManagerCheckpoint", policy, default, entries))}
    Path(paths.kubelet_state).write_text(json.dumps(doc))
    with Store(paths.state_dir) as store:
        _crio_pod(store, "g", "uid-g", None, None)  # the spec said nothing: kubelet does
        _crio_pod(store, "b", "uid-b", None, None)
    obs = _observe(paths)
    assert obs.checkpoint_error is None
    assert _kubelet(obs)["g-app"] == cs("2-5")  # before issue 25: the pool
    assert _kubelet(obs)["b-app"] == cs("0-1,6-111")
    plan = plan_node(obs, read_topology(str(SYSFS_FIXTURES / XEON)))
    assert plan.sandbox("g").mask == cs("2-5")  # type: ignore[union-attr]
    assert {cpu for cpu, claim in plan.exclusive.items() if claim.sandbox == "g"} == {2, 3, 4, 5}


def _vmm(pid: int, nvcpus: int, actual: str) -> VmmObs:
    threads = [ThreadObs(pid, "emulator", None, None, "", "qemu", cs(actual))]
    threads += [ThreadObs(pid + 1 + i, "vcpu", i, None, "", None, cs(actual))
                for i in range(nvcpus)]  # fmt: skip
    return VmmObs(pid, pid * 10, tuple(threads))


def _kata(sid: str, cpus: str, vmm: VmmObs, policy: Policy = Policy()) -> SandboxObs:
    rec = SandboxRec(sid, "kata", vmm.pid, vmm.start, pod_uid=f"uid-{sid}")
    ctrs = (ContainerObs(ContainerRec(f"{sid}-app", sid, False, "app", f"uid-{sid}",
                                      cpus=cs(cpus), cpus_source="spec")),)  # fmt: skip
    return SandboxObs(sid, "kata", policy, rec, ctrs, vmm)


def test_threads_left_alone_hold_the_cpus_they_run_on() -> None:
    """``vmpin.io/vcpus: none`` keeps its vCPU on 0-1; the neighbour on 0 is not pinned 1:1
    there (before issue 25: 1:1 on 0, a double pin no pass could clear)."""
    t = read_topology(str(SYSFS_FIXTURES / "no-smt-server"))
    alone = _kata("n", "1", _vmm(100, 1, "0-1"), Policy(vcpus="none", helpers="none"))
    neighbour = _kata("a", "0", _vmm(200, 1, "0-15"))
    plan = plan_node(Observation((alone, neighbour)), t)
    a = plan.sandbox("a")
    assert a is not None and a.mode == "float" and a.pinned_cpus == {}, a.reason
    assert "0" in a.reason
    n = plan.sandbox("n")
    assert n is not None and {x.desired for x in n.threads} == {None}
    assert plan.problems == ()
    result = audit(plan)
    assert not [v for v in result["violations"] if v["kind"] == "double-pin"]

    # vCPUs left alone but helpers placed: only the vCPU's CPUs are held
    vcpus_only = _kata("n", "1", _vmm(100, 1, "1"), Policy(vcpus="none"))
    free = _kata("a", "0", _vmm(200, 1, "0-15"))
    plan = plan_node(Observation((vcpus_only, free)), t)
    assert plan.sandbox("a").mode == "1:1"  # type: ignore[union-attr]

    # a VMM vmpin does not track (another pinner's VM) holds where its threads run
    stranger = SandboxObs("s", "kata", Policy(), None, (), _vmm(300, 1, "0"))
    plan = plan_node(Observation((stranger, _kata("a", "0", _vmm(200, 1, "0-15")))), t)
    assert plan.sandbox("a").mode == "float"  # type: ignore[union-attr]
    plan = plan_node(Observation((stranger, _kata("a", "2", _vmm(200, 1, "0-15")))), t)
    assert plan.sandbox("a").mode == "1:1"  # type: ignore[union-attr]


def test_views_read_the_affinity_of_threads_left_alone() -> None:
    """The narrow scopes of ``sandboxes``/``show`` widen to the affinity of threads left
    alone: a neighbour's mode in a view must be what a full pass plans."""
    from vmpin.reconcile.observation import claiming, leaves_alone

    narrow = Scope(True, frozenset({"a"}), False, False)
    assert leaves_alone(True, Policy(vcpus="none"))
    assert leaves_alone(False, Policy())
    assert not leaves_alone(True, Policy())
    wide = claiming(narrow)
    assert wide.reads_threads("n") and wide.affinity
    assert claiming(Scope(False)) == Scope(False)  # a view that locates no VMM stays so
