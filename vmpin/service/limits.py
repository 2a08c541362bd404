"""Bounds on what the agent serves: connections per endpoint, the time a request may take to
arrive and a reply to leave, and the fd limit the agent runs under.

Why (issue 26): every metrics connection had a thread and an fd of its own, uncapped, and
its timeout was per ``recv`` -- a client sending one byte a second never met it.  Any local
user could open ~1,400 such connections to 127.0.0.1:9464; the unit's 1,024 fds ran out, the
periodic pass's ``os.listdir`` failed with EMFILE and the agent aborted.  Now both endpoints
(the control socket, :mod:`vmpin.service.server`; the metrics port,
:mod:`vmpin.service.metrics`) are bounded alike:

- **Slots** (:class:`Slots`).  A connection holds a slot from its accept to its close.  Over
  the cap, a new connection takes the slot of the *oldest connection still sending its
  request*, which is shut down (``evicted``): every honest client -- a hook, ``vmpin
  status``, a Prometheus scrape -- sends its whole request as it connects, so only a slow
  one is ever evicted, and a flood of slow connections cannot lock an honest one out.  A
  connection whose request is whole in its socket at accept (peeked: :func:`arrived`; under
  a flood an honest client waits in the backlog, so its request is there by then) is never
  evictable, even before its thread gets the GIL to read it.  With
  no slot still reading (each is being answered: say a storm of hooks blocking on a pass),
  the new connection is refused at once (``over_cap``): the control socket closes it -- the
  hook or ``vmpin update`` then pins in-process, as with no agent -- and the metrics port
  answers 503.  Either is counted in ``vmpin_connections_dropped_total{endpoint,reason}``
  and said in the log once a minute (:class:`vmpin.service.logs.Throttle`).
- **Deadlines** (:func:`read_request`): the whole request must arrive within the endpoint's
  read timeout of its accept, however it trickles in (``timeout``); a reply must be written
  within its write timeout (``sendall`` under a socket timeout is one deadline for the whole
  send, since Python 3.5).
- **The fd limit** (:func:`raise_nofile`): at start the soft RLIMIT_NOFILE is raised to the
  hard one (a DaemonSet's container gets 1,024 soft under a far higher hard limit), and the
  caps are sized from it (:func:`caps`) so that the endpoints can never take the fds the
  passes need (``/proc``, SQLite, QMP sockets, inotify).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import resource
import select
import socket
import threading
import time
from collections.abc import Callable

from vmpin.service.logs import Throttle, log_event

#: control connections at once, at most.  The honest ones are hooks and ``vmpin update``,
#: each for about one pass (a blocking ``dirty`` holds its connection until the pass it
#: waits for ends: milliseconds, at most ``MAX_WAIT``); 256 is more container starts at once
#: than a node of 110 pods makes, and one over it is not lost -- its caller pins in-process.
CONTROL_CAP = 256
#: metrics connections at once, at most: a scraper asks once per interval, one request at a
#: time; 16 serves a few collectors and an operator's curl.
METRICS_CAP = 16
#: a control client sends its one line as it connects (hooks, ``vmpin status``): 2 s is that
#: plus a descheduled client on a loaded node, and what the old per-recv timeout was.
CONTROL_READ_TIMEOUT = 2.0
#: the reply is one line into a client waiting for it (its receive buffer is empty): a
#: client that takes longer than this to take it is not reading.
CONTROL_WRITE_TIMEOUT = 2.0
#: an HTTP scrape sends its request head at once; 5 s is what the old per-recv timeout was.
METRICS_READ_TIMEOUT = 5.0
#: Prometheus' default ``scrape_timeout``: a scraper slower than that has given up already.
METRICS_WRITE_TIMEOUT = 10.0
#: how long an accept loop waits after accept itself failed (EMFILE, ENOMEM): the connection
#: stays in the backlog, so retrying at once would spin.
ACCEPT_BACKOFF = 0.1
#: the longest an admission waits for evicted connections to be closed (:meth:`Slots.admit`)
EVICT_WAIT = 0.05
#: why a connection was closed unanswered (the ``reason`` label)
REASONS = ("over_cap", "evicted", "timeout", "too_large")
#: the endpoints (the ``endpoint`` label)
ENDPOINTS = ("control", "metrics")


def caps(nofile: int) -> tuple[int, int]:
    """(control cap, metrics cap) under a soft fd limit of ``nofile``.

    The endpoints may hold at most a quarter of the limit between them: each connection is
    one fd, and an endpoint's evicted connections not yet closed by their threads count too
    (at most twice its cap, :meth:`Slots.admit`), so 3 x (control + metrics) <= limit/4.
    The other three quarters stay the passes'.  Under the systemd unit (65,536) or a
    container's raised limit that is the full :data:`CONTROL_CAP` and :data:`METRICS_CAP`;
    under the old unit's 1,024, 75 and 10; under a 256-fd limit, 19 and 2.
    """
    share = max(2, nofile // 12)
    metrics = min(METRICS_CAP, max(1, share // 8))
    control = min(CONTROL_CAP, max(1, share - metrics))
    return control, metrics


def raise_nofile() -> tuple[int, int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit: (soft before, soft now, hard).

    Capped at 2**20 (the kernel's default ``fs.nr_open``): the agent needs far fewer (the
    caps bound what it serves), and a limit in the billions, which some container runtimes
    give, makes a child that closes every possible fd before exec (an old libc's
    ``closefrom``) spin for seconds.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, 1 << 20) if hard != resource.RLIM_INFINITY else 1 << 20
    if soft == resource.RLIM_INFINITY or soft >= want:
        return soft, soft, hard
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (OSError, ValueError):
        return soft, soft, hard
    return soft, want, hard


def start_thread(target: Callable[..., object], name: str, *args: object) -> threading.Thread:
    """A daemon thread, started; the host refusing one (EAGAIN or ENOMEM from clone, which
    Python raises as RuntimeError) raised as the OSError it is."""
    thread = threading.Thread(target=target, args=args, name=name, daemon=True)
    try:
        thread.start()
    except RuntimeError as err:
        raise OSError(errno.EAGAIN, f"cannot start a thread: {err}") from err
    return thread


def arrived(conn: socket.socket, ends: tuple[bytes, ...] | None) -> bool:
    """Whether a whole request (one of ``ends`` in its first 64 KiB) is already in the
    socket's receive buffer: peeked, not read, without blocking."""
    if not ends:
        return False
    data = _waiting(conn, socket.MSG_PEEK)
    return any(e in data for e in ends)


def arrived_head(conn: socket.socket, ends: tuple[bytes, ...]) -> tuple[bytes, bool]:
    """What of a new connection's request is in its socket already, read (not peeked)
    without blocking, and whether it is whole (one of ``ends`` in it): :func:`arrived`'s
    test for a connection whose own thread reads it next, which then goes on from these
    bytes (:func:`read_request`'s ``head``) -- a request sent as the client connected is
    read with this one ``recv``, not a peek, a poll and a second ``recv``."""
    data = _waiting(conn, 0)
    return data, any(e in data for e in ends)


def _waiting(conn: socket.socket, flags: int) -> bytes:
    """Up to 64 KiB of what is in the socket's receive buffer (``flags``: MSG_PEEK leaves
    it there), without blocking; b"" for nothing yet, or an error the read proper meets
    again.  Only on a socket in blocking mode: with a Python timeout set, recv would wait
    for data first."""
    if conn.gettimeout() is not None:
        return b""
    try:
        return conn.recv(65536, flags | socket.MSG_DONTWAIT)
    except OSError:
        return b""


class Cut(Exception):
    """A request that did not arrive whole: ``reason`` is ``timeout`` or ``too_large``."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def read_request(
    conn: socket.socket, ends: tuple[bytes, ...], limit: int, seconds: float, head: bytes = b""
) -> bytes:
    """The request's bytes, up to and with the first of ``ends``, or all that came before the
    peer closed its side (perhaps ``b""``; an evicted connection reads as closed).
    ``head``: its first bytes, read already (:func:`arrived_head`); a whole request there
    is returned as it is, without a system call.

    One deadline, ``seconds`` from now, for the whole request: a timeout per ``recv`` lets a
    client that sends one byte a second hold the connection for ever.  Raises :class:`Cut`
    past the deadline or past ``limit`` bytes; OSError as the socket does.

    The socket stays in blocking mode (a poll waits, a ``MSG_DONTWAIT`` recv reads): with a
    Python timeout set, any recv on it -- :func:`arrived`'s peek from the thread that
    decides an eviction -- would first wait for data, up to that timeout.
    """
    if head and any(e in head for e in ends):
        return head
    deadline = time.monotonic() + seconds
    buf = bytearray(head)
    if len(buf) > limit:
        raise Cut("too_large")
    longest = max(len(e) for e in ends)
    if conn.gettimeout() is not None:
        conn.settimeout(None)
    poller = select.poll()
    poller.register(conn, select.POLLIN)
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise Cut("timeout")
        if not poller.poll(max(1, math.ceil(left * 1000))):
            continue  # (the deadline, checked above)
        try:
            chunk = conn.recv(65536, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            continue
        if not chunk:
            return bytes(buf)
        start = max(0, len(buf) - longest + 1)  # (an end may straddle two chunks)
        buf += chunk
        if any(buf.find(e, start) >= 0 for e in ends):
            return bytes(buf)
        if len(buf) > limit:
            raise Cut("too_large")


class Slot:
    """One connection's hold on its endpoint, from accept to close."""

    __slots__ = ("conn", "evicted", "reading", "released")

    def __init__(self, conn: socket.socket, reading: bool = True) -> None:
        self.conn = conn
        self.evicted = False
        #: admitted still reading its request, so evictable until :meth:`Slots.answering`
        #: (False: its request was whole at the accept, and it never is)
        self.reading = reading
        self.released = False


class Slots:
    """The connections of one endpoint: at most ``cap`` at once (see the module's docstring).

    The owner of a slot calls :meth:`answering` once its request is in (from then on it is
    not evicted), and :meth:`release` *before* it closes the socket: an eviction shuts the
    socket down under the same lock, so it never reaches an fd number already reused.
    """

    def __init__(
        self,
        endpoint: str,
        cap: int,
        dropped: Callable[[str], object] = lambda reason: None,
        ends: tuple[bytes, ...] | None = None,
    ) -> None:
        if cap < 1:
            raise ValueError(f"{endpoint}: a cap of {cap} connections")
        self.endpoint = endpoint
        self.cap = cap
        #: where a request ends (peeked at before an eviction: :meth:`admit`)
        self.ends = ends
        self._dropped = dropped
        self._throttle = Throttle()
        self._lock = threading.Lock()
        #: signalled when a slot is released (an admission may be waiting for one)
        self._freed = threading.Condition(self._lock)
        self._held = 0  # admitted, neither evicted nor released
        self._evicted = 0  # evicted, not released yet (their sockets still open)
        #: slots still reading their request, oldest first (a dict keeps insertion order)
        self._reading: dict[Slot, None] = {}

    def admit(self, conn: socket.socket, whole: bool = False) -> Slot | None:
        """A slot for a new connection, evicting the oldest still reading if need be; None
        when every slot is being answered (the caller refuses it at once: counted here).
        ``whole``: its request has arrived already (:func:`arrived`), so it is answered
        from the start and never evicted.

        Evicted connections stay open until their threads close them, which under a flood
        wait for the GIL: at most a cap of them may be pending for a newcomer that may be
        slow itself, twice that for one whose request is in (an honest client).  Past that,
        the admission waits up to :data:`EVICT_WAIT` for one to close -- backpressure: the
        accept loop slows down, the flood waits in the listen backlog -- then refuses.
        """
        evictions = 0
        slot: Slot | None = None
        pending = 2 * self.cap if whole else self.cap
        deadline: float | None = None
        with self._lock:  # (the lock of _freed, taken as itself: no Python calls)
            while True:
                while self._held >= self.cap and self._reading and self._evicted < pending:
                    victim = next(iter(self._reading))
                    del self._reading[victim]
                    if arrived(victim.conn, self.ends):
                        # its request is in, its thread has not had the GIL to read it yet:
                        # an honest client, no longer evictable
                        continue
                    victim.evicted = True
                    self._held -= 1
                    self._evicted += 1
                    evictions += 1
                    with contextlib.suppress(OSError):
                        # its thread's recv returns b"": it releases, then closes
                        victim.conn.shutdown(socket.SHUT_RDWR)
                if self._held < self.cap:
                    slot = Slot(conn, not whole)
                    self._held += 1
                    if not whole:
                        self._reading[slot] = None
                    break
                if not self._reading:
                    break  # every slot is being answered: no eviction can make room
                now = time.monotonic()
                if deadline is None:
                    deadline = now + EVICT_WAIT
                if now >= deadline:
                    break
                self._freed.wait(deadline - now)
        for _ in range(evictions):
            self.drop("evicted")
        if slot is None:
            self.drop("over_cap")
        return slot

    def answering(self, slot: Slot) -> bool:
        """The request is in: the slot is no longer evicted.  False when it was already.
        (A slot admitted with its request whole was never evictable: no lock for it.)"""
        if not slot.reading:
            return True
        with self._lock:
            if slot.evicted:
                return False
            self._reading.pop(slot, None)
            return True

    def release(self, slot: Slot) -> None:
        with self._lock:
            if slot.released:
                return
            slot.released = True
            if slot.evicted:
                self._evicted -= 1
            else:
                self._held -= 1
                self._reading.pop(slot, None)
            self._freed.notify()

    def open(self) -> int:
        """Connections open now (evicted ones not closed yet included)."""
        with self._lock:
            return self._held + self._evicted

    def drop(self, reason: str) -> None:
        """A connection closed unanswered: counted, and said once a minute per reason."""
        self._dropped(reason)
        unsaid = self._throttle.due(reason)
        if unsaid is not None:
            log_event(
                logging.WARNING,
                "connection dropped",
                endpoint=self.endpoint,
                reason=reason,
                cap=self.cap,
                open=self.open(),
                unsaid=unsaid,
            )
