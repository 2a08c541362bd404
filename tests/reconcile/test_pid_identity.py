"""PID identity in the pass, for real: a reused pid leads vmpin to no stranger's cgroup.

Inside a private pid namespace (``unshare --pid --fork --mount-proc``), a container's init
runs in its cpuset cgroup and is recorded with (pid, start time); it exits, and writing
``/proc/sys/kernel/ns_last_pid`` makes the next process -- a stranger, in another cgroup --
get the same pid.  A pass must neither follow that pid nor touch the stranger's cgroup; and
a pid recorded without a start time proves nothing, so it is not followed either.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.session import new_id

#: makes cpuset cgroups in the host's v1 hierarchy; pid reuse needs a pid namespace (unshare).
pytestmark = [pytest.mark.cgroup_v1, pytest.mark.multi_cpu]

CPUSET = "/sys/fs/cgroup/cpuset"

SCRIPT = r"""
import json, os, subprocess, sys, time
from vmpin.core.cpuset import CpuSet
from vmpin.linux import procfs
from vmpin.linux.paths import HostPaths
from vmpin.reconcile.reconciler import Reconciler
from vmpin.state.records import ContainerRec, SandboxRec
from vmpin.state.store import Store

cg_dir, state_dir, runc_root, ident, with_start = sys.argv[1:6]
mine, stranger = os.path.join(cg_dir, ident + "-c"), os.path.join(cg_dir, ident + "-s")

def spawn_in(cgroup):
    p = subprocess.Popen(["sleep", "300"])
    with open(os.path.join(cgroup, "tasks"), "w") as f:
        f.write(str(p.pid))
    return p

init = spawn_in(mine)
pid, start = init.pid, procfs.start_time("/proc", init.pid)
paths = HostPaths(state_dir=state_dir, vm_dir=state_dir + "/vm", runc_root=runc_root,
                  kubelet_state=state_dir + "/none")
store = Store(state_dir)
cid = ident + "-ctr"
# runc still has the container (stopped, not yet deleted): vmpin keeps managing it, CPU 1
os.makedirs(os.path.join(runc_root, cid))
with open(os.path.join(runc_root, cid, "state.json"), "w") as f:
    json.dump({"id": cid, "config": {"cgroups": {"cpuset_cpus": "1"}}}, f)
store.put_sandbox(SandboxRec(cid, "runc"))
store.put_container(ContainerRec(cid, cid, False, "app", cpus=CpuSet.parse("1"),
                                 cpus_source="spec", pid=pid,
                                 pid_start=start if with_start == "1" else None))
if with_start == "1":
    init.kill(); init.wait()
    with open("/proc/sys/kernel/ns_last_pid", "w") as f:
        f.write(str(pid - 1))
    intruder = spawn_in(stranger)
else:
    # the recorded pid is alive, but nothing proves it is the container's: move it away
    with open(os.path.join(stranger, "tasks"), "w") as f:
        f.write(str(pid))
    intruder = init
reports = Reconciler(paths, store).reconcile(apply=True)
print(json.dumps({
    "pid": pid, "intruder": intruder.pid,
    "notes": [n for r in reports for n in r.notes],
    "containers": [c.id for c in store.containers()],
}))
intruder.kill()
"""


@pytest.fixture
def cgroups() -> Iterator[tuple[str, str]]:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare")
    # an id naming this session, so that the sweep of a dead session's cgroups finds them
    ident = new_id("vmpin-pidns")
    made = []
    for suffix, cpus in (("c", "0"), ("s", "0-1")):
        d = os.path.join(CPUSET, f"{ident}-{suffix}")
        os.mkdir(d)
        made.append(d)
        for name, value in (("cpuset.mems", "0"), ("cpuset.cpus", cpus)):
            with open(os.path.join(d, name), "w") as f:
                f.write(value)
    yield ident, CPUSET
    for d in made:
        with contextlib.suppress(OSError):
            os.rmdir(d)


def run(ident: str, cg: str, tmp: Path, with_start: bool) -> dict[str, object]:
    state = tmp / "state"
    runc_root = tmp / "runc"
    runc_root.mkdir()
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", SCRIPT,
         cg, str(state), str(runc_root), ident, "1" if with_start else "0"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(repo)},
    )
    assert proc.returncode == 0, proc.stderr
    out: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def cpus(cg: str, ident: str, suffix: str) -> str:
    return Path(cg, f"{ident}-{suffix}", "cpuset.cpus").read_text().strip()


def test_reused_pid_is_not_followed(cgroups: tuple[str, str], tmp_path: Path) -> None:
    ident, cg = cgroups
    out = run(ident, cg, tmp_path, with_start=True)
    assert out["intruder"] == out["pid"]  # the kernel really handed the pid to the stranger
    assert cpus(cg, ident, "s") == "0-1"  # the stranger's cgroup: untouched
    assert any("gone: its cgroup is not followed" in str(n) for n in out["notes"])  # type: ignore[attr-defined]


def test_pid_without_start_time_proves_nothing(cgroups: tuple[str, str], tmp_path: Path) -> None:
    ident, cg = cgroups
    out = run(ident, cg, tmp_path, with_start=False)
    assert cpus(cg, ident, "s") == "0-1"  # the cgroup the pid is in now: untouched
    assert any("identity unproven" in str(n) for n in out["notes"])  # type: ignore[attr-defined]
