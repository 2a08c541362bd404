"""Read the host's CPU topology from a sysfs root (``/sys``, or a fixture tree in tests).

Files read, all under ``<root>/devices/system``:

- ``cpu/online``, ``cpu/offline``, ``cpu/isolated`` (isolcpus): CPU lists;
- ``cpu/cpuN/topology/{physical_package_id,die_id,core_id,thread_siblings_list}``: present
  only for online CPUs (hot-unplugged CPUs lose their topology directory); ``die_id`` is
  missing before Linux 5.3 and reads as die 0;
- ``cpu/cpuN/cache/indexK/{level,shared_cpu_list}``: the L3 group (AMD EPYC has several
  per socket; Intel usually one);
- ``node/nodeN/cpulist``: NUMA nodes (a machine without NUMA has no ``node`` dir: node 0).
"""

from __future__ import annotations

import os

from vmpin.core.cpuset import EMPTY, CpuSet
from vmpin.core.errors import CpuSetError, TopologyError
from vmpin.core.topology import CpuInfo, Topology


def _read(path: str) -> str | None:
    """The file's text, stripped; None when it does not exist.

    os.open/os.read rather than open(): no buffered text wrapper for a few bytes (~5 us of
    ~12 per file, and a pass that re-plans reads a few files per CPU)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as err:
        raise TopologyError(f"{path}: {err.strerror}") from err
    try:
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    except OSError as err:
        raise TopologyError(f"{path}: {err.strerror}") from err
    finally:
        os.close(fd)
    return b"".join(chunks).decode().strip()


def _cpus(path: str, default: CpuSet | None = None) -> CpuSet:
    text = _read(path)
    if text is None:
        if default is None:
            raise TopologyError(f"{path}: missing")
        return default
    try:
        return CpuSet.parse(text)
    except CpuSetError as err:
        raise TopologyError(f"{path}: {err}") from err


def _int(path: str, default: int | None = None) -> int:
    text = _read(path)
    if text is None:
        if default is None:
            raise TopologyError(f"{path}: missing")
        return default
    try:
        return int(text)
    except ValueError:
        raise TopologyError(f"{path}: not a number: {text!r}") from None


def read_topology(sys_root: str = "/sys") -> Topology:
    cpu_dir = os.path.join(sys_root, "devices/system/cpu")
    online = _cpus(os.path.join(cpu_dir, "online"))
    offline = _cpus(os.path.join(cpu_dir, "offline"), EMPTY)
    isolated = _cpus(os.path.join(cpu_dir, "isolated"), EMPTY)
    numa_of = _numa_map(sys_root)

    raw: dict[int, tuple[int, int, int, CpuSet, int | None]] = {}
    for cpu in online:
        topo = os.path.join(cpu_dir, f"cpu{cpu}", "topology")
        socket = _int(os.path.join(topo, "physical_package_id"))
        # die_id is -1 on some hypervisors' CPUs; treat it as die 0.
        die = max(0, _int(os.path.join(topo, "die_id"), 0))
        core_id = _int(os.path.join(topo, "core_id"))
        siblings = _cpus(
            os.path.join(topo, "thread_siblings_list"),
            _cpus(os.path.join(topo, "core_cpus_list"), CpuSet([cpu])),
        )
        raw[cpu] = (socket, die, core_id, siblings & online | CpuSet([cpu]), _l3_key(cpu_dir, cpu))

    socket_first: dict[int, int] = {}
    for cpu, (socket, *_rest) in sorted(raw.items()):
        socket_first.setdefault(socket, cpu)
    infos = []
    for cpu, (socket, die, core_id, siblings, l3) in raw.items():
        infos.append(
            CpuInfo(
                cpu=cpu,
                core=siblings.first(),
                core_id=core_id,
                socket=socket,
                die=die,
                numa=numa_of.get(cpu, 0),
                # Without an L3 in sysfs (some VMs), the socket is the cache domain.
                l3=l3 if l3 is not None else socket_first[socket],
                siblings=siblings,
            )
        )
    return Topology.build(infos, online, offline, isolated)


def _l3_key(cpu_dir: str, cpu: int) -> int | None:
    cache = os.path.join(cpu_dir, f"cpu{cpu}", "cache")
    try:
        entries = sorted(os.listdir(cache))
    except FileNotFoundError:
        return None
    for entry in entries:
        if not entry.startswith("index"):
            continue
        if _read(os.path.join(cache, entry, "level")) == "3":
            shared = _cpus(os.path.join(cache, entry, "shared_cpu_list"), CpuSet([cpu]))
            return shared.first() if shared else cpu
    return None


def _numa_map(sys_root: str) -> dict[int, int]:
    node_dir = os.path.join(sys_root, "devices/system/node")
    out: dict[int, int] = {}
    try:
        entries = os.listdir(node_dir)
    except FileNotFoundError:
        return out
    for entry in entries:
        if entry.startswith("node") and entry[4:].isdigit():
            for cpu in _cpus(os.path.join(node_dir, entry, "cpulist"), EMPTY):
                out[cpu] = int(entry[4:])
    return out
