"""The allocator (vmpin.core.allocate), table-driven: kubelet's own cases on kubelet's test
machines, then the fixture machines of tests/fixtures/sysfs (SMT on/off, 2 NUMA, AMD with 8
L3 groups, offline and isolated CPUs).

kubelet's cases and machines are from pkg/kubelet/cm/cpumanager/cpu_assignment_test.go
(``commonTakeByTopologyTestCases`` and ``TestTakeByTopologyNUMAPacked``) and
policy_test.go's ``topoSingleSocketHT`` / ``topoDualSocketHT`` /
``topoDualSocketMultiNumaPerSocketHT``: the same free CPUs must give the same answer.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tests.conftest import FIXTURES
from vmpin.core.allocate import Options, Refusal, allocate, reserved_cpus, take_by_topology
from vmpin.core.cpuset import CpuSet
from vmpin.core.topology import CpuInfo, Topology
from vmpin.linux.sysfs import read_topology


def kubelet_machine(layout: dict[int, tuple[int, int, int]]) -> Topology:
    """cpu -> (socket, numa, core id) as kubelet's test topologies list them."""
    cores: dict[tuple[int, int], list[int]] = {}
    for cpu, (socket, _, core) in layout.items():
        cores.setdefault((socket, core), []).append(cpu)
    infos = []
    for cpu, (socket, numa, core) in layout.items():
        threads = CpuSet(cores[(socket, core)])
        infos.append(CpuInfo(cpu, min(threads), core, socket, 0, numa, socket, threads))
    return Topology.build(infos)


#: 1 socket, 4 cores, siblings n / n+4
SINGLE_SOCKET_HT = kubelet_machine({c: (0, 0, c % 4) for c in range(8)})
#: 2 sockets (one NUMA node each), 6 cores: even CPUs on socket 0, siblings n / n+6
DUAL_SOCKET_HT = kubelet_machine({c: (c % 2, c % 2, c % 6) for c in range(12)})
#: 2 sockets x 2 NUMA nodes x 10 cores, siblings n / n+40: NUMA k holds 10k..10k+9 (+40)
DUAL_SOCKET_MULTI_NUMA_HT = kubelet_machine(
    {c: ((c % 40) // 20, (c % 40) // 10, c % 40) for c in range(80)}
)


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
