"""CountingAffinity: the real sched_setaffinity backend, counting every call.

Shared by the tests and the benchmarks (bench/bench_idle_pass.py): the proof that an idle
pass makes no affinity write is a count of real calls, not a mock of vmpin's own code.
"""

from __future__ import annotations

import threading

from vmpin.core.cpuset import CpuSet
from vmpin.linux.affinity import SchedAffinity


class CountingAffinity:
    """The real backend, counting every call (thread-safe: the agent's workers share it)."""

    def __init__(self) -> None:
        self.inner = SchedAffinity()
        self.sets = 0
        self.gets = 0
        self._lock = threading.Lock()

    def get(self, tid: int) -> CpuSet:
        with self._lock:
            self.gets += 1
        return self.inner.get(tid)

    def set(self, tid: int, cpus: CpuSet) -> CpuSet:
        with self._lock:
            self.sets += 1
        return self.inner.set(tid, cpus)
