"""The agent's Kubernetes link: sandbox passes -> Events and the NodePinning report; pod
changes -> re-queued sandboxes.  Against the local API test server with the real client."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.kubeserver import KubeServer, serving
from vmpin.core.cpuset import CpuSet
from vmpin.core.planner import Policy
from vmpin.reconcile.allocations import REFUSED
from vmpin.reconcile.reconciler import SandboxReport, ThreadReport
from vmpin.runtimes import kubeapi
from vmpin.service.kube import KubeLink
from vmpin.service.settings import kube_configured as configured
from vmpin.state.records import ContainerRec, SandboxRec


def wait_until(cond, timeout: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return bool(cond())


class Link:
    def __init__(self, server: KubeServer, kubeconfig: Path) -> None:
        self.server = server
        self.node = f"node-{uuid.uuid4().hex[:6]}"
        self.notified: list[list[str]] = []
        self.pods: dict[str, list[str]] = {}
        api = kubeapi.connect(str(kubeconfig))
        self.link = KubeLink(api, self.node, notify=self.notify,
                             sandboxes_of_pod=lambda uid: self.pods.get(uid, []),
                             watch_timeout=5, report_interval=0.0)

    def notify(self, sids: list[str]) -> int:
        self.notified.append(sids)
        return len(sids)

    def flush(self) -> None:
        self.link.publisher.flush_once()

    def reasons(self) -> dict[str, tuple[str, int]]:
        with self.server.cond:
            return {e["reason"]: (e["type"], (e.get("series") or {}).get("count", 1))
                    for e in self.server.events.values()}


@pytest.fixture
def link(tmp_path: Path) -> Iterator[Link]:
    with serving(tmp_path, bookmark_interval=0.2) as (server, kubeconfig):
        yield Link(server, kubeconfig)


def rec(sid: str) -> SandboxRec:
    return SandboxRec(sid, "kata", None, None, f"uid-{sid}", f"pod-{sid}", "default")


def report(sid: str, *, pinned: int = 0, error: str | None = None, mode: str = "1:1",
           reason: str = "2 vCPUs on 2 CPUs", policy: Policy = Policy()) -> SandboxReport:
    r = SandboxReport(sid, "kata", 100)
    r.mask, r.mode, r.reason, r.policy = CpuSet.parse("2-3"), mode, reason, policy
    for i in range(2):
        action = "pinned" if i < pinned else "ok"
        r.threads.append(ThreadReport(1000 + i, "vcpu", i, f"CPU {i}/KVM", CpuSet([2 + i]),
                                      CpuSet([2 + i]), action=action))
    if error:
        r.threads.append(ThreadReport(2000, "iothread", None, "IO io0", CpuSet.parse("2-3"),
                                      None, action="error", error=error))
    return r


def test_passes_become_events_and_a_valid_report(link: Link) -> None:
    s = "sb-" + uuid.uuid4().hex[:6]
    link.link.after_pass(rec(s), report(s, pinned=2), drift=False)
    link.link.after_pass(rec(s), report(s, pinned=1), drift=False)
    link.link.after_pass(rec(s), report(s, pinned=1), drift=True)
    link.link.after_pass(rec(s), report(s, error="EPERM"), drift=False)
    shared = "CPUs 2-3 are shared with other sandboxes: no 1:1 pin there"
    link.link.after_pass(rec(s), report(s, mode="float", reason=shared,
                                        policy=Policy(cpuset="exclusive")), drift=False)
    link.flush()
    got = link.reasons()
    assert got == {"Pinned": ("Normal", 1), "Repinned": ("Normal", 1),
                   "DriftRepaired": ("Normal", 1), "CouldNotPin": ("Warning", 1),
                   "Conflict": ("Warning", 1)}
    status = link.server.pinnings[link.node]["status"]
    (sb,) = status["sandboxes"]
    assert (sb["id"], sb["mode"], sb["mask"], sb["policy"]["cpuset"]) == (
        s, "float", "2-3", "exclusive")
    assert status["conflictCount"] == 1 and status["audit"]["ok"] is False
    assert link.server.rejected == []
    # the sandbox goes: the report follows
    link.link.forget_sandbox(s)
    link.flush()
    assert link.server.pinnings[link.node]["status"]["sandboxCount"] == 0


def test_refused_allocation_is_a_warning_event(link: Link) -> None:
    """A pod vmpin could not give its exclusive CPUs (issue 30) hears why, as a Warning
    (validated by the test server as events.k8s.io/v1); repeats are counted, not resent."""
    s = "al-" + uuid.uuid4().hex[:6]
    r = report(s, mode="float", reason="the shared pool")
    r.notes = [f"{REFUSED}: vmpin.io/exclusive-cpus=1: needs 1 exclusive CPUs, 0 free; it"
               " runs on the shared pool until CPUs free up"]  # fmt: skip
    link.link.after_pass(rec(s), r, drift=False)
    link.link.after_pass(rec(s), r, drift=False)
    link.flush()
    assert link.reasons()["AllocationRefused"][0] == "Warning"
    with link.server.cond:
        (ev,) = [e for e in link.server.events.values() if e["reason"] == "AllocationRefused"]
    assert "needs 1 exclusive CPUs" in ev["note"] and ev["action"] == "Allocate"
    assert link.server.rejected == []


def test_runc_containers_in_the_report(link: Link) -> None:
    s = "rc-" + uuid.uuid4().hex[:6]
    r = SandboxReport(s, "runc")
    r.mask, r.mode = CpuSet.parse("1"), "none"
    r.containers = [ContainerRec(s, s, False, name="app", cpus=CpuSet.parse("1"))]
    link.link.after_pass(SandboxRec(s, "runc"), r, drift=False)
    link.flush()
    status = link.server.pinnings[link.node]["status"]
    assert status["containers"] == [{"id": s, "sandbox": s, "name": "app", "cpus": "1"}]
    assert status["exclusiveCpus"] == "1"


def test_policy_annotation_change_requeues_the_pods_sandboxes(link: Link) -> None:
    s = "sb-" + uuid.uuid4().hex[:6]
    link.pods[f"uid-{s}"] = [s]
    link.server.put_pod("default", f"pod-{s}", link.node, {}, uid=f"uid-{s}")
    link.link.start()
    try:
        assert wait_until(lambda: link.link.watch.synced.is_set())
        first = len(link.notified)
        # an annotation vmpin does not read: nothing to re-plan
        link.server.put_pod("default", f"pod-{s}", link.node, {"team": "a"})
        link.server.put_pod("default", f"pod-{s}", link.node,
                            {"team": "a", "vmpin.io/helpers": "none"})
        assert wait_until(lambda: len(link.notified) == first + 1)
        assert link.notified[-1] == [s]
        assert link.link.annotations_for(f"uid-{s}") == {"team": "a", "vmpin.io/helpers": "none"}
        link.server.delete_pod("default", f"pod-{s}")
        assert wait_until(lambda: link.link.annotations_for(f"uid-{s}") is None)
    finally:
        link.link.stop()


def test_configured_without_importing_the_client(tmp_path: Path) -> None:
    assert not configured(None, {"KUBECONFIG": str(tmp_path / "none")})
    assert configured(None, {"KUBERNETES_SERVICE_HOST": "10.0.0.1"})
    assert configured(str(tmp_path / "given"), {})


def test_agent_without_the_kube_extra_warns_and_goes_on(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """`pip install vmpin` has no Kubernetes client (it is the `kube` extra): `vmpin serve`
    must run without it, saying why there are no Events, not die on an ImportError."""
    import sys
    from types import SimpleNamespace

    from vmpin.service.agent import attach_kube

    for name in ("vmpin.service.kube", "vmpin.runtimes.kubeapi"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setitem(sys.modules, "kubernetes", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "urllib3", None)
    agent = SimpleNamespace(kube=None)
    with caplog.at_level("INFO", logger="vmpin"):
        attach_kube(agent, "/etc/kubernetes/kubelet.conf", None, {})  # type: ignore[arg-type]
    assert agent.kube is None
    warned = [r for r in caplog.records if "no Kubernetes client installed" in r.getMessage()]
    assert warned and warned[0].levelname == "WARNING"
