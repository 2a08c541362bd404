"""Audit: the node-wide invariant, checked on an observation and its plan, writing nothing.

``vmpin audit`` exits 1 exactly when one of these is found (DESIGN.md's violation kinds):

- ``drift``: a managed thread (or a runc container's cgroup) is not where the plan puts it
  (invariant 3);
- ``double-pin``: a CPU that a vCPU is pinned to 1:1 is also in the actual affinity of a
  thread of another sandbox -- managed or not, tracked or merely in the VM dir, or a runc
  container's task (invariant 1);
- ``foreign-on-exclusive``: a thread or a runc cgroup may run on a CPU kubelet assigns
  exclusively to a container of another pod (invariant 2);
- ``stale-pin``: a thread vmpin pinned and no longer manages still has vmpin's affinity,
  not the one it is to get back (invariant 4);
- ``conflict``: two pods claim one exclusive CPU; ``claimants`` names both (invariant 5);
- ``error``: an object that could not be read, or a plan that breaks the node rules.

Every check reads ``actual`` values of the observation, i.e. straight from /proc and cgroupfs.

``notes`` (additive; never a violation, ``ok`` does not depend on them): what the operator
should know to read the result -- a Kata configuration that turns on Kata's own vCPU pinning
(``enable_vcpus_pinning``) or could not be read, and each sandbox whose vCPUs vmpin therefore
pins in Kata's layout or leaves where Kata pinned them (vmpin.reconcile.plan).
"""

from __future__ import annotations

from vmpin.core.cpuset import CpuSet
from vmpin.core.cpuset import listed as _cpus
from vmpin.reconcile.plan import NodePlan, SandboxPlan, ThreadPlan
from vmpin.wire import views

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Literal

    from vmpin.reconcile.observation import Observation

    Kind = Literal["drift", "double-pin", "foreign-on-exclusive", "conflict", "stale-pin", "error"]

KINDS = ("drift", "double-pin", "foreign-on-exclusive", "conflict", "stale-pin", "error")


def _v(
    kind: Kind, sandbox: str | None, t: ThreadPlan | None, reason: str, **extra: Any
) -> dict[str, Any]:
    """A violation (views.violation) of thread ``t`` (or of none), ``extra`` given or
    overriding its keys."""
    keys: dict[str, Any] = {"tid": None, "role": None, "index": None, "desired": None,
                            "actual": None, "container": None}  # fmt: skip
    if t is not None:
        keys.update(tid=t.tid, role=t.role, index=t.index, desired=_cpus(t.desired),
                    actual=_cpus(t.actual), container=t.container)  # fmt: skip
    keys.update(extra)
    return views.violation(kind=kind, sandbox=sandbox, reason=reason, **keys)


def violations(plan: NodePlan) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    pods = {sp.id: _pod_of(sp) for sp in plan.sandboxes}
    runs_on = _runs_on(plan)
    foreign: dict[tuple[CpuSet, str], tuple[str, dict[str, Any]] | None] = {}

    def foreign_hit(actual: CpuSet, pod: str) -> tuple[str, dict[str, Any]] | None:
        key = (actual, pod)
        if key not in foreign:
            foreign[key] = _foreign(plan, actual, pod)
        return foreign[key]

    for sp in plan.sandboxes:
        if sp.vanished:
            continue
        out.extend(_errors(sp))
        for t in sp.threads:
            if t.actual is None or t.desired is None:
                continue
            if t.role == "container":
                # a process may narrow itself inside its container's cpuset
                wrong = not t.actual.issubset(t.desired)
            else:
                wrong = t.actual != t.desired
            if wrong and t.kind == "undo":
                out.append(_v("stale-pin", sp.id, t, "vmpin's pin left behind: not given back"))
            elif wrong:
                out.append(_v("drift", sp.id, t, "affinity differs from plan"))
        for c in sp.containers:
            cur = c.obs.cgroup_cpus
            if c.obs.cgroup is None or cur is None or c.desired is None or cur == c.desired:
                continue
            out.append(
                _v(
                    "drift",
                    sp.id,
                    None,
                    "cgroup cpuset.cpus differs from plan",
                    role="container",
                    container=c.rec.id,
                    cgroup=c.obs.cgroup.path,
                    desired=c.desired.to_list(),
                    actual=cur.to_list(),
                )
            )
        # invariant 1, read from the actual affinities of everyone else
        for cpu, tid in sorted(sp.pinned_cpus.items()):
            pinned = next(t for t in sp.threads if t.tid == tid)
            for other_id, t in runs_on.get(cpu, ()):
                if other_id == sp.id:
                    continue
                out.append(
                    _v(
                        "double-pin",
                        sp.id,
                        pinned,
                        f"CPU {cpu} is vCPU {pinned.index}'s alone, and thread {t.tid}"
                        f" ({t.role}) of {other_id} may run there",
                        other_sandbox=other_id,
                        other_tid=t.tid,
                        other_role=t.role,
                    )
                )
        # invariant 2 (nothing to find where kubelet assigns no CPU exclusively)
        for t in sp.threads if plan.exclusive else ():
            if t.actual is None:
                continue
            hit = foreign_hit(t.actual, pods[sp.id])
            if hit:
                out.append(_v("foreign-on-exclusive", sp.id, t, hit[0], claimant=hit[1]))
        for c in sp.containers if plan.exclusive else ():
            if c.obs.cgroup_cpus is None:
                continue
            hit = foreign_hit(c.obs.cgroup_cpus, pods[sp.id])
            if hit:
                out.append(
                    _v(
                        "foreign-on-exclusive",
                        sp.id,
                        None,
                        "cgroup: " + hit[0],
                        role="container",
                        container=c.rec.id,
                        claimant=hit[1],
                        actual=c.obs.cgroup_cpus.to_list(),
                    )
                )
    for conflict in plan.conflicts:
        first, second = conflict.first, conflict.second
        out.append(
            _v(
                "conflict",
                first.sandbox or second.sandbox,
                None,
                f"CPUs {conflict.cpus} claimed as their own by pod {first.pod} ({first.container})"
                f" and pod {second.pod} ({second.container})",
                actual=conflict.cpus.to_list(),
                claimants=[first.to_json(), second.to_json()],
            )
        )
    for problem in plan.problems:
        out.append(_v("error", None, None, f"plan: {problem}"))
    return out


def _runs_on(plan: NodePlan) -> dict[int, list[tuple[str, ThreadPlan]]]:
    """For each CPU some vCPU is pinned to 1:1: every thread (sandbox, thread) whose actual
    affinity holds it, in plan order.

    One walk over the node's threads, so invariant 1 is checked in time linear in threads
    (asking every other sandbox's threads for each pinned CPU was quadratic: 0.8 s at 500
    sandboxes); what is left per pinned CPU is the hits, each one a violation but its own.
    """
    pinned = CpuSet(
        {cpu for sp in plan.sandboxes if not sp.vanished for cpu in sp.pinned_cpus}
    )
    out: dict[int, list[tuple[str, ThreadPlan]]] = {}
    if not pinned:
        return out
    hits: dict[CpuSet, CpuSet] = {}
    for sp in plan.sandboxes:
        if sp.vanished:
            continue
        for t in sp.threads:
            if t.actual is None:
                continue
            on = hits.get(t.actual)
            if on is None:
                on = hits[t.actual] = t.actual & pinned
            for cpu in on:
                out.setdefault(cpu, []).append((sp.id, t))
    return out


def _pod_of(sp: SandboxPlan) -> str:
    from vmpin.reconcile.plan import _pod

    return _pod(sp.obs)


def _foreign(plan: NodePlan, actual: CpuSet, pod: str) -> tuple[str, dict[str, Any]] | None:
    for cpu in actual:
        claim = plan.exclusive.get(cpu)
        if claim is not None and claim.pod != pod:
            return (
                f"may run on CPU {cpu}, exclusive to pod {claim.pod} ({claim.container})",
                claim.to_json(),
            )
    return None


def _errors(sp: SandboxPlan) -> list[dict[str, Any]]:
    out = [_v("error", sp.id, None, e) for e in sp.errors]
    for c in sp.containers:
        if c.obs.error:
            out.append(_v("error", sp.id, None, c.obs.error, container=c.rec.id))
    for t in sp.threads:
        if t.error:
            out.append(_v("error", sp.id, t, t.error))
    return out


def notes(plan: NodePlan, node_notes: list[str] | None = None) -> list[str]:
    """The node's notes, then each sandbox's Kata note (see the module docstring)."""
    out = list(node_notes or ())
    for sp in plan.sandboxes:
        if sp.kata and not sp.vanished:
            out.extend(f"sandbox {sp.id}: {n}" for n in sp.notes if n.startswith("Kata pins"))
    return out


def audit(
    plan: NodePlan, checkpoint_error: str | None = None, node_notes: list[str] | None = None
) -> dict[str, Any]:
    found = violations(plan)
    if checkpoint_error:
        found.append(_v("error", None, None, checkpoint_error))
    live = [sp for sp in plan.sandboxes if not sp.vanished and sp.obs.tracked]
    return views.audit(
        ok=not found,
        violations=found,
        sandboxes=len(live),
        threads=sum(len(sp.threads) for sp in live),
        errors=[f"{sp.id}: {e}" for sp in live for e in sp.errors],
        notes=notes(plan, node_notes),
    )


def node_audit(obs: Observation, plan: NodePlan) -> dict[str, Any]:
    """``vmpin audit``'s result for a node observed as ``obs`` and planned as ``plan``: the
    one home of what it adds to :func:`audit` (Kata's own pinning, pods waiting for CPUs), for
    the command's in-process pass and the agent's (vmpin.service.agent_views) alike."""
    from vmpin.reconcile.allocations import notes as waiting

    node_notes = obs.kata.notes() if obs.kata is not None else []
    node_notes += waiting(obs)  # pods waiting for exclusive CPUs, and why (issue 30)
    return audit(plan, obs.checkpoint_error, node_notes)
