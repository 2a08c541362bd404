"""A plain container's hook, and ``vmpin update`` of one, cost the same on a node of 100
containers as on one of 10,000 (issue 26: 1.9 s and 3.7 s there, with one VM and no agent).

What is counted, never timed (bench/bench_scale.py times it): the real launcher runs in a
fresh interpreter under an audit hook that lists every file it opens and every directory it
lists under the node's roots, /proc and /sys, and every SQL statement it runs on the store
(SQLite's trace callback on each connection the store makes).  The two nodes must give the same
lists, and no statement may scan a table (EXPLAIN QUERY PLAN: indexes only).

And what the fast paths must still do: a container on CPUs a VM's plan depends on (the VM's
own CPU) re-plans the node before the hook returns, an update that stays off them brings the
container's real cgroup into line without looking at the VM, and a pass that wrote its
summary after a hook judged by the one before plans again with the hook's event.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pytest_mock import MockerFixture

from tests.support import bignode, fakevmm
from tests.support.session import new_id, vmpin_env
from vmpin.core.cpuset import CpuSet
from vmpin.linux.paths import HostPaths
from vmpin.reconcile.reconciler import Reconciler
from vmpin.state import journal, summary
from vmpin.state.records import ContainerRec
from vmpin.state.store import Store

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER = ROOT / "bin" / "vmpin"

# Runs the launcher as the kernel would, listing what it touches until it leaves (os._exit).
PROBE = """
import os, sys
roots = tuple(sys.argv[1].split(":"))
out = sys.argv[2]
seen = []
def hook(event, args):
    if event == "open" and isinstance(args[0], str) and args[0].startswith(roots):
        seen.append("open " + args[0])
    elif event in ("os.listdir", "os.scandir") and isinstance(args[0], str) \\
            and args[0].startswith(roots):
        seen.append("list " + args[0])
sys.addaudithook(hook)
import _sqlite3  # the module the store connects with (vmpin.state.sqlite)
real_connect = _sqlite3.connect
def connect(*args, **kw):
    db = real_connect(*args, **kw)
    db.set_trace_callback(lambda sql: seen.append("sql " + sql))
    return db
_sqlite3.connect = connect
real_exit = os._exit
def leave(code):
    with open(out, "w") as f:
        f.write("\\n".join(seen))
    real_exit(code)
os._exit = leave
launcher = sys.argv[3]
sys.argv = [launcher] + sys.argv[4:]
code = compile(open(launcher).read(), launcher, "exec")
try:
    exec(code, {"__name__": "__main__"})
except SystemExit as e:
    leave(e.code if isinstance(e.code, int) else 1)
leave(0)
"""


def vm(vm_dir: Path) -> fakevmm.FakeVmm:
    """The node's VM: a fake VMM whose vCPU thread has its name (it names itself just after
    the pidfile is written: a pass before that finds no vCPU)."""
    vmm = fakevmm.start(vm_dir, bignode.VM, vcpus=1)
    deadline = time.monotonic() + 10
    while not any(
        Path(f"/proc/{vmm.pid}/task/{tid}/comm").read_text().startswith("CPU 0/KVM")
        for tid in vmm.tids()
    ):
        if time.monotonic() > deadline:
            vmm.kill()
            raise AssertionError("the fake VMM did not name its vCPU thread")
        time.sleep(0.01)
    return vmm


class Node:
    def __init__(self, root: Path, containers: int) -> None:
        self.root = root
        self.paths = bignode.host_paths(root)
        bignode.populate(self.paths, containers)
        self.vmm = vm(Path(self.paths.vm_dir))
        try:
            # the VM's pass: its vCPU pinned 1:1 on CPU 1, and the node summary written
            with Store(self.paths.state_dir) as store:
                reports = Reconciler(self.paths, store).reconcile([bignode.VM])
            assert reports[0].mode == "1:1", reports[0].reason
        except BaseException:
            self.vmm.kill()  # (no fixture will: it never got the node)
            raise

    def probe(self, args: list[str], stdin: bytes = b"") -> list[str]:
        out = self.root.parent / f"probe-{new_id()}.txt"
        roots = ":".join((str(self.root), "/proc", "/sys"))
        proc = subprocess.run(
            [sys.executable, "-c", PROBE, roots, str(out), str(LAUNCHER), *args],
            input=stdin, env=vmpin_env(self.paths), capture_output=True, timeout=120,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr.decode()
        assert not proc.stderr, proc.stderr.decode()
        return out.read_text().splitlines()

    def summary(self) -> summary.Summary:
        got = summary.read(self.paths.state_dir)
        assert got is not None
        return got[1]


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[int, Node]]:
    made: dict[int, Node] = {}
    try:
        for n in (100, 10_000):
            made[n] = Node(tmp_path_factory.mktemp(f"node{n}"), n)
        yield made
    finally:
        for node in made.values():
            node.vmm.kill()


def _normal(lines: list[str], node: Node) -> list[str]:
    """The same touch on either node reads the same: its root, pids, event names, times."""
    out = []
    for line in lines:
        line = line.replace(str(node.root), "<root>")
        line = re.sub(r"/proc/\d+", "/proc/<pid>", line)
        line = re.sub(r"\d{20}-\d+\.json", "<event>", line)
        line = re.sub(r"\d+\.\d+", "<time>", line)
        line = re.sub(r"busy_timeout=\d+", "busy_timeout=<ms left>", line)
        out.append(line)
    return out


def _no_scans(node: Node, lines: list[str]) -> None:
    db = sqlite3.connect(node.paths.db)
    try:
        for line in lines:
            sql = line.removeprefix("sql ")
            if not line.startswith("sql ") or not sql.lstrip().upper().startswith(
                ("SELECT", "UPDATE", "DELETE")
            ):
                continue
            for row in db.execute("EXPLAIN QUERY PLAN " + sql):
                detail = row[-1]
                assert not (detail.startswith("SCAN") and "USING" not in detail), (sql, detail)
    finally:
        db.close()


def test_plain_hook_beside_a_vm_touches_as_much_at_100_as_at_10000(
    nodes: dict[int, Node],
) -> None:
    seen = {}
    for n, node in nodes.items():
        cid = "new"
        b, ann = bignode.bundle(node.root, "new", bignode.pod_id(3), bignode.POD_CPUS)
        lines = node.probe(["hook", "--strict", "createRuntime"],
                           bignode.state(cid, os.getpid(), b, ann))  # fmt: skip
        seen[n] = _normal(lines, node)
        # journaled, not applied: the store was not even opened, and the VM keeps its pin
        assert not [x for x in lines if x.startswith("sql ")]
        assert len(journal.pending(node.paths.state_dir)) == 1
        assert node.summary().private == CpuSet.parse(bignode.VM_CPUS)
        # and when it goes: its poststop frees no CPU a VM could have to itself
        lines = node.probe(["hook", "--strict", "poststop"],
                           bignode.state(cid, os.getpid(), b, ann))  # fmt: skip
        assert not [x for x in lines if x.startswith("sql ")]
        seen[n] += _normal(lines, node)
    assert seen[100] == seen[10_000]
    assert any("node-summary" in x for x in seen[100])


def test_update_of_a_plain_container_touches_as_much_at_100_as_at_10000(
    nodes: dict[int, Node],
) -> None:
    seen = {}
    for n, node in nodes.items():
        cid = f"{bignode.pod_id(3)}-c1"
        lines = node.probe(["update", cid, "--cpuset-cpus", "0", "--json"])
        _no_scans(node, lines)
        seen[n] = _normal(lines, node)
        # the VM's threads were not looked at
        assert not [x for x in lines if f"/proc/{node.vmm.pid}/" in x]
    assert seen[100] == seen[10_000]
    assert any(x.startswith("sql UPDATE containers") for x in seen[100])


# -- what the fast paths must still do ------------------------------------------------------
@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    made = Node(tmp_path / "node", 20)
    try:
        yield made
    finally:
        made.vmm.kill()


def _cgroup(node: Node, cid: str, cpus: str) -> None:
    """The container's cgroup as runc leaves it (a plain tree under the node's own root: the
    pass reads its cpuset and tasks -- this process -- as it would a real one)."""
    d = Path(node.paths.cgroup) / "cpuset" / cid
    d.mkdir(parents=True)
    (d / "cpuset.cpus").write_text(cpus + "\n")
    (d / "tasks").write_text(f"{os.getpid()}\n")


def test_a_container_on_the_vms_own_cpu_replans_the_node(node: Node) -> None:
    _cgroup(node, "onvm", bignode.VM_CPUS)
    b, ann = bignode.bundle(node.root, "onvm", bignode.pod_id(2), bignode.VM_CPUS)
    lines = node.probe(["hook", "--strict", "createRuntime"],
                       bignode.state("onvm", os.getpid(), b, ann))  # fmt: skip
    assert any(x.startswith("sql ") for x in lines)  # the node's pass, in the hook
    with Store(node.paths.state_dir) as store:
        assert store.container("onvm") is not None
    # CPU 1 is shared now: the VM's vCPU floats there, and the summary says so
    assert node.summary().private == CpuSet()
    assert node.summary().contended == CpuSet.parse(bignode.VM_CPUS)
    # when it goes, the VM has CPU 1 to itself again before its poststop returns
    (Path(node.paths.cgroup) / "cpuset" / "onvm" / "tasks").write_text("")
    lines = node.probe(["hook", "--strict", "poststop"],
                       bignode.state("onvm", os.getpid(), b, ann))  # fmt: skip
    assert any(x.startswith("sql ") for x in lines)
    assert node.summary().private == CpuSet.parse(bignode.VM_CPUS)


def test_a_container_without_a_cpu_set_replans_the_node(node: Node) -> None:
    # (its cgroup holds what its parent's does: any CPU, the VM's among them)
    b, ann = bignode.bundle(node.root, "nocpus", bignode.pod_id(2), None)
    lines = node.probe(["hook", "--strict", "createRuntime"],
                       bignode.state("nocpus", os.getpid(), b, ann))  # fmt: skip
    assert any(x.startswith("sql ") for x in lines)


def test_a_changed_vm_dir_or_checkpoint_is_not_judged_by_the_old_summary(node: Node) -> None:
    s = node.summary()
    vms = [bignode.VM]
    cp = summary.checkpoint_id(node.paths.kubelet_state)
    assert summary.stale(s, vms, cp, "0-1\n") is None
    assert summary.stale(s, [*vms, "other"], cp, "0-1") == "the VM dir changed"
    Path(node.paths.kubelet_state).write_text("{}")
    assert summary.stale(s, vms, summary.checkpoint_id(node.paths.kubelet_state), "0-1")
    assert summary.stale(s, vms, cp, "0") == "the online CPUs changed"


@pytest.mark.cgroup_v1
def test_an_update_off_the_vms_cpus_repins_the_real_cgroup_alone(
    tmp_path: Path, mocker: MockerFixture
) -> None:
    root = tmp_path / "node"
    paths = bignode.host_paths(root)
    paths = HostPaths(**{**paths._asdict(), "cgroup": "/sys/fs/cgroup"})
    bignode.populate(paths, 10)
    rel = f"vmpin-test-{new_id()}"
    cg = Path("/sys/fs/cgroup/cpuset") / rel
    cg.mkdir()
    sleeper = subprocess.Popen(["sleep", "300"])
    vmm: fakevmm.FakeVmm | None = None
    try:
        vmm = vm(Path(paths.vm_dir))
        (cg / "cpuset.mems").write_text("0")
        (cg / "cpuset.cpus").write_text("0-1")
        (cg / "cgroup.procs").write_text(str(sleeper.pid))
        start = int(Path(f"/proc/{sleeper.pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        with Store(paths.state_dir) as store:
            store.put_container(
                ContainerRec("real", bignode.pod_id(0), False, "real", "uid-00000",
                             cpus=CpuSet.parse("0"), cpus_source="spec",
                             pid=sleeper.pid, pid_start=start, cgroup=rel)
            )  # fmt: skip
        with Store(paths.state_dir) as store:
            Reconciler(paths, store).reconcile()
        assert (cg / "cpuset.cpus").read_text().strip() == "0"
        before = summary.read(paths.state_dir)
        assert before is not None and before[1].private == CpuSet.parse("1")
        (cg / "cpuset.cpus").write_text("0-1")  # (by hand: the update's own pass repairs it)
        proc = subprocess.run(
            [sys.executable, str(LAUNCHER), "update", "real", "--cpuset-cpus", "0", "--json"],
            env=vmpin_env(paths), capture_output=True, timeout=60,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr.decode()
        assert json.loads(proc.stdout)["applied_by"] == "re-pinned"
        assert (cg / "cpuset.cpus").read_text().strip() == "0"
        # the node was not re-planned: its summary is the one the last pass wrote
        assert summary.current(paths.state_dir, before[0])
        # and onto the VM's CPU: the node is re-planned, the VM's vCPU floats with it
        proc = subprocess.run(
            [sys.executable, str(LAUNCHER), "update", "real", "--cpuset-cpus", "0-1"],
            env=vmpin_env(paths), capture_output=True, timeout=60,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr.decode()
        assert (cg / "cpuset.cpus").read_text().strip() == "0-1"
        after = summary.read(paths.state_dir)
        assert after is not None and after[1].private == CpuSet()
    finally:
        sleeper.kill()
        sleeper.wait()
        if vmm is not None:
            vmm.kill()
        cg.rmdir()


def test_a_pass_plans_again_with_an_event_judged_by_the_summary_it_replaced(
    node: Node, mocker: MockerFixture
) -> None:
    """The race the summary's two-sided check closes: a hook judged by the old summary (CPU 1
    shared then) while a pass planned without its event and made CPU 1 the VM's own."""
    _cgroup(node, "late", bignode.VM_CPUS)
    b, ann = bignode.bundle(node.root, "late", bignode.pod_id(1), bignode.VM_CPUS)
    from vmpin.runtimes.oci import hook_event, parse_state

    state = parse_state(bignode.state("late", os.getpid(), b, ann), "state")
    event = hook_event(node.paths, "createRuntime", state)
    with Store(node.paths.state_dir) as store:
        rec = Reconciler(node.paths, store)
        real = rec._reconcile
        calls: list[object] = []

        def first_pass_then_the_hook(*args: object, **kw: object) -> object:
            out = real(*args, **kw)  # type: ignore[arg-type]
            if not calls:
                journal.append(node.paths.state_dir, event)  # after this pass's ingest
            calls.append(kw.get("again"))
            return out

        mocker.patch.object(rec, "_reconcile", side_effect=first_pass_then_the_hook)
        rec.reconcile()
        assert calls == [False, True]  # planned again, with the event
        assert store.container("late") is not None
    assert node.summary().private == CpuSet()


def test_a_hook_whose_summary_was_replaced_judges_by_the_new_one(
    node: Node, mocker: MockerFixture
) -> None:
    from vmpin.service import hook

    b, ann = bignode.bundle(node.root, "judged", bignode.pod_id(1), bignode.POD_CPUS)
    from vmpin.runtimes.oci import hook_event, parse_state

    state = parse_state(bignode.state("judged", os.getpid(), b, ann), "state")
    event = hook_event(node.paths, "createRuntime", state)
    # a pass replaced the summary between the judgement and the check: one that now makes
    # CPU 0 the VM's own -> the hook must re-plan
    s = node.summary()
    replaced = s._replace(private=CpuSet.parse("0-1"))
    real_current = summary.current

    def replaced_meanwhile(state_dir: str, ident: tuple[int, int, int, int, int]) -> bool:
        summary.write(state_dir, replaced)
        return real_current(state_dir, ident)

    mocker.patch.object(summary, "current", side_effect=replaced_meanwhile)
    replan, name = hook._beside_vms(node.paths, event, [bignode.VM])
    assert replan and name is not None  # journaled once, and the node is to be re-planned
    assert journal.pending(node.paths.state_dir) == [name]
