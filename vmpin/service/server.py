"""The agent's control socket: a 0600 Unix socket, peers of our uid only, one JSON line each way.

It owns the socket's life (bind without a window where others may connect, refuse to steal an
answering agent's socket, unlink only our own inode) and the connections, bounded as
:mod:`vmpin.service.limits` says (a cap, with the oldest slow sender evicted for a new
connection; the request line within 2 s of the accept, the reply within 2 s); the requests
are the agent's (``handle``), the wire format is :mod:`vmpin.wire.control`'s.
"""

from __future__ import annotations

import contextlib
import errno
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
from vmpin.service.control import request
from vmpin.service.limits import (
    ACCEPT_BACKOFF,
    CONTROL_CAP,
    CONTROL_READ_TIMEOUT,
    CONTROL_WRITE_TIMEOUT,
    Cut,
    Slot,
    Slots,
    arrived_head,
    read_request,
)
from vmpin.service.logs import log_event
from vmpin.wire.control import MAX_REQUEST, refused, reply_to_json

#: connection threads waiting in ``accept`` when the agent is quiet (ControlServer._acceptor)
SPARE_THREADS = 2
#: the most connection threads kept waiting after a burst
IDLE_THREADS = 8


class AgentRunning(StateError):
    """Another agent holds the state dir."""


class Reply:
    """One connection's answer line, sent at most once.

    Usually by the connection's own thread; for a blocking ``dirty`` by the agent's planner
    right at the end of the pass the caller waits for, so the answer does not wait for a
    sleeping thread to be woken and to get the GIL (issue 14: a Kata hook waits for it).
    Whoever sends decides under its own lock; the connection is closed only after.
    """

    __slots__ = ("_conn", "_slots", "sent")

    def __init__(self, conn: socket.socket, slots: Slots | None = None) -> None:
        self._conn = conn
        self._slots = slots
        self.sent = False

    def send(self, reply: dict[str, Any] | bytes) -> None:
        """Send ``reply`` (an object, or its line already written: a read view's)."""
        if self.sent:
            return
        self.sent = True
        data = reply if isinstance(reply, bytes) else reply_to_json(reply)
        conn = self._conn
        try:
            # a client that sent its line waits for this one: its receive buffer is empty,
            # so a line takes one send that does not block (no poll before it, as a socket
            # with a timeout makes); what it did not take (a view's megabytes) goes with a
            # timeout of CONTROL_WRITE_TIMEOUT: one deadline for the sendall, so a reader
            # that stops reading holds its own thread that long, and no one else
            try:
                sent = conn.send(data, socket.MSG_DONTWAIT)
            except BlockingIOError:
                sent = 0
            if sent < len(data):
                conn.settimeout(CONTROL_WRITE_TIMEOUT)
                conn.sendall(memoryview(data)[sent:])
        except TimeoutError:
            if self._slots is not None:
                self._slots.drop("timeout")
        except OSError as err:
            log_event(logging.DEBUG, "control connection dropped", error=str(err))


#: SO_PEERCRED's struct ucred: pid, uid, gid
_UCRED = struct.Struct("3i")


def _peer_uid(conn: socket.socket) -> int | None:
    try:
        raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    except OSError:
        return None
    _pid, uid, _gid = _UCRED.unpack(raw)
    return int(uid)


def _log_fault(where: str, err: BaseException) -> None:
    log_event(logging.ERROR, "control server error: going on", where=where, error=str(err))


class ControlServer:
    def __init__(
        self,
        paths: HostPaths,
        handle: Callable[[bytes, Reply], dict[str, Any] | bytes | None],
        refused: Callable[[], None] = lambda: None,
        *,
        slots: Slots | None = None,
        fault: Callable[[str, BaseException], object] = _log_fault,
    ) -> None:
        self.paths = paths
        self.handle = handle
        self.refused = refused
        #: the connections, at most ``slots.cap`` at once (vmpin.service.limits)
        self.slots = slots if slots is not None else Slots("control", CONTROL_CAP)
        #: told of an error a connection thread outlives (Agent.fault: logs.Faults.report)
        self.fault = fault
        self._listener: socket.socket | None = None
        self._socket_ino: int | None = None
        self._pool_lock = threading.Lock()
        self._accepting = 0  # connection threads in (or on their way to) accept()
        self._threads: set[threading.Thread] = set()

    def start(self) -> None:
        for _ in range(SPARE_THREADS):
            self._spawn()

    def _spawn(self) -> None:
        """One more connection thread, counted as accepting from now on; OSError when the
        host starts no more threads (EAGAIN, ENOMEM)."""
        thread = threading.Thread(target=self._acceptor, name="vmpin-conn", daemon=True)
        with self._pool_lock:
            self._accepting += 1
            self._threads.add(thread)
        try:
            thread.start()
        except RuntimeError as err:  # (what Python makes of clone's EAGAIN)
            with self._pool_lock:
                self._accepting -= 1
                self._threads.discard(thread)
            raise OSError(errno.EAGAIN, f"cannot start a thread: {err}") from err

    def open(self) -> None:
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
        Connection threads are bounded by the slots (:mod:`vmpin.service.limits`): a
        thread leaves ``accept`` (and may start another) only with a connection that has a
        slot; one over the cap is closed by the thread that accepted it, which goes on
        accepting.  So at most 3 x cap + :data:`IDLE_THREADS` threads (a cap answered, up to
        two caps evicted and not closed yet, the idle ones in ``accept``), whatever comes in.
        An error of accept itself (EMFILE, ENOMEM) is told to ``fault`` and tried again
        :data:`ACCEPT_BACKOFF` s later.
        """
        me = os.getuid()
        try:
            while True:
                sock = self._listener
                if sock is None:
                    return
                try:
                    conn, _ = sock.accept()
                except OSError as err:
                    if self._listener is None:
                        return
                    self.fault("control accept", err)
                    time.sleep(ACCEPT_BACKOFF)
                    continue
                slot, head, whole = self._admit(conn, me)
                if slot is None:
                    continue  # refused or over the cap, closed: this thread accepts on
                with self._pool_lock:
                    self._accepting -= 1
                    last = not self._accepting and self._listener is not None
                if last:
                    try:
                        self._spawn()
                    except OSError as err:  # this thread accepts again after this one
                        self.fault("control accept", err)
                try:
                    self._serve_conn(conn, slot, head, whole)
                finally:
                    # (released before the close: an eviction never meets a reused fd)
                    self.slots.release(slot)
                    conn.close()
                with self._pool_lock:
                    if self._accepting >= IDLE_THREADS or self._listener is None:
                        return
                    self._accepting += 1
        finally:
            with self._pool_lock:
                self._threads.discard(threading.current_thread())

    def _admit(self, conn: socket.socket, me: int) -> tuple[Slot | None, bytes, bool]:
        """An accepted connection's slot, what of its request has come (read already:
        :func:`arrived_head`) and whether that is the whole line; no slot when it was
        refused (another uid) or is over the cap (every slot being answered; counted):
        closed at once, and the caller (a hook, ``vmpin update``) then pins in-process."""
        uid = _peer_uid(conn)
        if uid is not None and uid not in (0, me):
            conn.close()
            self.refused()
            return None, b"", False
        head, whole = arrived_head(conn, (b"\n",))
        slot = self.slots.admit(conn, whole)
        if slot is None:
            conn.close()
        return slot, head, whole

    def _serve_conn(
        self, conn: socket.socket, slot: Slot, head: bytes = b"", whole: bool = False
    ) -> None:
        """Answer one connection.  ``head``: what of its request was read at the accept,
        ``whole`` when that holds the line's end (as an honest client's does: it sends its
        line as it connects), which is then neither looked for again nor read on."""
        try:
            if not whole:
                try:
                    line = read_request(conn, (b"\n",), MAX_REQUEST, CONTROL_READ_TIMEOUT, head)
                except Cut as cut:
                    self.slots.drop(cut.reason)
                    return
            else:
                line = head
            if not self.slots.answering(slot):
                return  # evicted for a newer connection while it trickled in (counted)
            end = line.find(b"\n")
            if end < 0:
                # closed before its line ended (a probe, a client killed mid-write): there
                # is no request to answer, and a log line for each would let any flood of
                # them fill the log
                return
            answer = Reply(conn, self.slots)
            try:
                reply = self.handle(line[:end], answer)
            except Exception as err:  # one request must not end its connection thread
                self.fault("control request", err)
                reply = refused(f"internal error: {err}")
            if reply is not None:  # (None: ``answer`` has been sent, or never will be)
                answer.send(reply)
        except OSError as err:
            log_event(logging.DEBUG, "control connection dropped", error=str(err))
