"""The node agent, ``vmpin serve``: coalesced event handling and periodic repair.

Everything works without it: hooks and ``vmpin update`` write the new level to the store and
reconcile their sandbox in-process when no agent answers.  When the agent runs they hand the
sandbox over instead (:mod:`vmpin.service.control`), which keeps hooks fast and turns update storms
into a handful of plans.  The shape::

    control socket ──► dirty set (per-sandbox coalescing) ──► the planner ──► Reconciler
    (server.py; a thread   (queue.py)      every ready entry: (one thread;
     per connection;          ▲            one node pass       agent_passes.py)
     agent_protocol.py)       │
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

The agent's rooms, each a small class given its collaborators:

- this module: :class:`Agent`, the lifecycle (the state dir's lock, the socket and the
  metrics port, the threads, signals, the drain) and the composition of the others;
  :func:`serve`, the foreground process;
- :mod:`vmpin.service.agent_protocol`: the control requests (``dirty``, ``status``,
  ``reconcile``; the wire format is there), notifications, and the blocking replies;
- :mod:`vmpin.service.agent_passes`: a full pass queued, the planner thread, a node pass;
- :mod:`vmpin.service.agent_accounting`: what the passes did, for ``status``, gauges, logs;
- beside them: the queue (:mod:`~vmpin.service.queue`), the socket
  (:mod:`~vmpin.service.server`), logs and faults (:mod:`~vmpin.service.logs`), metrics
  (:mod:`~vmpin.service.metrics`), the per-sandbox records (:mod:`~vmpin.service.workers`).
"""

from __future__ import annotations

import contextlib
import errno
import faulthandler
import fcntl
import logging
import math
import os
import select
import signal
import socket
import sqlite3
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from vmpin import __version__
from vmpin.core.errors import StateError, VmpinError
from vmpin.linux.paths import HostPaths
from vmpin.service import limits
from vmpin.service.agent_accounting import Accounting
from vmpin.service.agent_passes import Planner, ReconcilerFactory
from vmpin.service.agent_protocol import ControlProtocol, Waiters
from vmpin.service.agent_updates import AgentUpdates
from vmpin.service.agent_views import AgentViews
from vmpin.service.logs import HOST_FAULTS, Faults, log_event, setup_logging
from vmpin.service.metrics import Metrics, MetricsServer
from vmpin.service.queue import CAUSES, DEFAULT_HOLDOFF, DirtyQueue, Work
from vmpin.service.server import AgentRunning, ControlServer
from vmpin.service.settings import POLICY_KEYS, Settings, kube_configured
from vmpin.service.workers import SandboxStat
from vmpin.state import journal
from vmpin.state.locks import check_parent, open_lock_file
from vmpin.state.store import Store

if TYPE_CHECKING:
    from vmpin.reconcile.domains import LibvirtDomains
    from vmpin.service.kube import KubeLink

DEFAULT_INTERVAL = 5.0
DEFAULT_WORKERS = 2
DEFAULT_DRAIN_TIMEOUT = 10.0


class CtxLike(Protocol):
    """What the CLI hands :func:`serve` (``vmpin.cli.Ctx``), without importing typer here."""

    paths: HostPaths
    settings: Settings

    @property
    def reconciler(self) -> ReconcilerFactory: ...


MAX_INTERVAL = 86400.0
MAX_HOLDOFF = 60.0
MAX_WORKERS = 64
#: the agent's nice value unless VMPIN_AGENT_NICE says otherwise (docs/agent.md, "Priority")
DEFAULT_NICE = -5


def check_seconds(name: str, value: float, *, low: float, high: float) -> float:
    """A duration option: finite and in range (``nan`` compares false to everything, so a
    ``<= 0`` check lets it through, and ``inf`` overflows every timer)."""
    if not (isinstance(value, (int, float)) and math.isfinite(value) and low <= value <= high):
        raise StateError(f"{name} {value}: must be a number of seconds in {low:g}..{high:g}")
    return float(value)


def take_priority(raw: str) -> int:
    """Set this process's nice value from ``VMPIN_AGENT_NICE`` (``raw``; "" = DEFAULT_NICE)
    before any thread starts (each thread inherits it from the one that starts it); the value.

    Why above the node's default: a pin that comes late lets a sandbox's threads run on other
    pods' exclusive CPUs meanwhile, and the shared CPUs are busiest -- container starts are
    hook processes -- exactly when pins are due (the figures: docs/agent.md, "Priority").
    Its work per event is bounded, so a higher weight costs the others little.  Without
    CAP_SYS_NICE the value cannot go down: the agent says so and runs at the one it has.
    """
    try:
        nice = int(raw) if raw else DEFAULT_NICE
    except ValueError:
        raise StateError(f"VMPIN_AGENT_NICE={raw!r}: not a nice value (-20..19)") from None
    if not -20 <= nice <= 19:
        raise StateError(f"VMPIN_AGENT_NICE={raw}: not a nice value (-20..19)")
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    except OSError as err:
        have = os.getpriority(os.PRIO_PROCESS, 0)
        log_event(
            logging.WARNING, "priority not set", nice=nice, running_at=have, error=err.strerror
        )
        return have
    return nice


def take_lock(state_dir: str) -> int:
    """One agent per state dir: an exclusive ``flock`` on ``agent.lock`` (released by the
    kernel even on kill -9) holding our pid; its fd."""
    path = os.path.join(state_dir, "agent.lock")
    # owner-only, in a state dir no one else may write: whoever could open it could
    # keep every agent from starting (vmpin.state.locks)
    check_parent(state_dir)
    fd = open_lock_file(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise AgentRunning(
                f"another vmpin agent (pid {holder}) is running on {state_dir}"
            ) from None
        raise StateError(f"{path}: {err.strerror}") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def release_lock(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
    os.close(fd)  # closing the last fd releases the flock


class Agent:
    """The agent's life: start, the main loop, signals, the drain; and what it is made of.

    Its parts are built here and handed their collaborators: :class:`Accounting`,
    :class:`Waiters` and :class:`ControlProtocol` (the socket's requests), :class:`Planner`
    (the passes).  What others call on the agent -- the socket's ``handle``, the watchers'
    and the Kubernetes link's ``notify``, ``fault`` -- are those parts' methods.
    """

    def __init__(
        self,
        paths: HostPaths,
        reconciler_factory: ReconcilerFactory,
        *,
        interval: float = DEFAULT_INTERVAL,
        workers: int = DEFAULT_WORKERS,
        metrics_port: int = 0,
        metrics_address: str = "127.0.0.1",
        holdoff: float = DEFAULT_HOLDOFF,
        drain_timeout: float = DEFAULT_DRAIN_TIMEOUT,
        metrics: Metrics | None = None,
        domains: LibvirtDomains | None = None,
        settings: Settings | None = None,
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
        #: libvirt domains (vmpin.reconcile.domains): planned in every node-wide pass; their
        #: lifecycle events queue work (vmpin.service.domain_events)
        self.domains = domains
        self._domain_events: Any = None
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
        self._lock = threading.Lock()  # guards _pass_requested
        self._pass_requested = False
        self._workers: list[threading.Thread] = []
        self._server: ControlServer | None = None
        self._lockfd: int | None = None
        self._metrics_server: MetricsServer | None = None
        #: (control, metrics) connections at once, sized from the fd limit at start
        self.caps = (limits.CONTROL_CAP, limits.METRICS_CAP)
        #: the main thread's connection: each full pass applies the journal and lists the
        #: sandboxes on it (the planner has its own)
        self._store: Store | None = None
        self._watcher: Any = None  # vmpin.service.watch.Watcher: runc/kubelet changes -> notify
        self.metrics_error: str | None = None
        # -- the parts ----------------------------------------------------------------------
        #: recurring faults of the loops, counted, and said once a minute
        self.faults = Faults(lambda kind: self.metrics.errors.labels(kind).inc())
        self.fault = self.faults.report
        self.accounting = Accounting(paths, self.metrics)
        self.waiters = Waiters(self.fault)
        #: the read commands' views, from the planner's plans (``settings``: what the agent
        #: plans with, which a command's must match; default, the defaults on ``paths``)
        self.views = AgentViews(paths.state_dir, settings or Settings(paths), self.queue)
        self.control = ControlProtocol(
            self.queue, self.waiters, self.metrics, self.accounting,
            status=self.status, request_pass=self.request_pass, views=self.views.answer,
        )  # fmt: skip
        self.handle = self.control.handle
        self.notify = self.control.notify
        self.notify_and_wait = self.control.notify_and_wait
        self.planner = Planner(
            paths, reconciler_factory, self.queue, self.waiters, self.accounting, self.metrics,
            fault=self.fault, pause=self._pause, fatal=self._planner_failed,
            interval=interval, domains=domains is not None,
        )  # fmt: skip
        self.planner.views = self.views
        #: ``vmpin update`` written and re-pinned here (its own store connection, whose
        #: writes queue with the planner's on its lock)
        self.updates = AgentUpdates(
            paths, self.control.update_and_wait, write_lock=self.planner.write_lock
        )
        self.control.updates = self.updates.answer
        self.metrics.track_state(self.accounting.snapshot)
        self.metrics.track_queue(self.queue.depth, self.queue.running)
        self.metrics.track_journal(
            lambda: float(journal.backlog(paths.state_dir)),
            lambda: float(journal.quarantined(paths.state_dir)),
        )

    @property
    def kube(self) -> KubeLink | None:
        """The Kubernetes link (vmpin.service.kube) when the API is configured
        (:func:`attach_kube`)."""
        return self.planner.kube

    @kube.setter
    def kube(self, link: KubeLink | None) -> None:
        self.planner.kube = link

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Lock the state dir, open the socket and metrics, start workers, queue the start pass."""
        try:
            os.makedirs(self.paths.state_dir, mode=0o700, exist_ok=True)
        except OSError as err:
            raise StateError(f"{self.paths.state_dir}: {err.strerror}") from None
        self._lockfd = take_lock(self.paths.state_dir)
        # the soft fd limit up to the hard one, and the endpoints' caps sized from it
        # (vmpin.service.limits): what they serve can never take the passes' fds
        was, nofile, hard = limits.raise_nofile()
        if nofile != was:
            log_event(logging.INFO, "fd limit raised", soft=nofile, was=was, hard=hard)
        self.caps = limits.caps(nofile)
        try:
            self._store = Store(self.paths.state_dir)
            self._store.local_lock = self.planner.write_lock
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
            t = threading.Thread(target=self.planner.run, name="vmpin-planner", daemon=True)
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

    def full_pass(self, cause: str) -> bool:
        """Queue every sandbox (:meth:`Planner.full_pass`); False when the previous full pass
        has not finished yet."""
        assert self._store is not None
        return self.planner.full_pass(self._store, cause)

    def request_pass(self) -> None:
        """A full pass as soon as the main loop wakes (``{"op":"reconcile"}``)."""
        with self._lock:
            self._pass_requested = True
        self._wake()

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

    def _pause(self, seconds: float) -> bool:
        """Wait up to ``seconds``; True when the agent is stopping."""
        return self.stop_event.wait(seconds) or bool(self._stop_signal)

    def _planner_failed(self) -> None:
        """The planner cannot start (a setting it cannot plan with): the agent ends, 1."""
        self._exit_code = 1
        self.waiters.release()
        self.request_stop()

    def shutdown(self) -> int:
        """Drain: drop queued periodic work (the next start repeats it), finish the events
        already queued while still accepting new ones (at most ``drain_timeout``), answer
        whoever still waits with ``done: false``, then close the socket and let the planner
        finish the pass it is on."""
        if self._watcher is not None:
            self._watcher.close()
        dropped = self.queue.drop_background()
        drained = self.queue.wait_idle(self.drain_timeout)
        self.waiters.release()  # no pass is coming for whoever still waits: done=false
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
        self.views.close()
        self.updates.close()
        self._release_lock()
        if self._wakeup_fd_set:  # (before the fd is closed and its number reused)
            signal.set_wakeup_fd(-1)
            self._wakeup_fd_set = False
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)
        plans, events = self.accounting.totals()
        log_event(
            logging.INFO,
            "agent stopped",
            drained=drained,
            dropped_periodic=dropped,
            left=self.queue.depth(),
            plans=plans,
            events=events,
        )
        return self._exit_code

    # -- the state dir lock, the control socket (vmpin.service.server), the metrics port ------
    def _release_lock(self) -> None:
        if self._lockfd is not None:
            release_lock(self._lockfd)
            self._lockfd = None

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

    def _metrics_where(self, port: int | None = None) -> str:
        host = self.metrics_address
        host = f"[{host}]" if ":" in host else host
        return f"{host}:{self.metrics_port if port is None else port}"

    # -- status ---------------------------------------------------------------------------
    def status(self, sandbox_id: str | None = None) -> dict[str, Any]:
        """``{"op":"status"}``: health, counters, and one sandbox's bookkeeping when asked."""
        now = time.monotonic()
        runtimes, roles = self.accounting.snapshot()
        tally = self.accounting.tally(sandbox_id)
        age = None if tally.last_pass_end is None else now - tally.last_pass_end
        # Healthy: the planner alive and a full pass finished lately (one may take longer
        # than an interval on a crowded node: allow three, plus start-up slack).
        workers_alive = sum(1 for t in self._workers if t.is_alive())
        since = age if age is not None else now - self.started
        store_error = self.planner.store_error
        healthy = (
            workers_alive == self.n_workers
            and since < 3 * self.interval + 10
            and store_error is None
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
            "events": tally.events,
            "plans": tally.plans,
            "node_passes": tally.node_passes,
            "errors": tally.errors,
            "passes": tally.passes,
            "pass_running": tally.pass_running,
            "last_pass_age_s": None if age is None else round(age, 3),
            "journal_pending": journal.backlog(self.paths.state_dir),
            "journal_bad": journal.quarantined(self.paths.state_dir),
            "store_error": store_error,
            "metrics_error": self.metrics_error,
        }
        if tally.last_pass is not None:
            out.update({f"last_pass_{k}": v for k, v in tally.last_pass.items() if k != "number"})
        if sandbox_id is not None:
            out["sandbox"] = tally.sandbox
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
    setup_logging(level=ctx_obj.settings.log_level)
    if holdoff is None:
        # VMPIN_HOLDOFF, read where every variable is read: Settings.from_env
        raw = ctx_obj.settings.holdoff if env is None else env.get("VMPIN_HOLDOFF", "")
        try:
            holdoff = float(raw) if raw else DEFAULT_HOLDOFF
        except ValueError:
            raise StateError(f"VMPIN_HOLDOFF={raw!r}: not a number of seconds") from None
        check_seconds(f"VMPIN_HOLDOFF={raw}", holdoff, low=0.0, high=MAX_HOLDOFF)
    take_priority(ctx_obj.settings.nice if env is None else env.get("VMPIN_AGENT_NICE", ""))
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
        # (the policy keys are the agent's own: as set just below)
        settings=ctx_obj.settings._replace(given=POLICY_KEYS),
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
        agent.planner.store_failed(err)
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
