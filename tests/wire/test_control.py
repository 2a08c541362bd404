"""The control protocol's wire format: the lines on the agent's socket are what they were, and
both sides read what the other writes."""

from __future__ import annotations

import pytest

from vmpin.core.errors import WireError
from vmpin.wire.control import (
    MAX_WAIT,
    Dirty,
    DirtyReply,
    Reconcile,
    Status,
    refused,
    reply_from_json,
    reply_to_json,
    request_from_json,
    request_to_json,
)


@pytest.mark.parametrize(
    ("request_", "line"),
    [
        (Dirty(["p1"]), b'{"op": "dirty", "sandboxes": ["p1"]}\n'),
        (Dirty(["p1"], 1.0), b'{"op": "dirty", "sandboxes": ["p1"], "wait": 1.0}\n'),
        (
            Dirty([], 10.0, maps_first=False),
            b'{"op": "dirty", "sandboxes": [], "wait": 10.0, "guest_map": "after"}\n',
        ),
        (Status(), b'{"op": "status"}\n'),
        (Status("p1"), b'{"op": "status", "sandbox": "p1"}\n'),
        (Reconcile(), b'{"op": "reconcile"}\n'),
    ],
)
def test_requests_are_the_lines_they_were(request_: object, line: bytes) -> None:
    assert request_to_json(request_) == line  # type: ignore[arg-type]
    assert request_from_json(line) == request_


def test_a_raw_object_is_sent_as_it_is() -> None:
    assert request_to_json({"op": "nope"}) == b'{"op": "nope"}\n'


@pytest.mark.parametrize(
    ("line", "why"),
    [
        (b"{broken", "not JSON"),
        (b"[]", "not a JSON object"),
        (b'{"op": "nope"}', "unknown op 'nope' (dirty, status, reconcile)"),
        (b'{"op": "dirty", "sandboxes": "x"}', "must be a list of ids"),
        (b'{"op": "dirty", "sandboxes": ["../x"]}', "invalid id"),
        (b'{"op": "dirty", "sandboxes": [], "wait": 0}', "'wait' must be"),
        (b'{"op": "dirty", "sandboxes": [], "wait": true}', "'wait' must be"),
        (b'{"op": "dirty", "sandboxes": [], "wait": NaN}', "'wait' must be"),
        (b'{"op": "dirty", "sandboxes": [], "wait": Infinity}', "'wait' must be"),
        (b'{"op": "dirty", "sandboxes": [], "wait": 61}', f"(0, {MAX_WAIT:g}]"),
        (b'{"op": "dirty", "sandboxes": [], "wait": 1, "guest_map": "never"}', "guest_map"),
    ],
)
def test_what_the_agent_refuses(line: bytes, why: str) -> None:
    with pytest.raises(WireError, match=None) as err:
        request_from_json(line)
    assert why in str(err.value)


def test_status_with_a_sandbox_that_is_no_string_asks_for_the_node() -> None:
    assert request_from_json(b'{"op": "status", "sandbox": 3}') == Status()
    # (guest_map only counts with wait)
    assert request_from_json(b'{"op": "dirty", "sandboxes": [], "guest_map": "x"}') == Dirty([])


def test_replies() -> None:
    assert reply_to_json(DirtyReply(2).to_obj()) == b'{"ok": true, "queued": 2}\n'
    done = reply_to_json(DirtyReply(1, True).to_obj())
    assert done == b'{"ok": true, "queued": 1, "done": true}\n'
    assert DirtyReply.from_obj(reply_from_json(done)) == DirtyReply(1, True)
    assert DirtyReply.from_obj(refused("no")) is None
    assert DirtyReply.from_obj(None) is None
    assert reply_from_json(b"[1]\n") is None and reply_from_json(b"{") is None
