"""The cluster view: one row per node from its NodePinning report (``vmpin cluster``).

Pure: the reports (as the API returns them, deploy/crd.yaml) and the time in, rows out (the
``cluster`` view, vmpin.wire.views: hence this layer, not the core's).  A node's state is the
first that holds of:

- ``stale``      its agent has not written for 3 heartbeats (or never wrote a status);
- ``conflicts``  the plan has claims that cannot all be honoured (conflictCount > 0);
- ``violations`` the last audit found violations;
- ``clean``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any, Literal

from vmpin.wire import views

STALE_HEARTBEATS = 3
STATES = ("clean", "violations", "conflicts", "stale")


def _parse_time(value: object) -> float | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def node_row(report: Mapping[str, Any], now: float) -> dict[str, Any]:
    status = report.get("status") or {}
    name = (report.get("metadata") or {}).get("name", "")
    beat = _parse_time(status.get("heartbeatTime"))
    every = status.get("heartbeatSeconds") or 60
    age = None if beat is None else max(0.0, now - beat)
    audit = status.get("audit") or {}
    violations = int(audit.get("violations") or 0)
    conflicts = int(status.get("conflictCount") or 0)
    state: Literal["clean", "violations", "conflicts", "stale"]
    if age is None or age > STALE_HEARTBEATS * every:
        state = "stale"
    elif conflicts:
        state = "conflicts"
    elif violations or audit.get("ok") is False:
        state = "violations"
    else:
        state = "clean"
    return views.cluster_node(
        node=name,
        state=state,
        sandboxes=int(status.get("sandboxCount") or 0),
        violations=violations,
        conflicts=conflicts,
        exclusive_cpus=status.get("exclusiveCpus", ""),
        heartbeat_age=None if age is None else round(age, 1),
        conflict_list=list(status.get("conflicts") or []),
    )


def cluster_rows(reports: Iterable[Mapping[str, Any]], now: float) -> list[dict[str, Any]]:
    return sorted((node_row(r, now) for r in reports), key=lambda r: r["node"])
