"""The control protocol's wire format: the lines on the agent's socket are what they were, and
both sides read what the other writes."""

from __future__ import annotations

import pytest

from vmpin.core.errors import WireError
from vmpin.wire import jsonio, views
from vmpin.wire.control import (
    MAX_REPLY,
    MAX_WAIT,
    Dirty,
    DirtyReply,
    refused,
    reply_from_json,
    reply_to_json,
    request_to_json,
)
from vmpin.wire.control_commands import (
    Reconcile,
    Status,
    View,
    ViewReply,
    request_from_json,
    view_reply_to_json,
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
        (
            View("sandboxes", {"proc": "/proc"}, 1.75, max_age=30.0),
            b'{"op": "view", "view": "sandboxes", "max_age": 30.0, "wait": 1.75,'
            b' "settings": {"proc": "/proc"}}\n',
        ),
        (
            View("show", {}, 2.0, "p1"),
            b'{"op": "view", "view": "show", "sandbox": "p1", "wait": 2.0, "settings": {}}\n',
        ),
        (
            View("audit", {}, 2.0, fresh=True),
            b'{"op": "view", "view": "audit", "fresh": true, "wait": 2.0, "settings": {}}\n',
        ),
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
        (b'{"op": "nope"}', "unknown op 'nope' (dirty, status, reconcile, view, update)"),
        (b'{"op": "dirty", "sandboxes": "x"}', "must be a list of ids"),
        (b'{"op": "dirty", "sandboxes": ["../x"]}', "invalid id"),
        (b'{"op": "dirty", "sandboxes": [], "wait": 0}', "'wait' must be"),
        (b'{"op": "dirty", "sandboxes": [], "wait": true}', "'wait' must be"),
        (b'{"op": "dirty", "sandboxes": [], "wait": NaN}', "'wait' must be"),
        (b'{"op": "dirty", "sandboxes": [], "wait": Infinity}', "'wait' must be"),
        (b'{"op": "dirty", "sandboxes": [], "wait": 61}', f"(0, {MAX_WAIT:g}]"),
        (b'{"op": "dirty", "sandboxes": [], "wait": 1, "guest_map": "never"}', "guest_map"),
        (b'{"op": "view", "view": "topology", "wait": 1, "settings": {}}', "'view' must be"),
        (b'{"op": "view", "view": "show", "wait": 1, "settings": {}}', "show needs it"),
        (b'{"op": "view", "view": "audit", "sandbox": "a", "wait": 1, "settings": {}}',
         "'sandbox' is show's"),
        (b'{"op": "view", "view": "show", "sandbox": "../a", "wait": 1, "settings": {}}',
         "invalid id"),
        (b'{"op": "view", "view": "audit", "fresh": 1, "wait": 1, "settings": {}}', "'fresh'"),
        (b'{"op": "view", "view": "audit", "wait": 1}', "'settings' must be"),
        (b'{"op": "view", "view": "audit", "wait": 1, "settings": {"a": 1}}', "'settings'"),
        (b'{"op": "view", "view": "audit", "settings": {}}', "'wait' is needed"),
        (b'{"op": "view", "view": "audit", "wait": 61, "settings": {}}', "'wait' must be"),
        (b'{"op": "view", "view": "audit", "wait": 1, "max_age": -1, "settings": {}}',
         "'max_age' must be"),
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


def test_a_view_reply_carries_its_text_as_written() -> None:
    text = '[\n  {\n    "id": "a"\n  }\n]'
    line = view_reply_to_json("sandboxes", jsonio.dumps(text), 0.12345, 7)
    assert line == (
        b'{"ok": true, "view": "sandboxes", "age_s": 0.123, "pass": 7,'
        b' "text": "[\\n  {\\n    \\"id\\": \\"a\\"\\n  }\\n]"}\n'
    )
    assert ViewReply.from_obj(reply_from_json(line), "sandboxes") == ViewReply(
        "sandboxes", text, 0.123, 7
    )
    # another view's answer, a refusal (an old agent's "unknown op"), no answer: none
    assert ViewReply.from_obj(reply_from_json(line), "containers") is None
    old = refused("unknown op 'view' (dirty, status, reconcile)")
    assert ViewReply.from_obj(old, "audit") is None
    assert ViewReply.from_obj(None, "audit") is None
    assert ViewReply.from_obj({"ok": True, "view": "audit", "pass": 1, "age_s": 0}, "audit") is None
    shaped = {"ok": True, "view": "audit", "pass": True, "age_s": 0, "text": "{}"}
    assert ViewReply.from_obj(shaped, "audit") is None


def test_a_view_of_2000_sandboxes_fits_the_reply_limit_many_times_over() -> None:
    """The largest views: every container, and every sandbox, of a 2,000-pod node with
    containerd's 64-character ids; the limit leaves room for nodes several times that."""
    def cid(n: int) -> str:
        return f"{n:064x}"

    rows = [
        views.container(
            id=cid(2 * n + k), sandbox=cid(2 * n), name="workload-container-name",
            cpus="0-3,8-11", runtime="kata", is_sandbox=k == 0, pod_uid=cid(n)[:36],
            pod_name="a-pod-with-a-long-name", pod_namespace="a-namespace",
            cpus_source="kubelet", pid=4194303, stored_cpus="0-3,8-11",
        )
        for n in range(2000) for k in (0, 1, 2)
    ]  # fmt: skip
    text = jsonio.dumps(rows, indent=2)  # (as printed: vmpin.service.commands.json_text)
    line = view_reply_to_json("containers", jsonio.dumps(text), 1.0, 1)
    assert len(line) * 4 < MAX_REPLY
    got = ViewReply.from_obj(reply_from_json(line), "containers")
    assert got is not None and jsonio.loads(got.text) == rows
