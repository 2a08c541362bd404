"""Each read view shows the same thing from its narrower observation as from a full one.

``containers``, ``sandboxes``, ``show`` and ``audit`` observe only what they print (issue 14:
:func:`vmpin.service.commands_read.view_scope`, :class:`vmpin.reconcile.observe.Scope`): no VMM for
``containers``, no affinities or guest maps for ``sandboxes``, one sandbox's threads for
``show``, no guest maps for ``audit``.  Here a node with every shape a view distinguishes -- a
VMM pinned 1:1, one sharing a CPU, one without a CPU set, one gone since the last pass, one
with a vCPU hot-plugged since (re-classified), one never found, an untracked VMM, a runc
sandbox, a thread moved by hand, with and without kubelet's static checkpoint -- is shown both
ways, and each view's rows (the audit's result) must be equal.  A view's plan is never applied.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import fakevmm
from tests.support.kubelet_util import write_checkpoint
from vmpin.core.cpuset import CpuSet
from vmpin.linux.paths import HostPaths
from vmpin.reconcile.apply import Applier
from vmpin.reconcile.observe import FULL, Scope
from vmpin.reconcile.reconciler import Reconciler, view_sandbox
from vmpin.service.commands_read import fresh_containers, sandbox_rows, show_json, view_scope
from vmpin.state.records import ContainerRec, SandboxRec
from vmpin.state.store import Store


@pytest.fixture(params=[True, False], ids=["b-runs", "b-never-ran"])
def node(
    request: pytest.FixtureRequest, paths: HostPaths, vm_dir: Path
) -> Iterator[dict[str, fakevmm.FakeVmm]]:
    """Fake VMMs for a, c, g, h, u, and b when the param says so: whether b's VMM runs
    decides whether a (on b's CPU) may pin a vCPU 1:1, which ``show a`` must see without
    reading b's threads."""
    started: dict[str, fakevmm.FakeVmm] = {}
    try:
        for sid in ("a", "b", "c", "g", "h", "u"):
            if sid != "b" or request.param:
                started[sid] = fakevmm.start(vm_dir, sid, vcpus=2)
        yield started
    finally:
        for v in started.values():
            v.kill()


def _register(store: Store) -> None:
    def sandbox(sid: str, cpus: str | None, runtime: str = "kata") -> None:
        store.put_sandbox(SandboxRec(sid, runtime, pod_uid=f"pod-{sid}"))
        store.put_container(ContainerRec(sid, sid, True, name="pause", pod_uid=f"pod-{sid}"))
        if cpus is not None:
            store.put_container(
                ContainerRec(
                    f"{sid}-app", sid, False, name="app", pod_uid=f"pod-{sid}",
                    cpus=CpuSet.parse(cpus), cpus_source="spec",
                )
            )  # fmt: skip

    sandbox("a", "1")  # 2 vCPUs on 1 CPU: the last 1:1 unless the CPU is shared
    sandbox("b", "1")
    sandbox("c", None)
    sandbox("g", "1")
    sandbox("h", "0")
    sandbox("n", "0")  # no VMM ever started
    sandbox("r", "0", runtime="runc")


def _wait_threads(vmm: fakevmm.FakeVmm, n: int) -> None:
    deadline = time.monotonic() + 10
    while len(vmm.tids()) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(vmm.tids()) >= n


@pytest.mark.multi_cpu  # two CPUs: 1:1 pins, shared CPUs and drift all show up
@pytest.mark.parametrize("checkpoint", [True, False], ids=["pool-0", "no-kubelet"])
def test_each_view_of_its_scope_equals_the_view_of_the_whole_node(
    paths: HostPaths, node: dict[str, fakevmm.FakeVmm], checkpoint: bool
) -> None:
    # kubelet's pool {0} keeps c and u (no CPU set) off CPU 1, which it gives to a's and b's
    # pods both (exclusive claims, a conflict); without it they float over every CPU
    if checkpoint:
        write_checkpoint(paths.kubelet_state, "0", {"pod-a": {"app": "1"}, "pod-b": {"app": "1"}})
    with Store(paths.state_dir) as store:
        _register(store)
        Reconciler(paths, store, publish=False).reconcile()  # pins; remembers thread roles
        # then the host moves on: g's VMM dies, h gets a vCPU, a thread of a is moved by hand
        node["g"].kill()
        before = len(node["h"].tids())
        node["h"].hotplug_vcpu()
        _wait_threads(node["h"], before + 1)
        moved = node["a"].tids()[-1]
        os.sched_setaffinity(moved, {0})  # a runs on 1: drift

        rec = Reconciler(paths, store, publish=False)
        full = rec.plan()
        assert full.scope == FULL
        for view, rows in (("containers", fresh_containers), ("sandboxes", sandbox_rows)):
            narrow = rec.plan(scope=view_scope(view))
            assert narrow.scope != FULL
            assert rows(narrow) == rows(full), view
        modes = {r["id"]: r["mode"] for r in sandbox_rows(full)}
        if checkpoint:  # the node's shape reaches a's plan: b's VMM running or not
            assert modes["a"] == ("float" if "b" in node else "partial"), modes
        for sid in ("a", "b", "c", "g", "h", "n", "r"):
            sandbox = store.sandbox(sid)
            assert sandbox is not None
            want = show_json(view_sandbox(rec, sandbox))
            got = show_json(
                view_sandbox(rec, sandbox, view_scope("show", sid))
            )
            assert got == want, sid
        a = store.sandbox("a")
        assert a is not None
        shown = show_json(view_sandbox(rec, a, view_scope("show", "a")))
        assert [t["actual"] for t in shown["threads"] if t["tid"] == moved] == ["0"]
        audit = rec.audit(view_scope("audit"))
        assert audit == rec.audit()
        assert not audit["ok"]  # the thread moved by hand, at least


def test_a_views_plan_is_never_applied(paths: HostPaths) -> None:
    with Store(paths.state_dir) as store:
        rec = Reconciler(paths, store, publish=False)
        plan = rec.plan(scope=Scope(vmms=False))
        with pytest.raises(ValueError, match="never applied"):
            Applier(paths, rec.affinity, publish=False).apply(store, plan)
        with pytest.raises(ValueError, match="whole node"):
            rec.reconcile(apply=True, scope=Scope(affinity=False))
