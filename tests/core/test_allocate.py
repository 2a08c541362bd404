"""The allocator (vmpin.core.allocate), table-driven: kubelet's own cases on kubelet's test
machines, then the fixture machines of tests/fixtures/sysfs (SMT on/off, 2 NUMA, AMD with 8
L3 groups, offline and isolated CPUs).

kubelet's cases and machines are from pkg/kubelet/cm/cpumanager/cpu_assignment_test.go
(``commonTakeByTopologyTestCases``, ``TestTakeByTopologyNUMAPacked`` with its
PreferAlignByUncoreCache cases, ``commonTakeByTopologyExtendedTestCases`` and
``TestTakeByTopologyNUMADistributed``) and policy_test.go's ``topoSingleSocketHT`` /
``topoDualSocketHT`` / ``topoDualSocketMultiNumaPerSocketHT`` / ``topoUncore*``: the same free
CPUs must give the same answer.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tests.conftest import FIXTURES
from vmpin.core.allocate import (
    Options,
    Refusal,
    allocate,
    for_machine,
    reserved_cpus,
    take_by_topology,
    take_distributed,
)
from vmpin.core.cpuset import CpuSet
from vmpin.core.topology import CpuInfo, Topology
from vmpin.linux.sysfs import read_topology


def kubelet_machine(layout: dict[int, tuple[int, ...]]) -> Topology:
    """cpu -> (socket, numa, core id[, uncore cache id]) as kubelet's test topologies list
    them (no uncore cache id: kubelet's zero value, one group for the machine)."""
    cores: dict[tuple[int, int], list[int]] = {}
    for cpu, (socket, _, core, *_) in layout.items():
        cores.setdefault((socket, core), []).append(cpu)
    infos = []
    for cpu, (socket, numa, core, *uncore) in layout.items():
        threads = CpuSet(cores[(socket, core)])
        l3 = uncore[0] if uncore else 0
        infos.append(CpuInfo(cpu, min(threads), core, socket, 0, numa, l3, threads))
    return Topology.build(infos)


#: 1 socket, 4 cores, siblings n / n+4
SINGLE_SOCKET_HT = kubelet_machine({c: (0, 0, c % 4) for c in range(8)})
#: 2 sockets (one NUMA node each), 6 cores: even CPUs on socket 0, siblings n / n+6
DUAL_SOCKET_HT = kubelet_machine({c: (c % 2, c % 2, c % 6) for c in range(12)})
#: 2 sockets x 2 NUMA nodes x 10 cores, siblings n / n+40: NUMA k holds 10k..10k+9 (+40)
DUAL_SOCKET_MULTI_NUMA_HT = kubelet_machine(
    {c: ((c % 40) // 20, (c % 40) // 10, c % 40) for c in range(80)}
)


# policy_test.go's uncore machines (no SMT unless said; 4 CPUs per uncore cache):
#: 1 socket, 1 NUMA node, 4 uncore caches
UNCORE_SINGLE_SOCKET_NO_SMT = kubelet_machine({c: (0, 0, c, c // 4) for c in range(16)})
#: 2 sockets of one NUMA node, 2 uncore caches each
UNCORE_DUAL_SOCKET_NO_SMT = kubelet_machine({c: (c // 8, c // 8, c, c // 4) for c in range(16)})
#: 1 socket, 2 NUMA nodes of 2 uncore caches
UNCORE_SINGLE_SOCKET_MULTI_NUMA = kubelet_machine({c: (0, c // 8, c, c // 4) for c in range(16)})
#: 1 socket, 8 cores (siblings n / n+8), cores 0-3 on uncore cache 0, 4-7 on 1
UNCORE_SINGLE_SOCKET_SMT = kubelet_machine({c: (0, 0, c % 8, c % 8 // 4) for c in range(16)})
#: issue kubernetes#114642's machine: 2 sockets x 2 NUMA nodes, no SMT, NUMA n = CPUs n mod 4,
#: NUMA 0 and 2 on socket 0
TWO_SOCKET_FOUR_NUMA = kubelet_machine({c: (c % 2, c % 4, c) for c in range(16)})


@dataclass(frozen=True)
class Case:
    name: str
    topo: Topology
    free: str
    count: int
    want: str | None  # None: refused


P = CpuSet.parse
KUBELET_CASES = [
    Case("more than available", SINGLE_SOCKET_HT, "0,2,4,6", 5, None),
    Case("one cpu", SINGLE_SOCKET_HT, "0-7", 1, "0"),
    Case("one cpu, some taken", SINGLE_SOCKET_HT, "1,3,5,6,7", 1, "6"),
    Case("two cpus", SINGLE_SOCKET_HT, "0-7", 2, "0,4"),
    Case("all cpus", SINGLE_SOCKET_HT, "0-7", 8, "0-7"),
    Case("two cpus, one core free", SINGLE_SOCKET_HT, "0-3,6", 2, "2,6"),
    Case("a socket, dual socket", DUAL_SOCKET_HT, "0-11", 6, "0,2,4,6,8,10"),
    Case("a socket, multi-NUMA", DUAL_SOCKET_MULTI_NUMA_HT, "0-79", 40, "0-19,40-59"),
    Case("a NUMA node, multi-NUMA", DUAL_SOCKET_MULTI_NUMA_HT, "0-79", 20, "0-9,40-49"),
    Case("a NUMA node, one taken", DUAL_SOCKET_MULTI_NUMA_HT, "10-39,50-79", 20, "10-19,50-59"),
    Case("a socket and a NUMA node", DUAL_SOCKET_MULTI_NUMA_HT, "0-79", 60, "0-29,40-69"),
    Case("socket + NUMA, core 0 taken", DUAL_SOCKET_MULTI_NUMA_HT, "1-39,41-79", 60,
         "10-39,50-79"),
    Case("one cpu from socket 0's core", DUAL_SOCKET_HT, "1-5,7-11", 1, "2"),
    Case("4 full cores, 3 on NUMA 0", DUAL_SOCKET_HT, "0-11", 8, "0,6,2,8,4,10,1,7"),
    Case("32 full cores, 30 from 3 NUMA", DUAL_SOCKET_MULTI_NUMA_HT, "0-79", 64,
         "0-29,40-69,30,31,70,71"),
]


# TestTakeByTopologyNUMAPacked, "Test cases for PreferAlignByUncoreCache"
UNCORE_CASES = [
    Case("two full uncore caches and part of one", UNCORE_SINGLE_SOCKET_NO_SMT, "1-15", 10,
         "1,2,4-11"),
    # kubelet's topoDualSocketHT has one uncore cache for both sockets (its zero value): the
    # lowest free core's first thread, not packed's 2
    Case("one cpu from dual socket with HT", DUAL_SOCKET_HT, "1-5,7-11", 1, "1"),
    Case("first available uncore cache, first socket", UNCORE_DUAL_SOCKET_NO_SMT, "0-15", 4,
         "0-3"),
    Case("all available uncore caches, first socket", UNCORE_DUAL_SOCKET_NO_SMT, "2-15", 6,
         "2-7"),
    Case("first available uncore cache, second socket", UNCORE_DUAL_SOCKET_NO_SMT, "8-15", 4,
         "8-11"),
    Case("first available uncore cache, available NUMA", UNCORE_SINGLE_SOCKET_MULTI_NUMA,
         "3,4-8,12", 2, "4,5"),
    Case("best available uncore cache, SMT", UNCORE_SINGLE_SOCKET_SMT, "2-3,10-11,4-7,12-15", 6,
         "4,5,6,12,13,14"),
    Case("several uncore caches, SMT", UNCORE_SINGLE_SOCKET_SMT, "1-7,9-15", 10,
         "4-7,12-15,1,9"),
]  # fmt: skip


@dataclass(frozen=True)
class Spread:
    name: str
    topo: Topology
    free: str
    count: int
    group: int  # kubelet's cpuGroupSize: a core's threads under full-pcpus-only
    want: str


# commonTakeByTopologyExtendedTestCases + TestTakeByTopologyNUMADistributed
DISTRIBUTED_CASES = [
    Spread("4 full cores, 2 on each NUMA node", DUAL_SOCKET_HT, "0-11", 8, 1,
           "0,6,2,8,1,7,3,9"),
    Spread("32 full cores, 8 on each NUMA node", DUAL_SOCKET_MULTI_NUMA_HT, "0-79", 64, 1,
           "0-7,10-17,20-27,30-37,40-47,50-57,60-67,70-77"),
    Spread("24 full cores over the first 3 NUMA nodes", DUAL_SOCKET_MULTI_NUMA_HT, "0-79", 48,
           1, "0-7,10-17,20-27,40-47,50-57,60-67"),
    Spread("24 full cores, all but 2 of NUMA 0", DUAL_SOCKET_MULTI_NUMA_HT,
           "1-29,32-39,41-69,72-79", 48, 1, "1-8,10-17,20-27,41-48,50-57,60-67"),
    Spread("24 full cores over the last 3 NUMA nodes", DUAL_SOCKET_MULTI_NUMA_HT,
           "2-29,31-39,42-69,71-79", 48, 1, "10-17,20-27,31-38,50-57,60-67,71-78"),
    Spread("8 full cores, 2 on each NUMA node", DUAL_SOCKET_MULTI_NUMA_HT,
           "0-2,10-12,20-22,30-32,40-41,50-51,60-61,70-71", 16, 1,
           "0-1,10-11,20-21,30-31,40-41,50-51,60-61,70-71"),
    Spread("one cpu, core from socket 0", DUAL_SOCKET_HT, "1-5,7-11", 1, 1, "1"),
    Spread("one cpu, cpuGroupSize 2", DUAL_SOCKET_HT, "1-5,7-11", 1, 2, "2"),
    Spread("13 full cores over the first 2 NUMA nodes", DUAL_SOCKET_MULTI_NUMA_HT, "0-79", 26,
           1, "0-6,10-16,40-45,50-55"),
    Spread("13 full cores over 2 NUMA nodes, group 2", DUAL_SOCKET_MULTI_NUMA_HT, "0-79", 26, 2,
           "0-6,10-15,40-46,50-55"),
    Spread("31 full cores, spill to NUMA 0, 1", DUAL_SOCKET_MULTI_NUMA_HT, "0-79", 62, 1,
           "0-7,10-17,20-27,30-37,40-47,50-57,60-66,70-76"),
    Spread("31 full cores, spill to NUMA 0, 1, 2, group 2", DUAL_SOCKET_MULTI_NUMA_HT, "0-79",
           62, 2, "0-7,10-17,20-27,30-36,40-47,50-57,60-67,70-76"),
    Spread("31 full cores, spill to NUMA 2, 3 for balance", DUAL_SOCKET_MULTI_NUMA_HT,
           "0-8,10-18,20-39,40-48,50-58,60-79", 62, 1,
           "0-7,10-17,20-27,30-37,40-46,50-56,60-67,70-77"),
    Spread("31 full cores, spill to NUMA 0, 2, 3 for balance, group 2",
           DUAL_SOCKET_MULTI_NUMA_HT, "0-8,10-18,20-39,40-48,50-58,60-79", 62, 2,
           "0-7,10-16,20-27,30-37,40-47,50-56,60-67,70-77"),
    Spread("bestRemainder has NUMA nodes with enough CPUs", DUAL_SOCKET_MULTI_NUMA_HT,
           "0-3,10-13,20-23,30-36,40-43,50-53,60-63,70-76", 34, 1,
           "0-3,10-13,20-23,30-34,40-43,50-53,60-63,70-74"),
]  # fmt: skip


def load(name: str) -> Topology:
    return read_topology(str(FIXTURES / "sysfs" / name))


# The fixture machines (tests/support/make_sysfs.py): siblings n / n+<cores>.
FIXTURE_CASES = [
    # Xeon 6258R x2: 28 cores per socket, one NUMA node per socket, siblings n / n+56
    Case("xeon: 1 cpu", load("xeon-gold-6258r-2s"), "0-111", 1, "0"),
    Case("xeon: 2 cpus = one core", load("xeon-gold-6258r-2s"), "0-111", 2, "0,56"),
    Case("xeon: 4 cpus, CPU 0's core reserved", load("xeon-gold-6258r-2s"), "1-55,57-111", 4,
         "1,2,57,58"),
    Case("xeon: a whole socket", load("xeon-gold-6258r-2s"), "0-111", 56, "0-27,56-83"),
    Case("xeon: socket 0 in use, socket 1 packed", load("xeon-gold-6258r-2s"),
         "0,56,28-55,84-111", 2, "0,56"),
    # EPYC 7313 x2: 16 cores per socket, 8 L3 groups of 4 cores, siblings n / n+32
    Case("epyc: 3 cpus, a core and a thread", load("amd-epyc-7313-2s"), "0-63", 3, "0,1,32"),
    Case("epyc: a socket", load("amd-epyc-7313-2s"), "0-63", 32, "0-15,32-47"),
    # no SMT, 16 CPUs on 2 NUMA nodes of one socket
    Case("no-smt: 3 cpus", load("no-smt-server"), "0-15", 3, "0-2"),
    Case("no-smt: a NUMA node", load("no-smt-server"), "0-15", 8, "0-7"),
    Case("no-smt: a NUMA node, packed on the used one", load("no-smt-server"), "1-15", 2, "1,2"),
    # 4 cores of which 6 CPUs online (6-7 offline), 2-3 isolated
    Case("offline: the core whose sibling is offline", load("offline-isolated"), "0-5", 1, "2"),
    Case("offline: never an offline CPU", load("offline-isolated"), "0-7", 6, "0-5"),
    Case("offline: 7 is more than online", load("offline-isolated"), "0-7", 7, None),
]


@pytest.mark.parametrize("case", KUBELET_CASES + FIXTURE_CASES, ids=lambda c: c.name)
def test_take_by_topology(case: Case) -> None:
    """kubelet's cases give kubelet's answers; the fixture machines the same order's."""
    got = take_by_topology(case.topo, P(case.free), case.count)
    if case.want is None:
        assert isinstance(got, Refusal), got
    else:
        assert got == P(case.want), f"got {got}, expected {case.want}"


@pytest.mark.parametrize("case", UNCORE_CASES, ids=lambda c: c.name)
def test_prefer_align_by_uncore_cache(case: Case) -> None:
    assert take_by_topology(case.topo, P(case.free), case.count, uncore=True) == P(case.want)


@pytest.mark.parametrize("case", DISTRIBUTED_CASES, ids=lambda c: c.name)
def test_distribute_across_numa(case: Spread) -> None:
    got = take_distributed(case.topo, P(case.free), case.count, case.group)
    assert got == P(case.want), f"got {got}, expected {case.want}"


def test_align_by_socket_keeps_the_spread_in_one_socket() -> None:
    """kubernetes#114642 / #139778: 6 CPUs spread over 2 NUMA nodes, CPU 0 taken.  The most
    balanced pair is NUMA 2 + 1, across the sockets; align-by-socket takes the best pair of one
    socket, NUMA 1 + 3 (socket 1)."""
    free = P("1-15")
    assert take_distributed(TWO_SOCKET_FOUR_NUMA, free, 6) == P("1,2,5,6,9,10")
    aligned = take_distributed(TWO_SOCKET_FOUR_NUMA, free, 6, align_by_socket=True)
    assert aligned == P("1,3,5,7,9,11")
    opts = Options(reserved=CpuSet(), distribute_across_numa=True, align_by_socket=True)
    assert allocate(TWO_SOCKET_FOUR_NUMA, free, 6, opts) == aligned


def test_align_by_socket_where_kubelet_refuses_it() -> None:
    """More sockets than NUMA nodes (kubelet's ValidateStaticPolicyOptions): not followed."""
    opts = Options(align_by_socket=True)
    assert for_machine(load("xeon-gold-6258r-2s"), opts) == (opts, [])
    # (no fixture has more sockets than NUMA nodes: kubelet's own 4-socket, 1-node shape)
    one_node = kubelet_machine({c: (c % 4, 0, c // 4) for c in range(8)})
    got, notes = for_machine(one_node, opts)
    assert not got.align_by_socket and "4 sockets but 1 NUMA node(s)" in notes[0]


# The options on the fixture machines, through allocate() as vmpin calls it: what each
# changes against kubelet's default order.
OPTION_CASES = [
    # EPYC 7313: L3 groups of 4 cores (CPUs 4k..4k+3 and their siblings +32); CPU 0 reserved
    ("epyc: 8 CPUs packed span L3 groups 0 and 4", "amd-epyc-7313-2s", Options(), 8,
     "1-4,33-36"),
    ("epyc: 8 CPUs, prefer-align: one whole L3 group", "amd-epyc-7313-2s",
     Options(prefer_uncore=True), 8, "4-7,36-39"),
    # (group 0's part left, CPU 32 alone, cannot give a core: the next group's first one)
    ("epyc: 10 CPUs, prefer-align: a whole group and a core", "amd-epyc-7313-2s",
     Options(prefer_uncore=True), 10, "4-8,36-40"),
    # (packed: 1-3,33-35; kubelet counts group 0's lowest cores, 0 of which has only CPU 32
    # free: 5 CPUs, not 6, so the next group)
    ("epyc: 6 CPUs, prefer-align: the first group they fit", "amd-epyc-7313-2s",
     Options(prefer_uncore=True), 6, "4-6,36-38"),
    # Xeon 6258R x2 (one NUMA node per socket): distributed balances the free CPUs, so a
    # request one node holds goes to the node with more free (1: CPU 0's core reserved)
    ("xeon: 6 CPUs packed on node 0", "xeon-gold-6258r-2s", Options(keep=2), 6, "1-3,57-59"),
    ("xeon: 6 CPUs distributed: node 1, more free", "xeon-gold-6258r-2s",
     Options(keep=2, distribute_across_numa=True), 6, "28-30,84-86"),
    ("xeon: 60 CPUs distributed: 30 a node", "xeon-gold-6258r-2s",
     Options(reserved=CpuSet(), distribute_across_numa=True), 60,
     "0-14,28-42,56-70,84-98"),
    ("xeon: 58 CPUs, full cores, distributed in pairs", "xeon-gold-6258r-2s",
     Options(reserved=CpuSet(), full_pcpus_only=True, distribute_across_numa=True), 58,
     "0-14,28-41,56-70,84-97"),
    # no SMT, 2 NUMA nodes of 8 CPUs on one socket (one L3 group)
    ("no-smt: 4 CPUs packed", "no-smt-server", Options(), 4, "1-4"),
    ("no-smt: 4 CPUs distributed: node 1", "no-smt-server",
     Options(distribute_across_numa=True), 4, "8-11"),
    ("no-smt: 10 CPUs distributed: 5 a node", "no-smt-server",
     Options(distribute_across_numa=True), 10, "1-5,8-12"),
    ("no-smt: one L3 group: prefer-align changes nothing", "no-smt-server",
     Options(prefer_uncore=True), 4, "1-4"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "machine", "opts", "count", "want"), OPTION_CASES,
                         ids=[c[0] for c in OPTION_CASES])  # fmt: skip
def test_options_on_fixture_machines(
    name: str, machine: str, opts: Options, count: int, want: str
) -> None:
    topo = load(machine)
    assert allocate(topo, topo.online, count, opts) == P(want)


def test_strict_cpu_reservation_keeps_a_pool_besides_the_reserved() -> None:
    topo = load("no-smt-server")
    # without it the reserved CPU 0 is the pool: 15 of 16 can go
    assert allocate(topo, topo.online, 15) == P("1-15")
    strict = Options(strict_reservation=True)
    refused = allocate(topo, topo.online, 15, strict)
    assert isinstance(refused, Refusal) and "besides the reserved CPUs 0" in str(refused)
    assert allocate(topo, topo.online, 14, strict) == P("1-6,8-15")  # (NUMA 1 whole)


def test_pool_keeps_one_cpu() -> None:
    topo = load("no-smt-server")
    none = Options(reserved=CpuSet())
    assert allocate(topo, P("0-15"), 15, none) == P("0-14")
    refused = allocate(topo, P("0-15"), 16, none)
    assert isinstance(refused, Refusal) and "keeps at least 1" in str(refused)
    # CPUs held by nobody but not offered (reserved) count for the pool
    assert allocate(topo, P("1-15"), 15, Options(reserved=P("0"))) == P("1-15")
    refused = allocate(topo, P("1-5"), 6, none)
    assert isinstance(refused, Refusal) and "6 exclusive CPUs, 5 free (1-5)" in str(refused)


def test_reserved_cpus_are_never_allocated() -> None:
    got = allocate(SINGLE_SOCKET_HT, P("0-7"), 2, Options(reserved=P("0,4")))
    assert got == P("1,5")


@pytest.mark.parametrize(
    ("machine", "keep", "reserved", "two"),
    [
        # as kubelet reserves a CPU count: its own order over every CPU, so CPU 0 (and on
        # SMT machines the next exclusive pick avoids CPU 0's core, as kubelet's does)
        ("xeon-gold-6258r-2s", 1, "0", "1,57"),
        ("xeon-gold-6258r-2s", 2, "0,56", "1,57"),
        ("no-smt-server", 1, "0", "1-2"),
        ("offline-isolated", 1, "2", "0,4"),
    ],
)
def test_default_reserved_is_kubelets_pick(
    machine: str, keep: int, reserved: str, two: str
) -> None:
    topo = load(machine)
    assert reserved_cpus(topo, Options(keep=keep)) == P(reserved)
    assert allocate(topo, topo.online, 2, Options(keep=keep)) == P(two)
    refused = allocate(topo, P(reserved), 1, Options(keep=keep))
    assert isinstance(refused, Refusal) and f"CPUs {P(reserved)} are reserved" in str(refused)


def test_full_pcpus_only() -> None:
    topo = load("xeon-gold-6258r-2s")
    refused = allocate(topo, P("0-111"), 3, Options(full_pcpus_only=True))
    assert isinstance(refused, Refusal) and "not a whole number of cores" in str(refused)
    # CPU 56 taken: its core is not whole, so the next whole cores are used
    assert allocate(topo, P("0-55,57-111"), 2, Options(full_pcpus_only=True)) == P("1,57")
    # only split cores left: refused rather than split
    refused = allocate(SINGLE_SOCKET_HT, P("0-3"), 2, Options(full_pcpus_only=True))
    assert isinstance(refused, Refusal) and "whole cores" in str(refused)
    # without the option kubelet's order takes threads of split cores
    assert allocate(SINGLE_SOCKET_HT, P("0-3"), 2) == P("1,2")  # (0: reserved)
    # no SMT: every count is whole cores
    no_smt = load("no-smt-server")
    assert allocate(no_smt, P("0-15"), 3, Options(full_pcpus_only=True)) == P("1-3")


def test_count_below_one_is_refused() -> None:
    assert isinstance(allocate(SINGLE_SOCKET_HT, P("0-7"), 0), Refusal)
