"""What runc believes vs what the cgroup says, on real runc containers (no vmpin hooks yet).

Also pins down the runc facts vmpin's hook and the test helper rely on (tests/runc_util.py):
where a cgroupsPath-less container's cgroup lands, which stages run where, what each sees.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import runc_util
from tests.support.runc_util import HOST_STAGES, RuncSession, new_id, own_cpuset_cgroup
from vmpin.core.cpuset import CpuSet
from vmpin.core.errors import RuntimeKindError
from vmpin.linux import procfs
from vmpin.linux.cgroups import find_container_cgroup, read_cpus, tasks, write_cpus
from vmpin.linux.paths import HostPaths
from vmpin.runtimes.runcstate import runc_cgroup_paths, runc_cpus, runc_init_pid, state_path
from vmpin.wire.hookevent import STAGES

needs_runc = pytest.mark.runc


@pytest.fixture
def runc(
    paths: HostPaths, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RuncSession]:
    rootfs = runc_util.shared_rootfs(tmp_path_factory.getbasetemp())
    with RuncSession(paths, tmp_path, rootfs) as session:
        yield session


def host_cpus() -> CpuSet:
    return CpuSet.parse(Path("/sys/fs/cgroup/cpuset/cpuset.effective_cpus").read_text())


# -- state.json without runc ----------------------------------------------------------------
@pytest.fixture
def paths16(paths: HostPaths, tmp_path: Path) -> HostPaths:
    """``paths`` on a 16-CPU machine (nr_cpu_ids from a fixture sysfs), runc state only."""
    possible = tmp_path / "sys16" / "devices" / "system" / "cpu" / "possible"
    possible.parent.mkdir(parents=True)
    possible.write_text("0-15\n")
    return paths._replace(sys=str(tmp_path / "sys16"))


def write_state(paths: HostPaths, cid: str, state: object) -> None:
    path = Path(state_path(paths, cid))
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(state))


def test_no_state_is_none(paths: HostPaths) -> None:
    assert runc_cpus(paths, "nothere") is None
    assert runc_init_pid(paths, "nothere") is None
    assert runc_cgroup_paths(paths, "nothere") == {}


def test_inline_and_nested_resources(paths16: HostPaths) -> None:
    paths = paths16
    write_state(paths, "a", {"config": {"cgroups": {"cpuset_cpus": "2-3"}}})
    write_state(paths, "b", {"config": {"cgroups": {"resources": {"cpuset_cpus": "4"}}}})
    write_state(paths, "c", {"config": {"cgroups": {}}})
    assert runc_cpus(paths, "a") == "2-3"
    assert runc_cpus(paths, "b") == "4"
    assert runc_cpus(paths, "c") == ""


@pytest.mark.parametrize("raw", ["{", "[]", '{"config": {"cgroups": {"cpuset_cpus": 3}}}'])
def test_malformed_state(paths: HostPaths, raw: str) -> None:
    path = Path(state_path(paths, "x"))
    path.parent.mkdir(parents=True)
    path.write_text(raw)
    with pytest.raises(RuntimeKindError, match=str(path)):
        runc_cpus(paths, "x")


def test_init_pid_checks_start_time(paths: HostPaths) -> None:
    me = os.getpid()
    start = procfs.start_time(paths.proc, me)
    write_state(paths, "alive", {"init_process_pid": me, "init_process_start": start})
    write_state(paths, "reused", {"init_process_pid": me, "init_process_start": start + 1})
    write_state(paths, "gone", {"init_process_pid": 2**22 + 1, "init_process_start": 1})
    assert runc_init_pid(paths, "alive") == me
    assert runc_init_pid(paths, "reused") is None
    assert runc_init_pid(paths, "gone") is None


# -- real containers ------------------------------------------------------------------------
@pytest.mark.runc
@pytest.mark.cgroup_v1
@pytest.mark.multi_cpu
def test_update_is_seen_in_state_and_cgroup(runc: RuncSession, paths: HostPaths) -> None:
    cpus = host_cpus()
    assert len(cpus) >= 2, f"a multi_cpu test, yet the cpuset root has only {cpus}"
    last = CpuSet([cpus.sorted()[-1]])
    first = CpuSet([cpus.first()])
    cid = new_id()
    pid = runc.run(cid, cpus=cpus.to_list(), hooks=None)
    host = paths  # the real /proc and /sys/fs/cgroup, a private runc root

    # where runc put it: <runc's own cpuset cgroup>/<id>; /sys/fs/cgroup/cpuset/<id> here
    expected_rel = os.path.join(own_cpuset_cgroup(), cid)
    ref = find_container_cgroup(host, cid, pid=pid)
    assert ref is not None and ref.version == 1
    assert ref.rel == expected_rel
    assert ref.path == os.path.join(host.cgroup, "cpuset", expected_rel.lstrip("/"))
    if own_cpuset_cgroup() == "/":
        assert ref.path == f"/sys/fs/cgroup/cpuset/{cid}"
        assert find_container_cgroup(host, cid) == ref  # the /<id> layout, no pid needed
    assert runc_cgroup_paths(paths, cid)["cpuset"] == ref.path
    assert runc_init_pid(paths, cid) == pid
    assert pid in tasks(ref)

    # as created
    assert runc_cpus(paths, cid) == cpus.to_list()
    assert read_cpus(ref) == cpus

    # a legitimate update: runc's state and the cgroup change together
    runc.update(cid, last.to_list())
    assert runc_cpus(paths, cid) == last.to_list()
    assert read_cpus(ref) == last
    assert procfs.cpus_allowed(paths.proc, pid) == last
    # runc 1.1 quirk: update without --cpuset-mems blanks cpuset_mems in its state only
    state = json.loads(Path(state_path(paths, cid)).read_text())
    assert state["config"]["cgroups"]["cpuset_mems"] == ""
    assert Path(ref.path, "cpuset.mems").read_text().strip() == "0"

    # drift: the cgroup changes behind runc's back, runc's state does not
    write_cpus(ref, first)
    assert runc_cpus(paths, cid) == last.to_list()
    assert read_cpus(ref) == first

    runc.delete(cid)
    assert runc_cpus(paths, cid) is None
    assert runc_init_pid(paths, cid) is None
    assert not Path(ref.path).exists()


@pytest.mark.runc
@pytest.mark.multi_cpu  # the init inherits runc's affinity: {0} here unless widened
def test_no_cpuset_reads_the_inherited_cgroup(runc: RuncSession, paths: HostPaths) -> None:
    cid = new_id()
    pid = runc.run(cid, hooks=runc_util.true_argv)
    assert runc.state(cid)["status"] == "running"
    state = json.loads(Path(state_path(paths, cid)).read_text())
    assert state["config"]["cgroups"].get("cpuset_cpus", "") == ""
    # runc set no cpuset: runc says nothing about the CPUs (its cgroup inherited its parent's,
    # which is not runc's value: issue 26, taking it as runc's laundered drift)
    assert runc_cpus(paths, cid) == ""
    assert procfs.cpus_allowed(paths.proc, pid)  # (it runs somewhere all the same)


@pytest.mark.runc
@pytest.mark.cgroup_v1
def test_memory_only_update_leaves_the_cpus(runc: RuncSession, paths: HostPaths) -> None:
    cpus = host_cpus()
    last = CpuSet([cpus.sorted()[-1]])
    cid = new_id()
    pid = runc.run(cid, cpus=last.to_list(), hooks=None)
    assert runc_cpus(paths, cid) == last.to_list()
    runc.cmd("update", "--memory", "64M", cid)
    # the runc fact: its state forgets the cpuset, the cgroup keeps it
    state = json.loads(Path(state_path(paths, cid)).read_text())
    assert state["config"]["cgroups"]["cpuset_cpus"] == ""
    ref = find_container_cgroup(paths, cid, pid=pid)
    assert ref is not None and read_cpus(ref) == last
    # runc's state says nothing about the CPUs now: "", never the cgroup's value (which a hand
    # edit may have changed: that is drift, not runc's word)
    assert runc_cpus(paths, cid) == ""
    assert procfs.cpus_allowed(paths.proc, pid) == last


@pytest.mark.runc
@pytest.mark.cgroup_v1
@pytest.mark.multi_cpu
def test_kernel_only_list_forms_stored_verbatim(runc: RuncSession, paths: HostPaths) -> None:
    cpus = host_cpus()
    a, b = cpus.sorted()[:2]
    odd = f" {b},,{a}\n"  # the kernel accepts empty groups, whitespace and a newline
    cid = new_id()
    pid = runc.run(cid, cpus=odd, hooks=None)
    state = json.loads(Path(state_path(paths, cid)).read_text())
    assert state["config"]["cgroups"]["cpuset_cpus"] == odd  # runc keeps it verbatim
    assert procfs.cpus_allowed(paths.proc, pid) == CpuSet([a, b])
    assert runc_cpus(paths, cid) == CpuSet([a, b]).to_list()


@pytest.mark.parametrize(
    ("stored", "want"),
    [
        ("0-7:2/4", "0-1,4-5"),
        ("1,,0", "0-1"),
        ("  3 , 5\n", "3,5"),
        ("2-3,", "2-3"),
        ("N", "15"),
        ("12-N:1/2", "12,14"),
    ],
)
def test_kernel_list_forms_in_state(paths16: HostPaths, stored: str, want: str) -> None:
    paths = paths16
    write_state(paths, "k", {"config": {"cgroups": {"cpuset_cpus": stored}}})
    assert runc_cpus(paths, "k") == want


@pytest.mark.parametrize("stored", ["3-1", "0-7:3/2", "x", "1-", "16", "0-7:2"])
def test_a_list_the_kernel_refuses_names_the_state(paths16: HostPaths, stored: str) -> None:
    paths = paths16
    write_state(paths, "bad", {"config": {"cgroups": {"cpuset_cpus": stored}}})
    with pytest.raises(RuntimeKindError) as info:
        runc_cpus(paths, "bad")
    assert state_path(paths, "bad") in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.runc
def test_hook_stages_and_what_each_sees(runc: RuncSession, tmp_path: Path) -> None:
    """Every stage runc 1.1 runs, with the environment and stdin runc_util sets up."""
    rec = tmp_path / "rec"
    rec.mkdir()

    def recorder(stage: str) -> list[str]:
        if stage == "startContainer":  # runs inside the container: busybox's true
            return ["/bin/true"]
        return ["/bin/sh", "-c", 'cat > "$REC/$0.json"; env > "$REC/$0.env"', stage]

    cid = new_id()
    annotations = {"io.kubernetes.cri.container-type": "container"}
    pid = runc.run(
        cid, hooks=recorder, stages=STAGES, annotations=annotations, env={"REC": str(rec)}
    )
    runc.delete(cid)

    seen = {p.stem: json.loads(p.read_text()) for p in rec.glob("*.json")}
    assert set(seen) == set(HOST_STAGES)
    for state in seen.values():
        assert state["id"] == cid
        assert state["annotations"] == annotations
        assert state["bundle"] == str(runc.workdir / "bundles" / cid)
    for stage in ("prestart", "createRuntime", "poststart"):
        assert seen[stage]["pid"] == pid
    assert seen["createContainer"]["pid"] == 1  # the container's own pid namespace
    assert "pid" not in seen["poststop"]
    assert seen["poststop"]["status"] == "stopped"

    env = dict(
        line.split("=", 1)
        for line in (rec / "prestart.env").read_text().splitlines()
        if "=" in line
    )
    assert env["VMPIN_RUNC_ROOT"] == runc.paths.runc_root
    assert env["VMPIN_STATE_DIR"] == runc.paths.state_dir
    assert "PATH" in env


@pytest.mark.runc
def test_host_path_start_container_hook_stops_the_container(runc: RuncSession) -> None:
    """Why vmpin is never a startContainer hook: it runs after pivot_root, in the rootfs."""
    cid = new_id()
    runc.run(
        cid,
        hooks=lambda stage: [sys.executable, "-c", "pass"],
        stages=["startContainer"],
    )
    assert runc.state(cid)["status"] == "stopped"


def test_vmpin_hook_argv_is_absolute() -> None:
    argv = runc_util.vmpin_argv("poststop")
    assert os.path.isabs(argv[0]) and os.access(argv[0], os.X_OK)
    assert argv[-2:] == ["hook", "poststop"]
