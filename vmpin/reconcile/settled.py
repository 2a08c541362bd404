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
    from collections.abc import Collection, Iterable

    from vmpin.reconcile.apply import Applied
    from vmpin.reconcile.plan import NodePlan, SandboxPlan

def _same_work(before: SandboxPlan | None, sp: SandboxPlan) -> bool:
    """Whether applying ``sp`` would do what applying ``before`` did: the very plan, or the
    same threads, containers and guest map of a sandbox whose record moved in its
    bookkeeping alone and is not dirty (plan_node gives such a plan its new observation) --
    or whose threads' plans moved in their affinities alone, each now where its plan puts
    it: what applying ``before`` pinned, read back (plan_node gives such a plan the
    affinities observed: the sandbox of the last event's pass, at the next one)."""
    if before is sp:
        return True
    if before is None or before.containers is not sp.containers:
        return False
    rec = sp.obs.record
    if before.guest_map is not sp.guest_map or rec is None or rec.gen > rec.done_gen:
        return False
    if before.threads is sp.threads:
        return before.obs.vmm is sp.obs.vmm
    return _pinned_as_planned(before, sp)


def _pinned_as_planned(before: SandboxPlan, sp: SandboxPlan) -> bool:
    """``sp``'s threads are ``before``'s but for their affinities, and each is where its
    plan puts it (or unmanaged): applying it writes nothing, to the host or the store."""
    was, now = before.obs.vmm, sp.obs.vmm
    if was is None or now is None or len(before.threads) != len(sp.threads):
        return False
    if (was.pid, was.start, was.classified, was.as_recorded, was.missing_vcpus) != (
        now.pid, now.start, now.classified, now.as_recorded, now.missing_vcpus
    ):  # (what the store records of a VMM: vmpin.reconcile.apply)
        return False
    for p, q in zip(before.threads, sp.threads, strict=True):
        if q.actual is None or (q.desired is not None and q.actual != q.desired):
            return False
        if p is not q and p._replace(actual=q.actual) != q:
            return False
    return True


class Settled:
    """Sandbox id -> the plan applied without an error by the last pass that applied it."""

    __slots__ = ("_asked", "_open", "_plans")

    def __init__(self) -> None:
        self._plans: dict[str, SandboxPlan] = {}
        #: the sandboxes of the plan last noted and the ids of those whose plan is not
        #: settled, when known: a plan made from that one (NodePlan.moved_from) is asked
        #: about the sandboxes it may have moved alone (at 500 sandboxes the walk over the
        #: others was ~0.4 M instructions of an event's pass)
        self._open: tuple[tuple[SandboxPlan, ...], set[str]] | None = None
        #: the last to_apply's plan's sandboxes and answer
        self._asked: tuple[tuple[SandboxPlan, ...], set[str]] | None = None

    def to_apply(self, plan: NodePlan, named: Collection[str]) -> set[str]:
        """The sandboxes of ``plan`` an event's pass applies: those ``named``, and those
        whose plan is not the very one applied cleanly before."""
        plans = self._plans
        out = set(named)
        sandboxes = plan.sandboxes
        walk: Iterable[SandboxPlan] = sandboxes
        base, known = plan.moved_from, self._open
        if base is not None and known is not None and base[0] is known[0]:
            walk = [sandboxes[i] for i in base[1]]
            # (every other plan is the very one noted last: as settled as it left it; one
            # gone from the plan is not asked about)
            out.update(known[1].difference([sp.id for sp in walk], base[2]))
            self._asked = (sandboxes, out)
        else:  # (each id once, as in a plan of plan_node's: else note cannot vouch for it)
            unique = len({sp.id for sp in sandboxes}) == len(sandboxes)
            self._asked = (sandboxes, out) if unique else None
        out.update(
            sp.id
            for sp in walk
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
        asked, self._asked, self._open = self._asked, None, None
        if only is None:
            sandboxes = plan.sandboxes
            self._plans = {sp.id: sp for sp in sandboxes if not sp.vanished and sp.id not in bad}
            left = {sp.id for sp in sandboxes if sp.vanished or sp.id in bad}
            if len(self._plans) + len(left) == len(sandboxes):  # (each id once)
                self._open = (sandboxes, left)
            return
        # (an event's pass: the others stand; a sandbox gone meanwhile stays here until the
        # next full pass, harmless: a sandbox of that id again has another plan)
        plans = self._plans
        left = set()
        for sp in applied.sandboxes:  # (those of ``only``)
            if sp.vanished or sp.id in bad:
                plans.pop(sp.id, None)
                left.add(sp.id)
            else:
                plans[sp.id] = sp
        if asked is not None and asked[0] is plan.sandboxes and asked[1] is only:
            # (what to_apply left out of ``only`` was settled, and stays so)
            self._open = (plan.sandboxes, left)

    def forget(self) -> None:
        self._plans = {}
        self._open = self._asked = None


__all__ = ["Settled"]
