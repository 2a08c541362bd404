"""One sandbox as the host and the store show it now: its runtime, policy, containers and VMM.

:class:`SandboxObserver` owns the per-sandbox half of observing (:class:`.observe.Observer`
walks the node and hands it each sandbox): a tracked sandbox from its record (its runtime --
a "runc" one with a VM dir is Kata's --, the policy it is planned with, each container's
values, its VMM through :class:`.observe_vmm.VmmObserver`), a VMM in the VM dir vmpin does
not track, and whether a sandbox's last observation was made from what the store holds now.

A container's values: kubelet's CPUs for it (app and init containers only), and for a runc
one runc's own state value, its cgroup with the actual cpuset and each task's affinity.  Its
cgroup is looked up from its pid only while (pid, start time) proves the pid is still the
container's init: a pid without a recorded start time is not followed.

One bad object is an error *against that object* (a runc state.json that cannot be read, a
VMM whose QMP socket does not answer): it carries its ``error`` and the pass goes on.
Reading only: nothing here writes the store, a cgroup or an affinity.
"""

from __future__ import annotations

import os

from vmpin.core.errors import HostError, IdError, ProcessGone, VmpinError
from vmpin.core.ids import check_id
from vmpin.linux import procfs
from vmpin.reconcile.observation import (
    FULL,
    ContainerObs,
    SandboxObs,
    Scope,
    ThreadObs,
    VmmObs,
    claiming,
    leaves_alone,
    replace,
)
from vmpin.reconcile.observe_vmm import VmmObserver

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping
    from collections.abc import Set as AbstractSet

    from vmpin.core.planner import Policy
    from vmpin.linux.paths import HostPaths
    from vmpin.reconcile.observation import Recorded
    from vmpin.reconcile.podpolicies import PodPolicies
    from vmpin.runtimes.kubelet import Checkpoint
    from vmpin.state.records import ContainerRec, SandboxRec


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


class SandboxObserver:
    """Reads sandboxes one at a time; holds the node's policy and its per-sandbox overrides."""

    __slots__ = ("paths", "policy", "policy_for", "vmms")

    def __init__(
        self,
        paths: HostPaths,
        policy: Policy,
        policy_for: Mapping[str, Policy] | None = None,
        qmp_timeout: float = 0.3,
    ) -> None:
        self.paths = paths
        self.policy = policy
        #: per-sandbox policy overrides (per-pod policy plugs in here)
        self.policy_for = dict(policy_for or {})
        self.vmms = VmmObserver(paths, qmp_timeout)

    def policy_of(self, sandbox_id: str) -> Policy:
        return self.policy_for.get(sandbox_id, self.policy)

    # -- tracked sandboxes ---------------------------------------------------------------------
    def tracked(
        self,
        recorded: Recorded,
        policies: PodPolicies,
        rec: SandboxRec,
        cp: Checkpoint | None,
        scope: Scope = FULL,
        last: SandboxObs | None = None,
        reuse: bool = False,
    ) -> SandboxObs:
        """The sandbox of the record ``rec`` in a walk of the node: never raises (one
        sandbox's failure is an error on it, not the node's).

        ``last``: its last full observation, given again as that very object when the new
        one equals it (the last pass's observation is kept with its plan, two of them at
        once were the agent's RSS peak, and comparing the node with the last one --
        Reconciler.plan -- then finds the same objects).  ``reuse`` (an event's pass, for a
        sandbox no event names): ``last`` is given unread when it was observed from the
        records and under the policy of now (:meth:`.observe.Observer.observe`'s ``fresh``).
        """
        if reuse and last is not None and self._unchanged(last, rec, recorded, policies):
            # (with the record as it is now: its generation is what apply marks done)
            return last if last.record == rec else replace(last, record=rec)
        try:
            found = self.read(recorded, policies, rec, cp, scope)
            # (its record first: an event's sandbox has moved in it, and comparing that alone
            # costs a tenth of comparing every field)
            return last if last is not None and last.record == rec and last == found else found
        except Exception as err:  # one sandbox's failure is an error on it, not the node's
            msg = f"observing it: unexpected {type(err).__name__}: {err}"
            return SandboxObs(rec.id, rec.runtime, self.policy_of(rec.id), rec, errors=(msg,))

    def read(
        self,
        recorded: Recorded,
        policies: PodPolicies,
        rec: SandboxRec,
        cp: Checkpoint | None,
        scope: Scope = FULL,
    ) -> SandboxObs:
        """The sandbox of the record ``rec`` (its containers' records in ``recorded``), read
        now; what it does not expect, it raises."""
        runtime = rec.runtime
        became_kata = False
        if runtime == "runc" and os.path.isdir(os.path.join(self.paths.vm_dir, rec.id)):
            # Recorded before its VM dir existed (hooks ran ahead of the VMM): it is Kata's.
            runtime, became_kata = "kata", True
        containers = tuple(
            self.container(c, runtime, cp) for c in recorded.containers.get(rec.id, ())
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
            scope = claiming(scope)
        try:
            vmm, gone, notes = self.vmms.tracked(recorded, rec, scope)
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

    def _unchanged(
        self, before: SandboxObs, rec: SandboxRec, recorded: Recorded, policies: PodPolicies
    ) -> bool:
        """Whether ``before`` was observed from the records the store holds now, under the
        policy that applies now."""
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

    def still(self, s: SandboxObs, cp: Checkpoint | None) -> bool:
        """Whether :meth:`read` would find the tracked sandbox ``s`` again now, its records
        and policy as they were (the caller knows they are) and kubelet's checkpoint ``cp``
        the one it was observed with: what :meth:`read` takes from the host read again and
        compared -- whether a runc one has a VM dir now, each runc container's values (its
        cgroup's cpuset, its tasks), its VMM (:meth:`.observe_vmm.VmmObserver.still`).  A
        sandbox observed with an error is False: a pass finds what it is."""
        rec = s.record
        if rec is None or s.errors or s.runtime not in ("kata", "runc"):
            return False
        if rec.runtime == "runc":
            if os.path.isdir(os.path.join(self.paths.vm_dir, rec.id)) != s.became_kata:
                return False
            for c in s.containers if s.runtime == "runc" else ():
                if self.container(c.rec, "runc", cp) != c:
                    return False
        # (a Kata sandbox's containers: kubelet's CPUs from ``cp``, the host read for none)
        if s.runtime != "kata":
            return True
        if s.vmm is None:  # (its notes say so, from its record alone)
            return self.vmms.still(rec, None)
        return not s.notes and self.vmms.still(rec, s.vmm)

    # -- the VM dir's other sandboxes ----------------------------------------------------------
    def vm_dir_ids(
        self,
        tracked: AbstractSet[str] = frozenset(),
        listed: list[str] | None = None,
        known: Mapping[str, SandboxObs] | None = None,
    ) -> list[str]:
        """The sandbox dirs in the VM dir, in name order, but for ``tracked`` ones (observed
        from the store: not checked here, one stat per sandbox saved; told apart by one set
        difference, not a lookup per name: an event's pass lists the whole VM dir);
        ``listed``: the VM dir's names, sorted, as the caller listed them already
        (vmpin.linux.files.listing).

        ``known``: an earlier pass's observations by id; the untracked sandboxes among them
        were dirs of the VM dir then, and are taken as such without a stat.  An event's pass
        reuses those sandboxes' observations as the last pass made them; checking each name
        again cost it one stat per leftover dir (a shim that died leaves its dir), ~18 % of
        an event pass under churn with a few hundred."""
        if listed is not None:
            names = listed
        else:
            try:
                names = sorted(os.listdir(self.paths.vm_dir))
            except OSError:
                return []
        out = []
        for n in sorted(set(names).difference(tracked)):
            before = known.get(n) if known is not None else None
            if before is not None and not before.tracked:
                out.append(n)
                continue
            try:
                check_id(n, "VM dir entry")
            except IdError:
                continue  # not a sandbox dir vmpin could name
            if os.path.isdir(os.path.join(self.paths.vm_dir, n)):
                out.append(n)
        return out

    def untracked(self, sid: str, originals: Mapping[str, str], scope: Scope) -> SandboxObs:
        """A VMM in the VM dir that vmpin does not manage: it floats, and it may need undo."""
        from vmpin.runtimes.vmm import find_vmm

        try:
            vmm = find_vmm(self.paths, sid, scan=False)
        except VmpinError as err:
            return SandboxObs(sid, "kata", self.policy_of(sid), None, errors=(str(err),))
        if vmm is None:
            return SandboxObs(sid, "kata", self.policy_of(sid), None, notes=("no VMM running",))
        scope = claiming(scope)  # its threads are left alone: they hold where they run
        threads = (
            self.vmms.untracked_threads(sid, vmm.pid, vmm.start, originals, scope.affinity)
            if scope.reads_threads(sid)
            else ()
        )
        return SandboxObs(
            sid,
            "kata",
            self.policy_of(sid),
            None,
            vmm=VmmObs(vmm.pid, vmm.start, threads),
            notes=("in the VM dir, not tracked by vmpin",),
        )

    # -- containers ----------------------------------------------------------------------------
    def container(self, c: ContainerRec, runtime: str, cp: Checkpoint | None) -> ContainerObs:
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


__all__ = ["SandboxObserver", "pid_alive"]
