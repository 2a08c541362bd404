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

A mask need not hold whole cores: kubelet reserves CPU 0, so a container can get 1,4,5 on a
4-core SMT part (siblings n/n+4), where 4's sibling 0 is not in the mask.  A lone thread
placed first would shift every following pair across two cores, so :meth:`Topology.ordered`
puts the cores with an even number of threads in the mask first and the odd ones (lone
threads) last.  :meth:`Topology.place_vcpus` maps guest vCPU indices onto the mask keeping
guest pairs (2k, 2k+1) on one host core, also when some indices are not pinned (Kata's boot
vCPU, see docs/design.md).
"""

from __future__ import annotations

from vmpin.core.cpuset import EMPTY, CpuSet
from vmpin.core.errors import TopologyError

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.lean.records)
if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping
    from typing import NamedTuple
else:
    from vmpin.lean.records import NamedTuple


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
        """The CPUs of ``mask`` in topology order (siblings adjacent, grouped by L3/NUMA),
        cores with an even number of threads in the mask first, lone threads last."""
        return [cpu for unit in self._cores_in(mask) for cpu in unit]

    def _cores_in(self, mask: CpuSet) -> list[list[int]]:
        """The mask's CPUs grouped by host core, in :meth:`ordered`'s order."""
        by_core: dict[int, list[int]] = {}
        for cpu in self.order:
            if cpu in mask:
                by_core.setdefault(self.cpus[cpu].core, []).append(cpu)
        cores = list(by_core.values())  # dicts keep insertion order: topology order
        return [c for c in cores if len(c) % 2 == 0] + [c for c in cores if len(c) % 2]

    def place_vcpus(self, indices: Iterable[int], mask: CpuSet) -> dict[int, int]:
        """Guest vCPU index -> host CPU, one CPU each, for ``len(mask)`` indices.

        A guest with ``threads=2`` sees vCPUs (2k, 2k+1) as SMT siblings (QEMU numbers
        threads innermost).  Guest pairs whose two indices are both given take host cores'
        thread pairs, in order; an index whose guest sibling is not given (next to a floating
        boot vCPU, or the last odd one) takes a lone host thread when the mask has one, so
        it does not break a host pair.  What is left fills the rest in order.
        """
        idx = sorted(set(indices))
        cores = self._cores_in(mask)
        if len(idx) != sum(len(c) for c in cores):
            raise TopologyError(f"{len(idx)} vCPUs cannot be placed 1:1 on {mask}")
        host_pairs = [c[i : i + 2] for c in cores for i in range(0, len(c) - 1, 2)]
        lone = [c[-1] for c in cores if len(c) % 2]
        given = set(idx)
        guest_pairs = [(i, i + 1) for i in idx if i % 2 == 0 and i + 1 in given]
        paired = {i for pair in guest_pairs for i in pair}
        singles = [i for i in idx if i not in paired]
        out: dict[int, int] = {}
        for (a, b), (x, y) in zip(guest_pairs, host_pairs, strict=False):
            out[a], out[b] = x, y
        used = len(out) // 2
        spare = [cpu for pair in host_pairs[used:] for cpu in pair]
        # Singles take lone threads before spare host pairs.  Guest pairs beyond the host's
        # pairs only exist when no spare pair is left: then all go, in index order, to lone
        # threads (on a no-SMT host that is plain topology order).
        rest = sorted(singles + [i for pair in guest_pairs[used:] for i in pair])
        for i, cpu in zip(rest, lone + spare, strict=True):
            out[i] = cpu
        return out

    def siblings(self, cpu: int) -> CpuSet:
        return self.info(cpu).siblings

    def check_online(self, mask: CpuSet, what: str) -> None:
        check_online(mask, self.online, what)

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


def check_online(mask: CpuSet, online: CpuSet, what: str) -> None:
    """TopologyError unless every CPU of ``mask`` is in ``online`` (the online list alone:
    ``vmpin update`` checks its set with it, without the rest of the topology)."""
    bad = mask - online
    if bad:
        raise TopologyError(f"{what}: CPUs {bad} are not online (online: {online})")
