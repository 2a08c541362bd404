"""The agent's Prometheus metrics, and the small HTTP endpoint that serves them.

Only the agent imports this module (prometheus_client costs start-up time the OCI hook must
not pay; the import-linter contract keeps it off the hook path).  Every metric lives in a
registry of its own, not the library's global one, so several agents can run in one test
process and nothing else in the process leaks into vmpin's /metrics.

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
                                       ``control`` (a malformed request)
``vmpin_pin_latency_seconds``          from a dirty notification to its sandbox's threads
                                       carrying the new plan (read back from the kernel)
``vmpin_sandbox_pass_seconds``         one node pass run for dirty sandboxes (refresh, plan,
                                       apply, verify; the name is older than the batching)
``vmpin_full_pass_seconds``            one periodic pass over every sandbox (wall time)
``vmpin_full_pass_cpu_seconds``        CPU time of the last periodic pass (the whole process)
``vmpin_last_full_pass_timestamp``     when the last periodic pass finished (unix time)
``vmpin_queue_depth`` / ``vmpin_running``  sandboxes waiting / being planned right now
=====================================  ======================================================
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from vmpin import __version__

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

#: Latency buckets: a pin normally lands in a few ms; a storm's holdoff adds ~0.1 s.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
PASS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

#: (runtime -> (sandboxes, containers), role -> threads pinned): what the state gauges show.
Snapshot = tuple[Mapping[str, tuple[int, int]], Mapping[str, int]]


class _StateCollector(Collector):
    """Gauges computed at scrape time from the agent's per-sandbox bookkeeping."""

    def __init__(self, snapshot: Callable[[], Snapshot]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterable[Metric]:
        runtimes, roles = self._snapshot()
        sandboxes = GaugeMetricFamily(
            "vmpin_sandboxes", "Sandboxes the agent tracks", labels=["runtime"]
        )
        containers = GaugeMetricFamily(
            "vmpin_containers", "Containers in the tracked sandboxes", labels=["runtime"]
        )
        for runtime, (n_sandboxes, n_containers) in sorted(runtimes.items()):
            sandboxes.add_metric([runtime], n_sandboxes)
            containers.add_metric([runtime], n_containers)
        pinned = GaugeMetricFamily(
            "vmpin_threads_pinned",
            "Threads carrying their planned affinity after the last pass over their sandbox",
            labels=["role"],
        )
        for role, n in sorted(roles.items()):
            pinned.add_metric([role], n)
        yield sandboxes
        yield containers
        yield pinned


class Metrics:
    """Every metric the agent updates; ``registry`` is private to this instance."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        # The *_created series double every counter's lines and say nothing useful here.
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = registry if registry is not None else CollectorRegistry()
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
        self.conflicts = Gauge(
            "vmpin_conflicts",
            "Pairs of pods claiming one exclusive CPU in the last plan (invariant 5)",
            registry=r,
        )
        for kind in ("affinity", "sandbox", "internal", "control"):
            self.errors.labels(kind)  # export zeros, so rate() works from the first scrape
        for kind in ("thread", "cgroup", "vanished"):
            self.drift.labels(kind)
        for cause in ("event", "periodic", "startup"):
            self.plans.labels(cause)

    def track_state(self, snapshot: Callable[[], Snapshot]) -> None:
        self.registry.register(_StateCollector(snapshot))

    def track_queue(self, depth: Callable[[], float], running: Callable[[], float]) -> None:
        self.queue_depth.set_function(depth)
        self.running.set_function(running)

    def track_journal(self, pending: Callable[[], float], bad: Callable[[], float]) -> None:
        """Counted from the journal dir at scrape time: any vmpin process may quarantine."""
        self.journal_pending.set_function(pending)
        self.journal_quarantined.set_function(bad)


class MetricsServer:
    """``/metrics`` over HTTP on a loopback address, in a daemon thread; ``close()`` stops it."""

    def __init__(self, metrics: Metrics, port: int, addr: str = "127.0.0.1") -> None:
        from prometheus_client import start_http_server

        server: WSGIServer
        server, self._thread = start_http_server(port, addr=addr, registry=metrics.registry)
        self._server = server
        self.port: int = server.server_port

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
