"""The control protocol's ``update`` request (``vmpin update``) and its reply.

Apart from :mod:`vmpin.wire.control_commands` (the read commands' requests and the agent's
reader of every request line, which reads this one too) because ``vmpin update``, a measured
figure (issue 28), sends this request alone: the other requests' four classes were ~0.5 M of
its ~46 M instructions (a bare interpreter ~39 M), each class created ~0.12 M.  The
protocol's lines, limits and version are :mod:`vmpin.wire.control`'s.

Lean (the Kata hook's closure reaches vmpin.service.control): stdlib only, no ``typing`` at
run time.
"""

from __future__ import annotations

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.lean.records)
if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Any, NamedTuple
else:
    from vmpin.lean.records import NamedTuple


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
