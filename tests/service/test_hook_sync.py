"""A hook whose sandbox must be in line when it returns (Kata, or VMs on the node) syncs its
journal entry (the file, then its directory) while the agent's pass runs, or after its own
pass when no agent answers, and always before it returns."""

from __future__ import annotations

import errno
import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.support.fakeagent import OneReplyAgent, SyncWatchingAgent, watch_syncs
from tests.support.session import new_id
from vmpin.core.errors import StateError
from vmpin.linux.paths import HostPaths
from vmpin.service import budget, hook
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
    synced = watch_syncs(mocker, journal_dir(paths.state_dir), events, journal_dir(paths.state_dir))
    cid, state = _pod(tmp_path, "hs")
    return cid, state, events, synced


def _pod(tmp_path: Path, prefix: str) -> tuple[str, bytes]:
    """A pod's sandbox container: its id, and its OCI state (its bundle written)."""
    cid = new_id(prefix)
    bundle = tmp_path / cid
    bundle.mkdir()
    ann = {CRI + "container-type": "sandbox", CRI + "sandbox-id": cid}
    (bundle / "config.json").write_text(json.dumps({"annotations": ann}))
    state = {"id": cid, "bundle": str(bundle), "annotations": ann, "pid": os.getpid()}
    return cid, json.dumps(state).encode()


def _touches(mocker: Any, paths: HostPaths) -> dict[str, int]:
    """Count what the hook does to its own files: opens of its event's file (``.tmp`` or
    renamed: "event opened") and looks at the agent's socket file ("socket stat")."""
    counts = {"event opened": 0, "socket stat": 0}
    jdir = journal_dir(paths.state_dir)
    real_open, real_stat = os.open, os.stat

    def opening(path: Any, *args: Any, **kw: Any) -> int:
        if os.path.dirname(str(path)) == jdir and str(path).endswith((".json", ".json.tmp")):
            counts["event opened"] += 1
        return real_open(path, *args, **kw)

    def stat(path: Any, *args: Any, **kw: Any) -> os.stat_result:
        if path == paths.control_socket:
            counts["socket stat"] += 1
        return real_stat(path, *args, **kw)

    mocker.patch("os.open", side_effect=opening)
    mocker.patch("os.stat", side_effect=stat)
    return counts


def test_hook_syncs_the_journal_while_the_agent_works(
    paths: HostPaths, tmp_path: Path, mocker: Any
) -> None:
    cid, data, events, synced = _prestart(paths, tmp_path, mocker)
    agent = SyncWatchingAgent(paths.control_socket, synced, events)
    touches = _touches(mocker, paths)
    try:
        assert hook.run(paths, "prestart", data) == cid
    finally:
        agent.close()
    events.append("returned")
    assert agent.request == {"op": "dirty", "sandboxes": [cid], "wait": budget.AGENT_WAIT}
    # the entry was whole and in the journal when the agent was asked (it ingests it), the
    # file and its directory synced after that and before the answer was read
    assert events == ["request", "synced file", "synced", "reply", "returned"]
    assert len(pending(paths.state_dir)) == 1
    # the file synced through the descriptor it was written by (not opened again), the
    # agent's socket file looked at once (not again by the request)
    assert touches == {"event opened": 1, "socket stat": 1}


def test_hook_without_an_agent_syncs_before_it_returns(
    paths: HostPaths, tmp_path: Path, mocker: Any
) -> None:
    """No agent: the entry is in the journal (whole) for the hook's own pass, and synced
    after it, before the hook returns."""
    cid, data, events, _ = _prestart(paths, tmp_path, mocker)

    def reconcile(*_: Any) -> None:
        assert len(pending(paths.state_dir)) == 1  # (its pass applies it)
        events.append("reconciled")

    here = mocker.patch.object(hook, "reconcile_here", side_effect=reconcile)
    assert hook.run(paths, "prestart", data) == cid
    events.append("returned")
    assert events == ["reconciled", "synced file", "synced", "returned"]
    here.assert_called_once()
    assert len(pending(paths.state_dir)) == 1


def test_hook_without_an_agent_reports_a_failed_sync(
    paths: HostPaths, tmp_path: Path, mocker: Any
) -> None:
    """A sync that fails is the hook's failure, one line naming the directory, after its
    pass (the pins stand)."""
    _, data, _, _ = _prestart(paths, tmp_path, mocker)
    jdir = os.path.realpath(journal_dir(paths.state_dir))
    real = os.fsync

    def fsync(fd: int) -> None:
        if os.path.realpath(f"/proc/self/fd/{fd}") == jdir:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real(fd)

    mocker.patch("os.fsync", side_effect=fsync)
    here = mocker.patch.object(hook, "reconcile_here")
    with pytest.raises(StateError) as err:
        hook.run(paths, "prestart", data)
    here.assert_called_once()
    assert str(err.value) == f"{journal_dir(paths.state_dir)}: event not recorded durably: " + (
        os.strerror(errno.EIO)
    )


def test_hook_pinning_in_process_keeps_the_wal_short(
    paths: HostPaths, tmp_path: Path, mocker: Any
) -> None:
    """The hook's own pass (no agent) checkpoints a short WAL: it leaves unclosed, and the
    next start without an agent reads the whole WAL again (Store.keep_wal_short)."""
    from vmpin.state.ingest import SHORT_WAL
    from vmpin.state.store import Store

    cid, data, _, _ = _prestart(paths, tmp_path, mocker)
    spy = mocker.spy(Store, "keep_wal_short")
    assert hook.run(paths, "prestart", data) == cid
    spy.assert_called_once()
    store = spy.call_args.args[0]
    assert store.db.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == SHORT_WAL


def test_hook_without_an_agent_whose_event_cannot_be_written_does_not_pin(
    paths: HostPaths, tmp_path: Path, mocker: Any
) -> None:
    """The file could not be written (a full disk): the hook's one-line error says the
    event was not recorded, no pass applied the journal, and no temp file is left."""
    from vmpin.state.store import Store

    _, data, _, _ = _prestart(paths, tmp_path, mocker)
    real = os.write

    def write(fd: int, chunk: Any) -> int:
        if os.path.realpath(f"/proc/self/fd/{fd}").endswith(".json.tmp"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, chunk)

    mocker.patch("os.write", side_effect=write)
    ingest = mocker.spy(Store, "ingest")
    with pytest.raises(StateError, match="event not recorded: No space left on device"):
        hook.run(paths, "prestart", data)
    ingest.assert_not_called()
    assert os.listdir(journal_dir(paths.state_dir)) == []


def test_a_plain_hook_renames_its_event_into_place_then_syncs_it(
    paths: HostPaths, tmp_path: Path, mocker: Any
) -> None:
    """A plain container on a node without VMs (no agent): the event's file is renamed into
    place whole, then it and the journal's directory are synced, before the hook returns --
    the file's sync commits the rename too, so the directory's finds nothing left to write
    (two journal commits on ext4 were one more than needed)."""
    os.makedirs(journal_dir(paths.state_dir), exist_ok=True)
    events: list[str] = []
    watch_syncs(mocker, journal_dir(paths.state_dir), events, journal_dir(paths.state_dir))
    real = os.rename

    def rename(src: str, dst: str) -> None:
        real(src, dst)
        events.append("renamed")

    mocker.patch("os.rename", side_effect=rename)
    cid = new_id("hp")
    bundle = tmp_path / cid
    bundle.mkdir()
    ann = {CRI + "container-type": "sandbox", CRI + "sandbox-id": cid}
    (bundle / "config.json").write_text(json.dumps({"annotations": ann}))
    state = {"id": cid, "bundle": str(bundle), "annotations": ann, "pid": os.getpid()}
    assert hook.run(paths, "prestart", json.dumps(state).encode()) == cid
    events.append("returned")
    assert events == ["renamed", "synced file", "synced", "returned"]
    assert len(pending(paths.state_dir)) == 1


def test_a_plain_hook_beside_an_agent_opens_its_event_and_the_socket_file_once(
    paths: HostPaths, tmp_path: Path, mocker: Any
) -> None:
    """A plain container with an agent up: the event's file is opened once (written, then
    synced through the same descriptor), and the agent's socket file looked at once -- by
    the hook, which then posts to the agent without notify or the exchange looking again."""
    os.makedirs(journal_dir(paths.state_dir), exist_ok=True)
    events: list[str] = []
    watch_syncs(mocker, journal_dir(paths.state_dir), events, journal_dir(paths.state_dir))
    agent = OneReplyAgent(paths.control_socket, {"ok": True, "queued": 1})
    touches = _touches(mocker, paths)
    cid, state = _pod(tmp_path, "ho")
    try:
        assert hook.run(paths, "prestart", state) == cid
    finally:
        agent.close()
    assert agent.request == {"op": "dirty", "sandboxes": [cid]}
    assert events == ["synced file", "synced"]
    assert touches == {"event opened": 1, "socket stat": 1}
    assert len(pending(paths.state_dir)) == 1
