"""vmpin.service.metrics against prometheus_client: the same operations, the same /metrics bytes.

The agent writes the Prometheus text format itself (prometheus_client's import is 11.5 MB of
its RSS); these tests keep it identical to what prometheus_client's ``generate_latest`` writes,
for every kind, label values that need escaping and floats Go prints its own way, and serve
it over HTTP as prometheus_client's server does (content type, gzip, methods).
"""

from __future__ import annotations

import gzip
import math
import urllib.request
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vmpin.service import metrics as m

prom = pytest.importorskip("prometheus_client")
from prometheus_client.core import Metric  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

prom.disable_created_metrics()

LABELS = st.text(max_size=6)  # quotes, backslashes, newlines and non-ASCII included
AMOUNTS = st.one_of(
    st.floats(min_value=0, max_value=1e12, allow_nan=False),
    st.integers(min_value=0, max_value=10**9).map(float),
)
VALUES = st.floats(allow_nan=False, width=64) | st.sampled_from([1e6, 123456789.0, 0.1])
BUCKETS = (0.001, 0.0025, 0.5, 1.0, 7.0, 1e6, 2.5e7)

#: (kind, labelled?)
KINDS = [("counter", False), ("counter", True), ("gauge", False), ("gauge", True),
         ("histogram", False), ("histogram", True)]  # fmt: skip


def build(kind: str, labelled: bool, i: int, ours: m.Registry, theirs: Any) -> tuple[Any, Any]:
    name, doc = f"vmpin_t{i}", f'Help {i}: a "quote", a \\ and a\nnewline'
    labels = ["role", "a_label"] if labelled else []
    if kind == "counter":
        return (m.Counter(name, doc, labels, registry=ours),
                prom.Counter(name, doc, labels, registry=theirs))  # fmt: skip
    if kind == "gauge":
        return (m.Gauge(name, doc, labels, registry=ours),
                prom.Gauge(name, doc, labels, registry=theirs))  # fmt: skip
    return (m.Histogram(name, doc, labels, buckets=BUCKETS, registry=ours),
            prom.Histogram(name, doc, labels, buckets=BUCKETS, registry=theirs))  # fmt: skip


@st.composite
def scenarios(draw: st.DrawFn) -> list[tuple[int, tuple[str, ...], float]]:
    ops = []
    for _ in range(draw(st.integers(0, 25))):
        i = draw(st.integers(0, len(KINDS) - 1))
        labels = (draw(LABELS), draw(LABELS)) if KINDS[i][1] else ()
        kind = KINDS[i][0]
        value = draw(AMOUNTS if kind == "counter" else VALUES)
        if kind == "histogram":
            value = draw(st.floats(-1e9, 1e9) | st.sampled_from(BUCKETS))
        ops.append((i, labels, value))
    return ops


@settings(max_examples=200, deadline=None)
@given(scenarios())
def test_text_format_is_prometheus_clients(ops: list[tuple[int, tuple[str, ...], float]]) -> None:
    ours, theirs = m.Registry(), prom.CollectorRegistry()
    pairs = [build(kind, labelled, i, ours, theirs) for i, (kind, labelled) in enumerate(KINDS)]
    for i, labels, value in ops:
        a, b = pairs[i]
        if labels:
            a, b = a.labels(*labels), b.labels(*labels)
        kind = KINDS[i][0]
        if kind == "counter":
            a.inc(value)
            b.inc(value)
        elif kind == "gauge":
            a.set(value)
            b.set(value)
        else:
            a.observe(value)
            b.observe(value)
    assert ours.exposition() == prom.generate_latest(theirs)


def test_gauge_functions_and_time() -> None:
    ours, theirs = m.Registry(), prom.CollectorRegistry()
    a, b = build("gauge", False, 0, ours, theirs)
    a.set_function(lambda: 3)
    b.set_function(lambda: 3)
    assert ours.exposition() == prom.generate_latest(theirs)
    c = m.Gauge("vmpin_t1", "t", registry=ours)
    c.set_to_current_time()
    assert abs(ours.get_sample_value("vmpin_t1") - __import__("time").time()) < 60  # type: ignore[operator]


@pytest.mark.parametrize("value", [0.0, 1.0, 1e6, 999999.0, 1234567.0, 2.5e-05, -1e7, math.inf,
                                   -math.inf, math.nan, 12345678.9])  # fmt: skip
def test_go_float(value: float) -> None:
    from prometheus_client.utils import floatToGoString

    assert m.go_float(value) == floatToGoString(value)


class Replay:
    """A prometheus_client collector that yields our families as they are (for the agent's
    whole registry: its scrape-time gauges included)."""

    def __init__(self, ours: m.Registry) -> None:
        self.ours = ours

    def collect(self) -> list[Any]:
        out = []
        for f in self.ours.collect():
            metric = Metric(f.name, f.help, f.type)
            for name, labels, value in f.samples:
                metric.add_sample(name, labels, value)
            out.append(metric)
        return out


def test_the_agents_metrics_as_prometheus_writes_them() -> None:
    agent = m.Metrics()
    agent.track_state(lambda: ({"kata": (3, 6), "runc": (1, 1)}, {"vcpu": 4, "emulator": 2}))
    agent.track_queue(lambda: 2, lambda: 1)
    agent.track_journal(lambda: 0, lambda: 5)
    agent.plans.labels("event").inc(3)
    agent.affinity_writes.labels("vcpu").inc()
    agent.latency.observe(0.003)
    agent.full_pass.observe(0.4)
    agent.full_pass_cpu.set(0.25)
    agent.last_full_pass.set(1764000000.123)
    theirs = prom.CollectorRegistry()
    theirs.register(Replay(agent.registry))
    body = agent.registry.exposition()
    assert body == prom.generate_latest(theirs)
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    assert families["vmpin_plans"].type == "counter"
    assert families["vmpin_pin_latency_seconds"].type == "histogram"
    assert families["vmpin_sandboxes"].samples[0].labels == {"runtime": "kata"}
    assert b'vmpin_agent_info{version="' in body
    assert agent.registry.get_sample_value("vmpin_errors_total", {"kind": "control"}) == 0
    assert agent.registry.get_sample_value("vmpin_queue_depth") == 2


def _but_open_connections(body: bytes) -> bytes:
    """The exposition without the open-connections gauge of the metrics port: a scrape counts
    itself (it is open while it is answered), an exposition made after it does not."""
    line = b'vmpin_connections{endpoint="metrics"} '
    return b"\n".join(x for x in body.split(b"\n") if not x.startswith(line))


def test_served_over_http() -> None:
    agent = m.Metrics()
    agent.events.inc()
    server = m.MetricsServer(agent, 0)
    try:
        url = f"http://127.0.0.1:{server.port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as reply:
            assert reply.headers["Content-Type"] == prom.exposition.CONTENT_TYPE_PLAIN_0_0_4
            body = reply.read()
            assert b'vmpin_connections{endpoint="metrics"} 1.0\n' in body
            assert _but_open_connections(body) == _but_open_connections(
                agent.registry.exposition()
            )
        req = urllib.request.Request(url, headers={"Accept-Encoding": "br, gzip;q=0.9"})
        with urllib.request.urlopen(req, timeout=5) as reply:
            assert reply.headers["Content-Encoding"] == "gzip"
            assert _but_open_connections(gzip.decompress(reply.read())) == (
                _but_open_connections(agent.registry.exposition())
            )
        req = urllib.request.Request(url, method="POST", data=b"")
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=5)
        assert err.value.code == 405 and err.value.headers["Allow"] == "OPTIONS,GET"
    finally:
        server.close()


def test_port_in_use_is_an_oserror() -> None:
    server = m.MetricsServer(m.Metrics(), 0)
    try:
        with pytest.raises(OSError):
            m.MetricsServer(m.Metrics(), server.port)
    finally:
        server.close()


class _Label(str):
    """A label value that is a string, and may not be converted again."""

    def __str__(self) -> str:
        raise AssertionError("converted")


@pytest.mark.parametrize("kind", ["counter", "gauge", "histogram"])
def test_children_found_as_given(kind: str) -> None:
    """A child is found by its label values as given when they are strings (every caller's),
    with neither a conversion nor the lock; others are converted, a wrong count or labels
    on an unlabelled metric refused; an unlabelled metric's child is made with it (issue 28:
    a few per request, on the connection thread before the planner it woke gets the GIL)."""
    reg = m.Registry()
    made: dict[str, Any] = {
        "counter": lambda *a: m.Counter(*a, registry=reg),
        "gauge": lambda *a: m.Gauge(*a, registry=reg),
        "histogram": lambda *a: m.Histogram(*a, buckets=BUCKETS, registry=reg),
    }
    op = {"counter": "inc", "gauge": "set", "histogram": "observe"}[kind]
    labelled = made[kind]("x_total", "x", ["where"])
    child = labelled.labels("1")
    labelled._lock = None  # (taking it now would raise)
    assert labelled.labels(_Label("1")) is child
    assert labelled.labels(1) is child
    for bad in ((), ("1", "2")):
        with pytest.raises(ValueError):
            labelled.labels(*bad)
    with pytest.raises(ValueError):
        getattr(labelled, op)(1)
    one = made[kind]("y_total", "y")
    with pytest.raises(ValueError):
        one.labels("1")
    getattr(one, op)(2)
    assert one._one is not None
    assert (one._one.get() if kind != "histogram" else one._one._sum) == 2
