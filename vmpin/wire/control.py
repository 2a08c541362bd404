"""The agent's control protocol: the requests and replies on its socket, one home for both sides.

The client (:mod:`vmpin.service.control`: hooks, ``vmpin update``, ``vmpin status``) writes
requests and reads replies with this module; the agent (:mod:`vmpin.service.agent_protocol`,
on :mod:`vmpin.service.server`'s socket) reads requests and writes replies with it, so the two
cannot drift.  One JSON object per line each way, version :data:`VERSION`::

    {"op":"dirty","sandboxes":[ids]}            -> {"ok":true,"queued":n}
    {"op":"dirty","sandboxes":[ids],"wait":s}   -> {"ok":true,"queued":n,"done":bool}
        (0 < s <= MAX_WAIT; "guest_map": "before" (default) or "after" the answer)
    {"op":"status"[,"sandbox":id]}              -> health and counters (one sandbox's
                                                   bookkeeping when asked; the agent's own
                                                   object, ``vmpin status`` prints it)
    {"op":"reconcile"}                          -> {"ok":true}: a full pass now
    {"op":"update","container":id,"cpus":LIST,"until":t,"wait":s,"roots":{key:path}}
                                                -> {"ok":true,"done":true,"id":id,
                                                   "sandbox":id,"cpus":LIST}
                                                   or {"ok":true,"done":false,"error":TEXT}
        (``vmpin update`` written by the agent: the set is written only before "until",
        CLOCK_MONOTONIC seconds, checked inside the write transaction; "done" once a pass
        planned from it has pinned; not done, the set is as before: the caller does it
        itself.  Refused when "roots" are not the agent's host roots)
    {"op":"view","view":NAME[,"sandbox":id][,"fresh":true][,"max_age":s],"wait":s,
     "settings":{key:value}}                    -> {"ok":true,"view":NAME,"age_s":s,
                                                   "pass":n,"text":TEXT}
        (NAME one of VIEW_NAMES, "sandbox" for show; TEXT what the command prints with
        --json, to the byte; refused when the agent's settings differ from "settings",
        or it cannot answer within "wait": the command then observes in-process)
    anything else                               -> {"ok":false,"error":TEXT}

The version is not on the wire: version 1 is everything a vmpin since the agent existed sends
and understands; a change that an older peer would misread takes a new socket name instead,
so an old hook meeting a new agent gets no agent, never a wrong answer.  Limits: a request
line of at most :data:`MAX_REQUEST` bytes, a blocking wait of at most :data:`MAX_WAIT` s, a
reply line of at most :data:`MAX_REPLY` bytes (a view of a 2,000-sandbox node is ~3 MB).

Lean (the Kata hook speaks it): stdlib and vmpin.core only, no ``typing`` at run time.
"""

from __future__ import annotations

from vmpin.core.errors import IdError, WireError
from vmpin.core.ids import check_id
from vmpin.wire.jsonio import dumps, loads

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.lean.records)
if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Any, NamedTuple, TypeAlias
else:
    from vmpin.lean.records import NamedTuple

#: the protocol's version (not sent: see the module docstring)
VERSION = 1
#: the longest request line the agent reads
MAX_REQUEST = 1 << 20
#: the longest a blocking ``dirty`` request may ask to wait (seconds)
MAX_WAIT = 60.0
#: the oldest plan a ``view`` may ask for (seconds)
MAX_AGE = 86400.0
#: the longest reply line a client reads (a view: ~1 KB per sandbox, threads included)
MAX_REPLY = 32 << 20
#: the views the agent answers from its plan (vmpin.service.agent_views)
VIEW_NAMES = ("containers", "sandboxes", "show", "audit")
OPS = ("dirty", "status", "reconcile", "view", "update")


class Dirty(NamedTuple):
    """Mark sandboxes dirty (their new level is in the store or the journal already).

    ``wait``: block until a node pass that started after the request has ended (None: reply
    at once); ``maps_first``: that pass publishes its guest maps before the answer."""

    sandboxes: list[str]
    wait: float | None = None
    maps_first: bool = True

    def to_obj(self) -> dict[str, Any]:
        obj: dict[str, Any] = {"op": "dirty", "sandboxes": self.sandboxes}
        if self.wait is not None:
            obj["wait"] = self.wait
            if not self.maps_first:
                obj["guest_map"] = "after"
        return obj


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


class Update(NamedTuple):
    """``vmpin update``, written and re-pinned by the agent (vmpin.service.agent_updates):
    the command then opens no store, and waits for one pass instead of a write, a sync and
    a pass.

    ``until`` (``time.monotonic()``, the caller's): the agent writes only before it, and
    checks that inside the write transaction, so that a caller that gave up at ``until``
    and wrote the set itself can never be overwritten by an agent that was stopped with
    the request in hand (issue 26).  ``wait``: the caller's wait, which ``until`` must not
    lie beyond (an agent whose monotonic clock is not the caller's refuses).  ``roots``:
    the caller's host roots (HostPaths), which must be the agent's."""

    container: str
    cpus: str
    until: float
    wait: float
    roots: dict[str, str]

    def to_obj(self) -> dict[str, Any]:
        return {
            "op": "update",
            "container": self.container,
            "cpus": self.cpus,
            "until": self.until,
            "wait": self.wait,
            "roots": self.roots,
        }


if TYPE_CHECKING:
    Request: TypeAlias = Dirty | Status | Reconcile | View | Update


class DirtyReply(NamedTuple):
    """The agent's answer to :class:`Dirty`: how many sandboxes it queued, and for a blocking
    request whether a pass that saw it has ended well (``done``; None: not blocking)."""

    queued: int
    done: bool | None = None

    def to_obj(self) -> dict[str, Any]:
        obj: dict[str, Any] = {"ok": True, "queued": self.queued}
        if self.done is not None:
            obj["done"] = self.done
        return obj

    @classmethod
    def from_obj(cls, reply: Mapping[str, Any] | None) -> DirtyReply | None:
        """The answer in a reply; None when the agent did not take the request."""
        if not reply or not reply.get("ok"):
            return None
        return cls(reply.get("queued", 0), bool(reply["done"]) if "done" in reply else None)


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


class UpdateReply(NamedTuple):
    """The agent's answer to :class:`Update`: ``done`` with the container's sandbox and set
    as written, or not done with why (the set then is as it was, bar a later writer's)."""

    done: bool
    id: str = ""
    sandbox: str = ""
    cpus: str | None = None
    error: str | None = None

    def to_obj(self) -> dict[str, Any]:
        if not self.done:
            return {"ok": True, "done": False, "error": self.error or "not done"}
        return {"ok": True, "done": True, "id": self.id, "sandbox": self.sandbox,
                "cpus": self.cpus}  # fmt: skip

    @classmethod
    def from_obj(cls, reply: Mapping[str, Any] | None) -> UpdateReply | None:
        """The answer in a reply; None when the agent did not take the request (an old
        agent, a refusal, a reply of another shape)."""
        if not reply or reply.get("ok") is not True or not isinstance(reply.get("done"), bool):
            return None
        if not reply["done"]:
            error = reply.get("error")
            return cls(False, error=error if isinstance(error, str) else None)
        cid, sid, cpus = reply.get("id"), reply.get("sandbox"), reply.get("cpus")
        if not isinstance(cid, str) or not isinstance(sid, str):
            return None
        return cls(True, cid, sid, cpus if isinstance(cpus, str) else None)


def view_reply_to_json(view: str, text_json: str, age_s: float, number: int) -> bytes:
    """The reply line of a :class:`View`, around its text already written as a JSON string
    (the agent writes a plan's view once, for every reader of that plan)."""
    head = dumps({"ok": True, "view": view, "age_s": round(age_s, 3), "pass": number})
    return f'{head[:-1]}, "text": {text_json}}}\n'.encode()


OK: dict[str, Any] = {"ok": True}


def refused(error: str) -> dict[str, Any]:
    """The reply to a request the agent did not understand (``error`` says why)."""
    return {"ok": False, "error": error}


def request_to_json(message: Request | Mapping[str, Any]) -> bytes:
    """A request line (``message`` a request, or a raw object: tests and probes send any)."""
    if isinstance(message, (Dirty, Status, Reconcile, View, Update)):
        message = message.to_obj()
    return dumps(message).encode() + b"\n"


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


def reply_to_json(reply: Mapping[str, Any]) -> bytes:
    """A reply line."""
    return dumps(reply).encode() + b"\n"


def reply_from_json(data: bytes) -> dict[str, Any] | None:
    """The reply in ``data`` (one line); None when it is not a JSON object."""
    try:
        reply = loads(data)
    except (ValueError, RecursionError):
        return None
    return reply if isinstance(reply, dict) else None
