"""``vmpin explain``: who is on a CPU and why, what a pod or container gets and why.

An operator's first question on a pinned node is "who is on CPU 7, and why".  The answer is in
one node plan (:mod:`vmpin.reconcile.plan`): kubelet's claims, each sandbox's mask and the
containers it is the union of, every VMM thread's planned and actual affinity with the rule
that placed it, every runc container's cgroup.  This module reads a plan and says it; it is
pure (no host access) and builds the ``--json`` view with vmpin.wire.views (``vmpin schema
explain``).

Every claimant carries ``rule``: one sentence naming the rule that put it there, in the
words of docs/design.md, so that the text and the JSON say the same.
"""

from __future__ import annotations

from typing import Any

from vmpin.core.cpuset import CpuSet
from vmpin.core.cpuset import listed as _cpus
from vmpin.core.errors import StateError
from vmpin.core.topology import Topology
from vmpin.reconcile.plan import ContainerPlan, NodePlan, SandboxPlan, ThreadPlan
from vmpin.wire import views

#: where a container's CPU set came from (the store's ``cpus_source``), in words
SOURCES = {
    "spec": "its OCI spec at create (linux.resources.cpu.cpus)",
    "update": "vmpin update (CRI UpdateContainerResources)",
    "runc": "runc update (runc's state)",
    "kubelet": "kubelet's checkpoint",
}


def _pod(sp: SandboxPlan) -> dict[str, Any]:
    rec = sp.obs.record
    if rec is None:
        return views.explain_pod_of(uid=None, name=None, namespace=None)
    return views.explain_pod_of(uid=rec.pod_uid, name=rec.pod_name, namespace=rec.pod_namespace)


def _container_rule(c: ContainerPlan, pool: CpuSet | None) -> str:
    rec = c.rec
    if rec.cpus is None:
        if c.desired is not None and pool is not None and c.desired == pool:
            return "no CPU set of its own: the shared pool (kubelet's defaultCpuSet)"
        return "no CPU set of its own"
    where = SOURCES.get(rec.cpus_source or "", rec.cpus_source or "unknown")
    return f"its CPU set {rec.cpus.to_list()}, from {where}"


def _thread_rule(sp: SandboxPlan, t: ThreadPlan) -> str:
    if t.role == "container":
        return "a task of a runc container: its cgroup's cpuset"
    what = f"vCPU {t.index}" if t.role == "vcpu" and t.index is not None else t.role
    if t.kind == "undo":
        return f"{what}: vmpin no longer places it and gives back {_cpus(t.desired)}"
    if t.kind == "none" or t.desired is None:
        if not sp.obs.tracked:
            return f"{what} of a VMM vmpin does not track: left where it runs"
        return f"{what}: left where its runtime put it ({sp.reason or 'policy none'})"
    if t.role == "vcpu" and len(t.desired) == 1 and sp.mode in ("1:1", "partial"):
        return f"{what} pinned 1:1 ({sp.mode}: {sp.reason})"
    if t.role == "vcpu":
        return f"{what} floats over {t.desired.to_list()} ({sp.mode}: {sp.reason})"
    return f"{what}: helper policy {sp.obs.policy.helpers}, on {t.desired.to_list()}"


def _thread_entry(sp: SandboxPlan, t: ThreadPlan, cpu: int | None) -> dict[str, Any]:
    rule = _thread_rule(sp, t)
    if (
        cpu is not None
        and t.desired is not None
        and t.actual is not None
        and cpu in t.actual
        and cpu not in t.desired
    ):
        rule += f"; drift: it runs here, planned for {t.desired.to_list()}"
    return views.explain_thread(
        kind="thread", sandbox=sp.id, runtime=sp.runtime, pod=_pod(sp), tid=t.tid, role=t.role,
        index=t.index, container=t.container, desired=_cpus(t.desired), actual=_cpus(t.actual),
        rule=rule,
    )  # fmt: skip


def explain_cpu(plan: NodePlan, topology: Topology, cpu: int) -> dict[str, Any]:
    """Every claimant of ``cpu``: kubelet's, each sandbox whose mask holds it (and the
    containers that put it there), every thread planned or running on it."""
    if cpu not in topology.cpus:
        raise StateError(f"CPU {cpu}: no such CPU on this host (online: {topology.online})")
    pool = plan.shared_pool
    claim = plan.exclusive.get(cpu)
    if claim is not None:
        rule = f"kubelet gives it to pod {claim.pod} ({claim.container}) alone"
    elif pool is None:
        rule = "kubelet's static policy is not in force: no CPU is exclusive"
    elif cpu in pool:
        rule = "in kubelet's shared pool (defaultCpuSet)"
    else:
        rule = "outside kubelet's shared pool and given to no container (reserved or idle)"
    kubelet = views.explain_kubelet(
        pool=None if pool is None else cpu in pool,
        exclusive=None if claim is None else claim.to_json(),
        rule=rule,
    )
    claimants: list[dict[str, Any]] = []
    for sp in plan.sandboxes:
        if cpu in sp.mask:
            why = [
                f"{c.rec.name or c.rec.id}: {_container_rule(c, pool)}"
                for c in sp.containers
                if c.rec.cpus is not None and cpu in c.rec.cpus
            ]
            claimants.append(views.explain_sandbox(
                kind="sandbox", sandbox=sp.id, runtime=sp.runtime, pod=_pod(sp), mode=sp.mode,
                rule=f"in its mask {sp.mask.to_list()} (the union of its containers' sets): "
                + "; ".join(why),
            ))  # fmt: skip
        for t in sp.threads:
            on = (t.desired is not None and cpu in t.desired) or (
                t.actual is not None and cpu in t.actual
            )
            if on:
                claimants.append(_thread_entry(sp, t, cpu))
    info = topology.info(cpu)
    return views.explain_cpu(
        cpu=cpu, online=cpu in topology.online, isolated=cpu in topology.isolated,
        socket=info.socket, core=info.core, siblings=info.siblings.to_list(), kubelet=kubelet,
        claimants=claimants,
    )  # fmt: skip


def _match(sp: SandboxPlan, key: str) -> bool:
    rec = sp.obs.record
    if sp.id == key:
        return True
    if rec is None:
        return False
    return key in (rec.pod_uid, rec.pod_name, f"{rec.pod_namespace}/{rec.pod_name}")


def explain_pod(plan: NodePlan, key: str) -> dict[str, Any]:
    """A pod (uid, name, namespace/name or sandbox id): its sandbox, policy, CPUs and why."""
    found = [sp for sp in plan.sandboxes if _match(sp, key)]
    if not found:
        raise StateError(f"unknown pod {key!r}: no tracked sandbox has that uid, name or id")
    if len(found) > 1:
        names = ", ".join(sp.id for sp in found)
        raise StateError(f"pod {key!r} names several sandboxes ({names}): give a uid or an id")
    sp = found[0]
    pool = plan.shared_pool
    p = sp.obs.policy
    return views.explain_pod(
        sandbox=sp.id,
        runtime=sp.runtime,
        pod=_pod(sp),
        mask=sp.mask.to_list(),
        mode=sp.mode,
        reason=sp.reason,
        policy=views.explain_policy(
            vcpus=p.vcpus,
            helpers=p.helpers,
            source=sp.obs.policy_source,
            problems=list(sp.obs.policy_problems),
        ),
        containers=[
            views.explain_pod_container(
                id=c.rec.id,
                name=c.rec.name,
                cpus=_cpus(c.desired if sp.runtime == "runc" else c.rec.cpus),
                rule=_container_rule(c, pool),
            )
            for c in sp.containers
        ],
        threads=[_thread_entry(sp, t, None) for t in sp.threads],
        notes=list(sp.notes),
    )


def explain_container(plan: NodePlan, container_id: str) -> dict[str, Any]:
    """A container: its CPUs, where they came from, what kubelet and runc say, its guest CPUs."""
    for sp in plan.sandboxes:
        for c in sp.containers:
            if c.rec.id != container_id:
                continue
            guest = ((sp.guest_map or {}).get("containers") or {}).get(container_id) or {}
            return views.explain_container(
                container=c.rec.id,
                name=c.rec.name,
                sandbox=sp.id,
                runtime=sp.runtime,
                pod=_pod(sp),
                cpus=_cpus(c.desired if sp.runtime == "runc" else c.rec.cpus),
                source=c.rec.cpus_source,
                rule=_container_rule(c, plan.shared_pool),
                kubelet=_cpus(c.obs.kubelet_cpus),
                runc=c.obs.runc_cpus,
                cgroup=_cpus(c.obs.cgroup_cpus),
                guest_cpus=guest.get("guest_cpus"),
                sandbox_mode=sp.mode,
            )
    raise StateError(f"unknown container {container_id!r} (see `vmpin containers`)")


def explain(plan: NodePlan, topology: Topology, what: str) -> dict[str, Any]:
    """``what``: a CPU number, else a container id, else a pod (see the functions above)."""
    if what.isdigit():
        return views.explain(cpu=explain_cpu(plan, topology, int(what)))
    known = {c.rec.id for sp in plan.sandboxes for c in sp.containers}
    if what in known:
        return views.explain(container=explain_container(plan, what))
    return views.explain(pod=explain_pod(plan, what))
