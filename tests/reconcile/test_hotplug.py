"""CPU hotplug under a long-lived planner: the agent's topology follows the online list.

A command reads the topology once for a pass of milliseconds; the agent plans for its whole
life, so its reconciler (``follow_hotplug``) reads the online list before each use and the
topology again when it changed.  On sysfs fixture trees (a CPU taken offline loses its
``topology`` directory, as the kernel removes it).
"""

from __future__ import annotations

import shutil
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from tests.service.test_agent import dirty_wait
from tests.support.make_sysfs import SYSFS_FIXTURES as SYSFS
from vmpin.core.cpuset import CpuSet
from vmpin.linux.paths import HostPaths
from vmpin.reconcile.reconciler import Reconciler
from vmpin.state.store import Store


def unplug(root: Path, cpu: int) -> None:
    """Take ``cpu`` offline in the tree as the kernel does: the online list, its topology."""
    cpu_dir = root / "devices/system/cpu"
    online = CpuSet.parse((cpu_dir / "online").read_text().strip()) - CpuSet([cpu])
    shutil.rmtree(cpu_dir / f"cpu{cpu}" / "topology")
    (cpu_dir / "online").write_text(f"{online}\n")


@pytest.mark.parametrize("follow", [True, False])
def test_a_long_lived_reconciler_follows_the_online_list(
    paths: HostPaths, tmp_path: Path, follow: bool
) -> None:
    root = tmp_path / "sys"
    shutil.copytree(SYSFS / "no-smt-server", root)
    paths = paths._replace(sys=str(root))
    with Store(paths.state_dir) as store:
        rec = Reconciler(paths, store, follow_hotplug=follow)
        before = rec.topology
        assert rec.topology is before  # nothing changed: the same object, nothing read
        unplug(root, 15)
        after = rec.topology
        if follow:
            assert after.online == before.online - CpuSet([15]) and 15 not in after.cpus
            assert rec.topology is after
        else:  # a command's reconciler keeps what it read
            assert after is before


def test_the_agent_plans_for_a_cpu_unplugged_while_it_runs(
    paths: HostPaths, tmp_path: Path, mocker: Any
) -> None:
    """The agent's planner follows the online list: after a CPU goes, its next pass plans
    on a topology without it (the agent's startup read it with the CPU)."""
    from vmpin.linux import sysfs
    from vmpin.service.agent import Agent

    root = tmp_path / "sys"
    shutil.copytree(SYSFS / "no-smt-server", root)
    paths = paths._replace(sys=str(root))
    reads = mocker.spy(sysfs, "read_topology")
    agent = Agent(paths, partial(Reconciler, paths), interval=3600, workers=1,
                  metrics_port=0)  # fmt: skip
    agent.start()
    try:
        assert dirty_wait(paths, [], 20)["done"] is True
        assert reads.call_count == 1 and 15 in reads.spy_return.cpus
        unplug(root, 15)
        assert dirty_wait(paths, [], 20)["done"] is True
        assert reads.call_count == 2 and 15 not in reads.spy_return.cpus
        assert dirty_wait(paths, [], 20)["done"] is True
        assert reads.call_count == 2  # (read once per change)
    finally:
        agent.request_stop()
        agent.shutdown()

