"""Plan: a pure function from an :class:`~.observe.Observation` (+ topology) to a NodePlan.

It owns the node-wide rules (issue 9's invariants), on top of the per-sandbox placement of
:func:`vmpin.core.planner.plan_sandbox`:

1. a vCPU pinned alone on a CPU (1:1) shares it with no thread of another sandbox: every
   other sandbox's *footprint* is passed to the planner as ``others`` -- its mask, or, for a
   sandbox without a CPU set (tracked or merely in the VM dir), the CPUs it floats over: the
   shared pool when kubelet's is known, else every online CPU;
2. no thread of a sandbox is planned on a CPU kubelet's checkpoint assigns exclusively to a
   container of another pod (those CPUs go into ``others_exclusive``; undo goes to the pool);
3. every managed thread gets a desired affinity (apply repairs, audit reports the drift);
4. a sandbox that vmpin no longer pins (no CPU set left, or forgotten) gets its threads back
   to the shared pool when known, else to the affinity recorded before vmpin's first pin;
5. two pods claiming the same exclusive CPU is a :class:`Conflict` naming both claimants;
   it is never merged (both then float, as CPUs shared between sandboxes do).

Kata's own vCPU pinning (``enable_vcpus_pinning`` in a Kata configuration vmpin reads,
:mod:`vmpin.runtimes.kataconfig`) is never fought: where it applies to a Kata sandbox (as many
vCPUs as CPUs in its cpuset), a 1:1 plan takes Kata's layout (vmpin.core.planner); where vmpin
would not pin 1:1 (CPUs shared with others, a float policy, unknown vCPU indexes) and the
vCPUs are pinned one per CPU of the cpuset, as Kata pins them, they are left as they are
(``SandboxPlan.kata``); so are the vCPUs of an untracked Kata VMM pinned one per CPU.

:func:`check_node` (the successor of ``planner.check_global``) runs on every plan.

Desired CPU sets also come from sources that change behind vmpin's back (runc's state after
``runc update``; kubelet's checkpoint): a source is *adopted* when its value changed since
vmpin last saw it there (:func:`adopt`); the adoption is part of the plan, and apply records it.
"""

from __future__ import annotations

from vmpin.core.cpuset import EMPTY, CpuSet, checked
from vmpin.core.errors import VmpinError
from vmpin.core.planner import Plan, check_global, plan_sandbox
from vmpin.core.topology import Topology
from vmpin.reconcile.allocations import NONE, Overlay, overlay
from vmpin.reconcile.allocations import SOURCE as ALLOC
from vmpin.reconcile.observe import (
    FULL,
    ContainerObs,
    Observation,
    SandboxObs,
    Scope,
    ThreadObs,
    VmmObs,
    leaves_alone,
)
from vmpin.runtimes.kubelet import is_infra
from vmpin.state.records import ContainerRec

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Collection, Mapping
    from dataclasses import dataclass, field
    from typing import Any, NamedTuple
else:  # dataclasses imports inspect and re: a stand-in on the hook's path
    from vmpin.lean.records import NamedTuple, dataclass, field


class ThreadPlan(NamedTuple):
    """One thread's part of a sandbox's plan.  A NamedTuple, not a frozen dataclass: a pass
    makes one per thread of each VMM it plans (37 for a 32-vCPU VMM), and a frozen dataclass
    sets its eleven fields through ``object.__setattr__`` one by one (~14 k instructions a
    record, a tuple ~3.5 k; a field read costs ~0.15 k more: the event pass of a 37-thread
    VMM, bench/bench_event_pass.py, 5.45 -> 5.21 M)."""

    tid: int
    role: str
    #: its vCPU index (shadows tuple.index, which nothing asks of a ThreadPlan)
    index: int | None  # type: ignore[assignment]
    name: str | None
    layer: str
    desired: CpuSet | None
    actual: CpuSet | None
    #: plan (vmpin's placement) | undo (give back what vmpin took) | none (left alone)
    kind: str = "plan"
    container: str | None = None
    original: CpuSet | None = None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Adoption:
    """A container's CPU set as a source now says it (``cpus`` changed only when ``adopt``)."""

    container: str
    source: str  # runc | kubelet
    column: str  # runtime_seen | kubelet_seen
    seen: str
    cpus: CpuSet | None
    adopt: bool


@dataclass(frozen=True, slots=True)
class ContainerPlan:
    rec: ContainerRec  # with adopted values
    desired: CpuSet | None
    obs: ContainerObs


@dataclass(frozen=True, slots=True)
class Claim:
    """Who holds a CPU as its own: a pod's container (from vmpin's record or kubelet's)."""

    sandbox: str | None
    pod: str
    container: str | None
    source: str  # vmpin (a spec's or update's set) | kubelet | vmpin-alloc (an allocation)

    def to_json(self) -> dict[str, Any]:
        from vmpin.wire import views  # (here: the hooks, which load this module, print none)

        return views.claim(sandbox=self.sandbox, pod=self.pod, container=self.container,
                           source=self.source)  # type: ignore[arg-type]  # fmt: skip


@dataclass(frozen=True, slots=True)
class Conflict:
    cpus: CpuSet
    first: Claim
    second: Claim

    def sandboxes(self) -> set[str]:
        return {c.sandbox for c in (self.first, self.second) if c.sandbox}


@dataclass(frozen=True, slots=True)
class SandboxPlan:
    id: str
    runtime: str
    obs: SandboxObs
    mask: CpuSet = EMPTY
    mode: str = "none"
    reason: str = ""
    #: the CPUs this sandbox's threads may use (its footprint seen by others)
    footprint: CpuSet = EMPTY
    plan: Plan | None = None
    threads: tuple[ThreadPlan, ...] = ()
    containers: tuple[ContainerPlan, ...] = ()
    #: the store should forget it (VMM gone, or its last container gone)
    vanished: bool = False
    guest_map: dict[str, Any] | None = None
    notes: tuple[str, ...] = ()
    errors: tuple[str, ...] = ()
    #: Kata's own vCPU pinning applies to this sandbox (#vCPUs == |cpuset|): "follows" (the
    #: 1:1 plan is Kata's layout), "left" (vCPUs left where Kata pinned them), "expected"
    #: (Kata's pins are not in place: planned as usual); "" when Kata does not pin them
    kata: str = ""

    @property
    def pinned_cpus(self) -> dict[int, int]:
        """CPU -> tid of the vCPUs this plan pins 1:1."""
        if self.plan is None or not self.plan.vcpu_map:
            return {}  # (asked per sandbox by check_node and audit: most pin nothing 1:1)
        out = {}
        by_idx = {t.index: t.tid for t in self.threads if t.role == "vcpu"}
        for idx, cpu in self.plan.vcpu_map.items():
            if idx in by_idx:
                out[cpu] = by_idx[idx]
        return out


@dataclass(frozen=True, slots=True)
class NodePlan:
    sandboxes: tuple[SandboxPlan, ...]
    adoptions: tuple[Adoption, ...] = ()
    forget_containers: tuple[str, ...] = ()
    conflicts: tuple[Conflict, ...] = ()
    #: violations of the node-wide rules found in the plan itself (should stay empty)
    problems: tuple[str, ...] = ()
    #: kubelet's exclusive assignments: CPU -> claimant
    exclusive: Mapping[int, Claim] = field(default_factory=dict)
    shared_pool: CpuSet | None = None
    #: store keys of every original affinity vmpin had recorded when observing
    originals: tuple[str, ...] = ()
    #: what its observation covered: a view's plan (narrower than FULL) is never applied
    scope: Scope = FULL
    #: each sandbox's mask as the node's rules counted it (before the planner's own cuts)
    masks: Mapping[str, CpuSet] = field(default_factory=dict)
    #: made as the last call's plan with some sandboxes planned again (plan_node's memo, an
    #: event's pass): that plan's ``sandboxes``, the indexes of those here that may differ,
    #: and the ids of its sandboxes gone from here -- every other sandbox plan, and its
    #: mask, is the very object there (at the same index when none came or went).  Who keeps
    #: something per sandbox plan of the last plan it saw looks at those alone (issue 28).
    #: (Not compared: a plan equals the one made from nothing for the same node.)
    moved_from: tuple[tuple[SandboxPlan, ...], tuple[int, ...], tuple[str, ...]] | None = field(
        default=None, compare=False
    )

    def sandbox(self, sandbox_id: str) -> SandboxPlan | None:
        return next((s for s in self.sandboxes if s.id == sandbox_id), None)

    @property
    def undo(self) -> list[tuple[str, ThreadPlan]]:
        return [(s.id, t) for s in self.sandboxes for t in s.threads if t.kind == "undo"]


# -- desired CPU sets ----------------------------------------------------------------------------
def adopt(rec: ContainerRec, source: str, column: str, seen: str, want: CpuSet | None) -> Adoption:
    """Adopt a source's value when it changed since vmpin last looked there.

    Before the first look, what the source "last said" is taken to be the spec the container
    was created with -- unless vmpin has been told otherwise since (an update), in which case
    a source still holding an older value is not news.
    """
    stored: str | None = rec._asdict()[column]
    last = stored
    if last is None:
        if rec.cpus_source == "spec":
            last = "" if rec.cpus is None else rec.cpus.to_list()
        else:
            last = seen
    return Adoption(rec.id, source, column, seen, want, seen != last)


def _with(rec: ContainerRec, a: Adoption) -> ContainerRec:
    if a.column == "runtime_seen":
        rec = rec._replace(runtime_seen=a.seen)
    else:
        rec = rec._replace(kubelet_seen=a.seen)
    return rec._replace(cpus=a.cpus, cpus_source=a.source) if a.adopt else rec


def refresh(c: ContainerObs, runtime: str) -> tuple[ContainerRec | None, list[Adoption]]:
    """The container's record with the sources' news adopted; None when it is gone."""
    rec = c.rec
    out: list[Adoption] = []
    if runtime == "runc":
        if c.alive is False and c.runc_cpus is None:
            return None, out
        if c.runc_cpus and c.error is None:
            # ("" = runc's state holds no cpuset: runc says nothing, there is nothing to adopt)
            want = CpuSet.parse(c.runc_cpus)
            a = adopt(rec, "runc", "runtime_seen", c.runc_cpus, want)
            if a.adopt or rec.runtime_seen != a.seen:
                out.append(a)
            rec = _with(rec, a)
    if c.kubelet_cpus is not None:
        a = adopt(rec, "kubelet", "kubelet_seen", c.kubelet_cpus.to_list(), c.kubelet_cpus)
        if a.adopt or rec.kubelet_seen != a.seen:
            out.append(a)
        rec = _with(rec, a)
    return rec, out


def _own_cpus(rec: ContainerRec) -> CpuSet | None:
    """The container's CPU set as the node plan counts it.

    An infra (pause) container gets no CPUs from kubelet (:func:`is_infra`): a value adopted
    from the checkpoint's shared pool by an older vmpin is not its own, so it follows the pool
    like any container without a set.  A set its runtime gave it (CRI-O's
    ``infra_ctr_cpuset``) stays: that is where its cgroup is.
    """
    if rec.cpus_source == "kubelet" and is_infra(rec.is_sandbox, rec.pod_uid, rec.name):
        return None
    return rec.cpus


def _left_alone(s: SandboxObs, online: CpuSet) -> CpuSet:
    """Where the threads of ``s`` that vmpin does not place run now: they hold those CPUs.

    vmpin leaves a thread alone under the vCPU policy ``none`` (its vCPUs), the helper policy
    ``none`` (the others), and in a VMM it does not track (another pinner's VM): wherever such
    a thread runs, no other sandbox's vCPU may be pinned 1:1, or the two share a CPU for good
    and no pass can clear it.  A thread whose affinity is unknown (it could not be read)
    holds every online CPU.  Observe reads these threads' affinity in every scope
    (:func:`vmpin.reconcile.observation.leaves_alone`), so views plan alike.
    """
    if s.vmm is None or not leaves_alone(s.tracked, s.policy):
        return EMPTY
    out: list[CpuSet] = []
    for t in s.vmm.threads:
        if not s.tracked or (s.policy.vcpus if t.role == "vcpu" else s.policy.helpers) == "none":
            out.append(t.actual if t.actual is not None else online)
    return CpuSet.union_all(out)


def _mask(recs: list[ContainerRec]) -> CpuSet:
    """A sandbox's mask: the union of its app and init containers' CPU sets.

    The infra container never widens it: kubelet assigns it nothing, and what its runtime put
    in its spec (CRI-O's ``infra_ctr_cpuset``: the node's reserved CPUs) is housekeeping, not
    the pod's.  Counting it made a Guaranteed Kata pod's mask its exclusive CPUs plus the whole
    shared pool, and its vCPUs floated there.
    """
    return CpuSet.union_all(
        r.cpus for r in recs
        if r.cpus is not None and not is_infra(r.is_sandbox, r.pod_uid, r.name)
    )  # fmt: skip


# -- the node ------------------------------------------------------------------------------------
def _pod(s: SandboxObs) -> str:
    if s.record is not None and s.record.pod_uid:
        return s.record.pod_uid
    for c in s.containers:
        if c.rec.pod_uid:
            return c.rec.pod_uid
    return f"sandbox:{s.id}"


class _Records:
    """What one sandbox's records come to in a plan (:func:`_records`), and its footprint
    (:func:`_footprint`) with what that was made from: kept between calls in ``memo``."""

    __slots__ = (
        "adoptions", "alloc", "cplans", "footprint", "forget", "obs", "pod", "recs", "taken",
    )  # fmt: skip

    def __init__(
        self,
        obs: SandboxObs,
        alloc: CpuSet | None,
        taken: tuple[object, ...],
        recs: list[ContainerRec],
        cplans: list[ContainerPlan],
        adoptions: list[Adoption],
        forget: list[str],
    ) -> None:
        self.obs, self.alloc, self.taken = obs, alloc, taken
        self.recs, self.cplans, self.adoptions, self.forget = recs, cplans, adoptions, forget
        #: the pod it belongs to (:func:`_pod`)
        self.pod = _pod(obs)
        #: (this, the CPUs kept off, the node's inputs, mask, Kata's cpuset, kept off, fp)
        self.footprint: tuple[Any, ...] | None = None


class _Kept:
    """A sandbox's plan in ``memo`` with what it was planned from."""

    __slots__ = ("inputs", "plan", "records")

    def __init__(self, inputs: tuple[object, ...], plan: SandboxPlan, records: _Records) -> None:
        self.inputs, self.plan, self.records = inputs, plan, records


def _moved_alone(before: SandboxObs, s: SandboxObs) -> tuple[ThreadObs, ...] | None:
    """Whether ``s`` is ``before`` with its record's bookkeeping (generation, done
    generation, time: the last pass marked it done) and its VMM threads' actual affinities
    (what the last pass pinned them to) moved alone: its threads then, or None.  Planned
    from the same inputs, its plan is the same but for those affinities, which its threads'
    plans carry (issue 28: the sandbox of the last event's pass was planned again from
    scratch at the next, for the sandbox of another event)."""
    was, rec = before.record, s.record
    if was is None or rec is None:
        return None
    if was is not rec and (
        was._replace(gen=rec.gen, done_gen=rec.done_gen, updated_at=rec.updated_at) != rec
    ):
        return None
    # (field by field, the same objects mostly: building ``before`` with ``rec`` to compare
    # it whole was ~6 % of an event's pass at 60 sandboxes, for the last pass's sandbox)
    for name in _BESIDE:
        was_it, it = getattr(before, name), getattr(s, name)
        if was_it is not it and was_it != it:
            return None
    vmm, now = before.vmm, s.vmm
    if vmm is None or now is None:
        return None if vmm is not now else ()
    if vmm is now:
        return now.threads
    for field in _VMM_BESIDE:
        was_it, it = getattr(vmm, field), getattr(now, field)
        if was_it is not it and was_it != it:
            return None
    if len(vmm.threads) != len(now.threads):
        return None
    for t, u in zip(vmm.threads, now.threads, strict=True):
        if t is not u and (t.tid, t.role, t.index, t.label, t.layer, t.name, t.original,
                           t.error) != (u.tid, u.role, u.index, u.label, u.layer, u.name,
                                        u.original, u.error):  # fmt: skip
            return None
    return now.threads


#: what a sandbox's observation holds beside its record and VMM, and a VMM's beside its
#: threads (:func:`_moved_alone`)
_BESIDE = tuple(name for name in SandboxObs.__match_args__ if name not in ("record", "vmm"))
_VMM_BESIDE = tuple(name for name in VmmObs.__match_args__ if name != "threads")


def _records(
    s: SandboxObs,
    alloc: Overlay,
    pool: CpuSet | None,
    mine: CpuSet | None,
    taken: tuple[object, ...],
) -> _Records:
    """Each container's record with its sources' news adopted and its pod's allocation, and
    what it is to run on; the containers that are gone."""
    recs: list[ContainerRec] = []
    cps: list[ContainerPlan] = []
    adoptions: list[Adoption] = []
    forget: list[str] = []
    for c in s.containers:
        rec, adopted = refresh(c, s.runtime)
        adoptions.extend(adopted)
        if rec is None:
            forget.append(c.rec.id)
            continue
        rec = alloc.container(s.id, rec)
        recs.append(rec)
        cpus = _own_cpus(rec)
        desired = cpus if cpus is not None else pool
        cps.append(ContainerPlan(rec, desired if s.runtime == "runc" else cpus, c))
    return _Records(s, mine, taken, recs, cps, adoptions, forget)


def _footprint(
    s: SandboxObs, first: _Records, off: CpuSet, pool: CpuSet | None, online: CpuSet
) -> tuple[CpuSet, CpuSet, CpuSet | None, CpuSet]:
    """A sandbox's mask, its mask before ``off`` (the CPUs kept free for Crane's exclusive
    pods) was taken out, what was taken out (None: nothing), and its footprint: where its
    threads may run once the plan is applied."""
    mask = whole = _mask(first.recs)
    kept = None
    if s.runtime != "runc" and mask & off and mask - off:
        kept = mask & off
        mask = mask - off
    if s.runtime == "runc":
        cplans = first.cplans
        runs = any(c.obs.tasks for c in cplans)
        fp = CpuSet.union_all(
            (c.desired if c.desired is not None else online) for c in cplans if c.obs.tasks
        )
        return mask, whole, kept, fp if runs else EMPTY
    if s.vmm is None:
        return mask, whole, kept, EMPTY  # nothing runs
    if not s.tracked and s.vmm.threads:
        return mask, whole, kept, _left_alone(s, online)  # not vmpin's: where its threads run
    fp = mask or pool or online
    fp = (fp - off) or fp
    held = _left_alone(s, online)
    return mask, whole, kept, fp | held if held else fp


def plan_node(
    obs: Observation,
    topology: Topology,
    *,
    float_policy: str = "all",
    memo: dict[str, _Kept] | None = None,
) -> NodePlan:
    """Plan every sandbox and runc container of the node from one observation.

    ``memo`` (a long-lived caller's, kept between calls): each sandbox's plan with what it
    was planned from; a sandbox given as the very observation it was planned from, under the
    same node-wide inputs (its mask, footprint, the others' footprints and exclusive CPUs,
    the pool...), gets that plan back -- ``_plan_sandbox`` is a function of those alone.  An
    event's pass (Observer.observe's ``fresh``) gives most sandboxes as they were: it plans
    the ones that moved (issue 28).  Refilled with this node's sandboxes only.

    A :class:`PlanMemo` also keeps the last call's node: on a node where nothing is
    node-wide (no kubelet pool, allocations, Crane pods or adoptions) the sandboxes that
    are not the very objects of that call are all the walk takes (:func:`_plan_moved`)."""
    if isinstance(memo, PlanMemo):
        # (taken out first: a call that fails on the way leaves none behind)
        then, memo.last = memo.last, None
        if then is not None:
            moved = _plan_moved(obs, topology, float_policy, memo, then)
            if moved is not None:
                return moved
    out = _walk(obs, topology, float_policy, memo)
    assert out is not None  # (only a walk restricted to some sandboxes gives up)
    return out


def _plan_moved(
    obs: Observation,
    topology: Topology,
    float_policy: str,
    memo: PlanMemo,
    was: tuple[Observation, NodePlan, bool],
) -> NodePlan | None:
    """:func:`plan_node` of ``obs`` as the last call's plan (``was``) with the sandboxes
    that are not the very objects they were there planned again: the same sandboxes, some
    of them moved, come or gone, on a node where nothing is node-wide (:func:`_walk` checks
    the rest).  None when that does not hold, or when all or too many moved (a start-up or
    periodic pass): the walk over every sandbox then (issue 28: an event's pass walked the
    node several times to plan one sandbox; a pass for a sandbox come or gone, most of
    churn's, walked it once)."""
    then, plan_then, pins = was
    sandboxes, before = obs.sandboxes, then.sandboxes
    if (
        memo.node is None
        or obs.scope is not then.scope
        or obs.shared_pool is not None
        or obs.kata_pinning != then.kata_pinning
    ):
        return None
    gone: list[str] = []
    base: list[SandboxPlan | None] | None = None
    if len(sandboxes) == len(before):
        pairs = enumerate(zip(sandboxes, before, strict=True))
        moved = [i for i, (s, t) in pairs if s is not t]
        if all(sandboxes[i].id == before[i].id for i in moved):
            base = list(plan_then.sandboxes)
    if base is None:
        # (a sandbox come or gone: the others found by id, each id once on either side)
        at = {t.id: i for i, t in enumerate(before)}
        ids = {s.id for s in sandboxes}
        if len(at) != len(before) or len(ids) != len(sandboxes):
            return None
        then_plans = plan_then.sandboxes
        moved, base = [], []
        for i, s in enumerate(sandboxes):
            j = at.get(s.id)
            if j is None or before[j] is not s:
                moved.append(i)
                base.append(None)  # (planned below)
            else:
                base.append(then_plans[j])
        gone = [t.id for t in before if t.id not in ids]
        # (a CPU a sandbox come or gone holds, held by one other or none: its count crosses
        # one, the others' inputs move and the walk over those moved alone gives up -- on a
        # node of two sandboxes, always: the full walk at once; a gone one's footprint, as
        # counted, says so here)
        counted = memo.node.footprints
        if len(before) < 2 or any(
            counted._count[cpu] < 3 for sid in gone for cpu in counted._sets[sid]
        ):
            return None
    if len(moved) + len(gone) > len(sandboxes) // 4 + 1 or len(moved) == len(sandboxes):
        return None
    return _walk(obs, topology, float_policy, memo, (moved, plan_then, pins, base, gone))


def _walk(
    obs: Observation,
    topology: Topology,
    float_policy: str,
    memo: dict[str, _Kept] | None,
    moved: tuple[list[int], NodePlan, bool, list[SandboxPlan | None], list[str]] | None = None,
) -> NodePlan | None:
    """:func:`plan_node`'s walk over the node's sandboxes -- or (``moved``: their indexes,
    the last call's plan, whether a plan there pins a vCPU 1:1, the plans there of the
    sandboxes here (None: moved), the ids of those gone) over those alone, every other plan
    standing as it is in the last call's: None when that does not hold, the full walk then.
    It holds when nothing is node-wide (no allocation, no Crane pod, no adoption nor
    container to forget: :func:`_plan_moved` checks the pool) and no CPU came to, or left,
    one footprint or one mask, a sandbox's come or gone included: no other sandbox's inputs
    moved (the full walk's ``steady`` rule would keep each of their plans)."""
    sandboxes = obs.sandboxes
    walk = sandboxes if moved is None else [sandboxes[i] for i in moved[0]]
    online = topology.online
    # vmpin's own allocations (issue 30; none under kubelet's static policy) shrink the pool
    alloc = overlay(obs, topology)
    if moved is not None and alloc is not NONE:
        return None
    pool = obs.shared_pool if alloc.pool is None else alloc.pool
    adoptions: list[Adoption] = []
    forget: list[str] = []
    live: dict[str, list[ContainerRec]] = {}
    last = memo if memo is not None else {}
    # (what a sandbox's records come to depends on it and the allocations alone: a sandbox
    # given as the very observation of the last call, under the same allocations, comes to
    # what it came to then -- most of an event's pass, issue 28)
    taken = (alloc.taken, alloc.pool, pool)
    firsts: dict[str, _Records] = {}
    for s in walk:
        before = last.get(s.id)
        mine = alloc.by_sandbox.get(s.id)
        got = before.records if before is not None else None
        if got is None or got.obs is not s or got.alloc != mine or got.taken != taken:
            got = _records(s, alloc, pool, mine, taken)
        firsts[s.id] = got
        if got.adoptions:
            adoptions.extend(got.adoptions)
        if got.forget:
            forget.extend(got.forget)
        live[s.id] = got.recs

    pods = {s.id: firsts[s.id].pod for s in walk}
    # Crane's cpu-manager "exclusive" (vmpin.core.podpolicy): other sandboxes' threads are
    # kept off the pod's CPUs while they have CPUs of their own left (runc containers are not
    # moved: their cpuset is kubelet's to decide).
    crane = {
        s.id: _mask(live[s.id]) for s in walk
        if s.policy.cpuset == "exclusive" and s.runtime != "runc"
    }  # fmt: skip
    if moved is not None and (adoptions or forget or crane):
        return None  # (node-wide: the full walk)
    crane_others = _Others(crane) if crane else None
    # Footprints: where each sandbox's threads may run once this plan is applied.
    prior_sets = memo.node if moved is not None and isinstance(memo, PlanMemo) else None
    masks = {} if prior_sets is None else dict(prior_sets.masks._sets)
    footprint = {} if prior_sets is None else dict(prior_sets.footprints._sets)
    gone = () if moved is None else moved[4]
    for sid in gone:
        del masks[sid], footprint[sid]
    kept_off: dict[str, CpuSet] = {}
    # Kata's cpuset, over which it pins vCPUs itself when a configuration says so: the union
    # of the containers' CPU sets, as vmpin's mask before anything is kept off it
    kata_pins: dict[str, CpuSet] = {}
    kata_pinning = obs.kata_pinning
    node = (kata_pinning, pool, online)
    for s in walk:
        first = firsts[s.id]
        off = crane_others.without(s.id) if crane_others is not None else EMPTY
        kept_was = last.get(s.id)
        fp_memo = kept_was.records.footprint if kept_was is not None else None
        if (
            fp_memo is None
            or fp_memo[0] is not first
            or (fp_memo[1] is not off and fp_memo[1] != off)
            or fp_memo[2] != node
        ):
            fp_memo = (first, off, node, *_footprint(s, first, off, pool, online))
        _, _, _, mask, pinned_by_kata, off_mask, fp = fp_memo
        first.footprint = fp_memo
        if kata_pinning and s.runtime == "kata":
            kata_pins[s.id] = pinned_by_kata
        if off_mask is not None:
            kept_off[s.id] = off_mask
        masks[s.id] = mask
        footprint[s.id] = fp

    exclusive, conflicts = _claims(obs, live, pods, pool)
    for cpu, sid in alloc.owner.items():  # a CPU vmpin allocated is its pod's alone
        exclusive.setdefault(cpu, Claim(sid, pods.get(sid, f"sandbox:{sid}"), None, ALLOC))
    conflicted = {sid for c in conflicts for sid in c.sandboxes()}
    # Every "all the others" set below is derived from per-CPU counts made once, so the
    # node is planned in time linear in its sandboxes (a union over the others per sandbox
    # was quadratic: 2,000 sandboxes took seconds); a long-lived caller's counts are kept
    # and moved by the sandboxes whose footprint or mask moved (PlanMemo).
    prior = None
    if isinstance(memo, PlanMemo):
        # (its counts are moved below: a call that fails on the way leaves none behind)
        prior, memo.node = memo.node, None
    only = None if moved is None else firsts
    others_fp, fp_moved = _counted(
        footprint, prior.footprints if prior is not None else None, only, gone
    )  # fmt: skip
    by_mask, _ = _counted(masks, prior.masks if prior is not None else None, only, gone)
    alone = by_mask.alone - (pool or EMPTY)  # CPUs in exactly one sandbox's mask
    # The node as the last call saw it, but for the CPUs ``fp_moved`` (an event's pass): a
    # sandbox whose observation, mask, footprint and Kata cpuset are the very ones it was
    # planned with, and whose footprint holds none of those CPUs, has the inputs it was
    # planned with (its others' footprints and exclusive CPUs): its plan stands unasked.
    node_key = (
        topology, float_policy, obs.scope, pool, alloc.reserved, alloc.uncore,
        bool(conflicts), bool(exclusive),
    )  # fmt: skip
    steady = (
        prior is not None and fp_moved is not None and not conflicts and not exclusive
        and prior.key == node_key and prior.total == others_fp.total and prior.alone == alone
    )  # fmt: skip
    if moved is not None and (not steady or fp_moved):
        return None  # (the others' inputs moved: the full walk asks each; counts spent)
    moved_cpus = checked(fp_moved) if fp_moved else EMPTY
    excl_all = checked(exclusive) if exclusive else EMPTY
    excl_own: dict[str, set[int]] = {}
    for cpu, cl in exclusive.items():
        excl_own.setdefault(cl.pod, set()).add(cpu)
    foreign_by_pod: dict[str, CpuSet] = {}
    kept: dict[str, _Kept] = {}
    walked: list[SandboxPlan] = []
    pins = moved is not None and moved[2]
    for s in walk:
        before = last.get(s.id)
        first = firsts[s.id]
        if (
            steady
            and before is not None
            and before.plan.obs is s
            and before.inputs[3] is masks[s.id]
            and before.inputs[4] is footprint[s.id]
            and before.inputs[9] is kata_pins.get(s.id)
            and (not fp_moved or footprint[s.id].isdisjoint(moved_cpus))
        ):
            sp = before.plan
            kept[s.id] = before if before.records is first else _Kept(before.inputs, sp, first)
        else:
            others = others_fp.without(s.id)
            own = masks[s.id]
            others_excl = alone - own if alone & own else alone
            pod = pods[s.id]
            foreign_excl = foreign_by_pod.get(pod) if excl_all else EMPTY
            if foreign_excl is None:
                foreign_excl = foreign_by_pod[pod] = excl_all - checked(excl_own.get(pod, ()))
            excl = (others_excl | foreign_excl) if foreign_excl else others_excl
            inputs = (
                topology, float_policy, obs.scope, own, footprint[s.id], others, excl, pool,
                s.id in conflicted, kata_pins.get(s.id), alloc.reserved, alloc.uncore,
            )  # fmt: skip
            sp = _planned(s, before, first, inputs, conflicted)
            kept[s.id] = _Kept(inputs, sp, first)
        walked.append(sp)
        pins = pins or _pins(sp)
    if memo is not None:
        if moved is None:
            memo.clear()
        for sid in gone:
            del memo[sid]
        memo.update(kept)
        if isinstance(memo, PlanMemo):
            memo.node = _NodeMemo(node_key, others_fp, by_mask, alone)
    if moved is None:
        plans = walked
    else:
        base = moved[3]
        for i, sp in zip(moved[0], walked, strict=True):
            base[i] = sp
        plans = base  # type: ignore[assignment]  # (each None replaced)
    if kept_off:
        plans = [
            _replace(
                p,
                notes=(
                    *p.notes,
                    f"CPUs {kept_off[p.id]} kept free for a pod with"
                    " qos.gocrane.io/cpu-manager: exclusive",
                ),
            )
            if p.id in kept_off
            else p
            for p in plans
        ]
    if alloc.notes:
        plans = [  # what vmpin allocated to each pod, or why it waits (issue 30)
            _replace(p, notes=(*p.notes, note)) if (note := alloc.notes.get(p.id)) else p
            for p in plans
        ]
    # (check_node's rules are about vCPUs pinned 1:1 and exclusive CPUs: without either,
    # it has nothing to find)
    problems = check_node(plans, exclusive, pods) if pins or exclusive else []
    out = NodePlan(
        tuple(plans),
        tuple(adoptions),
        tuple(forget),
        tuple(conflicts),
        tuple(problems),
        exclusive,
        pool,
        tuple(obs.originals),
        obs.scope,
        masks,
        None if moved is None else (moved[1].sandboxes, tuple(moved[0]), tuple(gone)),
    )
    simple = alloc is NONE and pool is None and not crane and not adoptions and not forget
    if isinstance(memo, PlanMemo) and simple:
        memo.last = (obs, out, pins)
    return out


def _planned(
    s: SandboxObs,
    before: _Kept | None,
    first: _Records,
    inputs: tuple[Any, ...],
    conflicted: set[str],
) -> SandboxPlan:
    """The plan of ``s`` from ``inputs`` (plan_node's, in its order): the one kept in the
    memo when it was made from the same."""
    if before is not None and before.plan.obs is s and before.inputs == inputs:
        return before.plan
    topology, float_policy, scope, mask, fp, others, excl, pool, _, kata, reserved, uncore = inputs
    if before is not None and before.inputs == inputs:
        was = before.plan
        threads = _moved_alone(was.obs, s)
        if threads is not None and (was.obs.vmm is s.vmm or threads == ()):
            return _replace(was, obs=s)  # (its threads, containers and map: the same)
        if (
            threads
            and kata is None  # (Kata's own pinning is judged by the affinities: _kata)
            and s.runtime == "kata"
            and len(was.threads) == len(threads)
            and all(p.tid == t.tid for p, t in zip(was.threads, threads, strict=True))
        ):
            # a VM's threads are planned in their order, each plan carrying the thread's
            # affinity as observed: the rest is the plan of the same inputs
            return _replace(was, obs=s, threads=tuple(
                p._replace(actual=t.actual) for p, t in zip(was.threads, threads, strict=True)
            ))  # fmt: skip
    return _plan_sandbox(
        s, topology, mask, first.recs, first.cplans, fp, others, excl, pool, float_policy,
        conflicted, scope, kata, reserved, uncore,
    )  # fmt: skip


def _pins(sp: SandboxPlan) -> bool:
    """Whether ``sp`` pins a vCPU 1:1 (what check_node's rules are about, with exclusive
    CPUs)."""
    return sp.plan is not None and bool(sp.plan.vcpu_map)


class _Others:
    """For named CPU sets, the union of all but one, in time linear in the sets' sizes.

    A CPU is in the union of the others exactly when some set other than the named one holds
    it: the total minus the named set's CPUs that no other set holds.
    """

    __slots__ = ("_count", "_sets", "total")

    def __init__(self, sets: Mapping[str, CpuSet], counts: dict[int, int] | None = None) -> None:
        """``counts``: how many of ``sets`` hold each CPU, when the caller knows (_counted)."""
        self._sets = sets
        if counts is None:
            counts = {}
            for cpus in sets.values():
                for cpu in cpus:
                    counts[cpu] = counts.get(cpu, 0) + 1
        self._count = counts
        self.total = checked(counts)

    @property
    def alone(self) -> CpuSet:
        """The CPUs exactly one set holds."""
        return checked([cpu for cpu, n in self._count.items() if n == 1])

    def without(self, name: str) -> CpuSet:
        own = self._sets.get(name)
        if not own:
            return self.total
        only_own = [cpu for cpu in own if self._count[cpu] == 1]
        return self.total - checked(only_own) if only_own else self.total


def _counted(
    sets: dict[str, CpuSet],
    before: _Others | None,
    only: Collection[str] | None = None,
    gone: Collection[str] = (),
) -> tuple[_Others, set[int] | None]:
    """:class:`_Others` of ``sets``, from ``before``'s counts moved by the sets that are not
    the very objects they were (``before`` is spent); and the CPUs where "some set holds it"
    or "exactly one set holds it" may have changed -- all that :meth:`_Others.without` and
    :attr:`_Others.alone` depend on (None: counted anew).  ``only``: the names whose sets
    may have moved, the others' and the names being ``before``'s but for those ``gone``
    (_plan_moved)."""
    if before is None:
        return _Others(sets), None
    old, counts = before._sets, before._count
    was: dict[int, int] = {}  # (each touched CPU's count before)

    def move(cpus: CpuSet, by: int) -> None:
        for cpu in cpus:
            n = counts.get(cpu, 0)
            was.setdefault(cpu, n)
            counts[cpu] = n + by

    for sid in sets if only is None else only:
        cpus, then = sets[sid], old.get(sid)
        if then is not cpus:
            if then is not None:
                move(then, -1)
            move(cpus, 1)
    if only is None and len(old) + sum(1 for sid in sets if sid not in old) != len(sets):
        gone = old.keys() - sets.keys()
    for sid in gone:  # (gone from the node)
        move(old[sid], -1)
    moved = set()
    for cpu, n in was.items():
        now = counts[cpu]
        if now == 0:
            del counts[cpu]
        if (n == 1) != (now == 1) or (n == 0) != (now == 0):
            moved.add(cpu)
    return _Others(sets, counts), moved


class _NodeMemo:
    """What a plan's node-wide inputs were (:class:`PlanMemo`)."""

    __slots__ = ("alone", "footprints", "key", "masks", "total")

    def __init__(self, key: tuple[object, ...], footprints: _Others, masks: _Others, alone: CpuSet):
        self.key, self.footprints, self.masks, self.alone = key, footprints, masks, alone
        self.total = footprints.total


class PlanMemo(dict[str, _Kept]):
    """A long-lived caller's memo for :func:`plan_node`: each sandbox's plan with what it was
    planned from, and (``node``) the node-wide counts of the last call, which the next one
    moves by what moved instead of counting the node again (issue 28)."""

    __slots__ = ("last", "node")

    def __init__(self) -> None:
        super().__init__()
        self.node: _NodeMemo | None = None
        #: the last call's observation and plan, when its node had nothing node-wide
        #: (:func:`_plan_moved` moves it by the sandboxes that moved), and whether a plan
        #: may pin a vCPU 1:1
        self.last: tuple[Observation, NodePlan, bool] | None = None


def _claims(
    obs: Observation,
    live: Mapping[str, list[ContainerRec]],
    pods: Mapping[str, str],
    pool: CpuSet | None,
) -> tuple[dict[int, Claim], list[Conflict]]:
    """kubelet's exclusive CPUs, and every pair of pods claiming one CPU as their own.

    An exclusive claim needs kubelet's shared pool to tell "own" from "shared": a container's
    CPUs outside the pool are its own; kubelet's entries are exclusive by definition.  Without
    a static-policy checkpoint nothing is exclusive (overlapping masks then merely float).
    """
    exclusive: dict[int, Claim] = {}
    if pool is None or obs.checkpoint is None:
        return exclusive, []
    claims: dict[int, list[Claim]] = {}
    sandbox_of_pod = {pod: sid for sid, pod in pods.items()}
    for pod, names in obs.checkpoint.entries.items():
        for name, cpus in names.items():
            claim = Claim(sandbox_of_pod.get(pod), pod, name, "kubelet")
            for cpu in cpus:
                exclusive.setdefault(cpu, claim)
                claims.setdefault(cpu, []).append(claim)
    if obs.checkpoint.by_container_id:  # a v1 checkpoint: entries keyed by container id
        where = {r.id: (sid, r) for sid, recs in live.items() for r in recs}
        for cid, cpus in obs.checkpoint.by_container_id.items():
            sid, rec = where.get(cid, (None, None))
            pod = pods[sid] if sid is not None else f"container:{cid}"
            claim = Claim(sid, pod, (rec.name or cid) if rec is not None else cid, "kubelet")
            for cpu in cpus:
                exclusive.setdefault(cpu, claim)
                claims.setdefault(cpu, []).append(claim)
    for sid, recs in live.items():
        for r in recs:
            if r.cpus is None or is_infra(r.is_sandbox, r.pod_uid, r.name):
                continue
            claim = Claim(sid, pods[sid], r.name or r.id, "vmpin")
            for cpu in r.cpus - pool:
                claims.setdefault(cpu, []).append(claim)
    by_pair: dict[tuple[Claim, Claim], set[int]] = {}
    for cpu, cl in sorted(claims.items()):
        first = cl[0]
        for other in cl[1:]:
            if other.pod != first.pod:
                by_pair.setdefault((first, other), set()).add(cpu)
    conflicts = [Conflict(CpuSet(cpus), a, b) for (a, b), cpus in by_pair.items()]
    return exclusive, conflicts


def _plan_sandbox(
    s: SandboxObs,
    topology: Topology,
    mask: CpuSet,
    recs: list[ContainerRec],
    cplans: list[ContainerPlan],
    footprint: CpuSet,
    others: CpuSet,
    others_exclusive: CpuSet,
    pool: CpuSet | None,
    float_policy: str,
    conflicted: set[str],
    scope: Scope = FULL,
    kata_pins: CpuSet | None = None,
    reserved: CpuSet = EMPTY,
    uncore: bool = False,
) -> SandboxPlan:
    """One sandbox's plan.  ``reserved``, ``uncore``: what the node follows of kubelet's
    strict-cpu-reservation (helper threads under ``isolate`` go to its reserved CPUs) and
    prefer-align-cpus-by-uncorecache (vmpin.reconcile.allocations.Overlay)."""
    if s.tracked and s.containers and not recs:
        return _replace(_base(s, mask, footprint, cplans), vanished=True,
                        reason="every container is gone")  # fmt: skip
    if s.vmm_gone:
        return _replace(_base(s, mask, footprint, cplans), vanished=True,
                        reason="the VMM is gone")  # fmt: skip
    if s.runtime == "runc":
        threads = tuple(
            _thread(t, c.desired, "plan" if c.desired is not None else "none", c.rec.id)
            for c in cplans
            for t in c.obs.tasks
        )
        return _replace(_base(s, mask, footprint, cplans), mode="cgroup", threads=threads)
    if s.vmm is None or not scope.reads_threads(s.id):
        # nothing runs, or a view that did not read this VMM's threads
        return _base(s, mask, footprint, cplans)
    vthreads = s.vmm.threads
    if not s.tracked:
        # Present in the VM dir, not vmpin's: it floats; give back whatever vmpin pinned.  Its
        # cpuset is unknown here; vCPUs pinned one per CPU while Kata's pinning is on are
        # Kata's doing, and are left so.
        left = kata_pins is not None and _one_per_cpu(vthreads)
        return _replace(
            _base(s, mask, footprint, cplans),
            mode="none",
            reason="not tracked by vmpin: floats over the shared pool when known, else left alone"
            " (pins vmpin made are undone)",
            threads=tuple(
                _thread(t, None, "none")
                if left and t.role == "vcpu"
                else _thread(t, pool, "undo" if t.original else "plan")
                if pool
                else _undo_or_none(t, None)
                for t in vthreads
            ),
            kata="left" if left else "",
            notes=(*s.notes, KATA_LEFT_UNTRACKED) if left else s.notes,
        )
    policy = s.policy
    if reserved and policy.helpers == "isolate":
        policy = policy._replace(housekeeping=reserved)
    try:
        plan = plan_sandbox(
            topology,
            s.id,
            mask,
            vthreads,
            policy,
            others=others,
            others_exclusive=others_exclusive,
            shared_pool=pool,
            runtime_pins=kata_pins,
            # an incomplete classification plans the same whichever vCPUs it saw (planner)
            missing_vcpus=s.vmm.missing_vcpus,
            unidentified=[t.tid for t in vthreads if t.layer == "none"]
            if s.vmm.missing_vcpus
            else (),
            uncore=uncore,
        )
    except VmpinError as err:
        return _replace(_base(s, mask, footprint, cplans), errors=(*s.errors, str(err)))
    except Exception as err:  # a planner bug on one sandbox is an error on it, not the node's
        why = f"planning: unexpected {err!r}"
        return _replace(_base(s, mask, footprint, cplans), errors=(*s.errors, why))
    kata, kata_note = _kata(plan, vthreads, kata_pins)
    vplans: list[ThreadPlan] = []
    for t, p in zip(vthreads, plan.placements, strict=True):  # (placements: in threads' order)
        if kata == "left" and t.role == "vcpu":
            vplans.append(_thread(t, None, "none"))  # Kata's pin: neither moved nor undone
        elif p.desired is None:
            vplans.append(_undo_or_none(t, pool))
        else:
            vplans.append(_thread(t, p.desired, "plan"))
    notes = list(s.notes) + list(plan.notes) + ([kata_note] if kata_note else [])
    if s.id in conflicted:
        notes.append("claims an exclusive CPU another pod claims too: see the conflicts")
    guest_map: dict[str, Any] | None = None
    if s.policy.guest == "off":  # vmpin.io/guest-pinning: off -- nothing for the guest
        notes.append("guest pinning off: no guest map published")
    elif scope.guest_maps:
        from vmpin.core.guestmap import map_sandbox

        ctrs = {r.id: r.cpus for r in recs if not r.is_sandbox or r.cpus is not None}
        guest_map = map_sandbox(plan, ctrs, topology, float_policy)
    return SandboxPlan(  # (the one record of a planned sandbox: no _base to replace)
        s.id, s.runtime, s, plan.mask, plan.mode, plan.reason, footprint=footprint, plan=plan,
        threads=tuple(vplans), containers=tuple(cplans), guest_map=guest_map,
        notes=tuple(notes), errors=s.errors, kata=kata,
    )  # fmt: skip


def _base(
    s: SandboxObs, mask: CpuSet, footprint: CpuSet, cplans: list[ContainerPlan]
) -> SandboxPlan:
    """The plan of a sandbox whose VMM threads are not planned, which _plan_sandbox's early
    answers start from."""
    return SandboxPlan(
        s.id, s.runtime, s, mask, footprint=footprint,
        containers=tuple(cplans), notes=s.notes, errors=s.errors,
    )  # fmt: skip


KATA_LEFT_UNTRACKED = (
    "Kata pins the vCPUs itself (enable_vcpus_pinning): vCPUs left where Kata pinned them,"
    " one per CPU"
)


def _one_per_cpu(threads: tuple[ThreadObs, ...], cpuset: CpuSet | None = None) -> bool:
    """Every vCPU alone on a CPU of its own (together ``cpuset``, when given): pinned as
    Kata's ``enable_vcpus_pinning`` pins them."""
    actual = [t.actual for t in threads if t.role == "vcpu"]
    singles = [a for a in actual if a is not None and len(a) == 1]
    if not actual or len(singles) != len(actual):
        return False
    union = CpuSet.union_all(singles)
    return len(union) == len(singles) and (cpuset is None or union == cpuset)


def _kata(plan: Plan, threads: tuple[ThreadObs, ...], cpuset: CpuSet | None) -> tuple[str, str]:
    """Whether Kata's own vCPU pinning applies to this sandbox, and how vmpin keeps out of
    its way (``SandboxPlan.kata``), with the note that says so."""
    n = plan.nvcpus
    if cpuset is None or not n or n != len(cpuset):
        return "", ""  # Kata pins only when #vCPUs == |cpuset|
    why = f"Kata pins the {n} vCPUs itself (enable_vcpus_pinning, {n} vCPUs on {cpuset})"
    if plan.runtime_map and plan.vcpu_map == plan.runtime_map:
        return "follows", f"{why}: vmpin's 1:1 plan is Kata's layout, vCPU i on its i-th CPU"
    if _one_per_cpu(threads, cpuset):
        return "left", (
            f"{why}: vCPUs left where Kata pinned them, one per CPU"
            f" (vmpin's own plan: {plan.mode}, {plan.reason})"
        )
    return "expected", f"{why}, but they are not pinned so: planned as usual until Kata does"


def _thread(
    t: ThreadObs, desired: CpuSet | None, kind: str, container: str | None = None
) -> ThreadPlan:
    return ThreadPlan(
        t.tid, t.role, t.index, t.name or t.label, t.layer, desired, t.actual, kind, container,
        t.original, t.error,
    )  # fmt: skip


def _undo_or_none(t: ThreadObs, pool: CpuSet | None) -> ThreadPlan:
    """Invariant 4: a thread vmpin pinned and no longer manages goes back (pool, or original)."""
    if t.original is None:
        return _thread(t, None, "none")
    return _thread(t, pool or t.original, "undo")


def _replace(p: SandboxPlan, **kw: object) -> SandboxPlan:
    if TYPE_CHECKING:
        from dataclasses import replace
    else:
        from vmpin.lean.records import replace

    return replace(p, **kw)  # type: ignore[arg-type]


def check_node(
    plans: list[SandboxPlan], exclusive: Mapping[int, Claim], pods: Mapping[str, str]
) -> list[str]:
    """The node-wide rules on a plan (successor of ``planner.check_global``).

    No CPU carries two 1:1 vCPUs; a 1:1 CPU lies in no other sandbox's footprint; no thread
    is planned onto a CPU kubelet gives another pod exclusively.
    """
    problems = check_global([p.plan for p in plans if p.plan is not None])
    # Which sandboxes' footprints hold each 1:1 CPU: one walk over the footprints, so the
    # check stays linear in the node (each hit found is a problem reported).
    pins = [(p, pinned) for p in plans if (pinned := p.pinned_cpus)]
    holders: dict[int, list[str]] = {}
    if pins:
        pinned_set = checked([cpu for _, pinned in pins for cpu in pinned])
        for q in plans:
            for cpu in q.footprint & pinned_set:
                holders.setdefault(cpu, []).append(q.id)
    for p, pinned in pins:
        for cpu in pinned:
            for qid in holders.get(cpu, ()):
                if qid != p.id:
                    problems.append(f"CPU {cpu}: pinned 1:1 for {p.id}, in {qid}'s footprint")
    if not exclusive:
        return problems
    foreign: dict[tuple[CpuSet, str | None], int | None] = {}
    for p in plans:
        pod = pods.get(p.id)
        for t in p.threads:
            if t.desired is None:
                continue
            key = (t.desired, pod)
            if key not in foreign:
                foreign[key] = next(
                    (c for c in t.desired if (cl := exclusive.get(c)) and cl.pod != pod), None
                )
            hit = foreign[key]
            if hit is not None:
                claim = exclusive[hit]
                problems.append(
                    f"thread {t.tid} of {p.id} planned on CPU {hit}, exclusive to pod"
                    f" {claim.pod} ({claim.container})"
                )
    return problems
