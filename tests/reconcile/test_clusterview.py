"""The cluster view's states, from NodePinning reports as the API returns them."""

from __future__ import annotations

from typing import Any

import pytest

from vmpin.reconcile.clusterview import cluster_rows, node_row

NOW = 1_800_000_000.0  # 2027-01-15T08:00:00Z


def report(name: str, age: float | None, **status: Any) -> dict[str, Any]:
    from datetime import datetime, timezone

    st: dict[str, Any] = {"heartbeatSeconds": 60, **status}
    if age is not None:
        st["heartbeatTime"] = datetime.fromtimestamp(NOW - age, tz=timezone.utc).strftime(
            "%Y-%m-%dT%H:%M:%SZ")
    return {"metadata": {"name": name}, "status": st}


CASES = [
    ("clean", report("a", 5, audit={"ok": True, "violations": 0}), "clean"),
    ("violations", report("a", 5, audit={"ok": False, "violations": 2}), "violations"),
    ("conflicts-win-over-violations",
     report("a", 5, conflictCount=1, audit={"ok": False, "violations": 2}), "conflicts"),
    ("stale-wins", report("a", 181, conflictCount=1), "stale"),
    ("just-fresh", report("a", 179), "clean"),
    ("never-wrote", {"metadata": {"name": "a"}}, "stale"),
    ("bad-time", {"metadata": {"name": "a"}, "status": {"heartbeatTime": "yesterday"}}, "stale"),
]


@pytest.mark.parametrize(("name", "rep", "state"), CASES, ids=[c[0] for c in CASES])
def test_states(name: str, rep: dict[str, Any], state: str) -> None:
    assert node_row(rep, NOW)["state"] == state


def test_rows_sorted_with_counts() -> None:
    rows = cluster_rows([report("b", 1, sandboxCount=3, exclusiveCpus="2-5"),
                         report("a", 1)], NOW)
    assert [r["node"] for r in rows] == ["a", "b"]
    assert (rows[1]["sandboxes"], rows[1]["exclusive_cpus"], rows[1]["heartbeat_age"]) == (
        3, "2-5", 1.0)
