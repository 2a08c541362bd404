"""Observe: host + store -> one immutable :class:`Observation` of the node, with no writes.

This module owns *reading*: every tracked sandbox and container (from the store), every VMM
found in the VM dir (tracked or not), each VMM's threads with their actual affinity, each
runc container's cgroup with its actual cpuset and tasks, runc's own state value, kubelet's
checkpoint (shared pool and exclusive assignments), and what vmpin recorded before its first
pin of a thread (for the undo of invariant 4).  Nothing here writes the store, a cgroup or an
affinity: ``vmpin show``/``audit``/... are built on it and must leave ``state.db`` untouched.

One bad object is an error *against that object*: a container whose runc state.json cannot
be read, a VMM whose QMP socket does not answer, a checkpoint that does not parse -- each
carries its ``error`` string and the pass goes on.

Identity is (pid, start time): a runc container's cgroup is looked up from its pid only when
the pid still has the start time recorded at create; a pid without a start time cannot be
proven to be the container's, so it is not followed (the cgroup is then found by the
runtime's layouts, or not at all).

Extension point: a :class:`SandboxObs` carries its ``runtime`` ("kata", "runc"; a libvirt
backend adds "libvirt" with its own VMM finder) and its own ``policy`` (the node's today;
per-pod policy from the Kubernetes API replaces it per sandbox), so :mod:`.plan` needs no
change to learn either.
"""

from __future__ import annotations

import os

from vmpin.core.cpuset import EMPTY, CpuSet
from vmpin.core.errors import HostError, ProcessGone, VmpinError
from vmpin.core.planner import Policy
from vmpin.linux import procfs
from vmpin.linux.paths import HostPaths
from vmpin.reconcile.podpolicies import PodPolicies
from vmpin.state.store import ContainerRec, SandboxRec, Store, ThreadRec
from vmpin.wire.undokeys import MISSING_PREFIX, ORIG_PREFIX, VmmKey

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Container, Mapping, Sequence
    from dataclasses import dataclass, field
    from typing import TypeVar

    from vmpin.linux.cgroups import CgroupRef
    from vmpin.reconcile.sources import DomainSource
    from vmpin.runtimes.kataconfig import KataConfigReader, KataConfigs
    from vmpin.state.allocations import Allocation
    from vmpin.state.store import PolicyRecord

    _T = TypeVar("_T")
    #: the store's policy inputs: the specs' by sandbox id, the Kubernetes API's by pod uid
    _PolicyRecords = tuple[Mapping[str, PolicyRecord], Mapping[str, PolicyRecord]]
    from vmpin.runtimes.kubelet import Checkpoint, CheckpointReader
else:  # dataclasses imports inspect and re: a stand-in on the hook's path
    from vmpin.core._lean import dataclass, field

@dataclass(frozen=True, slots=True)
class ThreadObs:
    """One host thread as seen now: a VMM thread or a task of a container's cgroup."""

    tid: int
    role: str  # vcpu | iothread | vhost | emulator | container
    index: int | None = None
    label: str | None = None
    layer: str = ""
    name: str | None = None
    #: None when the thread was gone by the time its affinity was read
    actual: CpuSet | None = None
    #: the affinity vmpin recorded before its first pin of this thread, if it ever pinned it
    original: CpuSet | None = None
    error: str | None = None

    @property
    def gone(self) -> bool:
        return self.actual is None and self.error is None


@dataclass(frozen=True, slots=True)
class VmmObs:
    pid: int
    start: int
    threads: tuple[ThreadObs, ...] = ()
    #: True when the roles were classified afresh in this observation (apply records them)
    classified: bool = False
    missing_vcpus: tuple[int, ...] = ()
    layers: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    #: classified afresh, and found as the store has it already (apply then writes nothing)
    as_recorded: bool = False


@dataclass(frozen=True, slots=True)
class ContainerObs:
    rec: ContainerRec
    #: True/False when the init's (pid, start) could be checked, None when there was nothing
    alive: bool | None = None
    #: runc's state.json value of cpuset_cpus ("" = none, None = no state file)
    runc_cpus: str | None = None
    #: kubelet's value for (pod uid, container name): exclusive set or shared pool
    kubelet_cpus: CpuSet | None = None
    cgroup: CgroupRef | None = None
    cgroup_cpus: CpuSet | None = None
    tasks: tuple[ThreadObs, ...] = ()
    notes: tuple[str, ...] = ()
    error: str | None = None


@dataclass(frozen=True, slots=True)
class SandboxObs:
    """One sandbox: tracked (``record`` set) or merely present in the VM dir (``record`` None)."""

    id: str
    runtime: str  # kata | runc (| libvirt, later)
    policy: Policy
    record: SandboxRec | None
    containers: tuple[ContainerObs, ...] = ()
    vmm: VmmObs | None = None
    #: the recorded VMM (pid, start) no longer runs: the sandbox went away without a poststop
    vmm_gone: bool = False
    #: the sandbox was recorded as plain runc but has a VM dir: it is Kata's
    became_kata: bool = False
    notes: tuple[str, ...] = ()
    errors: tuple[str, ...] = ()
    #: where ``policy`` came from: node | oci | api (vmpin.reconcile.podpolicies), and the
    #: pod's annotations that could not be used
    policy_source: str = "node"
    policy_problems: tuple[str, ...] = ()
    #: when that source's annotations were recorded in the store (None: node, or not known)
    policy_at: float | None = None

    @property
    def tracked(self) -> bool:
        return self.record is not None


@dataclass(frozen=True, slots=True)
class Scope:
    """How much of the node a read-only view observes and plans: less than a pass does, but
    each value it does read is read fresh from the host (issue 14: read commands at 500
    sandboxes spent ~55 ms reading and planning threads most of them never print).

    ``FULL`` (the default everywhere) is what a pass, ``audit`` and apply need.  A narrower
    scope leaves values *out* (a VMM without threads, a thread without its actual affinity,
    a sandbox without a plan), never puts other values in; so only a view that prints none
    of what is left out may use one, and apply refuses its plan.
    """

    #: find each sandbox's VMM (pid, start time): a VM's footprint, which other sandboxes'
    #: plans depend on, is its mask only while it runs
    vmms: bool = True
    #: the sandboxes whose VMM threads are read and planned (None: every one)
    threads: frozenset[str] | None = None
    #: each thread's actual affinity and name (roles and vCPU indexes are read regardless)
    affinity: bool = True
    #: each planned sandbox's guest map
    guest_maps: bool = True

    def reads_threads(self, sandbox_id: str) -> bool:
        return self.vmms and (self.threads is None or sandbox_id in self.threads)


#: everything: what a pass, ``audit`` and apply need
FULL = Scope()


def leaves_alone(tracked: bool, policy: Policy) -> bool:
    """Whether vmpin leaves some of a VMM's threads where they are (they then hold the CPUs
    they run on, so every scope reads their affinity: see ``plan._left_alone``)."""
    return not tracked or policy.vcpus == "none" or policy.helpers == "none"


def _claiming(scope: Scope) -> Scope:
    """``scope`` widened to read every thread's affinity of a sandbox whose threads are left
    alone: other sandboxes' plans depend on where those threads run."""
    if not scope.vmms or (scope.threads is None and scope.affinity):
        return scope
    return Scope(True, None, True, scope.guest_maps)


@dataclass(frozen=True, slots=True)
class Observation:
    sandboxes: tuple[SandboxObs, ...]
    checkpoint: Checkpoint | None = None
    checkpoint_error: str | None = None
    #: what vmpin recorded before its first pins, by (sandbox, vmm pid, vmm start, tid)
    originals: Mapping[str, str] = field(default_factory=dict)
    #: what was observed (a view's narrower scope, or everything)
    scope: Scope = FULL
    #: Kata's configuration files and whether one turns on Kata's own vCPU pinning
    #: (vmpin.runtimes.kataconfig); None when not read (a view that looks at no VMM)
    kata: KataConfigs | None = None
    #: vmpin's own allocations, granted and waiting (vmpin.reconcile.allocations)
    allocations: tuple[Allocation, ...] = ()

    @property
    def kata_pinning(self) -> bool:
        """Kata pins vCPUs itself where #vCPUs == |cpuset| (``enable_vcpus_pinning``)."""
        return self.kata is not None and self.kata.pinning

    @property
    def shared_pool(self) -> CpuSet | None:
        cp = self.checkpoint
        if cp is None or cp.policy != "static" or not cp.default:
            return None
        pool: CpuSet = cp.default
        return pool

    def sandbox(self, sandbox_id: str) -> SandboxObs | None:
        return next((s for s in self.sandboxes if s.id == sandbox_id), None)


@dataclass(slots=True)
class _Recorded:
    """What a pass reads from the store, each table read once for the whole node.

    (One query per sandbox per table made the store's share of a pass grow with the node,
    and kept the pass's queries proportional to it; see tests/reconcile/test_scaling.py.)
    """

    containers: Mapping[str, list[ContainerRec]]
    threads: Mapping[tuple[str, int, int], dict[int, ThreadRec]]
    missing: Mapping[str, str]
    originals: Mapping[str, str]
    #: kernel vhost threads by owner, scanned at the pass's first classification only
    vhost: Mapping[int, Sequence[tuple[int, str]]] | None = None

    @classmethod
    def read(cls, store: Store, scope: Scope = FULL) -> _Recorded:
        """The store's tables, those ``scope`` needs: no VMM looked at, only the containers;
        no affinity read, no original affinities (a thread's is read beside its actual)."""
        containers: dict[str, list[ContainerRec]] = {}
        for c in store.containers():
            containers.setdefault(c.sandbox_id, []).append(c)
        if not scope.vmms:
            return cls(containers, {}, {}, {})
        return cls(
            containers,
            store.all_threads(),
            dict(store.meta_prefix(MISSING_PREFIX)),
            dict(store.meta_prefix(ORIG_PREFIX)) if scope.affinity else {},
        )


def pid_alive(paths: HostPaths, pid: int | None, start: int | None) -> bool | None:
    """True/False when we can tell, None when there is nothing to check."""
    if not pid:
        return None
    try:
        fields = procfs.stat_fields(paths.proc, pid)
        # A zombie (state Z) keeps its pid and start time until reaped, but runs nothing:
        # runc delete leaves the init that way for a moment.
        if fields[2] in ("Z", "X"):
            return False
        return start is None or int(fields[21]) == start
    except ProcessGone:
        return False
    except HostError:
        return None


class Observer:
    """Reads the node.  Holds caches that only save work (checkpoint by mtime)."""

    def __init__(
        self,
        paths: HostPaths,
        policy: Policy,
        *,
        qmp_timeout: float = 0.3,
        policy_for: Mapping[str, Policy] | None = None,
        domains: DomainSource | None = None,
    ) -> None:
        self.paths = paths
        #: libvirt domains: sandboxes with runtime "libvirt" that live outside the store
        self.domains = domains
        self.policy = policy
        #: per-sandbox policy overrides (per-pod policy plugs in here)
        self.policy_for = dict(policy_for or {})
        self.qmp_timeout = qmp_timeout
        self._checkpoint_reader: CheckpointReader | None = None
        self._kata_reader: KataConfigReader | None = None
        #: the last full observation's sandboxes by id (see observe)
        self._last: dict[str, SandboxObs] = {}
        #: (store, its version and the scope's reads, what was read): see _read_store
        self._store_memo: (
            tuple[
                Store,
                tuple[tuple[int, int], bool, bool],
                _Recorded,
                list[SandboxRec],
                _PolicyRecords,
            ]
            | None
        ) = None

    # -- kubelet ---------------------------------------------------------------------------
    def checkpoint(self) -> tuple[Checkpoint | None, str | None]:
        """kubelet's cpu_manager_state (re-read when it changes), and its error.

        A file kubelet would refuse is reported and the last good one is used
        (:class:`vmpin.runtimes.kubelet.CheckpointReader`).
        """
        from vmpin.runtimes.kubelet import CheckpointReader

        if self._checkpoint_reader is None:
            self._checkpoint_reader = CheckpointReader(self.paths.kubelet_state)
        try:
            return self._checkpoint_reader.read()
        except VmpinError as err:  # unreadable (permissions): the host's problem, not the file's
            return None, f"kubelet checkpoint {self.paths.kubelet_state}: {err}"

    # -- Kata --------------------------------------------------------------------------------
    def kata_configs(self, save: bool = True) -> KataConfigs:
        """Kata's configuration files as they say now (parsed again only when one changed;
        ``save``: the answer may be kept in the state dir for the next process)."""
        from vmpin.runtimes.kataconfig import KataConfigReader

        if self._kata_reader is None:
            self._kata_reader = KataConfigReader(
                self.paths.kata_config, self.paths.kata_config_cache
            )
        return self._kata_reader.read(save=save)

    # -- the node ----------------------------------------------------------------------------
    def observe(
        self, store: Store, scope: Scope = FULL, fresh: Container[str] | None = None
    ) -> Observation:
        """The node as the host and the store show it now (``scope``: see :class:`Scope`).

        ``fresh``: the sandboxes an event names (the agent's event passes).  Every other one
        whose records in the store, and whose policy, are what the last observation was made
        from is given as that observation, its host values unread: an event's pass then
        costs its sandboxes' reads, not the node's (issue 28: churn's round trips had grown
        with the node since passes went node-wide).  What the last pass wrote to the host
        is in it (:meth:`note_applied`); what changed behind vmpin's back is read by the next
        pass without ``fresh`` (the agent's periodic one)."""
        checkpoint, cp_error = self.checkpoint()
        kata = self.kata_configs(save=not store.readonly) if scope.vmms else None
        recorded, sandboxes, (oci, api) = self._read_store(store, scope, fresh is not None)
        originals = recorded.originals
        policies = PodPolicies(self.policy, oci, api)
        out: list[SandboxObs] = []
        seen: set[str] = set()
        # A sandbox observed as the last full pass saw it is given as that very object: the
        # new one goes at once (the last pass's observation is kept with its plan, and two
        # of them at once were the agent's RSS peak), and comparing the node with the last
        # one (Reconciler.plan) finds the same objects.
        last = self._last if scope is FULL else {}
        for rec in sandboxes:
            seen.add(rec.id)
            before = last.get(rec.id)
            if (
                fresh is not None
                and before is not None
                and rec.id not in fresh
                and self._unchanged(before, rec, recorded, policies)
            ):
                # (with the record as it is now: its generation is what apply marks done)
                out.append(before if before.record == rec else _replace(before, record=rec))
                continue
            try:
                found = self._sandbox(recorded, policies, rec, checkpoint, scope)
                before = last.get(rec.id)
                out.append(before if before is not None and before == found else found)
            except Exception as err:  # one sandbox's failure is an error on it, not the node's
                msg = f"observing it: unexpected {type(err).__name__}: {err}"
                out.append(
                    SandboxObs(rec.id, rec.runtime, self._policy(rec.id), rec, errors=(msg,))
                )
        for sid in self._vm_dir_ids(seen) if scope.vmms else ():
            before = last.get(sid)
            if fresh is not None and sid not in fresh and before is not None and not before.tracked:
                out.append(before)
            else:
                out.append(self._untracked(sid, originals, scope))
        if self.domains is not None:
            try:
                out.extend(self.domains.sandboxes(self._policy))
            except Exception as err:  # libvirt's failure is an error on it, not the node's
                msg = f"observing libvirt domains: unexpected {type(err).__name__}: {err}"
                out.append(SandboxObs("libvirt", "libvirt", self.policy, None, errors=(msg,)))
        if scope is FULL:
            self._last = {s.id: s for s in out}
        from vmpin.reconcile.allocations import recorded as allocations

        return Observation(
            tuple(out), checkpoint, cp_error, originals, scope, kata, allocations(store)
        )

    def observe_plain(self, store: Store, sandbox_id: str) -> Observation | None:
        """One plain (runc) sandbox alone, read through the store's indexes: for a pass that
        changes nothing but its cgroups (``Reconciler.reconcile_plain``), whose cost must not
        grow with the node (issue 26).  None when the sandbox is not a tracked runc one.

        Its plan is the node plan's for it (a runc container's desired set is its own or the
        shared pool, whatever the others do); the observation leaves every other sandbox out,
        so it is never to be planned for anything else, and it records no originals (apply
        then deletes none)."""
        rec = store.sandbox(sandbox_id)
        if rec is None or rec.runtime != "runc":
            return None
        checkpoint, cp_error = self.checkpoint()
        recorded = _Recorded({sandbox_id: store.containers(sandbox_id)}, {}, {}, {})
        # (a runc sandbox's plan takes nothing from its pod's policy)
        s = self._sandbox(recorded, PodPolicies(self.policy, {}, {}), rec, checkpoint)
        if s.runtime != "runc":
            return None  # it has a VM dir now: Kata's, planned with the node
        return Observation((s,), checkpoint, cp_error)

    def _unchanged(
        self, before: SandboxObs, rec: SandboxRec, recorded: _Recorded, policies: PodPolicies
    ) -> bool:
        """Whether ``before`` was observed from the records the store holds now, under the
        policy that applies now (see :meth:`observe`'s ``fresh``)."""
        was = before.record
        if was is None or before.errors or (rec.runtime, rec.pod_uid) != (was.runtime, was.pod_uid):
            return False
        # the VMM it was observed with: the one recorded then, or the one found then (which
        # the pass has recorded since); the generations are bookkeeping, not observation
        vmm = (rec.vmm_pid, rec.vmm_start)
        found = (before.vmm.pid, before.vmm.start) if before.vmm is not None else None
        if vmm != (was.vmm_pid, was.vmm_start) and vmm != found:
            return False
        recs = recorded.containers.get(rec.id, ())
        if len(recs) != len(before.containers) or any(
            c.rec != r for c, r in zip(before.containers, recs, strict=True)
        ):
            return False
        if rec.id in self.policy_for:
            return before.policy == self.policy_for[rec.id]
        r = policies.resolve(rec.id, rec.pod_uid)
        return (before.policy, before.policy_source, before.policy_at) == (r.policy, r.source, r.at)

    def note_applied(
        self, threads: Mapping[tuple[str, int], CpuSet], cgroups: Mapping[tuple[str, str], CpuSet]
    ) -> None:
        """What a pass wrote to the host and read back -- thread affinities by (sandbox, tid),
        cgroup cpusets by (sandbox, container) -- put into the last observation, which the
        next event's pass may give again (:meth:`observe`'s ``fresh``): it must not find the
        threads where they were before this pass moved them."""
        by_sandbox: dict[str, tuple[dict[int, CpuSet], dict[str, CpuSet]]] = {}
        for (sid, tid), cpus in threads.items():
            by_sandbox.setdefault(sid, ({}, {}))[0][tid] = cpus
        for (sid, cid), cpus in cgroups.items():
            by_sandbox.setdefault(sid, ({}, {}))[1][cid] = cpus
        for sid, (tids, cids) in by_sandbox.items():
            s = self._last.get(sid)
            if s is None:
                continue
            vmm = s.vmm
            if vmm is not None and tids:
                vmm = _replace(vmm, threads=tuple(
                    _replace(t, actual=tids[t.tid]) if t.tid in tids else t for t in vmm.threads
                ))  # fmt: skip
            containers = tuple(
                _replace(c, cgroup_cpus=cids[c.rec.id]) if c.rec.id in cids else c
                for c in s.containers
            )
            self._last[sid] = _replace(s, vmm=vmm, containers=containers)

    def _read_store(
        self, store: Store, scope: Scope, keep_last: bool = False
    ) -> tuple[_Recorded, list[SandboxRec], _PolicyRecords]:
        """The store's tables a pass reads, read again only when the store has changed
        (:meth:`Store.version`; an idle node's passes find it unchanged).  What is returned
        is only read, never changed, by the pass (the VMM-thread scan of ``vhost`` is the
        pass's own: a fresh :class:`_Recorded` each time)."""
        key = (store.version(), scope.vmms, scope.affinity)
        memo = self._store_memo
        if memo is None or memo[0] is not store or memo[1] != key:
            # The old tables go before the new are read; and so does the last observation:
            # with the store moved the node is planned anew anyway, and building a node's
            # observation while the last one is kept was the agent's RSS peak.
            memo = self._store_memo = None
            if not keep_last:
                self._last = {}
            memo = (
                store,
                key,
                _Recorded.read(store, scope),
                store.sandboxes(),
                store.policy_records(),
            )
            self._store_memo = memo
        _, _, rec, sandboxes, policies = memo
        fresh = _Recorded(rec.containers, rec.threads, rec.missing, rec.originals)
        return fresh, sandboxes, policies

    def _vm_dir_ids(self, tracked: Container[str] = ()) -> list[str]:
        """The sandbox dirs in the VM dir, but for ``tracked`` ones (observed from the store:
        not checked here, one stat per sandbox saved)."""
        from vmpin.core.errors import IdError
        from vmpin.core.ids import check_id

        try:
            names = sorted(os.listdir(self.paths.vm_dir))
        except OSError:
            return []
        out = []
        for n in names:
            if n in tracked:
                continue
            try:
                check_id(n, "VM dir entry")
            except IdError:
                continue  # not a sandbox dir vmpin could name
            if os.path.isdir(os.path.join(self.paths.vm_dir, n)):
                out.append(n)
        return out

    def _policy(self, sandbox_id: str) -> Policy:
        return self.policy_for.get(sandbox_id, self.policy)

    def _untracked(self, sid: str, originals: Mapping[str, str], scope: Scope) -> SandboxObs:
        """A VMM in the VM dir that vmpin does not manage: it floats, and it may need undo."""
        from vmpin.runtimes.vmm import find_vmm

        try:
            vmm = find_vmm(self.paths, sid, scan=False)
        except VmpinError as err:
            return SandboxObs(sid, "kata", self._policy(sid), None, errors=(str(err),))
        if vmm is None:
            return SandboxObs(sid, "kata", self._policy(sid), None, notes=("no VMM running",))
        scope = _claiming(scope)  # its threads are left alone: they hold where they run
        threads = (
            self._vmm_threads_plain(sid, vmm.pid, vmm.start, originals, scope.affinity)
            if scope.reads_threads(sid)
            else ()
        )
        return SandboxObs(
            sid,
            "kata",
            self._policy(sid),
            None,
            vmm=VmmObs(vmm.pid, vmm.start, threads),
            notes=("in the VM dir, not tracked by vmpin",),
        )

    def _sandbox(
        self,
        recorded: _Recorded,
        policies: PodPolicies,
        rec: SandboxRec,
        cp: Checkpoint | None,
        scope: Scope = FULL,
    ) -> SandboxObs:
        runtime = rec.runtime
        became_kata = False
        if runtime == "runc" and os.path.isdir(os.path.join(self.paths.vm_dir, rec.id)):
            # Recorded before its VM dir existed (hooks ran ahead of the VMM): it is Kata's.
            runtime, became_kata = "kata", True
        containers = tuple(
            self._container(c, runtime, cp) for c in recorded.containers.get(rec.id, ())
        )
        at: float | None = None
        if rec.id in self.policy_for:
            policy, source, problems = self.policy_for[rec.id], "node", tuple[str, ...]()
        else:
            r = policies.resolve(rec.id, rec.pod_uid)
            policy, source, problems, at = r.policy, r.source, tuple(r.problems), r.at
        if runtime != "kata" or not scope.vmms:
            return SandboxObs(
                rec.id, runtime, policy, rec, containers, became_kata=became_kata,
                policy_source=source, policy_problems=problems, policy_at=at,
            )  # fmt: skip
        if leaves_alone(True, policy):
            scope = _claiming(scope)
        try:
            vmm, gone, notes = self._vmm(recorded, rec, scope)
        except VmpinError as err:
            return SandboxObs(
                rec.id, runtime, policy, rec, containers, became_kata=became_kata,
                errors=(str(err),), policy_source=source, policy_problems=problems,
                policy_at=at,
            )  # fmt: skip
        return SandboxObs(
            rec.id, runtime, policy, rec, containers, vmm, gone, became_kata, tuple(notes),
            policy_source=source, policy_problems=problems, policy_at=at,
        )  # fmt: skip

    # -- containers ----------------------------------------------------------------------------
    def _container(self, c: ContainerRec, runtime: str, cp: Checkpoint | None) -> ContainerObs:
        kubelet = None
        if cp and c.pod_uid and (c.name or cp.by_container_id):
            from vmpin.runtimes.kubelet import cpus_for, is_infra

            # kubelet assigns CPUs to app and init containers only: the infra container has
            # no answer in the checkpoint (it is not "the shared pool")
            if not is_infra(c.is_sandbox, c.pod_uid, c.name):
                kubelet = cpus_for(cp, c.pod_uid, c.name, c.id)
        if runtime != "runc":
            return ContainerObs(c, kubelet_cpus=kubelet)
        from vmpin.linux import cgroups
        from vmpin.runtimes.runcstate import runc_cpus

        notes: list[str] = []
        try:
            runc = runc_cpus(self.paths, c.id)
        except VmpinError as err:
            return ContainerObs(c, kubelet_cpus=kubelet, error=f"runc state: {err}")
        alive = pid_alive(self.paths, c.pid, c.pid_start)
        ref = None
        try:
            if c.cgroup:
                ref = cgroups.ref_from_rel(self.paths, c.cgroup)
            if ref is None or not os.path.isdir(ref.path):
                # Follow the pid only while (pid, start time) proves it is still the
                # container's init: a reused pid belongs to a stranger, whose cgroup is not ours.
                pid = c.pid if alive is True and c.pid_start is not None else None
                if c.pid and pid is None:
                    notes.append(
                        f"pid {c.pid}: "
                        + ("no start time recorded, identity unproven" if alive else "gone")
                        + ": its cgroup is not followed"
                    )
                ref = cgroups.find_container_cgroup(self.paths, c.id, c.pod_uid, pid)
            if ref is None:
                return ContainerObs(c, alive, runc, kubelet, notes=tuple(notes))
            current = cgroups.read_cpus(ref)
            tasks = tuple(self._task(tid) for tid in cgroups.tasks(ref))
        except VmpinError as err:
            return ContainerObs(c, alive, runc, kubelet, ref, error=str(err), notes=tuple(notes))
        return ContainerObs(c, alive, runc, kubelet, ref, current, tasks, tuple(notes))

    def _task(self, tid: int) -> ThreadObs:
        try:
            return ThreadObs(
                tid,
                "container",
                actual=procfs.affinity(self.paths.proc, tid),
                name=procfs.comm(self.paths.proc, tid),
                layer="cgroup",
            )
        except ProcessGone:
            return ThreadObs(tid, "container", layer="cgroup")
        except HostError as err:
            return ThreadObs(tid, "container", layer="cgroup", error=str(err))

    # -- VMMs ----------------------------------------------------------------------------------
    def _vmm(
        self, recorded: _Recorded, rec: SandboxRec, scope: Scope = FULL
    ) -> tuple[VmmObs | None, bool, list[str]]:
        # (imported here, not with the module: a pass over runc containers needs none of it;
        # "from <module> import" names, since "from <package> import <module>" costs a
        # Python-level importlib call on every sandbox)
        from vmpin.runtimes.vmm import Vmm, find_vmm, still_running

        # The QEMU a pass classified before (its threads are remembered under its pid and
        # start time, taken from a checked command line) is recognised by two small reads:
        # the pidfile still names it and its start time is unchanged.  Anything else goes
        # through find_vmm: the pidfile, then the recorded pid, then a scan of /proc.
        vmm: Vmm | None = None
        if rec.vmm_pid and rec.vmm_start is not None:
            key = (rec.id, rec.vmm_pid, rec.vmm_start)
            if key in recorded.threads and still_running(
                self.paths, rec.id, rec.vmm_pid, rec.vmm_start
            ):
                vmm = Vmm(rec.vmm_pid, rec.vmm_start, (), False)  # (cmdline unread)
        if vmm is None:
            vmm = find_vmm(self.paths, rec.id, hint_pid=rec.vmm_pid, scan=True)
        if vmm is None:
            if rec.vmm_pid and rec.vmm_start is not None:
                return None, True, [f"VMM pid {rec.vmm_pid} is gone"]
            return None, False, ["no VMM found yet for this sandbox"]
        if not scope.reads_threads(rec.id):
            return VmmObs(vmm.pid, vmm.start), False, []  # located, its threads not read
        originals = recorded.originals
        affinity = scope.affinity
        at = VmmKey(rec.id, vmm.pid, vmm.start).orig_prefix()
        remembered = recorded.threads.get((rec.id, vmm.pid, vmm.start), {})
        try:
            current = set(procfs.tids(self.paths.proc, vmm.pid))
        except ProcessGone:
            return None, False, [f"VMM pid {vmm.pid} exited during the pass"]
        missing_before = recorded.missing.get(VmmKey(rec.id, vmm.pid, vmm.start).missing())
        if remembered and not missing_before and self._complete(remembered, current):
            # Fast path: the same threads as last time, their roles are known; no QMP.
            roles = list(remembered.values())
            threads = tuple(self._thread(vmm.pid, at, t, originals, affinity) for t in roles)
            layers = tuple(sorted({t.layer for t in roles}))
            return VmmObs(vmm.pid, vmm.start, threads, False, (), layers), False, []
        from vmpin.runtimes.threads import VmmThread, classify

        listed: set[int] | None = current  # (the task/ listing classify may take over)
        if not vmm.cmdline:
            # classifying reads the command line (iothread ids, debug-threads)
            was = (vmm.pid, vmm.start)
            vmm = find_vmm(self.paths, rec.id, hint_pid=rec.vmm_pid, scan=True)
            if vmm is None:
                return None, False, [f"VMM pid {rec.vmm_pid} exited during the pass"]
            if (vmm.pid, vmm.start) != was:
                listed = None  # another process: its threads are listed anew
            at = VmmKey(rec.id, vmm.pid, vmm.start).orig_prefix()
            remembered = recorded.threads.get((rec.id, vmm.pid, vmm.start), {})
        sock = os.path.join(self.paths.vm_dir, rec.id, "qmp.sock")
        if recorded.vhost is None:
            from vmpin.runtimes.threads import find_vhost_kthreads

            recorded.vhost = find_vhost_kthreads(self.paths)
        result = classify(
            self.paths,
            vmm,
            sock if os.path.exists(sock) else None,
            {t.tid: VmmThread(t.tid, t.role, t.idx, t.label, t.layer) for t in remembered.values()},
            qmp_timeout=self.qmp_timeout,
            vhost_kthreads=recorded.vhost,
            tids=listed,
        )
        threads = tuple(
            self._thread(
                vmm.pid, at, ThreadRec(t.tid, t.role, t.index, t.label, t.layer), originals,
                affinity,
            )
            for t in result.threads
        )  # fmt: skip
        obs = VmmObs(
            vmm.pid,
            vmm.start,
            threads,
            True,
            tuple(result.missing_vcpus),
            tuple(result.layers),
            tuple(result.notes),
            as_recorded=(
                missing_before == ",".join(map(str, result.missing_vcpus))
                and [ThreadRec(t.tid, t.role, t.index, t.label, t.layer) for t in result.threads]
                == list(remembered.values())
            ),
        )
        return obs, False, []

    def _complete(self, remembered: dict[int, ThreadRec], current: set[int]) -> bool:
        """The same threads as last time (vhost kthreads before Linux 6.4 live outside
        ``task/`` and must merely still exist)."""
        if remembered.keys() == current:
            return True
        outside = set(remembered) - current
        if set(remembered) - outside != current:
            return False
        return all(
            remembered[tid].role == "vhost"
            and os.path.exists(os.path.join(self.paths.proc, str(tid)))
            for tid in outside
        )

    def _thread(
        self,
        pid: int,
        orig_at: str,
        t: ThreadRec,
        originals: Mapping[str, str],
        affinity: bool = True,
    ) -> ThreadObs:
        """One thread of the VMM ``pid`` as it is now (``affinity`` False: its role only,
        nothing read); ``orig_at``: the VMM's :meth:`VmmKey.orig_prefix`."""
        if not affinity:
            return ThreadObs(t.tid, t.role, t.idx, t.label, t.layer, t.label)
        # vhost workers before Linux 6.4 are kernel threads of their own, not in task/
        owner = pid if t.role != "vhost" or procfs.exists(self.paths.proc, pid, t.tid) else t.tid
        # a thread created after vmpin's first pin inherited the pin: what the VMM had before
        # (its main thread's record) is what it is to get back
        orig_text = originals.get(f"{orig_at}{t.tid}") or originals.get(f"{orig_at}{pid}")
        original = _parse(orig_text) if orig_text else None
        try:
            actual = procfs.affinity(self.paths.proc, owner, t.tid)
            # a labelled thread is reported by its label: its comm is not read
            name = t.label or procfs.comm(self.paths.proc, owner, t.tid)
        except ProcessGone:
            return ThreadObs(t.tid, t.role, t.idx, t.label, t.layer, original=original)
        except HostError as err:
            return ThreadObs(
                t.tid, t.role, t.idx, t.label, t.layer, original=original, error=str(err)
            )
        return ThreadObs(t.tid, t.role, t.idx, t.label, t.layer, name, actual, original)

    def _vmm_threads_plain(
        self, sid: str, pid: int, start: int, originals: Mapping[str, str], affinity: bool = True
    ) -> tuple[ThreadObs, ...]:
        """An untracked VMM's threads, unclassified (vmpin plans nothing for them but undo)."""
        try:
            tids = procfs.tids(self.paths.proc, pid)
        except ProcessGone:
            return ()
        at = VmmKey(sid, pid, start).orig_prefix()
        return tuple(
            self._thread(pid, at, ThreadRec(tid, "emulator", None, None, ""), originals, affinity)
            for tid in tids
        )


_PARSED: dict[str, CpuSet] = {}


def _parse(text: str) -> CpuSet:
    """CpuSet.parse, remembered: a node's recorded affinities are few distinct texts, and a
    pass parses one per thread."""
    cpus = _PARSED.get(text)
    if cpus is None:
        if len(_PARSED) > 4096:
            _PARSED.clear()
        cpus = _PARSED[text] = CpuSet.parse(text)
    return cpus


def _replace(t: _T, **kw: object) -> _T:
    if TYPE_CHECKING:
        from dataclasses import replace
    else:
        from vmpin.core._lean import replace

    return replace(t, **kw)  # type: ignore[type-var]


__all__ = [
    "EMPTY",
    "FULL",
    "ContainerObs",
    "Observation",
    "Observer",
    "SandboxObs",
    "Scope",
    "ThreadObs",
    "VmmObs",
    "pid_alive",
]
