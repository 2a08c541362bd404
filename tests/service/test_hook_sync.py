"""A hook whose sandbox must be in line when it returns (Kata, or VMs on the node) syncs its
journal entry's directory while the agent's pass runs, and always before it returns."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

from tests.support.fakeagent import SyncWatchingAgent, watch_syncs
from tests.support.session import new_id
from vmpin.linux.paths import HostPaths
from vmpin.service import hook
from vmpin.state.journal import journal_dir, pending

CRI = "io.kubernetes.cri."


def _prestart(
    paths: HostPaths, tmp_path: Path, mocker: Any
) -> tuple[str, bytes, list[str], threading.Event]:
    """A plain container's prestart on a node where a VM sandbox runs (its VM dir is there):
    the hook waits for the node to be re-planned, as for Kata.  Syncs of the journal's
    directory are recorded in the list (the event: set by each)."""
    os.makedirs(os.path.join(paths.vm_dir, new_id("vm")))
    os.makedirs(journal_dir(paths.state_dir), exist_ok=True)
    events: list[str] = []
    synced = watch_syncs(mocker, journal_dir(paths.state_dir), events)
    cid = new_id("hs")
    bundle = tmp_path / cid
    bundle.mkdir()
    ann = {CRI + "container-type": "sandbox", CRI + "sandbox-id": cid}
    (bundle / "config.json").write_text(json.dumps({"annotations": ann}))
    state = {"id": cid, "bundle": str(bundle), "annotations": ann, "pid": os.getpid()}
    return cid, json.dumps(state).encode(), events, synced


def test_hook_syncs_the_journal_while_the_agent_works(
    paths: HostPaths, tmp_path: Path, mocker: Any
) -> None:
    cid, data, events, synced = _prestart(paths, tmp_path, mocker)
    agent = SyncWatchingAgent(paths.control_socket, synced, events)
    try:
        assert hook.run(paths, "prestart", data) == cid
    finally:
        agent.close()
    events.append("returned")
    assert agent.request == {"op": "dirty", "sandboxes": [cid], "wait": hook.AGENT_WAIT}
    # the entry was whole and in the journal when the agent was asked (it ingests it), its
    # directory synced after that and before the answer was read
    assert events == ["request", "synced", "reply", "returned"]
    assert len(pending(paths.state_dir)) == 1


def test_hook_without_an_agent_syncs_before_it_reconciles(
    paths: HostPaths, tmp_path: Path, mocker: Any
) -> None:
    cid, data, events, _ = _prestart(paths, tmp_path, mocker)
    here = mocker.patch.object(hook, "reconcile_here",
                               side_effect=lambda *a: events.append("reconciled"))  # fmt: skip
    assert hook.run(paths, "prestart", data) == cid
    assert events == ["synced", "reconciled"]
    here.assert_called_once()
