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

This module holds what every side needs and the hooks' request (``dirty``, its reply);
the commands' requests (``status``, ``reconcile``, ``view``, ``update``) and the agent's reader
of every request are :mod:`vmpin.wire.control_commands`'s, which a hook does not load.

Lean (the Kata hook speaks it): stdlib and vmpin.core only, no ``typing`` at run time.
"""

from __future__ import annotations

from vmpin.wire.jsonio import dumps, loads

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.lean.records)
if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Any, NamedTuple

    from vmpin.wire.control_commands import Request
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


OK: dict[str, Any] = {"ok": True}


def refused(error: str) -> dict[str, Any]:
    """The reply to a request the agent did not understand (``error`` says why)."""
    return {"ok": False, "error": error}


def request_to_json(message: Request | Mapping[str, Any]) -> bytes:
    """A request line (``message`` a request, or a raw object: tests and probes send any)."""
    to_obj = getattr(message, "to_obj", None)
    return dumps(message if to_obj is None else to_obj()).encode() + b"\n"

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
