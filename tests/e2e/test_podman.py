"""podman 4.3 with runc and vmpin's ``hooks/oci-hooks.d`` files, and ``podman update``.

The hooks directory is a copy of the shipped files with the executable pointed at this venv's
vmpin and the hook ``env`` at this test's paths (nothing else changed).  podman runs with
private storage, run and tmp dirs, runc's state under a private ``--root``
(``--runtime-flag root=``), a private network config dir and a cgroupfs parent; everything is
removed afterwards.  ``vmpin serve`` runs with its periodic pass an hour away, so the
``podman update --cpuset-cpus`` step (runc update, no hook) is adopted through its watch.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.test_containerd import allowed, audit_clean, listed, remove_cgroup_parent
from tests.support import runc_util
from tests.support.agents import AgentProc
from tests.support.qemu_util import wait_until
from tests.support.runc_util import build_rootfs, hook_env, vmpin_argv
from tests.support.session import new_id
from vmpin.linux.paths import HostPaths
from vmpin.state.store import Store

pytestmark = [pytest.mark.runc, pytest.mark.podman, pytest.mark.cgroup_v1, pytest.mark.multi_cpu]
HOOKS_D = Path(__file__).resolve().parents[2] / "hooks" / "oci-hooks.d"
TWO = (os.cpu_count() or 1) > 1
#: podman creates these whatever its flags say; removed afterwards when it made them
PODMAN_MADE = ("/run/containers/networks", "/run/containers", "/run/libpod")


class Podman:
    def __init__(self, work: Path, runc_root: Path, hooks: Path) -> None:
        self.cgroup_parent = "/" + new_id("vmpin-podman")  # a dead session's is swept
        # podman refuses a runroot longer than 50 characters: pytest's tmp paths are longer
        self.runroot = tempfile.mkdtemp(prefix="vmpin-pm-", dir="/tmp")
        self.argv = [
            "podman",
            "--root", str(work / "storage"),
            "--runroot", self.runroot,
            "--tmpdir", str(work / "tmp"),
            "--storage-driver", "vfs",
            "--cgroup-manager", "cgroupfs",
            "--events-backend", "file",
            "--network-config-dir", str(work / "net"),
            "--runtime", "runc",
            "--runtime-flag", f"root={runc_root}",
            "--hooks-dir", str(hooks),
        ]
        self.made = [d for d in PODMAN_MADE if not os.path.exists(d)]
        self.names: list[str] = []

    def __call__(self, *args: str) -> str:
        proc = subprocess.run([*self.argv, *args], capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise AssertionError(f"podman {' '.join(args)}: {proc.stderr}")
        return proc.stdout.strip()

    def cleanup(self) -> None:
        for name in self.names:
            subprocess.run([*self.argv, "rm", "-f", "-t", "0", name], capture_output=True,
                           timeout=120, check=False)
        remove_cgroup_parent(self.cgroup_parent)
        shutil.rmtree(self.runroot, ignore_errors=True)
        for d in self.made:
            if os.path.isdir(d):
                shutil.rmtree(d, ignore_errors=True)


def hooks_dir(dest: Path, paths: HostPaths) -> Path:
    """The shipped hooks.d files, executable and env pointed at this venv and these paths."""
    dest.mkdir()
    for f in sorted(HOOKS_D.glob("*.json")):
        doc = json.loads(f.read_text())
        stage = doc["stages"][0]
        doc["hook"]["path"] = vmpin_argv(stage)[0]
        doc["hook"]["env"] = hook_env(paths)
        (dest / f.name).write_text(json.dumps(doc))
    return dest


@pytest.fixture
def podman(paths: HostPaths, tmp_path: Path) -> Iterator[Podman]:
    why = runc_util.missing() or (None if shutil.which("podman") else "podman is not installed")
    if why:
        pytest.skip(why)
    p = Podman(tmp_path / "podman", Path(paths.runc_root), hooks_dir(tmp_path / "hooks", paths))
    try:
        yield p
    finally:
        p.cleanup()


def test_podman_run_update_rm(
    podman: Podman, paths: HostPaths, env: dict[str, str], tmp_path: Path
) -> None:
    rootfs = build_rootfs(tmp_path / "rootfs")
    agent = AgentProc(paths, env, tmp_path / "agent.log", interval=3600)
    try:
        agent.wait_ready()
        name = new_id("vmpin-podman")
        podman.names.append(name)
        first = "1" if TWO else "0"
        cid = podman(
            "run", "-d", "--name", name, "--network", "none",
            "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024",
            "--cgroup-parent", podman.cgroup_parent, "--cpuset-cpus", first,
            "--rootfs", str(rootfs), "/bin/sleep", "3600",
        )
        seen = listed(env)[cid]
        assert seen["runtime"] == "runc" and seen["cpus"] == first
        pid = int(seen["pid"])
        assert allowed(pid) == first
        audit_clean(env)
        agent.wait_pass(1)

        want = "0-1" if TWO else "0"
        before = time.monotonic()
        podman("update", "--cpuset-cpus", want, name)
        returned = time.monotonic()

        def adopted() -> bool:
            with Store(paths.state_dir, ingest=False) as store:
                rec = store.container(cid)
            return rec is not None and rec.cpus_source == "runc"

        assert wait_until(adopted, 10, 0.002), agent.log.read_text()
        print(f"podman update returned -> adopted: {(time.monotonic() - returned) * 1000:.1f} ms"
              f" (the command took {(returned - before) * 1000:.0f} ms)")
        assert (agent.status() or {}).get("passes") == 1  # not the periodic pass
        assert listed(env)[cid]["cpus"] == want and allowed(pid) == want
        audit_clean(env)

        podman("rm", "-f", "-t", "0", name)  # podman runs poststop itself
        podman.names.remove(name)
        assert cid not in listed(env)
        audit_clean(env)
        assert agent.stop() == 0
    finally:
        agent.kill()
