"""The writers of one process queue on a shared lock before SQLite's (the agent's planner,
updates, settler and main thread: vmpin.state.writer.Writer.local_lock): each is woken as the
one before commits, not by SQLite's busy handler's sleeps; a deadline still bounds the wait,
and a failed transaction gives the lock back."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from vmpin.core.cpuset import CpuSet
from vmpin.state.records import ContainerRec, SandboxRec
from vmpin.state.sqlite import sqlite3
from vmpin.state.store import Store


def _stores(state_dir: Path) -> tuple[Store, Store, threading.Lock]:
    lock = threading.Lock()
    a = Store(str(state_dir), ingest=False, shared=True)
    b = Store(str(state_dir), ingest=False, shared=True)
    a.local_lock = b.local_lock = lock
    with a.transaction():
        a.put_sandbox(SandboxRec("s1", "runc"))
        a.put_container(ContainerRec("c1", "s1", True, cpus=CpuSet.parse("0")))
    return a, b, lock


def test_a_second_writer_waits_its_turn_and_writes(state_dir: Path) -> None:
    a, b, lock = _stores(state_dir)
    done: list[float] = []
    try:
        with a.transaction():
            assert lock.locked()  # taken before SQLite's
            a.set_container_cpus("c1", CpuSet.parse("1"), "update")
            t = threading.Thread(
                target=lambda: (b.set_container_cpus("c1", CpuSet.parse("0-1"), "update"),
                                done.append(time.monotonic())))  # fmt: skip
            t.start()
            time.sleep(0.1)
            assert not done  # waiting on the lock, not failing
            committed = time.monotonic()
        t.join(5)
        assert done and done[0] >= committed
        rec = a.container("c1")
        assert rec is not None and rec.cpus == CpuSet.parse("0-1")  # the later write last
        assert not lock.locked()
    finally:
        a.close()
        b.close()


def test_a_deadline_bounds_the_wait_and_changes_nothing(state_dir: Path) -> None:
    a, b, lock = _stores(state_dir)
    try:
        with a.transaction():
            b.deadline = time.monotonic() + 0.2
            t0 = time.monotonic()
            with pytest.raises(sqlite3.OperationalError, match="locked"):
                b.set_container_cpus("c1", CpuSet.parse("1"), "update")
            assert 0.15 < time.monotonic() - t0 < 2
        rec = a.container("c1")
        assert rec is not None and rec.cpus == CpuSet.parse("0")
        assert not lock.locked()
    finally:
        a.close()
        b.close()


def test_a_failed_transaction_gives_the_lock_back(state_dir: Path) -> None:
    a, b, lock = _stores(state_dir)
    try:
        with pytest.raises(RuntimeError), a.transaction():
            a.set_container_cpus("c1", CpuSet.parse("1"), "update")
            raise RuntimeError("mid-transaction")
        assert not lock.locked()
        b.set_container_cpus("c1", CpuSet.parse("1"), "update")
        rec = a.container("c1")
        assert rec is not None and rec.cpus == CpuSet.parse("1")
    finally:
        a.close()
        b.close()
