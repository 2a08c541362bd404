"""The agent and libvirt: a domain that starts while the agent runs is pinned on its lifecycle
event, long before the next periodic pass (the interval here is a minute)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("libvirt")

from tests.support.agents import AgentProc
from tests.support.libvirt_util import DomainHandle, domain_factory, libvirtd_uri  # noqa: F401
from tests.support.qemu_util import wait_until
from vmpin.linux.paths import HostPaths

pytestmark = pytest.mark.libvirtd


def vcpu_affinity(name: str) -> dict[int, str]:
    """vCPU index -> Cpus_allowed_list of the domain's QEMU, found by the thread names."""
    for pid in os.listdir("/proc"):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if f"guest={name},".encode() not in cmdline:
            continue
        out = {}
        for tid in os.listdir(f"/proc/{pid}/task"):
            comm = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            if comm.startswith("CPU "):
                status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
                allowed = [x for x in status.splitlines() if x.startswith("Cpus_allowed_list")]
                out[int(comm.split()[1].split("/")[0])] = allowed[0].split(":")[1].strip()
        return out
    return {}


def test_started_domain_is_pinned_on_its_lifecycle_event(
    paths: HostPaths,
    env: dict[str, str],
    tmp_path: Path,
    libvirtd_uri: str,  # noqa: F811
    domain_factory: Callable[..., DomainHandle],  # noqa: F811
) -> None:
    agent = AgentProc(paths, {**env, "VMPIN_LIBVIRT": libvirtd_uri}, tmp_path / "a.log", 60.0)
    try:
        agent.wait_ready()
        agent.wait_pass(1)
        h = domain_factory(vcpus=2, iothreads=1, mask="0-1")
        assert wait_until(lambda: vcpu_affinity(h.name) == {0: "0", 1: "1"}, 30), (
            vcpu_affinity(h.name),
            agent.log.read_text(),
        )
        assert "libvirt event" in agent.log.read_text()
        assert agent.stop() == 0
    finally:
        agent.kill()
