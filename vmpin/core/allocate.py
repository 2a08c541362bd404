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
on its test machines; an L3 group (kubelet's uncore cache) by its lowest CPU.

Options (kubelet's static-policy options that bear on the choice, as kubelet's
``staticPolicy.takeByTopology`` applies them; docs/allocation.md):

- ``full_pcpus_only``: whole cores only -- a count that is not a multiple of the threads per
  core, or more whole cores than are free, is refused (kubelet's SMTAlignmentError);
- ``distribute_across_numa`` (``distribute-cpus-across-numa``): kubelet's
  ``takeByTopologyNUMADistributed`` instead (:func:`take_distributed`): when one NUMA node
  cannot hold the request, it is spread evenly over the fewest NUMA nodes that can, the
  remainder going where it leaves the free CPUs most balanced; in groups of a core's threads
  under ``full_pcpus_only``;
- ``align_by_socket`` (``align-by-socket``): with ``distribute_across_numa``, NUMA nodes of
  one socket are preferred to any set spanning sockets (kubelet #139778).  Its other effect in
  kubelet widens a topology manager's NUMA hint to whole sockets; vmpin has no topology
  manager (kubelet's default policy ``none`` gives no hint either), so there it changes
  nothing;
- ``prefer_uncore`` (``prefer-align-cpus-by-uncorecache``): between the socket/NUMA levels and
  whole cores, whole free L3 groups while the request needs one, then the request's rest
  inside a single L3 group where it fits (kubelet's ``takeUncoreCache``);
- ``reserved``: kubelet's reserved CPUs (``reservedSystemCPUs``): never allocated, they stay
  in the pool.  Not given, they are what kubelet reserves when only a CPU count is reserved:
  the first ``keep`` CPUs in this same order over every online CPU (CPU 0 on most machines);
  ``EMPTY`` reserves none;
- ``strict_reservation`` (``strict-cpu-reservation``): the reserved CPUs leave the shared pool
  too (kubelet's default CPU set excludes them): the pool that is left must keep a CPU of its
  own besides them;
- ``keep``: CPUs the shared pool keeps at the least (kubelet's pool never goes empty: 1).
"""

from __future__ import annotations

from vmpin.core.cpuset import EMPTY, CpuSet

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.lean.records)
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence
    from typing import NamedTuple

    from vmpin.core.topology import CpuInfo, Topology
else:
    from vmpin.lean.records import NamedTuple


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
    distribute_across_numa: bool = False
    align_by_socket: bool = False
    prefer_uncore: bool = False
    strict_reservation: bool = False


def for_machine(topology: Topology, options: Options) -> tuple[Options, list[str]]:
    """The options as kubelet would run them on this machine, and a note for each it would
    not: kubelet refuses ``align-by-socket`` where sockets outnumber NUMA nodes
    (ValidateStaticPolicyOptions) -- vmpin follows the rest without it."""
    notes = []
    if options.align_by_socket and topology.sockets > topology.numa_nodes:
        notes.append(
            f"cpuManagerPolicyOptions align-by-socket: {topology.sockets} sockets but"
            f" {topology.numa_nodes} NUMA node(s) (kubelet refuses it on such a machine):"
            " not followed"
        )
        options = options._replace(align_by_socket=False)
    return options, notes


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
    pool holds that are not offered, e.g. reserved ones); it keeps ``options.keep`` CPUs, or
    under ``strict_reservation`` one besides the reserved CPUs, which it does not hold.
    """
    if count < 1:
        return Refusal(f"asks for {count} CPUs: nothing to allocate")
    free = free & topology.online
    reserved = reserved_cpus(topology, options)
    offered = free - reserved
    if options.strict_reservation:  # the pool is what is left besides the reserved CPUs
        pool_after, keep = len((free | pool_floor) - reserved) - count, 1
    else:
        pool_after, keep = len(free | pool_floor | reserved) - count, options.keep
    if count > len(offered):
        return Refusal(
            f"needs {count} exclusive CPUs, {len(offered)} free"
            + (f" ({offered})" if offered else "")
            + (f"; CPUs {reserved} are reserved for the shared pool" if reserved else "")
        )
    if pool_after < keep:
        return Refusal(
            f"needs {count} exclusive CPUs, {len(offered)} free ({offered}), but the shared"
            f" pool keeps at least {keep}"
            + (f" besides the reserved CPUs {reserved}" if options.strict_reservation else "")
        )
    tpc = topology.threads_per_core
    if options.full_pcpus_only and count % tpc:
        return Refusal(
            f"full-pcpus-only: {count} CPUs is not a whole number of cores ({tpc} threads each)"
        )
    if options.distribute_across_numa:
        group = tpc if options.full_pcpus_only else 1
        if options.full_pcpus_only:  # a split core is never taken (SMTAlignmentError)
            offered = CpuSet.union_all(c for c in _Accumulator(topology, offered, 0).free_cores())
            if count > len(offered):
                return Refusal(f"full-pcpus-only: {count} CPUs are not free as whole cores")
        return take_distributed(
            topology, offered, count, group, align_by_socket=options.align_by_socket
        )
    return take_by_topology(
        topology, offered, count, whole_cores=options.full_pcpus_only,
        uncore=options.prefer_uncore,
    )  # fmt: skip


def take_by_topology(
    topology: Topology,
    free: CpuSet,
    count: int,
    *,
    whole_cores: bool = False,
    uncore: bool = False,
) -> CpuSet | Refusal:
    """kubelet's takeByTopologyNUMAPacked on vmpin's topology (see the module docstring);
    ``uncore``: its ``preferAlignByUncoreCache``."""
    acc = _Accumulator(topology, free, count)
    if acc.done:
        return EMPTY
    if count > len(acc.free):
        return Refusal(f"needs {count} CPUs, {len(acc.free)} free")
    for level in acc.levels():
        for unit in acc.free_units(level):
            if acc.needs(len(unit)):
                acc.take(unit)
                if acc.done:
                    return acc.result
    if uncore:
        acc.take_uncore()
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


def take_distributed(
    topology: Topology,
    free: CpuSet,
    count: int,
    group: int = 1,
    *,
    align_by_socket: bool = False,
) -> CpuSet | Refusal:
    """kubelet's takeByTopologyNUMADistributed (KEP-2902) on vmpin's topology.

    Tries sets of 1, 2, ... NUMA nodes (from the fewest that could hold the request, in the
    packed NUMA order): in each size, the set that can take an even share of ``group``-sized
    groups from every node, whose remainder -- handed out a group at a time over some of its
    nodes -- leaves the free CPUs per NUMA node most balanced (lowest standard deviation;
    the first such set wins a tie; a perfect balance ends the search).  Each node's share is
    then taken packed (:func:`take_by_topology`) from that node's free CPUs.  A count that is
    not a whole number of groups, or no set that works, is packed over everything."""
    if count % group:
        return take_by_topology(topology, free, count)
    acc = _Accumulator(topology, free, count)
    if acc.done:
        return EMPTY
    if count > len(acc.free):
        return Refusal(f"needs {count} CPUs, {len(acc.free)} free")
    numas = acc.numa_order()
    avail = {n: acc.free_in_numa(n) for n in numas}
    lo, hi = acc.numa_range(group)
    for k in range(lo, hi + 1):
        best: tuple[float, bool, Sequence[int], Sequence[int]] | None = None
        for combo in _combinations(numas, k):
            if best is not None and best[0] == 0 and (not align_by_socket or best[1]):
                break
            if sum(avail[n] for n in combo) < count:
                continue
            if sum(avail[n] // group for n in combo) * group < count:
                continue
            share = count // k // group * group
            if align_by_socket:  # (never more than a node has, kubelet #139778)
                share = min([share] + [avail[n] // group * group for n in combo])
            if any(avail[n] < share for n in combo):
                continue
            after = dict(avail)
            for n in combo:
                after[n] -= share
            remainder = count - share * k
            local: tuple[float, Sequence[int]] | None = None
            if remainder == 0:
                local = (_stdev(after.values()), ())
            spare = [n for n in combo if after[n] >= group]
            for j in range(len(spare), 0, -1):
                if remainder <= 0:
                    break
                for subset in _combinations(spare, j):
                    left = _spread(after, subset, remainder, group)
                    if left is None:
                        continue
                    balance = _stdev(left.values())
                    if local is None or balance < local[0]:
                        local = (balance, subset)
            if local is None:
                continue
            in_one = align_by_socket and len({acc.socket_of_numa(n) for n in combo}) == 1
            better = best is None or local[0] < best[0]
            if align_by_socket and best is not None and in_one != best[1]:
                better = in_one
            if better:
                best = (local[0], in_one, combo, local[1])
        if best is None:
            continue
        _, _, chosen, spread_over = best
        share = min([count // len(chosen) // group * group]
                    + [acc.free_in_numa(n) // group * group for n in chosen])  # fmt: skip
        for n in chosen:
            acc.take_packed(n, share)
        remainder = count - share * len(chosen)
        while remainder > 0:
            before = remainder
            for n in spread_over:
                if remainder == 0:
                    break
                if acc.free_in_numa(n) < group:
                    continue
                acc.take_packed(n, group)
                remainder -= group
            if remainder == before:
                break  # (kubelet would loop here forever: nothing left to spread over)
        if acc.need != 0 or len(acc.result) != count:
            return Refusal(f"needs {count} CPUs, spread over NUMA nodes found {len(acc.result)}")
        return acc.result
    return take_by_topology(topology, free, count)


def _combinations(items: Sequence[int], k: int) -> Iterable[tuple[int, ...]]:
    """k-subsets in kubelet's iterateCombinations order (itertools' lexicographic one)."""
    from itertools import combinations

    return combinations(items, k) if k >= 1 else ()


def _spread(
    after: dict[int, int], subset: Sequence[int], remainder: int, group: int
) -> dict[int, int] | None:
    """What each NUMA node keeps once ``remainder`` CPUs are handed out a group at a time,
    round robin over ``subset``; None when the subset cannot take them."""
    left = dict(after)
    if sum(left[n] for n in subset) < remainder:
        return None
    while remainder > 0:
        before = remainder
        for n in subset:
            if remainder == 0:
                break
            if left[n] < group:
                continue
            left[n] -= group
            remainder -= group
        if remainder == before:
            return None  # (groups do not fit what is left: kubelet would spin)
    return left


def _round3(x: float) -> float:
    """Go's ``math.Round(x*1000) / 1000`` for x >= 0 (half away from zero)."""
    import math

    return math.floor(x * 1000 + 0.5) / 1000


def _stdev(values: Iterable[int]) -> float:
    """kubelet's balance score: the population standard deviation, mean and result rounded
    to 3 decimals as its ``standardDeviation`` does."""
    import math

    xs = list(values)
    mean = _round3(sum(xs) / len(xs))
    return _round3(math.sqrt(sum((x - mean) * (x - mean) for x in xs) / len(xs)))


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
        self._l3s = _group(infos, lambda c: c.l3)
        self._l3_of_core = {c.core: c.l3 for c in infos}
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

    def free_in_numa(self, numa: int) -> int:
        return self._free_in(self._numas[numa])

    def socket_of_numa(self, numa: int) -> int:
        return self._socket_of_numa[numa]

    def numa_order(self) -> list[int]:
        return self._numa_order()

    def take_packed(self, numa: int, count: int) -> None:
        """``count`` CPUs of one NUMA node's free ones, packed (kubelet's distributed step)."""
        got = take_by_topology(self.topo, self.free & self._numas[numa], count)
        if isinstance(got, CpuSet):
            self.take(got)

    def numa_range(self, group: int) -> tuple[int, int]:
        """kubelet's rangeNUMANodesNeededToSatisfy: the fewest and most NUMA nodes that could
        hold what is still needed, in groups of ``group`` CPUs."""
        groups = (len(self.topo.online) - 1) // group + 1
        per_numa = (groups - 1) // len(self._numas) + 1
        needed = (self.need - 1) // group + 1
        with_free = sum(1 for cpus in self._numas.values() if cpus & self.free)
        return (needed - 1) // per_numa + 1, min(needed, with_free)

    # -- kubelet's takeUncoreCache (prefer-align-cpus-by-uncorecache) ------------------------
    def _uncore_order(self) -> list[int]:
        """L3 groups with free CPUs, NUMA node by NUMA node in the packed order, fewer free
        CPUs first, then by key (kubelet's sortAvailableUncoreCaches: a group spanning NUMA
        nodes comes once per node)."""
        out: list[int] = []
        for n in self._numa_order():
            ids = {self.topo.cpus[c].l3 for c in self._numas[n] & self.free}
            out.extend(sorted(ids, key=lambda u: (self._free_in(self._l3s[u]), u)))
        return out

    def take_uncore(self) -> None:
        """Whole free L3 groups while at least a group's worth is needed, else the rest from
        one L3 group where it fits, trying the groups in :meth:`_uncore_order`."""
        per_group = len(self.topo.online) // len(self._l3s)  # (kubelet's CPUsPerUncore)
        for l3 in self._uncore_order():
            if self.needs(per_group):
                for whole in self._uncore_order():
                    cpus = self._l3s[whole]
                    if cpus <= self.free and self.needs(len(cpus)):
                        self.take(cpus)
            if self.done:
                return
            self._take_partial_uncore(l3)
            if self.done:
                return

    def _take_partial_uncore(self, l3: int) -> None:
        """All that is needed from the lowest cores of one L3 group with free threads, or
        nothing; an odd count on SMT leaves the last of those cores' highest thread."""
        tpc = self.topo.threads_per_core
        cores_needed = (self.need + tpc - 1) // tpc
        cores = sorted(k for k, cpus in self._cores.items()
                       if self._l3_of_core[k] == l3 and cpus & self.free)  # fmt: skip
        cpus = CpuSet.union_all(self._cores[k] & self.free for k in cores[:cores_needed])
        if self.need % 2 and tpc > 1 and len(cpus) > self.need:
            cpus = cpus - CpuSet((max(cpus),))
        if len(cpus) == self.need:
            self.take(cpus)

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
