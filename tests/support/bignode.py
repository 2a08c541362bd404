"""A node of many plain containers beside one VM: what a hook's cost must not grow with.

Shared by tests/service/test_node_scale.py (what a hook and an update touch, counted) and
bench/bench_scale.py (what they cost, timed).  The containers are store rows of runc pods
(an infra container and four app containers each, on CPU 0, the pod uid set, no cgroup on
the host): a pass reads each of them as it would a container not started yet; the VM is a
tracked Kata sandbox on CPU 1 whose VMM the caller starts (a fake VMM or a real QEMU).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from vmpin.core.cpuset import CpuSet
from vmpin.linux.paths import HostPaths
from vmpin.state.records import ContainerRec, SandboxRec
from vmpin.state.store import Store

PER_POD = 5
VM = "bigvm"
VM_CPUS = "1"
POD_CPUS = "0"


def host_paths(root: Path) -> HostPaths:
    """Every root under ``root`` (an empty cgroup tree: the rows have no cgroup)."""
    for d in ("state", "vm", "cgroup", "runc", "publish"):
        (root / d).mkdir(parents=True, exist_ok=True)
    os.chmod(root / "state", 0o700)
    return HostPaths(
        state_dir=str(root / "state"),
        vm_dir=str(root / "vm"),
        runc_root=str(root / "runc"),
        kubelet_state=str(root / "cpu_manager_state"),
        publish_dir=str(root / "publish"),
        kata_config=str(root / "kata" / "configuration.toml"),
        cgroup=str(root / "cgroup"),
    )


def pod_id(p: int) -> str:
    return f"pod{p:05d}"


def populate(paths: HostPaths, containers: int) -> None:
    """``containers`` plain containers in pods of :data:`PER_POD`, and the VM's sandbox record
    (its one app container on :data:`VM_CPUS`)."""
    with Store(paths.state_dir) as store, store.transaction():
        for p in range(containers // PER_POD):
            sid, uid = pod_id(p), f"uid-{p:05d}"
            store.put_sandbox(SandboxRec(sid, "runc", None, None, pod_uid=uid))
            store.put_container(ContainerRec(sid, sid, True, "POD", uid))
            for c in range(PER_POD - 1):
                store.put_container(
                    ContainerRec(f"{sid}-c{c}", sid, False, f"c{c}", uid,
                                 cpus=CpuSet.parse(POD_CPUS), cpus_source="spec")
                )  # fmt: skip
        store.put_sandbox(SandboxRec(VM, "kata", None, None, pod_uid="uid-vm"))
        store.put_container(
            ContainerRec(f"{VM}-app", VM, False, "app", "uid-vm",
                         cpus=CpuSet.parse(VM_CPUS), cpus_source="spec")
        )  # fmt: skip


CRI = "io.kubernetes.cri."


def bundle(root: Path, cid: str, sandbox: str, cpus: str | None) -> tuple[Path, dict[str, str]]:
    """A containerd-style bundle for a new app container of pod ``sandbox``."""
    b = root / "bundles" / cid
    b.mkdir(parents=True)
    ann = {CRI + "container-type": "container", CRI + "sandbox-id": sandbox,
           CRI + "sandbox-uid": f"uid-{sandbox}", CRI + "sandbox-name": f"pod-{sandbox}",
           CRI + "sandbox-namespace": "default", CRI + "container-name": cid}  # fmt: skip
    spec: dict[str, object] = {"ociVersion": "1.0.2", "annotations": ann, "linux": {}}
    if cpus is not None:
        spec["linux"] = {"resources": {"cpu": {"cpus": cpus, "mems": "0"}}}
    (b / "config.json").write_text(json.dumps(spec))
    return b, ann


def state(cid: str, pid: int, b: Path, ann: dict[str, str]) -> bytes:
    return json.dumps({"ociVersion": "1.0.2", "id": cid, "status": "creating",
                       "bundle": str(b), "annotations": ann, "pid": pid}).encode()  # fmt: skip
