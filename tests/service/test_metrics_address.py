"""Metrics a cluster can scrape (issue 29, item 3): ``--metrics-address`` binds the port where
a cluster's Prometheus reaches it (the default stays 127.0.0.1), a bad address is one line at
start, and the manifests (DaemonSet probes and ports, deploy/metrics.yaml) agree."""

from __future__ import annotations

import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.conftest import vmpin_cmd
from tests.support.agents import AgentProc
from vmpin.linux.paths import HostPaths

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def test_metrics_bind_the_address_given(paths: HostPaths, env: dict[str, str],
                                        tmp_path: Path) -> None:  # fmt: skip
    """127.0.0.2 stands for a node IP here (no address off this machine is used)."""
    agent = AgentProc(paths, {**env, "VMPIN_METRICS_ADDRESS": "127.0.0.2"}, tmp_path / "a.log")
    try:
        agent.wait_ready()
        with urllib.request.urlopen(f"http://127.0.0.2:{agent.port}/metrics", timeout=5) as r:
            assert r.status == 200 and b"vmpin_" in r.read()
        with pytest.raises(urllib.error.URLError):  # not on 127.0.0.1 any more
            urllib.request.urlopen(f"http://127.0.0.1:{agent.port}/metrics", timeout=5)
    finally:
        assert agent.stop(timeout=30) == 0

@pytest.mark.parametrize("bad", ["node-ip", "300.1.1.1", "::g"])
def test_a_bad_address_is_one_line(paths: HostPaths, env: dict[str, str], bad: str) -> None:
    out = subprocess.run([*vmpin_cmd(), "serve", "--metrics-address", bad], env=env,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 2
    lines = [line for line in out.stderr.splitlines() if "--metrics-address" in line]
    assert len(lines) == 1 and bad in lines[0] and "not an IPv4 or IPv6 address" in lines[0]


def test_manifests_agree() -> None:
    (ds,) = [d for d in yaml.safe_load_all((DEPLOY / "daemonset.yaml").read_text())
             if d and d.get("kind") == "DaemonSet"]  # fmt: skip
    spec = ds["spec"]["template"]["spec"]
    (c,) = [c for c in spec["containers"] if c["name"] == "vmpin"]
    args = c["args"]
    port = int(args[args.index("--metrics-port") + 1])
    assert args[args.index("--metrics-address") + 1] == "$(NODE_IP)"
    assert {e["name"] for e in c["env"]} >= {"NODE_IP"}
    assert [p["containerPort"] for p in c["ports"] if p["name"] == "metrics"] == [port]
    assert c["readinessProbe"]["httpGet"]["port"] == "metrics" and c["livenessProbe"]
    assert spec["hostNetwork"] is True
    labels = ds["spec"]["template"]["metadata"]["labels"]
    svc, mon = list(yaml.safe_load_all((DEPLOY / "metrics.yaml").read_text()))
    assert svc["spec"]["selector"].items() <= labels.items()
    assert mon["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert svc["spec"]["ports"][0]["port"] == port
    assert mon["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
