"""`vmpin install` into a scratch host root, then a real containerd (CRI) and a real podman
start containers through what it installed; `vmpin uninstall` leaves the root as it was.

The scratch root stands for a node's ``/`` seen from an init container (``--root ROOT``): its
containerd config.toml is the private containerd's own (tests/support/containerd_util.py,
without a base spec), edited in place by the installer; podman reads the installed hooks.d
with ``--hooks-dir``.  Every document the installer writes names host paths
(``/opt/vmpin/bin/vmpin-hook``), so the daemons run where the host's ``/opt/vmpin`` *is*
``ROOT/opt/vmpin``: in a private mount namespace of their own (a tmpfs on ``/opt``, the
install bound there), which the runtime, its shims and the hooks inherit and which dies with
them -- this machine's ``/opt`` is never touched.  The hook is the installed file alone,
run by the host's ``/usr/bin/python3`` (no venv), with the environment the installer put in
the configs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.e2e.test_containerd import allowed, listed
from tests.e2e.test_podman import Podman
from tests.support import containerd_util, runc_util
from tests.support.containerd_util import IMAGE, Containerd, Cri
from tests.support.runc_util import build_rootfs
from tests.support.session import new_id
from vmpin.linux.paths import ENVVARS, HostPaths

pytestmark = [pytest.mark.runc, pytest.mark.containerd, pytest.mark.podman,
              pytest.mark.cgroup_v1, pytest.mark.multi_cpu]  # fmt: skip
HOST_PYTHON = "/usr/bin/python3"
PREFIX = "/opt/vmpin"
TWO = (os.cpu_count() or 1) > 1


def snapshot(root: Path) -> dict[str, tuple[str, int, bytes]]:
    out: dict[str, tuple[str, int, bytes]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = ("link", 0, os.readlink(p).encode())
            elif p.is_dir():
                out[rel] = ("dir", p.lstat().st_mode & 0o7777, b"")
            else:
                out[rel] = ("file", p.lstat().st_mode & 0o7777, p.read_bytes())
    return out


def host_view(root: Path, dest: Path) -> Path:
    """An argv prefix (a script) that runs a command where ``PREFIX`` is ``ROOT/PREFIX``: a
    private mount namespace (unshare execs in place: the command keeps the pid), a tmpfs on
    ``/opt`` there, the install bound on top."""
    script = dest / "host-view"
    script.write_text(
        "#!/bin/sh\n"
        "exec unshare --mount --propagation private -- /bin/sh -c '"
        "mount -t tmpfs -o size=1m,mode=755 vmpin-test /opt && mkdir /opt/vmpin &&"
        f" mount --bind \"$0\" /opt/vmpin && exec \"$@\"' {root}{PREFIX} \"$@\"\n"
    )
    script.chmod(0o755)
    return script


def vmpin(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vmpin", *args], capture_output=True,
                          text=True, timeout=300)  # fmt: skip


@pytest.fixture
def ctd_paths(paths: HostPaths, tmp_path: Path) -> HostPaths:
    # podman's runc root, and containerd's handler Root's namespace dirs (DIR/*)
    return paths._replace(runc_root=f"{paths.runc_root}:{tmp_path / 'ctd' / 'runc'}/*")


def test_installed_hook_under_containerd_and_podman(
    ctd_paths: HostPaths, env: dict[str, str], tmp_path: Path
) -> None:
    why = (containerd_util.missing() or runc_util.missing()
           or (None if shutil.which("podman") else "podman is not installed")
           or (None if os.access(HOST_PYTHON, os.X_OK) else f"{HOST_PYTHON} is missing")
           or (None if shutil.which("unshare") else "unshare (util-linux) is missing"))  # fmt: skip
    if why:
        pytest.skip(why)
    env = {**env, "VMPIN_RUNC_ROOT": ctd_paths.runc_root}
    root = tmp_path / "host"
    (root / "etc" / "containerd").mkdir(parents=True)
    (root / "opt").mkdir()
    hooks_d = root / "usr" / "share" / "containers" / "oci" / "hooks.d"
    hooks_d.mkdir(parents=True)
    (hooks_d / "00-other.json").write_text(
        '{"version": "1.0.0", "hook": {"path": "/bin/true"}, "when": {"annotations":'
        ' {"never": "x"}}, "stages": ["prestart"]}\n'
    )
    work = tmp_path / "ctd"
    work.mkdir()
    view = host_view(root, tmp_path)
    ctd = Containerd(work, None, config=root / "etc" / "containerd" / "config.toml",
                     wrap=[str(view)])  # fmt: skip
    before = snapshot(root)

    hook_env = [f"{var}={getattr(ctd_paths, name)}" for name, var in ENVVARS.items()]
    proc = vmpin("install", "--root", str(root), "--python", HOST_PYTHON, "--ctr", "ctr",
                 *(a for e in hook_env for a in ("--env", e)))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    print(proc.stdout)
    assert f"{PREFIX}/bin/vmpin-hook: bytecode for {HOST_PYTHON}" in proc.stdout
    assert "handler runc: base_runtime_spec = /opt/vmpin/containerd/" in proc.stdout

    # -- containerd's CRI, as kubelet drives it
    podman: Podman | None = None
    try:
        ctd.start()
        ctd.import_image(containerd_util.build_image(tmp_path / "image.tar"))
        cri = Cri(ctd.address, tmp_path / "stubs")
        pb, rt = cri.pb, cri.rt
        parent = "/" + new_id("vmpin-inst")
        pod = pb.PodSandboxConfig(
            metadata=pb.PodSandboxMetadata(name="p", uid=uuid.uuid4().hex, namespace="vmpin"),
            log_directory=str(tmp_path / "logs"),
            linux=pb.LinuxPodSandboxConfig(
                cgroup_parent=parent,
                security_context=pb.LinuxSandboxSecurityContext(
                    namespace_options=pb.NamespaceOption(network=pb.NODE)),
            ),
        )  # fmt: skip
        pod_id = rt.RunPodSandbox(pb.RunPodSandboxRequest(config=pod, runtime_handler="runc"),
                                  timeout=60).pod_sandbox_id  # fmt: skip
        cpus = "1" if TWO else "0"
        config = pb.ContainerConfig(
            metadata=pb.ContainerMetadata(name="app"), image=pb.ImageSpec(image=IMAGE),
            command=["/bin/sleep", "3600"], log_path="app.log",
            linux=pb.LinuxContainerConfig(
                resources=pb.LinuxContainerResources(cpuset_cpus=cpus, cpuset_mems="0")),
        )  # fmt: skip
        cid = rt.CreateContainer(pb.CreateContainerRequest(
            pod_sandbox_id=pod_id, config=config, sandbox_config=pod), timeout=60).container_id
        rt.StartContainer(pb.StartContainerRequest(container_id=cid), timeout=60)
        seen = listed(env)[cid]  # recorded by the installed hook (createRuntime)
        assert (seen["runtime"], seen["cpus"], seen["sandbox"]) == ("runc", cpus, pod_id)
        assert allowed(int(seen["pid"])) == cpus
        rt.StopContainer(pb.StopContainerRequest(container_id=cid, timeout=0), timeout=60)
        assert cid not in listed(env)  # poststop
        rt.RemoveContainer(pb.RemoveContainerRequest(container_id=cid), timeout=60)
        rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=pod_id), timeout=60)
        rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=pod_id), timeout=60)
        cri.close()
        ctd.stop()
        from tests.e2e.test_containerd import remove_cgroup_parent

        remove_cgroup_parent(parent)

        # -- podman, reading the installed hooks.d
        podman = Podman(tmp_path / "podman", Path(ctd_paths.runc_root.split(":")[0]), hooks_d)
        podman.argv = [str(view), *podman.argv]
        name = new_id("vmpin-inst")
        podman.names.append(name)
        pid_cid = podman(
            "run", "-d", "--name", name, "--network", "none",
            "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024",
            "--cgroup-parent", podman.cgroup_parent, "--cpuset-cpus", cpus,
            "--rootfs", str(build_rootfs(tmp_path / "rootfs")), "/bin/sleep", "3600",
        )  # fmt: skip
        seen = listed(env)[pid_cid]  # prestart
        assert (seen["runtime"], seen["cpus"]) == ("runc", cpus)
        podman("rm", "-f", "-t", "0", name)  # podman runs poststop itself
        podman.names.remove(name)
        assert pid_cid not in listed(env)
    finally:
        ctd.stop()
        if podman is not None:
            podman.cleanup()

    proc = vmpin("uninstall", "--root", str(root))
    assert proc.returncode == 0, proc.stderr
    assert snapshot(root) == before
    assert json.loads((hooks_d / "00-other.json").read_text())["hook"]["path"] == "/bin/true"
