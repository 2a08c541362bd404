"""Apply: a NodePlan vs what was observed -> the fewest host writes, verified, then the store.

Host writes come first and are each read back (the kernel may hold a narrower set than was
asked: cpuset restrictions); only threads and cgroups whose actual value differs from the
plan are touched, so a second pass over an unchanged node makes no write at all.  A thread
that exits between observe and apply is expected (``gone``), EPERM/EINVAL are an error on
that thread only.

Before vmpin's first pin of a VMM thread, the affinity it had is recorded in the store (meta
``orig-affinity:...``), so that invariant 4's undo can give it back later.

Store writes, after the host: what the sources said (adoptions), forgotten containers and
sandboxes, a sandbox's VMM and thread roles when classified afresh, and ``done_gen``.  Then
the guest map is published for the sandboxes whose plan has one.
"""

from __future__ import annotations

from vmpin.core.cpuset import CpuSet
from vmpin.core.errors import HostError, ProcessGone, VmpinError
from vmpin.linux.paths import HostPaths
from vmpin.reconcile.observation import FULL, VmmKey, stale_originals
from vmpin.reconcile.plan import Adoption, NodePlan, SandboxPlan, ThreadPlan
from vmpin.state.records import ThreadRec
from vmpin.state.store import Store

TYPE_CHECKING = False
if TYPE_CHECKING:
    import sqlite3
    from collections.abc import Callable, Iterable, Sequence
    from dataclasses import dataclass
    from functools import partial
    from typing import Any

    from vmpin.linux.affinity import AffinityBackend
    from vmpin.reconcile.sources import DomainSource
else:  # dataclasses imports inspect and re: a stand-in on the hook's path
    # functools.partial is this C type; functools itself is ~2.5 ms (vmpin.state.sqlite)
    from _functools import partial

    from vmpin.lean.records import dataclass
    from vmpin.state.sqlite import sqlite3


@dataclass(slots=True)
class Outcome:
    """What apply did for one thread: ok | pinned | gone | error | unmanaged | drift."""

    action: str
    actual: CpuSet | None
    error: str | None = None


#: what apply did to a thread that leaves nothing for the next pass to try again
CLEAN = frozenset(("ok", "pinned", "unmanaged"))


class Applied:
    """What a pass applied: each thread's outcome by sandbox and tid, and, gathered while it
    was applied (not by walking every thread again after), each sandbox's threads pinned
    with the affinity read back (``pinned``) and the sandboxes with a thread whose outcome
    is not :data:`CLEAN` (``unclean``)."""

    __slots__ = ("cgroups", "errors", "pinned", "sandboxes", "threads", "unclean")

    def __init__(self) -> None:
        #: the sandbox plans applied (an event's pass: those it was given)
        self.sandboxes: Sequence[SandboxPlan] = ()
        self.threads: dict[str, dict[int, Outcome]] = {}
        self.cgroups: dict[str, list[dict[str, Any]]] = {}
        self.errors: dict[str, list[str]] = {}
        self.pinned: dict[str, dict[int, CpuSet]] = {}
        self.unclean: set[str] = set()

    def add(self, sandbox_id: str, tid: int, o: Outcome) -> None:
        """A thread's outcome, counted where it belongs (pinned, unclean) as it comes."""
        self.extend(sandbox_id, ((tid, o),))

    def extend(self, sandbox_id: str, outcomes: Iterable[tuple[int, Outcome]]) -> None:
        """:meth:`add` of each of one sandbox's ``(tid, outcome)``, as each comes (a thread
        applied is added before the next is: one that raises leaves those before it told).
        One call per sandbox, not per thread: an event's pass over a 37-thread VM pins them
        all (issue 28)."""
        threads = pinned = None
        for tid, o in outcomes:
            if threads is None:  # (a sandbox with none added has no entry, as before)
                threads = self.threads.setdefault(sandbox_id, {})
            threads[tid] = o
            action = o.action
            if action == "pinned" and o.actual is not None:
                if pinned is None:
                    pinned = self.pinned.setdefault(sandbox_id, {})
                pinned[tid] = o.actual
            elif action not in CLEAN:
                self.unclean.add(sandbox_id)


def outcome_without_apply(t: ThreadPlan) -> Outcome:
    """What a thread's state is when nothing is written (audit, show)."""
    if t.actual is None:
        return Outcome("error" if t.error else "gone", None, t.error)
    if t.desired is None:
        return Outcome("unmanaged", t.actual)
    return Outcome("ok" if t.actual == t.desired else "drift", t.actual)


class Applier:
    def __init__(
        self,
        paths: HostPaths,
        affinity: AffinityBackend,
        *,
        publish: bool = True,
        domains: DomainSource | None = None,
        maps_later: list[tuple[str, dict[str, Any] | None]] | None = None,
        hold: list[int] | None = None,
    ):
        self.paths = paths
        self.affinity = affinity
        self.publish = publish
        self.domains = domains
        #: when a list, the guest maps to publish go there instead (:func:`publish_maps`
        #: later): a caller that answers a waiter first, as the agent does for an update
        self.maps_later = maps_later
        #: when a list, replaced guest maps are held open there (publish_map's ``hold``)
        self.hold = hold

    def apply(self, store: Store, plan: NodePlan, only: set[str] | None = None) -> Applied:
        """Make the host match ``plan`` (every sandbox, or those in ``only``), then record."""
        # (FULL itself first: comparing scopes is a dataclass's __eq__)
        if plan.scope is not FULL and plan.scope != FULL:
            # a view's plan leaves threads out: applying it would undo them
            raise ValueError("a plan observed for a read-only view is never applied")
        out = Applied()
        # (the sandboxes applied, picked once: an event's pass applies a few of the node's)
        chosen = plan.sandboxes if only is None else [sp for sp in plan.sandboxes if sp.id in only]
        out.sandboxes = chosen
        live = [sp for sp in chosen if not sp.vanished]
        self._remember_originals(store, live, out)
        for sp in live:
            try:
                if sp.runtime == "libvirt":
                    # pinned through libvirt (its per-thread cgroups refuse a raw affinity),
                    # and nothing of a domain goes into the store: libvirt holds its state
                    if self.domains is not None:
                        for tid, o in self.domains.apply(sp, self.publish).items():
                            out.add(sp.id, tid, o)
                    continue
                if sp.runtime == "runc":
                    self._cgroups(sp, out)
                thread = self._thread
                out.extend(sp.id, ((t.tid, thread(t)) for t in sp.threads if t.role != "container"))
            except Exception as err:
                # A bug or an unforeseen error while applying one sandbox is an error against
                # that sandbox: every other sandbox of the node is still brought into line.
                out.errors.setdefault(sp.id, []).append(f"unexpected {type(err).__name__}: {err}")
        self._record(store, plan, chosen, only is None)
        return out

    # -- host ----------------------------------------------------------------------------------
    def _cgroups(self, sp: SandboxPlan, out: Applied) -> None:
        from vmpin.linux import cgroups

        for c in sp.containers:
            ref, current = c.obs.cgroup, c.obs.cgroup_cpus
            if ref is None or current is None or c.desired is None or current == c.desired:
                continue
            drift: dict[str, Any] = {
                "container": c.rec.id,
                "cgroup": ref.path,
                "desired": c.desired.to_list(),
                "actual": current.to_list(),
            }
            try:
                cgroups.write_cpus(ref, c.desired)
                drift["repaired"] = cgroups.read_cpus(ref) == c.desired
            except VmpinError as err:
                out.errors.setdefault(sp.id, []).append(f"container {c.rec.id}: {err}")
                drift["repaired"] = False
            out.cgroups.setdefault(sp.id, []).append(drift)

    def _remember_originals(self, store: Store, plans: list[SandboxPlan], out: Applied) -> None:
        """Before vmpin's first pin in a VMM, record every thread's affinity (invariant 4).

        Only the first time: a thread created later inherits its creator's pinned affinity,
        and observe gives it the main thread's record instead.  Every sandbox's record goes
        into one transaction, before any pin (one commit per sandbox made a start-up pass
        over 2,000 sandboxes wait on 2,000 fsyncs).
        """
        records: dict[str, list[tuple[str, str]]] = {}
        for sp in plans:
            vmm = sp.obs.vmm
            if sp.runtime == "libvirt" or vmm is None:
                continue
            if any(t.original is not None for t in sp.threads):
                continue
            if not any(
                t.kind == "plan" and t.desired is not None and t.actual not in (None, t.desired)
                for t in sp.threads
            ):
                continue
            vmm_key = VmmKey(sp.id, vmm.pid, vmm.start)
            records[sp.id] = [
                (vmm_key.orig(t.tid), t.actual.to_list())
                for t in sp.threads
                if t.actual is not None
            ]
        if not records:
            return
        try:
            with store.transaction():
                for keys in records.values():
                    for key, value in keys:
                        store.set_meta(key, value)
        except (sqlite3.Error, OSError, VmpinError) as err:
            # A full or read-only state dir must not leave the VM floating over other pods'
            # CPUs: pin from the host's truth anyway; without a record the undo (invariant 4)
            # falls back to the shared pool, as for a thread created after the first pin.
            for sid in records:
                out.errors.setdefault(sid, []).append(
                    f"original affinities not recorded (store not writable: {err}); pinned anyway"
                )

    def _thread(self, t: ThreadPlan) -> Outcome:
        if t.actual is None:
            return Outcome("error" if t.error else "gone", None, t.error)
        if t.desired is None:
            return Outcome("unmanaged", t.actual)
        if t.actual == t.desired:
            return Outcome("ok", t.actual)
        try:
            actual = self.affinity.set(t.tid, t.desired)
        except ProcessGone:
            return Outcome("gone", None)
        except HostError as err:
            return Outcome("error", t.actual, str(err))
        # (the backend gives the set asked for itself when the kernel holds just that)
        if actual is not t.desired and actual != t.desired:
            return Outcome("error", actual, f"kernel holds {actual} after setting {t.desired}")
        return Outcome("pinned", actual)

    # -- store ---------------------------------------------------------------------------------
    def _record(
        self, store: Store, plan: NodePlan, chosen: Sequence[SandboxPlan], whole: bool
    ) -> None:
        """The pass's store writes, in one transaction, and none at all when nothing changed;
        ``chosen``: the sandbox plans applied, ``whole``: every one of the node's.

        (A commit per write made a start-up pass over 2,000 sandboxes 10,000 commits; an idle
        pass must not touch ``state.db`` or its WAL.)  The guest maps are published after.
        """
        writes: list[Callable[[], object]] = []
        for a in plan.adoptions:
            writes.append(partial(_adopt, store, a))
        for cid in plan.forget_containers:
            writes.append(partial(store.delete_container, cid))
        live_vmms: list[VmmKey] = []
        publish: list[tuple[str, dict[str, Any] | None]] = []
        # (an event's pass: the others are applied as they are by an earlier pass, their
        # records written then, .settled; what it recorded of VMMs gone, the next full pass
        # forgets)
        for sp in chosen:
            s = sp.obs
            if s.vmm is not None:
                live_vmms.append(VmmKey(sp.id, s.vmm.pid, s.vmm.start))
            if not s.tracked or s.record is None or s.runtime == "libvirt":
                continue
            if sp.vanished:
                if s.vmm_gone:
                    writes.append(partial(store.delete_sandbox, sp.id))
                continue
            if s.became_kata:
                writes.append(partial(store.put_sandbox, s.record._replace(runtime="kata")))
            for c in sp.containers:
                if c.obs.cgroup is not None and c.obs.cgroup.rel != c.rec.cgroup:
                    writes.append(partial(store.note_seen, c.rec.id, cgroup=c.obs.cgroup.rel))
            vmm = s.vmm
            if vmm is not None:
                rec = s.record
                if (rec.vmm_pid, rec.vmm_start) != (vmm.pid, vmm.start):
                    writes.append(partial(store.set_vmm, sp.id, vmm.pid, vmm.start))
                if vmm.classified and not vmm.as_recorded:
                    threads = [
                        ThreadRec(t.tid, t.role, t.index, t.label, t.layer) for t in vmm.threads
                    ]
                    writes.append(partial(store.save_threads, sp.id, vmm.pid, vmm.start, threads))
                    writes.append(
                        partial(
                            store.set_meta,
                            VmmKey(sp.id, vmm.pid, vmm.start).missing(),
                            ",".join(map(str, vmm.missing_vcpus)),
                        )
                    )
            if s.record.gen > s.record.done_gen:
                # (an idle sandbox is already done at gen: no write)
                writes.append(partial(store.mark_done, sp.id, s.record.gen))
            if self.publish and sp.guest_map is not None:
                publish.append((sp.id, sp.guest_map))
            elif self.publish and s.policy.guest == "off":
                publish.append((sp.id, None))  # the pod turned guest pinning off: withdrawn
        # what vmpin recorded for VMMs that no longer run is of no use to anyone
        # (an event's pass leaves them to the next full pass: it walks only what it applies)
        stale = stale_originals(plan.originals, live_vmms) if whole else []
        if stale:
            writes.append(partial(store.delete_meta, stale))
        if writes:
            with store.transaction():
                for write in writes:
                    write()
        if self.maps_later is not None:
            self.maps_later.extend(publish)
        else:
            publish_maps(self.paths, publish, self.hold)


def publish_maps(
    paths: HostPaths,
    maps: list[tuple[str, dict[str, Any] | None]],
    hold: list[int] | None = None,
) -> None:
    """Publish (a map) or withdraw (None) each sandbox's guest map; ``hold``: see
    :func:`vmpin.runtimes.publish.publish_map`.

    A failure is the map's alone (the pins stand, and the next pass writes it again).
    """
    if not maps:
        return
    from vmpin.runtimes.publish import publish_map, remove_map

    for sid, guest_map in maps:
        try:
            if guest_map is None:
                remove_map(paths, sid)
            else:
                publish_map(paths, sid, guest_map, hold=hold)
        except VmpinError:
            continue


def _adopt(store: Store, a: Adoption) -> None:
    """Record what a source said (adopted, or merely seen)."""
    try:
        if a.adopt:
            store.set_container_cpus(a.container, a.cpus, a.source, **{a.column: a.seen})
        else:
            store.note_seen(a.container, **{a.column: a.seen})
    except VmpinError:
        return  # deleted by another process meanwhile
