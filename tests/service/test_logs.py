"""The agent's log lines (vmpin.service.logs): JSON objects, one per line."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest

from vmpin.service.logs import log_event, setup_logging


@pytest.fixture
def stream() -> Iterator[io.StringIO]:
    root = logging.getLogger("vmpin")
    saved = root.handlers[:], root.propagate, root.level
    out = io.StringIO()
    setup_logging(out, "DEBUG")
    try:
        yield out
    finally:
        root.handlers[:], root.propagate = saved[0], saved[1]
        root.setLevel(saved[2])


def test_a_line_is_its_event_and_fields(stream: io.StringIO) -> None:
    log_event(logging.INFO, "sandbox pass", sandbox="s1", pinned=37, path=Path("/x"))
    line = stream.getvalue()
    assert line.endswith("\n") and line.count("\n") == 1
    obj = json.loads(line)
    assert list(obj) == ["ts", "level", "event", "sandbox", "pinned", "path"]
    assert obj["level"] == "info" and obj["event"] == "sandbox pass"
    assert obj["sandbox"] == "s1" and obj["pinned"] == 37
    assert obj["path"] == "/x"  # (what JSON cannot hold, as its str)
    ts = datetime.fromisoformat(obj["ts"])
    assert ts.utcoffset() is not None and ts.utcoffset().total_seconds() == 0
    assert len(obj["ts"]) == len("2026-01-01T00:00:00.000+00:00")


def test_below_the_level_nothing_is_made(stream: io.StringIO) -> None:
    logging.getLogger("vmpin").setLevel("WARNING")
    log_event(logging.INFO, "sandbox pass", sandbox="s1")
    assert stream.getvalue() == ""


def test_a_line_does_not_search_the_stack(
    stream: io.StringIO, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The caller's file, line and function are not looked for: no JSON line shows them,
    and the search was ~15% of a line's cost (the agent writes one per re-pinned sandbox,
    in the planner's work that the next request waits behind; issue 28)."""

    def searched(*args: object, **kw: object) -> object:
        raise AssertionError("findCaller called")

    monkeypatch.setattr(logging.Logger, "findCaller", searched)
    log_event(logging.WARNING, "bad control request", error="x")
    assert json.loads(stream.getvalue())["event"] == "bad control request"
