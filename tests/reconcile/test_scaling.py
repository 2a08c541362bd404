"""A node pass grows linearly with the node, and an idle pass writes nothing (issue 14).

Work is counted, never timed (no test asserts a wall time; bench/bench_idle_pass.py times it):

- plan + audit of a synthetic node: the Python function calls they make (``sys.setprofile``,
  generators' resumptions included) for N and 2N sandboxes.  A linear pass doubles, a pass
  that compares every sandbox with every other (the audit's double-pin check and the plan's
  "every other sandbox's footprint" unions were) quadruples;
- a pass over real fake VMMs: the SQL statements it runs (SQLite's trace callback on the
  store's own connection) are as many for 2 sandboxes as for 6 -- every table is read once
  per pass, not once per sandbox;
- the idle pass after the start-up pass: no sched_setaffinity (a counting backend around the
  real one), no statement that writes, no change in ``total_changes``, the database and its
  WAL byte-identical in size and mtime.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from types import FrameType

import pytest
from pytest_mock import MockerFixture

from tests.support import fakevmm
from tests.support.counting import CountingAffinity
from tests.support.make_sysfs import SYSFS_FIXTURES
from tests.support.session import new_id
from vmpin.core.cpuset import CpuSet
from vmpin.core.planner import Policy
from vmpin.linux.paths import HostPaths
from vmpin.linux.sysfs import read_topology
from vmpin.reconcile.audit import audit
from vmpin.reconcile.observe import ContainerObs, Observation, SandboxObs, ThreadObs, VmmObs
from vmpin.reconcile.plan import plan_node
from vmpin.reconcile.reconciler import Reconciler
from vmpin.runtimes.kubelet import Checkpoint
from vmpin.state.records import ContainerRec, SandboxRec
from vmpin.state.store import Store


# -- plan + audit: calls made, N vs 2N ----------------------------------------------------------
def _sandbox(i: int, cpus: CpuSet | None, actual: CpuSet) -> SandboxObs:
    sid, pod, base = f"sb{i:04d}", f"pod{i:04d}", 10_000 + 10 * i
    threads = (
        ThreadObs(base, "emulator", None, None, "names", "qemu", actual),
        *(
            ThreadObs(base + 1 + k, "vcpu", k, f"CPU {k}/KVM", "names", f"CPU {k}/KVM", actual)
            for k in range(2)
        ),
    )
    containers = (
        ContainerObs(ContainerRec(f"{sid}-pause", sid, True, "pause", pod)),
        ContainerObs(ContainerRec(f"{sid}-app", sid, False, "app", pod, cpus=cpus,
                                  cpus_source="spec")),
    )  # fmt: skip
    rec = SandboxRec(sid, "kata", base, 1, pod_uid=pod)
    return SandboxObs(sid, "kata", Policy(), rec, containers, VmmObs(base, 1, threads))


def _node(n: int) -> Observation:
    """Four sandboxes pinned 1:1 on two CPUs each outside kubelet's pool (one of them drifted
    onto the pool), every other one floating over the pool: every check has work to do."""
    pool = CpuSet.parse("0-7")
    sandboxes = []
    for i in range(n):
        if i < 4:
            own = CpuSet([8 + 2 * i, 9 + 2 * i])
            sandboxes.append(_sandbox(i, own, pool if i == 0 else own))
        else:
            sandboxes.append(_sandbox(i, None, pool))
    return Observation(tuple(sandboxes), Checkpoint("static", pool, {}, 1))


def _calls(fn: Callable[[], object]) -> int:
    count = 0

    def profiler(frame: FrameType, event: str, arg: object) -> None:
        nonlocal count
        if event in ("call", "c_call"):
            count += 1

    sys.setprofile(profiler)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count


def test_plan_and_audit_work_grows_linearly() -> None:
    topology = read_topology(str(SYSFS_FIXTURES / "xeon-gold-6258r-2s"))
    small, large = _node(100), _node(200)

    def run(obs: Observation) -> Callable[[], object]:
        def once() -> object:
            result = audit(plan_node(obs, topology))
            # the drifted sandbox's vCPUs are found, and the floaters over its pinned CPUs:
            # the index the checks use finds what the pairwise scan found
            assert {v["kind"] for v in result["violations"]} == {"drift"}
            return result

        return once

    run(small)()  # imports and caches out of the count
    ratio = _calls(run(large)) / _calls(run(small))
    # linear: 2.0 (plus the fixed part); a quadratic term at these sizes gives > 3
    assert ratio < 2.3, ratio


# -- a pass over fake VMMs: statements and writes --------------------------------------------
def _register(store: Store, vmms: Callable[[str], fakevmm.FakeVmm], n: int) -> None:
    for i in range(n):
        sid = new_id("scale")
        vmms(sid)
        store.put_sandbox(SandboxRec(sid, "kata"))
        store.put_container(ContainerRec(sid, sid, True, name="pause"))
        store.put_container(
            ContainerRec(f"{sid}-app", sid, False, name="app", cpus=CpuSet([i % 2]))
        )


class Statements:
    """Every SQL statement the store's connection runs, as SQLite reports it."""

    def __init__(self, store: Store) -> None:
        self.seen: list[str] = []
        store.db.set_trace_callback(self.seen.append)

    def writes(self) -> list[str]:
        verbs = ("INSERT", "UPDATE", "DELETE", "REPLACE", "BEGIN IMMEDIATE")
        return [s for s in self.seen if s.lstrip().upper().startswith(verbs)]


def _files(paths: HostPaths) -> dict[str, tuple[int, int]]:
    out = {}
    for name in ("state.db", "state.db-wal"):
        p = os.path.join(paths.state_dir, name)
        if os.path.exists(p):
            st = os.stat(p)
            out[name] = (st.st_size, st.st_mtime_ns)
    return out


@pytest.mark.multi_cpu  # the fake VMMs start on every CPU: the start-up pass really pins
def test_idle_pass_writes_nothing_and_reads_each_table_once(
    paths: HostPaths, vmms: Callable[[str], fakevmm.FakeVmm]
) -> None:
    per_size = {}
    for n in (2, 6):
        with Store(paths.state_dir) as store:
            _register(store, vmms, n)
            counter = CountingAffinity()
            reconciler = Reconciler(paths, store, affinity=counter, publish=False)
            reconciler.reconcile()  # start-up: pins, records originals and roles
            assert counter.sets > 0
            counter.sets = 0
            changes, files = store.db.total_changes, _files(paths)
            statements = Statements(store)
            reports = reconciler.reconcile()  # idle
            store.db.set_trace_callback(None)
            assert counter.sets == 0
            assert statements.writes() == []
            assert store.db.total_changes == changes
            assert _files(paths) == files
            assert all(t.action == "ok" for r in reports for t in r.threads if t.role == "vcpu")
            per_size[n] = len(statements.seen)
    # 2 sandboxes, then 8: as many statements -- O(1) queries per pass, not per sandbox
    assert per_size[2] == per_size[6], per_size


@pytest.mark.multi_cpu  # the fake VMMs start on every CPU: the start-up pass really pins
def test_an_idle_pass_rereads_and_replans_only_what_changed(
    paths: HostPaths, vmms: Callable[[str], fakevmm.FakeVmm], mocker: MockerFixture
) -> None:
    """An unchanged store is not read again (Store.version), an unchanged node not planned
    again (the last plan stands); a change in either, or on the host, is seen at once."""
    from vmpin.reconcile import plan as plan_module

    with Store(paths.state_dir) as store:
        _register(store, vmms, 2)
        counter = CountingAffinity()
        reconciler = Reconciler(paths, store, affinity=counter, publish=False)
        reconciler.reconcile()  # start-up: pins, records originals and roles
        reconciler.reconcile()  # (reads what the start-up pass recorded)
        planned = mocker.spy(plan_module, "plan_node")
        before = reconciler.last_plan
        statements = Statements(store)
        counter.sets = 0
        reconciler.reconcile()  # idle
        assert [s for s in statements.seen if "FROM" in s.upper()] == [], statements.seen
        assert planned.call_count == 0 and reconciler.last_plan is before
        assert counter.sets == 0
        # another process changes a container's CPUs: its commit is seen, the node re-planned
        sid = next(s.id for s in store.sandboxes())
        with Store(paths.state_dir) as other:
            other.set_container_cpus(f"{sid}-app", CpuSet([0, 1]), "update")
        reports = {r.id: r for r in reconciler.reconcile()}
        assert planned.call_count == 1
        assert reports[sid].mask == CpuSet([0, 1])
        # someone moves a pinned thread: the observation differs, so it is planned and repaired
        vcpu = next(t for t in reports[sid].threads if t.role == "vcpu")
        assert vcpu.desired is not None and os.sched_getaffinity(vcpu.tid) == set(vcpu.desired)
        moved = {0, 1} - set(vcpu.desired) or {0}
        os.sched_setaffinity(vcpu.tid, moved)
        counter.sets = 0
        reconciler.reconcile()
        assert planned.call_count == 2 and counter.sets == 1
        assert os.sched_getaffinity(vcpu.tid) == set(vcpu.desired)


def test_a_first_pass_lists_each_vmms_threads_once(
    paths: HostPaths, vmms: Callable[[str], fakevmm.FakeVmm], mocker: MockerFixture
) -> None:
    """A VMM's first classification takes the ``task/`` listing its observation just made
    (one listing per VMM in a node's start-up pass, not two), and still finds every thread."""
    from vmpin.linux import procfs

    with Store(paths.state_dir) as store:
        _register(store, vmms, 3)
        listed = mocker.spy(procfs, "tids")
        reports = Reconciler(paths, store, affinity=CountingAffinity(), publish=False).reconcile()
    pids = [c.args[1] for c in listed.call_args_list]
    assert len(pids) == len(set(pids)) == 3, pids
    assert all(len(r.threads) >= 2 and all(t.role != "unknown" for t in r.threads)
               for r in reports), reports  # fmt: skip
