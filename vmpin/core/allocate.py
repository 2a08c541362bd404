"""Exclusive CPUs for a pod when kubelet hands out none: which CPUs, in kubelet's order.

vmpin allocates on a node whose kubelet CPU manager policy is ``none`` (issue 30): a pod
annotated for exclusive CPUs (:mod:`vmpin.core.podpolicy`) gets ``count`` CPUs that no other
pod holds, and every other container runs on what is left (the node's shared pool).  This
module owns only the choice -- topology + free CPUs + count + options in, a CPU set or a
:class:`Refusal` out -- pure, no I/O; :mod:`vmpin.reconcile.allocations` decides who asks
and records the answer.

The order is kubelet's ``takeByTopologyNUMAPacked`` (pkg/kubelet/cm/cpumanager/
cpu_assignment.go), so an operator moving between kubelet's static policy and vmpin's
allocation sees the same CPUs chosen:

1. whole sockets, while the request needs at least a socket's worth (free sockets in ID
   order);
2. whole NUMA nodes, likewise (sockets holding fewer free CPUs first, then NUMA nodes within
   them holding fewer free CPUs first: packing, so big free units stay whole for later);
3. whole cores (a core whose every online thread is free), in that NUMA order and, within a
   NUMA node, cores with fewer free threads first, then by core;
4. single threads, from the same core order (partly used cores first), lowest CPU first.

When NUMA nodes span sockets (rather than the usual sockets holding NUMA nodes) the first two
levels swap, as kubelet's ``numaOrSocketsFirst`` does.  A core is keyed by its lowest thread
(sysfs ``core_id`` is per package: vmpin.core.topology), which orders as kubelet's core ids do
on its test machines.

Options (kubelet's static-policy options that bear on the choice):

- ``full_pcpus_only``: whole cores only -- a count that is not a multiple of the threads per
  core, or more whole cores than are free, is refused (kubelet's SMTAlignmentError);
- ``reserved``: kubelet's reserved CPUs (``reservedSystemCPUs``): never allocated, they stay
  in the pool.  Not given, they are what kubelet reserves when only a CPU count is reserved:
  the first ``keep`` CPUs in this same order over every online CPU (CPU 0 on most machines);
  ``EMPTY`` reserves none;
- ``keep``: CPUs the shared pool keeps at the least (kubelet's pool never goes empty: 1).
"""

from __future__ import annotations

from vmpin.core.cpuset import EMPTY, CpuSet

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.core._lean)
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable
    from typing import NamedTuple

    from vmpin.core.topology import CpuInfo, Topology
else:
    from vmpin.core._lean import NamedTuple


class Refusal(NamedTuple):
    """Why a request cannot be met now (one line, for ``audit`` and an Event)."""

    reason: str

    def __str__(self) -> str:
        return self.reason


class Options(NamedTuple):
    full_pcpus_only: bool = False
    #: None: the first ``keep`` CPUs in kubelet's order (:func:`reserved_cpus`)
    reserved: CpuSet | None = None
    #: CPUs the shared pool keeps, at the least
    keep: int = 1


def reserved_cpus(topology: Topology, options: Options) -> CpuSet:
    """The CPUs never allocated: the option's, or kubelet's choice for ``keep`` CPUs."""
    if options.reserved is not None:
        return options.reserved & topology.online
    got = take_by_topology(topology, topology.online, max(0, options.keep))
    return got if isinstance(got, CpuSet) else EMPTY


def allocate(
    topology: Topology,
    free: CpuSet,
    count: int,
    options: Options = Options(),
    pool_floor: CpuSet = EMPTY,
) -> CpuSet | Refusal:
    """``count`` CPUs out of ``free`` (online CPUs no pod holds), or why not.

    The shared pool is what stays: ``free`` less the answer (plus ``pool_floor``: CPUs the
    pool holds that are not offered, e.g. reserved ones); it keeps ``options.keep`` CPUs.
    """
    if count < 1:
        return Refusal(f"asks for {count} CPUs: nothing to allocate")
    free = free & topology.online
    reserved = reserved_cpus(topology, options)
    offered = free - reserved
    pool_after = len(free | pool_floor | reserved) - count
    if count > len(offered):
        return Refusal(
            f"needs {count} exclusive CPUs, {len(offered)} free"
            + (f" ({offered})" if offered else "")
            + (f"; CPUs {reserved} are reserved for the shared pool" if reserved else "")
        )
    if pool_after < options.keep:
        return Refusal(
            f"needs {count} exclusive CPUs, {len(offered)} free ({offered}), but the shared"
            f" pool keeps at least {options.keep}"
        )
    if options.full_pcpus_only:
        tpc = topology.threads_per_core
        if count % tpc:
            return Refusal(
                f"full-pcpus-only: {count} CPUs is not a whole number of cores"
                f" ({tpc} threads each)"
            )
    got = take_by_topology(topology, offered, count, whole_cores=options.full_pcpus_only)
    return got


def take_by_topology(
    topology: Topology, free: CpuSet, count: int, *, whole_cores: bool = False
) -> CpuSet | Refusal:
    """kubelet's takeByTopologyNUMAPacked on vmpin's topology (see the module docstring)."""
    acc = _Accumulator(topology, free, count)
    if acc.done:
        return EMPTY
    if count > len(free):
        return Refusal(f"needs {count} CPUs, {len(free)} free")
    for level in acc.levels():
        for unit in acc.free_units(level):
            if acc.needs(len(unit)):
                acc.take(unit)
                if acc.done:
                    return acc.result
    for core in acc.free_cores():
        if acc.needs(topology.threads_per_core):
            acc.take(core)
            if acc.done:
                return acc.result
    if whole_cores:
        return Refusal(f"full-pcpus-only: {count} CPUs are not free as whole cores")
    for cpu in acc.packed_cpus():
        acc.take(CpuSet((cpu,)))
        if acc.done:
            return acc.result
    return Refusal(f"needs {count} CPUs, found {len(acc.result)}")  # (cannot happen)


class _Accumulator:
    """kubelet's cpuAccumulator: what is free, what is taken, what is still needed."""

    def __init__(self, topology: Topology, free: CpuSet, count: int) -> None:
        self.topo = topology
        self.free = free & topology.online
        self.need = count
        self.result = EMPTY
        infos = [topology.cpus[c] for c in topology.online]
        self._sockets = _group(infos, lambda c: c.socket)
        self._numas = _group(infos, lambda c: c.numa)
        self._cores = _group(infos, lambda c: c.core)
        self._socket_of_numa = {c.numa: c.socket for c in infos}
        # sockets hold NUMA nodes (the usual case), or NUMA nodes hold sockets
        self._numa_first = any(
            len({topology.cpus[c].socket for c in cpus}) > 1 for cpus in self._numas.values()
        )

    @property
    def done(self) -> bool:
        return self.need < 1

    def needs(self, n: int) -> bool:
        return self.need >= n

    def take(self, cpus: CpuSet) -> None:
        self.result = self.result | cpus
        self.free = self.free - cpus
        self.need -= len(cpus)

    def _free_in(self, cpus: CpuSet) -> int:
        return len(cpus & self.free)

    def levels(self) -> list[dict[int, CpuSet]]:
        return [self._numas, self._sockets] if self._numa_first else [self._sockets, self._numas]

    def free_units(self, units: dict[int, CpuSet]) -> list[CpuSet]:
        """The units (sockets, NUMA nodes) whose every online CPU is free, in ID order."""
        return [cpus for _, cpus in sorted(units.items()) if cpus <= self.free]

    def _numa_order(self) -> list[int]:
        """NUMA nodes with free CPUs: their sockets by free CPUs (fewest first), then the
        nodes in each by free CPUs (fewest first), then by id."""
        with_free = [n for n, cpus in self._numas.items() if cpus & self.free]
        if self._numa_first:
            return sorted(with_free, key=lambda n: (self._free_in(self._numas[n]), n))
        by_socket: dict[int, list[int]] = {}
        for n in with_free:
            by_socket.setdefault(self._socket_of_numa[n], []).append(n)
        order = sorted(by_socket, key=lambda s: (self._free_in(self._sockets[s]), s))
        return [
            n
            for s in order
            for n in sorted(by_socket[s], key=lambda n: (self._free_in(self._numas[n]), n))
        ]

    def _core_order(self) -> list[CpuSet]:
        """Cores with free threads, NUMA node by NUMA node, fewer free threads first."""
        out: list[CpuSet] = []
        for n in self._numa_order():
            numa = self._numas[n]
            cores = [(k, c) for k, c in self._cores.items() if c & self.free and c <= numa]
            cores.sort(key=lambda kc: (self._free_in(kc[1]), kc[0]))
            out.extend(cpus for _, cpus in cores)
        return out

    def free_cores(self) -> list[CpuSet]:
        """Whole free cores: every thread a core of this machine has (kubelet's
        CPUsPerCore), all free; a core whose sibling is offline is not whole."""
        tpc = self.topo.threads_per_core
        return [cpus for cpus in self._core_order() if cpus <= self.free and len(cpus) == tpc]

    def packed_cpus(self) -> Iterable[int]:
        for core in self._core_order():
            yield from sorted(core & self.free)


def _group(infos: list[CpuInfo], key: Callable[[CpuInfo], int]) -> dict[int, CpuSet]:
    out: dict[int, list[int]] = {}
    for info in infos:
        out.setdefault(key(info), []).append(info.cpu)
    return {k: CpuSet(v) for k, v in out.items()}
