"""The node agent, ``vmpin serve``: coalesced event handling and periodic repair.

Everything works without it: hooks and ``vmpin update`` write the new level to the store and
reconcile their sandbox in-process when no agent answers.  When the agent runs they hand the
sandbox over instead (:mod:`vmpin.service.control`), which keeps hooks fast and turns update storms
into a handful of plans.  The shape::

    control socket ──► dirty set (per-sandbox coalescing) ──► the planner ──► Reconciler
    (server.py; a thread   (queue.py)      every ready entry: (one thread; logs.py,
     per connection)          ▲            one node pass       metrics.py, workers.py)
                              └── periodic full pass (main thread, every ``interval``)

- **Events only mark sandboxes dirty.**  The writer (hook, update) has already stored the new
  level and bumped the sandbox's generation ``gen``; ``{"op":"dirty"}`` only wakes the
  planner.  A sandbox is queued at most once and is in at most one pass at a time:
  notifications that arrive while it is queued fold into that entry, and those arriving while
  a pass over it runs make it run exactly once more afterwards (that pass re-reads the store,
  so it sees the last update).  Events for a sandbox whose last event-driven pass ended less
  than ``holdoff`` (0.1 s) ago wait out the rest of it, and the wait doubles, up to 1 s, while
  they keep coming: a storm of N updates costs a handful of plans, not N, and an isolated
  update waits for nothing.
- **One node pass per batch.**  Every pass is node-wide (``Reconciler.reconcile`` observes,
  plans and applies the whole node, whatever asked for it), so the planner takes *every*
  ready entry at once (events first) and runs one pass for the lot, then accounts each
  sandbox's report.  A full pass over n sandboxes is one node pass, not n.  There is one
  planner thread: two node passes at once would do the same work twice and race on the same
  threads (and the GIL runs them one at a time anyway); ``--workers`` is accepted for
  compatibility and plans nothing more.
- **Each pass is level-triggered.**  The pass reads each sandbox (and its ``gen``),
  reconciles it from the full desired state, then records ``done_gen = gen`` (``Reconciler``
  does both).
- **Blocking replies.**  ``{"op":"dirty",...,"wait":s}`` is answered once a node pass that
  started after the request arrived has finished (waiters sleep on a condition the planner
  signals at the end of each pass), or with ``done: false`` after ``s`` seconds; its entries
  skip the hold-off (their caller is waiting).
- **Periodic full pass** (default every 5 s): every sandbox is queued (behind events), and the
  reconciler re-reads the host and writes only where desired and actual differ: new threads
  (vCPU hotplug, a new vhost worker), vanished VMMs and containers, cpusets changed behind
  vmpin's back, kubelet checkpoint changes.  A tick that finds the previous pass
  unfinished is skipped, so a slow node never piles passes up.
- **Crash-safe.**  State lives only in SQLite (each write one transaction; WAL).  At start the
  agent takes an exclusive ``flock`` on ``agent.lock`` (released by the kernel even on kill -9),
  removes a stale socket and runs a full pass: whatever a crash interrupted is planned again
  from the stored level (the pass is node-wide, so dirty or not, every sandbox is planned).
- **SIGTERM / SIGINT drain.**  Periodic passes stop; queued work is finished while the socket
  still accepts (at most ``drain_timeout`` s); then the socket is closed and removed (hooks
  fall back to in-process reconciles), the planner finishes its current pass, exit code 0.
  Work left undone is still dirty in the store, or is drift the next start repairs.
- **Observable.**  JSON lines on stderr (one object per line: ``ts``, ``level``, ``event`` and
  fields), Prometheus metrics (:mod:`vmpin.service.metrics`) on a loopback port, and
  ``{"op":"status"}`` on the socket (what ``vmpin status`` prints).

Control protocol (one JSON object per line, one reply line; socket mode 0600, and the peer's
uid must be ours): ``{"op":"dirty","sandboxes":[ids]}`` -> ``{"ok":true,"queued":n}``;
``{"op":"dirty","sandboxes":[ids],"wait":s}`` (0 < s <= 60) -> ``{"ok":true,"queued":n,
"done":bool}`` (:mod:`vmpin.service.control`);
``{"op":"status"[,"sandbox":id]}`` -> health and counters (one sandbox's bookkeeping when
asked); ``{"op":"reconcile"}`` -> start a full pass now.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import math
import os
import signal
import socket
import sqlite3
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from vmpin import __version__
from vmpin.core.errors import IdError, StateError, VmpinError
from vmpin.core.ids import check_id, valid_id
from vmpin.linux.paths import HostPaths
from vmpin.reconcile.reconciler import Reconciler, SandboxReport
from vmpin.service import limits
from vmpin.service.logs import Throttle, log, log_event, setup_logging
from vmpin.service.metrics import Metrics, MetricsServer, Snapshot
from vmpin.service.queue import CAUSES, DEFAULT_HOLDOFF, DirtyQueue, Work
from vmpin.service.server import AgentRunning, ControlServer, Reply
from vmpin.service.settings import POLICY_KEYS, Settings
from vmpin.service.workers import FullPass, SandboxStat
from vmpin.state import journal
from vmpin.state.locks import WAIT
from vmpin.state.store import Store

if TYPE_CHECKING:
    from vmpin.reconcile.domains import LibvirtDomains
    from vmpin.service.kube import KubeLink

#: thread actions whose thread carries its plan (vmpin.reconcile.apply, .report)
_CARRYING = ("ok", "pinned")

#: the work item of a full pass that stands for every libvirt domain (not store sandboxes)
DOMAINS_WORK = "libvirt-domains"

DEFAULT_INTERVAL = 5.0
DEFAULT_WORKERS = 2
DEFAULT_DRAIN_TIMEOUT = 10.0
#: the least time between two log lines about one recurring fault (:meth:`Agent.fault`)
FAULT_LOG_EVERY = 60.0
#: errors the host raises that a loop of the agent outlives (issue 26: EMFILE, ENFILE,
#: ENOMEM, EIO ...): counted as ``host`` errors; anything else is a bug, ``internal``
HOST_FAULTS = (OSError, MemoryError)


class _Waiter:
    """A blocking ``dirty`` request: the pass it waits for, and how to answer it."""

    __slots__ = ("answer", "maps_first", "queued", "reply", "target")

    def __init__(self, answer: Reply | None, maps_first: bool = True) -> None:
        self.answer = answer
        #: answered only once the pass's guest maps are published (a Kata hook: the guest
        #: hook of the container about to start reads its entry); False for ``vmpin
        #: update``, whose map the guest's follower picks up whenever it comes
        self.maps_first = maps_first
        self.target = 0
        self.queued = 0
        self.reply: dict[str, Any] | None = None


class CtxLike(Protocol):
    """What the CLI hands :func:`serve` (``vmpin.cli.Ctx``), without importing typer here."""

    paths: HostPaths
    settings: Settings

    def reconciler(self, store: Store | None = None) -> Reconciler: ...


MAX_INTERVAL = 86400.0
MAX_HOLDOFF = 60.0
MAX_WORKERS = 64
#: the longest a blocking ``dirty`` request may ask to wait (seconds)
MAX_WAIT = 60.0


def check_seconds(name: str, value: float, *, low: float, high: float) -> float:
    """A duration option: finite and in range (``nan`` compares false to everything, so a
    ``<= 0`` check lets it through, and ``inf`` overflows every timer)."""
    if not (isinstance(value, (int, float)) and math.isfinite(value) and low <= value <= high):
        raise StateError(f"{name} {value}: must be a number of seconds in {low:g}..{high:g}")
    return float(value)


class Agent:
    def __init__(
        self,
        paths: HostPaths,
        reconciler_factory: Callable[[Store], Reconciler],
        *,
        interval: float = DEFAULT_INTERVAL,
        workers: int = DEFAULT_WORKERS,
        metrics_port: int = 0,
        metrics_address: str = "127.0.0.1",
        holdoff: float = DEFAULT_HOLDOFF,
        drain_timeout: float = DEFAULT_DRAIN_TIMEOUT,
        metrics: Metrics | None = None,
        domains: LibvirtDomains | None = None,
    ) -> None:
        check_seconds("--interval", interval, low=0.01, high=MAX_INTERVAL)
        check_seconds("VMPIN_HOLDOFF", holdoff, low=0.0, high=MAX_HOLDOFF)
        if not 1 <= workers <= MAX_WORKERS:
            raise StateError(f"--workers {workers}: need 1..{MAX_WORKERS} workers")
        if not 0 <= metrics_port <= 65535:
            raise StateError(f"--metrics-port {metrics_port}: not a TCP port (0 = off)")
        try:
            socket.inet_pton(socket.AF_INET6 if ":" in metrics_address else socket.AF_INET,
                             metrics_address)  # fmt: skip
        except (OSError, ValueError):
            raise StateError(
                f"--metrics-address {metrics_address!r}: not an IPv4 or IPv6 address"
            ) from None
        self.paths = paths
        self.reconciler_factory = reconciler_factory
        #: libvirt domains (vmpin.reconcile.domains): planned in every node-wide pass; their
        #: lifecycle events queue work (vmpin.service.domain_events)
        self.domains = domains
        self._domain_events: Any = None
        self._conflicts: set[tuple[str, Any, Any]] = set()
        self.interval = interval
        #: ``--workers`` as given (validated, kept for compatibility): node passes are
        #: serialised on one planner thread whatever it says
        self.workers_option = workers
        self.n_workers = 1
        self.metrics_port = metrics_port
        #: where the metrics port binds (--metrics-address: 127.0.0.1 keeps it on the node)
        self.metrics_address = metrics_address
        self.drain_timeout = drain_timeout
        self.metrics = metrics or Metrics()
        self.queue = DirtyQueue(holdoff)
        self.stop_event = threading.Event()
        self._stop_signal: int | None = None
        self._exit_code = 0
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._wakeup_fd_set = False
        self.started = time.monotonic()
        self._lock = threading.Lock()  # guards the bookkeeping below
        self._stats: dict[str, SandboxStat] = {}
        self._pass: FullPass | None = None
        self._passes = 0
        self._last_pass: dict[str, Any] | None = None
        self._last_pass_end: float | None = None
        self._pass_requested = False
        self._events = 0
        self._plans = 0
        self._errors = 0
        self._node_passes = 0
        #: the last pass whose guest maps are published, and the waiters that do not need
        #: them first but are not registered yet (under _pass_cond)
        self._maps_done = 0
        self._maps_after_coming = 0
        #: node passes started / finished / finished without raising (numbered from 1), and
        #: the condition blocking ``dirty`` requests sleep on (signalled at each pass's end)
        self._pass_cond = threading.Condition()
        self._node_started = 0
        self._node_finished = 0
        self._node_ok = 0
        self._stopping = False
        #: blocking ``dirty`` requests not answered yet (under ``_pass_cond``)
        self._waiters: list[_Waiter] = []
        self._workers: list[threading.Thread] = []
        self._server: ControlServer | None = None
        self._lockfd: int | None = None
        self._metrics_server: MetricsServer | None = None
        #: (control, metrics) connections at once, sized from the fd limit at start
        self.caps = (limits.CONTROL_CAP, limits.METRICS_CAP)
        self._store: Store | None = None
        self._watcher: Any = None  # vmpin.service.watch.Watcher: runc/kubelet changes -> notify
        self._tracked_lock = threading.Lock()
        self._tracked_cache: tuple[float, dict[str, tuple[str, int]]] | None = None
        #: bumped (under ``_lock``) whenever ``_stats`` changes: the gauges and status sum
        #: the per-sandbox bookkeeping again only then (a status poll during an idle node
        #: cost a walk over 2,000 records)
        self._stats_version = 0
        self._snapshot_cache: tuple[tuple[float, int], Snapshot] | None = None
        #: the Kubernetes link (vmpin.service.kube) when the API is configured
        self.kube: KubeLink | None = None
        #: the pods' policy annotations as last recorded in the store (planner thread only;
        #: None until the first pass reads them), and the link's version they came from
        self._api_policies: dict[str, dict[str, str]] | None = None
        self._api_policy_version = -1
        self.metrics.track_state(self._snapshot)
        self.metrics.track_queue(self.queue.depth, self.queue.running)
        self.metrics.track_journal(
            lambda: float(journal.backlog(paths.state_dir)),
            lambda: float(journal.quarantined(paths.state_dir)),
        )
        #: recurring faults of the loops, said once a minute (:meth:`fault`)
        self._faults = Throttle(FAULT_LOG_EVERY)
        #: why the store cannot be written (read-only, full), while pinning goes on
        self.store_error: str | None = None
        self.metrics_error: str | None = None

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Lock the state dir, open the socket and metrics, start workers, queue the start pass."""
        try:
            os.makedirs(self.paths.state_dir, mode=0o700, exist_ok=True)
        except OSError as err:
            raise StateError(f"{self.paths.state_dir}: {err.strerror}") from None
        self._take_lock()
        # the soft fd limit up to the hard one, and the endpoints' caps sized from it
        # (vmpin.service.limits): what they serve can never take the passes' fds
        was, nofile, hard = limits.raise_nofile()
        if nofile != was:
            log_event(logging.INFO, "fd limit raised", soft=nofile, was=was, hard=hard)
        self.caps = limits.caps(nofile)
        try:
            self._store = Store(self.paths.state_dir)
            self._open_socket()
            if self.metrics_port:
                try:
                    self._metrics_server = MetricsServer(
                        self.metrics, self.metrics_port, self.metrics_address,
                        cap=self.caps[1], fault=self.fault,
                    )  # fmt: skip
                except OSError as err:
                    # Anyone may bind a loopback port first: that must not stop pinning (an
                    # exit here is a crash loop under Restart=always).  Said once, in status.
                    self.metrics_error = (
                        f"metrics port {self._metrics_where()}: {err.strerror};"
                        " running without metrics"
                    )
                    self.metrics.errors.labels("internal").inc()
                    log_event(logging.ERROR, "metrics off", error=self.metrics_error)
            # Crash recovery: whatever the last agent (or a killed hook) left half-done is
            # planned again from the stored level by the start-up pass, which (node-wide like
            # every pass) plans every sandbox whether marked dirty or not.  So nothing is
            # marked here: that cost a write per sandbox per start and changed no plan.
            t = threading.Thread(target=self._planner, name="vmpin-planner", daemon=True)
            t.start()
            self._workers.append(t)
            assert self._server is not None
            self._server.start()
            from vmpin.service import watch  # lazily: inotify_simple is the agent's alone

            self._watcher = watch.start(self.paths, self.notify, on_error=self.fault)
            if self.domains is not None:
                from vmpin.service.domain_events import DomainEvents

                self._domain_events = DomainEvents.start(self.domains, self.notify)
        except BaseException:
            self._close_socket()
            if self._metrics_server is not None:
                self._metrics_server.close()
            if self._store is not None:
                self._store.close()
            self._release_lock()
            raise
        log_event(
            logging.INFO,
            "agent started",
            pid=os.getpid(),
            version=__version__,
            state_dir=self.paths.state_dir,
            socket=self.paths.control_socket,
            interval=self.interval,
            workers=self.n_workers,
            holdoff=self.queue.holdoff,
            metrics=(self._metrics_where(self._metrics_server.port)
                     if self._metrics_server else None),
            nofile=nofile,
            control_cap=self.caps[0],
            metrics_cap=self.caps[1],
        )
        self.full_pass("startup")

    def run(self) -> int:
        """The main thread: periodic passes until stopped, then drain; the exit code."""
        import select

        next_tick = time.monotonic() + self.interval
        while not self.stop_event.is_set():
            timeout = max(0.0, next_tick - time.monotonic())
            try:
                ready, _, _ = select.select([self._wake_r], [], [], timeout)
                if ready:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self._wake_r, 4096)
            except HOST_FAULTS as err:
                self.fault("main loop", err)
                time.sleep(0.1)  # (what failed is the wait itself: do not spin)
            if self._stop_signal is not None or self.stop_event.is_set():
                break
            with self._lock:
                requested, self._pass_requested = self._pass_requested, False
            if requested or time.monotonic() >= next_tick:
                try:
                    self.full_pass("periodic")
                except (VmpinError, sqlite3.Error) as err:
                    self.metrics.errors.labels("internal").inc()
                    log_event(logging.ERROR, "cannot start a pass", error=str(err))
                except HOST_FAULTS as err:  # issue 26: EMFILE here ended the agent (exit 134)
                    self.fault("periodic pass", err)
                next_tick = time.monotonic() + self.interval
        log_event(logging.INFO, "stopping", signal=self._stop_signal)
        return self.shutdown()

    def watch_signals(self) -> None:
        """Wake the main loop on any signal (main thread only; undone by :meth:`shutdown`)."""
        signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        self._wakeup_fd_set = True

    def request_stop(self, signum: int | None = None) -> None:
        """Safe from a signal handler: sets a flag and writes one byte, takes no lock."""
        if signum is not None:
            self._stop_signal = signum
        else:
            self.stop_event.set()
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def fault(self, where: str, err: BaseException) -> None:
        """An error one of the agent's loops outlives (the main loop and its periodic pass,
        the planner, the watcher, the accept loops): counted in ``vmpin_errors_total`` --
        ``host`` for what the host refused (EMFILE, ENFILE, ENOMEM, EIO: an OSError or
        MemoryError), ``internal`` for anything else -- and logged the first time per
        (where, what), then at most once a minute with how many went unsaid: a host out of
        fds must not also fill the node's journal.  The loop then tries again at its next
        turn (issue 26: an EMFILE in the periodic pass used to end the agent)."""
        # (a VmpinError translated from the host's OSError chains it: ``raise ... from err``)
        cause = err.__cause__ if isinstance(err.__cause__, HOST_FAULTS) else err
        host = isinstance(cause, HOST_FAULTS)
        self.metrics.errors.labels("host" if host else "internal").inc()
        code = getattr(cause, "errno", None)
        what = errno.errorcode.get(code, type(cause).__name__) if code else type(cause).__name__
        unsaid = self._faults.due((where, what))
        if unsaid is None:
            return
        fields = {"where": where, "error": what, "detail": str(err), "unsaid": unsaid}
        log.error(
            "host error: going on" if host else "internal error: going on",
            exc_info=None if host else err,
            extra={"fields": fields},
        )

    def shutdown(self) -> int:
        """Drain: drop queued periodic work (the next start repeats it), finish the events
        already queued while still accepting new ones (at most ``drain_timeout``), answer
        whoever still waits with ``done: false``, then close the socket and let the planner
        finish the pass it is on."""
        if self._watcher is not None:
            self._watcher.close()
        dropped = self.queue.drop_background()
        drained = self.queue.wait_idle(self.drain_timeout)
        self._release_waiters()  # no pass is coming for whoever still waits: done=false
        if self.kube is not None:
            self.kube.stop()
        self._close_socket()
        if self._domain_events is not None:
            self._domain_events.close()
        self.queue.close()
        for t in self._workers:
            t.join(timeout=self.drain_timeout)
        if self._metrics_server is not None:
            self._metrics_server.close()
        if self._store is not None:
            self._store.close()
        self._release_lock()
        if self._wakeup_fd_set:  # (before the fd is closed and its number reused)
            signal.set_wakeup_fd(-1)
            self._wakeup_fd_set = False
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)
        log_event(
            logging.INFO,
            "agent stopped",
            drained=drained,
            dropped_periodic=dropped,
            left=self.queue.depth(),
            plans=self._plans,
            events=self._events,
        )
        return self._exit_code

    # -- the state dir lock and the socket ---------------------------------------------------
    def _take_lock(self) -> None:
        from vmpin.state.locks import check_parent, open_lock_file

        path = os.path.join(self.paths.state_dir, "agent.lock")
        # owner-only, in a state dir no one else may write: whoever could open it could
        # keep every agent from starting (vmpin.state.locks)
        check_parent(self.paths.state_dir)
        fd = open_lock_file(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise AgentRunning(
                    f"another vmpin agent (pid {holder}) is running on {self.paths.state_dir}"
                ) from None
            raise StateError(f"{path}: {err.strerror}") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lockfd = fd

    def _release_lock(self) -> None:
        if self._lockfd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._lockfd, 0)
            os.close(self._lockfd)  # closing the last fd releases the flock
            self._lockfd = None

    # -- the control socket (vmpin.service.server) -------------------------------------------
    def _open_socket(self) -> None:
        slots = self.metrics.slots("control", self.caps[0], (b"\n",))
        self._server = ControlServer(
            self.paths, self.handle, self._refused, slots=slots, fault=self.fault
        )
        self._server.open()

    def _close_socket(self) -> None:
        if self._server is not None:
            self._server.close()

    def _refused(self) -> None:
        self.metrics.errors.labels("control").inc()

    # -- control requests -----------------------------------------------------------------
    def handle(self, line: bytes, answer: Reply | None = None) -> dict[str, Any] | None:
        """One request line -> one reply (a dict; ``ok`` says whether it was understood).

        None when the reply went out on ``answer`` already (a blocking ``dirty``, answered by
        the planner: :meth:`notify_and_wait`)."""
        try:
            msg = json.loads(line)
        except ValueError:
            return self._bad("request is not JSON")
        if not isinstance(msg, dict):
            return self._bad("request is not a JSON object")
        op = msg.get("op")
        if op == "dirty":
            ids = msg.get("sandboxes")
            if not isinstance(ids, list):
                return self._bad("dirty: 'sandboxes' must be a list of ids")
            try:
                sids = [check_id(s, "sandbox id") for s in ids]
            except IdError as err:
                return self._bad(f"dirty: {err}")
            if "wait" not in msg:
                return {"ok": True, "queued": self.notify(sids)}
            wait = msg["wait"]
            if (
                isinstance(wait, bool)
                or not isinstance(wait, (int, float))
                or not (math.isfinite(wait) and 0 < wait <= MAX_WAIT)
            ):
                return self._bad(f"dirty: 'wait' must be a number of seconds in (0, {MAX_WAIT:g}]")
            guest_map = msg.get("guest_map", "before")
            if guest_map not in ("before", "after"):
                return self._bad("dirty: 'guest_map' must be \"before\" or \"after\" the answer")
            maps_first = guest_map == "before"
            if answer is None:
                return self.notify_and_wait(sids, float(wait), maps_first=maps_first)
            self.notify_and_wait(sids, float(wait), answer, maps_first=maps_first)
            return None
        if op == "status":
            sid = msg.get("sandbox")
            return self.status(sid if isinstance(sid, str) else None)
        if op == "reconcile":
            with self._lock:
                self._pass_requested = True
            self._wake()
            return {"ok": True}
        return self._bad(f"unknown op {op!r} (dirty, status, reconcile)")

    def _bad(self, error: str) -> dict[str, Any]:
        self.metrics.errors.labels("control").inc()
        # said once a minute: whoever sends a flood of them must not fill the log too
        unsaid = self._faults.due(("control", "bad request"))
        if unsaid is not None:
            log_event(logging.WARNING, "bad control request", error=error, unsaid=unsaid)
        return {"ok": False, "error": error}

    def notify(self, sandbox_ids: list[str], *, urgent: bool = False) -> int:
        """Mark sandboxes dirty (their new level is already in the store); how many queued.

        ``urgent``: a caller blocks on the pass, so no hold-off (:class:`DirtyQueue`).
        """
        now = time.monotonic()
        added = self.queue.add_all(sandbox_ids, "event", now, urgent=urgent)
        queued = sum(added)
        self.metrics.events.inc(len(added))
        if len(added) > queued:
            self.metrics.coalesced.inc(len(added) - queued)
        with self._lock:
            self._events += len(sandbox_ids)
        return queued

    def notify_and_wait(
        self,
        sandbox_ids: list[str],
        wait: float,
        answer: Reply | None = None,
        *,
        maps_first: bool = True,
    ) -> dict[str, Any]:
        """The blocking ``dirty``: reply once a node pass that started after now has ended.

        Runs on the request's own connection thread (:class:`ControlServer` serves each
        connection on one), so the accept loop and other clients go on meanwhile.  No
        polling: the planner answers every waiter its pass satisfies at the end of that pass,
        itself, on the waiter's connection (``answer``), and only then wakes the waiting
        threads; a waiter past its deadline (or the agent stopping) answers ``done: false``
        itself.  A pass that raised does not count (the caller then does the work itself),
        a later one does.  The reply is returned too (for callers without a connection).
        ``maps_first``: the pass publishes its guest maps before answering (else after).
        """
        deadline = time.monotonic() + wait
        waiter = _Waiter(answer, maps_first)
        with self._pass_cond:
            # passes are numbered in the order they start, and one runs at a time: the first
            # to start from now on is number started + 1 (it ingests and reads the store
            # after this point, so it sees whatever the caller wrote before asking)
            waiter.target = self._node_started + 1
            if not maps_first:
                self._maps_after_coming += 1  # (a pass that starts now defers its maps)
        waiter.queued = self.notify(sandbox_ids, urgent=True)
        self.queue.kick()  # a pass even if every id folded into one running, or none was given
        with self._pass_cond:
            # registered once complete, so the planner answers it whole; a pass that ended
            # meanwhile is caught by the loop's first test
            self._waiters.append(waiter)
            if not maps_first:
                self._maps_after_coming -= 1
            while waiter.reply is None:
                if self._stopping or (
                    self._node_finished >= waiter.target
                    and (self._maps_done >= waiter.target or not maps_first)
                ):
                    self._answer(waiter)
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    self._answer(waiter)
                    break
                self._pass_cond.wait(left)
        assert waiter.reply is not None
        return waiter.reply

    def _answer(self, waiter: _Waiter) -> None:
        """Reply to one waiter (under ``_pass_cond``): done when its pass ended well."""
        if waiter in self._waiters:
            self._waiters.remove(waiter)
        waiter.reply = {
            "ok": True,
            "queued": waiter.queued,
            "done": self._node_ok >= waiter.target,
        }
        if waiter.answer is not None:
            waiter.answer.send(waiter.reply)

    def _release_waiters(self) -> None:
        with self._pass_cond:
            self._stopping = True
            self._pass_cond.notify_all()

    # -- passes -----------------------------------------------------------------------------
    def full_pass(self, cause: str) -> bool:
        """Queue every sandbox; False when the previous full pass has not finished yet."""
        assert self._store is not None
        with self._lock:
            if self._pass is not None:
                log_event(
                    logging.WARNING,
                    "previous pass still running: tick skipped",
                    number=self._pass.number,
                    remaining=len(self._pass.remaining),
                )
                return False
            self._passes += 1
            self._ingest(self._store)  # containers whose hooks nobody has applied yet
            ids = [s.id for s in self._store.sandboxes()]
            if self.domains is not None:
                # domains are not in the store; one node-wide pass covers them all
                ids.append(DOMAINS_WORK)
            # forget bookkeeping of sandboxes deleted behind our back (e.g. by a hook)
            for gone in set(self._stats) - set(ids):
                del self._stats[gone]
                self._stats_version += 1
            p = FullPass(self._passes, cause, ids)
            self._pass = p
        self.queue.add_all(ids, cause)  # all at once: one node pass, not a few and the rest
        if not ids:
            self._finish_pass_if_done(p)
        return True

    def _finish_pass_if_done(self, p: FullPass) -> None:
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

    def _planner(self) -> None:
        """The one planning thread: every ready entry -> one node pass -> each one accounted."""
        while True:
            try:
                store = Store(self.paths.state_dir)
                try:
                    reconciler = self._planner_setup(store)
                except BaseException:
                    store.close()
                    raise
                break
            except (StateError, sqlite3.Error, *HOST_FAULTS) as err:
                # the store cannot be opened now (EMFILE, ENOMEM, EIO): not a setting that
                # is wrong, so try again rather than end the agent
                self.fault("planner start", err)
                if self.stop_event.wait(min(self.interval, 5.0)) or self._stop_signal:
                    return
            except VmpinError as err:  # a setting the planner cannot plan with
                log_event(logging.ERROR, "planner cannot start", error=str(err))
                self.metrics.errors.labels("internal").inc()
                self._exit_code = 1
                self._release_waiters()
                self.request_stop()
                return
        with store:
            while True:
                batch = self.queue.take_batch()
                if batch is None:
                    return
                try:
                    self._run_batch(batch, store, reconciler)
                except Exception as err:  # after the pass (maps, settling): the next one runs
                    self.fault("planner", err)

    def _planner_setup(self, store: Store) -> Reconciler:
        # a waiting hook or `vmpin update` gets its answer before any sync: the pass's
        # writes reach the disk with the checkpoint after it (_settle)
        store.defer_durability()
        reconciler = self.reconciler_factory(store)
        # a replaced guest map is freed after the pass's answers, not in its rename
        # (~0.2 ms of a Kata hook's wait on ext4, issue 14)
        reconciler.held_maps = []
        # the agent plans for its whole life: a CPU hot(un)plugged is planned for at the
        # next pass (one read of the online list each)
        reconciler.follow_hotplug = True
        return reconciler

    def _run_batch(self, batch: list[Work], store: Store, reconciler: Reconciler) -> None:
        with self._pass_cond:
            self._node_started += 1
            number = self._node_started
            # the guest maps wait for the answers only when a waiter does not need them
            # first (vmpin update); else they are written in the pass, as they are made (a
            # full pass's 2,000 maps kept to its end were ~1 MB of the agent's RSS)
            later = self._maps_after_coming > 0 or any(not w.maps_first for w in self._waiters)
            reconciler.maps_later = [] if later else None
        ok = False
        try:
            self._node_pass(batch, store, reconciler)
            ok = True
        except HOST_FAULTS as err:  # EMFILE, ENOMEM, EIO: said once a minute, not per pass
            with self._lock:
                self._errors += 1
            self.fault("node pass", err)
        except Exception as err:  # the planner must survive any one pass
            self.metrics.errors.labels("internal").inc()
            with self._lock:
                self._errors += 1
            if isinstance(err, sqlite3.OperationalError):  # full (or gone read-only)
                if self.store_error is None:
                    log_event(logging.ERROR, "cannot write the store", error=str(err))
                self.store_error = f"{store.path}: {err}"
            log.error(
                "node pass failed",
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
        finally:
            self.queue.done_all([w.sandbox_id for w in batch])
            self._progress(batch)
            with self._pass_cond:
                self._node_finished = number
                if ok:
                    self._node_ok = number
                due = [w for w in self._waiters if w.target <= number]
                maps_now = any(w.maps_first for w in due)
                if maps_now:
                    # a Kata hook: its container's guest hook reads the map once it returns
                    self._publish_maps(reconciler, number)
                # answered from here, before their threads wake (Reply)
                for waiter in due:
                    self._answer(waiter)
                self._pass_cond.notify_all()
        if not maps_now:
            # after the answers: the maps no waiter needed first (an update's: the guest's
            # follower polls for it); a waiter that registered late waits for them
            self._publish_maps(reconciler, number)
            with self._pass_cond:
                if self._waiters:
                    self._pass_cond.notify_all()
        # the maps the pass replaced, freed now that no one waits (Reconciler.held_maps)
        reconciler.release_maps()
        # then the pass's journal events made durable, their files removed
        self._settle(store)

    def _publish_maps(self, reconciler: Reconciler, number: int) -> None:
        """The guest maps of pass ``number`` (and those before it) published."""
        try:
            reconciler.publish_maps()
        except Exception as err:  # the planner must survive any one pass (said once a minute)
            self.fault("publishing guest maps", err)
        self._maps_done = number

    def _settle(self, store: Store) -> None:
        try:
            store.settle_journal()
        except StateError as err:
            self._store_failed(err)

    def _metrics_where(self, port: int | None = None) -> str:
        host = self.metrics_address
        host = f"[{host}]" if ":" in host else host
        return f"{host}:{self.metrics_port if port is None else port}"

    def _store_failed(self, err: StateError) -> None:
        """A store that cannot be written (read-only, full), or whose journal the host does
        not let us read (EMFILE, EIO: a ``host`` fault, :meth:`fault`): logged once, shown
        in status until an ingest succeeds again."""
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
                self._store_failed(err)
                return
            for uid, ann in changes.items():
                if ann is None:
                    known.pop(uid, None)
                else:
                    known[uid] = dict(ann)
        self._api_policy_version = version

    def _ingest(self, store: Store, durable: bool = True) -> None:
        """Apply the journal; a store that cannot be written (read-only, full) is logged and
        shown in status, and the pass goes on pinning from what is stored and the host."""
        try:
            store.ingest(durable=durable)
        except StateError as err:
            self._store_failed(err)
        else:
            self.store_error = None

    def _progress(self, batch: list[Work]) -> None:
        """Tick the running full pass off for the entries it queued (not older ones)."""
        with self._lock:
            p = self._pass
            if p is None:
                return
            for work in batch:
                if work.taken_at >= p.started:
                    p.remaining.discard(work.sandbox_id)
        self._finish_pass_if_done(p)

    def _node_pass(self, batch: list[Work], store: Store, reconciler: Reconciler) -> None:
        """One node-wide pass for every sandbox in ``batch``, then each one's accounting.

        The journal is applied without waiting for the disk, and settled after the pass,
        once its waiters have their answer (:meth:`_settle`; issue 14: a Kata hook waits for
        this pass, and the sync and checkpoint were a third of it).
        """
        t0 = time.monotonic()
        # once per pass: a plain container's hook journals its event and only notifies us
        self._ingest(store, durable=False)
        self._record_api_policies(store)
        # each sandbox's generation before the pass (for drift), in one read
        recs = {rec.id: rec for rec in store.sandboxes()}
        ids = [w.sandbox_id for w in batch]
        reconciler.ingest_first = False  # (just done)
        reports = {r.id: r for r in reconciler.reconcile(ids)}
        if reconciler.went_unlocked:
            # another process held the node's plan lock past its wait (stopped, or stuck):
            # this pass went on without it, and either side plans again when needed
            log_event(
                logging.WARNING,
                "pass ran without the node lock",
                lock=reconciler.lock_error or f"held by another process past {WAIT:g} s",
            )
        self._note_conflicts(reconciler)
        # the node's plan (with the observation it holds) is not needed between passes: do
        # not keep every sandbox's plan alive until the next one (agent RSS, issue #14)
        reconciler.last_plan = None
        end = time.monotonic()
        self.metrics.sandbox_pass.observe(end - t0)
        self.metrics.node_passes.inc()
        with self._lock:
            self._node_passes += 1
        kube = self.kube
        now = time.time()
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
                    if kube is not None:
                        kube.forget_sandbox(sid, publish=False)
                    continue
                report = reports.get(sid)
                if report is None:  # gone during the pass
                    report = SandboxReport(sid, rec.runtime)
                    report.vanished = True
                plans[work.cause] = plans.get(work.cause, 0) + 1
                if work.first_event is not None:
                    self.metrics.latency.observe(end - work.first_event)
                drift = self._account(work, rec.gen, rec.dirty, report, now)
                if kube is not None:
                    kube.after_pass(rec, report, drift=drift, publish=False)
        finally:
            for cause, n in plans.items():
                self.metrics.plans.labels(cause).inc(n)
        if kube is not None:
            kube.publish()

    def _note_conflicts(self, reconciler: Reconciler) -> None:
        """Invariant 5: conflicting exclusive claims are a metric and a log line, never merged."""
        plan = reconciler.last_plan
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
        pinned_threads = []
        failed = []
        pinned: dict[str, int] = {}
        for t in r.threads:
            if t.action == "pinned":
                pinned_threads.append(t)
            elif t.action == "error":
                failed.append(t)
            # "ok" / "pinned": the kernel holds the plan (actual == desired, read back; a
            # container outside its cgroup's set is "drift"), so no need to compare again
            if (
                t.desired is not None
                and t.actual is not None
                and (t.action in _CARRYING or not t.violates())
            ):
                pinned[t.role] = pinned.get(t.role, 0) + 1
        cgroup_fixed = sum(1 for d in r.cgroup_drift if d.get("repaired")) if r.cgroup_drift else 0
        errors = list(r.errors) + [f"tid {t.tid}: {t.error}" for t in failed]
        for t in pinned_threads:
            self.metrics.affinity_writes.labels(t.role).inc()
        if failed:
            self.metrics.errors.labels("affinity").inc(len(failed))
        if r.errors:
            self.metrics.errors.labels("sandbox").inc(len(r.errors))
        if drift:
            if pinned_threads:
                self.metrics.drift.labels("thread").inc(len(pinned_threads))
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
                    p.repaired += len(pinned_threads) + cgroup_fixed + int(r.vanished)
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
        changed = bool(pinned_threads or cgroup_fixed or r.vanished or errors)
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
                pinned=len(pinned_threads),
                cgroups=cgroup_fixed,
                vanished=r.vanished,
                drift=drift and bool(pinned_threads or cgroup_fixed or r.vanished),
                errors=errors,
            )
        return drift

    # -- status and metrics ---------------------------------------------------------------------
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

    def _snapshot(self) -> Snapshot:
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

    def status(self, sandbox_id: str | None = None) -> dict[str, Any]:
        now = time.monotonic()
        runtimes, roles = self._snapshot()
        with self._lock:
            last_end = self._last_pass_end
            age = None if last_end is None else now - last_end
            # Healthy: the planner alive and a full pass finished lately (one may take
            # longer than an interval on a crowded node: allow three, plus start-up slack).
            workers_alive = sum(1 for t in self._workers if t.is_alive())
            since = age if age is not None else now - self.started
            healthy = (
                workers_alive == self.n_workers
                and since < 3 * self.interval + 10
                and self.store_error is None
            )
            out: dict[str, Any] = {
                "ok": True,
                "healthy": healthy,
                "pid": os.getpid(),
                "version": __version__,
                "uptime_s": round(now - self.started, 3),
                "interval_s": self.interval,
                "workers": workers_alive,
                "sandboxes": sum(n for n, _ in runtimes.values()),
                "containers": sum(c for _, c in runtimes.values()),
                "threads_pinned": sum(roles.values()),
                "queue": self.queue.depth(),
                "running": self.queue.running(),
                "events": self._events,
                "plans": self._plans,
                "node_passes": self._node_passes,
                "errors": self._errors,
                "passes": self._passes,
                "pass_running": self._pass is not None,
                "last_pass_age_s": None if age is None else round(age, 3),
                "journal_pending": journal.backlog(self.paths.state_dir),
                "journal_bad": journal.quarantined(self.paths.state_dir),
                "store_error": self.store_error,
                "metrics_error": self.metrics_error,
            }
            if self._last_pass is not None:
                out.update(
                    {f"last_pass_{k}": v for k, v in self._last_pass.items() if k != "number"}
                )
            if sandbox_id is not None:
                st = self._stats.get(sandbox_id)
                out["sandbox"] = None if st is None else {"id": sandbox_id, **st.to_json()}
        return out


def serve(
    ctx_obj: CtxLike,
    *,
    interval: float = DEFAULT_INTERVAL,
    workers: int = DEFAULT_WORKERS,
    metrics_port: int = 9464,
    metrics_address: str = "127.0.0.1",
    holdoff: float | None = None,
    env: Mapping[str, str] | None = None,
    kubeconfig: str | None = None,
    node_name: str | None = None,
) -> int:
    """Run the agent in the foreground until SIGTERM/SIGINT; the process exit code.

    ``holdoff`` (seconds; also ``VMPIN_HOLDOFF``) is the least time between two passes over
    one sandbox while events keep coming for it.
    """
    setup_logging()
    if holdoff is None:
        # VMPIN_HOLDOFF, read where every variable is read: Settings.from_env
        raw = ctx_obj.settings.holdoff if env is None else env.get("VMPIN_HOLDOFF", "")
        try:
            holdoff = float(raw) if raw else DEFAULT_HOLDOFF
        except ValueError:
            raise StateError(f"VMPIN_HOLDOFF={raw!r}: not a number of seconds") from None
        check_seconds(f"VMPIN_HOLDOFF={raw}", holdoff, low=0.0, high=MAX_HOLDOFF)
    agent = Agent(
        ctx_obj.paths,
        ctx_obj.reconciler,
        interval=interval,
        workers=workers,
        metrics_port=metrics_port,
        metrics_address=metrics_address,
        holdoff=holdoff,
        # vmpin.cli.Ctx.domains(): libvirt domains on the configured connections, if any
        domains=getattr(ctx_obj, "domains", lambda: None)(),
    )

    # The agent's policy is the node's: its own settings (defaults included) decide, never a
    # policy an earlier agent recorded; it is recorded for every other process once this
    # agent holds the node (below).
    ctx_obj.settings = ctx_obj.settings._replace(given=POLICY_KEYS)
    # Settings (policy, housekeeping set, guest float) are checked now, once, as one line --
    # not by each worker after start, which would leave an agent without workers.
    with Store(ctx_obj.paths.state_dir) as store:
        ctx_obj.reconciler(store)

    def on_signal(signum: int, frame: object) -> None:
        agent.request_stop(signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # The kernel delivers SIGTERM to any thread of the process, and a Python handler runs
    # only in the main thread once it runs Python again: with the signal taken by another
    # thread (libvirt's event loop sits in poll() all the time), the main thread slept in
    # its select() until the next periodic pass -- up to --interval -- before it stopped.
    # The wakeup fd is written by the C-level handler in whichever thread took the signal.
    agent.watch_signals()
    # SIGUSR1 writes every thread's stack to stderr (the C module: no import cost, works even
    # while a thread holds the GIL): what an operator, or a test, asks of an agent that does
    # not stop or answer.
    import faulthandler

    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        agent.start()
    except AgentRunning as err:
        log_event(logging.ERROR, "refusing to start", error=str(err))
        raise
    try:
        with Store(ctx_obj.paths.state_dir) as store:
            ctx_obj.settings.record(store, "vmpin serve")
    except StateError as err:
        agent._store_failed(err)
    try:
        # after start: the pod watch's first list re-queues every pod's sandboxes, so the
        # start-up pass needs no API; a bad kubeconfig stops the agent with one line
        attach_kube(agent, kubeconfig, node_name, os.environ if env is None else env)
    except VmpinError:
        agent.request_stop()
        agent.shutdown()
        raise
    return agent.run()


def attach_kube(
    agent: Agent,
    kubeconfig: str | None,
    node_name: str | None,
    env: Mapping[str, str],
    **kw: Any,
) -> None:
    """Connect the agent to the Kubernetes API when it is configured; say once when not.

    The client is imported only here, only when credentials are in sight (it costs 335 ms and
    35 MB of RSS).
    It is an extra (``vmpin[kube]``): without it the agent runs as without an API, and says so.
    """
    from vmpin.service.settings import kube_configured

    if not kube_configured(kubeconfig, env):  # asked before the client is imported (35 MB)
        log_event(logging.INFO, "no Kubernetes API configured: per-pod policy from OCI annotations"
             " only; no Events, no NodePinning report")
        return
    try:
        from vmpin.service.kube import connect_link
    except ImportError as err:
        log_event(
            logging.WARNING,
            "no Kubernetes client installed (pip install 'vmpin[kube]'): per-pod policy from OCI"
            " annotations only; no Events, no NodePinning report",
            error=str(err),
        )
        return
    import socket

    node = node_name or env.get("NODE_NAME") or socket.gethostname()
    paths = agent.paths

    def sandboxes_of_pod(uid: str) -> list[str]:
        with Store(paths.state_dir, ingest=False) as store:
            return [s.id for s in store.sandboxes() if s.pod_uid == uid]

    agent.kube = connect_link(
        kubeconfig, node, notify=agent.notify, sandboxes_of_pod=sandboxes_of_pod, **kw
    )
    if agent.kube is not None:
        log_event(logging.INFO, "Kubernetes API connected", node=node)


__all__ = [
    "CAUSES",
    "DEFAULT_HOLDOFF",
    "Agent",
    "AgentRunning",
    "DirtyQueue",
    "SandboxStat",
    "Work",
    "serve",
    "setup_logging",
]
