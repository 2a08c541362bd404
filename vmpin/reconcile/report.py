"""Report views: what one pass saw and did, per sandbox and per thread, for people and JSON.

Built from a :class:`~vmpin.reconcile.plan.SandboxPlan` and, when the pass applied, the
:class:`~vmpin.reconcile.apply.Outcome` of each thread (:func:`sandbox_report`); a node pass's
reports, with the conflicts each sandbox is in, by :func:`node_reports`.  The CLI's
``show``/``sandboxes``/``reconcile`` and the agent's accounting read these; their JSON keys are
DESIGN.md's contract.
"""

from __future__ import annotations

from vmpin.core.cpuset import EMPTY, CpuSet
from vmpin.state.records import ContainerRec

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.lean.records)

if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import Any

    from vmpin.core.planner import Plan, Policy
    from vmpin.reconcile.apply import Applied
    from vmpin.reconcile.plan import NodePlan, SandboxPlan
    from vmpin.state.records import SandboxRec


class ThreadReport:
    """What one pass saw and did for one thread (mutable while the pass runs)."""

    __slots__ = (
        "action",
        "actual",
        "container",
        "desired",
        "error",
        "index",
        "layer",
        "name",
        "role",
        "tid",
    )

    def __init__(
        self,
        tid: int | None,
        role: str,
        index: int | None,
        name: str | None,
        desired: CpuSet | None,
        actual: CpuSet | None,
        layer: str = "",
        container: str | None = None,
        action: str = "ok",
        error: str | None = None,
    ) -> None:
        self.tid, self.role, self.index, self.name = tid, role, index, name
        self.desired, self.actual, self.layer = desired, actual, layer
        self.container = container
        #: ok | pinned | gone | error | unmanaged | drift
        self.action, self.error = action, error

    def violates(self) -> bool:
        if self.desired is None or self.actual is None:
            return False
        if self.role == "container":
            # A process may narrow itself inside its container's cpuset; leaving it is drift.
            return not self.actual.issubset(self.desired)
        return self.actual != self.desired

    def to_json(self) -> dict[str, Any]:
        from vmpin.wire import views  # (here: the hooks, which load this module, print none)

        return views.thread(
            tid=self.tid,
            role=self.role,  # type: ignore[arg-type]
            index=self.index,
            name=self.name,
            desired=None if self.desired is None else self.desired.to_list(),
            actual=None if self.actual is None else self.actual.to_list(),
            layer=self.layer,
            container=self.container,
            action=self.action,
            error=self.error,
        )


class SandboxReport:
    """What one pass saw and did for one sandbox."""

    def __init__(self, id: str, runtime: str, vmm_pid: int | None = None) -> None:
        self.id, self.runtime, self.vmm_pid = id, runtime, vmm_pid
        self.mask: CpuSet = EMPTY
        self.mode = "none"
        self.reason = ""
        self.threads: list[ThreadReport] = []
        self.containers: list[ContainerRec] = []
        self.plan: Plan | None = None
        self.layers: list[str] = []
        self.notes: list[str] = []
        self.errors: list[str] = []
        self.cgroup_drift: list[dict[str, Any]] = []
        self.vanished = False
        self.guest_map: dict[str, Any] | None = None
        #: conflicts this sandbox is part of (invariant 5)
        self.conflicts: list[dict[str, Any]] = []
        #: the policy this pass planned with, where it came from (node, oci, api), and the
        #: pod's annotations it could not use (vmpin.reconcile.podpolicies)
        self.policy: Policy | None = None
        self.policy_source = "node"
        self.policy_problems: list[str] = []
        #: when the policy's source recorded it in the store (None: the node's, or unknown)
        self.policy_at: float | None = None
        #: the sandbox's stored record as the pass observed it, before the pass's own writes
        #: (None: not in the store, e.g. a libvirt domain): the agent accounts the pass by it
        #: rather than by a read of its own (vmpin.service.agent_passes)
        self.record: SandboxRec | None = None

    def policy_json(self) -> dict[str, Any] | None:
        """The policy in effect and where it came from, as ``show`` prints it."""
        p = self.policy
        if p is None:
            return None
        from vmpin.wire import views  # (here: the hooks, which load this module, print none)

        return views.policy(
            vcpus=p.vcpus,
            helpers=p.helpers,
            housekeeping=p.housekeeping.to_list() or None,
            guest=p.guest,
            cpuset=p.cpuset or None,
            source=self.policy_source,  # type: ignore[arg-type]
            recorded_at=self.policy_at,
            problems=self.policy_problems,
        )

    @property
    def changed(self) -> int:
        return sum(1 for t in self.threads if t.action == "pinned")


def sandbox_report(sp: SandboxPlan, applied: Applied | None) -> SandboxReport:
    s = sp.obs
    report = SandboxReport(sp.id, sp.runtime, s.vmm.pid if s.vmm is not None else None)
    if report.vmm_pid is None and s.record is not None and s.record.vmm_start is not None:
        report.vmm_pid = s.record.vmm_pid
    report.mask, report.mode, report.reason = sp.mask, sp.mode, sp.reason
    report.policy, report.policy_source = s.policy, s.policy_source
    report.policy_problems = list(s.policy_problems)
    report.policy_at = s.policy_at
    # (a libvirt domain's record is made by its observation: no store holds it)
    report.record = s.record if sp.runtime != "libvirt" else None
    report.containers = [c.rec for c in sp.containers]
    report.plan, report.guest_map, report.vanished = sp.plan, sp.guest_map, sp.vanished
    report.notes = list(sp.notes)
    report.errors = list(sp.errors)
    if s.vmm is not None:
        report.layers = list(s.vmm.layers)
        report.notes.extend(s.vmm.notes)
    for c in sp.containers:
        report.notes.extend(f"container {c.rec.id}: {n}" for n in c.obs.notes)
        if c.obs.error:
            report.errors.append(f"container {c.rec.id}: {c.obs.error}")
        elif c.obs.cgroup is None and (not c.rec.is_sandbox or c.desired is not None):
            report.notes.append(f"container {c.rec.id}: no cgroup found")
    outcomes = (None if applied is None else applied.threads.get(sp.id)) or {}
    append = report.threads.append
    for t in sp.threads:
        out = outcomes.get(t.tid)
        if out is None:
            # (here, not per call: an agent's pass reports every sandbox, every thread applied)
            from vmpin.reconcile.apply import outcome_without_apply

            out = outcome_without_apply(t)
        r = ThreadReport(
            t.tid, t.role, t.index, t.name, t.desired, out.actual, t.layer, t.container,
            out.action, out.error,
        )  # fmt: skip
        if t.role == "container" and r.violates():
            r.action = "drift"
        append(r)
    if applied is not None:
        report.cgroup_drift = applied.cgroups.get(sp.id, [])
        report.errors.extend(applied.errors.get(sp.id, []))
    else:
        for c in sp.containers:
            cur = c.obs.cgroup_cpus
            if c.obs.cgroup is None or cur is None or c.desired is None or cur == c.desired:
                continue
            report.cgroup_drift.append(
                {
                    "container": c.rec.id,
                    "cgroup": c.obs.cgroup.path,
                    "desired": c.desired.to_list(),
                    "actual": cur.to_list(),
                }
            )
    return report


def node_reports(
    plan: NodePlan,
    applied: Applied | None,
    sandbox_ids: list[str] | None = None,
    among: Sequence[SandboxPlan] | None = None,
) -> list[SandboxReport]:
    """The reports of a node pass: of ``sandbox_ids`` in that order (default: every tracked
    sandbox, in the plan's order), each with the conflicts its sandbox is in.  ``among``:
    the plan's sandbox plans that hold every one of ``sandbox_ids`` the plan has (an event's
    pass: those it applied), looked through instead of the node's."""
    conflicts: dict[str, list[dict[str, Any]]] = {}
    for c in plan.conflicts:
        entry = {"cpus": c.cpus.to_list(), "claimants": [c.first.to_json(), c.second.to_json()]}
        for sid in sorted(c.sandboxes()):
            conflicts.setdefault(sid, []).append(entry)
    wanted = None if sandbox_ids is None else set(sandbox_ids)
    reports = []
    for sp in plan.sandboxes if among is None else among:
        if wanted is not None and sp.id not in wanted:
            continue
        if not sp.obs.tracked:
            continue
        report = sandbox_report(sp, applied)
        report.conflicts = [dict(e) for e in conflicts.get(sp.id, ())]
        reports.append(report)
    if sandbox_ids is not None:
        order = {sid: i for i, sid in enumerate(sandbox_ids)}
        reports.sort(key=lambda r: order[r.id])
    return reports
