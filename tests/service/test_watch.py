"""The agent's inotify watch: runc state and kubelet checkpoint changes mark work at once.

Real runc containers (their hooks record them in the store), a real ``runc update`` (no hook
fires), real renames of kubelet's checkpoint.  The in-process tests check what the watcher
reports; the last one runs ``vmpin serve`` with a periodic pass an hour away, so only the watch
can be what makes the agent adopt the update.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.qemu_util import wait_until
from tests.support.runc_util import RuncSession, missing, new_id
from vmpin.linux.paths import HostPaths
from vmpin.service.watch import Watcher
from vmpin.state.store import Store

pytestmark = [pytest.mark.runc, pytest.mark.multi_cpu]


class Calls:
    def __init__(self) -> None:
        self.got: list[tuple[float, list[str]]] = []
        self.cond = threading.Condition()

    def __call__(self, ids: list[str]) -> None:
        with self.cond:
            self.got.append((time.monotonic(), ids))
            self.cond.notify_all()

    def wait_for(self, sid: str, since: float, timeout: float = 5.0) -> float:
        """Seconds from ``since`` to the first call naming ``sid`` after it."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for t, ids in self.got:
                    if t >= since and sid in ids:
                        return t - since
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no call for {sid}: {self.got}")
                self.cond.wait(left)


@pytest.fixture
def runc(paths: HostPaths, tmp_path: Path) -> Iterator[RuncSession]:
    why = missing()
    if why:
        pytest.skip(why)
    with RuncSession(paths, tmp_path / "work") as session:
        yield session


@pytest.fixture
def watched(paths: HostPaths) -> Iterator[tuple[Watcher, Calls]]:
    calls = Calls()
    w = Watcher(paths, calls, rescan=0.2).start()
    try:
        yield w, calls
    finally:
        w.close()


def test_runc_update_is_reported_for_its_sandbox(
    runc: RuncSession, watched: tuple[Watcher, Calls]
) -> None:
    _, calls = watched
    cid = new_id("vmpin-watch")
    runc.run(cid, cpus="0")  # the root and the container's dir appear after the watch began
    other = new_id("vmpin-watch")
    runc.run(other, cpus="0")
    time.sleep(0.3)  # let the creation events pass
    before = time.monotonic()
    runc.update(cid, "0-1" if (os.cpu_count() or 1) > 1 else "0")
    latency = calls.wait_for(cid, before)
    print(f"runc update -> watch callback: {latency * 1000:.1f} ms")
    assert all(other not in ids for t, ids in calls.got if t >= before)


def test_checkpoint_rename_marks_every_sandbox(
    runc: RuncSession, watched: tuple[Watcher, Calls], paths: HostPaths
) -> None:
    _, calls = watched
    a, b = new_id("vmpin-watch"), new_id("vmpin-watch")
    runc.run(a, cpus="0")
    runc.run(b, cpus="0")
    before = time.monotonic()
    # kubelet writes a temporary file and renames it over the checkpoint
    tmp = Path(paths.kubelet_state + ".tmp")
    tmp.write_text(json.dumps({"policyName": "none", "defaultCpuSet": "", "checksum": 1}))
    os.rename(tmp, paths.kubelet_state)
    calls.wait_for(a, before)
    calls.wait_for(b, before)


def test_unknown_containers_and_other_files_mark_nothing(
    watched: tuple[Watcher, Calls], paths: HostPaths
) -> None:
    w, calls = watched
    root = Path(paths.runc_root)
    (root / "stranger").mkdir(parents=True)
    assert wait_until(lambda: str(root) in w._watched, 5, 0.02)
    (root / "stranger" / "state.json").write_text("{}")  # not in vmpin's store
    Path(paths.kubelet_state).with_name("unrelated").write_text("x")
    time.sleep(0.5)
    assert calls.got == []


def test_containerd_namespace_created_later_is_watched(
    paths: HostPaths, tmp_path: Path
) -> None:
    parent = tmp_path / "ctd-runc"
    parent.mkdir()
    ns_paths = paths._replace(runc_root=f"{paths.runc_root}:{parent}/*")
    calls = Calls()
    w = Watcher(ns_paths, calls, rescan=60).start()
    try:
        cid = new_id("vmpin-watch")
        with Store(paths.state_dir) as store:
            from vmpin.state.records import ContainerRec, SandboxRec

            store.put_sandbox(SandboxRec(id=cid, runtime="runc"))
            store.put_container(ContainerRec(id=cid, sandbox_id=cid, is_sandbox=True))
        (parent / "k8s.io" / cid).mkdir(parents=True)
        assert wait_until(lambda: str(parent / "k8s.io" / cid) in w._watched, 5, 0.02)
        before = time.monotonic()
        tmp = parent / "k8s.io" / cid / "state.json.tmp"
        tmp.write_text("{}")
        os.rename(tmp, parent / "k8s.io" / cid / "state.json")
        calls.wait_for(cid, before)
    finally:
        w.close()


def test_agent_adopts_runc_update_through_the_watch(
    runc: RuncSession, paths: HostPaths, env: dict[str, str], tmp_path: Path
) -> None:
    """``vmpin serve --interval 3600``: after its start-up pass only the watch can make it
    adopt a ``runc update`` (no hook fires for one)."""
    from tests.support.agents import AgentProc

    cid = new_id("vmpin-watch")
    pid = runc.run(cid, cpus="0")
    agent = AgentProc(paths, env, tmp_path / "agent.log", interval=3600)
    try:
        agent.wait_ready()
        agent.wait_pass(1)
        want = "0-1" if (os.cpu_count() or 1) > 1 else "0"
        before = time.monotonic()
        runc.update(cid, want)

        def adopted() -> Any:
            with Store(paths.state_dir, ingest=False) as store:
                rec = store.container(cid)
            return rec is not None and rec.cpus_source == "runc"

        assert wait_until(adopted, 10, 0.002), agent.log.read_text()
        print(f"runc update -> adopted by the agent: {(time.monotonic() - before) * 1000:.1f} ms")
        status = agent.status() or {}
        assert status.get("passes") == 1, status  # no periodic pass did it
        with open(f"/proc/{pid}/status") as f:
            assert f"Cpus_allowed_list:\t{want}" in f.read()
        assert agent.stop() == 0
    finally:
        agent.kill()


def test_root_created_after_the_watch_with_an_immediate_update(
    runc: RuncSession, paths: HostPaths
) -> None:
    """runc makes its root with the first container; an update right after must not be lost
    (no rescan timer can help here: it is an hour away)."""
    assert not os.path.exists(paths.runc_root)
    calls = Calls()
    w = Watcher(paths, calls, rescan=3600).start()
    try:
        time.sleep(0.1)  # the watch is in place
        cid = new_id("vmpin-watch")
        runc.run(cid, cpus="0")
        before = time.monotonic()
        runc.update(cid, "0-1" if (os.cpu_count() or 1) > 1 else "0")
        calls.wait_for(cid, before - 5)  # the update, or the dir's discovery just before it
        assert str(Path(paths.runc_root) / cid) in w._watched
    finally:
        w.close()
