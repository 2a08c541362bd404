"""What the agent does per request on its control socket, counted so that it cannot creep back
(issue 28): a request line sent as the client connected is read with one ``recv`` (no peek,
no poll, no change of the socket's mode), its answer line goes out with one ``send``; a
blocking request wakes the planner once and syncs before anything else of its own."""

from __future__ import annotations

import _socket
import os
import socket
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import vmpin.service.limits as limits
from vmpin.linux.paths import HostPaths
from vmpin.service.agent_accounting import Accounting
from vmpin.service.agent_protocol import ControlProtocol, Waiters
from vmpin.service.metrics import Metrics
from vmpin.service.queue import DirtyQueue
from vmpin.service.server import ControlServer, Reply


@pytest.fixture
def calls(mocker: Any) -> Counter[str]:
    """The agent side's socket calls (the clients here use _socket's sockets: not counted)."""
    counted: Counter[str] = Counter()

    def count(owner: Any, name: str, as_: str | None = None) -> None:
        real = getattr(owner, name)

        def counting(*args: Any, **kw: Any) -> Any:
            counted[as_ or name] += 1
            return real(*args, **kw)

        mocker.patch.object(owner, name, counting)

    for name in ("recv", "send", "sendall", "settimeout"):
        count(socket.socket, name)
    count(limits.select, "poll")
    return counted


@pytest.fixture
def serve(paths: HostPaths) -> Iterator[Callable[..., ControlServer]]:
    """A control server on ``paths`` answering with ``handle``, its threads started by the
    caller (``start``: after the clients have connected and sent, when it wants that)."""
    made: list[ControlServer] = []

    def make(handle: Callable[[bytes, Reply], Any]) -> ControlServer:
        os.makedirs(paths.state_dir, exist_ok=True)
        server = ControlServer(paths, handle)
        server.open()
        made.append(server)
        return server

    yield make
    for server in made:
        server.close()


def _client(path: str, line: bytes) -> Any:
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(path)
    sock.sendall(line)
    return sock


def _answer(sock: Any) -> bytes:
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = sock.recv(1 << 20)
        if not chunk:
            break
        buf += chunk
    sock.close()
    return buf


def test_a_request_sent_as_it_connected_costs_one_recv_and_one_send(
    paths: HostPaths, serve: Callable[..., ControlServer], calls: Counter[str]
) -> None:
    server = serve(lambda line, answer: {"ok": True, "got": line.decode()})
    # connected and sent before the server accepts: the line is in the socket at accept
    sock = _client(paths.control_socket, b'{"op": "x"}\n')
    server.start()
    assert _answer(sock) == b'{"ok": true, "got": "{\\"op\\": \\"x\\"}"}\n'
    assert calls == {"recv": 1, "send": 1}, calls


def test_a_request_whole_at_the_accept_is_not_looked_at_again(
    paths: HostPaths, serve: Callable[..., ControlServer], mocker: Any
) -> None:
    """The accept's one recv found the line whole: the line is taken as it is, its end not
    looked for again by read_request (issue 28: the test was made twice per request)."""
    import vmpin.service.server as server_mod

    read = mocker.patch.object(server_mod, "read_request", side_effect=AssertionError("read"))
    server = serve(lambda line, answer: {"ok": True, "got": line.decode()})
    sock = _client(paths.control_socket, b'{"op": "x"}\n')
    server.start()
    assert _answer(sock) == b'{"ok": true, "got": "{\\"op\\": \\"x\\"}"}\n'
    assert read.call_count == 0


def test_a_request_that_trickles_in_and_a_long_answer_are_still_whole(
    paths: HostPaths, serve: Callable[..., ControlServer], calls: Counter[str]
) -> None:
    """The line read over several chunks (after the first recv found half of it), and an
    answer longer than the socket takes at once (a view's megabytes): sent whole, under the
    write timeout (a settimeout, then sendall for the rest)."""
    big = b"x" * (8 << 20) + b"\n"
    got: list[bytes] = []

    def handle(line: bytes, answer: Reply) -> bytes:
        got.append(line)
        return big

    server = serve(handle)
    sock = _client(paths.control_socket, b'{"op": ')
    server.start()
    threading.Event().wait(0.2)  # (the server has read the first half, and waits)
    sock.sendall(b'"x"}\n')
    assert _answer(sock) == big
    assert got == [b'{"op": "x"}']
    assert calls["recv"] == 2 and calls["poll"] == 1, calls
    assert calls["send"] == 1 and calls["settimeout"] == 1 and calls["sendall"] == 1, calls


def test_a_blocking_request_wakes_the_planner_once_and_syncs_first() -> None:
    """After queueing, the request's thread does its ``meanwhile`` (an update's sync) before
    anything else of its own (the counting), and the queue is not kicked as well: the
    planner, woken by the queue, takes the GIL when the sync lets go of it (issue 28)."""
    order: list[str] = []
    queue = DirtyQueue()
    real_add_all, real_kick = queue.add_all, queue.kick
    queue.add_all = lambda *a, **kw: (order.append("queued"), real_add_all(*a, **kw))[1]  # type: ignore[method-assign]
    queue.kick = lambda: (order.append("kick"), real_kick())[1]  # type: ignore[method-assign]
    metrics = Metrics()
    accounting = Accounting(HostPaths(state_dir="/nonexistent"), metrics)
    real_count = accounting.count_events
    accounting.count_events = lambda n: (order.append("counted"), real_count(n))[1]  # type: ignore[method-assign]
    waiters = Waiters(lambda where, err: None)
    protocol = ControlProtocol(queue, waiters, metrics, accounting, lambda s: {}, lambda: None)

    def planner() -> None:
        batch = queue.take_batch(timeout=10)
        number, _ = waiters.pass_begins()
        queue.done_all([w.sandbox_id for w in batch or []])
        waiters.pass_ends(number, True, lambda: None)

    thread = threading.Thread(target=planner)
    thread.start()
    done = {"ok": True, "done": True}
    reply = protocol.update_and_wait("sb1", 10, None, done, lambda: order.append("synced"))
    thread.join(10)
    assert reply == done
    assert order == ["queued", "synced", "counted"], order
    assert accounting.totals()[1] == 1  # (plans, events)


class _CountingCondition(threading.Condition):
    def __init__(self, lock: Any) -> None:
        super().__init__(lock)
        self.notified = 0

    def notify_all(self) -> None:
        self.notified += 1
        super().notify_all()


@pytest.mark.parametrize("maps_first", [True, False])
def test_a_pass_wakes_its_waiters_once_and_a_kata_hooks_only_after_its_maps(
    maps_first: bool,
) -> None:
    """A waiter that needs the pass's guest maps first (a Kata hook) is not woken before
    they are published: its thread would only find its test false and sleep again, a
    context switch and the GIL in the way of the maps it waits for (issue 28)."""
    waiters = Waiters(lambda where, err: None)
    cond = waiters._cond = _CountingCondition(waiters._lock)  # (on the lock it guards)
    queued = threading.Event()
    replies: list[dict[str, Any]] = []

    def request() -> None:
        replies.append(waiters.wait(lambda: queued.set() or 1, 10, maps_first=maps_first))

    thread = threading.Thread(target=request)
    thread.start()
    assert queued.wait(10)
    while not waiters._waiters:  # (registered once its work is queued)
        threading.Event().wait(0.001)
    number, later = waiters.pass_begins()
    assert later is not maps_first
    at_publish: list[int] = []
    published = waiters.pass_ends(number, True, lambda: at_publish.append(cond.notified))
    if not maps_first:
        waiters.publish_late(number, lambda: at_publish.append(cond.notified))
    thread.join(10)
    assert replies == [{"ok": True, "queued": 1, "done": True}]
    assert published is maps_first
    # woken once, by its answer: after the maps (a hook's) or before them (an update's)
    assert at_publish == ([0] if maps_first else [1]), at_publish
    assert cond.notified == 1
