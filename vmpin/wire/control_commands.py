"""The control protocol's requests of the commands -- ``status``, ``reconcile``, ``view`` (the
read commands) and ``update`` (``vmpin update``; its request and reply are
:mod:`vmpin.wire.control_update`'s) -- their replies, and the agent's reader of every request
line (:func:`request_from_json`).

The protocol itself (its lines, limits, version) and the hooks' ``dirty`` are
:mod:`vmpin.wire.control`'s: a hook loads that module alone.  Both sides use these, so that
they cannot drift: :mod:`vmpin.service.control` writes them, the agent
(:mod:`vmpin.service.agent_protocol`) reads them.
"""

from __future__ import annotations

from vmpin.core.errors import IdError, WireError
from vmpin.core.ids import check_id
from vmpin.wire.control import MAX_AGE, MAX_WAIT, OPS, VIEW_NAMES, Dirty
from vmpin.wire.control_update import Update
from vmpin.wire.jsonio import dumps, loads

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.lean.records)
if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Any, NamedTuple, TypeAlias
else:
    from vmpin.lean.records import NamedTuple


class Status(NamedTuple):
    """The agent's health and counters; one sandbox's bookkeeping with ``sandbox``."""

    sandbox: str | None = None

    def to_obj(self) -> dict[str, Any]:
        obj: dict[str, Any] = {"op": "status"}
        if self.sandbox is not None:
            obj["sandbox"] = self.sandbox
        return obj


class Reconcile(NamedTuple):
    """A full pass now."""

    def to_obj(self) -> dict[str, Any]:
        return {"op": "reconcile"}


class View(NamedTuple):
    """A read command's view, from the agent's plan (vmpin.service.agent_views).

    ``fresh``: the node as it is after the request (``audit``: drift made since the last
    pass must be seen): from a full pass that starts after it, or from the current plan once
    the host is read again and found as that plan's pass observed it; else from the current
    plan when nothing changed since it (older than ``max_age`` seconds: a fresh pass).
    ``wait``: the most the agent takes.
    ``settings``: what the command would observe with (its host roots and the policy keys it
    was given, :meth:`vmpin.service.settings.Settings.view_key`); an agent whose own differ
    refuses."""

    view: str
    settings: dict[str, str]
    wait: float
    sandbox: str | None = None
    fresh: bool = False
    max_age: float | None = None

    def to_obj(self) -> dict[str, Any]:
        obj: dict[str, Any] = {"op": "view", "view": self.view}
        if self.sandbox is not None:
            obj["sandbox"] = self.sandbox
        if self.fresh:
            obj["fresh"] = True
        if self.max_age is not None:
            obj["max_age"] = self.max_age
        obj["wait"] = self.wait
        obj["settings"] = self.settings
        return obj


if TYPE_CHECKING:
    Request: TypeAlias = Dirty | Status | Reconcile | View | Update


class ViewReply(NamedTuple):
    """The agent's answer to :class:`View`: the view as the command prints it with
    ``--json`` (its text: the command prints it as it is, or reads its data back for a
    table), the age of the plan it comes from (seconds) and that pass's number."""

    view: str
    text: str
    age_s: float
    number: int

    @classmethod
    def from_obj(cls, reply: Mapping[str, Any] | None, view: str) -> ViewReply | None:
        """The answer in a reply; None when the agent did not answer this view (refused, an
        old agent that does not know the request, a reply of another shape)."""
        if not reply or reply.get("ok") is not True or reply.get("view") != view:
            return None
        text, age, number = reply.get("text"), reply.get("age_s"), reply.get("pass")
        if not isinstance(text, str) or not isinstance(age, (int, float)):
            return None
        if isinstance(number, bool) or not isinstance(number, int):
            return None
        return cls(view, text, float(age), number)


def view_reply_to_json(view: str, text_json: str, age_s: float, number: int) -> bytes:
    """The reply line of a :class:`View`, around its text already written as a JSON string
    (the agent writes a plan's view once, for every reader of that plan)."""
    head = dumps({"ok": True, "view": view, "age_s": round(age_s, 3), "pass": number})
    return f'{head[:-1]}, "text": {text_json}}}\n'.encode()


def request_from_json(line: bytes | str) -> Request:
    """The request in one line; WireError saying what is wrong (the agent's reply)."""
    try:
        msg = loads(line)
    except ValueError:
        raise WireError("request is not JSON") from None
    if not isinstance(msg, dict):
        raise WireError("request is not a JSON object")
    op = msg.get("op")
    if op == "dirty":
        ids = msg.get("sandboxes")
        if not isinstance(ids, list):
            raise WireError("dirty: 'sandboxes' must be a list of ids")
        try:
            sids = [check_id(s, "sandbox id") for s in ids]
        except IdError as err:
            raise WireError(f"dirty: {err}") from None
        if "wait" not in msg:
            return Dirty(sids)
        wait = msg["wait"]
        # (NaN and infinity fail the range: JSON's NaN and Infinity are read as floats)
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 < wait <= MAX_WAIT:
            raise WireError(f"dirty: 'wait' must be a number of seconds in (0, {MAX_WAIT:g}]")
        guest_map = msg.get("guest_map", "before")
        if guest_map not in ("before", "after"):
            raise WireError("dirty: 'guest_map' must be \"before\" or \"after\" the answer")
        return Dirty(sids, float(wait), guest_map == "before")
    if op == "status":
        sid = msg.get("sandbox")
        return Status(sid if isinstance(sid, str) else None)
    if op == "reconcile":
        return Reconcile()
    if op == "view":
        return _view_from(msg)
    if op == "update":
        return _update_from(msg)
    raise WireError(f"unknown op {op!r} ({', '.join(OPS)})")


def _seconds(msg: Mapping[str, Any], key: str, high: float) -> float | None:
    """A duration of a request, None when absent; WireError unless in (0, high]."""
    if key not in msg:
        return None
    value = msg[key]
    # (NaN and infinity fail the range: JSON's NaN and Infinity are read as floats)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= high:
        raise WireError(f"{msg.get('op')}: {key!r} must be a number of seconds in (0, {high:g}]")
    return float(value)


def _view_from(msg: Mapping[str, Any]) -> View:
    view = msg.get("view")
    if view not in VIEW_NAMES:
        raise WireError(f"view: 'view' must be one of {', '.join(VIEW_NAMES)}")
    sandbox = msg.get("sandbox")
    if (sandbox is None) != (view != "show"):
        raise WireError("view: 'sandbox' is show's, and show needs it")
    if sandbox is not None:
        try:
            sandbox = check_id(sandbox, "sandbox id")
        except IdError as err:
            raise WireError(f"view: {err}") from None
    fresh = msg.get("fresh", False)
    if not isinstance(fresh, bool):
        raise WireError("view: 'fresh' must be true or false")
    settings = msg.get("settings")
    if not isinstance(settings, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in settings.items()
    ):
        raise WireError("view: 'settings' must be an object of strings")
    wait = _seconds(msg, "wait", MAX_WAIT)
    if wait is None:
        raise WireError("view: 'wait' is needed")
    return View(view, settings, wait, sandbox, fresh, _seconds(msg, "max_age", MAX_AGE))


def _update_from(msg: Mapping[str, Any]) -> Update:
    try:
        cid = check_id(msg.get("container", ""), "container id")
    except IdError as err:
        raise WireError(f"update: {err}") from None
    cpus, until, roots = msg.get("cpus"), msg.get("until"), msg.get("roots")
    if not isinstance(cpus, str):
        raise WireError("update: 'cpus' must be a CPU list")
    # (NaN and infinity fail: a deadline no clock reaches would be no deadline)
    if isinstance(until, bool) or not isinstance(until, (int, float)) or not 0 < until < 1e12:
        raise WireError("update: 'until' must be a time of CLOCK_MONOTONIC in seconds")
    wait = _seconds(msg, "wait", MAX_WAIT)
    if wait is None:
        raise WireError("update: 'wait' is needed")
    if not isinstance(roots, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in roots.items()
    ):
        raise WireError("update: 'roots' must be an object of strings")
    return Update(cid, cpus, float(until), wait, roots)
