"""An event's pass reads the host for the sandboxes it names, and plans again only what moved,
not the whole node (issue 28:
churn's update round trips had grown with the node since passes went node-wide).

Counted on real fake VMMs (tests/support/fakevmm.py), never timed (bench/bench_churn.py
times it): the /proc reads of another sandbox's threads, the affinity writes.  And what such
a pass must still do: plan every sandbox (a change in one moves another's plan), find a
sandbox whose records changed, and not pin again what the last pass pinned; what changed
behind vmpin's back is the periodic pass's, which reads everything.
"""

from __future__ import annotations

import os
import sqlite3
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pytest_mock import MockerFixture

from tests.support import fakevmm
from tests.support.counting import CountingAffinity
from tests.support.session import new_id
from vmpin.core.cpuset import CpuSet
from vmpin.linux import procfs
from vmpin.linux.affinity import SchedAffinity
from vmpin.linux.files import SETTLE_NS
from vmpin.linux.paths import HostPaths
from vmpin.reconcile import plan as plan_module
from vmpin.reconcile.reconciler import Reconciler
from vmpin.state.records import ContainerRec, SandboxRec
from vmpin.state.store import Store


def _sandbox(store: Store, vmms: Callable[[str], fakevmm.FakeVmm], cpus: str) -> tuple[str, int]:
    sid = new_id("ev")
    vmm = vmms(sid, vcpus=1, iothreads=())
    store.put_sandbox(SandboxRec(sid, "kata"))
    store.put_container(ContainerRec(f"{sid}-app", sid, False, name="app",
                                     cpus=CpuSet.parse(cpus), cpus_source="spec"))  # fmt: skip
    return sid, vmm.pid


@pytest.mark.multi_cpu
def test_an_event_pass_reads_only_its_sandboxes_and_plans_the_node(
    paths: HostPaths, vmms: Callable[[str], fakevmm.FakeVmm], mocker: MockerFixture
) -> None:
    with Store(paths.state_dir) as store:
        a, _ = _sandbox(store, vmms, "0")
        b, b_pid = _sandbox(store, vmms, "1")
        counter = CountingAffinity()  # (b: its id and VMM pid)
        rec = Reconciler(paths, store, affinity=counter, publish=False)
        rec.reconcile()  # start-up: every thread pinned where its sandbox's mask is
        assert counter.sets > 0
        # the next event's pass finds what the last one pinned where it left it: no write
        counter.sets = 0
        rec.reconcile([a], fresh={a})
        assert counter.sets == 0
        # b's threads are not read for a's event, nor is b planned again (plan_node's memo:
        # the same observation under the same node-wide inputs)
        reads = mocker.spy(procfs, "thread_affinity")  # (a VMM's threads: its pid's)
        planned = mocker.spy(plan_module, "_plan_sandbox")
        rec.reconcile([a], fresh={a})
        assert all(call.args[1] != b_pid for call in reads.call_args_list)
        assert reads.call_count > 0  # (a's are)
        assert all(call.args[0].id != b for call in planned.call_args_list)
        # a's container moved within its own CPU (same plan input for b): only a re-planned
        store.set_container_cpus(f"{a}-app", CpuSet.parse("0"), "update")
        planned.reset_mock()
        rec.reconcile([a], fresh={a})
        assert [call.args[0].id for call in planned.call_args_list] == [a]
        # ... but b is planned: a moving onto b's CPU makes b's vCPU leave its 1:1 pin
        store.set_container_cpus(f"{a}-app", CpuSet.parse("1"), "update")
        [report] = rec.reconcile([a], fresh={a})
        assert report.mask == CpuSet.parse("1")
        plan = rec.last_plan
        assert plan is not None
        b_plan = plan.sandbox(b)
        assert b_plan is not None and b_plan.mode == "float", b_plan


@pytest.mark.multi_cpu
def test_drift_behind_vmpins_back_waits_for_the_pass_that_reads_everything(
    paths: HostPaths, vmms: Callable[[str], fakevmm.FakeVmm]
) -> None:
    with Store(paths.state_dir) as store:
        a, _ = _sandbox(store, vmms, "0")
        _, b_pid = _sandbox(store, vmms, "1")
        rec = Reconciler(paths, store, publish=False)
        rec.reconcile()
        real = SchedAffinity()
        real.set(b_pid, CpuSet.parse("0-1"))  # by hand
        rec.reconcile([a], fresh={a})
        assert real.get(b_pid) == CpuSet.parse("0-1")  # not read: not seen
        rec.reconcile()  # the periodic pass
        assert real.get(b_pid) == CpuSet.parse("1")


def test_an_event_pass_takes_leftover_vm_dirs_as_the_last_pass_found_them(
    paths: HostPaths, vmms: Callable[[str], fakevmm.FakeVmm], mocker: MockerFixture
) -> None:
    """Dirs that a dead shim left in the VM dir are observed (untracked, no VMM) by every
    pass, but an event's pass does not stat each again: under churn with a few hundred it
    spent ~18 % of its time there.  A dir that comes after is still found, and the
    periodic pass checks them all."""
    leftovers = [new_id("gone") for _ in range(20)]
    for sid in leftovers:
        os.makedirs(os.path.join(paths.vm_dir, sid))
    with Store(paths.state_dir) as store:
        a, _ = _sandbox(store, vmms, "0")
        rec = Reconciler(paths, store, publish=False)
        rec.reconcile()
        isdir = mocker.spy(os.path, "isdir")

        def seen() -> set[str]:
            last = rec.last_observed
            assert last is not None
            return {s.id for s in last[0].sandboxes if not s.tracked}

        rec.reconcile([a], fresh={a})
        assert isdir.call_count == 0
        assert seen() == set(leftovers)
        late = new_id("late")
        os.makedirs(os.path.join(paths.vm_dir, late))
        with open(os.path.join(paths.vm_dir, "not-a-dir"), "w"):
            pass
        rec.reconcile([a], fresh={a})
        assert sorted(c.args[0] for c in isdir.call_args_list) == sorted(
            os.path.join(paths.vm_dir, n) for n in (late, "not-a-dir")
        )
        assert seen() == {*leftovers, late}
        os.rmdir(os.path.join(paths.vm_dir, leftovers[0]))
        isdir.reset_mock()
        rec.reconcile()  # the periodic pass: every name checked
        assert isdir.call_count == len(leftovers) + 1
        assert seen() == {*leftovers[1:], late}


@pytest.mark.multi_cpu
def test_a_sandbox_whose_records_changed_is_read_afresh(
    paths: HostPaths, vmms: Callable[[str], fakevmm.FakeVmm]
) -> None:
    with Store(paths.state_dir) as store:
        a, _ = _sandbox(store, vmms, "0")
        b, b_pid = _sandbox(store, vmms, "1")
        rec = Reconciler(paths, store, publish=False)
        rec.reconcile()
        store.set_container_cpus(f"{b}-app", CpuSet.parse("0"), "update")  # not named below
        rec.reconcile([a], fresh={a})
        assert SchedAffinity().get(b_pid) == CpuSet.parse("0")


def test_an_event_pass_looks_again_at_what_it_names_what_moved_and_what_failed(
    tmp_path: Path,
) -> None:
    """Every other sandbox is given as last observed without walking the node (Observer's
    _given); one never observed, or too many to look at, make it walk every record."""
    from vmpin.core.planner import Policy
    from vmpin.reconcile.observe import GIVEN, Observer, SandboxObs

    observer = Observer(HostPaths(state_dir=str(tmp_path)), Policy())
    ids = ["a", "b", "c", "d", "e"]
    last = {sid: SandboxObs(sid, "kata", Policy(), None) for sid in ids}
    observer._last = dict(last)
    observer._bad = {"d"}  # (observed with an error last time)
    given = observer._given(ids, {"a"}, {"c", "gone"})
    assert given is not None
    out, walk = given
    assert out == [last[sid] for sid in ids]
    assert walk == [0, 2, 3]  # a named, c moved, d failed; "gone" is no longer a record
    assert observer._given([*ids, "new"], {"a"}, set()) is None  # never observed
    many = {f"m{i}" for i in range(GIVEN + 1)}
    assert observer._given(ids, {"a"}, many) is None


def test_what_a_pass_pinned_goes_into_the_kept_observation_when_it_is_given_again(
    tmp_path: Path,
) -> None:
    """Observer.note_applied keeps the pins; the next full observation puts them into the
    last observation of each sandbox it may give again, and not into that of a sandbox it
    reads afresh for an event (its threads would be built anew only to be dropped)."""
    from vmpin.core.planner import Policy
    from vmpin.reconcile.observe import Observer, SandboxObs, ThreadObs, VmmObs

    observer = Observer(HostPaths(state_dir=str(tmp_path)), Policy())
    was = CpuSet.parse("0-1")
    vmm = VmmObs(1, 2, (ThreadObs(10, "vcpu", 0, actual=was), ThreadObs(11, "emulator")))
    for sid in ("a", "b"):
        observer._last[sid] = SandboxObs(sid, "kata", Policy(), None, vmm=vmm)
    observer.note_applied({"a": {10: CpuSet.parse("0")}, "b": {10: CpuSet.parse("1")}}, {})
    assert observer._last["b"].vmm is vmm  # (not yet)
    observer._pinned({"a"})
    a, b = observer._last["a"].vmm, observer._last["b"].vmm
    assert a is vmm  # read afresh by that observation
    assert b is not None and b.threads[0].actual == CpuSet.parse("1")
    assert b.threads[1] is vmm.threads[1]
    assert observer._pins == {}


# -- what an event's pass touches does not grow with the node (issue 28) ---------------------
class _Cursor:
    def __init__(self, cur: sqlite3.Cursor, touched: _Touched) -> None:
        self.cur, self.touched = cur, touched

    def fetchone(self) -> object:
        row = self.cur.fetchone()
        self.touched.rows += row is not None
        return row

    def fetchall(self) -> list[object]:
        rows = self.cur.fetchall()
        self.touched.rows += len(rows)
        return rows

    def __iter__(self) -> Iterator[object]:
        for row in self.cur:
            self.touched.rows += 1
            yield row

    def __getattr__(self, name: str) -> object:
        return getattr(self.cur, name)


class _Connection:
    def __init__(self, db: sqlite3.Connection, touched: _Touched) -> None:
        self.db, self.touched = db, touched

    def execute(self, *args: Any) -> _Cursor:
        return _Cursor(self.db.execute(*args), self.touched)

    def __getattr__(self, name: str) -> object:
        return getattr(self.db, name)


class _Touched:
    """The SQL statements and rows of the store's connection (its cursors counted), and the
    files opened and directories listed (audit events), while inside ``with``."""

    hooked = False
    live: _Touched | None = None

    def __init__(self, store: Store) -> None:
        self.store, self.db = store, store.db
        self.statements: list[str] = []
        self.rows = 0
        self.files: list[str] = []
        self.dirs = 0
        if not _Touched.hooked:
            sys.addaudithook(_Touched._audit)  # (for the session: audit hooks stay)
            _Touched.hooked = True

    @staticmethod
    def _audit(event: str, args: tuple[Any, ...]) -> None:
        me = _Touched.live
        if me is None:
            return
        if event == "open":
            me.files.append(os.path.basename(str(args[0])))
        elif event in ("os.listdir", "os.scandir"):
            me.dirs += 1

    def __enter__(self) -> _Touched:
        self.db.set_trace_callback(self.statements.append)
        self.store.db = _Connection(self.db, self)  # type: ignore[assignment]
        _Touched.live = self
        return self

    def __exit__(self, *exc: object) -> None:
        _Touched.live = None
        self.store.db = self.db
        self.db.set_trace_callback(None)


def _node(paths: HostPaths, started: list[fakevmm.FakeVmm], n: int) -> list[str]:
    """``n`` Kata sandboxes (a pause and an app container each), the first two with a VMM."""
    ids = [new_id("node") for _ in range(n)]
    with Store(paths.state_dir) as store, store.transaction():
        for i, sid in enumerate(ids):
            if i < 2:
                started.append(fakevmm.start(Path(paths.vm_dir), sid, vcpus=1, iothreads=()))
            store.put_sandbox(SandboxRec(sid, "kata"))
            store.put_container(ContainerRec(sid, sid, True, name="pause"))
            store.put_container(ContainerRec(f"{sid}-app", sid, False, name="app",
                                             cpus=CpuSet([i % 2]), cpus_source="spec"))  # fmt: skip
    return ids


@pytest.mark.multi_cpu
def test_an_event_pass_touches_as_much_at_60_as_at_2000_sandboxes(tmp_path: Path) -> None:
    """As the agent runs it (its store's writes deferred, the journal its own): an update
    written by another connection (`vmpin update`), then the event's pass for its sandbox.
    The statements, the rows they return, the files opened and the directories listed are
    the same at 60 sandboxes as at 2,000 (before: every table whole, 26,000 rows)."""
    figures = {}
    for n in (60, 2000):
        root = tmp_path / str(n)
        paths = HostPaths(
            state_dir=str(root / "state"), vm_dir=str(root / "vm"),
            runc_root=str(root / "runc"), kubelet_state=str(root / "no-kubelet"),
            publish_dir=str(root / "publish"), kata_config=str(root / "kata.toml"),
        )  # fmt: skip
        os.makedirs(paths.vm_dir)
        started: list[fakevmm.FakeVmm] = []
        try:
            ids = _node(paths, started, n)
            # the VMMs' pidfiles old enough to be remembered (vmpin.linux.files.settled): a
            # small node is planned within that time of their writing, and its event pass
            # would read them again where a big node's does not
            newest = max(os.stat(Path(paths.vm_dir) / sid / "pid").st_mtime_ns for sid in ids[:2])
            time.sleep(max(0.0, (newest + 2 * SETTLE_NS - time.time_ns()) / 1e9))
            figures[n] = _event_passes(paths, ids)
        finally:
            for v in started:
                v.kill()
    assert figures[60] == figures[2000]
    [(_, rows, _, _), _] = figures[2000]
    assert rows < 100, figures[2000]


def _event_passes(paths: HostPaths, ids: list[str]) -> list[tuple[int, int, list[str], int]]:
    """Two updates of the first sandbox's app, each then its event's pass: what each touched."""
    seen = []
    with Store(paths.state_dir) as store, Store(paths.state_dir) as writer:
        store.defer_durability()
        rec = Reconciler(paths, store, ingest_first=False, publish=False)
        rec.reconcile()  # start-up
        rec.reconcile()  # (reads what the start-up pass wrote)
        for cpus in ("0-1", "0"):
            writer.set_container_cpus(f"{ids[0]}-app", CpuSet.parse(cpus), "update")
            with _Touched(store) as touched:
                [report] = rec.reconcile([ids[0]], fresh={ids[0]})
            assert report.mask == CpuSet.parse(cpus)
            _read_once(touched.statements)
            seen.append((len(touched.statements), touched.rows, sorted(touched.files),
                         touched.dirs))  # fmt: skip
    return seen


def _read_once(statements: list[str]) -> None:
    """What every layer of a pass asked again (issue 28: the data version five times a pass,
    the change log twice) is read once: the pass holds its version (Reader.hold_version) and
    shares the log's delta (Reader.changes_since)."""
    assert statements.count("PRAGMA data_version") == 1, statements
    log = [s for s in statements if "FROM changes WHERE" in s or "name = 'changes'" in s]
    assert len(log) == 1, statements  # (its rows from the pass's seq on: no top apart)


@pytest.mark.multi_cpu
def test_an_event_pass_reads_the_store_and_kubelets_checkpoint_once(
    tmp_path: Path, mocker: MockerFixture
) -> None:
    """An event's pass reads, of the store, the data version, the change log (one statement)
    and what the log names (its sandbox's row and containers): not the allocations table,
    which the log says nothing wrote (issue 28: read at every pass), nor the log's top
    apart; and kubelet's checkpoint file once, for the allocations and the observation
    (it was twice).
    An allocation another process writes is still seen by the next event's pass (which
    releases it: its pod asks for none)."""
    from vmpin.state import allocations as table
    from vmpin.state.allocations import Allocation

    root = tmp_path
    paths = HostPaths(
        state_dir=str(root / "state"), vm_dir=str(root / "vm"), runc_root=str(root / "runc"),
        kubelet_state=str(root / "cpu_manager_state"), publish_dir=str(root / "publish"),
        kata_config=str(root / "kata.toml"),
    )  # fmt: skip
    (root / "cpu_manager_state").write_text(
        '{"policyName":"none","defaultCpuSet":"","checksum":1353318690}'
    )
    os.makedirs(paths.vm_dir)
    started: list[fakevmm.FakeVmm] = []
    try:
        ids = _node(paths, started, 3)
        with Store(paths.state_dir) as store, Store(paths.state_dir) as writer:
            rec = Reconciler(paths, store, ingest_first=False, publish=False)
            rec.reconcile()
            rec.reconcile()
            stat = mocker.spy(os, "stat")
            for cpus in ("0-1", "0"):
                writer.set_container_cpus(f"{ids[0]}-app", CpuSet.parse(cpus), "update")
                stat.reset_mock()
                with _Touched(store) as touched:
                    rec.reconcile([ids[0]], fresh={ids[0]})
                sql = touched.statements
                _read_once(sql)
                assert not [s for s in sql if "allocations" in s or "sqlite_sequence" in s], sql
                read = sql[: sql.index("BEGIN IMMEDIATE")] if "BEGIN IMMEDIATE" in sql else sql
                assert len(read) == 4, read  # data version, the log, the sandbox, its containers
                # (the node summary's identity of it apart: an lstat, vmpin.state.summary)
                cp = [c for c in stat.call_args_list
                      if c.args[0] == paths.kubelet_state and "follow_symlinks" not in c.kwargs]
                assert len(cp) == 1, cp
            row = Allocation(ids[2], None, CpuSet.parse("1"), 1, "test", None, 1.0, 1.0)
            with writer.transaction() as db:
                table.write(db, [row], [])
            with _Touched(store) as touched:
                rec.reconcile([ids[0]], fresh={ids[0]})
            # seen, and released (its pod asks for none)
            assert [s for s in touched.statements if "FROM allocations" in s]
            assert table.read(writer.db) == []
    finally:
        for v in started:
            v.kill()


def test_an_event_pass_observes_without_importing_the_readers_it_holds(
    paths: HostPaths, vmms: Callable[[str], fakevmm.FakeVmm], mocker: MockerFixture
) -> None:
    """kubelet's and Kata's readers are imported with the reader made, once, and the VM
    dir's names checked with the id rules imported with the module: not by an import
    statement at every observation (each one of a module loaded already is ~9 k
    instructions under Python 3.11: 2 % of an event's pass over a 37-thread VM, issue 28)."""
    import builtins

    with Store(paths.state_dir) as store:
        a, _ = _sandbox(store, vmms, "0")
        rec = Reconciler(paths, store, publish=False)
        rec.reconcile()
        imported: list[str] = []
        real = builtins.__import__

        def counting(name: str, *args: Any, **kw: Any) -> Any:
            imported.append(name)
            return real(name, *args, **kw)

        mocker.patch.object(builtins, "__import__", counting)
        store.set_container_cpus(f"{a}-app", CpuSet.parse("1"), "update")
        rec.reconcile([a], fresh={a})
        mocker.stopall()
        assert imported  # (the count works: the pass's other imports are others' to cut)
        readers = ("vmpin.runtimes.kubelet", "vmpin.runtimes.kataconfig", "vmpin.core.ids")
        assert not [name for name in imported if name in readers], imported


@pytest.mark.multi_cpu
def test_a_vhost_kernel_thread_that_comes_later_is_pinned_by_the_pass_that_reads_everything(
    paths: HostPaths, vmms: Callable[[str], fakevmm.FakeVmm], mocker: MockerFixture
) -> None:
    """Before Linux 6.4 a vhost worker is a kernel thread outside QEMU's ``task/`` (FACTS.md),
    and a network device can be hotplugged into the running VM (Kata's endpoint hotplug): the
    worker comes after the VMM was classified, QEMU's own threads unchanged, so the fast path
    alone would leave it floating for good.  An event's pass does not look for it (its cost
    stays its sandbox's); the periodic pass, which reads everything, does, and pins it with
    the sandbox's helpers.
    (This kernel has no vhost module: a sleeping process stands in for the kernel thread,
    and the kernel threads' index is the test's.)"""
    import subprocess

    from vmpin.runtimes import threads

    index: dict[int, list[tuple[int, str]]] = {}
    search = mocker.patch.object(threads, "find_vhost_kthreads", side_effect=lambda p: dict(index))
    real = SchedAffinity()
    with Store(paths.state_dir) as store:
        a, pid = _sandbox(store, vmms, "0")
        rec = Reconciler(paths, store, publish=False)
        rec.reconcile()
        worker = subprocess.Popen(["sleep", "60"])
        try:
            real.set(worker.pid, CpuSet.parse("0-1"))
            index[pid] = [(worker.pid, f"vhost-{pid}")]
            searched = search.call_count
            rec.reconcile([a], fresh={a})
            assert search.call_count == searched  # (an event's pass: not looked for)
            assert real.get(worker.pid) == CpuSet.parse("0-1")
            rec.reconcile()  # the periodic pass
            assert real.get(worker.pid) == CpuSet.parse("0")
            plan = rec.last_plan
            assert plan is not None
            sandbox = plan.sandbox(a)
            assert sandbox is not None and sandbox.obs.vmm is not None
            found = [t for t in sandbox.obs.vmm.threads if t.tid == worker.pid]
            assert [(t.role, t.name) for t in found] == [("vhost", f"vhost-{pid}")]
            # known from then on: the next passes take the fast path again
            calls = search.call_count
            rec.reconcile()
            assert real.get(worker.pid) == CpuSet.parse("0")
            assert search.call_count == calls + 1  # (one look per such pass, not per VMM)
        finally:
            worker.kill()
            worker.wait()
