"""End to end with real runc containers whose config.json runs `vmpin hook` at every stage."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import vmpin_cmd
from tests.support.kubelet_util import checkpoint_text, write_checkpoint
from tests.support.runc_util import RuncSession, missing, new_id
from vmpin.linux.paths import HostPaths

#: runc on the host's v1 cpuset hierarchy (cgroup paths below are v1), plans over CPUs 0-1.
pytestmark = [pytest.mark.runc, pytest.mark.cgroup_v1, pytest.mark.multi_cpu]


@pytest.fixture
def runc(paths: HostPaths, tmp_path: Path) -> Iterator[RuncSession]:
    why = missing()
    if why:
        pytest.skip(why)
    with RuncSession(paths, tmp_path) as session:
        yield session


def vmpin(env: dict[str, str], *args: str, stdin: str | None = None,
          check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([*vmpin_cmd(), *args], input=stdin, capture_output=True, text=True,
                          env=env, timeout=60)
    if check and proc.returncode != 0:
        raise AssertionError(f"vmpin {args} -> {proc.returncode}: {proc.stdout}{proc.stderr}")
    return proc


def allowed(pid: int) -> str:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("Cpus_allowed_list:"):
                return line.split(":", 1)[1].strip()
    raise AssertionError("no Cpus_allowed_list")


def cgroup_cpus(cid: str) -> str:
    return Path(f"/sys/fs/cgroup/cpuset/{cid}/cpuset.cpus").read_text().strip()


def containers(env: dict[str, str]) -> dict[str, dict[str, object]]:
    return {c["id"]: c for c in json.loads(vmpin(env, "containers", "--json").stdout)}


def test_container_lifecycle(runc: RuncSession, env: dict[str, str]) -> None:
    cid = new_id("vmpin-e2e-a")
    pid = runc.run(cid, cpus="1")
    listed = containers(env)
    assert listed[cid]["cpus"] == "1" and listed[cid]["runtime"] == "runc"
    assert listed[cid]["pid"] == pid
    assert allowed(pid) == "1"
    assert vmpin(env, "audit").returncode == 0

    # runc update rewrites the cgroup and fires no hook: one reconcile adopts it
    runc.update(cid, "0")
    vmpin(env, "reconcile", "--once")
    assert containers(env)[cid]["cpus"] == "0"
    assert containers(env)[cid]["cpus_source"] == "runc"
    assert allowed(pid) == "0" and cgroup_cpus(cid) == "0"

    # vmpin update (CRI UpdateContainerResources) is applied to the cgroup at once
    vmpin(env, "update", cid, "--cpuset-cpus", "0-1")
    assert containers(env)[cid]["cpus"] == "0-1"
    assert cgroup_cpus(cid) == "0-1" and allowed(pid) == "0-1"
    # ... and the next pass does not undo it because runc's state still says "0"
    vmpin(env, "reconcile", "--once")
    assert cgroup_cpus(cid) == "0-1"

    # a hand edit of the cgroup is drift: audit fails, reconcile restores the plan
    Path(f"/sys/fs/cgroup/cpuset/{cid}/cpuset.cpus").write_text("1")
    audit = vmpin(env, "audit", "--json", check=False)
    assert audit.returncode == 1
    assert any(v["role"] == "container" for v in json.loads(audit.stdout)["violations"])
    vmpin(env, "reconcile", "--once")
    assert cgroup_cpus(cid) == "0-1" and allowed(pid) == "0-1"
    assert vmpin(env, "audit").returncode == 0

    # -r resources.json, as runc update -r takes it, from stdin
    vmpin(env, "update", cid, "-r", "-", stdin=json.dumps({"cpu": {"cpus": "1"}}))
    assert cgroup_cpus(cid) == "1" and allowed(pid) == "1"

    sandboxes = json.loads(vmpin(env, "sandboxes", "--json").stdout)
    assert [(s["id"], s["runtime"], s["mask"]) for s in sandboxes] == [(cid, "runc", "1")]

    runc.delete(cid)  # poststop hook
    assert cid not in containers(env)
    assert json.loads(vmpin(env, "sandboxes", "--json").stdout) == []


def test_drift_after_a_cpuless_runc_update_is_repaired(
    runc: RuncSession, env: dict[str, str]
) -> None:
    """``runc update`` without ``--cpuset-cpus`` leaves ``cpuset_cpus: ""`` in runc's state;
    a hand edit of the cgroup after it is drift, not runc's word (issue 26: vmpin took the
    cgroup as runc's value, adopted the edit as ``source runc`` and audit exited 0)."""
    cid = new_id("vmpin-e2e-l")
    pid = runc.run(cid, cpus="1")
    runc.cmd("update", "--memory", "64M", cid)
    assert runc.state(cid)["status"] == "running"
    vmpin(env, "reconcile", "--once")
    assert containers(env)[cid]["cpus"] == "1" and cgroup_cpus(cid) == "1"

    Path(f"/sys/fs/cgroup/cpuset/{cid}/cpuset.cpus").write_text("0-1")
    audit = vmpin(env, "audit", "--json", check=False)
    assert audit.returncode == 1, audit.stdout
    assert {v["kind"] for v in json.loads(audit.stdout)["violations"]} == {"drift"}
    vmpin(env, "reconcile", "--once")
    assert cgroup_cpus(cid) == "1" and allowed(pid) == "1"
    listed = containers(env)[cid]
    assert (listed["cpus"], listed["cpus_source"]) == ("1", "spec")
    assert vmpin(env, "audit").returncode == 0


def test_doctor_recovers_runc_containers_through_a_search_list(
    runc: RuncSession, env: dict[str, str], paths: HostPaths, tmp_path: Path
) -> None:
    """``--runc-root`` is a search list (the default: ``/run/runc:/run/containerd/runc/*``):
    doctor reads every root it names (issue 26: it listed the option string as one directory,
    recovered nothing, and said "rebuilt from the host")."""
    cid = new_id("vmpin-e2e-d")
    runc.run(cid, cpus="1")
    env = {**env, "VMPIN_RUNC_ROOT": f"{tmp_path}/absent:{Path(paths.runc_root).parent}/*"}
    assert cid in containers(env)
    db = Path(paths.state_dir, "state.db")
    for extra in ("-wal", "-shm"):
        Path(str(db) + extra).unlink(missing_ok=True)
    db.write_bytes(b"not a database" * 300)
    fixed = vmpin(env, "doctor")
    assert f"container {cid}: recovered from runc state" in fixed.stdout, fixed.stdout
    assert "1 containers and sandboxes recovered" in fixed.stdout
    assert containers(env)[cid]["cpus"] == "1"


def test_container_gone_without_poststop_is_forgotten(
    runc: RuncSession, env: dict[str, str], paths: HostPaths
) -> None:
    cid = new_id("vmpin-e2e-b")
    runc.run(cid, cpus="0")
    assert cid in containers(env)
    # delete behind vmpin's back: no poststop hook runs, the process and runc's state go
    bundle = runc.workdir / "bundles" / cid
    cfg = json.loads((bundle / "config.json").read_text())
    cfg["hooks"].pop("poststop")
    (bundle / "config.json").write_text(json.dumps(cfg))
    state_file = Path(paths.runc_root) / cid / "state.json"
    state = json.loads(state_file.read_text())
    state["config"]["hooks"] = {}
    state_file.write_text(json.dumps(state))
    runc.delete(cid)
    assert cid in containers(env)
    vmpin(env, "reconcile", "--once")
    assert cid not in containers(env)


def test_update_bad_input_changes_nothing(runc: RuncSession, env: dict[str, str]) -> None:
    cid = new_id("vmpin-e2e-c")
    runc.run(cid, cpus="1")
    cases = [
        (["update", "nope", "--cpuset-cpus", "0"], "unknown container"),
        (["update", cid, "--cpuset-cpus", "3-1"], "runs backwards"),
        (["update", cid, "--cpuset-cpus", "9-2"], "runs backwards"),
        (["update", cid, "--cpuset-cpus", "7"], "not online"),
        (["update", cid, "--cpuset-cpus", "a"], "not a CPU number"),
        (["update", cid], "exactly one"),
        (["update", cid, "-r", "/nonexistent.json"], "/nonexistent.json"),
    ]
    for args, words in cases:
        proc = vmpin(env, *args, check=False)
        assert proc.returncode == 2, (args, proc.stderr)
        assert words in proc.stderr and proc.stderr.count("\n") == 1, (args, proc.stderr)
    proc = vmpin(env, "update", cid, "-r", "-", stdin="{not json", check=False)
    assert proc.returncode == 2 and "malformed JSON" in proc.stderr
    assert containers(env)[cid]["cpus"] == "1" and cgroup_cpus(cid) == "1"


def test_hook_bad_input_fails_open(env: dict[str, str], tmp_path: Path) -> None:
    bundle = tmp_path / "b"
    bundle.mkdir()
    (bundle / "config.json").write_text(json.dumps(
        {"linux": {"resources": {"cpu": {"cpus": "9-2"}}}}))
    good_state = json.dumps({"id": "x1", "pid": 1, "bundle": str(bundle)})
    cases = [
        ("", "empty"),
        ("{broken", "malformed JSON"),
        (json.dumps({"id": "x1", "bundle": str(tmp_path / "missing")}), "config.json"),
        (good_state, "linux.resources.cpu.cpus"),
        (json.dumps({"id": "../../etc", "bundle": str(bundle)}), "invalid id"),
    ]
    for stdin, words in cases:
        lax = vmpin(env, "hook", "prestart", stdin=stdin, check=False)
        assert lax.returncode == 0, lax.stderr
        assert words in lax.stderr and lax.stderr.count("\n") == 1, (stdin, lax.stderr)
        strict = vmpin(env, "hook", "--strict", "prestart", stdin=stdin, check=False)
        assert strict.returncode == 1 and words in strict.stderr
    bad_stage = vmpin(env, "hook", "--strict", "prestop", stdin=good_state, check=False)
    assert bad_stage.returncode == 1 and "bad stage" in bad_stage.stderr
    # bad input left no state behind: the read-only listing shows a node with nothing on it
    listed = vmpin(env, "containers", "--json", check=False)
    assert listed.returncode == 0 and json.loads(listed.stdout) == []
    assert "nothing recorded at" in listed.stderr
    assert not (Path(env["VMPIN_STATE_DIR"]) / "state.db").exists()


def test_hundred_concurrent_hooks_lose_nothing(env: dict[str, str], tmp_path: Path) -> None:
    """100 hook processes at once (two pods' worth of a busy node's churn): all recorded."""
    states = []
    for i in range(100):
        b = tmp_path / f"b{i}"
        b.mkdir()
        ann = {"io.kubernetes.cri.container-type": "container",
               "io.kubernetes.cri.sandbox-id": f"pod{i % 10}"}
        (b / "config.json").write_text(json.dumps(
            {"annotations": ann, "linux": {"resources": {"cpu": {"cpus": str(i % 2)}}}}))
        states.append(json.dumps({"id": f"c{i}", "bundle": str(b), "annotations": ann}))

    def run(state: str) -> int:
        return vmpin(env, "hook", "--strict", "createRuntime", stdin=state,
                     check=False).returncode

    with ThreadPoolExecutor(max_workers=100) as pool:
        codes = list(pool.map(run, states))
    assert codes == [0] * 100
    listed = containers(env)
    assert len(listed) == 100
    assert all(listed[f"c{i}"]["cpus"] == str(i % 2) for i in range(100))
    assert len(json.loads(vmpin(env, "sandboxes", "--json").stdout)) == 10


def test_state_dir_permissions(env: dict[str, str], paths: HostPaths) -> None:
    vmpin(env, "reconcile", "--once")
    assert os.stat(paths.db).st_mode & 0o777 == 0o600


def test_kubelet_checkpoint_changes_are_adopted(
    runc: RuncSession, env: dict[str, str], paths: HostPaths
) -> None:
    """kubelet's cpu_manager_state (read only): an entry for (pod uid, name) moves a container."""
    cid = new_id("vmpin-e2e-k")
    ann = {"io.kubernetes.cri.container-type": "container",
           "io.kubernetes.cri.sandbox-id": "podk", "io.kubernetes.cri.sandbox-uid": "uid-k",
           "io.kubernetes.cri.container-name": "app"}
    checkpoint = Path(paths.kubelet_state)

    def write(default: str, entry: str | None) -> None:
        entries = {"uid-k": {"app": entry}} if entry else {}
        write_checkpoint(checkpoint, default, entries)

    write("0-1", "1")
    pid = runc.run(cid, cpus="1", annotations=ann)
    assert containers(env)[cid]["cpus"] == "1"
    write("1", "0")  # kubelet moved the exclusive CPU
    vmpin(env, "reconcile", "--once")
    assert containers(env)[cid]["cpus"] == "0"
    assert containers(env)[cid]["cpus_source"] == "kubelet"
    assert allowed(pid) == "0" and cgroup_cpus(cid) == "0"
    written = checkpoint_text("1", {"uid-k": {"app": "0"}})
    assert checkpoint.read_text() == written  # never written by vmpin
