"""The agent's logging: JSON lines on stderr, one object per line (``ts``, ``level``, ``event``,
then the fields), so a node's log pipeline can index them without parsing prose; and the
:class:`Throttle` that keeps a condition which recurs (a host out of fds, a flood of
connections) to a line a minute instead of a line per pass or per connection."""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Hashable
from datetime import datetime, timezone
from typing import Any

log = logging.getLogger("vmpin.service.agent")


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
        return json.dumps(out, default=str)


def setup_logging(stream: Any = None, level: str | None = None) -> None:
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger("vmpin")
    root.handlers[:] = [handler]
    root.propagate = False
    name = (level or os.environ.get("VMPIN_LOG_LEVEL") or "INFO").upper()
    if name not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        from vmpin.core.errors import StateError

        raise StateError(f"VMPIN_LOG_LEVEL={name!r}: expected DEBUG, INFO, WARNING or ERROR")
    root.setLevel(name)


def log_event(level: int, event: str, **fields: Any) -> None:
    if log.isEnabledFor(level):
        log.log(level, event, extra={"fields": fields})


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
