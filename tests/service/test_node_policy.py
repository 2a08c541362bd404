"""One policy truth for the node's own settings (issue 25): the agent records the policy it
runs with, and a hook, ``audit`` or ``reconcile --once`` that was not given a policy plans
with it.  Before, a CLI without the agent's ``VMPIN_HELPER_POLICY`` planned with the
defaults: ``audit`` called the agent's placement drift and ``reconcile --once`` reverted it.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

from tests.conftest import vmpin_cmd
from tests.service.test_agent import all_on, fake_vmms, register
from tests.support import fakevmm
from tests.support.agents import AgentProc
from tests.support.qemu_util import wait_until
from vmpin.linux.paths import HostPaths
from vmpin.service.settings import NODE_POLICY_META, Settings
from vmpin.state.store import Store

__all__ = ["fake_vmms"]  # the fixture, imported for this module's tests


def test_unset_keys_follow_the_recorded_node_policy(paths: HostPaths) -> None:
    with Store(paths.state_dir) as store:
        assert Settings.from_env({}, {}).over_recorded(store).helpers == "share"  # none yet
        agent = Settings.from_env({"helpers": "isolate", "housekeeping": "0"}, {})
        assert agent.given == ("helpers", "housekeeping")
        agent.record(store, "test")
        plain = Settings.from_env({}, {}).over_recorded(store)
        assert (plain.helpers, plain.housekeeping, plain.vcpus) == ("isolate", "0", "auto")
        # given here, by an option or the environment: that wins for this process
        assert Settings.from_env({"helpers": "share"}, {}).over_recorded(store).helpers == "share"
        by_env = Settings.from_env({}, {"VMPIN_HELPER_POLICY": "none"}).over_recorded(store)
        assert by_env.helpers == "none" and by_env.housekeeping == "0"
        store.set_meta(NODE_POLICY_META, "{not json")  # a hand edit: the defaults, no crash
        assert Settings.from_env({}, {}).over_recorded(store).helpers == "share"


def test_cli_plans_with_the_agents_policy(
    fake_vmms: Callable[..., fakevmm.FakeVmm],
    paths: HostPaths,
    env: dict[str, str],
) -> None:
    """The agent runs with helpers isolate (housekeeping CPU 0); the CLI is given nothing."""
    sid = "np-1"
    vmm = fake_vmms(sid, vcpus=1)
    with Store(paths.state_dir) as store:
        register(store, sid, "1")
    agent_env = {**env, "VMPIN_HELPER_POLICY": "isolate", "VMPIN_HOUSEKEEPING": "0"}
    a = AgentProc(paths, agent_env, Path(paths.state_dir).parent / "agent.log", interval=0.3)
    try:
        a.wait_ready()
        a.wait_pass(2)
        # the agent put the helpers on the housekeeping CPU, the vCPU 1:1 on CPU 1
        assert wait_until(lambda: not all_on(vmm.pid, "1"), 10)
        audit = subprocess.run([*vmpin_cmd(), "audit", "--json"], env=env, capture_output=True,
                               text=True, timeout=60)  # fmt: skip
        assert audit.returncode == 0, audit.stdout
        once = subprocess.run([*vmpin_cmd(), "reconcile", "--once", "--json"], env=env,
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        assert [r["repaired"] for r in json.loads(once.stdout)] == [0], once.stdout
        show = json.loads(subprocess.run([*vmpin_cmd(), "show", sid, "--json"], env=env,
                                         capture_output=True, text=True, timeout=60).stdout)
        assert show["policy"]["helpers"] == "isolate"
    finally:
        assert a.stop() == 0
