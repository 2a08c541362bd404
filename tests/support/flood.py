"""Floods of slow connections from a child process, optionally as an unprivileged user: what
any local user can do to the agent's metrics port, and a runaway root client to its control
socket (issue 26).

The child is forked (multiprocessing's ``fork``), not exec'd: it needs no interpreter of its
own, so it can drop to ``nobody`` although the venv's interpreter lives under /root, where
nobody may not read.  It raises its own RLIMIT_NOFILE first (as root), then drops its
groups, gid and uid, then opens ``n`` connections as fast as the kernel takes them (each
non-blocking: a full backlog costs an attempt, not a second of SYN retries) and sends each a
request that never ends, one byte a second (a slowloris).  A connection the agent closes is
replaced by a new one until ``hold`` seconds have passed, so the pressure lasts.

What it reports (:class:`Report`): how many connections it tried and opened, which
``connect`` refused and why (``EACCES``: the socket's mode kept the user out), how many the
agent cut (EOF or reset) and after how long, how many it answered 503, and the age of the
oldest connection still open at the end (a slowloris the agent never cuts grows old).
"""

from __future__ import annotations

import contextlib
import errno
import json
import multiprocessing
import os
import pwd
import resource
import select
import socket
import time
from dataclasses import dataclass, field
from typing import Any

#: (family, address): ("tcp", ("127.0.0.1", port)) or ("unix", path)
Target = tuple[str, Any]

#: the request each connection sends, one byte a second, and never finishes: the end of the
#: line (control) or of the header block (HTTP) never comes
PREFIX = {"tcp": b"GET /metrics HTTP/1.1\r\nX-Slow: ", "unix": b'{"op":"status","pad":"'}


@dataclass
class Report:
    uid: int = -1
    attempted: int = 0
    opened: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    cut: int = 0
    answered_503: int = 0
    #: the longest a connection stayed open before the agent cut it (seconds)
    longest_cut_s: float = 0.0
    #: connections open at the end, and the age of the oldest of them
    open_at_end: int = 0
    oldest_open_s: float = 0.0
    #: bytes sent in all (the slowloris' trickle)
    bytes_sent: int = 0
    seconds: float = 0.0
    error: str = ""


class _Conn:
    __slots__ = ("born", "sent", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.born = time.monotonic()
        self.sent = 0


def _drop_to(user: str) -> None:
    pw = pwd.getpwnam(user)
    os.setgroups([])
    os.setgid(pw.pw_gid)
    os.setuid(pw.pw_uid)
    if os.getuid() == 0 or os.geteuid() == 0:
        raise RuntimeError(f"still root after dropping to {user}")


def _connect(kind: str, addr: Any, report: Report) -> _Conn | None:
    family = socket.AF_INET if kind == "tcp" else socket.AF_UNIX
    report.attempted += 1
    try:
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as err:
        name = errno.errorcode.get(err.errno or 0, str(err))
        report.refused[name] = report.refused.get(name, 0) + 1
        return None
    sock.setblocking(False)
    rc = sock.connect_ex(addr)
    if rc not in (0, errno.EINPROGRESS):
        sock.close()
        name = errno.errorcode.get(rc, str(rc))
        report.refused[name] = report.refused.get(name, 0) + 1
        return None
    report.opened += 1
    return _Conn(sock)


def _tick(kind: str, conns: list[_Conn], report: Report) -> list[_Conn]:
    """One second of the slowloris: what the agent closed is counted and dropped; every
    connection still open gets one more byte of its never-ending request."""
    prefix = PREFIX[kind]
    alive: list[_Conn] = []
    now = time.monotonic()
    for c in conns:
        closed = False
        try:
            data = c.sock.recv(4096)
            if data.startswith(b"HTTP/1.0 503"):
                report.answered_503 += 1
            closed = True  # an answer or EOF: the agent is done with it
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as err:
            closed = err.errno != errno.ENOTCONN  # (not connected yet) / reset
        if not closed:
            byte = prefix[c.sent : c.sent + 1] or b"a"
            try:
                c.sent += c.sock.send(byte)
                report.bytes_sent += len(byte)
            except (BlockingIOError, InterruptedError):
                pass  # not connected yet, or the agent reads nothing: next second
            except OSError as err:
                closed = err.errno != errno.ENOTCONN
        if closed:
            report.cut += 1
            report.longest_cut_s = max(report.longest_cut_s, now - c.born)
            c.sock.close()
        else:
            alive.append(c)
    return alive


def _run(kind: str, addr: Any, n: int, hold: float, user: str | None, out: Any) -> None:
    report = Report()
    conns: list[_Conn] = []
    t0 = time.monotonic()
    try:
        want = n + 256
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, max(hard, want)))
        if user is not None:
            _drop_to(user)
        report.uid = os.getuid()
        deadline = t0 + hold
        next_tick = time.monotonic()
        while time.monotonic() < deadline:
            # open (or replace) connections up to n, as fast as the kernel takes them
            while len(conns) < n and time.monotonic() < min(deadline, next_tick + 1.0):
                c = _connect(kind, addr, report)
                if c is not None:
                    conns.append(c)
                elif report.attempted > n and not conns:
                    break  # everything is refused (EACCES): no point retrying in a loop
            if time.monotonic() >= next_tick:
                conns = _tick(kind, conns, report)
                next_tick += 1.0
            left = min(deadline, next_tick) - time.monotonic()
            if left > 0:
                select.select([], [], [], min(left, 0.05))
    except Exception as err:  # reported, not raised: the parent asserts on the report
        report.error = f"{type(err).__name__}: {err}"
    end = time.monotonic()
    report.open_at_end = len(conns)
    report.oldest_open_s = round(max((end - c.born for c in conns), default=0.0), 3)
    report.longest_cut_s = round(report.longest_cut_s, 3)
    report.seconds = round(end - t0, 3)
    for c in conns:
        c.sock.close()
    out.send(json.dumps(report.__dict__))
    out.close()


class Flood:
    """One flooding child: ``Flood(("tcp", ("127.0.0.1", port)), 5000, hold=8, user="nobody")``,
    then :meth:`report` once it is done (it is killed by its pid if it is not)."""

    def __init__(
        self, target: Target, n: int, *, hold: float, user: str | None = None
    ) -> None:
        kind, addr = target
        ctx = multiprocessing.get_context("fork")
        self._recv, send = ctx.Pipe(duplex=False)
        self.hold = hold
        self.proc = ctx.Process(
            target=_run, args=(kind, addr, n, hold, user, send), name=f"flood-{kind}", daemon=True
        )
        self.proc.start()
        send.close()

    def report(self, slack: float = 30.0) -> Report:
        try:
            if not self._recv.poll(self.hold + slack):
                raise AssertionError("the flood child did not report")
            return Report(**json.loads(self._recv.recv()))
        finally:
            self.kill()

    def kill(self) -> None:
        if self.proc.is_alive() and self.proc.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, 9)
        self.proc.join(5)
        self._recv.close()
