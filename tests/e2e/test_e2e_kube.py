"""End to end, Kubernetes-native, on a real QEMU sandbox.

Through the API (the local test server, tests/support/kubeserver.py, driven by the agent's
real `kubernetes` client): a pod's annotation changes -> the agent re-plans its sandbox, the
vCPU threads move, an Event is recorded, the NodePinning report follows, and `vmpin cluster`
shows the node.  Without any API: the same policy from the OCI annotations the hooks see.
Every affinity is read from /proc/<pid>/task/<tid>/status.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_e2e_kata import Kata, affinities, sid, thread_names
from tests.service.test_agent import run_cli
from tests.support.agents import AgentProc
from tests.support.kubeserver import KubeServer, serving
from tests.support.qemu_util import QemuHandle, qemu_factory, require_qemu, wait_until
from vmpin.linux.paths import HostPaths

#: real QEMUs under KVM (vcpu_affinity reads threads named "CPU N/KVM"), over host CPUs 0-1.
pytestmark = [pytest.mark.qemu, pytest.mark.kvm, pytest.mark.multi_cpu]


@pytest.fixture
def qemu(vm_dir: Path) -> Iterator[Callable[..., QemuHandle]]:
    require_qemu()
    with qemu_factory(vm_dir) as start:
        yield start


@pytest.fixture
def kata(tmp_path: Path, env: dict[str, str]) -> Kata:
    return Kata(tmp_path, env)


def vcpu_affinity(q: QemuHandle) -> dict[str, str]:
    """vCPU thread name ("CPU 0/KVM") -> its allowed CPUs."""
    names = thread_names(q.pid)
    aff = affinities(q.pid)
    return {n: aff[t] for t, n in names.items() if n.endswith("/KVM") and t in aff}


def one_to_one(q: QemuHandle) -> bool:
    got = vcpu_affinity(q)
    return len(got) == 2 and sorted(got.values()) == ["0", "1"]


def floating(q: QemuHandle) -> bool:
    got = vcpu_affinity(q)
    return len(got) == 2 and set(got.values()) == {"0-1"}


def with_policy(kata: Kata, q: QemuHandle, cid: str, cpus: str, ann: dict[str, str]) -> None:
    """Kata's hooks for a sandbox and one container whose specs carry the pod's annotations
    (containerd's pod_annotations pass them to both the sandbox's and the container's spec)."""
    for bundle_id, name, c in ((q.sandbox_id, "POD", None), (cid, f"ctr-{cid}", cpus)):
        b = kata.bundle(bundle_id, q.sandbox_id, c, name)
        spec = json.loads((b / "config.json").read_text())
        spec["annotations"].update(ann)
        (b / "config.json").write_text(json.dumps(spec))
        for stage in ("prestart", "createRuntime"):
            kata.hook(stage, bundle_id, b, q.pid)
        kata.hook("poststart", q.sandbox_id, b, q.pid)


def events_of(server: KubeServer, reason: str) -> list[dict[str, Any]]:
    with server.cond:
        return [e for e in server.events.values() if e["reason"] == reason]


def sandbox_report(server: KubeServer, node: str) -> dict[str, Any]:
    with server.cond:
        obj = server.pinnings.get(node) or {}
    sandboxes = (obj.get("status") or {}).get("sandboxes") or [{}]
    return dict(sandboxes[0])


def test_annotation_change_through_the_api(
    qemu: Callable[..., QemuHandle], kata: Kata, paths: HostPaths, env: dict[str, str],
    tmp_path: Path,
) -> None:
    s = sid("kube")
    node = f"node-{uuid.uuid4().hex[:8]}"
    pod = f"pod-{s}"
    with serving(tmp_path) as (server, kubeconfig):
        node_uid = server.put_node(node)
        server.put_pod("default", pod, node, {}, uid=f"uid-{s}")
        q = qemu(s, smp=2, debug_threads=True)
        with_policy(kata, q, f"{s}-app", "0-1", {})
        assert wait_until(lambda: one_to_one(q), 10), vcpu_affinity(q)  # node default: auto

        agent_env = {**env, "VMPIN_KUBECONFIG": str(kubeconfig), "NODE_NAME": node}
        agent = AgentProc(paths, agent_env, tmp_path / "agent.log", interval=0.5)
        try:
            agent.wait_ready()
            assert wait_until(lambda: sandbox_report(server, node).get("id") == s, 15), \
                (tmp_path / "agent.log").read_text()

            # the operator changes the pod's policy through the API
            t0 = time.monotonic()
            server.put_pod("default", pod, node, {"vmpin.io/vcpus": "float"})
            assert wait_until(lambda: floating(q), 10, 0.005), vcpu_affinity(q)
            latency = time.monotonic() - t0
            print(f"\nannotation change -> vCPUs re-pinned in {latency * 1000:.0f} ms")

            assert wait_until(lambda: events_of(server, "Repinned"), 10)
            (ev,) = events_of(server, "Repinned")
            assert ev["regarding"]["name"] == pod and ev["regarding"]["uid"] == f"uid-{s}"
            assert "float" in ev["note"]
            assert wait_until(
                lambda: sandbox_report(server, node).get("policy", {}).get("vcpus") == "float",
                10,
            )
            rep = sandbox_report(server, node)
            assert rep["mode"] == "float" and rep["policy"]["source"] == "api"

            # one policy truth (issue 25): the CLI, with no API access of its own, plans with
            # the policy the agent recorded from the API -- audit finds no drift, reconcile
            # --once moves nothing back to 1:1, show says where the policy came from
            audit = run_cli(env, "audit", "--json")
            assert audit.returncode == 0, audit.stdout + audit.stderr
            assert json.loads(audit.stdout)["violations"] == []
            once = run_cli(env, "reconcile", "--once", "--json")
            assert once.returncode == 0, once.stderr
            assert [r["repaired"] for r in json.loads(once.stdout)] == [0], once.stdout
            assert floating(q), vcpu_affinity(q)
            shown = json.loads(run_cli(env, "show", s, "--json").stdout)
            assert shown["mode"] == "float"
            assert shown["policy"]["vcpus"] == "float" and shown["policy"]["source"] == "api"
            assert shown["policy"]["recorded_at"] is not None
            assert rep["pod"] == {"namespace": "default", "name": pod, "uid": f"uid-{s}"}

            out = run_cli({**env, "VMPIN_KUBECONFIG": str(kubeconfig)}, "cluster", "--json")
            assert out.returncode == 0, out.stderr
            (row,) = json.loads(out.stdout)
            assert (row["node"], row["state"], row["sandboxes"]) == (node, "clean", 1)
            table = run_cli({**env, "VMPIN_KUBECONFIG": str(kubeconfig)}, "cluster")
            assert node in table.stdout and "clean" in table.stdout

            # a value vmpin does not know: a Warning Event, and the node default (1:1) is back
            server.put_pod("default", pod, node, {"vmpin.io/vcpus": "sideways"})
            assert wait_until(lambda: events_of(server, "BadAnnotation"), 10)
            (bad,) = events_of(server, "BadAnnotation")
            assert bad["type"] == "Warning" and "sideways" in bad["note"]
            assert wait_until(lambda: one_to_one(q), 10), vcpu_affinity(q)
            # NodePinning as a Kubernetes object: owned by its Node, with conditions
            with server.cond:
                obj = dict(server.pinnings[node])
            assert obj["metadata"]["ownerReferences"] == [{
                "apiVersion": "v1", "kind": "Node", "name": node, "uid": node_uid,
                "blockOwnerDeletion": False, "controller": False}]
            conds = {c["type"]: c for c in obj["status"]["conditions"]}
            assert set(conds) == {"Ready", "Drift", "Conflict"}
            assert conds["Ready"]["status"] == "True" and conds["Conflict"]["status"] == "False"
            assert obj["status"]["sandboxCount"] == 1 and obj["status"]["truncated"] is False
            assert server.rejected == []  # every object the agent wrote passed validation
            # the agent needed nothing deploy/rbac.yaml does not grant (vmpin cluster: the view)
            assert server.rbac_denials(["vmpin-agent", "vmpin-cluster-view"]) == []
            assert any("nodepinnings needs" in d and "list" in d
                       for d in server.rbac_denials(["vmpin-agent"]))  # the agent lists nothing
        finally:
            assert agent.stop() == 0
    assert "Kubernetes API connected" in (tmp_path / "agent.log").read_text()


def test_same_policy_from_oci_annotations_without_an_api(
    qemu: Callable[..., QemuHandle], kata: Kata, env: dict[str, str], tmp_path: Path,
) -> None:
    env["KUBECONFIG"] = str(tmp_path / "no-such-kubeconfig")
    env.pop("KUBERNETES_SERVICE_HOST", None)
    s = sid("oci")
    q = qemu(s, smp=2, debug_threads=True)
    with_policy(kata, q, f"{s}-app", "0-1", {"vmpin.io/vcpus": "float",
                                             "vmpin.io/guest-pinning": "off"})
    # the Kata hook planned in-process, with the pod's policy from its spec
    assert wait_until(lambda: floating(q), 10), vcpu_affinity(q)
    show = kata.show(s)
    assert show["mode"] == "float" and show["guest_map"] is None
    # a repair pass keeps it so (the policy is in the store, not only in the hook's memory)
    kata.vmpin("reconcile", "--once")
    assert floating(q), vcpu_affinity(q)
