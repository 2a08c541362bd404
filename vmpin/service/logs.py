"""The agent's logging: JSON lines on stderr, one object per line (``ts``, ``level``, ``event``,
then the fields), so a node's log pipeline can index them without parsing prose."""

from __future__ import annotations

import json
import logging
import os
import sys
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
