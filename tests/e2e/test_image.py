"""The node-agent image, built from this repository with one command and run with podman
(issue 29, item 1): ``--version``, ``topology`` against the host's /sys, and ``serve``
answering ``status`` on its control socket and ``/metrics`` over HTTP.

The build (deploy/image/build.sh: mmdebstrap + podman import, ~2 minutes) runs once per
input hash; a later run finds the image in podman and reuses it.  Containers are removed by
the id podman gave them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import vmpin_cmd
from tests.support.agents import free_port
from tests.support.qemu_util import wait_until

pytestmark = [pytest.mark.podman]

ROOT = Path(__file__).resolve().parents[2]
#: what podman needs on these machines (no CAP_SYS_RESOURCE: FACTS.md)
LIMITS = ["--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"]


@pytest.fixture(scope="module")
def image() -> str:
    if shutil.which("mmdebstrap") is None:
        pytest.skip("mmdebstrap is missing (apt-get install mmdebstrap)")
    proc = subprocess.run(["bash", str(ROOT / "deploy/image/build.sh")], capture_output=True,
                          text=True, timeout=900, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


def podman(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout)


def test_version_and_topology(image: str) -> None:
    out = podman("run", "--rm", *LIMITS, "--network", "none", image, "--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith("vmpin ")
    topo = podman("run", "--rm", *LIMITS, "--network", "none", "-v", "/sys:/sys:ro",
                  image, "topology", "--json")  # fmt: skip
    assert topo.returncode == 0, topo.stderr
    with open("/sys/devices/system/cpu/online") as f:
        assert json.loads(topo.stdout)["online"] == f.read().strip()
    labels = json.loads(podman("image", "inspect", image).stdout)[0]["Labels"]
    assert labels["org.opencontainers.image.title"] == "vmpin"
    assert labels["io.vmpin.inputs"] in image


@pytest.fixture
def served(image: str, tmp_path: Path) -> Iterator[tuple[Path, int]]:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    port = free_port()
    run = podman("run", "-d", *LIMITS, "--network", "host", "-v", f"{state}:/run/vmpin",
                 image, "serve", "--metrics-port", str(port))  # fmt: skip
    assert run.returncode == 0, run.stderr
    cid = run.stdout.strip()
    try:
        yield state, port
    finally:
        podman("rm", "-f", "-t", "0", cid)


def test_serve_answers_status_and_metrics(served: tuple[Path, int]) -> None:
    state, port = served
    env = {**os.environ, "VMPIN_STATE_DIR": str(state)}

    def status() -> bool:
        out = subprocess.run([*vmpin_cmd(), "status"], env=env, capture_output=True,
                             text=True, timeout=30)  # fmt: skip
        return out.returncode == 0

    assert wait_until(status, 60, 0.5), "the agent in the image never answered status"
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        body = resp.read().decode()
    assert "vmpin_" in body
