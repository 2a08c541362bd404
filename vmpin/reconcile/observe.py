"""Observe: host + store -> one immutable :class:`Observation` of the node, with no writes.

This module owns *reading the node*: every tracked sandbox and container (from the store),
every VMM found in the VM dir (tracked or not), each VMM's threads with their actual
affinity, each runc container's cgroup with its actual cpuset and tasks, runc's own state
value, kubelet's checkpoint (shared pool and exclusive assignments), and what vmpin recorded
before its first pin of a thread (for the undo of invariant 4).  Nothing here writes the
store, a cgroup or an affinity: ``vmpin show``/``audit``/... are built on it and must leave
``state.db`` untouched.

The work is in three rooms, each a step down from the last:

- :class:`Observer` (here): the node -- the store's tables (read again only when the store
  moved), kubelet's checkpoint, Kata's configuration, the last observation an event's pass
  may give again, libvirt's domains;
- :class:`.observe_sandbox.SandboxObserver`: one sandbox -- its runtime, policy and
  containers (runc state, cgroup, tasks, kubelet's CPUs);
- :class:`.observe_vmm.VmmObserver`: one VMM -- found, its threads' roles known (remembered
  or classified), their affinity read.

The values they make live in :mod:`.observation` and are importable from here too.

One bad object is an error *against that object*: a container whose runc state.json cannot
be read, a VMM whose QMP socket does not answer, a checkpoint that does not parse -- each
carries its ``error`` string and the pass goes on.
"""

from __future__ import annotations

from vmpin.core.cpuset import EMPTY, CpuSet
from vmpin.core.errors import VmpinError
from vmpin.core.planner import Policy
from vmpin.linux.paths import HostPaths
from vmpin.reconcile.observation import (
    FULL,
    MISSING_PREFIX,
    ORIG_PREFIX,
    ContainerObs,
    Observation,
    Recorded,
    SandboxObs,
    Scope,
    ThreadObs,
    VmmObs,
    leaves_alone,
    replace,
)
from vmpin.reconcile.observe_sandbox import SandboxObserver, pid_alive
from vmpin.reconcile.podpolicies import PodPolicies
from vmpin.reconcile.tables import Tables
from vmpin.state.records import SandboxRec

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Collection, Iterable, Mapping

    from vmpin.reconcile.sources import DomainSource
    from vmpin.runtimes.kataconfig import KataConfigReader, KataConfigs
    from vmpin.runtimes.kubelet import Checkpoint, CheckpointReader
    from vmpin.state.reader import Reader
    from vmpin.state.records import PolicyRecord

    #: the store's policy inputs: the specs' by sandbox id, the Kubernetes API's by pod uid
    _PolicyRecords = tuple[Mapping[str, PolicyRecord], Mapping[str, PolicyRecord]]


#: sandboxes an event's pass looks at again, past which it walks every record (_given)
GIVEN = 16


class Observer:
    """Reads the node, each sandbox through :attr:`sandboxes`.  Holds caches that only save
    work (checkpoint by mtime, the store's tables by version, the last observation)."""

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
        #: reads one sandbox at a time; holds the node's policy and per-sandbox overrides
        self.sandboxes = SandboxObserver(paths, policy, policy_for, qmp_timeout)
        self._checkpoint_reader: CheckpointReader | None = None
        self._kata_reader: KataConfigReader | None = None
        #: the last full observation's sandboxes by id (see observe)
        self._last: dict[str, SandboxObs] = {}
        #: the store's tables as the last pass read them (see _read_store)
        self._tables: Tables | None = None
        #: the tracked sandboxes of ``_last`` observed with an error (looked at again)
        self._bad: set[str] = set()
        #: what passes wrote to the host since the last full observation, by sandbox, not
        #: yet put into ``_last`` (:meth:`note_applied`)
        self._pins: dict[str, tuple[dict[int, CpuSet], dict[str, CpuSet]]] = {}

    @property
    def policy(self) -> Policy:
        """The node's policy (a pod's own, or an override, replaces it per sandbox)."""
        return self.sandboxes.policy

    # -- kubelet ---------------------------------------------------------------------------
    def checkpoint(self) -> tuple[Checkpoint | None, str | None]:
        """kubelet's cpu_manager_state (re-read when it changes), and its error.

        A file kubelet would refuse is reported and the last good one is used
        (:class:`vmpin.runtimes.kubelet.CheckpointReader`).
        """
        if self._checkpoint_reader is None:
            # (imported with the reader made: an import statement of a module loaded
            # already is ~9 k instructions under 3.11, a pass's each time, issue 28)
            from vmpin.runtimes.kubelet import CheckpointReader

            self._checkpoint_reader = CheckpointReader(self.paths.kubelet_state)
        try:
            return self._checkpoint_reader.read()
        except VmpinError as err:  # unreadable (permissions): the host's problem, not the file's
            return None, f"kubelet checkpoint {self.paths.kubelet_state}: {err}"

    # -- Kata --------------------------------------------------------------------------------
    def kata_configs(self, save: bool = True) -> KataConfigs:
        """Kata's configuration files as they say now (parsed again only when one changed;
        ``save``: the answer may be kept in the state dir for the next process)."""
        if self._kata_reader is None:
            from vmpin.runtimes.kataconfig import KataConfigReader  # (see checkpoint)

            self._kata_reader = KataConfigReader(
                self.paths.kata_config, self.paths.kata_config_cache
            )
        return self._kata_reader.read(save=save)

    # -- the node ----------------------------------------------------------------------------
    def observe(
        self,
        store: Reader,
        scope: Scope = FULL,
        fresh: Collection[str] | None = None,
        vm_dir: list[str] | None = None,
        read: tuple[Checkpoint | None, str | None] | None = None,
    ) -> Observation:
        """The node as the host and the store show it now (``scope``: see :class:`Scope`).

        ``fresh``: the sandboxes an event names (the agent's event passes).  Every other one
        whose records in the store, and whose policy, are what the last observation was made
        from is given as that observation, its host values unread: an event's pass then
        costs its sandboxes' reads, not the node's (issue 28: churn's round trips had grown
        with the node since passes went node-wide).  What the last pass wrote to the host
        is in it (:meth:`note_applied`); what changed behind vmpin's back is read by the next
        pass without ``fresh`` (the agent's periodic one).  ``vm_dir``: an event's pass's
        listing of the VM dir, taken for its node summary just before (a VMM that comes
        after it is found by the next pass, as one that comes after the observation is).
        ``read``: :meth:`checkpoint` as the pass read it just before (it settled the
        allocations with it)."""
        checkpoint, cp_error = self.checkpoint() if read is None else read
        kata = self.kata_configs(save=not store.readonly) if scope.vmms else None
        recorded, records, (oci, api), moved = self._read_store(store, scope, fresh is not None)
        recorded.kthreads = fresh is None and scope is FULL
        if scope is FULL and self._pins:
            self._pinned(fresh)
        originals = recorded.originals
        sandboxes = self.sandboxes
        policies = PodPolicies(sandboxes.policy, oci, api)
        # (a sandbox observed as the last full pass saw it is given as that very object:
        # SandboxObserver.tracked)
        last = self._last if scope is FULL else {}
        ids = [rec.id for rec in records]
        given = None
        if fresh is not None and moved is not None and scope is FULL:
            given = self._given(ids, fresh, moved)
        if given is None:
            out: list[SandboxObs] = []
            walk: Iterable[int] = range(len(records))
        else:
            out, walk = given
        for i in walk:
            rec = records[i]
            reuse = fresh is not None and rec.id not in fresh
            before = last.get(rec.id)
            if (
                reuse and moved is not None and rec.id not in moved
                and before is not None and not before.errors
            ):  # fmt: skip
                # not one of its records has been written since the last pass read them
                # (the store's change log, .tables): that pass's observation stands as it is
                if given is None:
                    out.append(before)
                continue
            s = sandboxes.tracked(recorded, policies, rec, checkpoint, scope, before, reuse)
            if given is None:
                out.append(s)
            else:
                out[i] = s
        if scope is FULL:
            self._bad = {s.id for s in out if s.errors} if given is None else (
                (self._bad - {records[i].id for i in walk})
                | {out[i].id for i in walk if out[i].errors}
            )  # fmt: skip
        seen = set(ids)
        listed, known = (vm_dir, last) if fresh is not None else (None, None)
        for sid in sandboxes.vm_dir_ids(seen, listed, known) if scope.vmms else ():
            before = last.get(sid)
            if fresh is not None and sid not in fresh and before is not None and not before.tracked:
                out.append(before)
            else:
                out.append(sandboxes.untracked(sid, originals, scope))
        if self.domains is not None:
            try:
                out.extend(self.domains.sandboxes(sandboxes.policy_of))
            except Exception as err:  # libvirt's failure is an error on it, not the node's
                msg = f"observing libvirt domains: unexpected {type(err).__name__}: {err}"
                out.append(SandboxObs("libvirt", "libvirt", sandboxes.policy, None, errors=(msg,)))
        if scope is FULL:
            ids.extend(s.id for s in out[len(ids) :])
            self._last = dict(zip(ids, out, strict=True))
        from vmpin.reconcile.allocations import recorded as allocations

        return Observation(
            tuple(out), checkpoint, cp_error, originals, scope, kata, allocations(store)
        )

    def _given(
        self, ids: list[str], fresh: Collection[str], moved: Collection[str]
    ) -> tuple[list[SandboxObs], list[int]] | None:
        """An event's pass: each record's last observation (the sandboxes ``ids``, in their
        order), and the places of those to look at again -- the ones ``fresh`` names, those
        whose records moved (``moved``), those last observed with an error; None when one
        has no last observation or too many are to be looked at (the walk of every record
        then).  Lookups and scans in C: that walk was ~0.7 us a sandbox of every event's
        pass (issue 28)."""
        last = self._last
        # (not ``None in out``: that compares every observation with None, field by field)
        if not last.keys() >= set(ids):
            return None
        again = {*fresh, *moved, *self._bad}
        if len(again) > GIVEN:
            return None
        return list(map(last.__getitem__, ids)), sorted(
            ids.index(sid) for sid in again if sid in last and sid in ids
        )

    def still(self, obs: Observation) -> bool:
        """Whether :meth:`observe` would give ``obs`` again now, if the store holds what it
        held when ``obs`` was made (the caller's to know: the agent's views ask the store's
        ``data_version``).  What the host can change behind vmpin's back -- kubelet's
        checkpoint, Kata's configuration, the VM dir's entries, each VMM still the recorded
        process with the same threads, each thread's affinity and name, each runc cgroup's
        cpuset and tasks -- is read again and compared in place, stopping at the first
        difference; a VMM's threads build nothing, so it costs less than the reads of a pass
        (:meth:`.observe_vmm.VmmObserver.still`); and vhost kernel threads, where the kernel
        can have them, all among their VMMs' threads.

        For ``vmpin audit`` through the agent (vmpin.service.agent_views): True means a pass
        now would observe what its last pass did, so plan it alike (``plan_node`` is a
        function of its inputs) and find the same violations.  Whatever this does not read
        makes it False (libvirt's domains, a scope narrower than a pass's, a sandbox
        observed with an error, a VMM classified afresh): a pass then observes.  Only for an
        observer of its own: it holds none of the pass's state, but its readers' caches
        (checkpoint, Kata's files) are not to be shared between threads."""
        if obs.scope != FULL or self.domains is not None:
            return False
        if self.checkpoint() != (obs.checkpoint, obs.checkpoint_error):
            return False
        if obs.kata is None or self.kata_configs(save=False) != obs.kata:
            return False
        sandboxes = self.sandboxes
        tracked = [s for s in obs.sandboxes if s.record is not None]
        others = obs.sandboxes[len(tracked) :]  # (observe lists the tracked ones first)
        if sandboxes.vm_dir_ids({s.id for s in tracked}) != [s.id for s in others]:
            return False  # (a libvirt domain is listed here too: never with self.domains None)
        cp = obs.checkpoint
        if not all(sandboxes.still(s, cp) for s in tracked):
            return False
        # (a vhost kernel thread come since, which observe would classify: _new_kthreads)
        if not sandboxes.vmms.kthreads_known([s.vmm for s in tracked if s.vmm is not None]):
            return False
        return all(sandboxes.untracked(s.id, obs.originals, FULL) == s for s in others)

    def observe_plain(self, store: Reader, sandbox_id: str) -> Observation | None:
        """One plain (runc) sandbox alone, read through the store's indexes: for a pass that
        changes nothing but its cgroups (``reconciler.reconcile_plain``), whose cost must not
        grow with the node (issue 26).  None when the sandbox is not a tracked runc one.

        Its plan is the node plan's for it (a runc container's desired set is its own or the
        shared pool, whatever the others do); the observation leaves every other sandbox out,
        so it is never to be planned for anything else, and it records no originals (apply
        then deletes none)."""
        rec = store.sandbox(sandbox_id)
        if rec is None or rec.runtime != "runc":
            return None
        checkpoint, cp_error = self.checkpoint()
        recorded = Recorded({sandbox_id: store.containers(sandbox_id)}, {}, {}, {})
        # (a runc sandbox's plan takes nothing from its pod's policy)
        policies = PodPolicies(self.sandboxes.policy, {}, {})
        s = self.sandboxes.read(recorded, policies, rec, checkpoint)
        if s.runtime != "runc":
            return None  # it has a VM dir now: Kata's, planned with the node
        return Observation((s,), checkpoint, cp_error)

    def note_applied(
        self,
        threads: Mapping[str, Mapping[int, CpuSet]],
        cgroups: Mapping[str, Mapping[str, CpuSet]],
    ) -> None:
        """What a pass wrote to the host and read back -- thread affinities by sandbox and
        tid, cgroup cpusets by sandbox and container -- put into the last observation, which
        the next event's pass may give again (:meth:`observe`'s ``fresh``): it must not find
        the threads where they were before this pass moved them (:meth:`_pinned` puts them
        there)."""
        pins = self._pins
        for sid in threads.keys() | cgroups.keys():
            tids, cids = pins.setdefault(sid, ({}, {}))
            tids.update(threads.get(sid, {}))
            cids.update(cgroups.get(sid, {}))

    def _pinned(self, fresh: Collection[str] | None) -> None:
        """What passes wrote (:meth:`note_applied`) put into the last observation, before a
        full observation gives it again or compares with it -- put there only now, and not
        at all for a sandbox this observation reads afresh for an event (``fresh``): its
        last observation then only stands in for a new one equal to it, which the sandbox's
        records, moved by the event, hardly let it be.  (Each thread of an event's VM built
        anew at every event, to be dropped by the next one: ~8 % of an event's pass over
        a 37-thread VM, issue 28.)"""
        pins, self._pins = self._pins, {}
        for sid, (tids, cids) in pins.items():
            if fresh is not None and sid in fresh:
                continue
            s = self._last.get(sid)
            if s is None:
                continue
            vmm = s.vmm
            if vmm is not None and tids:
                vmm = replace(vmm, threads=tuple(
                    t.pinned(tids[t.tid]) if t.tid in tids else t for t in vmm.threads
                ))  # fmt: skip
            containers = tuple(
                replace(c, cgroup_cpus=cids[c.rec.id]) if c.rec.id in cids else c
                for c in s.containers
            ) if cids else s.containers  # (a VM's: its threads alone were pinned)
            self._last[sid] = replace(s, vmm=vmm, containers=containers)

    def _read_store(
        self, store: Reader, scope: Scope, keep_last: bool = False
    ) -> tuple[Recorded, list[SandboxRec], _PolicyRecords, Collection[str] | None]:
        """The store's tables a pass reads: as the last pass read them while the store has
        not moved (:meth:`Reader.version`; an idle node's passes find it unchanged), else
        brought up to date through the store's change log, a sandbox at a time
        (:mod:`.tables`), or read whole.  What is returned is only read, never changed, by
        the pass; and the sandboxes whose records may have moved since the last call (None:
        any of them)."""
        version = store.version()
        tables = self._tables
        if tables is not None and tables.matches(store, scope) and tables.version == version:
            return (*tables.current(), ())
        if not keep_last:
            # with the store moved the node is planned anew anyway, and building a node's
            # observation while the last one is kept was the agent's RSS peak
            self._last = {}
        if tables is None or not tables.matches(store, scope) or not tables.follow(version):
            # (the old tables go before the new are read)
            self._tables = None
            self._tables = tables = Tables(store, scope)
        return (*tables.current(), tables.moved)


__all__ = [
    "EMPTY",
    "FULL",
    "MISSING_PREFIX",
    "ORIG_PREFIX",
    "ContainerObs",
    "Observation",
    "Observer",
    "SandboxObs",
    "Scope",
    "ThreadObs",
    "VmmObs",
    "leaves_alone",
    "pid_alive",
]
