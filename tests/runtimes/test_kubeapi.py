"""vmpin.runtimes.kubeapi driven through the real `kubernetes` client against the local test
server (tests/support/kubeserver.py): list/watch with resourceVersion, bookmarks, 410 Gone,
429/500 with Retry-After; Events and the NodePinning report validated by the server."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.kubeserver import KubeServer, serving
from vmpin.core.errors import KubeError
from vmpin.runtimes import kubeapi
from vmpin.runtimes.kubeapi import Backoff, EventRecorder, NodeReport, Pod, PodRef, PodWatch


def wait_until(cond, timeout: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return bool(cond())


@pytest.fixture
def kube(tmp_path: Path) -> Iterator[tuple[KubeServer, Path]]:
    with serving(tmp_path, bookmark_interval=0.2) as pair:
        yield pair


class Seen:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.events: list[tuple[str, Pod]] = []
        self.relists: list[set[str]] = []

    def on_event(self, kind: str, pod: Pod) -> None:
        with self.lock:
            self.events.append((kind, pod))

    def on_relist(self, uids: set[str]) -> None:
        with self.lock:
            self.relists.append(uids)

    def names(self, kind: str | None = None) -> list[str]:
        with self.lock:
            return [p.name for k, p in self.events if kind is None or k == kind]


def watcher(kubeconfig: Path, node: str, seen: Seen, **kw: object) -> PodWatch:
    api = kubeapi.connect(str(kubeconfig))
    assert api is not None
    return PodWatch(api, node, seen.on_event, seen.on_relist, **kw)  # type: ignore[arg-type]


def test_no_credentials_means_no_client(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "absent"))
    assert kubeapi.connect() is None
    bad = tmp_path / "bad"
    bad.write_text("apiVersion: v1\nkind: Config\nclusters: 3\n")
    with pytest.raises(KubeError, match=str(bad)):
        kubeapi.connect(str(bad))


def test_list_then_watch_only_this_node(kube: tuple[KubeServer, Path]) -> None:
    server, cfg = kube
    node = f"node-{uuid.uuid4().hex[:6]}"
    server.put_pod("default", "mine", node, {"vmpin.io/vcpus": "float"})
    server.put_pod("default", "theirs", "other-node")
    seen = Seen()
    w = watcher(cfg, node, seen, timeout_seconds=5)
    w.start()
    try:
        assert wait_until(lambda: w.synced.is_set())
        assert seen.names("SYNCED") == ["mine"]
        server.put_pod("default", "mine", node, {"vmpin.io/vcpus": "none"})
        server.put_pod("default", "theirs", "other-node", {"x": "y"})
        server.put_pod("kube-system", "new", node)
        assert wait_until(lambda: seen.names("ADDED") == ["new"])
        modified = [p for k, p in seen.events if k == "MODIFIED"]
        assert [(p.name, p.annotations) for p in modified] == [("mine", {"vmpin.io/vcpus": "none"})]
        server.delete_pod("kube-system", "new")
        assert wait_until(lambda: seen.names("DELETED") == ["new"])
        # one list, and the watch resumed from the list's resourceVersion (no second list)
        assert w.stats.lists == 1
        assert int(w.resource_version or 0) == server.rv
    finally:
        w.stop()


def test_bookmarks_advance_the_resource_version_while_idle(kube: tuple[KubeServer, Path]) -> None:
    server, cfg = kube
    node = f"node-{uuid.uuid4().hex[:6]}"
    seen = Seen()
    w = watcher(cfg, node, seen, timeout_seconds=5)
    w.start()
    try:
        assert wait_until(lambda: w.synced.is_set())
        before = w.resource_version
        for i in range(5):  # changes elsewhere: this node's watch only sees bookmarks
            server.put_pod("default", f"p{i}", "other-node")
        assert wait_until(lambda: w.stats.bookmarks >= 2 and w.resource_version == str(server.rv))
        assert w.resource_version != before and seen.events == []
    finally:
        w.stop()


def test_gone_relists(kube: tuple[KubeServer, Path]) -> None:
    server, cfg = kube
    node = f"node-{uuid.uuid4().hex[:6]}"
    server.put_pod("default", "a", node)
    stale = str(server.rv)
    server.put_pod("default", "b", node)
    server.compact()  # rv `stale` is gone from the history
    seen = Seen()
    w = watcher(cfg, node, seen, timeout_seconds=5)
    w.resource_version = stale  # as if resuming after a long disconnect
    w.start()
    try:
        assert wait_until(lambda: w.stats.gone == 1 and w.synced.is_set())
        assert sorted(seen.names("SYNCED")) == ["a", "b"]
        assert seen.relists[-1] == {p["metadata"]["uid"] for p in server.pods.values()}
        server.put_pod("default", "c", node)
        assert wait_until(lambda: seen.names("ADDED") == ["c"])
    finally:
        w.stop()


def test_429_and_500_back_off_as_the_server_says(kube: tuple[KubeServer, Path]) -> None:
    server, cfg = kube
    node = f"node-{uuid.uuid4().hex[:6]}"
    server.put_pod("default", "a", node)
    server.fail("/api/v1/pods", 429, times=1, retry_after=1)
    server.fail("/api/v1/pods", 500, times=1, retry_after=1)
    seen = Seen()
    w = watcher(cfg, node, seen, timeout_seconds=5, backoff=Backoff(base=0.05, cap=5))
    t0 = time.monotonic()
    w.start()
    try:
        assert wait_until(lambda: w.synced.is_set())
        waited = time.monotonic() - t0
    finally:
        w.stop()
    # urllib3 (under the client) itself retries a 429 that carries Retry-After; the 500
    # reaches PodWatch, whose backoff takes the server's Retry-After over its 0.05 s base
    assert w.stats.errors == 1
    assert server.hits("/api/v1/pods")[:3] == [429, 500, 200]
    assert waited >= 2.0  # both Retry-After: 1 honoured


def test_backoff_grows_and_is_capped() -> None:
    b = Backoff(base=1.0, cap=4.0)
    delays = [b.delay() for _ in range(8)]
    assert all(0 <= d <= 4.0 for d in delays)
    b.reset()
    assert b.delay() <= 1.0


REF = PodRef("default", "pod-a", "uid-a")


def test_events_are_valid_and_aggregated(kube: tuple[KubeServer, Path]) -> None:
    server, cfg = kube
    api = kubeapi.connect(str(cfg))
    now = [1000.0]
    rec = EventRecorder(api, "vmpin-node1", interval=10.0, rate=1.0, burst=5,
                        clock=lambda: now[0])
    rec.record(REF, "Pinned", "4 vCPUs 1:1 on 2-5", action="Pin")
    assert rec.flush() == 1
    for _ in range(50):
        rec.record(REF, "Pinned", "4 vCPUs 1:1 on 2-5", action="Pin")
    assert rec.flush() == 0  # within the interval: counted, not written
    now[0] += 10
    assert rec.flush() == 1
    (ev,) = server.events.values()
    assert ev["series"]["count"] == 51 and ev["reason"] == "Pinned"
    assert ev["regarding"] == {"apiVersion": "v1", "kind": "Pod", "namespace": "default",
                               "name": "pod-a", "uid": "uid-a"}
    assert ev["reportingController"] == "vmpin.io/agent"
    assert server.rejected == []
    assert (server.count("event.create"), server.count("event.patch")) == (1, 1)


def test_server_rejects_an_invalid_event(kube: tuple[KubeServer, Path]) -> None:
    """The server's validation is real: a Warning with an unknown type is refused (422)."""
    server, cfg = kube
    api = kubeapi.connect(str(cfg))
    rec = EventRecorder(api, "vmpin-node1")
    rec.record(REF, "CouldNotPin", "x", type="Severe")
    assert rec.flush() == 0 and rec.written.failures == 1
    assert "type: Unsupported value" in server.rejected[0]


def test_storm_of_1000_updates_is_a_bounded_number_of_writes(
    kube: tuple[KubeServer, Path],
) -> None:
    """1,000 re-pins of 10 pods over 100 s (simulated clock): writes bounded by the series
    interval, not by the number of occurrences."""
    server, cfg = kube
    api = kubeapi.connect(str(cfg))
    now = [0.0]
    rec = EventRecorder(api, "vmpin-node1", interval=10.0, rate=1.0, burst=20,
                        clock=lambda: now[0])
    report = NodeReport(api, "node1", min_interval=3.0, clock=lambda: now[0])
    refs = [PodRef("default", f"pod-{i}", f"uid-{i}") for i in range(10)]
    for i in range(1000):
        now[0] = i * 0.1
        ref = refs[i % 10]
        rec.record(ref, "Repinned", "vCPUs re-pinned after an update", action="Repin")
        report.set({"sandboxCount": 10, "observedTime": kubeapi.rfc3339(0),
                    "sandboxes": [{"id": f"sb{i % 10}", "runtime": "kata", "mask": f"{i % 7}",
                                   "mode": "float"}]})
        if i % 2 == 0:  # the publisher ticks every 0.2 s
            rec.flush()
            report.flush()
    now[0] += 20
    rec.flush()
    report.flush()
    event_writes = server.count("event.create") + server.count("event.patch")
    report_writes = server.count("nodepinning.create") + server.count("nodepinning.status")
    total = sum(e["series"]["count"] if "series" in e else 1 for e in server.events.values())
    assert total == 1000  # every occurrence counted
    # 10 series x (1 create + one patch per 10 s over 100 s + the last) ...
    assert event_writes <= 10 * (1 + 100 / 10 + 1)
    # ... and the report at most once per 3 s (+ the create)
    assert report_writes <= 1 + 100 / 3 + 2
    assert server.rejected == []
    print(f"\nstorm: 1000 updates -> {event_writes} event writes, {report_writes} report writes")


def test_report_is_schema_valid_rate_limited_and_heartbeats(kube: tuple[KubeServer, Path]) -> None:
    server, cfg = kube
    api = kubeapi.connect(str(cfg))
    now = [0.0]
    rep = NodeReport(api, "n1", min_interval=3.0, heartbeat=30.0, clock=lambda: now[0])
    status = {"sandboxCount": 0, "conflictCount": 0, "audit": {"ok": True, "violations": 0}}
    rep.set(status)
    assert rep.flush() is True
    assert rep.flush() is False  # unchanged
    now[0] = 31
    assert rep.flush() is True  # heartbeat
    got = server.pinnings["n1"]["status"]
    assert got["nodeName"] == "n1" and got["heartbeatSeconds"] == 30
    (item,) = kubeapi.list_reports(api)
    assert item["metadata"]["name"] == "n1"
    # a field the CRD does not declare is refused by the server's schema check
    rep.set({**status, "bogus": 1})
    now[0] = 40
    with pytest.raises(Exception, match="422"):
        rep.flush()
    assert "bogus" in server.rejected[-1]
