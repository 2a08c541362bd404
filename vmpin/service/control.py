"""The agent's control socket, client side: how hooks and ``vmpin update`` hand work over.

One request line, one reply line, as :mod:`vmpin.wire.control` writes and reads them (the
agent's side uses it too).  :func:`notify` marks sandboxes dirty (the agent plans them,
coalesced); ``vmpin status`` asks for ``status``; the read commands ask for their view
(:func:`view`).  The socket lives in the state dir with mode
0600: only root may ask the agent to act.

``notify(..., wait=SECONDS)`` is the blocking form (hooks and ``vmpin update``: the invariant
must hold when they return).  The agent replies only once a node-wide pass that *started
after the request arrived* has finished (it saw the caller's journaled or stored write) --
``done: true`` -- or, when that takes longer than SECONDS, ``done: false``; the caller then
does the work itself.  No polling of the store: the reply is the signal.

The client never waits long: the whole exchange (connect, request, answer) ends within
``timeout`` (``wait`` for the blocking form), after which the caller does the work itself,
so a stopped agent slows a container start by at most that (vmpin.service.budget), and a
dead one by nothing (the socket file is checked before ``socket``, or the protocol's module,
is even imported: a plain container's hook on a node without an agent loads neither).  A
stopped agent's socket still accepts (the kernel queues the connection), so it is the
answer that is waited for, never longer than that.
"""

from __future__ import annotations

import os
import time

from vmpin.linux.paths import HostPaths

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.lean.records)
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping
    from typing import Any

    from vmpin.wire.control_commands import Request, View, ViewReply
    from vmpin.wire.control_update import UpdateReply


#: how long a full backlog is waited out (seconds; at most the request's timeout)
CONNECT_PATIENCE = 1.0


def _connect(sock: Any, path: str, patience: float) -> None:
    """``connect``, as a blocking connect with a timeout would do it: a full listen backlog
    (the agent swamped by a storm of hooks, or a flood) is waited out for up to
    ``patience`` seconds, not taken at once for "no agent" -- with a timeout set, Python
    makes the socket non-blocking, and the kernel then answers EAGAIN at once for a Unix
    socket whose backlog is full (issue 26: ``vmpin status`` said no agent during a flood)."""
    try:
        sock.connect(path)
        return
    except BlockingIOError:
        pass
    import time

    deadline = time.monotonic() + patience
    pause = 0.001
    while True:
        time.sleep(pause)
        try:
            sock.connect(path)
            return
        except BlockingIOError:
            if time.monotonic() + pause >= deadline:
                raise
        pause = min(pause * 2, 0.05)


def _agent_socket(paths: HostPaths) -> str | None:
    """The agent's socket, None when there is no socket file (no agent: nothing to ask)."""
    path = paths.control_socket
    return path if os.path.exists(path) else None


def _send(
    path: str,
    message: Request | Mapping[str, Any],
    timeout: float,
    answer: bool,
    meanwhile: Callable[[], object] | None = None,
    limit: int | None = None,
) -> bytes | None:
    """Send one request line (``message``: a request of vmpin.wire.control, or any object:
    tests send what they like) to the socket ``path`` (its file found by the caller:
    :func:`_agent_socket`, once per exchange); None when no agent took it, else its answer
    (b"" without ``answer``, or when the agent closed without one).  ``meanwhile`` runs once
    the agent has the request, before its answer is read (what raises there is the
    caller's: only a failed exchange means no agent).  The exchange ends within ``timeout``
    seconds in all (an answer not complete by then, or longer than ``limit`` bytes: no
    agent)."""
    from vmpin.wire.control import request_to_json

    line = request_to_json(message)
    deadline = time.monotonic() + timeout
    # _socket, not socket: socket.py imports enum, selectors and functools (~2 ms of a hook)
    # for features a one-line exchange does not use.  _socket's sockets are close-on-exec.
    import _socket

    try:
        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    except OSError:
        return None
    buf = bytearray()  # (a view's answer comes in many chunks: no copy of the whole each)
    try:
        try:
            sock.settimeout(timeout)
            _connect(sock, path, min(timeout, CONNECT_PATIENCE))
            sock.sendall(line)
        except OSError:
            return None
        if meanwhile is not None:
            meanwhile()  # what it raises is the caller's, not a failed exchange
        try:
            while answer and not buf.endswith(b"\n"):
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                sock.settimeout(left)
                chunk = sock.recv(262144)
                if not chunk:
                    break
                buf += chunk
                if limit is not None and len(buf) > limit:
                    return None
        except OSError:
            return None
    finally:
        sock.close()
    return bytes(buf)


def request(
    paths: HostPaths,
    message: Request | Mapping[str, Any],
    timeout: float = 1.0,
    meanwhile: Callable[[], object] | None = None,
) -> dict[str, Any] | None:
    """Send one request; the reply, or None when no agent answered.  ``meanwhile`` runs
    while the agent works on it (see :func:`_send`)."""
    path = _agent_socket(paths)
    return None if path is None else _ask(path, message, timeout, meanwhile)


def _ask(
    path: str,
    message: Request | Mapping[str, Any],
    timeout: float,
    meanwhile: Callable[[], object] | None = None,
) -> dict[str, Any] | None:
    """:func:`request` to the socket ``path``, found already."""
    buf = _send(path, message, timeout, answer=True, meanwhile=meanwhile)
    if not buf:
        return None
    from vmpin.wire.control import reply_from_json

    return reply_from_json(buf)


def view(paths: HostPaths, message: View, timeout: float) -> ViewReply | None:
    """A read command's view from the agent's plan (``message``: vmpin.wire.control_commands.View);
    None when no agent answered it (none, an old one, a refusal, past ``timeout``, a reply
    longer than MAX_REPLY): the command then observes in-process."""
    path = _agent_socket(paths)
    if path is None:
        return None
    from vmpin.wire.control import MAX_REPLY, reply_from_json
    from vmpin.wire.control_commands import ViewReply

    buf = _send(path, message, timeout, answer=True, limit=MAX_REPLY)
    return ViewReply.from_obj(reply_from_json(buf), message.view) if buf else None


def post(paths: HostPaths, message: Request | Mapping[str, Any], timeout: float = 1.0) -> bool:
    """Send one request and do not wait for the reply: True when an agent's socket took it.

    For a plain container's hook, whose event is journaled already and applied by whoever
    comes next: the agent's answer would tell it nothing it acts on, and waiting for it was a
    round trip (the agent's accept, a thread, its reply) on every container start.  The agent
    reads the line all the same; its reply meets a closed socket, which it ignores.
    """
    path = _agent_socket(paths)
    return path is not None and _send(path, message, timeout, answer=False) is not None


def notify(
    paths: HostPaths,
    sandbox_ids: list[str],
    timeout: float = 1.0,
    wait: float | None = None,
    meanwhile: Callable[[], object] | None = None,
    maps_first: bool = True,
    *,
    answered: bool = True,
    seen: bool = False,
) -> bool:
    """Mark sandboxes dirty in the running agent; False when there is none to tell.

    With ``wait``, block until the agent has finished a pass that saw this request (True), or
    give up after ``wait`` seconds from now, connecting included (False: the caller
    reconciles in-process); ``meanwhile`` runs while the agent's pass does (``vmpin update``
    syncs its write then).  Without ``maps_first`` the answer may come before the pass's
    guest maps are published (for a caller that waits only on the host's pins).  Without
    ``answered`` (and ``wait``) the request is only :func:`post`-ed: True once a socket took it.
    ``seen``: the caller found the socket file just now (a plain container's hook, which
    imports this module only then): it is not looked for again.
    """
    path = paths.control_socket if seen else _agent_socket(paths)
    if path is None:
        return False  # (before the protocol's module is imported: see the docstring)
    from vmpin.wire.control import Dirty, DirtyReply

    if wait is None:
        message = Dirty(sandbox_ids)
        if not answered:
            return _send(path, message, timeout, answer=False) is not None
        return DirtyReply.from_obj(_ask(path, message, timeout)) is not None
    got = DirtyReply.from_obj(_ask(path, Dirty(sandbox_ids, wait, maps_first), wait, meanwhile))
    return bool(got and got.done)


def update(
    paths: HostPaths,
    container_id: str,
    cpus: str,
    wait: float,
    meanwhile: Callable[[], object] | None = None,
) -> tuple[UpdateReply | None, bool]:
    """``vmpin update`` written and re-pinned by the agent (a vmpin.wire.control_update.
    Update: the container, its CPU list, a deadline ``wait`` seconds from now): the answer,
    and whether any came.  (None, True): the agent refused (an old one that does not know
    the request, other host roots); (None, False): no agent (nothing is imported then), or
    none that answered by the deadline -- the caller does it itself, and waits for that
    agent no more.  An answer not done says the agent wrote nothing (or put its write
    back), so the caller may go on at once; with none, it is the deadline that ends the
    exchange, and the agent writes nothing past it.  ``meanwhile`` runs while the agent
    works on it (see :func:`_send`)."""
    path = _agent_socket(paths)
    if path is None:
        return None, False
    from vmpin.wire.control import reply_from_json
    from vmpin.wire.control_update import Update, UpdateReply

    until = time.monotonic() + wait
    message = Update(container_id, cpus, until, wait, dict(paths._asdict()))
    # (the exchange ends at ``until`` or after it, never before: see the docstring)
    buf = _send(path, message, until - time.monotonic(), answer=True, meanwhile=meanwhile)
    if not buf:
        return None, False
    return UpdateReply.from_obj(reply_from_json(buf)), True
