"""Fixture sysfs trees: named machines, each defined once, written as real directories.

``python -m tests.support.make_sysfs`` (re)writes ``tests/fixtures/sysfs/<name>/devices/system/...``
for every machine in :data:`MACHINES`; the trees are committed next to this generator, and
``tests/test_topology.py`` checks that they still match it.  Tests read the trees through
:func:`vmpin.linux.sysfs.read_topology`, exactly as vmpin reads ``/sys`` (no patched ``open``).

Written per machine, after the kernel's own layout:

- ``cpu/{online,offline,isolated,possible,present}``;
- ``cpu/cpuN/online`` for hot-pluggable CPUs (all but cpu0 on x86);
- for online CPUs only (an offlined CPU loses them, as in real sysfs):
  ``cpu/cpuN/topology/{physical_package_id,die_id,core_id,thread_siblings_list,core_cpus_list}``
  and ``cpu/cpuN/cache/index{0..3}/{level,type,size,shared_cpu_list}`` (L1d, L1i, L2 per core,
  L3 shared);
- ``node/nodeN/cpulist``.

Sibling and cache lists only name online CPUs: the kernel drops an offlined CPU from its
siblings' masks (and x86 drops it from its node's cpulist too).

Linux numbers x86 CPUs in MADT order, which firmware lists as every core's first thread
(socket by socket), then every core's second thread: so a core's threads are ``n`` and
``n + <cores in the machine>``, never adjacent.  :func:`machine` builds that numbering.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from vmpin.core.cpuset import EMPTY, CpuSet

SYSFS_FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "sysfs"


@dataclass(frozen=True)
class Cpu:
    cpu: int
    socket: int
    #: sysfs core_id: per package, repeated across sockets, with gaps.
    core_id: int
    #: every thread of the core, online or not.
    threads: CpuSet
    numa: int
    #: every CPU sharing this CPU's L3, online or not.
    l3: CpuSet


@dataclass(frozen=True)
class Caches:
    """Sizes as sysfs prints them (``cache/indexN/size``)."""

    l1d: str
    l1i: str
    l2: str
    l3: str


@dataclass(frozen=True)
class Machine:
    name: str
    note: str
    cpus: tuple[Cpu, ...]
    caches: Caches
    offline: CpuSet = EMPTY
    isolated: CpuSet = EMPTY

    @property
    def possible(self) -> CpuSet:
        return CpuSet(c.cpu for c in self.cpus)

    @property
    def online(self) -> CpuSet:
        return self.possible - self.offline


def machine(
    name: str,
    note: str,
    *,
    sockets: int,
    core_ids: Sequence[int],
    threads: int,
    numa: Callable[[int, int], int],
    l3: Callable[[int, int], int],
    caches: Caches,
    offline: CpuSet = EMPTY,
    isolated: CpuSet = EMPTY,
) -> Machine:
    """A machine numbered as x86 Linux numbers it.

    ``core_ids`` are one package's sysfs core ids (the same in every package); ``numa`` and
    ``l3`` map (socket, core index within the socket) to a NUMA node and an L3 group number
    (any number unique per group).  Thread ``t`` of core ``c`` in socket ``s`` is CPU
    ``t * sockets * cores + s * cores + c``.
    """
    cores = len(core_ids)
    total = sockets * cores

    def cpu_of(t: int, s: int, c: int) -> int:
        return t * total + s * cores + c

    l3_groups: dict[int, set[int]] = {}
    for s in range(sockets):
        for c in range(cores):
            group = l3_groups.setdefault(l3(s, c), set())
            group.update(cpu_of(t, s, c) for t in range(threads))
    cpus = []
    for t in range(threads):
        for s in range(sockets):
            for c in range(cores):
                cpus.append(
                    Cpu(
                        cpu=cpu_of(t, s, c),
                        socket=s,
                        core_id=core_ids[c],
                        threads=CpuSet(cpu_of(u, s, c) for u in range(threads)),
                        numa=numa(s, c),
                        l3=CpuSet(l3_groups[l3(s, c)]),
                    )
                )
    return Machine(name, note, tuple(cpus), caches, offline, isolated)


# -- the machines ---------------------------------------------------------------------------

XEON_GOLD_6258R_2S = machine(
    "xeon-gold-6258r-2s",
    """Intel Xeon Gold 6258R (Cascade Lake), 2 sockets, HT on; Linux 5.15 (Ubuntu 22.04).

    lscpu excerpt::

        CPU(s):                  112
        On-line CPU(s) list:     0-111
        Thread(s) per core:      2
        Core(s) per socket:      28
        Socket(s):               2
        L1d / L1i:               1.8 MiB (56 instances) each
        L2:                      56 MiB (56 instances)
        L3:                      77 MiB (2 instances)
        NUMA node0 CPU(s):       0-27,56-83
        NUMA node1 CPU(s):       28-55,84-111

    Siblings are n and n+56 (cpu0 and cpu56).  core_id is per package and follows the mesh
    tile APIC ids, so it has gaps and repeats in each socket: 0-6,8-14,16-22,24-30.  One
    38.5 MiB L3 per socket.
    """,
    sockets=2,
    core_ids=[*range(0, 7), *range(8, 15), *range(16, 23), *range(24, 31)],
    threads=2,
    numa=lambda s, c: s,
    l3=lambda s, c: s,
    caches=Caches(l1d="32K", l1i="32K", l2="1024K", l3="39424K"),
)

AMD_EPYC_7313_2S = machine(
    "amd-epyc-7313-2s",
    """AMD EPYC 7313 (Milan, Zen 3), 2 sockets, SMT on, NPS1; Linux 6.1 (Debian 12).

    lscpu excerpt::

        CPU(s):                  64
        On-line CPU(s) list:     0-63
        Thread(s) per core:      2
        Core(s) per socket:      16
        Socket(s):               2
        L2:                      16 MiB (32 instances)
        L3:                      256 MiB (8 instances)
        NUMA node0 CPU(s):       0-15,32-47
        NUMA node1 CPU(s):       16-31,48-63

    Four CCDs per socket with 4 of their 8 cores enabled; each CCD is one CCX with its own
    32 MiB L3, so a socket has 4 L3 groups of 4 cores (cpu0-3 and 32-35 share one).
    Siblings are n and n+32.  core_id is per package and keeps the 8-core CCD stride of the
    APIC ids: 0-3,8-11,16-19,24-27 in each socket.
    """,
    sockets=2,
    core_ids=[*range(0, 4), *range(8, 12), *range(16, 20), *range(24, 28)],
    threads=2,
    numa=lambda s, c: s,
    l3=lambda s, c: s * 4 + c // 4,
    caches=Caches(l1d="32K", l1i="32K", l2="512K", l3="32768K"),
)

NO_SMT_SERVER = machine(
    "no-smt-server",
    """Intel Xeon Gold 6326 (Ice Lake SP), 1 socket, HT off in firmware, SNC2; Linux 6.1.

    lscpu excerpt::

        CPU(s):                  16
        On-line CPU(s) list:     0-15
        Thread(s) per core:      1
        Core(s) per socket:      16
        Socket(s):               1
        L2:                      20 MiB (16 instances)
        L3:                      24 MiB (1 instance)
        NUMA node0 CPU(s):       0-7
        NUMA node1 CPU(s):       8-15

    Every thread_siblings_list names the CPU alone.  Sub-NUMA clustering splits the socket
    into two NUMA nodes that still share the one L3 (the kernel logs "llc-sibling ... is not
    on the same node"), so here an L3 group spans NUMA nodes.  core_id has gaps from fused-off
    tiles: 0-3,8-11,16-19,24-27 here.
    """,
    sockets=1,
    core_ids=[*range(0, 4), *range(8, 12), *range(16, 20), *range(24, 28)],
    threads=1,
    numa=lambda s, c: c // 8,
    l3=lambda s, c: s,
    caches=Caches(l1d="48K", l1i="32K", l2="1280K", l3="24576K"),
)

OFFLINE_ISOLATED = machine(
    "offline-isolated",
    """Intel Core i7-7700 (Kaby Lake), 4 cores x 2 threads; Linux 6.1, booted with
    ``isolcpus=2,3``, then ``echo 0 > /sys/devices/system/cpu/cpu{6,7}/online``.

    lscpu excerpt::

        CPU(s):                  8
        On-line CPU(s) list:     0-5
        Off-line CPU(s) list:    6,7
        Thread(s) per core:      2
        Core(s) per socket:      4
        Socket(s):               1
        NUMA node0 CPU(s):       0-5

    Siblings are n and n+4, so cores 2 and 3 have lost their second thread: cpu2's and
    cpu3's thread_siblings_list name them alone.  cpu6 and cpu7 keep only their ``online``
    file (no topology or cache dir).  cpu/isolated reads 2-3.
    """,
    sockets=1,
    core_ids=[0, 1, 2, 3],
    threads=2,
    numa=lambda s, c: 0,
    l3=lambda s, c: 0,
    caches=Caches(l1d="32K", l1i="32K", l2="256K", l3="8192K"),
    offline=CpuSet([6, 7]),
    isolated=CpuSet([2, 3]),
)

MACHINES: dict[str, Machine] = {
    m.name: m for m in (XEON_GOLD_6258R_2S, AMD_EPYC_7313_2S, NO_SMT_SERVER, OFFLINE_ISOLATED)
}


# -- the writer ----------------------------------------------------------------------------


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def write_tree(m: Machine, root: Path) -> Path:
    """Write ``m`` as a sysfs tree under ``root`` (replacing it); return ``root``."""
    if root.exists():
        shutil.rmtree(root)
    system = root / "devices" / "system"
    cpu_dir = system / "cpu"
    online = m.online
    _write(cpu_dir / "possible", m.possible.to_list())
    _write(cpu_dir / "present", m.possible.to_list())
    _write(cpu_dir / "online", online.to_list())
    # The kernel prints an empty line for an empty offline/isolated list.
    _write(cpu_dir / "offline", m.offline.to_list())
    _write(cpu_dir / "isolated", m.isolated.to_list())
    for c in m.cpus:
        d = cpu_dir / f"cpu{c.cpu}"
        if c.cpu != 0:
            # cpu0 is not hot-pluggable on x86: it has no online file.
            _write(d / "online", "1" if c.cpu in online else "0")
        if c.cpu not in online:
            d.mkdir(parents=True, exist_ok=True)
            continue
        siblings = (c.threads & online).to_list()
        topo = d / "topology"
        _write(topo / "physical_package_id", str(c.socket))
        _write(topo / "die_id", "0")
        _write(topo / "core_id", str(c.core_id))
        _write(topo / "thread_siblings_list", siblings)
        _write(topo / "core_cpus_list", siblings)
        caches = (
            (1, "Data", m.caches.l1d, siblings),
            (1, "Instruction", m.caches.l1i, siblings),
            (2, "Unified", m.caches.l2, siblings),
            (3, "Unified", m.caches.l3, (c.l3 & online).to_list()),
        )
        for i, (level, kind, size, shared) in enumerate(caches):
            index = d / "cache" / f"index{i}"
            _write(index / "level", str(level))
            _write(index / "type", kind)
            _write(index / "size", size)
            _write(index / "shared_cpu_list", shared)
    nodes: dict[int, set[int]] = {}
    for c in m.cpus:
        nodes.setdefault(c.numa, set())
        if c.cpu in online:
            nodes[c.numa].add(c.cpu)
    for node, cpus in sorted(nodes.items()):
        _write(system / "node" / f"node{node}" / "cpulist", CpuSet(cpus).to_list())
    _write(system / "node" / "online", CpuSet(nodes).to_list())
    return root


def write_all(dest: Path = SYSFS_FIXTURES) -> list[Path]:
    return [write_tree(m, dest / name) for name, m in MACHINES.items()]


if __name__ == "__main__":
    for path in write_all():
        print(path)
