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


def test_a_deadlines_wait_is_set_when_shorter_and_waited_to_its_end(state_dir: Path) -> None:
    """SQLite's busy_timeout is set only when the one in force is longer than what the
    deadline leaves (issue 28: a pragma SQLite compiled again before every transaction);
    a shorter one that runs out with the lock still taken is followed by the rest."""
    holder = Store(str(state_dir), ingest=False, shared=True)
    writer = Store(str(state_dir), ingest=False)
    sql: list[str] = []
    writer.db.set_trace_callback(sql.append)
    try:
        for left in (10.0, 20.0, 5.0):
            writer.deadline = time.monotonic() + left
            writer.mark_dirty(["s1"])
        pragmas = [s for s in sql if s.startswith("PRAGMA busy_timeout")]
        assert len(pragmas) == 2, sql  # (the first, then the shorter: not the longer)
        writer.deadline = time.monotonic() + 0.05  # a short wait in force
        writer.mark_dirty(["s1"])
        assert writer.busy_ms is not None and writer.busy_ms <= 50
        # the lock taken past the wait in force: the rest waited, and the write made
        holder.db.execute("BEGIN IMMEDIATE")
        threading.Timer(0.3, lambda: holder.db.execute("COMMIT")).start()
        writer.deadline = time.monotonic() + 5
        t0 = time.monotonic()
        writer.mark_dirty(["s1"])
        assert 0.2 < time.monotonic() - t0 < 4
        # and never past the deadline
        holder.db.execute("BEGIN IMMEDIATE")
        writer.deadline = time.monotonic() + 0.3
        t0 = time.monotonic()
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            writer.mark_dirty(["s1"])
        assert 0.25 < time.monotonic() - t0 < 1.5
        holder.db.execute("ROLLBACK")
    finally:
        writer.db.set_trace_callback(None)
        holder.close()
        writer.close()
