"""The leftover sweep (tests/support/session.py): what dead test sessions left is removed,
what live ones (this one included) own is never touched."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.session import creator_alive, new_id, start_time, sweep

V1_CPUSET = Path("/sys/fs/cgroup/cpuset")


def dead_tag() -> str:
    """The tag of a process that ran and is gone (its pid may be reused: the start time
    tells them apart)."""
    p = subprocess.Popen(["sleep", "0.2"])
    start = start_time(p.pid)
    p.wait()
    assert start is not None
    return f"p{p.pid}s{start}"


def test_ids_name_their_creator() -> None:
    sid = new_id("sb")
    assert sid.startswith("sb-p") and creator_alive(sid) is True
    assert creator_alive(f"sb-{dead_tag()}-{uuid.uuid4().hex[:8]}") is False
    assert creator_alive("sb1") is None  # no tag: never swept
    assert new_id("sb") != sid


@contextlib.contextmanager
def sandbox_process(sid: str) -> Iterator[subprocess.Popen[bytes]]:
    """A QEMU-shaped process: ``-name sandbox-<sid>`` on its command line."""
    p = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)", "-name", f"sandbox-{sid},x=y"]
    )
    try:
        yield p
    finally:
        p.kill()
        p.wait(10)


def test_sweep_kills_only_the_sandboxes_of_dead_sessions() -> None:
    dead_sid = f"sb-{dead_tag()}-{uuid.uuid4().hex[:8]}"
    with sandbox_process(dead_sid) as dead, sandbox_process(new_id("sb")) as live:
        dead_start, live_start = start_time(dead.pid), start_time(live.pid)
        swept = sweep()
        assert any(f"sandbox-{dead_sid}" in s for s in swept.processes), swept
        assert start_time(dead.pid) != dead_start  # gone (reaped, or at least not running)
        assert start_time(live.pid) == live_start and live.poll() is None


@pytest.mark.cgroup_v1
def test_sweep_removes_only_the_cgroups_of_dead_sessions() -> None:
    mems = (V1_CPUSET / "cpuset.mems").read_text().strip()
    dead_dir = V1_CPUSET / f"vmpin-test-{dead_tag()}-{uuid.uuid4().hex[:8]}"
    live_dir = V1_CPUSET / new_id()
    inner = dead_dir / "ctr"
    made = [dead_dir, inner, live_dir]
    task = None
    try:
        for d in made:
            d.mkdir()
            (d / "cpuset.mems").write_text(mems)
            (d / "cpuset.cpus").write_text("0")
        tasks = str(inner / "tasks")

        def enter() -> None:
            with open(tasks, "w") as f:
                f.write("0")  # this (forked) task

        task = subprocess.Popen(["sleep", "600"], preexec_fn=enter)  # a dead session's container
        swept = sweep()
        assert str(dead_dir) in swept.cgroups and not swept.errors, swept
        assert not dead_dir.exists()
        # killed by the sweep: `sleep 600` ends within seconds only so (the sweep may have
        # reaped our child itself, then wait() reports 0; a zombie still shows its start time)
        task.wait(30)
        assert live_dir.is_dir()
    finally:
        if task is not None and task.poll() is None:
            task.kill()
            task.wait(10)
        for d in reversed(made):
            with contextlib.suppress(FileNotFoundError):
                d.rmdir()
