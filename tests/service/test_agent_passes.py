"""The planner's order (vmpin.service.agent_passes): a waiter waits for the pins alone.

Issue 28: under churn most requests arrive while a pass runs, and each then waited for the
rest of it -- its bookkeeping, its settling (a checkpoint: the disk's syncs) -- before a pass
of its own began.  The bookkeeping now comes after the answers, and the settling is a thread
of its own (:class:`~vmpin.service.agent_passes.Settler`); these tests hold each of them up
and see the answers come regardless.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from tests.support import fakevmm
from tests.support.qemu_util import wait_until
from tests.support.session import new_id
from vmpin.core.cpuset import CpuSet
from vmpin.linux.paths import HostPaths
from vmpin.reconcile.reconciler import Reconciler
from vmpin.service.agent import Agent
from vmpin.service.agent_accounting import Accounting
from vmpin.service.agent_passes import Planner
from vmpin.service.agent_protocol import Waiters
from vmpin.service.metrics import Metrics
from vmpin.service.queue import DirtyQueue, Work
from vmpin.state.records import ContainerRec, SandboxRec
from vmpin.state.store import Store


@pytest.fixture
def sandbox_vmm(paths: HostPaths, vm_dir: Path) -> Iterator[tuple[str, fakevmm.FakeVmm]]:
    """One Kata sandbox on a fake VMM, its workload container on CPU 0."""
    sid = new_id("passes")
    vmm = fakevmm.start(vm_dir, sid, vcpus=2)
    try:
        with Store(paths.state_dir) as store:
            store.put_sandbox(SandboxRec(sid, "kata"))
            store.put_container(ContainerRec(sid, sid, True, name="pause"))
            store.put_container(
                ContainerRec(f"{sid}-app", sid, False, name="app", cpus=CpuSet.parse("0"))
            )
        yield sid, vmm
    finally:
        vmm.kill()


@pytest.fixture
def sandbox(sandbox_vmm: tuple[str, fakevmm.FakeVmm]) -> str:
    return sandbox_vmm[0]


@pytest.fixture
def agent(paths: HostPaths) -> Iterator[Agent]:
    a = Agent(paths, partial(Reconciler, paths), interval=3600, metrics_port=0)
    a.start()
    try:
        assert wait_until(lambda: a.status()["passes"] == 1 and not a.status()["pass_running"], 10)
        yield a
    finally:
        a.request_stop()
        assert a.shutdown() == 0


def update(paths: HostPaths, sid: str, cpus: str) -> None:
    with Store(paths.state_dir) as store:
        store.set_container_cpus(f"{sid}-app", CpuSet.parse(cpus), "update")


class StuckLink:
    """A Kubernetes link whose report hangs until released: the bookkeeping after a pass."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def policies(self, version: int) -> None:
        return None

    def forget_sandbox(self, sid: str, publish: bool = True) -> None:
        pass

    def after_pass(self, rec: Any, report: Any, *, drift: bool, publish: bool = True) -> None:
        pass

    def publish(self) -> None:
        self.entered.set()
        self.release.wait(30)

    def stop(self) -> None:
        self.release.set()


@pytest.mark.multi_cpu
def test_the_answer_does_not_wait_for_the_bookkeeping(
    paths: HostPaths, sandbox: str, agent: Agent
) -> None:
    link = StuckLink()
    agent.kube = link  # type: ignore[assignment]
    try:
        update(paths, sandbox, "1")
        reply = agent.notify_and_wait([sandbox], 10.0)
        assert reply["done"] is True
        # answered while the pass's bookkeeping still hangs in the link's report
        assert link.entered.wait(10) and not link.release.is_set()
    finally:
        link.release.set()
    # ... which then ends, and says where the waiter's time went
    value = agent.metrics.registry.get_sample_value
    assert wait_until(lambda: (value("vmpin_pass_tail_seconds_count") or 0) >= 2, 10)
    for name in ("vmpin_queue_wait_seconds", "vmpin_event_pass_seconds"):
        assert (value(f"{name}_count") or 0) >= 1, name


@pytest.mark.multi_cpu
def test_no_pass_waits_for_the_settling(
    paths: HostPaths, sandbox: str, agent: Agent, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A settling that hangs (a disk's sync) holds up neither the answers nor the next pass;
    the passes' requests to settle meanwhile fold into one more."""
    entered, release = threading.Event(), threading.Event()
    calls: list[str] = []
    real: Callable[[Store], int] = Store.settle_journal

    def stuck(store: Store) -> int:
        calls.append(threading.current_thread().name)
        entered.set()
        release.wait(30)
        return real(store)

    monkeypatch.setattr(Store, "settle_journal", stuck)
    try:
        for cpus in ("1", "0", "0-1"):
            update(paths, sandbox, cpus)
            assert agent.notify_and_wait([sandbox], 10.0)["done"] is True
        assert entered.wait(10)
        assert calls == ["vmpin-settler"]  # held up in the first; the next ones wait for it
    finally:
        release.set()
    wait_until(lambda: len(calls) == 2, 2)  # (the requests that came meanwhile: one more)
    assert len(calls) <= 2 and set(calls) == {"vmpin-settler"}


@pytest.mark.multi_cpu
def test_the_answer_does_not_wait_for_the_queues_bookkeeping(
    paths: HostPaths, sandbox: str, agent: Agent, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pass's waiters are answered before its sandboxes are marked done in the queue
    (DirtyQueue.done_all: its lock, its backoff records), which then follows all the same:
    nothing is left running."""
    from vmpin.service.queue import DirtyQueue

    entered, release = threading.Event(), threading.Event()
    real = DirtyQueue.done_all

    def held(queue: DirtyQueue, sandbox_ids: Any) -> None:
        entered.set()
        release.wait(30)
        real(queue, sandbox_ids)

    monkeypatch.setattr(DirtyQueue, "done_all", held)
    try:
        update(paths, sandbox, "1")
        assert agent.notify_and_wait([sandbox], 10.0)["done"] is True
        # answered before it, or while it was held (Reconciler.on_pinned answers earlier)
        assert entered.wait(10) and not release.is_set()
    finally:
        release.set()
    assert wait_until(agent.queue.idle, 10)


@pytest.mark.multi_cpu
@pytest.mark.parametrize("maps_first", [True, False], ids=["kata-hook", "update"])
def test_the_answer_does_not_wait_for_the_node_summary(
    paths: HostPaths,
    sandbox_vmm: tuple[str, fakevmm.FakeVmm],
    agent: Agent,
    monkeypatch: pytest.MonkeyPatch,
    maps_first: bool,
) -> None:
    """A pass's waiters are answered once its pins are in place and current
    (Reconciler.on_pinned), before its node summary is written -- with the guest map
    published first for a waiter that reads it (a Kata hook) -- and the summary follows."""
    from vmpin.reconcile.summarizer import Summarizer
    from vmpin.runtimes.publish import map_path, read_published

    sandbox, vmm = sandbox_vmm

    entered, release = threading.Event(), threading.Event()
    real = Summarizer.write

    def held(self: Summarizer, *args: Any, **kw: Any) -> bool:
        entered.set()
        release.wait(30)
        return real(self, *args, **kw)

    path = map_path(paths, sandbox)
    os.makedirs(os.path.dirname(os.path.dirname(path)))  # (Kata's dir shared with the guest)
    monkeypatch.setattr(Summarizer, "write", held)
    try:
        update(paths, sandbox, "1")
        reply = agent.notify_and_wait([sandbox], 10.0, maps_first=maps_first)
        assert reply["done"] is True
        assert entered.is_set() and not release.is_set()  # answered while it was held
        assert {frozenset(os.sched_getaffinity(t)) for t in vmm.tids()} == {frozenset({1})}
        if maps_first:
            doc = read_published(path)
            assert doc is not None and doc["containers"][f"{sandbox}-app"]["host_cpus"] == "1"
    finally:
        release.set()
    assert wait_until(lambda: not agent.status()["pass_running"], 10)


def _planner(paths: HostPaths) -> tuple[Planner, Accounting]:
    """The agent's planner, run by the test's own thread (as bench/bench_event_pass.py)."""

    def fault(where: str, err: BaseException) -> None:
        raise err

    metrics = Metrics()
    accounting = Accounting(paths, metrics)
    planner = Planner(
        paths, partial(Reconciler, paths), DirtyQueue(), Waiters(fault), accounting, metrics,
        fault=fault, pause=lambda s: True, fatal=lambda: None, interval=5.0,
    )  # fmt: skip
    return planner, accounting


@pytest.mark.multi_cpu
def test_an_event_pass_accounts_by_the_records_its_observation_read(
    paths: HostPaths, sandbox: str
) -> None:
    """An event's pass reads its sandbox's row once, in its observation, and accounts the
    pass by that record (it read the row again before the pass: issue 28); a sandbox the
    store does not hold is gone, as before."""
    planner, accounting = _planner(paths)
    with Store(paths.state_dir) as store:
        reconciler = planner._setup(store)
        now = time.monotonic()
        planner._run_batch([Work(sandbox, "startup", None, now)], store, reconciler)
        update(paths, sandbox, "1")
        statements: list[str] = []
        store.db.set_trace_callback(statements.append)
        try:
            now = time.monotonic()
            planner._run_batch([Work(sandbox, "event", now, now)], store, reconciler)
        finally:
            store.db.set_trace_callback(None)
        rec = store.sandbox(sandbox)
        assert rec is not None and not rec.dirty
        reads = [s for s in statements if s.startswith("SELECT") and "FROM sandboxes" in s]
        assert len(reads) == 1, statements
        tally = accounting.tally(sandbox)
        assert tally.plans == 2 and tally.sandbox is not None
        assert tally.sandbox["gen"] == rec.gen  # (the update's: the pass planned from it)
        assert tally.sandbox["plans"] == 2
        # an event for a sandbox no store holds (gone, or a libvirt domain): forgotten
        gone = new_id("gone")
        now = time.monotonic()
        planner._run_batch([Work(gone, "event", now, now)], store, reconciler)
        assert accounting.tally(gone).sandbox is None
        assert accounting.tally().plans == 2
