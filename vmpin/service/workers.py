"""What the agent's planner keeps per sandbox and per full pass (status, gauges, pass logs).

The planner loop itself (take every ready entry -> one node-wide pass -> account each) is
:meth:`vmpin.service.agent_passes.Planner.run`; these records are kept, under its lock, by
:class:`vmpin.service.agent_accounting.Accounting`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from vmpin.core.cpuset import EMPTY, CpuSet


class SandboxStat:
    """What the agent knows about one sandbox after its last pass (for status and gauges)."""

    __slots__ = (
        "containers",
        "errors",
        "gen",
        "last",
        "mask",
        "mode",
        "pinned",
        "plans",
        "runtime",
        "threads",
    )

    def __init__(self, runtime: str) -> None:
        self.runtime = runtime
        self.plans = 0
        self.gen = 0
        self.last = 0.0
        self.containers = 0
        self.threads = 0
        self.pinned: dict[str, int] = {}
        #: kept as the set (a pass over 2,000 sandboxes renders none), listed in to_json
        self.mask: CpuSet = EMPTY
        self.mode = ""
        self.errors: list[str] = []

    def to_json(self) -> dict[str, Any]:
        return {
            "runtime": self.runtime,
            "plans": self.plans,
            "gen": self.gen,
            "last_pass_unix": round(self.last, 3),
            "containers": self.containers,
            "threads": self.threads,
            "threads_pinned": sum(self.pinned.values()),
            "mask": self.mask.to_list(),
            "mode": self.mode,
            "errors": self.errors,
        }


class FullPass:
    def __init__(self, number: int, cause: str, sandboxes: Iterable[str]) -> None:
        self.number = number
        self.cause = cause
        self.remaining = set(sandboxes)
        self.total = len(self.remaining)
        self.started = time.monotonic()
        self.started_cpu = time.process_time()
        self.repaired = 0
        self.errors = 0
