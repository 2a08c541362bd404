"""The agent's control socket: a 0600 Unix socket, peers of our uid only, one JSON line each way.

It owns the socket's life (bind without a window where others may connect, refuse to steal an
answering agent's socket, unlink only our own inode) and the connections; the requests are
the agent's (``handle``), the wire format is :mod:`vmpin.service.control`'s.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from vmpin.core.errors import StateError
from vmpin.linux.paths import HostPaths
from vmpin.service.logs import log_event

#: connection threads waiting in ``accept`` when the agent is quiet (ControlServer._acceptor)
SPARE_THREADS = 2
#: the most connection threads kept waiting after a burst
IDLE_THREADS = 8
#: a client gets this long to send its request line (hooks send it at once).
REQUEST_TIMEOUT = 2.0
MAX_REQUEST = 1 << 20


class AgentRunning(StateError):
    """Another agent holds the state dir."""


class Reply:
    """One connection's answer line, sent at most once.

    Usually by the connection's own thread; for a blocking ``dirty`` by the agent's planner
    right at the end of the pass the caller waits for, so the answer does not wait for a
    sleeping thread to be woken and to get the GIL (issue 14: a Kata hook waits for it).
    Whoever sends decides under its own lock; the connection is closed only after.
    """

    __slots__ = ("_conn", "sent")

    def __init__(self, conn: socket.socket) -> None:
        self._conn = conn
        self.sent = False

    def send(self, reply: dict[str, Any]) -> None:
        if self.sent:
            return
        self.sent = True
        try:
            # a client that sent its line waits for this one: its receive buffer is empty
            self._conn.sendall(json.dumps(reply).encode() + b"\n")
        except OSError as err:
            log_event(logging.DEBUG, "control connection dropped", error=str(err))


def _peer_uid(conn: socket.socket) -> int | None:
    try:
        raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return None
    _pid, uid, _gid = struct.unpack("3i", raw)
    return int(uid)


class ControlServer:
    def __init__(
        self,
        paths: HostPaths,
        handle: Callable[[bytes, Reply], dict[str, Any] | None],
        refused: Callable[[], None] = lambda: None,
    ) -> None:
        self.paths = paths
        self.handle = handle
        self.refused = refused
        self._listener: socket.socket | None = None
        self._socket_ino: int | None = None
        self._pool_lock = threading.Lock()
        self._accepting = 0  # connection threads in (or on their way to) accept()
        self._threads: set[threading.Thread] = set()

    def start(self) -> None:
        for _ in range(SPARE_THREADS):
            self._spawn()

    def _spawn(self) -> None:
        """One more connection thread, counted as accepting from now on."""
        thread = threading.Thread(target=self._acceptor, name="vmpin-conn", daemon=True)
        with self._pool_lock:
            self._accepting += 1
            self._threads.add(thread)
        thread.start()

    def open(self) -> None:
        from vmpin.service.control import request

        path = self.paths.control_socket
        if os.path.lexists(path):
            # We hold the lock, so an answering agent would be a foreign one (another state
            # dir layout, an old version): refuse rather than steal its socket.
            if request(self.paths, {"op": "status"}, timeout=0.5) is not None:
                raise AgentRunning(f"another agent answers on {path}")
            os.unlink(path)
            log_event(logging.INFO, "removed stale control socket", socket=path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # the socket is born 0600: no window where others may connect
        try:
            sock.bind(path)
        except OSError as err:
            sock.close()
            raise StateError(f"{path}: cannot bind the control socket: {err.strerror}") from None
        finally:
            os.umask(old)
        os.chmod(path, 0o600)
        sock.listen(512)
        self._listener = sock
        self._socket_ino = os.stat(path).st_ino

    def close(self) -> None:
        sock, self._listener = self._listener, None
        if sock is None:
            return
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)  # wakes the accept() blocked on it
        sock.close()
        path = self.paths.control_socket
        with contextlib.suppress(OSError):
            if os.stat(path).st_ino == self._socket_ino:  # only ours, never a successor's
                os.unlink(path)
        # the shutdown woke every thread in accept(); a busy one ends after its connection
        deadline = time.monotonic() + 2
        with self._pool_lock:
            threads = list(self._threads)
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(timeout=max(0.0, deadline - time.monotonic()))

    def _acceptor(self) -> None:
        """A connection thread: accept a connection, serve it, accept the next.

        Each thread waits in ``accept`` itself (the kernel wakes one per connection), so a
        connection reaches the thread that serves it with one wake-up: an accept thread
        handing it on was a second one, ~0.15 ms of every blocking round trip (a Kata hook
        waits for it, issue 14), and starting a thread per connection ~0.2-0.3 ms.  Threads
        are never short (a blocking ``dirty`` holds one until its pass ends, and a storm of
        them must all be accepted before that pass starts), so the last thread to leave
        ``accept`` starts another first; after a storm at most :data:`IDLE_THREADS` stay.
        """
        me = os.getuid()
        try:
            while True:
                sock = self._listener
                if sock is None:
                    return
                try:
                    conn, _ = sock.accept()
                except OSError:
                    if self._listener is None:
                        return
                    time.sleep(0.01)
                    continue
                with self._pool_lock:
                    self._accepting -= 1
                    last = not self._accepting and self._listener is not None
                if last:
                    self._spawn()
                uid = _peer_uid(conn)
                if uid is not None and uid not in (0, me):
                    conn.close()
                    self.refused()
                else:
                    self._serve_conn(conn)
                with self._pool_lock:
                    if self._accepting >= IDLE_THREADS or self._listener is None:
                        return
                    self._accepting += 1
        finally:
            with self._pool_lock:
                self._threads.discard(threading.current_thread())

    def _serve_conn(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(REQUEST_TIMEOUT)
                buf = b""
                while b"\n" not in buf and len(buf) < MAX_REQUEST:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    buf += chunk
                answer = Reply(conn)
                reply = self.handle(buf.split(b"\n", 1)[0], answer)
                if reply is not None:  # (None: ``answer`` has been sent, or never will be)
                    answer.send(reply)
            except OSError as err:
                log_event(logging.DEBUG, "control connection dropped", error=str(err))
