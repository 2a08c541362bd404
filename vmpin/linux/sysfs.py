"""Read the host's CPU topology from a sysfs root (``/sys``, or a fixture tree in tests).

Files read, all under ``<root>/devices/system``:

- ``cpu/online``, ``cpu/offline``, ``cpu/isolated`` (isolcpus): CPU lists;
- ``cpu/cpuN/topology/{physical_package_id,die_id,core_id,thread_siblings_list}``: present
  only for online CPUs (hot-unplugged CPUs lose their topology directory); ``die_id`` is
  missing before Linux 5.3 and reads as die 0;
- ``cpu/cpuN/cache/indexK/{level,shared_cpu_list}``: the L3 group (AMD EPYC has several
  per socket; Intel usually one);
- ``node/nodeN/cpulist``: NUMA nodes (a machine without NUMA has no ``node`` dir: node 0).

That is ~9 files per CPU, ~800 on a 96-CPU node, read by every process that plans (a Kata
hook without an agent, every command).  :func:`read_topology` with ``cache`` keeps what it
read in a file of the state dir and reads it back while its key holds (:func:`_cache_key`);
a process that reads it again (the agent, for each ``vmpin update``) keeps the last one it
read or wrote, and takes it again while the key holds and the file is the same (:func:`_held`).
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
    return _parse(text, path)


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


#: the cache file's layout and meaning; another is not read (a change to what _read_cpus
#: makes of sysfs bumps it, so that no vmpin reads another's conclusions)
_CACHE_FORMAT = 1


def online_text(sys_root: str = "/sys") -> str | None:
    """The online CPU list as sysfs has it (None without one): a process that keeps a
    topology for its life compares it before each use (CPU hotplug changes it)."""
    return _read(os.path.join(sys_root, "devices/system/cpu/online"))


def online_cpus(sys_root: str = "/sys") -> CpuSet:
    """The online CPUs (``cpu/online``), read alone: what a CPU set is checked against
    (``vmpin update``), where the whole topology, even cached, is ~10 files' reads and
    stats (its lists, the boot id, a stat per CPU)."""
    return _cpus(os.path.join(sys_root, "devices/system/cpu/online"))


def read_topology(
    sys_root: str = "/sys",
    *,
    cache: str | None = None,
    proc_root: str = "/proc",
    save: bool = True,
) -> Topology:
    """The host's CPU topology; with ``cache``, read back from that file while it is current,
    and (with ``save``) written there after a full read: best effort, a read-only state dir
    only means reading sysfs every time."""
    cpu_dir = os.path.join(sys_root, "devices/system/cpu")
    texts = [_read(os.path.join(cpu_dir, name)) for name in ("online", "offline", "isolated")]
    if texts[0] is None:
        raise TopologyError(f"{os.path.join(cpu_dir, 'online')}: missing")
    online = _parse(texts[0], os.path.join(cpu_dir, "online"))
    offline = EMPTY if texts[1] is None else _parse(texts[1], os.path.join(cpu_dir, "offline"))
    isolated = EMPTY if texts[2] is None else _parse(texts[2], os.path.join(cpu_dir, "isolated"))
    key = None
    if cache is not None:
        key = _cache_key(sys_root, proc_root, texts, online)
        if key is not None:
            held = _held(cache, key)
            if held is not None:
                return held
            found = _load_cache(cache, key, online)
            if found is not None:
                return _hold(cache, key, Topology.build(found, online, offline, isolated))
    infos = _read_cpus(sys_root, online)
    if cache is not None and key is not None and save:
        _save_cache(cache, key, infos)
        return _hold(cache, key, Topology.build(infos, online, offline, isolated))
    return Topology.build(infos, online, offline, isolated)


#: the topology this process last read back from (or wrote to) a cache file: (the file, its
#: key, the file's inode, size and mtime, the topology).  A process that lives on (the
#: agent: each ``vmpin update`` checks its CPUs against the topology) took ~0.4 ms per read
#: to load and rebuild what it had read the time before (issue 28).
_last: tuple[str, list[object], tuple[int, int, int], Topology] | None = None


def _file_of(cache: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(cache, follow_symlinks=False)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def _held(cache: str, key: list[object]) -> Topology | None:
    """The topology :func:`_hold` kept, while it is what the cache file would give: its key
    holds (the host is as it was) and the file is the one it came from (a file replaced,
    by another vmpin or anyone, is read again: what it holds is checked there)."""
    last = _last
    if last is None or last[0] != cache or last[1] != key:
        return None
    return last[3] if _file_of(cache) == last[2] else None


def _hold(cache: str, key: list[object], topology: Topology) -> Topology:
    """Keep ``topology`` as the cache file holds it under ``key`` (when there is one)."""
    global _last
    found = _file_of(cache)
    _last = None if found is None else (cache, key, found, topology)
    return topology


def _parse(text: str, path: str) -> CpuSet:
    try:
        return CpuSet.parse(text)
    except CpuSetError as err:
        raise TopologyError(f"{path}: {err}") from err


def _cache_key(
    sys_root: str, proc_root: str, texts: list[str | None], online: CpuSet
) -> list[object] | None:
    """What the cached topology is valid for; None when it cannot be told (no cache then).

    The boot, the three CPU lists, and for each online CPU its ``topology`` directory's inode
    and mtime: sysfs creates that directory when the CPU comes online and removes it when it
    goes offline, with a new inode each time, so a CPU hot-unplugged and brought back (or
    replaced) between two reads is a new key even when the lists read the same.  Siblings,
    L3 groups and NUMA lists change only with the online list.  One ``stat`` per CPU, against
    ~9 files read.
    """
    try:
        boot = _read(os.path.join(proc_root, "sys/kernel/random/boot_id")) or ""
    except (TopologyError, UnicodeDecodeError):
        return None
    dirs = []
    cpu_dir = os.path.join(sys_root, "devices/system/cpu")
    for cpu in online:
        try:
            st = os.stat(os.path.join(cpu_dir, f"cpu{cpu}", "topology"))
        except OSError:
            return None  # the full read says what is missing
        dirs.append([st.st_ino, st.st_mtime_ns])
    return [os.path.abspath(sys_root), boot, *texts, dirs]


def _load_cache(path: str, key: list[object], online: CpuSet) -> list[CpuInfo] | None:
    """The cached CPUs when the file holds ``key``'s; None otherwise (missing, stale, or not a
    file this module wrote: it is then read from sysfs and written again)."""
    from vmpin.linux.files import load_json, read_bytes

    try:
        doc = load_json(read_bytes(path, limit=1 << 22), path)
        if not isinstance(doc, dict) or doc.get("v") != _CACHE_FORMAT or doc.get("key") != key:
            return None
        infos = []
        for row in doc["cpus"]:
            *numbers, siblings = row
            cpu, core, core_id, socket, die, numa, l3 = (int(v) for v in numbers)
            infos.append(
                CpuInfo(cpu, core, core_id, socket, die, numa, l3, CpuSet.parse(siblings))
            )
        return infos if CpuSet(i.cpu for i in infos) == online else None
    except Exception:  # a cache is never a reason to fail: sysfs is read instead
        return None


def _save_cache(path: str, key: list[object], infos: list[CpuInfo]) -> None:
    from vmpin.linux.files import save_cache
    from vmpin.wire.jsonio import dumps

    rows = [[i.cpu, i.core, i.core_id, i.socket, i.die, i.numa, i.l3, i.siblings.to_list()]
            for i in infos]  # fmt: skip
    save_cache(path, dumps({"v": _CACHE_FORMAT, "key": key, "cpus": rows}).encode())


def _read_cpus(sys_root: str, online: CpuSet) -> list[CpuInfo]:
    """Every online CPU's place, from sysfs (the full read)."""
    cpu_dir = os.path.join(sys_root, "devices/system/cpu")
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
    return infos


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
