"""The agent's dirty set (vmpin.service.queue): what one request's round costs it.  Its
behaviour (coalescing, hold-off, batches) is tested in tests/service/test_agent.py."""

from __future__ import annotations

import threading
import time

import pytest

from vmpin.service.queue import DirtyQueue


def test_a_round_takes_the_lock_itself_not_through_the_condition(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """add_all (the connection thread), take_batch (the planner it woke) and done_all take
    the queue's lock as itself: a ``with`` on the condition made on it is two Python calls
    more each (issue 28: ~10% of the round's instructions).  The condition still wakes a
    planner waiting in take_batch."""
    q = DirtyQueue()
    got: list[list[str] | None] = []

    def planner() -> None:
        batch = q.take_batch(timeout=10)
        got.append(None if batch is None else [w.sandbox_id for w in batch])

    thread = threading.Thread(target=planner)
    thread.start()
    deadline = time.monotonic() + 10
    while not q._cond._waiters and time.monotonic() < deadline:  # type: ignore[attr-defined]
        time.sleep(0.001)

    def through(*args: object) -> None:
        raise AssertionError("the condition's with")

    monkeypatch.setattr(threading.Condition, "__enter__", through)
    assert q.add_all(["s1"], "event", time.monotonic(), urgent=True) == [True]
    thread.join(10)
    assert got == [["s1"]]
    q.done_all(["s1"])
    assert q.idle()
