"""A minimal QMP client: stdlib only (socket, json), bounded in time, never hanging.

Why so small and so strict about time:

- It may run on the OCI hook path, which delays container start; so no third-party import
  and no asyncio.
- A QMP chardev serves ONE client at a time.  In real Kata the shim holds ``qmp.sock`` for the
  VM's whole life; a second client's ``connect()`` still succeeds (the kernel queues it in the
  listen backlog) but QEMU never sends it a greeting.  Connecting and reading the greeting
  therefore share one short deadline (0.3 s by default) and a miss is a :class:`QmpError`,
  which callers treat as "QMP not available", not as a failure.
- Every socket error, timeout, malformed reply and QMP ``error`` reply becomes a
  :class:`QmpError` chained to its cause: one exception type for callers to catch.

The wire protocol (QEMU's docs/interop/qmp-spec): the server sends a greeting
``{"QMP": {...}}``; the client must send ``qmp_capabilities`` before any other command; every
message is one JSON object followed by CRLF.  Replies are ``{"return": ...}`` or
``{"error": {"class", "desc"}}`` and echo the command's ``id``; asynchronous events
``{"event": ...}`` may arrive at any time, in between, and are set aside.
"""

from __future__ import annotations

import sys
import time

from vmpin.core.errors import QmpError
from vmpin.wire import jsonio as json  # json without re: the hook reaches this module

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.lean.records)
if TYPE_CHECKING:
    import _socket as socket
    from collections.abc import Mapping
    from types import TracebackType
    from typing import Any

#: connect + greeting, together.  A held socket answers nothing: this is how long we wait.
DEFAULT_CONNECT_TIMEOUT = 0.3
#: per command; query-cpus-fast and query-iothreads answer in well under a millisecond.
DEFAULT_COMMAND_TIMEOUT = 2.0
#: a reply line longer than this is not something we asked for.
MAX_LINE = 8 << 20
#: events kept for inspection; older ones are dropped.
MAX_EVENTS = 64


class QmpTimeout(QmpError):
    """No (complete) answer before the deadline: for a greeting, usually a held socket."""


class QmpClient:
    """One QMP session over a unix socket; use as a context manager, which always closes.

    ``with QmpClient(path) as qmp:`` connects, reads the greeting and negotiates capabilities;
    leaving the block closes the socket even on error, so the chardev is free for the next
    client (Kata's shim reconnects to it).
    """

    def __init__(
        self,
        path: str,
        timeout: float = DEFAULT_CONNECT_TIMEOUT,
        command_timeout: float = DEFAULT_COMMAND_TIMEOUT,
    ) -> None:
        self.path = path
        self.timeout = timeout
        self.command_timeout = command_timeout
        self.greeting: dict[str, Any] | None = None
        self.events: list[dict[str, Any]] = []
        #: pid of the process that owns the listening socket (SO_PEERCRED), when known.
        self.peer_pid: int | None = None
        self._sock: socket.socket | None = None
        self._buf = b""
        self._next_id = 0

    # -- session -------------------------------------------------------------------------
    def connect(self) -> dict[str, Any]:
        """Connect and read the greeting within ``timeout`` seconds in total; return it."""
        self.close()  # a second connect() starts a new session, never leaks the old one
        # _socket, not socket: socket.py imports enum and selectors (~2 ms); and only when a
        # session starts: a Kata hook classifying the VMM by thread names needs none (~0.4 ms)
        import _socket as socket

        deadline = time.monotonic() + self.timeout
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock = sock
        try:
            sock.settimeout(max(self.timeout, 0.001))
            sock.connect(self.path)
        except OSError as err:
            self.close()
            raise QmpError(f"QMP {self.path}: cannot connect: {err}") from err
        self.peer_pid = _peer_pid(sock)
        try:
            greeting = self._read_message(deadline, "greeting")
        except QmpTimeout as err:
            raise QmpTimeout(
                f"QMP {self.path}: no greeting within {self.timeout:g} s"
                " (another client, e.g. the Kata shim, holds the socket)"
            ) from err
        if "QMP" not in greeting:
            self.close()
            raise QmpError(f"QMP {self.path}: unexpected greeting {greeting!r:.200}")
        self.greeting = greeting
        return greeting

    def negotiate(self) -> None:
        """Leave capabilities negotiation mode: nothing else is accepted before this."""
        self.execute("qmp_capabilities")

    def close(self) -> None:
        sock, self._sock = self._sock, None
        self._buf = b""
        if sock is not None:
            sock.close()

    def __enter__(self) -> QmpClient:
        self.connect()
        try:
            self.negotiate()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- commands ------------------------------------------------------------------------
    def execute(
        self,
        command: str,
        arguments: Mapping[str, Any] | None = None,
        timeout: float | None = None,
    ) -> Any:
        """Run one command and return its ``return`` value; events on the way are set aside."""
        if self._sock is None:
            raise QmpError(f"QMP {self.path}: not connected")
        self._next_id += 1
        msg_id = f"vmpin-{self._next_id}"
        msg: dict[str, Any] = {"execute": command, "id": msg_id}
        if arguments:
            msg["arguments"] = dict(arguments)
        deadline = time.monotonic() + (self.command_timeout if timeout is None else timeout)
        try:
            self._sock.settimeout(max(deadline - time.monotonic(), 0.001))
            self._sock.sendall(json.dumps(msg).encode() + b"\r\n")
        except OSError as err:
            self.close()
            raise QmpError(f"QMP {self.path}: {command}: send failed: {err}") from err
        while True:
            reply = self._read_message(deadline, command)
            if "event" in reply:
                self._keep_event(reply)
                continue
            if reply.get("id") != msg_id:
                continue  # a reply to someone else's (or an earlier, abandoned) command
            if "error" in reply:
                error = reply["error"]
                cls = error.get("class", "?") if isinstance(error, dict) else "?"
                desc = error.get("desc", error) if isinstance(error, dict) else error
                raise QmpError(f"QMP {command}: {cls}: {desc}")
            if "return" not in reply:
                raise QmpError(f"QMP {command}: reply without return: {reply!r:.200}")
            return reply["return"]

    def query_cpus_fast(self) -> list[tuple[int, int, dict[str, Any]]]:
        """(cpu-index, host thread id, topology props) per vCPU, in QEMU's order."""
        out: list[tuple[int, int, dict[str, Any]]] = []
        for cpu in _as_list(self.execute("query-cpus-fast"), "query-cpus-fast"):
            try:
                props = cpu.get("props") or {}
                out.append((int(cpu["cpu-index"]), int(cpu["thread-id"]), dict(props)))
            except (KeyError, TypeError, ValueError, AttributeError) as err:
                raise QmpError(f"QMP query-cpus-fast: malformed entry {cpu!r:.200}") from err
        return out

    def query_iothreads(self) -> list[tuple[str, int]]:
        """(iothread id, host thread id) per ``-object iothread``."""
        out: list[tuple[str, int]] = []
        for it in _as_list(self.execute("query-iothreads"), "query-iothreads"):
            try:
                out.append((str(it["id"]), int(it["thread-id"])))
            except (KeyError, TypeError, ValueError) as err:
                raise QmpError(f"QMP query-iothreads: malformed entry {it!r:.200}") from err
        return out

    # -- wire ----------------------------------------------------------------------------
    def _keep_event(self, event: dict[str, Any]) -> None:
        self.events.append(event)
        del self.events[:-MAX_EVENTS]

    def _read_message(self, deadline: float, what: str) -> dict[str, Any]:
        line = self._read_line(deadline, what)
        try:
            msg = json.loads(line)
        except ValueError as err:
            self.close()
            raise QmpError(f"QMP {self.path}: {what}: not JSON: {line[:200]!r}") from err
        if not isinstance(msg, dict):
            self.close()
            raise QmpError(f"QMP {self.path}: {what}: not a JSON object: {line[:200]!r}")
        return msg

    def _read_line(self, deadline: float, what: str) -> bytes:
        sock = self._sock
        if sock is None:
            raise QmpError(f"QMP {self.path}: not connected")
        while True:
            nl = self._buf.find(b"\n")
            if nl >= 0:
                line, self._buf = self._buf[:nl], self._buf[nl + 1 :]
                if line.strip():
                    return line
                continue
            if len(self._buf) > MAX_LINE:
                self.close()
                raise QmpError(f"QMP {self.path}: {what}: reply longer than {MAX_LINE} bytes")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.close()
                raise QmpTimeout(f"QMP {self.path}: {what}: timed out")
            try:
                sock.settimeout(remaining)
                chunk = sock.recv(65536)
            except TimeoutError as err:
                self.close()
                raise QmpTimeout(f"QMP {self.path}: {what}: timed out") from err
            except OSError as err:
                self.close()
                raise QmpError(f"QMP {self.path}: {what}: {err}") from err
            if not chunk:
                self.close()
                raise QmpError(f"QMP {self.path}: {what}: connection closed by QEMU")
            self._buf += chunk


def _as_list(value: Any, what: str) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise QmpError(f"QMP {what}: expected a list of objects, got {value!r:.200}")
    return value


def _peer_pid(sock: socket.socket) -> int | None:
    """The pid that created the listening socket: tells whose QMP this really is."""
    import _socket as socket

    try:
        # struct ucred {pid_t pid; uid_t uid; gid_t gid}: three native 32-bit ints (read
        # by hand: struct is ~0.4 ms of a Kata hook that pins in-process)
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
    except (OSError, AttributeError):
        return None
    pid = int.from_bytes(raw[:4], sys.byteorder, signed=True)
    return pid if pid > 0 else None


def query_vmm(
    path: str, timeout: float = DEFAULT_CONNECT_TIMEOUT
) -> tuple[int | None, list[tuple[int, int, dict[str, Any]]], list[tuple[str, int]]]:
    """One short session: (peer pid, query-cpus-fast, query-iothreads); QmpError if held."""
    with QmpClient(path, timeout=timeout) as qmp:
        return qmp.peer_pid, qmp.query_cpus_fast(), qmp.query_iothreads()
