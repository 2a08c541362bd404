"""A node as operators run it, on real QEMU and runc: kubelet's static policy, CRI-O and
containerd naming, Guaranteed, Burstable and BestEffort pods side by side (issue 25).

Five pods on this machine's two CPUs:

======  ==========  ===================  ==============================================
pod     runtime     naming               CPUs
======  ==========  ===================  ==============================================
G       Kata        CRI-O (infra POD)    Guaranteed: kubelet's exclusive CPU 1 (step 2)
B       Kata        containerd           Burstable: the shared pool, from its spec
E       Kata        containerd           BestEffort: no CPU set in its spec (the pool)
N       Kata        containerd           the pool; ``vmpin.io/vcpus: none``: its vCPU
                                         stays where its runtime put it (CPU 0)
R       runc        containerd           the pool; a real runc container, hooks in
                                         config.json, kubelet's updates as ``runc update``
======  ==========  ===================  ==============================================

Step 1: kubelet's pool is 0-1, no exclusive CPU.  Step 2: kubelet gives G's container CPU 1
(the pool shrinks to 0) and re-sends the shared containers' cpusets (CRI
UpdateContainerResources: ``runc update`` for runc, ``vmpin update`` for Kata).  Step 3: G is
deleted and the pool grows back.  After every step the node-wide invariant is read from
/proc (every QEMU thread's and runc task's ``Cpus_allowed_list``) and ``vmpin audit`` must
agree; ``reconcile --once`` then finds nothing to repair.  G's threads run on its exclusive
CPU only, its vCPU 1:1 there: before issue 25 CRI-O's ``POD`` was given the pool by the
checkpoint lookup, G's mask became 0-1 and its vCPU floated over the shared CPU.

The same runs with the agent up and N's policy set through the Kubernetes API only (its specs
say nothing): the CLI, which has no API access, must plan with it all the same.
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import vmpin_cmd
from tests.e2e.test_e2e_kata import affinities, qemu, thread_names
from tests.e2e.test_e2e_runc import runc
from tests.support.agents import AgentProc
from tests.support.kubelet_util import write_checkpoint
from tests.support.kubeserver import KubeServer, serving
from tests.support.qemu_util import QemuHandle, wait_until
from tests.support.runc_util import RuncSession, new_id
from vmpin.core.cpuset import CpuSet
from vmpin.linux.paths import HostPaths

pytestmark = [pytest.mark.qemu, pytest.mark.kvm, pytest.mark.runc, pytest.mark.cgroup_v1,
              pytest.mark.multi_cpu]  # fmt: skip
__all__ = ["qemu", "runc"]  # the fixtures, imported for this module's tests

CRI = "io.kubernetes.cri."
CRIO = "io.kubernetes.cri-o."
NONE = {"vmpin.io/vcpus": "none"}


def allowed(tid: int) -> CpuSet:
    with open(f"/proc/{tid}/status") as f:
        for line in f:
            if line.startswith("Cpus_allowed_list:"):
                return CpuSet.parse(line.split(":", 1)[1].strip())
    raise AssertionError(f"/proc/{tid}/status has no Cpus_allowed_list")


class Node:
    """Plays kubelet and the runtimes: bundles named as CRI-O or containerd name them, Kata's
    host hooks through the CLI, runc containers that run vmpin's hooks themselves."""

    def __init__(self, tmp: Path, env: dict[str, str], paths: HostPaths, runc: RuncSession,
                 qemu: Callable[..., QemuHandle], api_policy: bool) -> None:  # fmt: skip
        self.tmp, self.env, self.paths, self.runc, self.qemu = tmp, env, paths, runc, qemu
        self.api_policy = api_policy
        self.vms: dict[str, QemuHandle] = {}
        self.bundles: dict[str, Path] = {}
        self.runc_pids: dict[str, int] = {}

    # -- the CLI ---------------------------------------------------------------------------
    def vmpin(self, *args: str, stdin: str | None = None, check: bool = True
              ) -> subprocess.CompletedProcess[str]:  # fmt: skip
        proc = subprocess.run([*vmpin_cmd(), *args], input=stdin, capture_output=True,
                              text=True, env=self.env, timeout=60)  # fmt: skip
        if check and proc.returncode != 0:
            raise AssertionError(f"vmpin {' '.join(args)} -> {proc.returncode}\n"
                                 f"{proc.stdout}\n{proc.stderr}")  # fmt: skip
        return proc

    # -- pods --------------------------------------------------------------------------------
    def uid(self, pod: str) -> str:
        return f"uid-{self.vms[pod].sandbox_id}"

    def _annotations(self, pod: str, sid: str, name: str | None, sandbox: bool, crio: bool,
                     extra: dict[str, str]) -> dict[str, str]:  # fmt: skip
        uid, ns = f"uid-{sid}", "default"
        if crio:
            ann = {CRIO + "ContainerType": "sandbox" if sandbox else "container",
                   CRIO + "SandboxID": sid, "io.kubernetes.pod.uid": uid,
                   "io.kubernetes.pod.name": pod, "io.kubernetes.pod.namespace": ns,
                   "io.kubernetes.container.name": "POD" if sandbox else str(name)}  # fmt: skip
        else:
            ann = {CRI + "container-type": "sandbox" if sandbox else "container",
                   CRI + "sandbox-id": sid, CRI + "sandbox-uid": uid,
                   CRI + "sandbox-name": pod, CRI + "sandbox-namespace": ns}  # fmt: skip
            if not sandbox:
                ann[CRI + "container-name"] = str(name)
        return {**ann, **extra}

    def _kata_hook(self, stage: str, state_id: str, bundle: Path, pid: int | None) -> None:
        ann = json.loads((bundle / "config.json").read_text())["annotations"]
        state: dict[str, Any] = {"ociVersion": "", "id": state_id, "status": "",
                                 "bundle": str(bundle), "annotations": ann}  # fmt: skip
        if pid is not None:
            state["pid"] = pid
        out = self.vmpin("hook", "--strict", stage, stdin=json.dumps(state))
        assert out.stderr == "", out.stderr

    def _kata_bundle(self, cid: str, ann: dict[str, str], cpus: str | None) -> Path:
        b = self.tmp / "bundles" / cid
        b.mkdir(parents=True)
        linux: dict[str, Any] = {"resources": {"cpu": {"cpus": cpus}}} if cpus else {}
        (b / "config.json").write_text(json.dumps(
            {"ociVersion": "1.0.2", "annotations": ann, "linux": linux}))  # fmt: skip
        self.bundles[cid] = b
        return b

    def start_vm(self, pod: str, on: set[int] | None = None) -> str:
        """The pod's QEMU, started as Kata starts it; ``on``: where its runtime (or another
        pinner) put its threads.  Returns the sandbox id (the pod's uid is made from it)."""
        q = self.qemu(f"{pod.lower()}-{uuid.uuid4().hex[:8]}", smp=1, debug_threads=True)
        self.vms[pod] = q
        if on is not None:
            for tid in affinities(q.pid):
                os.sched_setaffinity(tid, on)
        return q.sandbox_id

    def admit(self, pod: str, policy: dict[str, str]) -> None:
        """The pod as the Kubernetes API holds it (only where the API is part of the test)."""

    def create_kata(self, pod: str, cpus: str | None, *, crio: bool = False,
                    policy: dict[str, str] | None = None) -> None:  # fmt: skip
        """Kata's host hooks for the pod's sandbox, then its one app container's (Kata's
        poststart carries the sandbox id)."""
        q = self.vms[pod]
        sid = q.sandbox_id
        self.admit(pod, dict(policy or {}))
        extra = {} if self.api_policy else dict(policy or {})
        infra = self._kata_bundle(sid, self._annotations(pod, sid, None, True, crio, extra), None)
        for stage in ("prestart", "createRuntime", "poststart"):
            self._kata_hook(stage, sid, infra, q.pid)
        app = f"{sid}-app"
        b = self._kata_bundle(app, self._annotations(pod, sid, "app", False, crio, extra), cpus)
        for stage in ("prestart", "createRuntime"):
            self._kata_hook(stage, app, b, q.pid)
        self._kata_hook("poststart", sid, b, q.pid)

    def kata_pod(
        self, pod: str, cpus: str | None, *, crio: bool = False,
        policy: dict[str, str] | None = None, on: set[int] | None = None,
    ) -> None:  # fmt: skip
        self.start_vm(pod, on)
        self.create_kata(pod, cpus, crio=crio, policy=policy)

    def delete_kata_pod(self, pod: str) -> None:
        q = self.vms.pop(pod)
        sid = q.sandbox_id
        self._kata_hook("poststop", sid, self.bundles[f"{sid}-app"], None)
        self._kata_hook("poststop", sid, self.bundles[sid], None)
        q.kill()

    def runc_pod(self, pod: str, cpus: str) -> None:
        """A runc pod with containerd's naming: its pause container and one app container,
        each a real runc container whose config.json runs vmpin's hooks."""
        sid = new_id("r")
        pause = self.runc.bundle(sid, annotations=self._annotations(pod, sid, None, True, False,
                                                                    {}))  # fmt: skip
        self.runc_pids[sid] = self.runc.run(sid, pause)
        app = f"{sid}-app"
        b = self.runc.bundle(app, cpus=cpus,
                             annotations=self._annotations(pod, sid, "app", False, False, {}))
        self.runc_pids[app] = self.runc.run(app, b)
        self.runc_app = app

    # -- the node-wide invariant, from /proc and from audit -----------------------------------
    def proc_problems(self, pool: CpuSet, exclusive: dict[str, CpuSet]) -> list[str]:
        problems = []
        taken = CpuSet.union_all(exclusive.values())
        for pod, q in self.vms.items():
            names = thread_names(q.pid)
            for tid in affinities(q.pid):
                try:
                    got = allowed(tid)
                except FileNotFoundError:
                    continue  # a thread that ended meanwhile
                if pod in exclusive:
                    if not got <= exclusive[pod]:
                        problems.append(f"{pod} tid {tid} on {got}, off its own {exclusive[pod]}")
                    if names.get(tid, "").endswith("/KVM") and got != exclusive[pod]:
                        problems.append(f"{pod} vCPU {tid} on {got}, not 1:1")
                elif got & taken:
                    problems.append(f"{pod} tid {tid} on {got}: on another pod's exclusive CPU")
                elif not got <= pool:
                    problems.append(f"{pod} tid {tid} on {got}, outside the pool {pool}")
        for cid, pid in self.runc_pids.items():
            for task in os.listdir(f"/proc/{pid}/task"):
                got = allowed(int(task))
                if not got <= pool or got & taken:
                    problems.append(f"runc {cid} task {task} on {got}, pool {pool}")
        return problems

    def holds(self, pool: str, exclusive: dict[str, str] | None = None) -> None:
        excl = {p: CpuSet.parse(c) for p, c in (exclusive or {}).items()}
        want = CpuSet.parse(pool)
        if not wait_until(lambda: not self.proc_problems(want, excl), 10, 0.05):
            shown = self.vmpin("audit", "--json", check=False).stdout
            raise AssertionError(f"{self.proc_problems(want, excl)}\naudit: {shown}")
        audit = self.vmpin("audit", "--json", check=False)
        data = json.loads(audit.stdout)
        assert audit.returncode == 0 and data["ok"], data["violations"]
        once = json.loads(self.vmpin("reconcile", "--once", "--json").stdout)
        assert all(r["repaired"] == 0 for r in once), once  # nothing left for a pass to do
        assert not self.proc_problems(want, excl)
        for pod in excl:
            show = json.loads(self.vmpin("show", self.vms[pod].sandbox_id, "--json").stdout)
            assert (show["mode"], show["mask"]) == ("1:1", excl[pod].to_list()), show["reason"]

    def kubelet(self, pool: str, entries: dict[str, str]) -> None:
        """kubelet's checkpoint: the pool, and pod -> its app container's exclusive CPUs."""
        write_checkpoint(self.paths.kubelet_state, pool,
                         {self.uid(p): {"app": c} for p, c in entries.items()})  # fmt: skip

    def resend_shared(self, pool: str) -> None:
        """kubelet re-sends every shared container's cpuset (CRI UpdateContainerResources):
        containerd runs ``runc update`` for runc, vmpin hears Kata's through ``vmpin update``.
        The BestEffort pod's container had no CPU set: vmpin follows the checkpoint for it."""
        self.runc.update(self.runc_app, pool)
        for pod in ("B", "N"):
            self.vmpin("update", f"{self.vms[pod].sandbox_id}-app", "--cpuset-cpus", pool)


def scenario(node: Node) -> None:
    node.kubelet("0-1", {})
    node.kata_pod("B", "0-1")
    node.kata_pod("E", None)
    node.kata_pod("N", "0-1", policy=NONE, on={0})
    node.runc_pod("R", "0-1")
    node.holds("0-1")

    # kubelet gives the Guaranteed pod's container CPU 1 (its Allocate comes before the
    # runtime creates the container: the checkpoint names the pod first), the pool shrinks,
    # CRI-O creates the pod, and kubelet tells the shared containers
    node.start_vm("G")
    node.kubelet("0", {"G": "1"})
    node.create_kata("G", "1", crio=True)
    node.resend_shared("0")
    node.holds("0", {"G": "1"})
    # who is on CPU 1, and why: kubelet gave it to G, and only G's threads are there
    cpu1 = json.loads(node.vmpin("explain", "1", "--json").stdout)["cpu"]
    g = node.vms["G"].sandbox_id
    assert cpu1["kubelet"]["exclusive"]["pod"] == f"uid-{g}"
    assert {c["sandbox"] for c in cpu1["claimants"]} == {g}
    assert any(c.get("role") == "vcpu" and "pinned 1:1" in c["rule"] for c in cpu1["claimants"])
    text = node.vmpin("explain", "1").stdout
    assert f"kubelet gives it to pod uid-{g}" in text
    pod = json.loads(node.vmpin("explain", "G", "--json").stdout)["pod"]
    assert (pod["sandbox"], pod["mode"], pod["mask"]) == (g, "1:1", "1")

    # G goes; kubelet gives CPU 1 back to the pool and re-sends the shared cpusets
    node.delete_kata_pod("G")
    node.kubelet("0-1", {})
    node.resend_shared("0-1")
    node.holds("0-1")


def test_static_policy_node_without_agent(
    qemu: Callable[..., QemuHandle], runc: RuncSession, paths: HostPaths,
    env: dict[str, str], tmp_path: Path,
) -> None:  # fmt: skip
    scenario(Node(tmp_path, env, paths, runc, qemu, api_policy=False))


def test_static_policy_node_with_agent_and_api_policy(
    qemu: Callable[..., QemuHandle], runc: RuncSession, paths: HostPaths,
    env: dict[str, str], tmp_path: Path,
) -> None:  # fmt: skip
    node_name = f"node-{uuid.uuid4().hex[:8]}"
    with serving(tmp_path) as (server, kubeconfig):
        agent_env = {**env, "VMPIN_KUBECONFIG": str(kubeconfig), "NODE_NAME": node_name}
        agent = AgentProc(paths, agent_env, tmp_path / "agent.log", interval=0.5)
        try:
            agent.wait_ready()
            node = _ApiNode(tmp_path, env, paths, runc, qemu, api_policy=True)
            node.server, node.node_name = server, node_name
            scenario(node)
        finally:
            assert agent.stop() == 0


class _ApiNode(Node):
    """The pods exist in the Kubernetes API before their sandboxes; N's policy is there only."""

    server: KubeServer
    node_name: str

    def admit(self, pod: str, policy: dict[str, str]) -> None:
        sid = self.vms[pod].sandbox_id
        self.server.put_pod("default", pod, self.node_name, policy, uid=f"uid-{sid}")
