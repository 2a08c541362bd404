"""The one reconciler: desired state from the store, actual state from the host, repair the diff.

Every entry point goes through here: the hook (one sandbox), ``vmpin update`` (one sandbox),
``vmpin reconcile --once`` and ``vmpin audit`` (all), and the agent (dirty ones, then all,
periodically).  It is level-triggered: a pass re-reads everything it needs, plans from the
full desired state, and writes only where desired and actual differ, so running it twice is
harmless and running it after a crash repairs whatever the crash interrupted.

One pass over a sandbox:

1. *Refresh the desired state* from the sources that change behind vmpin's back: runc's own
   state (``runc update`` rewrites it, and fires no hook) and kubelet's checkpoint.  A source
   is adopted when *its* value changes from what vmpin last saw there, so a ``vmpin update``
   is not undone by a runtime that never heard of it, and a hand-edit of a cgroup (which
   changes no source) is drift to repair.
2. *Forget the vanished*: a runc container whose init process (pid + start time) is gone, a
   Kata sandbox whose QEMU is gone.
3. *Plan*: Kata sandboxes through :mod:`vmpin.core.planner`; runc containers get their own CPU set
   on their cgroup.
4. *Apply and verify*: sched_setaffinity per thread (or cpuset.cpus per cgroup), then read
   back.  A thread that exits mid-pass is skipped; EPERM/EINVAL are reported on that thread.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

from vmpin.core.cpuset import EMPTY, CpuSet
from vmpin.core.errors import HostError, ProcessGone, VmpinError
from vmpin.linux import procfs
from vmpin.linux.affinity import SchedAffinity
from vmpin.linux.paths import HostPaths
from vmpin.state.store import ContainerRec, SandboxRec, Store, ThreadRec

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.core._lean)

if TYPE_CHECKING:
    from typing import Any

    from vmpin.core.planner import Plan, Policy
    from vmpin.core.topology import Topology
    from vmpin.linux.affinity import AffinityBackend


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
        return {
            "tid": self.tid,
            "role": self.role,
            "index": self.index,
            "name": self.name,
            "desired": None if self.desired is None else self.desired.to_list(),
            "actual": None if self.actual is None else self.actual.to_list(),
            "layer": self.layer,
            "container": self.container,
            "action": self.action,
            "error": self.error,
        }


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

    @property
    def changed(self) -> int:
        return sum(1 for t in self.threads if t.action == "pinned")


def _pid_alive(paths: HostPaths, pid: int | None, start: int | None) -> bool | None:
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


class Reconciler:
    def __init__(
        self,
        paths: HostPaths,
        store: Store | None = None,
        *,
        policy: Policy | Callable[[], Policy] | None = None,
        affinity: AffinityBackend | None = None,
        topology: Topology | None = None,
        qmp_timeout: float = 0.3,
        float_policy: str = "all",
        publish: bool = True,
    ) -> None:
        self.paths = paths
        self.store = store if store is not None else Store(paths.state_dir)
        # A factory is resolved on first use: plain containers never need a Policy, and the
        # planner it lives in is not worth importing on the hook's runc path.
        self._policy = policy
        self.affinity: AffinityBackend = affinity or SchedAffinity()
        self._topology = topology
        self.qmp_timeout = qmp_timeout
        self.float_policy = float_policy
        self.publish = publish
        self._checkpoint_cache: tuple[int, Any] | None = None
        #: (the store's cpu_masks() mapping, how many masks hold each CPU)
        self._holders: tuple[Mapping[str, CpuSet], dict[int, int]] | None = None

    # -- inputs --------------------------------------------------------------------------
    @property
    def policy(self) -> Policy:
        from vmpin.core.planner import Policy

        if not isinstance(self._policy, Policy):
            self._policy = self._policy() if self._policy is not None else Policy()
        return self._policy

    @property
    def topology(self) -> Topology:
        if self._topology is None:
            from vmpin.linux.sysfs import read_topology

            self._topology = read_topology(self.paths.sys)
        return self._topology

    def checkpoint(self) -> Any:
        """kubelet's cpu_manager_state, re-read only when its mtime changes."""
        try:
            mtime = os.stat(self.paths.kubelet_state).st_mtime_ns
        except OSError:
            self._checkpoint_cache = None
            return None
        from vmpin.runtimes.kubelet import read_checkpoint

        if self._checkpoint_cache is None or self._checkpoint_cache[0] != mtime:
            self._checkpoint_cache = (mtime, read_checkpoint(self.paths.kubelet_state))
        return self._checkpoint_cache[1]

    def shared_pool(self) -> CpuSet | None:
        cp = self.checkpoint()
        if cp is None or cp.policy != "static" or not cp.default:
            return None
        pool: CpuSet = cp.default
        return pool

    # -- step 1: refresh desired state from runtimes and kubelet ----------------------------
    def refresh_container(self, rec: ContainerRec, runtime: str) -> ContainerRec | None:
        """Adopt changes made behind vmpin's back; None when the container is gone."""
        if runtime == "runc":
            from vmpin.runtimes.runcstate import runc_cpus

            seen = runc_cpus(self.paths, rec.id)
            alive = _pid_alive(self.paths, rec.pid, rec.pid_start)
            if alive is False and seen is None:
                self.store.delete_container(rec.id)
                return None
            if seen is not None:
                want = CpuSet.parse(seen) if seen else None
                rec = self._adopt(rec, "runc", "runtime_seen", seen, want)
        cp = self.checkpoint() if rec.pod_uid and rec.name else None
        if cp is not None and rec.pod_uid and rec.name:
            from vmpin.runtimes.kubelet import cpus_for

            want = cpus_for(cp, rec.pod_uid, rec.name)
            if want is not None:
                rec = self._adopt(rec, "kubelet", "kubelet_seen", want.to_list(), want)
        return rec

    def _adopt(
        self,
        rec: ContainerRec,
        source: str,
        column: str,
        seen: str,
        want: CpuSet | None,
    ) -> ContainerRec:
        """Adopt a source's value when it changed since vmpin last looked there.

        Before the first look, what the source "last said" is taken to be the spec the
        container was created with -- unless vmpin has been told otherwise since (an update),
        in which case a source still holding an older value is not news.
        """
        stored: str | None = rec._asdict()[column]
        last = stored
        if last is None:
            if rec.cpus_source == "spec":
                last = "" if rec.cpus is None else rec.cpus.to_list()
            else:
                last = seen
        if seen == last:
            if stored != seen:  # first look: remember it
                self.store.note_seen(rec.id, **{column: seen})
                rec = (
                    rec._replace(runtime_seen=seen)
                    if column == "runtime_seen"
                    else rec._replace(kubelet_seen=seen)
                )
            return rec
        return self.store.set_container_cpus(rec.id, want, source, **{column: seen})

    # -- the pass ------------------------------------------------------------------------
    def reconcile(
        self, sandbox_ids: list[str] | None = None, *, apply: bool = True
    ) -> list[SandboxReport]:
        self.store.ingest()  # events the hooks journaled since this store was opened
        sandboxes = {s.id: s for s in self.store.sandboxes()}
        wanted = sorted(sandboxes) if sandbox_ids is None else sandbox_ids
        reports = []
        for sid in wanted:
            rec = sandboxes.get(sid) or self.store.sandbox(sid)
            if rec is None:
                continue
            reports.append(self.reconcile_sandbox(rec, apply=apply))
        return reports

    def reconcile_sandbox(self, rec: SandboxRec, *, apply: bool = True) -> SandboxReport:
        if rec.runtime == "runc" and os.path.isdir(os.path.join(self.paths.vm_dir, rec.id)):
            # Recorded before its VM dir existed (hooks ran ahead of the VMM): it is Kata's.
            self.store.put_sandbox(rec._replace(runtime="kata"))
            rec = self.store.sandbox(rec.id) or rec
        gen = rec.gen
        # a vmm_pid without a start time is an unverified hint from a hook, not a VMM
        verified = rec.vmm_pid if rec.vmm_start is not None else None
        report = SandboxReport(rec.id, rec.runtime, verified)
        containers = []
        for c in self.store.containers(rec.id):
            refreshed = self.refresh_container(c, rec.runtime)
            if refreshed is not None:
                containers.append(refreshed)
        report.containers = containers
        if not containers and self.store.sandbox(rec.id) is None:
            report.vanished = True
            return report
        report.mask = CpuSet.union_all(c.cpus for c in containers if c.cpus is not None)
        try:
            if rec.runtime == "kata":
                self._kata(rec, containers, report, apply)
            else:
                self._runc(rec, containers, report, apply)
        except VmpinError as err:
            report.errors.append(str(err))
        if apply and not report.vanished and gen > rec.done_gen:
            # (an idle sandbox is already done at gen: skipping the no-op write keeps the
            # store's cpu_masks() cache valid across a periodic pass)
            self.store.mark_done(rec.id, gen)
        return report

    # -- runc: the container's own cgroup ------------------------------------------------------
    def _runc(
        self, rec: SandboxRec, containers: list[ContainerRec], report: SandboxReport, apply: bool
    ) -> None:
        from vmpin.linux import cgroups

        pool = None
        report.mode = "cgroup"
        for c in containers:
            desired = c.cpus
            if desired is None:
                pool = pool if pool is not None else (self.shared_pool() or EMPTY)
                desired = pool or None
            ref = None
            if c.cgroup:
                ref = cgroups.ref_from_rel(self.paths, c.cgroup)
            if ref is None or not os.path.isdir(ref.path):
                ref = cgroups.find_container_cgroup(self.paths, c.id, c.pod_uid, c.pid)
                if ref is not None and ref.rel != c.cgroup:
                    self.store.note_seen(c.id, cgroup=ref.rel)
            if ref is None:
                if not c.is_sandbox or desired is not None:
                    report.notes.append(f"container {c.id}: no cgroup found")
                continue
            if desired is not None:
                try:
                    current = cgroups.read_cpus(ref)
                    if current != desired:
                        drift: dict[str, Any] = {
                            "container": c.id,
                            "cgroup": ref.path,
                            "desired": desired.to_list(),
                            "actual": current.to_list(),
                        }
                        if apply:
                            cgroups.write_cpus(ref, desired)
                            drift["repaired"] = cgroups.read_cpus(ref) == desired
                        report.cgroup_drift.append(drift)
                except VmpinError as err:
                    report.errors.append(f"container {c.id}: {err}")
            try:
                tasks = cgroups.tasks(ref)
            except VmpinError as err:
                report.errors.append(f"container {c.id}: {err}")
                continue
            for tid in tasks:
                report.threads.append(self._observe_task(tid, c, desired))

    def _observe_task(self, tid: int, c: ContainerRec, desired: CpuSet | None) -> ThreadReport:
        try:
            actual: CpuSet | None = procfs.cpus_allowed(self.paths.proc, tid)
            name: str | None = procfs.comm(self.paths.proc, tid)
            action = "ok" if desired is not None else "unmanaged"
        except ProcessGone:
            actual, name, action = None, None, "gone"
        t = ThreadReport(tid, "container", None, name, desired, actual, "cgroup", c.id, action)
        if t.violates():
            t.action = "drift"
        return t

    # -- kata: the VMM's threads ---------------------------------------------------------------
    def _kata(
        self, rec: SandboxRec, containers: list[ContainerRec], report: SandboxReport, apply: bool
    ) -> None:
        from vmpin.core.planner import Thread, plan_sandbox
        from vmpin.runtimes import vmm as vmm_mod
        from vmpin.runtimes.threads import VmmThread, classify

        vmm = None
        if rec.vmm_pid and rec.vmm_start is not None:
            candidate = vmm_mod.Vmm(rec.vmm_pid, rec.vmm_start, (), False)
            if vmm_mod.is_same(self.paths, candidate, rec.id):
                vmm = vmm_mod.find_vmm(self.paths, rec.id, hint_pid=rec.vmm_pid, scan=False)
        if vmm is None:
            vmm = vmm_mod.find_vmm(self.paths, rec.id, hint_pid=rec.vmm_pid, scan=True)
            if vmm is None:
                if rec.vmm_pid and rec.vmm_start is not None:
                    # It had a VMM, and it is gone: the sandbox went away without a poststop.
                    self.store.delete_sandbox(rec.id)
                    report.vanished = True
                    report.notes.append(f"VMM pid {rec.vmm_pid} is gone: sandbox forgotten")
                else:
                    report.notes.append("no VMM found yet for this sandbox")
                return
            self.store.set_vmm(rec.id, vmm.pid, vmm.start)
        report.vmm_pid = vmm.pid

        remembered = self.store.threads(rec.id, vmm.pid, vmm.start)
        try:
            current = set(procfs.tids(self.paths.proc, vmm.pid))
        except ProcessGone:
            report.notes.append(f"VMM pid {vmm.pid} exited during the pass")
            return
        if self._remembered_is_complete(rec.id, vmm.pid, vmm.start, remembered, current):
            # Fast path: the same threads as last time, their roles are known; no QMP.
            threads = [Thread(t.tid, t.role, t.idx, t.label) for t in remembered.values()]
            layers = {t.tid: t.layer for t in remembered.values()}
            report.layers = sorted({t.layer for t in remembered.values()})
        else:
            sock = os.path.join(self.paths.vm_dir, rec.id, "qmp.sock")
            result = classify(
                self.paths,
                vmm,
                sock if os.path.exists(sock) else None,
                {
                    t.tid: VmmThread(t.tid, t.role, t.idx, t.label, t.layer)
                    for t in remembered.values()
                },
                qmp_timeout=self.qmp_timeout,
            )
            threads = [Thread(t.tid, t.role, t.index, t.label) for t in result.threads]
            layers = {t.tid: t.layer for t in result.threads}
            report.layers = list(result.layers)
            report.notes.extend(result.notes)
            self.store.save_threads(
                rec.id,
                vmm.pid,
                vmm.start,
                [ThreadRec(t.tid, t.role, t.index, t.label, t.layer) for t in result.threads],
            )
            self.store.set_meta(
                _missing_key(rec.id, vmm.pid, vmm.start),
                ",".join(map(str, result.missing_vcpus)),
            )

        others, others_excl = self._others(rec.id)
        plan = plan_sandbox(
            self.topology,
            rec.id,
            report.mask,
            threads,
            self.policy,
            others=others,
            others_exclusive=others_excl,
            shared_pool=self.shared_pool(),
        )
        report.plan = plan
        report.mode, report.reason = plan.mode, plan.reason
        report.notes.extend(plan.notes)
        for p in plan.placements:
            report.threads.append(
                self._apply_thread(
                    vmm.pid,
                    p.tid,
                    p.role,
                    p.idx,
                    p.label,
                    p.desired,
                    layers.get(p.tid, ""),
                    apply,
                )
            )
        report.guest_map = self._guest_map(plan, containers)
        if apply and self.publish and report.guest_map is not None:
            self._publish(rec.id, report.guest_map)

    def _remembered_is_complete(
        self, sid: str, pid: int, start: int, remembered: dict[int, ThreadRec], current: set[int]
    ) -> bool:
        """May this pass reuse the last classification instead of classifying again?

        Only when the VMM has exactly the threads it had (vhost workers that are kernel
        threads, before Linux 6.4, live outside ``task/`` and must merely still exist) and the
        last pass accounted for every vCPU: a vCPU missed then (busy in the guest, never seen
        in KVM_RUN) must be looked for again, not frozen as "emulator".
        """
        if not remembered:
            return False
        outside = set(remembered) - current
        if set(remembered) - outside != current:
            return False
        for tid in outside:
            if remembered[tid].role != "vhost" or not os.path.exists(
                os.path.join(self.paths.proc, str(tid))
            ):
                return False
        return not self.store.meta(_missing_key(sid, pid, start))

    def _others(self, sandbox_id: str) -> tuple[CpuSet, CpuSet]:
        """Other sandboxes' CPUs, and those of them exclusive to one other sandbox.

        Same result as ``planner.exclusive_cpus`` over every mask, in O(sandboxes) rather
        than O(sandboxes^2) per call: a CPU is exclusive to some other sandbox when exactly
        one mask holds it, that mask is not ours, and it is not in the shared pool.
        """
        masks = self.store.cpu_masks()
        if self._holders is None or self._holders[0] is not masks:
            count: dict[int, int] = {}
            for mask in masks.values():
                for cpu in mask:
                    count[cpu] = count.get(cpu, 0) + 1
            self._holders = (masks, count)  # valid while the store hands out the same masks
        holders = self._holders[1]
        mine = masks.get(sandbox_id, EMPTY)
        others = CpuSet({c for c, n in holders.items() if n - (c in mine) > 0})
        others_excl = CpuSet({c for c, n in holders.items() if n == 1 and c not in mine})
        return others, others_excl - (self.shared_pool() or EMPTY)

    def _apply_thread(
        self,
        pid: int,
        tid: int,
        role: str,
        index: int | None,
        label: str | None,
        desired: CpuSet | None,
        layer: str,
        apply: bool,
    ) -> ThreadReport:
        t = ThreadReport(tid, role, index, label, desired, None, layer)
        # vhost workers before Linux 6.4 are kernel threads of their own, not in task/
        owner = pid if role != "vhost" or procfs.exists(self.paths.proc, pid, tid) else tid
        try:
            t.actual = procfs.cpus_allowed(self.paths.proc, owner, tid)
            if t.name is None:
                t.name = procfs.comm(self.paths.proc, owner, tid)
        except ProcessGone:
            t.action = "gone"
            return t
        if desired is None:
            t.action = "unmanaged"
            return t
        if t.actual == desired:
            return t
        if not apply:
            t.action = "drift"
            return t
        try:
            t.actual = self.affinity.set(tid, desired)
            t.action = "pinned" if t.actual == desired else "error"
            if t.action == "error":
                t.error = f"kernel holds {t.actual} after setting {desired}"
        except ProcessGone:
            t.action = "gone"
        except HostError as err:
            t.action, t.error = "error", str(err)
        return t

    def _guest_map(self, plan: Plan, containers: list[ContainerRec]) -> dict[str, Any] | None:
        from vmpin.core.guestmap import map_sandbox

        ctrs = {c.id: c.cpus for c in containers if not c.is_sandbox or c.cpus is not None}
        return map_sandbox(plan, ctrs, self.topology, self.float_policy)

    def _publish(self, sandbox_id: str, guest_map: dict[str, Any]) -> None:
        try:
            from vmpin.runtimes.publish import publish_map
        except ImportError:
            return
        publish_map(self.paths, sandbox_id, guest_map)

    # -- audit -----------------------------------------------------------------------------
    def audit(self) -> dict[str, Any]:
        from vmpin.core.planner import exclusive_cpus

        reports = self.reconcile(apply=False)
        violations: list[dict[str, Any]] = []
        masks = {r.id: r.mask for r in reports if r.mask}
        excl = exclusive_cpus(masks, self.shared_pool())
        for r in reports:
            for t in r.threads:
                if t.violates():
                    violations.append(_violation(r.id, t, "affinity differs from plan"))
                if t.desired is None or t.actual is None:
                    continue
                for other, cpus in excl.items():
                    if other != r.id and t.actual & cpus:
                        violations.append(
                            _violation(
                                r.id,
                                t,
                                f"runs on sandbox {other}'s exclusive CPUs {t.actual & cpus}",
                            )
                        )
            for d in r.cgroup_drift:
                violations.append(
                    {
                        "sandbox": r.id,
                        "tid": None,
                        "role": "container",
                        "desired": d["desired"],
                        "actual": d["actual"],
                        "container": d["container"],
                        "cgroup": d["cgroup"],
                        "reason": "cgroup cpuset.cpus differs from plan",
                    }
                )
        return {
            "ok": not violations,
            "violations": violations,
            "sandboxes": len(reports),
            "threads": sum(len(r.threads) for r in reports),
            "errors": [f"{r.id}: {e}" for r in reports for e in r.errors],
        }


def _missing_key(sandbox_id: str, pid: int, start: int) -> str:
    return f"missing-vcpus:{sandbox_id}:{pid}:{start}"


_VIOLATION_KEYS = ("tid", "role", "index", "desired", "actual", "container")


def _violation(sandbox: str, t: ThreadReport, reason: str) -> dict[str, Any]:
    seen = t.to_json()
    return {"sandbox": sandbox, **{k: seen[k] for k in _VIOLATION_KEYS}, "reason": reason}
