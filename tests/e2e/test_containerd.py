"""containerd 1.6 + CRI + runc, driven over gRPC as kubelet drives it, with vmpin's base spec.

A private containerd (tests/support/containerd_util.py) whose runc handler uses the base spec
``hooks/containerd/generate.py`` makes (hooks pointed at this venv's vmpin and this test's
paths), a pod with host networking and a cgroupfs parent, one container with a cpuset.  At
every CRI step ``vmpin containers --json`` shows what containerd did and ``vmpin audit`` is
clean.  ``vmpin serve`` runs with its periodic pass an hour away: the UpdateContainerResources
step (no hook fires) can only be adopted through the agent's inotify watch on runc's state,
which containerd keeps under ``<runc Root>/k8s.io`` -- found through a ``DIR/*`` runc root.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, vmpin_cmd
from tests.support import containerd_util
from tests.support.agents import AgentProc
from tests.support.containerd_util import IMAGE, Containerd, Cri
from tests.support.qemu_util import wait_until
from tests.support.runc_util import hook_env
from tests.support.session import new_id
from vmpin.linux.paths import HostPaths
from vmpin.state.store import Store

pytestmark = [
    pytest.mark.runc, pytest.mark.containerd, pytest.mark.cgroup_v1, pytest.mark.multi_cpu
]
TWO = (os.cpu_count() or 1) > 1


@pytest.fixture
def ctd_paths(paths: HostPaths, tmp_path: Path) -> HostPaths:
    return paths._replace(runc_root=f"{paths.runc_root}:{tmp_path / 'ctd' / 'runc'}/*")


@pytest.fixture
def ctd_env(env: dict[str, str], ctd_paths: HostPaths) -> dict[str, str]:
    return {**env, "VMPIN_RUNC_ROOT": ctd_paths.runc_root}


@pytest.fixture
def containerd(ctd_paths: HostPaths, tmp_path: Path) -> Iterator[Containerd]:
    why = containerd_util.missing()
    if why:
        pytest.skip(why)
    work = tmp_path / "ctd"
    work.mkdir()
    spec = work / "base-runtime-spec-runc.json"
    env_args = [
        a
        for e in hook_env(ctd_paths)
        if not e.startswith("PATH=")
        for a in ("--env", e)
    ]
    subprocess.run(
        [sys.executable, str(ROOT / "hooks" / "containerd" / "generate.py"),
         "--runtime", "runc", "--out", str(spec), "--vmpin", vmpin_cmd()[0], *env_args],
        check=True,
    )
    ctd = Containerd(work, spec)
    try:
        ctd.start()
        ctd.import_image(containerd_util.build_image(tmp_path / "image.tar"))
        yield ctd
    finally:
        ctd.stop()


def vmpin(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*vmpin_cmd(), *args], capture_output=True, text=True, env=env,
                          timeout=60)


def listed(env: dict[str, str]) -> dict[str, dict[str, Any]]:
    out = vmpin(env, "containers", "--json")
    assert out.returncode == 0, out.stderr
    return {c["id"]: c for c in json.loads(out.stdout)}


def audit_clean(env: dict[str, str]) -> None:
    out = vmpin(env, "audit", "--json")
    assert out.returncode == 0, out.stdout + out.stderr


def allowed(pid: int) -> str:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("Cpus_allowed_list:"):
                return line.split(":", 1)[1].strip()
    raise AssertionError(pid)


def remove_cgroup_parent(parent: str) -> None:
    for ctl in Path("/sys/fs/cgroup").iterdir():
        d = ctl / parent.lstrip("/")
        if d.is_dir():
            for child in sorted(d.glob("*/"), reverse=True):
                os.rmdir(child)
            os.rmdir(d)


def test_cri_pod_lifecycle(
    containerd: Containerd, ctd_paths: HostPaths, ctd_env: dict[str, str], tmp_path: Path
) -> None:
    cri = Cri(containerd.address, tmp_path / "stubs")
    pb, rt = cri.pb, cri.rt
    parent = "/" + new_id("vmpin-ctd")  # names this session: a dead one's is swept
    agent = AgentProc(ctd_paths, ctd_env, tmp_path / "agent.log", interval=3600)
    pod_id = cid = ""
    try:
        agent.wait_ready()
        pod = pb.PodSandboxConfig(
            metadata=pb.PodSandboxMetadata(name="p", uid=uuid.uuid4().hex, namespace="vmpin"),
            log_directory=str(tmp_path / "logs"),
            linux=pb.LinuxPodSandboxConfig(
                cgroup_parent=parent,
                security_context=pb.LinuxSandboxSecurityContext(
                    namespace_options=pb.NamespaceOption(network=pb.NODE)
                ),
            ),
        )
        pod_id = rt.RunPodSandbox(pb.RunPodSandboxRequest(config=pod, runtime_handler="runc"),
                                  timeout=60).pod_sandbox_id
        # containerd never applies base_runtime_spec to the pause container: no hook ran
        assert listed(ctd_env) == {}
        audit_clean(ctd_env)

        ctr_config = pb.ContainerConfig(
            metadata=pb.ContainerMetadata(name="app"),
            image=pb.ImageSpec(image=IMAGE),
            command=["/bin/sleep", "3600"],
            log_path="app.log",
            linux=pb.LinuxContainerConfig(
                resources=pb.LinuxContainerResources(cpuset_cpus="1" if TWO else "0",
                                                     cpuset_mems="0")
            ),
        )
        cid = rt.CreateContainer(
            pb.CreateContainerRequest(pod_sandbox_id=pod_id, config=ctr_config,
                                      sandbox_config=pod), timeout=60
        ).container_id
        # containerd runs every hook at StartContainer, none at CreateContainer
        assert cid not in listed(ctd_env)
        audit_clean(ctd_env)

        rt.StartContainer(pb.StartContainerRequest(container_id=cid), timeout=60)
        seen = listed(ctd_env)[cid]
        assert seen["runtime"] == "runc" and seen["cpus"] == ("1" if TWO else "0")
        assert seen["sandbox"] == pod_id and seen["name"] == "app"
        pid = int(seen["pid"])
        assert allowed(pid) == seen["cpus"]
        audit_clean(ctd_env)
        agent.wait_pass(1)

        # UpdateContainerResources: `runc update --resources -`, no hook.  The watch sees it.
        before = time.monotonic()
        rt.UpdateContainerResources(
            pb.UpdateContainerResourcesRequest(
                container_id=cid,
                linux=pb.LinuxContainerResources(cpuset_cpus="0-1" if TWO else "0",
                                                 cpuset_mems="0"),
            ),
            timeout=60,
        )
        returned = time.monotonic()

        def adopted() -> bool:
            with Store(ctd_paths.state_dir, ingest=False) as store:
                rec = store.container(cid)
            return rec is not None and rec.cpus_source == "runc"

        assert wait_until(adopted, 10, 0.002), agent.log.read_text()
        print(f"UpdateContainerResources returned -> adopted: "
              f"{(time.monotonic() - returned) * 1000:.1f} ms "
              f"(call took {(returned - before) * 1000:.1f} ms)")
        assert (agent.status() or {}).get("passes") == 1  # not the periodic pass
        seen = listed(ctd_env)[cid]
        assert seen["cpus"] == ("0-1" if TWO else "0")
        assert allowed(pid) == seen["cpus"]
        audit_clean(ctd_env)

        rt.StopContainer(pb.StopContainerRequest(container_id=cid, timeout=0), timeout=60)
        # poststop runs during StopContainer
        assert cid not in listed(ctd_env)
        audit_clean(ctd_env)
        rt.RemoveContainer(pb.RemoveContainerRequest(container_id=cid), timeout=60)
        cid = ""
        rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=pod_id), timeout=60)
        rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=pod_id), timeout=60)
        pod_id = ""
        assert listed(ctd_env) == {}
        audit_clean(ctd_env)
        assert agent.stop() == 0
    finally:
        agent.kill()
        try:
            if cid:
                rt.RemoveContainer(pb.RemoveContainerRequest(container_id=cid), timeout=60)
            if pod_id:
                rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=pod_id), timeout=60)
                rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=pod_id),
                                    timeout=60)
        finally:
            cri.close()
            containerd.stop()
            remove_cgroup_parent(parent)
