"""vmpin allocates where kubelet does not (issue 30), on real QEMU and runc: a node whose
kubelet CPU manager policy is ``none`` (no checkpoint at all), this machine's two CPUs.

======  ==========  ==================================  ===================================
pod     runtime     annotation                          CPUs
======  ==========  ==================================  ===================================
A       Kata        ``vmpin.io/exclusive-cpus: "1"``    CPU 1 alone, its vCPU 1:1 there
K       Kata        none                                the shared pool: CPU 0
R       runc        none                                the shared pool: CPU 0 (its cgroup)
B       Kata        Crane's ``cpu-manager: exclusive``  refused while A holds CPU 1 (the
                    and a CPU limit of 1                pool keeps CPU 0, as kubelet's
                                                        reserved CPU); CPU 1 once A is gone
======  ==========  ==================================  ===================================

After every step the node-wide invariant is read from /proc (every QEMU thread's and runc
task's ``Cpus_allowed_list``), ``vmpin audit`` must agree and ``reconcile --once`` finds
nothing to repair; the refusal is in audit's notes with its reason.  The same runs with the
agent up (its passes settle the allocations instead of the hooks' own).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.e2e.test_e2e_kata import affinities, qemu
from tests.e2e.test_e2e_runc import runc
from tests.e2e.test_e2e_static_node import Node, allowed
from tests.support.agents import AgentProc
from tests.support.qemu_util import QemuHandle
from tests.support.runc_util import RuncSession, new_id
from vmpin.core.cpuset import CpuSet
from vmpin.linux.paths import HostPaths

pytestmark = [pytest.mark.qemu, pytest.mark.kvm, pytest.mark.runc, pytest.mark.cgroup_v1,
              pytest.mark.multi_cpu]  # fmt: skip
__all__ = ["qemu", "runc"]  # the fixtures, imported for this module's tests

ONE = {"vmpin.io/exclusive-cpus": "1"}
CRANE = {"qos.gocrane.io/cpu-manager": "exclusive"}


class AllocNode(Node):
    """A policy-none node: no checkpoint, specs without cpusets (kubelet sets none)."""

    def _kata_bundle(self, cid: str, ann: dict[str, str], cpus: str | None) -> Path:
        b = super()._kata_bundle(cid, ann, cpus)
        if cid.endswith("-app") and ann.get(CRANE_KEY) == "exclusive":
            # a Guaranteed container's limit: 1 CPU (quota / period), as kubelet writes it
            spec = json.loads((b / "config.json").read_text())
            spec["linux"] = {"resources": {"cpu": {"quota": 100000, "period": 100000}}}
            (b / "config.json").write_text(json.dumps(spec))
        return b

    def runc_pod_none(self, pod: str) -> None:
        sid = new_id("r")
        pause = self.runc.bundle(
            sid, annotations=self._annotations(pod, sid, None, True, False, {})
        )
        self.runc_pids[sid] = self.runc.run(sid, pause)
        app = f"{sid}-app"
        b = self.runc.bundle(app, annotations=self._annotations(pod, sid, "app", False, False, {}))
        self.runc_pids[app] = self.runc.run(app, b)

    def notes(self) -> list[str]:
        out: list[str] = json.loads(self.vmpin("audit", "--json").stdout)["notes"]
        return out

    def cpus_of(self, pod: str) -> tuple[str, str]:
        rows = json.loads(self.vmpin("containers", "--json").stdout)
        app = next(r for r in rows if r["id"] == f"{self.vms[pod].sandbox_id}-app")
        return app["cpus"], app["cpus_source"]


CRANE_KEY = "qos.gocrane.io/cpu-manager"


def scenario(node: AllocNode) -> None:
    node.kata_pod("A", None, policy=ONE)
    node.kata_pod("K", None)
    node.runc_pod_none("R")
    node.holds("0", {"A": "1"})
    assert node.cpus_of("A") == ("1", "vmpin-alloc")
    a = node.vms["A"].sandbox_id
    assert any(f"(sandbox {a}) holds CPUs 1 exclusively" in n for n in node.notes())

    # a second pod asks: nothing is free but the pool's last CPU, so it is refused, loudly,
    # and runs on the shared pool
    node.kata_pod("B", None, policy=CRANE)
    b = node.vms["B"].sandbox_id
    node.holds("0", {"A": "1"})
    refused = [n for n in node.notes() if f"refused for pod uid-{b}" in n]
    assert refused and "reserved for the shared pool" in refused[0], node.notes()
    assert "qos.gocrane.io/cpu-manager=exclusive" in refused[0]
    text = node.vmpin("audit").stdout
    assert f"exclusive CPUs refused for pod uid-{b}" in text
    show = json.loads(node.vmpin("show", b, "--json").stdout)
    assert any(n.startswith("exclusive CPUs refused") for n in show["notes"]), show["notes"]

    # A goes: its CPU is released and B, waiting, gets it in the same pass
    node.delete_kata_pod("A")
    node.holds("0", {"B": "1"})
    assert node.cpus_of("B") == ("1", "vmpin-alloc")
    assert not any("refused" in n for n in node.notes())

    # B goes too: no allocation is left, the pool is every CPU again and the marker is gone
    node.delete_kata_pod("B")
    assert not (Path(node.paths.state_dir) / "allocations").exists()
    node.holds("0-1")
    # ... and what was shrunk to the pool grows back with it: the runc pod's tasks and the
    # plain Kata pod's threads are on every CPU again, not left on the last pool
    for pid in node.runc_pids.values():
        assert allowed(pid) == CpuSet.parse("0-1")
    assert all(v == "0-1" for v in affinities(node.vms["K"].pid).values())


def test_allocation_node_without_agent(
    qemu: Callable[..., QemuHandle], runc: RuncSession, paths: HostPaths,
    env: dict[str, str], tmp_path: Path,
) -> None:  # fmt: skip
    scenario(AllocNode(tmp_path, env, paths, runc, qemu, api_policy=False))


def test_allocation_node_with_agent(
    qemu: Callable[..., QemuHandle], runc: RuncSession, paths: HostPaths,
    env: dict[str, str], tmp_path: Path,
) -> None:  # fmt: skip
    agent = AgentProc(paths, env, tmp_path / "agent.log", interval=0.5)
    try:
        agent.wait_ready()
        scenario(AllocNode(tmp_path, env, paths, runc, qemu, api_policy=False))
    finally:
        assert agent.stop() == 0
