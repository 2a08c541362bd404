"""Stand-ins for the agent's side of the control socket, for the callers' tests (the agent's
own side is tested against the real agent in test_agent.py)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
from typing import Any

from vmpin.linux.paths import HostPaths


def read_line(conn: socket.socket) -> dict[str, Any]:
    """One request line, as the agent reads it."""
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            break
        buf += chunk
    msg: dict[str, Any] = json.loads(buf)
    return msg


def send_line(conn: socket.socket, reply: dict[str, Any]) -> None:
    """The reply line; a caller that went away without reading it is no error here (a plain
    container's hook does not wait for it, a failing caller may have left)."""
    with contextlib.suppress(OSError):
        conn.sendall(json.dumps(reply).encode() + b"\n")


class ProtocolAgent:
    """A real unix socket at the agent's place, answering the control protocol like the agent:
    ``dirty`` with ``wait`` -> done (as after its pass), without -> queued."""

    def __init__(self, paths: HostPaths) -> None:
        os.makedirs(paths.state_dir, exist_ok=True)
        self.requests: list[dict[str, object]] = []
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(paths.control_socket)
        self.sock.listen(8)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                msg = read_line(conn)
                self.requests.append(msg)
                reply: dict[str, object] = {"ok": True, "queued": len(msg["sandboxes"])}
                if "wait" in msg:
                    reply["done"] = True
                send_line(conn, reply)

    def close(self) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self.thread.join(5)


class OneReplyAgent:
    """A control socket that answers one request with ``reply`` (a stand-in for the agent's
    side of the blocking ``dirty``, which another part of the agent implements).  It is an
    agent from before the ``update`` request: it refuses that one, as those did (unknown op),
    and answers the next."""

    def __init__(self, path: str, reply: dict[str, object]) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(1)
        self.reply = reply
        self.request: dict[str, object] = {}
        self.refused: list[dict[str, object]] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _accept(self) -> tuple[socket.socket, dict[str, Any]]:
        """The first connection whose request is not an ``update`` (those refused)."""
        while True:
            conn, _ = self.sock.accept()
            self._accepted()
            msg = read_line(conn)
            if msg.get("op") != "update":
                return conn, msg
            with conn:
                self.refused.append(msg)
                self._accepted(refused=True)
                send_line(conn, {"ok": False, "error": "unknown op 'update'"})

    def _accepted(self, refused: bool = False) -> None:
        """A connection came (its request may still be on its way); called again with
        ``refused`` once its request was an ``update`` and refused."""

    def _serve(self) -> None:
        conn, self.request = self._accept()
        with conn:
            send_line(conn, self.reply)

    def close(self) -> None:
        self.thread.join(10)
        self.sock.close()


class SyncWatchingAgent(OneReplyAgent):
    """Answers ``done`` only once the caller's write is on the disk: it waits (up to 10 s)
    for a sync (:func:`watch_syncs`) *after* it has the request, so a caller that synced
    before asking, or never, is caught."""

    def __init__(self, path: str, synced: threading.Event, events: list[str]) -> None:
        self.synced, self.events = synced, events
        super().__init__(path, {"ok": True, "queued": 1, "done": True})

    def _accepted(self, refused: bool = False) -> None:
        # from the connection on: the caller may sync as soon as its line is sent, before
        # this thread has read it (a sync before the connection does not count)
        if refused:  # (the caller writes nothing before it has the refusal)
            self.events.remove("request")
            return
        self.events.append("request")
        self.synced.clear()

    def _serve(self) -> None:
        conn, self.request = self._accept()
        with conn:
            done = self.synced.wait(10)
            self.events.append("reply" if done else "no sync while waiting")
            send_line(conn, self.reply)


def watch_syncs(
    mocker: Any, path: str, events: list[str], files_in: str | None = None
) -> threading.Event:
    """Record every fsync of ``path`` in ``events`` as "synced" (the real fsync runs); the
    event returned is set by each.  With ``files_in``, an fsync of a file in that directory
    is recorded too, as "synced file" (it does not set the event)."""
    real = os.fsync
    synced = threading.Event()
    target = os.path.realpath(path)
    folder = None if files_in is None else os.path.realpath(files_in)

    def fsync(fd: int) -> None:
        real(fd)
        at = os.path.realpath(f"/proc/self/fd/{fd}")
        if at == target:
            events.append("synced")
            synced.set()
        elif folder is not None and os.path.dirname(at) == folder:
            events.append("synced file")

    mocker.patch("os.fsync", side_effect=fsync)
    return synced
