"""The agent's Prometheus metrics, and the small HTTP endpoint that serves them.

Written here rather than with prometheus_client (issue 14, agent RSS): importing that package
runs its ``__init__``, which imports http.server, urllib.request, ssl, email and wsgiref --
11.5 MB of the agent's RSS here (VmRSS after each import), for three metric kinds and one
text format.  What this module keeps of it, and checks against it
(``tests/service/test_metrics.py`` drives both with the same operations and compares the bytes
of ``/metrics``): the Prometheus text format 0.0.4 exactly as ``generate_latest`` writes it
(``# HELP`` / ``# TYPE`` per family, counters exposed as ``<name>_total``, histogram buckets
cumulative with ``le`` as Go prints floats, then ``_count`` and ``_sum``; no ``*_created``
series), ``Content-Type: text/plain; version=0.0.4; charset=utf-8``, gzip when the scraper
accepts it, GET and OPTIONS only.  What it does not: OpenMetrics negotiation (a Prometheus
server that asks for it first gets the 0.0.4 text, which it reads as well: same series) and
``name[]`` filtering.  Every registry is the instance's own, so several agents can run in one
test process and nothing else in the process leaks into vmpin's /metrics.

What is exported, and what question each answers:

=====================================  ======================================================
``vmpin_sandboxes{runtime}``           how many sandboxes the agent keeps pinned
``vmpin_containers{runtime}``          ... and containers in them
``vmpin_threads_pinned{role}``         threads carrying their plan after the last pass over
                                       their sandbox (role: vcpu, iothread, vhost, emulator,
                                       container)
``vmpin_plans_total{cause}``           sandboxes planned (each one's share of a node pass):
                                       cause ``event`` (a notification), ``periodic``,
                                       ``startup``
``vmpin_node_passes_total``            node-wide passes (observe, plan, apply the node): one
                                       covers every sandbox that was ready when it started
``vmpin_events_total``                 dirty notifications received on the control socket
``vmpin_events_coalesced_total``       ... of which folded into a pass already queued/running
``vmpin_affinity_writes_total{role}``  sched_setaffinity calls that took
``vmpin_drift_repaired_total{kind}``   repairs no event asked for: ``thread`` (a thread off
                                       its plan: hand-changed, hot-plugged vCPU, new vhost
                                       worker), ``cgroup`` (a runc cpuset rewritten behind
                                       vmpin's back), ``vanished`` (a VMM or container gone
                                       without a poststop)
``vmpin_errors_total{kind}``           ``affinity`` (a thread write refused), ``sandbox`` (a
                                       pass reported an error), ``internal`` (a pass raised),
                                       ``control`` (a malformed request), ``host`` (the host
                                       refused a loop of the agent: EMFILE, ENOMEM, EIO; it
                                       went on)
``vmpin_pin_latency_seconds``          from a dirty notification to its sandbox's threads
                                       carrying the new plan (read back from the kernel)
``vmpin_sandbox_pass_seconds``         one node pass run for dirty sandboxes (refresh, plan,
                                       apply, verify; the name is older than the batching)
``vmpin_event_pass_cpu_seconds``       the planner thread's CPU time for one node pass
                                       whose every sandbox came from an event (ingest,
                                       pass, answers, maps, bookkeeping; the settling is
                                       another thread's): what an update costs the agent,
                                       whatever the machine's load (issue 28)
``vmpin_event_pass_seconds``           ... its wall time, from its start to its threads
                                       pinned (what its waiters wait for, once it started)
``vmpin_queue_wait_seconds``           from a dirty notification to the start of the node
                                       pass that takes it: the rest of the pass running
                                       when it came, a hold-off (with the pass's own time:
                                       ``vmpin_pin_latency_seconds``)
``vmpin_pass_tail_seconds``            from a node pass's answers to the planner free for
                                       the next one (guest maps published late, the
                                       bookkeeping): what a request arriving then waits
                                       for before its own pass starts
``vmpin_full_pass_seconds``            one periodic pass over every sandbox (wall time)
``vmpin_full_pass_cpu_seconds``        CPU time of the last periodic pass (the whole process)
``vmpin_last_full_pass_timestamp``     when the last periodic pass finished (unix time)
``vmpin_queue_depth`` / ``vmpin_running``  sandboxes waiting / being planned right now
``vmpin_connections{endpoint}``        connections open now on the ``control`` socket and
                                       the ``metrics`` port (each capped:
                                       :mod:`vmpin.service.limits`)
``vmpin_connections_dropped_total``    ... closed unanswered, by ``endpoint`` and ``reason``:
                                       ``over_cap`` (refused at once: every slot was being
                                       answered), ``evicted`` (the oldest still sending its
                                       request, for a new one), ``timeout`` (request or reply
                                       past its deadline), ``too_large``
=====================================  ======================================================
"""

from __future__ import annotations

import bisect
import contextlib
import math
import socket
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Generic, TypeVar

from vmpin import __version__
from vmpin.service.limits import (
    ACCEPT_BACKOFF,
    ENDPOINTS,
    METRICS_CAP,
    METRICS_READ_TIMEOUT,
    METRICS_WRITE_TIMEOUT,
    REASONS,
    Cut,
    Slot,
    Slots,
    arrived,
    read_request,
    start_thread,
)

#: Latency buckets: a pin normally lands in a few ms; a storm's holdoff adds ~0.1 s.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
PASS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

#: (runtime -> (sandboxes, containers), role -> threads pinned): what the state gauges show.
Snapshot = tuple[Mapping[str, tuple[int, int]], Mapping[str, int]]

#: what /metrics is served as (prometheus_client's CONTENT_TYPE_PLAIN_0_0_4)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
INF = float("inf")


# -- the text format ----------------------------------------------------------------------------
def go_float(d: float) -> str:
    """A sample value as Prometheus clients print it (Go's formatting: ``+Inf``, ``NaN``, an
    exponent from 1e+06 up; Python's repr otherwise, so 1 is ``1.0``)."""
    d = float(d)
    if d == INF:
        return "+Inf"
    if d == -INF:
        return "-Inf"
    if math.isnan(d):
        return "NaN"
    s = repr(d)
    dot = s.find(".")
    if d > 0 and dot > 6:
        mantissa = f"{s[0]}.{s[1:dot]}{s[dot + 1:]}".rstrip("0.")
        return f"{mantissa}e+{dot - 1:02d}"
    return s


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')


class Family:
    """One collected metric family: its name (a counter's without ``_total``), type, help, and
    samples (full sample name, labels, value)."""

    __slots__ = ("help", "name", "samples", "type")

    def __init__(
        self, name: str, type: str, help: str, samples: list[tuple[str, dict[str, str], float]]
    ) -> None:
        self.name, self.type, self.help, self.samples = name, type, help, samples

    def text(self) -> str:
        """The family in the text format 0.0.4, as prometheus_client's generate_latest writes it."""
        name = self.name + "_total" if self.type == "counter" else self.name
        doc = self.help.replace("\\", r"\\").replace("\n", r"\n")
        out = [f"# HELP {name} {doc}\n# TYPE {name} {self.type}\n"]
        for sample, labels, value in self.samples:
            if labels:
                pairs = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
                out.append(f"{sample}{{{pairs}}} {go_float(value)}\n")
            else:
                out.append(f"{sample} {go_float(value)}\n")
        return "".join(out)


class Registry:
    """The metric families of one agent, collected in the order they were registered."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._collectors: list[Callable[[], Iterable[Family]]] = []

    def register(self, collect: Callable[[], Iterable[Family]]) -> None:
        with self._lock:
            self._collectors.append(collect)

    def collect(self) -> Iterator[Family]:
        with self._lock:
            collectors = list(self._collectors)
        for collect in collectors:
            yield from collect()

    def exposition(self) -> bytes:
        """Every family in the Prometheus text format 0.0.4 (the body of /metrics)."""
        return "".join(f.text() for f in self.collect()).encode()

    def get_sample_value(self, name: str, labels: Mapping[str, str] | None = None) -> float | None:
        """One sample's value, or None (for tests, as prometheus_client's)."""
        want = dict(labels or {})
        for family in self.collect():
            for sample, got, value in family.samples:
                if sample == name and got == want:
                    return value
        return None


# -- the three kinds --------------------------------------------------------------------------
class _Value:
    """A counter's or a gauge's value; a gauge's may be computed at scrape time."""

    __slots__ = ("_fn", "_lock", "_value")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._value = 0.0
        self._fn: Callable[[], float] | None = None

    def inc(self, amount: float = 1.0) -> None:
        with self._lock:
            self._value += amount

    def get(self) -> float:
        fn = self._fn
        return float(fn()) if fn is not None else self._value


class CounterChild(_Value):
    __slots__ = ()

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("counters can only be incremented by non-negative amounts")
        _Value.inc(self, amount)  # (not through super(): an object made per call)


class GaugeChild(_Value):
    __slots__ = ()

    def set(self, value: float) -> None:
        with self._lock:
            self._value = float(value)

    def dec(self, amount: float = 1.0) -> None:
        self.inc(-amount)

    def set_to_current_time(self) -> None:
        self.set(time.time())

    def set_function(self, fn: Callable[[], float]) -> None:
        self._fn = fn


class HistogramChild:
    __slots__ = ("_bounds", "_counts", "_lock", "_sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._lock = threading.Lock()
        self._bounds = bounds
        self._counts = [0.0] * len(bounds)
        self._sum = 0.0

    def observe(self, value: float) -> None:
        with self._lock:
            self._sum += value
            self._counts[bisect.bisect_left(self._bounds, value)] += 1  # first bound >= value

    def samples(self, name: str, labels: dict[str, str]) -> list[tuple[str, dict[str, str], float]]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        out = []
        acc = 0.0
        for bound, n in zip(self._bounds, counts, strict=True):
            acc += n
            out.append((name + "_bucket", {**labels, "le": go_float(bound)}, acc))
        out.append((name + "_count", dict(labels), acc))
        out.append((name + "_sum", dict(labels), total))
        return out


_C = TypeVar("_C", CounterChild, GaugeChild, HistogramChild)


class _Metric(Generic[_C]):
    """A family of children, one per label values (one, with no labels, for an unlabelled
    metric); registered with its registry at creation.

    The agent touches a few metrics per request and a few more per pass (issue 28: on the
    connection thread before the planner it woke gets the GIL, and in the pass's work after
    its answer): an unlabelled metric's child is at hand (``_one``), and a labelled one's
    is found by the label values as given when they are strings (as every caller's are),
    with no lock (only a child's making takes it)."""

    type = ""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Iterable[str] = (),
        *,
        registry: Registry,
    ) -> None:
        self.name, self.help = name, documentation
        self.labelnames = tuple(labelnames)
        self._lock = threading.Lock()
        self._children: dict[tuple[str, ...], _C] = {}
        #: the child of an unlabelled metric (None: labelled)
        self._one: _C | None = None
        if not self.labelnames:
            self._one = self._children[()] = self._child()
        registry.register(self.collect)

    def _child(self) -> _C:
        raise NotImplementedError

    def labels(self, *values: object) -> _C:
        if values:
            # (a child once made stays; the key is its values as strings, which no value
            # of another type equals: those, and a wrong count, take the checks below)
            child = self._children.get(values)  # type: ignore[arg-type]
            if child is not None:
                return child
        if not self.labelnames:
            raise ValueError(f"{self.name}: no labels")
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name}: expected labels {self.labelnames}")
        key = tuple(map(str, values))
        child = self._children.get(key)
        if child is None:
            with self._lock:
                child = self._children.get(key)
                if child is None:
                    child = self._children[key] = self._child()
        return child

    def _only(self) -> _C:
        if self._one is None:
            raise ValueError(f"{self.name}: labels {self.labelnames} missing")
        return self._one

    def _child_samples(
        self, child: _C, labels: dict[str, str]
    ) -> list[tuple[str, dict[str, str], float]]:
        assert isinstance(child, _Value)
        return [(self._sample_name(), labels, child.get())]

    def _sample_name(self) -> str:
        return self.name

    def collect(self) -> list[Family]:
        with self._lock:
            children = list(self._children.items())
        samples = []
        for key, child in children:
            samples += self._child_samples(child, dict(zip(self.labelnames, key, strict=True)))
        return [Family(self.name, self.type, self.help, samples)]


class Counter(_Metric[CounterChild]):
    type = "counter"

    def __init__(
        self, name: str, documentation: str, labelnames: Iterable[str] = (), *, registry: Registry
    ) -> None:
        super().__init__(name.removesuffix("_total"), documentation, labelnames, registry=registry)

    def _child(self) -> CounterChild:
        return CounterChild()

    def _sample_name(self) -> str:
        return self.name + "_total"

    def inc(self, amount: float = 1.0) -> None:
        self._only().inc(amount)


class Gauge(_Metric[GaugeChild]):
    type = "gauge"

    def _child(self) -> GaugeChild:
        return GaugeChild()

    def set(self, value: float) -> None:
        self._only().set(value)

    def inc(self, amount: float = 1.0) -> None:
        self._only().inc(amount)

    def dec(self, amount: float = 1.0) -> None:
        self._only().dec(amount)

    def set_to_current_time(self) -> None:
        self._only().set_to_current_time()

    def set_function(self, fn: Callable[[], float]) -> None:
        self._only().set_function(fn)


class Histogram(_Metric[HistogramChild]):
    type = "histogram"

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Iterable[str] = (),
        *,
        buckets: Iterable[float],
        registry: Registry,
    ) -> None:
        bounds = [float(b) for b in buckets]
        if bounds != sorted(bounds):
            raise ValueError(f"{name}: buckets not in order")
        if not bounds or bounds[-1] != INF:
            bounds.append(INF)
        self._bounds = tuple(bounds)
        super().__init__(name, documentation, labelnames, registry=registry)

    def _child(self) -> HistogramChild:
        return HistogramChild(self._bounds)

    def _child_samples(
        self, child: HistogramChild, labels: dict[str, str]
    ) -> list[tuple[str, dict[str, str], float]]:
        return child.samples(self.name, labels)

    def observe(self, value: float) -> None:
        self._only().observe(value)


def _state_families(snapshot: Callable[[], Snapshot]) -> list[Family]:
    """Gauges computed at scrape time from the agent's per-sandbox bookkeeping."""
    runtimes, roles = snapshot()
    ordered = sorted(runtimes.items())
    return [
        Family("vmpin_sandboxes", "gauge", "Sandboxes the agent tracks",
               [("vmpin_sandboxes", {"runtime": rt}, float(s)) for rt, (s, _) in ordered]),
        Family("vmpin_containers", "gauge", "Containers in the tracked sandboxes",
               [("vmpin_containers", {"runtime": rt}, float(c)) for rt, (_, c) in ordered]),
        Family(
            "vmpin_threads_pinned",
            "gauge",
            "Threads carrying their planned affinity after the last pass over their sandbox",
            [("vmpin_threads_pinned", {"role": role}, float(n))
             for role, n in sorted(roles.items())],
        ),
    ]  # fmt: skip


class Metrics:
    """Every metric the agent updates; ``registry`` is private to this instance."""

    def __init__(self, registry: Registry | None = None) -> None:
        # (no *_created series: they would double every counter's lines and say nothing here)
        self.registry = registry if registry is not None else Registry()
        r = self.registry
        self.plans = Counter(
            "vmpin_plans", "Sandboxes planned by the agent's node passes", ["cause"], registry=r
        )
        self.node_passes = Counter(
            "vmpin_node_passes",
            "Node-wide passes, each covering every sandbox ready when it started",
            registry=r,
        )
        self.events = Counter("vmpin_events", "Dirty notifications received", registry=r)
        self.coalesced = Counter(
            "vmpin_events_coalesced",
            "Notifications folded into a sandbox pass already queued or running",
            registry=r,
        )
        self.affinity_writes = Counter(
            "vmpin_affinity_writes",
            "Thread affinities set (and read back as set)",
            ["role"],
            registry=r,
        )
        self.drift = Counter(
            "vmpin_drift_repaired", "Drift repaired that no event asked for", ["kind"], registry=r
        )
        self.errors = Counter("vmpin_errors", "Errors by kind", ["kind"], registry=r)
        self.latency = Histogram(
            "vmpin_pin_latency_seconds",
            "From a dirty notification to its sandbox's threads carrying the plan",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.sandbox_pass = Histogram(
            "vmpin_sandbox_pass_seconds",
            "One node pass run for dirty sandboxes: refresh, plan, apply, verify",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.event_pass_cpu = Histogram(
            "vmpin_event_pass_cpu_seconds",
            "The planner thread's CPU time for one node pass run for events alone",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.event_pass = Histogram(
            "vmpin_event_pass_seconds",
            "Wall time of one node pass run for events alone, from its start to its threads"
            " pinned",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "vmpin_queue_wait_seconds",
            "From a dirty notification to the start of the node pass that takes it",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.pass_tail = Histogram(
            "vmpin_pass_tail_seconds",
            "From a node pass's answers to the planner free for the next pass",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.full_pass = Histogram(
            "vmpin_full_pass_seconds",
            "Wall time of one periodic pass over every sandbox",
            buckets=PASS_BUCKETS,
            registry=r,
        )
        self.full_pass_cpu = Gauge(
            "vmpin_full_pass_cpu_seconds",
            "CPU time (whole process) of the last periodic pass",
            registry=r,
        )
        self.last_full_pass = Gauge(
            "vmpin_last_full_pass_timestamp",
            "Unix time the last periodic pass finished",
            registry=r,
        )
        self.queue_depth = Gauge("vmpin_queue_depth", "Sandboxes waiting for a pass", registry=r)
        self.running = Gauge("vmpin_running", "Sandboxes being planned right now", registry=r)
        self.journal_pending = Gauge(
            "vmpin_journal_pending", "Hook events journaled and not yet applied", registry=r
        )
        self.journal_quarantined = Gauge(
            "vmpin_journal_quarantined",
            "Journal entries that could not be applied, moved to journal/bad/",
            registry=r,
        )
        info = Gauge("vmpin_agent_info", "The running agent", ["version"], registry=r)
        info.labels(__version__).set(1)
        self.connections = Gauge(
            "vmpin_connections",
            "Connections open now, per endpoint (control socket, metrics port)",
            ["endpoint"],
            registry=r,
        )
        self.connections_dropped = Counter(
            "vmpin_connections_dropped",
            "Connections closed unanswered: over_cap (refused at once), evicted (the oldest"
            " still sending its request, for a new one), timeout, too_large",
            ["endpoint", "reason"],
            registry=r,
        )
        self.conflicts = Gauge(
            "vmpin_conflicts",
            "Pairs of pods claiming one exclusive CPU in the last plan (invariant 5)",
            registry=r,
        )
        for kind in ("affinity", "sandbox", "internal", "control", "host"):
            self.errors.labels(kind)  # export zeros, so rate() works from the first scrape
        for kind in ("thread", "cgroup", "vanished"):
            self.drift.labels(kind)
        for endpoint in ENDPOINTS:
            self.connections.labels(endpoint)
            for reason in REASONS:
                self.connections_dropped.labels(endpoint, reason)
        for cause in ("event", "periodic", "startup"):
            self.plans.labels(cause)

    def track_state(self, snapshot: Callable[[], Snapshot]) -> None:
        self.registry.register(lambda: _state_families(snapshot))

    def track_queue(self, depth: Callable[[], float], running: Callable[[], float]) -> None:
        self.queue_depth.set_function(depth)
        self.running.set_function(running)

    def track_journal(self, pending: Callable[[], float], bad: Callable[[], float]) -> None:
        """Counted from the journal dir at scrape time: any vmpin process may quarantine."""
        self.journal_pending.set_function(pending)
        self.journal_quarantined.set_function(bad)

    def slots(self, endpoint: str, cap: int, ends: tuple[bytes, ...]) -> Slots:
        """The connection slots of one endpoint (whose requests end with one of ``ends``),
        counted in ``vmpin_connections`` and ``vmpin_connections_dropped_total``."""
        dropped = self.connections_dropped
        slots = Slots(endpoint, cap, lambda reason: dropped.labels(endpoint, reason).inc(), ends)
        self.connections.labels(endpoint).set_function(lambda: float(slots.open()))
        return slots


MAX_REQUEST = 1 << 16
#: where an HTTP request's head ends (a bare LF accepted, as http.server does)
HEAD_ENDS = (b"\r\n\r\n", b"\n\n")
#: what a connection over the cap is answered, at once, without blocking
BUSY = b"HTTP/1.0 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Length: 0\r\n\r\n"


def respond(
    registry: Registry, method: str, path: str, accept_encoding: str
) -> tuple[str, list[tuple[str, str]], bytes]:
    """(status, headers, body) for one request, as prometheus_client's WSGI app answers it:
    any path but /favicon.ico is the metrics, GET and OPTIONS only, gzip when accepted."""
    if method == "OPTIONS":
        return "200 OK", [("Allow", "OPTIONS,GET")], b""
    if method != "GET":
        status = "405 Method Not Allowed"
        body = f"# HTTP {status}: {method}; use OPTIONS or GET\n".encode()
        return status, [("Allow", "OPTIONS,GET")], body
    if path.partition("?")[0] == "/favicon.ico":
        return "200 OK", [], b""
    body = registry.exposition()
    headers = [("Content-Type", CONTENT_TYPE)]
    if any(t.split(";")[0].strip().lower() == "gzip" for t in accept_encoding.split(",")):
        packer = zlib.compressobj(9, zlib.DEFLATED, 31)  # wbits 31: a gzip member
        body = packer.compress(body) + packer.flush()
        headers.append(("Content-Encoding", "gzip"))
    return "200 OK", headers, body


class MetricsServer:
    """``/metrics`` over HTTP on a loopback address: an accept loop in a daemon thread, each
    request answered on a thread of its own (one request per connection, HTTP/1.0 as
    prometheus_client's wsgiref server); ``close()`` stops it.

    Anyone on the node may connect (issue 26: any local user could crash the agent from
    here), so it is bounded (:mod:`vmpin.service.limits`): at most ``cap`` connections, the
    oldest one still sending its request evicted for a new one, a 503 at once when every
    one is being answered; the request head within 5 s of the accept, the reply within 10 s.
    """

    def __init__(
        self,
        metrics: Metrics,
        port: int,
        addr: str = "127.0.0.1",
        *,
        cap: int = METRICS_CAP,
        fault: Callable[[str, BaseException], object] | None = None,
    ) -> None:
        self.registry = metrics.registry
        self.slots = metrics.slots("metrics", cap, HEAD_ENDS)
        #: told of an error the accept loop outlives (Agent.fault: logs.Faults.report)
        self._fault = fault or (lambda where, err: metrics.errors.labels("host").inc())
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as http.server does
            sock.bind((addr, port))
            sock.listen(64)
        except OSError:
            sock.close()
            raise
        self._sock: socket.socket | None = sock
        self.port: int = sock.getsockname()[1]
        self._thread = threading.Thread(target=self._accept_loop, name="vmpin-metrics", daemon=True)
        self._thread.start()

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is None:
            return
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)  # wakes the accept() blocked on it
        sock.close()
        self._thread.join(timeout=5)

    def _accept_loop(self) -> None:
        while True:
            sock = self._sock
            if sock is None:
                return
            try:
                conn, _ = sock.accept()
            except OSError as err:
                if self._sock is None:
                    return
                self._fault("metrics accept", err)  # EMFILE, ENOMEM: the next try
                time.sleep(ACCEPT_BACKOFF)
                continue
            slot = self.slots.admit(conn, arrived(conn, HEAD_ENDS))
            if slot is None:  # every slot is being answered (counted): busy, at once
                with contextlib.suppress(OSError):
                    conn.send(BUSY, socket.MSG_DONTWAIT)
                conn.close()
                continue
            try:
                start_thread(self._answer, "vmpin-metrics-conn", conn, slot)
            except OSError as err:
                self.slots.release(slot)
                conn.close()
                self._fault("metrics accept", err)

    def _answer(self, conn: socket.socket, slot: Slot) -> None:
        try:
            try:
                buf = read_request(conn, HEAD_ENDS, MAX_REQUEST, METRICS_READ_TIMEOUT)
            except Cut as cut:
                self.slots.drop(cut.reason)
                return
            if not self.slots.answering(slot):
                return  # evicted for a newer connection while it trickled in (counted)
            if b"\r\n\r\n" not in buf and b"\n\n" not in buf:
                return  # closed before its head ended: nobody to answer
            head = buf.decode("latin-1").replace("\r\n", "\n").split("\n\n", 1)[0]
            request, *lines = head.split("\n")
            parts = request.split()
            headers: list[tuple[str, str]] = []
            if len(parts) != 3 or not parts[2].startswith("HTTP/"):
                status, body = "400 Bad Request", b""
            else:
                encoding = ""
                for line in lines:
                    key, _, value = line.partition(":")
                    if key.strip().lower() == "accept-encoding":
                        encoding = value
                status, headers, body = respond(self.registry, parts[0], parts[1], encoding)
            head_out = [f"HTTP/1.0 {status}", *(f"{k}: {v}" for k, v in headers),
                        f"Content-Length: {len(body)}", "", ""]  # fmt: skip
            conn.settimeout(METRICS_WRITE_TIMEOUT)  # one deadline for the whole sendall
            try:
                conn.sendall("\r\n".join(head_out).encode("latin-1") + body)
            except TimeoutError:
                self.slots.drop("timeout")
        except Exception:  # a scrape that failed must not take the agent with it
            return
        finally:
            self.slots.release(slot)  # (before the close: an eviction never meets a reused fd)
            conn.close()
