"""The sandbox plans the agent's last passes applied cleanly: what an event's pass need not
apply again.

An event's pass plans every sandbox, but gives most of them the very plan object of the last
pass (``plan_node``'s ``memo``: the same observation under the same node-wide inputs).  Such a
plan was applied then, and what that pass pinned went into the observation it was planned
from (``Observer.note_applied``: a pinned thread makes the next plan a new object).  Applying
it again walks every thread of the node to find each where the last pass left it, and checks
every guest map: at 2,000 sandboxes, 8,000 threads and 2,000 ``lstat`` calls for one event
(issue 28).  So an event's pass applies only the sandboxes it names and those whose plan is
not one the last passes applied without an error; the periodic pass applies everything.
"""

from __future__ import annotations

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.lean.records)
if TYPE_CHECKING:
    from collections.abc import Collection

    from vmpin.reconcile.apply import Applied
    from vmpin.reconcile.plan import NodePlan, SandboxPlan

def _same_work(before: SandboxPlan | None, sp: SandboxPlan) -> bool:
    """Whether applying ``sp`` would do what applying ``before`` did: the very plan, or the
    same threads, containers and guest map of a sandbox whose record moved in its
    bookkeeping alone and is not dirty (plan_node gives such a plan its new observation)."""
    if before is sp:
        return True
    if before is None or before.threads is not sp.threads or before.containers is not sp.containers:
        return False
    rec = sp.obs.record
    return (
        before.guest_map is sp.guest_map
        and before.obs.vmm is sp.obs.vmm
        and rec is not None
        and rec.gen <= rec.done_gen
    )


class Settled:
    """Sandbox id -> the plan applied without an error by the last pass that applied it."""

    __slots__ = ("_plans",)

    def __init__(self) -> None:
        self._plans: dict[str, SandboxPlan] = {}

    def to_apply(self, plan: NodePlan, named: Collection[str]) -> set[str]:
        """The sandboxes of ``plan`` an event's pass applies: those ``named``, and those
        whose plan is not the very one applied cleanly before."""
        plans = self._plans
        out = set(named)
        out.update(
            sp.id
            for sp in plan.sandboxes
            if (before := plans.get(sp.id)) is not sp and not _same_work(before, sp)
        )
        return out

    def note(self, plan: NodePlan, applied: Applied, only: Collection[str] | None) -> None:
        """What a pass applied (``only``: those sandboxes, ``applied`` its apply of them;
        else every one)."""
        bad = set(applied.errors)
        bad.update(applied.unclean)  # (a thread apply left for the next pass to try again)
        bad.update(
            sid for sid, drifts in applied.cgroups.items()
            if any(not d.get("repaired") for d in drifts)
        )  # fmt: skip
        if only is None:
            self._plans = {
                sp.id: sp for sp in plan.sandboxes if not sp.vanished and sp.id not in bad
            }
            return
        # (an event's pass: the others stand; a sandbox gone meanwhile stays here until the
        # next full pass, harmless: a sandbox of that id again has another plan)
        plans = self._plans
        for sp in applied.sandboxes:  # (those of ``only``)
            if sp.vanished or sp.id in bad:
                plans.pop(sp.id, None)
            else:
                plans[sp.id] = sp

    def forget(self) -> None:
        self._plans = {}


__all__ = ["Settled"]
