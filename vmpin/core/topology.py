"""The host's CPU topology as plain data, and the order a 1:1 vCPU plan follows.

Built by :mod:`vmpin.linux.sysfs` from a sysfs tree (or by tests from fixture trees); this module
only holds values and lookups, after kubelet's ``topology.CPUTopology``.

Two sysfs facts shape the model:

- ``core_id`` is per package (and repeats across sockets, sometimes with gaps), so a core is
  keyed by the lowest CPU among its threads, never by ``core_id`` alone;
- SMT siblings are not adjacent in numbering on most Intel servers (0 and 56 on a 2x28-core
  Xeon), so "topology order" is computed: socket, then NUMA node, then L3 group, then core,
  with a core's threads next to each other.  Following that order, guest vCPU pairs (0,1),
  (2,3)... land on host core pairs, and a guest told ``threads=2`` sees the truth.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from vmpin.core.cpuset import EMPTY, CpuSet
from vmpin.core.errors import TopologyError

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.core._lean)
if TYPE_CHECKING:
    from typing import Any, NamedTuple
else:
    from vmpin.core._lean import NamedTuple


class CpuInfo(NamedTuple):
    cpu: int
    #: node-unique core key: the lowest CPU among the core's SMT threads.
    core: int
    #: the raw, per-package sysfs core_id.
    core_id: int
    socket: int
    die: int
    numa: int
    #: L3 group key: the lowest CPU sharing this CPU's L3 (its socket when there is no L3).
    l3: int
    siblings: CpuSet


class Topology(NamedTuple):
    cpus: Mapping[int, CpuInfo]
    online: CpuSet
    offline: CpuSet = EMPTY
    isolated: CpuSet = EMPTY
    #: CPUs ordered for placement; computed from ``cpus``.
    order: tuple[int, ...] = ()

    @classmethod
    def build(
        cls,
        infos: Iterable[CpuInfo],
        online: CpuSet | None = None,
        offline: CpuSet = EMPTY,
        isolated: CpuSet = EMPTY,
    ) -> Topology:
        table = {info.cpu: info for info in infos}
        if not table:
            raise TopologyError("no online CPU found")
        online = CpuSet(table) if online is None else online
        missing = online - CpuSet(table)
        if missing:
            raise TopologyError(f"online CPUs {missing} have no topology")
        ordered = sorted(
            table.values(), key=lambda c: (c.socket, c.numa, c.die, c.l3, c.core, c.cpu)
        )
        return cls(table, online, offline, isolated, tuple(c.cpu for c in ordered))

    # -- lookups -------------------------------------------------------------------------
    def info(self, cpu: int) -> CpuInfo:
        try:
            return self.cpus[cpu]
        except KeyError:
            raise TopologyError(f"CPU {cpu} is not online") from None

    def ordered(self, mask: CpuSet) -> list[int]:
        """The CPUs of ``mask`` in topology order (siblings adjacent, grouped by L3/NUMA)."""
        return [cpu for cpu in self.order if cpu in mask]

    def siblings(self, cpu: int) -> CpuSet:
        return self.info(cpu).siblings

    def check_online(self, mask: CpuSet, what: str) -> None:
        bad = mask - self.online
        if bad:
            raise TopologyError(f"{what}: CPUs {bad} are not online (online: {self.online})")

    @property
    def sockets(self) -> int:
        return len({c.socket for c in self.cpus.values()})

    @property
    def numa_nodes(self) -> int:
        return len({c.numa for c in self.cpus.values()})

    @property
    def cores(self) -> int:
        return len({c.core for c in self.cpus.values()})

    @property
    def l3_groups(self) -> int:
        return len({c.l3 for c in self.cpus.values()})

    @property
    def threads_per_core(self) -> int:
        return max(len(c.siblings) for c in self.cpus.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "online": self.online.to_list(),
            "offline": self.offline.to_list(),
            "isolated": self.isolated.to_list(),
            "sockets": self.sockets,
            "numa_nodes": self.numa_nodes,
            "cores": self.cores,
            "l3_groups": self.l3_groups,
            "threads_per_core": self.threads_per_core,
            "order": list(self.order),
            "cpus": [
                {
                    "cpu": c.cpu,
                    "core": c.core,
                    "core_id": c.core_id,
                    "socket": c.socket,
                    "die": c.die,
                    "numa": c.numa,
                    "l3": c.l3,
                    "siblings": c.siblings.to_list(),
                }
                for c in sorted(self.cpus.values(), key=lambda c: c.cpu)
            ],
        }
