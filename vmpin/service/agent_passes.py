"""The agent's passes: a full pass queued, and the planner thread that runs node passes.

:meth:`Planner.full_pass` (the main thread: at start, every ``interval``, on request) applies
the journal and queues every sandbox; :meth:`Planner.run` (the one planner thread) takes every
ready entry at once and runs one node-wide pass for the lot.  A pass, in phases::

    begin     Waiters.pass_begins          its number; guest maps now or after the answers
    pass      the store (ingest, the API's policies) -> Reconciler.reconcile (the pins)
    end       Waiters.pass_ends (answers) -> DirtyQueue.done_all -> AgentViews.pass_ends
    after     Waiters.publish_late -> Reconciler.release_maps -> Accounting.account_pass
              -> the Kubernetes link (events, the report) -> Accounting.progress
    settle    Store.settle_journal, on a thread of its own (:class:`Settler`), at most
              once a second while passes keep coming

Whoever waits for a pass waits for its pins alone: the bookkeeping (accounting, Kubernetes)
comes after the answers, and the settling (a checkpoint: the disk's syncs) is not between
passes at all -- a request that arrived meanwhile waited for both, then a pass of its own
(issue 28: under churn most requests arrive while a pass runs).

The planner's :class:`~vmpin.reconcile.reconciler.Reconciler` is built once, for the agent's
whole life, by the factory the agent is given (:class:`ReconcilerFactory`).
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Mapping
from functools import partial
from typing import TYPE_CHECKING, NamedTuple, Protocol

from vmpin.core.errors import StateError, VmpinError
from vmpin.core.ids import valid_id
from vmpin.linux.paths import HostPaths
from vmpin.reconcile.reconciler import Reconciler
from vmpin.service.agent_accounting import Accounting
from vmpin.service.agent_protocol import Waiters
from vmpin.service.logs import HOST_FAULTS, log, log_event
from vmpin.service.metrics import Metrics
from vmpin.service.queue import DirtyQueue, Work
from vmpin.state.locks import WAIT
from vmpin.state.records import SandboxRec
from vmpin.state.store import Store

if TYPE_CHECKING:
    from vmpin.reconcile.plan import NodePlan
    from vmpin.reconcile.reconciler import SandboxReport
    from vmpin.service.agent_views import AgentViews
    from vmpin.service.kube import KubeLink

#: the work item of a full pass that stands for every libvirt domain (not store sandboxes)
DOMAINS_WORK = "libvirt-domains"
#: the least time between two settlings while passes keep asking (seconds; see Settler)
SETTLE_EVERY = 1.0


class ReconcilerFactory(Protocol):
    """What builds the planner's reconciler: :func:`vmpin.service.settings.build_reconciler`
    (through ``vmpin.cli.Ctx.reconciler``), or a test's ``Reconciler``, with the options of
    a process that plans for its whole life."""

    def __call__(
        self,
        store: Store,
        *,
        ingest_first: bool = ...,
        hold_maps: bool = ...,
        follow_hotplug: bool = ...,
    ) -> Reconciler: ...


class _Pinned(NamedTuple):
    """A node pass's outcome, for its bookkeeping after the answers (:meth:`Planner._account`)."""

    plan: NodePlan | None
    #: the batch's records before the pass, and their reports
    recs: dict[str, SandboxRec]
    reports: dict[str, SandboxReport]
    #: when the pass began, and when its pins were done (``time.monotonic()``)
    started: float
    ended: float


class Settler:
    """The store settled after the passes, on a thread of its own: the journal files of
    applied events removed once a checkpoint has their events in the database file
    (:meth:`Store.settle_journal`), and the planner's own commits, which do not wait for
    the disk (:meth:`Store.defer_durability`), synced (:meth:`Store.sync`).

    Between two passes, that settling (a checkpoint syncs the WAL and the database file:
    7-12 ms on a disk, more under load) held up every request that arrived meanwhile: it
    waited for it, then for a pass of its own (issue 28).  Here no pass waits for it, and
    while passes keep asking it settles once per ``every`` seconds (as the planner did
    while work was queued): each settling is the disk's syncs, which the hooks' and
    updates' own syncs queue behind, and a thread that runs Python beside the planner's
    passes takes the GIL from them.  Its own connection (one is one thread's); a sync is of
    the files, whichever connection wrote them.  Nothing is lost meanwhile: a journal file
    stays until a checkpoint has its event, and ingest settles past ``SETTLE_AFTER`` of them.
    """

    def __init__(
        self,
        state_dir: str,
        failed: Callable[[StateError], None],
        fault: Callable[[str, BaseException], None],
        every: float = SETTLE_EVERY,
        write_lock: threading.Lock | None = None,
    ) -> None:
        self.state_dir = state_dir
        self.every = every
        #: the agent's writers' lock (Planner.write_lock)
        self.write_lock = write_lock
        #: a store that cannot be written (Planner.store_failed); any other error it outlives
        self._failed = failed
        self._fault = fault
        self._cond = threading.Condition()  # guards the three below
        self._wanted = False
        #: the planner's connection's changes when it last asked (Connection.total_changes)
        self._changes = 0
        self._closed = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="vmpin-settler", daemon=True)
        self._thread.start()

    def want(self, changes: int) -> None:
        """A pass ended; ``changes``: the planner's connection's ``total_changes`` then."""
        with self._cond:
            self._wanted = True
            self._changes = changes
            self._cond.notify()

    def close(self) -> None:
        """Settle what was asked for, then end the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        store: Store | None = None
        synced = 0  # the planner's changes made durable so far
        due = 0.0  # (monotonic) the next settling, not before
        try:
            while True:
                with self._cond:
                    while not self._closed:
                        left = due - time.monotonic()
                        if self._wanted and left <= 0:
                            break
                        self._cond.wait(left if self._wanted else None)
                    if not self._wanted:
                        return
                    self._wanted = False
                    changes = self._changes
                due = time.monotonic() + self.every
                try:
                    if store is None:
                        store = Store(self.state_dir, ingest=False)
                        store.local_lock = self.write_lock
                    store.settle_journal()
                    if changes != synced:
                        store.sync()
                        synced = changes
                except StateError as err:
                    self._failed(err)
                except Exception as err:  # (EMFILE, ENOMEM ...: the next pass asks again)
                    self._fault("settling", err)
        finally:
            if store is not None:
                store.close()


class Planner:
    def __init__(
        self,
        paths: HostPaths,
        reconciler_factory: ReconcilerFactory,
        queue: DirtyQueue,
        waiters: Waiters,
        accounting: Accounting,
        metrics: Metrics,
        *,
        fault: Callable[[str, BaseException], None],
        pause: Callable[[float], bool],
        fatal: Callable[[], None],
        interval: float,
        domains: bool = False,
    ) -> None:
        self.paths = paths
        self.reconciler_factory = reconciler_factory
        self.queue = queue
        self.waiters = waiters
        self.accounting = accounting
        self.metrics = metrics
        #: an error the planner outlives; a wait of up to n seconds, True once the agent
        #: stops; the planner cannot start at all (a setting it cannot plan with)
        self.fault = fault
        self.pause = pause
        self.fatal = fatal
        #: how often a store that cannot be opened is tried again (5 s at most)
        self.retry_every = min(interval, 5.0)
        #: libvirt domains are planned in every node-wide pass (one work item stands for them)
        self.domains = domains
        #: the Kubernetes link (vmpin.service.kube) when the API is configured
        self.kube: KubeLink | None = None
        #: the read views, told when each pass begins and ends (vmpin.service.agent_views)
        self.views: AgentViews | None = None
        #: why the store cannot be written (read-only, full), while pinning goes on
        self.store_error: str | None = None
        #: the pods' policy annotations as last recorded in the store (planner thread only;
        #: None until the first pass reads them), and the link's version they came from
        self._api_policies: dict[str, dict[str, str]] | None = None
        self._api_policy_version = -1
        #: when the running pass had its pins in place and current (Reconciler.on_pinned;
        #: planner thread only), None before
        self._pinned_at: float | None = None
        #: the thread that settles the store after the passes, while :meth:`run` runs
        self.settler: Settler | None = None
        #: the agent's writers queue on this rather than on SQLite's sleeping busy handler:
        #: the planner's, the settler's, the updates' and the main thread's connections
        #: (vmpin.state.writer.Writer.local_lock)
        self.write_lock = threading.Lock()

    # -- full passes (the main thread) -----------------------------------------------------
    def full_pass(self, store: Store, cause: str) -> bool:
        """Queue every sandbox; False when the previous full pass has not finished yet."""
        running = self.accounting.running_pass()
        if running is not None:
            log_event(
                logging.WARNING,
                "previous pass still running: tick skipped",
                number=running.number,
                remaining=len(running.remaining),
            )
            return False
        self._ingest(store)  # containers whose hooks nobody has applied yet
        ids = [s.id for s in store.sandboxes()]
        if self.domains:
            # domains are not in the store; one node-wide pass covers them all
            ids.append(DOMAINS_WORK)
        p = self.accounting.begin_pass(cause, ids)
        self.queue.add_all(ids, cause)  # all at once: one node pass, not a few and the rest
        if not ids:
            self.accounting.finish_pass_if_done(p)
        return True

    # -- the planner thread ------------------------------------------------------------------
    def run(self) -> None:
        """The one planning thread: every ready entry -> one node pass -> each one accounted."""
        while True:
            try:
                store = Store(self.paths.state_dir)
                store.local_lock = self.write_lock
                try:
                    reconciler = self._setup(store)
                except BaseException:
                    store.close()
                    raise
                break
            except (StateError, sqlite3.Error, *HOST_FAULTS) as err:
                # the store cannot be opened now (EMFILE, ENOMEM, EIO): not a setting that
                # is wrong, so try again rather than end the agent
                self.fault("planner start", err)
                if self.pause(self.retry_every):
                    return
            except VmpinError as err:  # a setting the planner cannot plan with
                log_event(logging.ERROR, "planner cannot start", error=str(err))
                self.metrics.errors.labels("internal").inc()
                self.fatal()
                return
        settler = self.settler = Settler(
            self.paths.state_dir, self.store_failed, self.fault, write_lock=self.write_lock
        )
        settler.start()
        try:
            with store:
                while True:
                    batch = self.queue.take_batch()
                    if batch is None:
                        return
                    try:
                        self._run_batch(batch, store, reconciler)
                    except Exception as err:  # after the answers (maps, bookkeeping): go on
                        self.fault("planner", err)
        finally:
            self.settler = None
            settler.close()  # (what the last pass asked for, settled)

    def _setup(self, store: Store) -> Reconciler:
        # a waiting hook or `vmpin update` gets its answer before any sync: the pass's
        # writes reach the disk with the checkpoint after it (_settle)
        store.defer_durability()
        return self.reconciler_factory(
            store,
            # each pass applies the journal itself, without waiting for the disk (_node_pass)
            ingest_first=False,
            # a replaced guest map is freed after the pass's answers, not in its rename
            # (~0.2 ms of a Kata hook's wait on ext4, issue 14)
            hold_maps=True,
            # the agent plans for its whole life: a CPU hot(un)plugged is planned for at the
            # next pass (one read of the online list each)
            follow_hotplug=True,
        )

    def _run_batch(self, batch: list[Work], store: Store, reconciler: Reconciler) -> None:
        cpu = time.thread_time()
        try:
            self._batch(batch, store, reconciler)
        finally:
            if all(w.cause == "event" for w in batch):
                self.metrics.event_pass_cpu.observe(time.thread_time() - cpu)

    def _waited(self, batch: list[Work], pinned: _Pinned | None, answered: float) -> None:
        """Where the pass's waiters' time went: in the queue (the rest of the pass running
        when they came), in the pass until its pins, and the planner's time after the
        answers, which the next requests wait for (issue 28)."""
        m = self.metrics
        if pinned is not None:
            begun = pinned.started
            for w in batch:
                if w.first_event is not None:
                    m.queue_wait.observe(begun - w.first_event)
            if all(w.cause == "event" for w in batch):
                m.event_pass.observe(pinned.ended - begun)
        m.pass_tail.observe(time.monotonic() - answered)

    def _batch(self, batch: list[Work], store: Store, reconciler: Reconciler) -> None:
        number, later = self.waiters.pass_begins()
        views = self.views
        if views is not None:
            views.pass_begins(number)
        reconciler.maps_later = [] if later else None
        # the waiters answered as soon as the pass's pins are in place and current, before
        # its node summary and the lock's release (Reconciler.on_pinned); again at its end,
        # for a pass that could not say so early (it went on without the node lock, or raised)
        reconciler.on_pinned = partial(self._pinned, number, reconciler)
        self._pinned_at = None
        pinned: _Pinned | None = None
        try:
            pinned = self._node_pass(batch, store, reconciler)
        except Exception as err:  # the planner must survive any one pass
            self._failed("node pass", err, batch, store)
        finally:
            reconciler.on_pinned = None
            # the answers as soon as the pins are done: a waiter waits for nothing else --
            # not for the queue's bookkeeping either, which comes after them (a request
            # for one of these sandboxes that comes meanwhile finds it running, and gets
            # the pass after: DirtyQueue.add)
            ok = pinned is not None
            try:
                maps_now = self.waiters.pass_ends(number, ok, reconciler.publish_maps)
            finally:
                self.queue.done_all([w.sandbox_id for w in batch])
            # (answered from the pass, when it could say its pins were in place)
            answered = self._pinned_at if self._pinned_at is not None else time.monotonic()
            if views is not None:
                views.pass_ends(number, ok, store, reconciler)
        if not maps_now:
            self.waiters.publish_late(number, reconciler.publish_maps)
        # the maps the pass replaced, freed now that no one waits (Reconciler.held_maps)
        reconciler.release_maps()
        # then the bookkeeping no one waits for: what the pass did, for status, metrics, logs
        # and the Kubernetes API
        if pinned is not None:
            try:
                self._account(batch, pinned)
            except Exception as err:
                self._failed("pass bookkeeping", err, batch, store)
        self.accounting.progress(batch)
        # then the pass's journal events made durable, their files removed
        self._settle(store)
        self._waited(batch, pinned, answered)

    def _pinned(self, number: int, reconciler: Reconciler) -> None:
        """Pass ``number``'s pins are in place and current: its waiters answered."""
        self._pinned_at = time.monotonic()
        self.waiters.pass_ends(number, True, reconciler.publish_maps)

    def _node_pass(self, batch: list[Work], store: Store, reconciler: Reconciler) -> _Pinned:
        """One node-wide pass for every sandbox in ``batch``: the pins, and what accounting
        them takes (:meth:`_account`, after the answers).

        The journal is applied without waiting for the disk, and settled after the pass,
        once its waiters have their answer (:meth:`_settle`; issue 14: a Kata hook waits for
        this pass, and the sync and checkpoint were a third of it).
        """
        t0 = time.monotonic()
        # once per pass: a plain container's hook journals its event and only notifies us
        self._ingest(store, durable=False)
        self._record_api_policies(store)
        ids = [w.sandbox_id for w in batch]
        # An event's pass reads the host for its sandboxes alone (and those whose records
        # moved), and plans the node; a periodic or start-up pass reads everything: drift
        # behind vmpin's back is found there (Observer.observe's ``fresh``, issue 28).
        fresh = set(ids) if all(w.cause == "event" for w in batch) else None
        # each sandbox's record before the pass (for drift): a full pass reads the whole
        # table; an event's pass takes those its observation read (SandboxReport.record),
        # not a read of its own per sandbox (issue 28)
        recs = {rec.id: rec for rec in store.sandboxes()} if fresh is None else None
        reports = {r.id: r for r in reconciler.reconcile(ids, fresh=fresh)}
        if recs is None:
            recs = {sid: r.record for sid, r in reports.items() if r.record is not None}
        # (the pins' latency ends where they were known in place, not after the summary)
        ended = self._pinned_at if self._pinned_at is not None else time.monotonic()
        if reconciler.node_lock.went_unlocked:
            # another process held the node's plan lock past its wait (stopped, or stuck):
            # this pass went on without it, and either side plans again when needed
            log_event(
                logging.WARNING,
                "pass ran without the node lock",
                lock=reconciler.node_lock.error or f"held by another process past {WAIT:g} s",
            )
        # the node's plan (with the observation it holds) is not needed between passes: do
        # not keep every sandbox's plan alive until the next one (agent RSS, issue #14)
        plan, reconciler.last_plan = reconciler.last_plan, None
        return _Pinned(plan, recs, reports, t0, ended)

    def _account(self, batch: list[Work], pinned: _Pinned) -> None:
        """Each sandbox of the pass accounted, and told to the Kubernetes link (events, the
        node's report)."""
        gone, accounted = self.accounting.account_pass(
            pinned.plan, batch, pinned.recs, pinned.reports, pinned.started, pinned.ended
        )
        kube = self.kube
        if kube is None:
            return
        for sid in gone:
            kube.forget_sandbox(sid, publish=False)
        for rec, report, drift in accounted:
            kube.after_pass(rec, report, drift=drift, publish=False)
        kube.publish()

    def _failed(self, what: str, err: Exception, batch: list[Work], store: Store) -> None:
        """A pass (or its bookkeeping) that raised: counted, and said."""
        self.accounting.count_error()
        if isinstance(err, HOST_FAULTS):  # EMFILE, ENOMEM, EIO: said once a minute, not per pass
            self.fault(what, err)
            return
        self.metrics.errors.labels("internal").inc()
        if isinstance(err, sqlite3.OperationalError):  # full (or gone read-only)
            if self.store_error is None:
                log_event(logging.ERROR, "cannot write the store", error=str(err))
            self.store_error = f"{store.path}: {err}"
        log.error(
            f"{what} failed",
            # the database failing (full, read-only, corrupt) is one line, not a
            # traceback per pass
            exc_info=not isinstance(err, (sqlite3.Error, VmpinError)),
            extra={
                "fields": {
                    "sandboxes": [w.sandbox_id for w in batch[:20]],
                    "batch": len(batch),
                    "error": str(err),
                }
            },
        )

    # -- the store ---------------------------------------------------------------------------
    def _ingest(self, store: Store, durable: bool = True) -> None:
        """Apply the journal; a store that cannot be written (read-only, full) is logged and
        shown in status, and the pass goes on pinning from what is stored and the host."""
        try:
            store.ingest(durable=durable)
        except StateError as err:
            self.store_failed(err)
        else:
            self.store_error = None

    def _settle(self, store: Store) -> None:
        """The pass's journal events made durable and their files removed, and the store's
        own writes made durable: by the :class:`Settler`'s thread when the planner runs
        one (a checkpoint syncs the WAL and the database file: 7-12 ms here, more under
        load, and a request that arrived meanwhile waited for it, issue 28), else here."""
        settler = self.settler
        if settler is not None:
            settler.want(store.db.total_changes)
            return
        try:
            store.settle_journal()
        except StateError as err:
            self.store_failed(err)

    def store_failed(self, err: StateError) -> None:
        """A store that cannot be written (read-only, full), or whose journal the host does
        not let us read (EMFILE, EIO: a ``host`` fault), logged once, shown in status until
        an ingest succeeds again."""
        if isinstance(err.__cause__, HOST_FAULTS):
            self.fault("store", err)
        else:
            if self.store_error != str(err):
                log_event(logging.ERROR, "cannot write the store", error=str(err))
            self.metrics.errors.labels("internal").inc()
        self.store_error = str(err)

    def _record_api_policies(self, store: Store) -> None:
        """The pods' policy annotations as the Kubernetes API shows them, into the store
        when they changed since the last pass: every process then plans with them (issue 25:
        they lived in the agent alone; ``audit`` called its choice drift and ``reconcile
        --once`` reverted it)."""
        kube = self.kube
        if kube is None:
            return
        shown = kube.policies(self._api_policy_version)
        if shown is None:
            return  # not listed yet, or nothing changed since the last pass
        version, policies = shown
        if self._api_policies is None:
            self._api_policies = {
                uid: dict(r.annotations) for uid, r in store.policy_records()[1].items()
            }
        known = self._api_policies
        changes: dict[str, Mapping[str, str] | None] = {
            uid: ann for uid, ann in policies.items() if known.get(uid) != ann and valid_id(uid)
        }
        changes.update({uid: None for uid in known if uid not in policies})
        if changes:
            try:
                store.record_api_policies(changes)
            except StateError as err:
                self.store_failed(err)
                return
            for uid, ann in changes.items():
                if ann is None:
                    known.pop(uid, None)
                else:
                    known[uid] = dict(ann)
        self._api_policy_version = version
