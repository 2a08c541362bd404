"""The agent's accounting: what its passes did, for ``status``, the gauges and the logs.

It owns the per-sandbox bookkeeping (:class:`~vmpin.service.workers.SandboxStat`), the full
pass under way (:class:`~vmpin.service.workers.FullPass`) and the last one's summary, the
counters ``status`` prints (events, plans, node passes, errors, passes), the conflicts seen
last, and the gauges' sums (:meth:`Accounting.snapshot`, read at scrape time).  Everything
here is under one lock: the planner writes it once per node pass
(:meth:`Accounting.account_pass`, then :meth:`Accounting.progress`), the main thread when it
starts a full pass, the control connections and the metrics endpoint read it.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vmpin.core.errors import VmpinError
from vmpin.linux.paths import HostPaths
from vmpin.reconcile.reconciler import SandboxReport
from vmpin.service.logs import log, log_event
from vmpin.service.metrics import Metrics, Snapshot
from vmpin.service.queue import Work
from vmpin.service.workers import FullPass, SandboxStat
from vmpin.state.records import SandboxRec
from vmpin.state.store import Store

if TYPE_CHECKING:
    from vmpin.reconcile.plan import NodePlan

#: thread actions whose thread carries its plan (vmpin.reconcile.apply, .report)
_CARRYING = ("ok", "pinned")


@dataclass(frozen=True)
class Tally:
    """The counters ``status`` prints, read at one moment (:meth:`Accounting.tally`)."""

    events: int
    plans: int
    node_passes: int
    errors: int
    passes: int
    pass_running: bool
    #: when the last full pass ended (``time.monotonic()``), and its summary
    last_pass_end: float | None
    last_pass: dict[str, Any] | None
    #: the asked-for sandbox's bookkeeping (None: not known), when one was asked for
    sandbox: dict[str, Any] | None


class Accounting:
    def __init__(self, paths: HostPaths, metrics: Metrics) -> None:
        self.paths = paths
        self.metrics = metrics
        self._lock = threading.Lock()  # guards the bookkeeping below
        self._stats: dict[str, SandboxStat] = {}
        #: bumped whenever ``_stats`` changes: the gauges and status sum the per-sandbox
        #: bookkeeping again only then (a status poll during an idle node cost a walk over
        #: 2,000 records)
        self._stats_version = 0
        self._pass: FullPass | None = None
        self._passes = 0
        self._last_pass: dict[str, Any] | None = None
        self._last_pass_end: float | None = None
        self._events = 0
        self._plans = 0
        self._errors = 0
        self._node_passes = 0
        self._conflicts: set[tuple[str, Any, Any]] = set()
        self._tracked_lock = threading.Lock()
        self._tracked_cache: tuple[float, dict[str, tuple[str, int]]] | None = None
        self._snapshot_cache: tuple[tuple[float, int], Snapshot] | None = None

    # -- counters -------------------------------------------------------------------------
    def count_events(self, n: int) -> None:
        with self._lock:
            self._events += n

    def count_error(self) -> None:
        with self._lock:
            self._errors += 1

    def totals(self) -> tuple[int, int]:
        """(plans, events) so far, for the agent's last log line."""
        with self._lock:
            return self._plans, self._events

    # -- full passes ----------------------------------------------------------------------
    def running_pass(self) -> FullPass | None:
        with self._lock:
            return self._pass

    def begin_pass(self, cause: str, ids: list[str]) -> FullPass:
        """A full pass over ``ids`` starts (the main thread's alone, after
        :meth:`running_pass` found none): its number, and the bookkeeping of sandboxes
        deleted behind the agent's back (e.g. by a hook) forgotten."""
        with self._lock:
            self._passes += 1
            for gone in set(self._stats) - set(ids):
                del self._stats[gone]
                self._stats_version += 1
            p = self._pass = FullPass(self._passes, cause, ids)
        return p

    def finish_pass_if_done(self, p: FullPass) -> None:
        with self._lock:
            if p.remaining or self._pass is not p:
                return
            self._pass = None
            wall = time.monotonic() - p.started
            cpu = time.process_time() - p.started_cpu
            self._last_pass_end = time.monotonic()
            self._last_pass = {
                "number": p.number,
                "cause": p.cause,
                "sandboxes": p.total,
                "duration_s": round(wall, 4),
                "cpu_s": round(cpu, 4),
                "repaired": p.repaired,
                "errors": p.errors,
            }
        self.metrics.full_pass.observe(wall)
        self.metrics.full_pass_cpu.set(cpu)
        self.metrics.last_full_pass.set_to_current_time()
        level = logging.INFO if (p.repaired or p.errors or p.cause == "startup") else logging.DEBUG
        log_event(level, "pass done", **self._last_pass)

    def progress(self, batch: list[Work]) -> None:
        """Tick the running full pass off for the entries it queued (not older ones)."""
        with self._lock:
            p = self._pass
            if p is None:
                return
            for work in batch:
                if work.taken_at >= p.started:
                    p.remaining.discard(work.sandbox_id)
        self.finish_pass_if_done(p)

    # -- one node pass --------------------------------------------------------------------
    def account_pass(
        self,
        plan: NodePlan | None,
        batch: list[Work],
        recs: Mapping[str, SandboxRec],
        reports: Mapping[str, SandboxReport],
        started: float,
        ended: float | None = None,
    ) -> tuple[list[str], list[tuple[SandboxRec, SandboxReport, bool]]]:
        """A node pass that began at ``started`` and had its threads pinned at ``ended``
        (``time.monotonic()``; default now) has planned ``plan`` for ``batch``: its
        conflicts, its metrics, and each sandbox's bookkeeping from ``recs`` (the store
        before the pass) and ``reports``.  (Its waiters may have their answers already.)

        The sandboxes that are gone (deleted, or a libvirt domain: the pass undid their pins),
        and the others' record, report and whether the pass repaired drift."""
        self._note_conflicts(plan)
        end = time.monotonic() if ended is None else ended
        self.metrics.sandbox_pass.observe(end - started)
        self.metrics.node_passes.inc()
        with self._lock:
            self._node_passes += 1
        now = time.time()
        gone: list[str] = []
        accounted: list[tuple[SandboxRec, SandboxReport, bool]] = []
        # per cause, not per sandbox: an idle pass over 2,000 sandboxes is one counter update
        plans: dict[str, int] = {}
        try:
            for work in batch:
                sid = work.sandbox_id
                rec = recs.get(sid)
                if rec is None:  # deleted (poststop), or a libvirt domain: the pass undid its pins
                    with self._lock:
                        if self._stats.pop(sid, None) is not None:
                            self._stats_version += 1
                    gone.append(sid)
                    continue
                report = reports.get(sid)
                if report is None:  # gone during the pass
                    report = SandboxReport(sid, rec.runtime)
                    report.vanished = True
                plans[work.cause] = plans.get(work.cause, 0) + 1
                if work.first_event is not None:
                    self.metrics.latency.observe(end - work.first_event)
                drift = self._account(work, rec.gen, rec.dirty, report, now)
                accounted.append((rec, report, drift))
        finally:
            for cause, n in plans.items():
                self.metrics.plans.labels(cause).inc(n)
        return gone, accounted

    def _note_conflicts(self, plan: NodePlan | None) -> None:
        """Invariant 5: conflicting exclusive claims are a metric and a log line, never merged."""
        if plan is None:
            return
        self.metrics.conflicts.set(len(plan.conflicts))
        seen = {(c.cpus.to_list(), c.first, c.second) for c in plan.conflicts}
        with self._lock:
            # every pass re-plans the node: log a conflict when it appears, not every pass
            new = seen - self._conflicts
            self._conflicts = seen
        for c in plan.conflicts:
            if (c.cpus.to_list(), c.first, c.second) not in new:
                continue
            log_event(
                logging.WARNING,
                "conflict",
                cpus=c.cpus.to_list(),
                claimants=[c.first.to_json(), c.second.to_json()],
            )

    def _account(
        self, work: Work, gen: int, dirty: bool, r: SandboxReport, now: float | None = None
    ) -> bool:
        """Metrics, bookkeeping and a log line for one sandbox pass.

        Runs for every sandbox of every pass (2,000 of them in an idle node pass): one walk
        over its threads, metrics touched only for what happened, and the log line's fields
        built only when the line is written (issue 14: the agent's idle pass)."""
        # Drift = what a pass repaired that no stored change asked for.  A periodic (or
        # start-up) pass over a dirty sandbox is applying an update whose notification is
        # still on its way, or that a crash interrupted.
        drift = work.cause != "event" and not dirty
        # the threads pinned, by role (one counter update per role, not per thread: an
        # event's pass over a 37-thread VM pins them all, issue 28), counted in the one walk
        writes: dict[str, int] = {}
        failed = []
        pinned: dict[str, int] = {}
        for t in r.threads:
            action, role = t.action, t.role
            if action == "pinned":
                writes[role] = writes.get(role, 0) + 1
            elif action == "error":
                failed.append(t)
            # "ok" / "pinned": the kernel holds the plan (actual == desired, read back; a
            # container outside its cgroup's set is "drift"), so no need to compare again
            if (
                t.desired is not None
                and t.actual is not None
                and (action in _CARRYING or not t.violates())
            ):
                pinned[role] = pinned.get(role, 0) + 1
        npinned = sum(writes.values())
        cgroup_fixed = sum(1 for d in r.cgroup_drift if d.get("repaired")) if r.cgroup_drift else 0
        errors = list(r.errors) + [f"tid {t.tid}: {t.error}" for t in failed]
        for role, n in writes.items():
            self.metrics.affinity_writes.labels(role).inc(n)
        if failed:
            self.metrics.errors.labels("affinity").inc(len(failed))
        if r.errors:
            self.metrics.errors.labels("sandbox").inc(len(r.errors))
        if drift:
            if npinned:
                self.metrics.drift.labels("thread").inc(npinned)
            if cgroup_fixed:
                self.metrics.drift.labels("cgroup").inc(cgroup_fixed)
            if r.vanished:
                self.metrics.drift.labels("vanished").inc()
        with self._lock:
            self._plans += 1
            self._errors += len(errors)
            self._stats_version += 1
            p = self._pass
            if p is not None and work.sandbox_id in p.remaining:
                if drift:
                    p.repaired += npinned + cgroup_fixed + int(r.vanished)
                p.errors += len(errors)
            if r.vanished:
                self._stats.pop(work.sandbox_id, None)
            else:
                st = self._stats.get(work.sandbox_id)
                if st is None:
                    st = self._stats[work.sandbox_id] = SandboxStat(r.runtime)
                st.plans += 1
                st.gen = gen
                st.last = time.time() if now is None else now
                st.containers = len(r.containers)
                st.threads = len(r.threads)
                st.mask = r.mask  # rendered as a list when status asks for it
                st.mode = r.mode
                st.errors = errors
                st.pinned = pinned
        changed = bool(npinned or cgroup_fixed or r.vanished or errors)
        level = logging.INFO if changed else logging.DEBUG
        if log.isEnabledFor(level):
            log_event(
                level,
                "sandbox pass",
                sandbox=r.id,
                cause=work.cause,
                gen=gen,
                mode=r.mode,
                mask=r.mask.to_list(),
                pinned=npinned,
                cgroups=cgroup_fixed,
                vanished=r.vanished,
                drift=drift and bool(npinned or cgroup_fixed or r.vanished),
                errors=errors,
            )
        return drift

    # -- status and gauges ----------------------------------------------------------------
    def _tracked(self) -> tuple[float, dict[str, tuple[str, int]]]:
        """Sandbox -> (runtime, containers), as the store says now (cached for a second), and
        when it was read.

        Read from the store rather than from the agent's bookkeeping: a sandbox whose last
        container went away in a hook that notified nobody (a poststop of the sandbox
        container) must not linger in the gauges until the next periodic pass.  A short-lived
        connection of this thread's own (sqlite connections are per thread).
        """
        now = time.monotonic()
        with self._tracked_lock:
            cached = self._tracked_cache
            if cached is not None and now - cached[0] < 1.0:
                return cached
            with Store(self.paths.state_dir) as store:
                self._tracked_cache = (now, store.tracked())
            return self._tracked_cache

    def snapshot(self) -> Snapshot:
        """The gauges' sums: computed again only when the store's view or the bookkeeping
        changed since the last time."""
        try:
            read_at, tracked = self._tracked()
        except (VmpinError, sqlite3.Error) as err:
            log_event(logging.WARNING, "cannot read the store for metrics", error=str(err))
            read_at, tracked = -1.0, {}
        with self._lock:
            key = (read_at, self._stats_version)
            cached = self._snapshot_cache
            if cached is not None and cached[0] == key and read_at >= 0:
                return cached[1]
            roles: dict[str, int] = {}
            for sid, st in self._stats.items():
                if sid in tracked:  # (the next full pass forgets the others)
                    for role, n in st.pinned.items():
                        roles[role] = roles.get(role, 0) + n
        runtimes: dict[str, tuple[int, int]] = {}
        for runtime, n_containers in tracked.values():
            n_s, n_c = runtimes.get(runtime, (0, 0))
            runtimes[runtime] = (n_s + 1, n_c + n_containers)
        snapshot = (runtimes, roles)
        with self._lock:
            self._snapshot_cache = (key, snapshot)
        return snapshot

    def tally(self, sandbox_id: str | None = None) -> Tally:
        """The counters, and ``sandbox_id``'s bookkeeping when asked, at one moment."""
        with self._lock:
            sandbox = None
            if sandbox_id is not None:
                st = self._stats.get(sandbox_id)
                sandbox = None if st is None else {"id": sandbox_id, **st.to_json()}
            return Tally(
                events=self._events,
                plans=self._plans,
                node_passes=self._node_passes,
                errors=self._errors,
                passes=self._passes,
                pass_running=self._pass is not None,
                last_pass_end=self._last_pass_end,
                last_pass=None if self._last_pass is None else dict(self._last_pass),
                sandbox=sandbox,
            )
