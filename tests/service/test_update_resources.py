"""``vmpin update``'s input: ``-r`` read as runc decodes it, ``--cpuset-cpus`` read strictly;
and its re-pin through the agent's blocking reply."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.support.fakeagent import OneReplyAgent, SyncWatchingAgent, watch_syncs
from tests.support.session import new_id
from vmpin.core.cpuset import CpuSet
from vmpin.core.errors import SpecError
from vmpin.linux.paths import HostPaths
from vmpin.service.update import parse_update
from vmpin.state.records import ContainerRec, SandboxRec
from vmpin.state.store import Store

# Documents `runc update -r FILE` applies (Go's encoding/json; runc's fs2 manager writes
# `unified` files verbatim after the cpu fields).  Each names CPUs: none is "nothing to do".
RUNC_ACCEPTS = [
    ({"CPU": {"CPUS": "1-2"}}, "1-2"),
    ({"Cpu": {"cpus": "0,,1"}}, "0-1"),
    ({"unified": {"cpuset.cpus": "3"}}, "3"),
    ({"cpu": {"cpus": "0-1"}, "unified": {"cpuset.cpus": "5"}}, "5"),
    ({"cpu": {"cpus": "0-7:1/2"}}, "0,2,4,6"),
]


@pytest.mark.parametrize(("doc", "cpus"), RUNC_ACCEPTS)
def test_resources_file_as_runc_reads_it(tmp_path: Path, doc: object, cpus: str) -> None:
    path = tmp_path / "r.json"
    path.write_text(json.dumps(doc))
    assert parse_update(None, str(path)) == CpuSet.parse(cpus)


def test_memory_only_resources_are_nothing_for_vmpin(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    path.write_text('{"memory": {"limit": 67108864}}')
    assert parse_update(None, str(path)) is None


@pytest.mark.parametrize("text", ["3-1", "0-7:2/4", "1,,0", "N"])
def test_cpuset_cpus_stays_strict(text: str) -> None:
    # what a user types gets the strict list grammar and one clear line
    with pytest.raises(SpecError) as info:
        parse_update(text, None)
    assert str(info.value).startswith("--cpuset-cpus: ")
    assert repr(text) in str(info.value)
    assert "\n" not in str(info.value)


# -- the re-pin: the agent's blocking reply, else this process --------------------------------
def _runc_container(paths: HostPaths) -> str:
    cid = new_id("upd")
    with Store(paths.state_dir) as store:
        store.put_sandbox(SandboxRec(cid, "runc"))
        store.put_container(ContainerRec(cid, cid, True, cpus=CpuSet.parse("0"),
                                         cpus_source="spec"))
    return cid


@pytest.mark.parametrize(("done", "applied"), [(True, "re-pinned by the agent"),
                                                (False, "this process")])
def test_update_waits_for_the_agents_reply(paths: HostPaths, done: bool, applied: str) -> None:
    """update asks with ``wait`` and takes the reply as the signal (no polling of the store):
    done -> the agent re-pinned; not done (no pass in time) -> this process re-pins."""
    from vmpin.service.update import update_container

    cid = _runc_container(paths)
    agent = OneReplyAgent(paths.control_socket, {"ok": True, "queued": 1, "done": done})
    try:
        result = update_container(paths, cid, cpuset_cpus="0", wait=3.0)
    finally:
        agent.close()
    assert agent.request == {
        "op": "dirty", "sandboxes": [cid], "wait": 3.0, "guest_map": "after"
    }
    if done:
        assert result["applied_by"] == applied
    else:
        assert result["applied_by"] != "re-pinned by the agent"
    with Store(paths.state_dir) as store:
        rec = store.container(cid)
        assert rec is not None and rec.cpus == CpuSet.parse("0") and rec.cpus_source == "update"


def test_update_syncs_its_write_while_the_agent_works(paths: HostPaths, mocker: Any) -> None:
    """The store write is committed without waiting for the disk, so the agent starts at
    once, and synced while the agent's pass runs: the command answers only after both."""
    from vmpin.service.update import update_container

    cid = _runc_container(paths)
    events: list[str] = []
    synced = watch_syncs(mocker, f"{paths.state_dir}/state.db-wal", events)
    agent = SyncWatchingAgent(paths.control_socket, synced, events)
    try:
        result = update_container(paths, cid, cpuset_cpus="0", wait=12.0)
    finally:
        agent.close()
    events.append("returned")
    assert result["applied_by"] == "re-pinned by the agent"
    # the sync came after the agent had the request, and before the answer was read
    assert events[:3] == ["request", "synced", "reply"] and events[-1] == "returned"


def test_update_without_an_agent_syncs_before_it_returns(paths: HostPaths, mocker: Any) -> None:
    from vmpin.service.update import update_container

    cid = _runc_container(paths)
    events: list[str] = []
    watch_syncs(mocker, f"{paths.state_dir}/state.db-wal", events)
    update_container(paths, cid, cpuset_cpus="0", wait=0.5)
    assert "synced" in events


def test_a_failed_sync_fails_the_update_and_is_not_taken_for_a_missing_agent(
    paths: HostPaths, mocker: Any
) -> None:
    """What fails while the agent works is the command's own error (one line, the old set
    back), not "no agent answered" followed by a pass in this process."""
    import errno

    from vmpin.core.errors import StateError
    from vmpin.service.update import update_container

    cid = _runc_container(paths)
    mocker.patch("os.fsync", side_effect=OSError(errno.EIO, "Input/output error"))
    agent = OneReplyAgent(paths.control_socket, {"ok": True, "queued": 1, "done": True})
    reconcile = mocker.patch("vmpin.service.settings.build_reconciler")
    try:
        with pytest.raises(StateError, match=r"state\.db-wal: cannot sync: Input/output error"):
            update_container(paths, cid, cpuset_cpus="1", wait=3.0)
    finally:
        agent.close()
    assert agent.request["op"] == "dirty"
    reconcile.assert_not_called()
    mocker.stopall()
    with Store(paths.state_dir) as store:
        rec = store.container(cid)
        assert rec is not None and rec.cpus == CpuSet.parse("0")
