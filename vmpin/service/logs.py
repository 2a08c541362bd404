"""The agent's logging: JSON lines on stderr, one object per line (``ts``, ``level``, ``event``,
then the fields), so a node's log pipeline can index them without parsing prose; the
:class:`Throttle` that keeps a condition which recurs (a host out of fds, a flood of
connections) to a line a minute instead of a line per pass or per connection; and
:class:`Faults`, how every loop of the agent reports an error it outlives."""

from __future__ import annotations

import errno
import json
import logging
import sys
import threading
import time
from collections.abc import Callable, Hashable
from datetime import datetime, timezone
from typing import Any

from vmpin.core.errors import StateError

log = logging.getLogger("vmpin.service.agent")
#: ``json.dumps(obj, default=str)``'s encoder, made once: dumps makes one per call when given
#: ``default`` (every log line)
_ENCODER = json.JSONEncoder(default=str)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``ts`` (UTC, ms), ``level``, ``event``, then the fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname.lower(),
            "event": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            out.update(fields)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return _ENCODER.encode(out)


def setup_logging(stream: Any = None, level: str | None = None) -> None:
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger("vmpin")
    root.handlers[:] = [handler]
    root.propagate = False
    name = (level or "INFO").upper()
    if name not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise StateError(f"VMPIN_LOG_LEVEL={name!r}: expected DEBUG, INFO, WARNING or ERROR")
    root.setLevel(name)


#: where a record made by :func:`log_event` says it comes from (Logger.log's own words for
#: a record made without a search of the stack)
_NO_FILE, _NO_FUNC = "(unknown file)", "(unknown function)"


def log_event(level: int, event: str, **fields: Any) -> None:
    """Log ``event`` with ``fields`` (the JSON line's keys after ``event``).

    The record is made as :meth:`logging.Logger.log` makes one, less its search of the
    stack for the caller's file, line and function, which no JSON line shows: ~15% of a
    line's cost, and the agent writes one per sandbox its pass re-pins -- an update's pass,
    in the planner's work after the answer that the next request waits behind (issue 28)."""
    if log.isEnabledFor(level):
        log.handle(log.makeRecord(log.name, level, _NO_FILE, 0, event, (), None, _NO_FUNC,
                                  {"fields": fields}))  # fmt: skip


class Throttle:
    """Say a recurring condition the first time it occurs, then at most once every ``every``
    seconds per key, with how many times it recurred unsaid in between.

    Issue 26: a host out of fds fails every pass and every accept; a line for each would
    fill the node's journal as fast as the condition recurs, and hide its first occurrence.
    Keys are few (where x what: "periodic pass" x EMFILE), so none is ever forgotten.
    """

    def __init__(self, every: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.every = every
        self._clock = clock
        self._lock = threading.Lock()
        self._seen: dict[Hashable, tuple[float, int]] = {}

    def due(self, key: Hashable) -> int | None:
        """None: stay quiet; else say it now, adding how many went unsaid since last time."""
        now = self._clock()
        with self._lock:
            seen = self._seen.get(key)
            if seen is not None and now - seen[0] < self.every:
                self._seen[key] = (seen[0], seen[1] + 1)
                return None
            self._seen[key] = (now, 0)
            return 0 if seen is None else seen[1]


#: the least time between two log lines about one recurring fault (:meth:`Faults.report`)
FAULT_LOG_EVERY = 60.0
#: errors the host raises that a loop of the agent outlives (issue 26: EMFILE, ENFILE,
#: ENOMEM, EIO ...): counted as ``host`` errors; anything else is a bug, ``internal``
HOST_FAULTS = (OSError, MemoryError)


class Faults:
    """The errors the agent's loops outlive (the main loop and its periodic pass, the
    planner, the watcher, the accept loops), counted by kind with ``count`` (the agent's
    ``vmpin_errors_total``) and said at most once a minute each."""

    def __init__(self, count: Callable[[str], object], every: float = FAULT_LOG_EVERY) -> None:
        self._count = count
        self._throttle = Throttle(every)

    def report(self, where: str, err: BaseException) -> None:
        """Count ``err`` -- ``host`` for what the host refused (EMFILE, ENFILE, ENOMEM, EIO:
        an OSError or MemoryError), ``internal`` for anything else -- and log it the first
        time per (where, what), then at most once a minute with how many went unsaid: a host
        out of fds must not also fill the node's journal.  The loop then tries again at its
        next turn (issue 26: an EMFILE in the periodic pass used to end the agent)."""
        # (a VmpinError translated from the host's OSError chains it: ``raise ... from err``)
        cause = err.__cause__ if isinstance(err.__cause__, HOST_FAULTS) else err
        host = isinstance(cause, HOST_FAULTS)
        self._count("host" if host else "internal")
        code = getattr(cause, "errno", None)
        what = errno.errorcode.get(code, type(cause).__name__) if code else type(cause).__name__
        unsaid = self._throttle.due((where, what))
        if unsaid is None:
            return
        fields = {"where": where, "error": what, "detail": str(err), "unsaid": unsaid}
        log.error(
            "host error: going on" if host else "internal error: going on",
            exc_info=None if host else err,
            extra={"fields": fields},
        )
