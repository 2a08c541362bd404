"""Topology read from fixture sysfs trees (tests/make_sysfs.py) and from this machine's /sys."""

from __future__ import annotations

import filecmp
import json
import random
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import FIXTURES, ROOT, vmpin_cmd
from tests.support.make_sysfs import MACHINES, write_all
from vmpin.core.cpuset import CpuSet
from vmpin.core.errors import TopologyError
from vmpin.core.topology import CpuInfo, Topology
from vmpin.linux.sysfs import read_topology
from vmpin.wire import views

SYSFS = FIXTURES / "sysfs"


@dataclass(frozen=True)
class Expect:
    sockets: int
    numa_nodes: int
    cores: int
    threads_per_core: int
    l3_groups: int
    online: str
    offline: str = ""
    isolated: str = ""


EXPECTED = {
    "xeon-gold-6258r-2s": Expect(2, 2, 56, 2, 2, "0-111"),
    "amd-epyc-7313-2s": Expect(2, 2, 32, 2, 8, "0-63"),
    "no-smt-server": Expect(1, 2, 16, 1, 1, "0-15"),
    "offline-isolated": Expect(1, 1, 4, 2, 1, "0-5", offline="6-7", isolated="2-3"),
}


def load(name: str) -> Topology:
    return read_topology(str(SYSFS / name))


def test_every_machine_has_expectations() -> None:
    assert set(EXPECTED) == set(MACHINES)
    assert {p.name for p in SYSFS.iterdir()} == set(MACHINES)


def test_committed_trees_match_generator(tmp_path: Path) -> None:
    write_all(tmp_path)
    for name in MACHINES:
        committed, fresh = SYSFS / name, tmp_path / name
        mismatch = _tree_diff(committed, fresh)
        assert not mismatch, f"{name}: run `python -m tests.support.make_sysfs`: {mismatch[:5]}"


def _tree_diff(a: Path, b: Path) -> list[str]:
    cmp = filecmp.dircmp(a, b)
    out = [*cmp.left_only, *cmp.right_only, *cmp.funny_files]
    _, mismatch, errors = filecmp.cmpfiles(a, b, cmp.common_files, shallow=False)
    out += mismatch + errors
    for sub in cmp.common_dirs:
        out += [f"{sub}/{p}" for p in _tree_diff(a / sub, b / sub)]
    return out


# -- counts ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_counts(name: str) -> None:
    topo, want = load(name), EXPECTED[name]
    assert topo.sockets == want.sockets
    assert topo.numa_nodes == want.numa_nodes
    assert topo.cores == want.cores
    assert topo.threads_per_core == want.threads_per_core
    assert topo.l3_groups == want.l3_groups
    assert topo.online == CpuSet.parse(want.online)
    assert topo.offline == CpuSet.parse(want.offline)
    assert topo.isolated == CpuSet.parse(want.isolated)
    assert CpuSet(topo.cpus) == topo.online


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_core_keys(name: str) -> None:
    topo = load(name)
    infos = topo.cpus.values()
    # A core is keyed by its lowest thread; sysfs core_id is per package, so only
    # (socket, die, core_id) is unique, and it names the same cores as the key.
    by_key = {c.core for c in infos}
    by_sysfs = {(c.socket, c.die, c.core_id) for c in infos}
    assert len(by_key) == len(by_sysfs) == EXPECTED[name].cores
    for c in infos:
        assert c.core == c.siblings.first()
        assert c.cpu in c.siblings
        for sib in c.siblings:
            other = topo.info(sib)
            assert (other.core, other.socket, other.core_id) == (c.core, c.socket, c.core_id)


SIBLINGS = [
    ("xeon-gold-6258r-2s", 0, "0,56"),
    ("xeon-gold-6258r-2s", 56, "0,56"),
    ("xeon-gold-6258r-2s", 27, "27,83"),
    ("xeon-gold-6258r-2s", 28, "28,84"),
    ("xeon-gold-6258r-2s", 111, "55,111"),
    ("amd-epyc-7313-2s", 0, "0,32"),
    ("amd-epyc-7313-2s", 47, "15,47"),
    ("amd-epyc-7313-2s", 16, "16,48"),
    ("no-smt-server", 0, "0"),
    ("no-smt-server", 15, "15"),
    ("offline-isolated", 0, "0,4"),
    ("offline-isolated", 5, "1,5"),
    ("offline-isolated", 2, "2"),  # its sibling 6 is offline
    ("offline-isolated", 3, "3"),
]


@pytest.mark.parametrize(("name", "cpu", "siblings"), SIBLINGS)
def test_siblings(name: str, cpu: int, siblings: str) -> None:
    assert load(name).siblings(cpu) == CpuSet.parse(siblings)


PLACES = [
    # name, cpu, socket, numa, core_id, core key, l3 key
    ("xeon-gold-6258r-2s", 0, 0, 0, 0, 0, 0),
    ("xeon-gold-6258r-2s", 28, 1, 1, 0, 28, 28),  # core_id 0 again, in socket 1
    ("xeon-gold-6258r-2s", 56, 0, 0, 0, 0, 0),
    ("xeon-gold-6258r-2s", 7, 0, 0, 8, 7, 0),  # the gap: no core_id 7
    ("xeon-gold-6258r-2s", 55, 1, 1, 30, 55, 28),
    ("xeon-gold-6258r-2s", 84, 1, 1, 0, 28, 28),
    ("amd-epyc-7313-2s", 3, 0, 0, 3, 3, 0),
    ("amd-epyc-7313-2s", 4, 0, 0, 8, 4, 4),  # the next CCX
    ("amd-epyc-7313-2s", 35, 0, 0, 3, 3, 0),
    ("amd-epyc-7313-2s", 31, 1, 1, 27, 31, 28),
    ("amd-epyc-7313-2s", 63, 1, 1, 27, 31, 28),
    ("no-smt-server", 7, 0, 0, 11, 7, 0),
    ("no-smt-server", 8, 0, 1, 16, 8, 0),  # SNC: the L3 spans both nodes
    ("offline-isolated", 4, 0, 0, 0, 0, 0),
]


@pytest.mark.parametrize(("name", "cpu", "socket", "numa", "core_id", "core", "l3"), PLACES)
def test_places(
    name: str, cpu: int, socket: int, numa: int, core_id: int, core: int, l3: int
) -> None:
    info = load(name).info(cpu)
    assert (info.socket, info.numa, info.core_id, info.core, info.l3, info.die) == (
        socket,
        numa,
        core_id,
        core,
        l3,
        0,
    )


def test_offline_cpus_have_no_info() -> None:
    topo = load("offline-isolated")
    for cpu in (6, 7):
        with pytest.raises(TopologyError, match=f"CPU {cpu}"):
            topo.info(cpu)
    with pytest.raises(TopologyError, match="not online"):
        topo.check_online(CpuSet.parse("4-7"), "mask")
    topo.check_online(CpuSet.parse("0-5"), "mask")
    # Isolated CPUs are online and placeable; isolation is policy, not topology.
    assert topo.isolated <= topo.online


# -- topology order ----------------------------------------------------------------------------


def _runs(order: tuple[int, ...], key: Callable[[CpuInfo], object], topo: Topology) -> list[object]:
    """The key of each maximal run of equal keys along ``order``."""
    runs: list[object] = []
    for cpu in order:
        k = key(topo.info(cpu))
        if not runs or runs[-1] != k:
            runs.append(k)
    return runs


ORDER_KEYS: dict[str, Callable[[CpuInfo], object]] = {
    "core": lambda c: c.core,
    "l3": lambda c: c.l3,
    "numa": lambda c: c.numa,
    "socket": lambda c: c.socket,
    "socket+die": lambda c: (c.socket, c.die),
}


@pytest.mark.parametrize("group", sorted(ORDER_KEYS))
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_order_groups_are_contiguous(name: str, group: str) -> None:
    topo = load(name)
    runs = _runs(topo.order, ORDER_KEYS[group], topo)
    assert len(runs) == len(set(runs)), f"{group} groups split in {topo.order}"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_order_is_a_permutation_with_adjacent_siblings(name: str) -> None:
    topo = load(name)
    assert sorted(topo.order) == topo.online.sorted()
    pos = {cpu: i for i, cpu in enumerate(topo.order)}
    for info in topo.cpus.values():
        where = sorted(pos[s] for s in info.siblings)
        assert where == list(range(where[0], where[0] + len(where)))


@pytest.mark.parametrize("name", ["xeon-gold-6258r-2s", "amd-epyc-7313-2s"])
def test_order_pairs_are_cores(name: str) -> None:
    # Guest vCPU pairs (0,1), (2,3)... land on host cores when the order is followed.
    topo = load(name)
    for i in range(0, len(topo.order), 2):
        a, b = topo.order[i], topo.order[i + 1]
        assert topo.siblings(a) == CpuSet([a, b])


ORDER_PREFIXES = [
    ("xeon-gold-6258r-2s", (0, 56, 1, 57, 2, 58)),
    ("amd-epyc-7313-2s", (0, 32, 1, 33, 2, 34, 3, 35, 4, 36)),
    ("no-smt-server", (0, 1, 2, 3)),
    ("offline-isolated", (0, 4, 1, 5, 2, 3)),
]


@pytest.mark.parametrize(("name", "prefix"), ORDER_PREFIXES)
def test_order_prefix(name: str, prefix: tuple[int, ...]) -> None:
    assert load(name).order[: len(prefix)] == prefix


ORDERED_MASKS = [
    ("xeon-gold-6258r-2s", "28-29,84-85,0,56", [0, 56, 28, 84, 29, 85]),
    ("xeon-gold-6258r-2s", "100,44", [44, 100]),
    # whole cores CCX by CCX, then the lone threads 32 and 33 (siblings 0 and 1 not in the mask)
    ("amd-epyc-7313-2s", "4-5,32-33,36-37", [4, 36, 5, 37, 32, 33]),
    # kubelet reserved CPU 0: 56 is a lone thread and goes last
    ("xeon-gold-6258r-2s", "1,56,57", [1, 57, 56]),
    ("no-smt-server", "15,0,8", [0, 8, 15]),
    ("offline-isolated", "0-5", [0, 4, 1, 5, 2, 3]),
    ("offline-isolated", "1,4,5", [1, 5, 4]),  # the 4-core part, CPU 0 reserved
    ("offline-isolated", "", []),
]


@pytest.mark.parametrize(("name", "mask", "ordered"), ORDERED_MASKS)
def test_ordered(name: str, mask: str, ordered: list[int]) -> None:
    topo = load(name)
    got = topo.ordered(CpuSet.parse(mask))
    assert sorted(got) == sorted(ordered)
    assert got == ordered


def test_topology_view_shape() -> None:
    data = views.topology_of(load("xeon-gold-6258r-2s"))
    for key in ("online", "isolated", "sockets", "numa_nodes", "cores", "threads_per_core"):
        assert key in data
    assert data["online"] == "0-111"
    assert data["sockets"] == 2
    assert len(data["cpus"]) == 112
    cpu56 = data["cpus"][56]
    assert {"cpu", "core", "socket", "numa", "siblings"} <= set(cpu56)
    assert (cpu56["cpu"], cpu56["core"], cpu56["siblings"]) == (56, 0, "0,56")
    json.dumps(data)


# -- broken trees ----------------------------------------------------------------------------


def _copy(name: str, tmp_path: Path) -> Path:
    root = tmp_path / name
    shutil.copytree(SYSFS / name, root)
    return root


BROKEN = [
    ("missing online", "devices/system/cpu/online", None),
    ("bad online", "devices/system/cpu/online", "0-3-"),
    ("bad core_id", "devices/system/cpu/cpu1/topology/core_id", "one"),
    ("missing package", "devices/system/cpu/cpu1/topology/physical_package_id", None),
    ("bad siblings", "devices/system/cpu/cpu1/topology/thread_siblings_list", "5-1"),
    ("bad isolated", "devices/system/cpu/isolated", "x"),
]


@pytest.mark.parametrize(("what", "rel", "content"), BROKEN, ids=[b[0] for b in BROKEN])
def test_broken_tree(tmp_path: Path, what: str, rel: str, content: str | None) -> None:
    root = _copy("offline-isolated", tmp_path)
    path = root / rel
    if content is None:
        path.unlink()
    else:
        path.write_text(content + "\n")
    with pytest.raises(TopologyError, match=rel.split("/")[-1]):
        read_topology(str(root))


def test_online_cpu_without_topology(tmp_path: Path) -> None:
    root = _copy("offline-isolated", tmp_path)
    (root / "devices/system/cpu/online").write_text("0-6\n")
    with pytest.raises(TopologyError, match="cpu6"):
        read_topology(str(root))


def test_no_node_dir_is_node_0(tmp_path: Path) -> None:
    root = _copy("xeon-gold-6258r-2s", tmp_path)
    shutil.rmtree(root / "devices/system/node")
    topo = read_topology(str(root))
    assert topo.numa_nodes == 1
    assert {c.numa for c in topo.cpus.values()} == {0}


def test_no_l3_is_socket(tmp_path: Path) -> None:
    root = _copy("amd-epyc-7313-2s", tmp_path)
    for cache in (root / "devices/system/cpu").glob("cpu*/cache/index3"):
        shutil.rmtree(cache)
    topo = read_topology(str(root))
    assert topo.l3_groups == 2
    assert topo.info(47).l3 == 0
    assert topo.info(48).l3 == 16


def test_missing_die_id_is_die_0(tmp_path: Path) -> None:
    root = _copy("no-smt-server", tmp_path)
    for die in (root / "devices/system/cpu").glob("cpu*/topology/die_id"):
        die.unlink()
    assert {c.die for c in read_topology(str(root)).cpus.values()} == {0}


# -- this machine ------------------------------------------------------------------------------

SYS_CPU = Path("/sys/devices/system/cpu")
live = pytest.mark.skipif(not (SYS_CPU / "online").exists(), reason="no /sys on this host")


def _sys_list(path: Path) -> CpuSet:
    # Read independently of vmpin's parser: expand "a-b" pieces by hand.
    cpus: set[int] = set()
    for part in path.read_text().strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    return CpuSet(cpus)


@live
def test_this_machine() -> None:
    topo = read_topology("/sys")
    online = _sys_list(SYS_CPU / "online")
    assert topo.online == online
    if (SYS_CPU / "isolated").exists():
        assert topo.isolated == _sys_list(SYS_CPU / "isolated")
    for cpu in online:
        sysfs = SYS_CPU / f"cpu{cpu}" / "topology"
        info = topo.info(cpu)
        assert info.siblings == _sys_list(sysfs / "thread_siblings_list")
        assert info.socket == int((sysfs / "physical_package_id").read_text())
        assert info.core_id == int((sysfs / "core_id").read_text())
    assert sorted(topo.order) == online.sorted()
    assert topo.sockets == len({topo.info(c).socket for c in online})


def _cli_has_topology() -> bool:
    table = ROOT / "vmpin" / "service" / "clispec.py"
    return table.exists() and '"topology"' in table.read_text()


cli_topology = pytest.mark.skipif(
    not _cli_has_topology(), reason="the command line has no `topology` command yet"
)


def _run_topology(env: dict[str, str], sys_root: str) -> dict[str, object]:
    env = {**env, "VMPIN_SYSFS_ROOT": sys_root}
    proc = subprocess.run(
        [*vmpin_cmd(), "topology", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    data: dict[str, object] = json.loads(proc.stdout)
    for key in ("online", "isolated", "sockets", "numa_nodes", "cores", "threads_per_core"):
        assert key in data, key
    return data


@live
@cli_topology
def test_cli_topology_this_machine(env: dict[str, str]) -> None:
    data = _run_topology(env, "/sys")
    online = _sys_list(SYS_CPU / "online")
    assert CpuSet.parse(str(data["online"])) == online
    cpus = data["cpus"]
    assert isinstance(cpus, list)
    assert sorted(c["cpu"] for c in cpus) == online.sorted()
    for c in cpus:
        siblings = _sys_list(SYS_CPU / f"cpu{c['cpu']}" / "topology" / "thread_siblings_list")
        assert CpuSet.parse(c["siblings"]) == siblings
        socket = int((SYS_CPU / f"cpu{c['cpu']}" / "topology" / "physical_package_id").read_text())
        assert c["socket"] == socket


@cli_topology
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_cli_topology_fixture(env: dict[str, str], name: str) -> None:
    data = _run_topology(env, str(SYSFS / name))
    want = EXPECTED[name]
    assert (
        data["sockets"],
        data["numa_nodes"],
        data["cores"],
        data["threads_per_core"],
        data["online"],
        data["isolated"],
    ) == (
        want.sockets,
        want.numa_nodes,
        want.cores,
        want.threads_per_core,
        want.online,
        want.isolated,
    )
    expected = load(name)
    for c in data["cpus"]:  # type: ignore[attr-defined]
        info = expected.info(c["cpu"])
        assert (c["core"], c["socket"], c["numa"], c["siblings"]) == (
            info.core,
            info.socket,
            info.numa,
            info.siblings.to_list(),
        )


# -- guest vCPU index -> host CPU ---------------------------------------------------------------
# name, mask, pinned guest indices, expected map.  Guest pairs are (2k, 2k+1).
PLACEMENTS = [
    ("offline-isolated", "1,4,5", [0, 1, 2], {0: 1, 1: 5, 2: 4}),
    ("xeon-gold-6258r-2s", "1,56,57", [0, 1, 2], {0: 1, 1: 57, 2: 56}),
    # Kata: boot vCPU 0 floats; 1 pairs with it in the guest, so it takes the lone thread
    ("xeon-gold-6258r-2s", "1,56,57", [1, 2, 3], {2: 1, 3: 57, 1: 56}),
    # Kata, whole cores only: (2,3) on one core, 1 and 4 (guest-unpaired) share the other
    ("xeon-gold-6258r-2s", "8-9,64-65", [1, 2, 3, 4], {2: 8, 3: 64, 1: 9, 4: 65}),
    (
        "amd-epyc-7313-2s",
        "4-5,32-33,36-37",
        list(range(6)),
        {0: 4, 1: 36, 2: 5, 3: 37, 4: 32, 5: 33},
    ),
    ("no-smt-server", "15,0,8", [0, 1, 2], {0: 0, 1: 8, 2: 15}),
]


@pytest.mark.parametrize(("name", "mask", "indices", "want"), PLACEMENTS)
def test_place_vcpus(name: str, mask: str, indices: list[int], want: dict[int, int]) -> None:
    assert load(name).place_vcpus(indices, CpuSet.parse(mask)) == want


def _best_pairs(topo: Topology, mask: CpuSet, indices: list[int]) -> int:
    """How many guest pairs can sit on one host core at most."""
    given = set(indices)
    guest = sum(1 for i in given if i % 2 == 0 and i + 1 in given)
    cores: dict[int, int] = {}
    for cpu in mask:
        cores[topo.cpus[cpu].core] = cores.get(topo.cpus[cpu].core, 0) + 1
    return min(guest, sum(n // 2 for n in cores.values()))


@pytest.mark.parametrize("name", sorted(MACHINES))
@pytest.mark.parametrize("boot", [0, 1, 2])
def test_pairs_stay_on_cores_for_every_mask_shape(name: str, boot: int) -> None:
    topo = load(name)
    rng = random.Random(f"{name}-{boot}")
    online = topo.online.sorted()
    for _ in range(200):
        mask = CpuSet(rng.sample(online, rng.randint(1, min(len(online), 12))))
        indices = list(range(boot, boot + len(mask)))
        placed = topo.place_vcpus(indices, mask)
        assert sorted(placed) == indices
        assert CpuSet(placed.values()) == mask  # one CPU each, all of the mask
        on_core = sum(
            1
            for i in indices
            if i % 2 == 0
            and i + 1 in placed
            and topo.cpus[placed[i]].core == topo.cpus[placed[i + 1]].core
        )
        assert on_core == _best_pairs(topo, mask, indices), (mask, boot, placed)


def test_place_vcpus_refuses_a_count_mismatch() -> None:
    with pytest.raises(TopologyError):
        load("no-smt-server").place_vcpus([0, 1], CpuSet.parse("0-2"))


# -- the cache in the state dir (read_topology(cache=...)) -------------------------------------


def _core_id_file(root: Path, cpu: int) -> Path:
    return root / f"devices/system/cpu/cpu{cpu}/topology/core_id"


def test_cache_is_read_back_while_its_key_holds(tmp_path: Path) -> None:
    root = _copy("amd-epyc-7313-2s", tmp_path)
    cache = tmp_path / "state" / "topology.json"
    cache.parent.mkdir()
    first = read_topology(str(root), cache=str(cache))
    assert first == read_topology(str(root))
    assert json.loads(cache.read_text())["v"] == 1
    # A file changed in place behind the key's back is not seen: proof that it was not read.
    # (sysfs never does that: a CPU's topology changes only with a new topology dir.)
    _core_id_file(root, 5).write_text("99\n")
    assert read_topology(str(root), cache=str(cache)) == first
    assert read_topology(str(root)).cpus[5].core_id == 99


def test_a_cpu_back_online_is_read_again(tmp_path: Path) -> None:
    """Offline and online again between two reads: the lists read the same, but sysfs made
    the CPU a new topology dir (a new inode)."""
    root = _copy("amd-epyc-7313-2s", tmp_path)
    cache = str(tmp_path / "topology.json")
    read_topology(str(root), cache=cache)
    topo_dir = _core_id_file(root, 5).parent
    shutil.move(topo_dir, tmp_path / "aside")
    shutil.copytree(tmp_path / "aside", topo_dir)
    (topo_dir / "core_id").write_text("99\n")
    assert read_topology(str(root), cache=cache).cpus[5].core_id == 99


def test_another_online_list_is_read_again(tmp_path: Path) -> None:
    root = _copy("offline-isolated", tmp_path)
    cache = str(tmp_path / "topology.json")
    before = read_topology(str(root), cache=cache)
    online = root / "devices/system/cpu/online"
    shutil.rmtree(root / "devices/system/cpu/cpu5/topology")
    online.write_text(str(before.online - CpuSet([5])) + "\n")
    after = read_topology(str(root), cache=cache)
    assert 5 not in after.cpus and after.online == before.online - CpuSet([5])


def test_another_boot_is_read_again(tmp_path: Path) -> None:
    root = _copy("amd-epyc-7313-2s", tmp_path)
    proc = tmp_path / "proc"
    boot_id = proc / "sys/kernel/random/boot_id"
    boot_id.parent.mkdir(parents=True)
    boot_id.write_text("11111111-1111-1111-1111-111111111111\n")
    cache = str(tmp_path / "topology.json")
    read_topology(str(root), cache=cache, proc_root=str(proc))
    _core_id_file(root, 5).write_text("99\n")
    assert read_topology(str(root), cache=cache, proc_root=str(proc)).cpus[5].core_id != 99
    boot_id.write_text("22222222-2222-2222-2222-222222222222\n")
    assert read_topology(str(root), cache=cache, proc_root=str(proc)).cpus[5].core_id == 99


def test_a_process_keeps_what_it_read_while_the_key_and_the_file_hold(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent checks each ``vmpin update``'s CPUs against the topology: the cache file is
    not loaded again while its key holds and it is the file last read (issue 28)."""
    from vmpin.linux import sysfs

    root = _copy("amd-epyc-7313-2s", tmp_path)
    cache = tmp_path / "topology.json"
    first = read_topology(str(root), cache=str(cache))  # (read from sysfs, written)
    loads: list[str] = []
    real = sysfs._load_cache

    def counted(path: str, key: list[object], online: CpuSet) -> list[CpuInfo] | None:
        loads.append(path)
        return real(path, key, online)

    monkeypatch.setattr(sysfs, "_load_cache", counted)
    assert read_topology(str(root), cache=str(cache)) is first
    assert loads == []
    # the file replaced (by another vmpin, or anyone): read again, and kept from then on
    (tmp_path / "new.json").write_text(cache.read_text())
    (tmp_path / "new.json").replace(cache)
    again = read_topology(str(root), cache=str(cache))
    assert again == first and loads == [str(cache)]
    assert read_topology(str(root), cache=str(cache)) is again and len(loads) == 1
    # another key (a CPU back online under a new topology dir): sysfs read again
    topo_dir = _core_id_file(root, 5).parent
    shutil.move(topo_dir, tmp_path / "aside")
    shutil.copytree(tmp_path / "aside", topo_dir)
    (topo_dir / "core_id").write_text("99\n")
    assert read_topology(str(root), cache=str(cache)).cpus[5].core_id == 99


@pytest.mark.parametrize(
    "garbage",
    [
        b"",
        b"{not json",
        b'{"v": 2}',
        b"[1, 2]",
        # the right key, but rows cut short, of the wrong type, or some CPUs missing
        None,
        "short",
        "types",
        "subset",
    ],
)
def test_a_bad_cache_is_replaced_by_sysfs(tmp_path: Path, garbage: bytes | str | None) -> None:
    root = _copy("amd-epyc-7313-2s", tmp_path)
    cache = tmp_path / "topology.json"
    truth = read_topology(str(root), cache=str(cache))
    good = cache.read_text()
    doc = json.loads(good)
    if isinstance(garbage, bytes):
        cache.write_bytes(garbage)
    elif garbage == "short":
        doc["cpus"][3] = doc["cpus"][3][:5]
        cache.write_text(json.dumps(doc))
    elif garbage == "types":
        doc["cpus"][3][2] = "three"
        cache.write_text(json.dumps(doc))
    elif garbage == "subset":
        doc["cpus"] = doc["cpus"][1:]
        cache.write_text(json.dumps(doc))
    else:
        cache.unlink()
    assert read_topology(str(root), cache=str(cache)) == truth
    assert cache.read_text() == good  # (written again)


def test_cache_not_written_when_told_or_when_it_cannot_be(tmp_path: Path) -> None:
    root = _copy("amd-epyc-7313-2s", tmp_path)
    cache = tmp_path / "topology.json"
    truth = read_topology(str(root))
    assert read_topology(str(root), cache=str(cache), save=False) == truth
    assert not cache.exists()
    # a state dir that does not exist (or is read-only): sysfs is read, nothing fails
    missing = tmp_path / "no-such-dir" / "topology.json"
    assert read_topology(str(root), cache=str(missing)) == truth
    assert list(tmp_path.iterdir()) == [root]


def test_cache_on_this_machine(tmp_path: Path) -> None:
    cache = str(tmp_path / "topology.json")
    fresh = read_topology("/sys")
    assert read_topology("/sys", cache=cache) == fresh  # (written)
    assert read_topology("/sys", cache=cache) == fresh  # (read back)
    key = json.loads(Path(cache).read_text())["key"]
    assert key[0] == "/sys" and len(key[-1]) == len(fresh.online)


def test_a_pass_keeps_the_cache_in_the_state_dir_and_a_view_only_reads_it(tmp_path: Path) -> None:
    from vmpin.linux.paths import HostPaths
    from vmpin.reconcile.reconciler import Reconciler
    from vmpin.state.store import Store

    root = _copy("amd-epyc-7313-2s", tmp_path)
    paths = HostPaths(state_dir=str(tmp_path / "state"), sys=str(root))
    Store(paths.state_dir).close()  # (a state dir, as a writer leaves it)
    view = Store.open_readonly(paths.state_dir)
    try:
        assert Reconciler(paths, view).topology == read_topology(str(root))
        assert not Path(paths.topology_cache).exists()  # a read-only view writes nothing
    finally:
        view.close()
    with Store(paths.state_dir) as store:
        assert Reconciler(paths, store).topology == read_topology(str(root))
    assert json.loads(Path(paths.topology_cache).read_text())["key"][0] == str(root)
