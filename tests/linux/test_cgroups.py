"""vmpin.linux.cgroups: fixture trees for every layout, and the real cgroup v1 cpuset hierarchy.

The real tests make their own cgroups under ``/sys/fs/cgroup/cpuset/vmpin-test-<random>``
and their own ``sleep`` processes, and remove both afterwards.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.session import new_id
from vmpin.core.cpuset import CpuSet
from vmpin.core.errors import AffinityRejected, IdError, ProcessGone
from vmpin.linux import procfs
from vmpin.linux.cgroups import (
    CgroupRef,
    candidate_paths,
    cgroup_of_pid,
    find_container_cgroup,
    parent,
    procs,
    read_cpus,
    read_effective,
    ref_from_rel,
    tasks,
    v2_root,
    write_cpus,
)
from vmpin.linux.paths import HostPaths

CID = "3f1e2d4c5b6a79880a1b2c3d4e5f60718293a4b5c6d7e8f9a0b1c2d3e4f5a6b7"
UID = "6b2f1a4e-7c1d-4c55-9a57-2f0a5c1e9d10"
UID_ = UID.replace("-", "_")
BURSTABLE_SLICE = f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice"


# -- fixture trees --------------------------------------------------------------------------
class Tree:
    """A fake host: ``proc/`` and ``cgroup/`` under tmp_path, built by the test."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.paths = HostPaths(proc=str(root / "proc"), cgroup=str(root / "cgroup"))

    def v1(self, rel: str, cpus: str = "0-3", effective: str | None = None) -> Path:
        d = self.root / "cgroup" / "cpuset" / rel.strip("/")
        d.mkdir(parents=True, exist_ok=True)
        (d / "cpuset.cpus").write_text(cpus + "\n")
        (d / "cpuset.effective_cpus").write_text((effective or cpus) + "\n")
        (d / "tasks").write_text("")
        (d / "cgroup.procs").write_text("")
        return d

    def v2(self, rel: str, cpus: str = "0-3", controllers: str = "cpuset cpu memory") -> Path:
        d = self.root / "cgroup" / rel.strip("/")
        d.mkdir(parents=True, exist_ok=True)
        (d / "cgroup.controllers").write_text(controllers + "\n")
        if "cpuset" in controllers.split():
            (d / "cpuset.cpus").write_text(cpus + "\n")
            (d / "cpuset.cpus.effective").write_text(cpus + "\n")
        (d / "cgroup.threads").write_text("")
        (d / "cgroup.procs").write_text("")
        return d

    def pure_v2(self) -> None:
        self.v2("/", controllers="cpuset cpu io memory pids")

    def hybrid(self, unified_controllers: str = "") -> None:
        d = self.root / "cgroup" / "unified"
        d.mkdir(parents=True, exist_ok=True)
        (d / "cgroup.controllers").write_text(unified_controllers + "\n")

    def proc(self, pid: int, *lines: str) -> None:
        d = self.root / "proc" / str(pid)
        d.mkdir(parents=True, exist_ok=True)
        (d / "cgroup").write_text("".join(line + "\n" for line in lines))


@pytest.fixture
def tree(tmp_path: Path) -> Tree:
    return Tree(tmp_path)


def test_v1_cpuset_line(tree: Tree) -> None:
    tree.hybrid()
    d = tree.v1("/kubepods/burstable/pod1/abc")
    tree.proc(
        10,
        "9:name=systemd:/kubepods/burstable/pod1/abc",
        "3:cpuset:/kubepods/burstable/pod1/abc",
        "1:cpu,cpuacct:/kubepods/burstable/pod1/abc",
        "0::/kubepods/burstable/pod1/abc",
    )
    ref = cgroup_of_pid(tree.paths, 10)
    assert ref == CgroupRef(1, str(d), "/kubepods/burstable/pod1/abc")


def test_v1_comounted_cpuset(tree: Tree) -> None:
    d = tree.root / "cgroup" / "cpu,cpuset" / "x"
    d.mkdir(parents=True)
    (d / "cpuset.cpus").write_text("1\n")
    tree.proc(11, "2:cpu,cpuset:/x")
    assert cgroup_of_pid(tree.paths, 11) == CgroupRef(1, str(d), "/x")


def test_pure_v2_with_cpuset(tree: Tree) -> None:
    tree.pure_v2()
    d = tree.v2("/kubepods.slice/kubepods-pod1.slice/cri-containerd-abc.scope", cpus="2-3")
    tree.proc(12, "0::/kubepods.slice/kubepods-pod1.slice/cri-containerd-abc.scope")
    ref = cgroup_of_pid(tree.paths, 12)
    assert ref is not None
    assert (ref.version, ref.path) == (2, str(d))
    assert read_cpus(ref) == CpuSet.parse("2-3")
    assert read_effective(ref) == CpuSet.parse("2-3")


def test_v2_without_cpuset_controller_is_none(tree: Tree) -> None:
    tree.pure_v2()
    tree.v2("/system.slice/foo.service", controllers="cpu memory")
    tree.proc(13, "0::/system.slice/foo.service")
    assert cgroup_of_pid(tree.paths, 13) is None


def test_hybrid_unified_without_cpuset_is_none(tree: Tree) -> None:
    # This machine's layout: v1 everything, v2 mounted at unified with no controllers.
    tree.hybrid()
    (tree.root / "cgroup" / "unified" / "x").mkdir()
    tree.proc(14, "1:cpu:/x", "0::/x")
    assert v2_root(tree.paths) == str(tree.root / "cgroup" / "unified")
    assert cgroup_of_pid(tree.paths, 14) is None


def test_v1_wins_over_v2(tree: Tree) -> None:
    tree.hybrid("cpuset")
    d = tree.v1("/a")
    tree.proc(15, "0::/a", "3:cpuset:/a")
    ref = cgroup_of_pid(tree.paths, 15)
    assert ref is not None and ref.version == 1 and ref.path == str(d)


def test_deleted_cgroup_is_none(tree: Tree) -> None:
    tree.pure_v2()
    tree.proc(16, "0::/gone (deleted)")
    assert cgroup_of_pid(tree.paths, 16) is None


def test_root_cgroup_rel(tree: Tree) -> None:
    d = tree.v1("/")
    tree.proc(17, "3:cpuset:/")
    assert cgroup_of_pid(tree.paths, 17) == CgroupRef(1, str(d), "/")


def test_missing_pid_raises_process_gone(tree: Tree) -> None:
    (tree.root / "proc").mkdir()
    with pytest.raises(ProcessGone):
        cgroup_of_pid(tree.paths, 99)


# -- layouts --------------------------------------------------------------------------------
V1_LAYOUTS = [
    f"/{CID}",
    f"/docker/{CID}",
    f"/kubepods/pod{UID}/{CID}",
    f"/kubepods/burstable/pod{UID}/{CID}",
    f"/kubepods/besteffort/pod{UID}/{CID}",
    f"/kubepods/burstable/pod{UID}/crio-{CID}",
    f"/kubepods.slice/kubepods-pod{UID_}.slice/cri-containerd-{CID}.scope",
    f"{BURSTABLE_SLICE}/crio-{CID}.scope",
    f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice/docker-{CID}.scope",
]


@pytest.mark.parametrize("rel", V1_LAYOUTS)
@pytest.mark.parametrize("uid", [UID, None])
def test_layouts_v1(tree: Tree, rel: str, uid: str | None) -> None:
    d = tree.v1(rel)
    assert find_container_cgroup(tree.paths, CID, pod_uid=uid) == CgroupRef(1, str(d), rel)


@pytest.mark.parametrize("rel", V1_LAYOUTS)
def test_layouts_pure_v2(tree: Tree, rel: str) -> None:
    tree.pure_v2()
    d = tree.v2(rel)
    ref = find_container_cgroup(tree.paths, CID, pod_uid=UID)
    assert ref == CgroupRef(2, str(d), rel)


def test_layout_hybrid_v2_with_cpuset(tree: Tree) -> None:
    tree.hybrid("cpuset cpu")
    rel = f"{BURSTABLE_SLICE}/cri-containerd-{CID}.scope"
    d = tree.root / "cgroup" / "unified" / rel.strip("/")
    d.mkdir(parents=True)
    (d / "cgroup.controllers").write_text("cpuset cpu\n")
    (d / "cpuset.cpus").write_text("1\n")
    assert find_container_cgroup(tree.paths, CID, UID) == CgroupRef(2, str(d), rel)


def test_layout_other_pod_is_not_found(tree: Tree) -> None:
    tree.v1(f"/kubepods/burstable/pod{UID}/{CID}")
    other = "11111111-2222-3333-4444-555555555555"
    assert find_container_cgroup(tree.paths, CID, pod_uid=other) is None
    assert find_container_cgroup(tree.paths, "another-container") is None


def test_layout_v2_dir_without_cpuset_is_skipped(tree: Tree) -> None:
    tree.pure_v2()
    tree.v2(
        f"/kubepods.slice/kubepods-pod{UID_}.slice/cri-containerd-{CID}.scope", controllers="cpu"
    )
    assert find_container_cgroup(tree.paths, CID, UID) is None


def test_pid_wins_over_layouts(tree: Tree) -> None:
    tree.v1(f"/{CID}")
    d = tree.v1(f"/kubepods/pod{UID}/{CID}")
    tree.proc(20, f"3:cpuset:/kubepods/pod{UID}/{CID}")
    ref = find_container_cgroup(tree.paths, CID, pid=20)
    assert ref is not None and ref.path == str(d)


def test_pid_in_root_or_gone_falls_back_to_layouts(tree: Tree) -> None:
    tree.v1("/")
    d = tree.v1(f"/kubepods/pod{UID}/{CID}")
    tree.proc(21, "3:cpuset:/")
    assert find_container_cgroup(tree.paths, CID, UID, pid=21) == CgroupRef(
        1, str(d), f"/kubepods/pod{UID}/{CID}"
    )
    assert find_container_cgroup(tree.paths, CID, UID, pid=424242) is not None


@pytest.mark.parametrize("bad", ["../etc", "a/b", "", ".hidden"])
def test_ids_cannot_escape(tree: Tree, bad: str) -> None:
    with pytest.raises(IdError):
        find_container_cgroup(tree.paths, bad)
    with pytest.raises(IdError):
        candidate_paths(CID, pod_uid=bad)


def test_v2_tasks_and_procs(tree: Tree) -> None:
    tree.pure_v2()
    d = tree.v2("/a")
    (d / "cgroup.threads").write_text("30\n31\n7\n")
    (d / "cgroup.procs").write_text("30\n7\n")
    ref = CgroupRef(2, str(d), "/a")
    assert tasks(ref) == [7, 30, 31]
    assert procs(ref) == [7, 30]


def test_parent() -> None:
    ref = CgroupRef(1, "/c/cpuset/a/b", "/a/b")
    assert parent(ref) == CgroupRef(1, "/c/cpuset/a", "/a")
    up = parent(ref)
    assert up is not None and parent(up) == CgroupRef(1, "/c/cpuset", "/")
    assert parent(CgroupRef(1, "/c/cpuset", "/")) is None


def test_gone_cgroup_is_process_gone(tree: Tree) -> None:
    ref = CgroupRef(1, str(tree.root / "nope"), "/nope")
    with pytest.raises(ProcessGone, match="nope"):
        read_cpus(ref)
    with pytest.raises(ProcessGone, match="nope"):
        tasks(ref)


# -- the real cgroup v1 cpuset hierarchy ----------------------------------------------------
HOST = HostPaths()
CPUSET = Path(HOST.cgroup) / "cpuset"


#: root and a writable v1 cpuset hierarchy (tests/support/capabilities.py probes it).
real_v1 = pytest.mark.cgroup_v1


class RealCgroups:
    """Makes cgroups under one ``vmpin-test-<random>`` dir and processes to put in them."""

    def __init__(self) -> None:
        self.top = CPUSET / new_id()
        self.dirs: list[Path] = []
        self.children: list[subprocess.Popen[bytes]] = []
        self.cpus = CpuSet.parse((CPUSET / "cpuset.effective_cpus").read_text())
        self.mems = (CPUSET / "cpuset.effective_mems").read_text().strip()

    def make(self, rel: str = "", cpus: CpuSet | None = None) -> CgroupRef:
        d = self.top / rel if rel else self.top
        d.mkdir()
        self.dirs.append(d)
        # v1 cpusets start empty; both files must be set before a task may join.
        (d / "cpuset.mems").write_text(self.mems)
        (d / "cpuset.cpus").write_text((cpus or self.cpus).to_list())
        return CgroupRef(1, str(d), "/" + str(d.relative_to(CPUSET)))

    def spawn(self) -> int:
        child = subprocess.Popen(["sleep", "300"])
        self.children.append(child)
        return child.pid

    def join(self, ref: CgroupRef, pid: int) -> None:
        Path(ref.path, "cgroup.procs").write_text(str(pid))

    def cleanup(self) -> None:
        for child in self.children:  # only the processes this test started
            child.kill()
            child.wait()
        for d in reversed(self.dirs):
            with contextlib.suppress(FileNotFoundError):
                d.rmdir()


@pytest.fixture
def real() -> Iterator[RealCgroups]:
    r = RealCgroups()
    try:
        yield r
    finally:
        r.cleanup()
    assert not r.top.exists()


def _last_cpu(r: RealCgroups) -> CpuSet:
    assert len(r.cpus) >= 2, f"a multi_cpu test, yet the cpuset root has only {r.cpus}"
    return CpuSet([r.cpus.sorted()[-1]])


@real_v1
def test_real_write_read(real: RealCgroups) -> None:
    ref = real.make()
    assert read_cpus(ref) == real.cpus
    one = CpuSet([real.cpus.first()])
    write_cpus(ref, one)
    assert read_cpus(ref) == one
    assert read_effective(ref) == one


@real_v1
@pytest.mark.multi_cpu
def test_real_task_follows_cgroup(real: RealCgroups) -> None:
    last = _last_cpu(real)
    ref = real.make()
    pid = real.spawn()
    real.join(ref, pid)
    assert procs(ref) == [pid]
    assert pid in tasks(ref)
    write_cpus(ref, last)
    assert procfs.cpus_allowed(HOST.proc, pid) == last
    write_cpus(ref, real.cpus)
    assert procfs.cpus_allowed(HOST.proc, pid) == real.cpus
    # found by pid, through the real /proc and /sys/fs/cgroup
    assert cgroup_of_pid(HOST, pid) == ref
    assert find_container_cgroup(HOST, "not-a-layout-name", pid=pid) == ref


@real_v1
def test_real_thread_ids(real: RealCgroups) -> None:
    ref = real.make()
    pid = real.spawn()
    real.join(ref, pid)
    assert tasks(ref) == procfs.tids(HOST.proc, pid)


@real_v1
@pytest.mark.multi_cpu
def test_real_child_cannot_outgrow_parent(real: RealCgroups) -> None:
    last = _last_cpu(real)
    top = real.make(cpus=last)
    child = real.make("c", cpus=last)
    assert parent(child) == top
    with pytest.raises(AffinityRejected) as info:
        write_cpus(child, real.cpus)
    msg = str(info.value)
    assert child.path in msg and top.path in msg and "widen the parent" in msg
    assert read_cpus(child) == last  # unchanged
    # widening the parent first makes it work
    write_cpus(top, real.cpus)
    write_cpus(child, real.cpus)
    assert read_cpus(child) == real.cpus


@real_v1
@pytest.mark.multi_cpu
def test_real_parent_cannot_drop_childs_cpu(real: RealCgroups) -> None:
    last = _last_cpu(real)
    top = real.make()
    real.make("c", cpus=last)
    with pytest.raises(AffinityRejected, match="EBUSY"):
        write_cpus(top, real.cpus - last)


@real_v1
def test_real_nonexistent_cpu(real: RealCgroups) -> None:
    ref = real.make()
    with pytest.raises(AffinityRejected, match="offline or nonexistent"):
        write_cpus(ref, CpuSet([4000]))


@real_v1
def test_real_empty_with_tasks(real: RealCgroups) -> None:
    ref = real.make()
    real.join(ref, real.spawn())
    with pytest.raises(AffinityRejected, match="tasks are attached"):
        write_cpus(ref, CpuSet())


@real_v1
def test_real_removed_cgroup(real: RealCgroups) -> None:
    ref = real.make()
    Path(ref.path).rmdir()
    with pytest.raises(ProcessGone, match=ref.path):
        write_cpus(ref, real.cpus)


def test_ref_from_rel(tree: Tree) -> None:
    tree.pure_v2()
    d1 = tree.root / "cgroup" / "cpuset" / "a"
    d1.mkdir(parents=True)
    (d1 / "cpuset.cpus").write_text("0\n")
    d2 = tree.v2("/b")
    assert ref_from_rel(tree.paths, "/a") == CgroupRef(1, str(d1), "/a")
    assert ref_from_rel(tree.paths, "/b") == CgroupRef(2, str(d2), "/b")
    assert ref_from_rel(tree.paths, "/c") is None


def test_glob_star_is_glob_for_every_candidate_layout(tmp_path: Path) -> None:
    """The hand-written stand-in for glob (kept off the hook's path) finds what glob finds."""
    import glob

    from vmpin.linux.cgroups import _glob_star

    root = str(tmp_path / "cpuset[x]")  # magic characters in the root are literal
    for rel in candidate_paths(CID):
        if "*" not in rel:
            continue
        for uid in ("aaaa-1", "bbbb_2", ""):
            real = os.path.join(root + rel.replace("*", uid))
            os.makedirs(real, exist_ok=True)
        hidden = root + rel.replace("*", "x").replace("/pod", "/.pod").replace("-pod", "-.pod")
        os.makedirs(hidden, exist_ok=True)
    os.makedirs(root + "/kubepods/podzz", exist_ok=True)  # no container inside: no match
    for rel in candidate_paths(CID):
        if "*" in rel:
            want = sorted(glob.glob(glob.escape(root) + rel))
            assert _glob_star(root, rel) == want and want, rel
    assert _glob_star(str(tmp_path / "none"), candidate_paths(CID)[2]) == []


# -- vmpin's writers of one cgroup file take turns (flock) ---------------------------------
def _plain_cgroup(tmp_path: Path, text: str) -> CgroupRef:
    d = tmp_path / "ctr"
    d.mkdir()
    (d / "cpuset.cpus").write_text(text)
    return CgroupRef(1, str(d), "/ctr")


def test_write_waits_its_turn_and_never_interleaves(tmp_path: Path) -> None:
    """A longer list written while another writer holds the file, then a shorter one: a plain
    file (a node's fixture) ends with the last write whole, never "0\\n91" (CI once read that
    when two passes past their budget wrote one container at once)."""
    import fcntl
    import threading
    import time

    ref = _plain_cgroup(tmp_path, "0-111\n")
    holder = os.open(ref.file("cpuset.cpus"), os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_EX)
    done = threading.Event()

    def write() -> None:
        write_cpus(ref, CpuSet.parse("0"))
        done.set()

    t = threading.Thread(target=write)
    t.start()
    time.sleep(0.03)
    assert not done.is_set(), "the write did not wait for the other writer's turn"
    # the other writer's write, in its turn: longer than the waiting one's
    with open(ref.file("cpuset.cpus"), "r+") as f:
        f.truncate(0)
        f.write("0-91\n")
    fcntl.flock(holder, fcntl.LOCK_UN)
    os.close(holder)
    t.join(5)
    assert done.is_set()
    assert Path(ref.file("cpuset.cpus")).read_text() == "0\n"


def test_a_turn_held_forever_delays_a_write_only_briefly(tmp_path: Path) -> None:
    """Anyone who may read a cgroup file may flock it: a write waits TURN_WAIT at most."""
    import fcntl
    import time

    from vmpin.linux import cgroups

    ref = _plain_cgroup(tmp_path, "0-3\n")
    holder = os.open(ref.file("cpuset.cpus"), os.O_RDONLY)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)
        t0 = time.monotonic()
        write_cpus(ref, CpuSet.parse("2"))
        took = time.monotonic() - t0
    finally:
        os.close(holder)
    assert Path(ref.file("cpuset.cpus")).read_text() == "2\n"
    assert cgroups.TURN_WAIT <= took < cgroups.TURN_WAIT + 1.0


@real_v1
def test_real_write_takes_a_turn(real: RealCgroups) -> None:
    """flock(2) and the truncation work on the kernel's cgroup files: a write waits while
    another holds the file (a reader's lock is enough to hold it), then lands."""
    import fcntl
    import time

    ref = real.make()
    one = CpuSet([real.cpus.first()])
    holder = os.open(ref.file("cpuset.cpus"), os.O_RDONLY)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)
        t0 = time.monotonic()
        write_cpus(ref, one)
        assert time.monotonic() - t0 >= 0.09
    finally:
        os.close(holder)
    t0 = time.monotonic()
    write_cpus(ref, real.cpus)
    assert time.monotonic() - t0 < 0.09
    assert read_cpus(ref) == real.cpus
