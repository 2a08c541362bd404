"""The one reconcile pass: observe the node -> plan the node -> apply the difference.

Every entry point goes through :class:`Reconciler` (built by the one factory,
:func:`vmpin.service.settings.build_reconciler`): the hook, ``vmpin update``, ``reconcile
--once``, the agent, and -- without applying -- ``show``, ``sandboxes`` and ``audit``.  It is
level-triggered and node-wide: whatever event asked for a pass, the whole node is observed
and planned (a node is small), because one sandbox's new CPU set can change another's plan
(issue 9).  Applying writes only where actual differs from the plan, so running it twice is
harmless and running it after a crash repairs what the crash interrupted.

- :mod:`.allocations`: vmpin's own exclusive CPUs settled in the store (before observe);
- :mod:`.observe`: host + store -> Observation (no writes);
- :mod:`.plan`: Observation + topology + policy -> NodePlan (pure);
- :mod:`.apply`: NodePlan vs actual -> affinity/cgroup writes, then store writes;
- :mod:`.summarizer`: the node summary the plain hooks judge by (after the last write);
- :mod:`.audit` / :mod:`.report`: the invariant and the views.

A pass that applies holds the node's plan lock (:mod:`vmpin.state.locks`) from its observe
to its last write, pins, records and guest maps alike: one writer order for the node, so
that the last write to the store is what the kernel ends with (issue 26).  It never waits
for the lock past its deadline (a hook's budget, docs/hooks.md); a pass that went on
without it, or whose hold was overtaken by one that did, plans again (at most
:data:`REPLANS` times) when what it planned from may be older than what another applied.
"""

from __future__ import annotations

import gc
import os

from vmpin.core.cpuset import CpuSet
from vmpin.core.errors import StateError
from vmpin.linux import sysfs
from vmpin.linux.affinity import SchedAffinity
from vmpin.linux.paths import HostPaths
from vmpin.reconcile import plan as planning
from vmpin.reconcile.observation import FULL
from vmpin.reconcile.report import SandboxReport, ThreadReport, node_reports, sandbox_report
from vmpin.reconcile.settled import Settled
from vmpin.state.locks import NodeLock
from vmpin.state.records import SandboxRec
from vmpin.state.store import Store

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.lean.records)

if TYPE_CHECKING:
    from collections.abc import Callable, Collection
    from typing import Any

    from vmpin.core.planner import Policy
    from vmpin.core.topology import Topology
    from vmpin.linux.affinity import AffinityBackend
    from vmpin.reconcile.apply import Applied
    from vmpin.reconcile.observe import Observation, Observer, Scope
    from vmpin.reconcile.plan import NodePlan
    from vmpin.reconcile.sources import DomainSource
    from vmpin.reconcile.summarizer import Inputs, Summarizer
    from vmpin.runtimes.kubelet import Checkpoint
    from vmpin.state.reader import Reader

__all__ = ["Reconciler", "SandboxReport", "ThreadReport", "reconcile_plain", "view_sandbox"]

#: passes planned again, at most, after one that may have been overtaken (see the docstring)
REPLANS = 3

#: one entry per pass running with the cyclic collector paused (list.append/pop are atomic)
_PAUSED: list[None] = []


class _GcPaused:
    """The cyclic garbage collector off for one pass, back on when the last pass ends.

    A node pass allocates a few objects per thread and keeps them all until it ends, so the
    collector's young generations fill up and get promoted: at 2,000 sandboxes the full
    collections it triggered took a quarter of an idle pass's CPU, to find no garbage (what a
    pass drops is freed by reference counting).  Passes in several threads share the pause;
    a process that had switched the collector off keeps it off.
    """

    __slots__ = ("_mine",)

    def __enter__(self) -> None:
        self._mine = bool(_PAUSED) or gc.isenabled()
        if self._mine:
            _PAUSED.append(None)
            gc.disable()

    def __exit__(self, *exc: object) -> None:
        if self._mine:
            _PAUSED.pop()
            if not _PAUSED:
                gc.enable()


class Reconciler:
    def __init__(
        self,
        paths: HostPaths,
        store: Reader | None = None,
        *,
        policy: Policy | Callable[[], Policy] | None = None,
        affinity: AffinityBackend | None = None,
        topology: Topology | None = None,
        qmp_timeout: float = 0.3,
        float_policy: str = "all",
        publish: bool = True,
        domains: DomainSource | None = None,
        ingest_first: bool = True,
        hold_maps: bool = False,
        follow_hotplug: bool = False,
        deadline: float | None = None,
    ) -> None:
        self.paths = paths
        #: what a pass reads; a pass that applies also writes it, and so needs a
        #: :class:`Store` (:meth:`_writer`): a read-only view's Reader only plans
        self.store: Reader = store if store is not None else Store(paths.state_dir)
        self._policy = policy
        self.affinity: AffinityBackend = affinity or SchedAffinity()
        self._topology = topology
        self.qmp_timeout = qmp_timeout
        self.float_policy = float_policy
        self.publish = publish
        #: libvirt domains (vmpin.reconcile.domains), observed and applied beside the store's
        self.domains = domains
        self._observer: Observer | None = None
        #: the last pass's plan (the agent's metrics and logs read its conflicts)
        self.last_plan: NodePlan | None = None
        #: a list: the guest maps a pass would publish are kept there for the caller to
        #: publish (:meth:`publish_maps`) once it has answered whoever waits on the pins
        self.maps_later: list[tuple[str, dict[str, Any] | None]] | None = None
        #: called in a pass that applies once its pins are in place and current (it holds
        #: the node's plan lock, and nobody went on without it meanwhile), before its node
        #: summary: the agent answers whoever waits on the pins there (issue 28)
        self.on_pinned: Callable[[], object] | None = None
        #: each sandbox's last plan with what it was planned from (plan_node's ``memo``)
        self._sandbox_plans: planning.PlanMemo | None = None
        #: the last plan and what it was made from (see plan())
        self._plan_memo: tuple[Observation, Topology, str, NodePlan, tuple[int, int]] | None = None
        #: the last plan's observation read every value from the host (no event pass's
        #: ``fresh``), and what the last pass that applied wrote to the host (threads and
        #: cgroups): what the agent's read views judge its plan by (:attr:`last_observed`)
        self._read_all = False
        self.last_writes = 0
        #: False: a pass does not apply the journal first (its caller just did, without
        #: waiting for the disk: the agent's pass, the Kata hook's own; Store.ingest)
        self.ingest_first = ingest_first
        #: a list: the guest maps and node summary a pass replaces are held open there
        #: until :meth:`release_maps` (the agent, after its answers: publish_map's and
        #: save_cache's ``hold``)
        self.held_maps: list[int] | None = [] if hold_maps else None
        #: True: the topology read from sysfs is read again
        #: once the online CPU list changes (CPU hotplug), checked at each use: for the
        #: agent, which plans for its whole life; a command's pass lasts milliseconds
        self.follow_hotplug = follow_hotplug
        #: the online list the topology read from sysfs was read after (None: not read
        #: here, or given to the constructor); the agent's ``audit`` compares it to tell a
        #: CPU hot(un)plugged since (agent_views)
        self.online_seen: str | None = None
        #: the node summary's inputs an applying pass read at its start: its online list and
        #: VM dir listing serve the pass too (:meth:`_online`, :meth:`observe`)
        self._inputs: Inputs | None = None
        #: kubelet's checkpoint (and its error) as an applying pass read it before it
        #: settled the allocations: its observation takes it (:meth:`observe`)
        self._checkpoint: tuple[Checkpoint | None, str | None] | None = None
        #: when set (``time.monotonic()``), a pass waits for the node's plan lock no later
        #: than this, then goes on without it (a hook's or ``vmpin update``'s budget); else
        #: it waits up to :data:`vmpin.state.locks.WAIT` seconds
        self.deadline = deadline
        #: the node's plan lock: whether the last applying pass went on without it, and why
        self.node_lock = NodeLock(self.store.state_dir)
        self._summarizer: Summarizer | None = None
        #: the plans the last passes applied cleanly (an event's pass applies the rest)
        self._settled = Settled()

    # -- inputs --------------------------------------------------------------------------
    @property
    def policy(self) -> Policy:
        from vmpin.core.planner import Policy

        if not isinstance(self._policy, Policy):
            self._policy = self._policy() if self._policy is not None else Policy()
        return self._policy

    @property
    def topology(self) -> Topology:
        following = self.follow_hotplug and self._topology is not None and self.online_seen
        if following and self._online() != self.online_seen:
            self._topology = None  # a CPU came or went: its place is read anew
        if self._topology is None:
            # (read before the topology: a CPU that comes or goes meanwhile is seen at the
            # next use)
            seen = self._online() if self.follow_hotplug else None
            # (a read-only view leaves the state dir as it found it: it reads the cache only)
            self._topology = sysfs.read_topology(
                self.paths.sys,
                cache=self.paths.topology_cache,
                proc_root=self.paths.proc,
                save=not self.store.readonly,
            )
            self.online_seen = seen
        return self._topology

    def _online(self) -> str | None:
        """The online list as this applying pass read it for its summary, else read now."""
        inputs = self._inputs
        return (inputs[2] or None) if inputs is not None else sysfs.online_text(self.paths.sys)

    @property
    def observer(self) -> Observer:
        if self._observer is None:
            from vmpin.reconcile.observe import Observer

            self._observer = Observer(
                self.paths, self.policy, qmp_timeout=self.qmp_timeout, domains=self.domains
            )
        return self._observer

    @property
    def summarizer(self) -> Summarizer:
        """The node summary, as this reconciler's passes keep it (built for the first pass
        that applies: a read-only view never needs it)."""
        if self._summarizer is None:
            from vmpin.reconcile.summarizer import Summarizer

            self._summarizer = Summarizer(self.paths, _writer(self.store))
        return self._summarizer

    # -- the pass ------------------------------------------------------------------------
    def observe(
        self, scope: Scope | None = None, fresh: Collection[str] | None = None
    ) -> Observation:
        """The node now; a read-only view may narrow it (``scope``, see observe.Scope), an
        event's pass read only the sandboxes it names afresh (``fresh``: Observer.observe)."""
        if scope is None:
            listed = self._inputs[0] if self._inputs is not None else None
            return self.observer.observe(
                self.store, fresh=fresh, vm_dir=listed, read=self._checkpoint
            )
        return self.observer.observe(self.store, scope, fresh)

    def plan(
        self,
        obs: Observation | None = None,
        scope: Scope | None = None,
        fresh: Collection[str] | None = None,
    ) -> NodePlan:
        """The node's plan (of ``obs``, or of a new observation within ``scope``/``fresh``)."""
        with _GcPaused():
            version = self.store.version()
            if self._plan_memo is not None and self._plan_memo[4] != version:
                # The store moved (an event, the last pass's own records): the plan will
                # hardly stand, and the old one is not to be kept while the node is observed
                # anew (three nodes' worth in memory at once: the agent's RSS peak).
                self._plan_memo = self.last_plan = None
            obs = obs if obs is not None else self.observe(scope, fresh)
            topology, float_policy = self.topology, self.float_policy
            memo = self._plan_memo
            if (
                memo is not None
                and memo[1] is topology
                and memo[2] == float_policy
                and memo[0] == obs
            ):
                # The node as the last pass saw it (an idle node): plan_node is a function
                # of its inputs alone, so its plan stands.  Comparing costs about a third of
                # planning (issue 14: the idle pass at 2,000 sandboxes).
                plan = memo[3]
            else:
                # the old node's plan goes first: never two nodes' plans in memory at once
                # (the agent's RSS peaks in a pass, issue 14)
                self._plan_memo = self.last_plan = None
                if self._sandbox_plans is None:
                    self._sandbox_plans = planning.PlanMemo()
                plan = planning.plan_node(
                    obs, topology, float_policy=float_policy, memo=self._sandbox_plans
                )
            self._plan_memo = (obs, topology, float_policy, plan, version)
            self._read_all = fresh is None and plan.scope == FULL
        self.last_plan = plan
        return plan

    @property
    def last_observed(self) -> tuple[Observation, NodePlan, tuple[int, int], bool] | None:
        """The last plan, the observation it was made from, the store's version before it
        was observed, and whether every value was read from the host afresh: what the
        agent's read views answer from (vmpin.service.agent_views)."""
        memo = self._plan_memo
        return None if memo is None else (memo[0], memo[3], memo[4], self._read_all)

    def reconcile(
        self,
        sandbox_ids: list[str] | None = None,
        *,
        apply: bool = True,
        scope: Scope | None = None,
        fresh: Collection[str] | None = None,
    ) -> list[SandboxReport]:
        """One node-wide pass; the reports of ``sandbox_ids`` (default: every tracked one).

        With ``apply``, pending journal events are applied first and the whole node is
        brought into line, whichever sandboxes are asked about.  Without, a view may narrow
        what is observed (``scope``, e.g. only the threads of the sandboxes it reports).
        ``fresh`` (an event's pass): the host is read for these sandboxes, and for those
        whose records changed; the others are planned as last observed (Observer.observe).
        """
        if apply and scope is not None:
            raise ValueError("a pass that applies observes the whole node")
        with _GcPaused():
            if not apply:
                return self._reconcile(sandbox_ids, apply, scope)
            held = self._lock()
            try:
                return self._applying(sandbox_ids, held, fresh)
            finally:
                self._unlock()

    # -- the node's plan lock (vmpin.state.locks) ----------------------------------------------
    def _lock(self) -> bool:
        """Take the node's plan lock, waiting until the deadline at most; whether held."""
        return self.node_lock.take(self.deadline)

    def _unlock(self) -> None:
        self.node_lock.release()

    def _applying(
        self, sandbox_ids: list[str] | None, held: bool, fresh: Collection[str] | None = None
    ) -> list[SandboxReport]:
        """One pass that applies; planned again while it may have applied an older plan
        than another process did (see the module's docstring), or while a plain container's
        event it did not plan with is one its node summary would not let a hook pass."""
        store, lock, summarizer = self.store, self.node_lock, self.summarizer
        summarized = False
        try:
            for attempt in range(REPLANS + 1):
                seen = store.data_version()
                # (one read of it per pass: every layer's Reader.version() answers with it)
                store.hold_version(seen)
                inputs = summarizer.inputs() if held else None
                self._inputs = inputs
                reports = self._reconcile(sandbox_ids, True, again=attempt > 0, fresh=fresh)
                if held and lock is not None and inputs is not None:
                    # nobody went on without the lock while this pass held it: nothing
                    # applied since this pass observed the node but by this pass
                    if not lock.overtaken():
                        if self.on_pinned is not None:
                            self.on_pinned()
                        summarized = summarizer.write(
                            self.last_plan, *inputs, hold=self.held_maps
                        )
                        if summarized:
                            break
                elif store.data_version() == seen:
                    break  # (no lock: nothing committed while this pass ran, so it is current)
        finally:
            store.hold_version(None)
            self._inputs = None
            if not summarized:
                # (went on without the lock, failed, or an event still disagrees with it:
                # every plain hook beside a VM re-plans until the next pass writes one)
                summarizer.forget()
        return reports

    def _note_applied(self, applied: Applied) -> None:
        """What the pass wrote and read back, into the observation an event's pass may give
        again (Observer.note_applied)."""
        threads, cgroups = applied.pinned, _repaired(applied)
        self.last_writes = sum(map(len, threads.values())) + sum(map(len, cgroups.values()))
        if threads or cgroups:
            self.observer.note_applied(threads, cgroups)

    def _reconcile(
        self,
        sandbox_ids: list[str] | None,
        apply: bool,
        scope: Scope | None = None,
        again: bool = False,
        fresh: Collection[str] | None = None,
    ) -> list[SandboxReport]:
        writer = _writer(self.store) if apply else None
        if writer is not None and (self.ingest_first or again) and not writer.readonly:
            # events the hooks journaled since this store was opened (planning again: since
            # the first time; the caller's own ingest did not wait for the disk)
            try:
                writer.ingest(durable=self.ingest_first)
            except StateError:
                if not again:
                    raise
        if writer is not None and not writer.readonly:
            from vmpin.reconcile.allocations import settle

            # (the pass's one read of kubelet's checkpoint: its observation takes it too)
            self._checkpoint = self.observer.checkpoint()
            settle(writer, self.topology, self._checkpoint[0], self.paths.kubelet_config)
        try:
            plan = self.plan(scope=scope, fresh=fresh)
        finally:
            self._checkpoint = None
        applied = None
        among = None
        if writer is not None:
            from vmpin.reconcile.apply import Applier

            # an event's pass applies what it names and what moved (.settled)
            only = None
            if fresh is not None and sandbox_ids is not None:
                only = self._settled.to_apply(plan, sandbox_ids)
            applied = Applier(
                self.paths,
                self.affinity,
                publish=self.publish,
                domains=self.domains,
                maps_later=self.maps_later,
                hold=self.held_maps,
            ).apply(writer, plan, only)
            self._settled.note(plan, applied, only)
            self._note_applied(applied)
            if only is not None:  # (it holds those asked about: to_apply gives them)
                among = applied.sandboxes
        return node_reports(plan, applied, sandbox_ids, among)

    def publish_maps(self) -> None:
        """Publish the guest maps kept back by passes since the last call (``maps_later``)."""
        if not self.maps_later:
            return
        from vmpin.reconcile.apply import publish_maps

        maps, self.maps_later[:] = list(self.maps_later), []
        # the maps are written in the node's writer order too: a map of an older plan must
        # not land after a newer one (vmpin.runtimes.publish takes no lock of its own); a
        # pass that answers from on_pinned holds the lock already
        taken = not self.node_lock.held and self._lock()
        try:
            publish_maps(self.paths, maps, self.held_maps)
        finally:
            if taken:
                self._unlock()

    def release_maps(self) -> None:
        """Close the replaced guest maps (and summaries) held since the last call: the
        filesystem frees them now, off the path of whoever waited on the pass."""
        held, self.held_maps = self.held_maps, ([] if self.held_maps is not None else None)
        for fd in held or ():
            try:  # noqa: SIM105 (contextlib stays off the Kata hook's path)
                os.close(fd)
            except OSError:
                pass

    def audit(self, scope: Scope | None = None) -> dict[str, Any]:
        """The node-wide invariant (``scope``: what it observes, default everything)."""
        from vmpin.reconcile.audit import node_audit

        with _GcPaused():
            obs = self.observe(scope)
            return node_audit(obs, self.plan(obs))


def reconcile_plain(
    reconciler: Reconciler, sandbox_id: str, old: CpuSet | None, new: CpuSet | None, infra: bool
) -> list[SandboxReport] | None:
    """A plain (runc) sandbox's pass after one of its containers went from ``old`` to
    ``new`` (``vmpin update``): its cgroups brought into line, nothing else observed, at a
    cost that does not grow with the node (issue 26: 3.7 s at 10,000 containers).

    Only under the node's plan lock, and only when the node summary of the last pass
    (vmpin.state.summary) says no VM's plan depends on the change; None otherwise (the
    caller then runs the node's pass).  The summary stays true: the change is one it lets
    through.  (A function beside the pass, which it is not: it plans one sandbox.)"""
    from vmpin.reconcile.apply import Applier
    from vmpin.state.allocating import present as allocating

    if allocating(reconciler.store.state_dir):
        return None  # vmpin's allocations move the pool: the node's pass (issue 30)
    lock = reconciler.node_lock
    with _GcPaused():
        if not lock.take(reconciler.deadline):
            return None
        try:
            if not reconciler.summarizer.lets_through(old, new, infra):
                return None
            obs = reconciler.observer.observe_plain(reconciler.store, sandbox_id)
            if obs is None:
                return None
            topology, float_policy = reconciler.topology, reconciler.float_policy
            plan = planning.plan_node(obs, topology, float_policy=float_policy)
            applier = Applier(reconciler.paths, reconciler.affinity, publish=False)
            applied = applier.apply(_writer(reconciler.store), plan)
            return [sandbox_report(sp, applied) for sp in plan.sandboxes]
        finally:
            lock.release()


def view_sandbox(
    reconciler: Reconciler, rec: SandboxRec, scope: Scope | None = None
) -> SandboxReport:
    """One sandbox's report from a node-wide pass that does not apply (``show``,
    ``guest-map``: the node is planned, whatever one sandbox is asked about); a vanished
    one when the pass found it gone.  (A function, not a method: views are not the pass.)"""
    found = reconciler.reconcile([rec.id], apply=False, scope=scope)
    if found:
        return found[0]
    report = SandboxReport(rec.id, rec.runtime)
    report.vanished = True
    return report


def _repaired(applied: Applied) -> dict[str, dict[str, CpuSet]]:
    """The cgroup cpusets a pass wrote and read back, by sandbox and container (its
    threads pinned: ``applied.pinned``)."""
    cgroups: dict[str, dict[str, CpuSet]] = {}
    for sid, drifts in applied.cgroups.items():
        for d in drifts:
            if d.get("repaired"):
                cgroups.setdefault(sid, {})[d["container"]] = CpuSet.parse(d["desired"])
    return cgroups


def _writer(store: Reader) -> Store:
    """The store as a pass that applies writes it: a :class:`Store` (open_readonly's
    in-memory copy too, whose records go nowhere); never a read-only view's Reader."""
    if not isinstance(store, Store):
        raise TypeError(f"{store.path}: opened for reading only: a pass cannot apply")
    return store
