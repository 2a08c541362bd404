"""One writer order for the node (issue 26): concurrent ``vmpin update`` without an agent.

Before, each update wrote its set and re-pinned in its own pass, and two passes could observe
the store one after the other and apply in the opposite order: 12 of 80 storms of 20
parallel updates ended with the kernel holding an older set than the store (every update
exit 0; audit failing until the next pass).  Passes now hold the node's plan lock from
observe to their last write (vmpin.state.locks), so the last acknowledged update is what the
kernel holds.

The storms run on one real QEMU sandbox (KVM, thread names, two vCPUs over host CPUs 0-1)
with no agent: 100 storms of 20 parallel ``vmpin update`` of its one container, each to a
random set, then the store's set, the threads' affinity read from /proc, and ``vmpin audit``
must all agree after every storm.  The updates run as on a node, from compiled bytecode:
this environment sets ``PYTHONDONTWRITEBYTECODE``, and compiling vmpin from source in every
process was 0.19 s of an update's 0.26 s here (the storms took ~6 s each instead of ~1 s),
so the processes get a private ``PYTHONPYCACHEPREFIX`` instead (``bytecode_env``).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import vmpin_cmd
from tests.e2e.test_e2e_kata import Kata, affinities, thread_names
from tests.service.test_agent import all_on, register
from tests.support import fakevmm
from tests.support.qemu_util import QemuHandle, qemu_factory, require_qemu
from tests.support.session import new_id
from vmpin.core.cpuset import CpuSet
from vmpin.linux.paths import HostPaths
from vmpin.reconcile.plan import NodePlan
from vmpin.reconcile.reconciler import Reconciler
from vmpin.state.store import Store

#: 100 storms of 20, as the issue counted them (not fewer in CI)
STORMS = 100
PARALLEL = 20
TARGETS = ("0", "1", "0-1")


@pytest.fixture
def qemu(vm_dir: Path) -> Iterator[Callable[..., QemuHandle]]:
    require_qemu()
    with qemu_factory(vm_dir) as start:
        yield start


def expected(cpus: str, names: dict[int, str]) -> dict[int, str]:
    """Each thread's affinity for the container's set, by hand (not by vmpin's planner): on
    one CPU every thread runs there (the boot vCPU floats over the one CPU, the other is
    pinned to it); on both, the two vCPUs are 1:1 in topology order and the rest float."""
    if cpus != "0-1":
        return dict.fromkeys(names, cpus)
    vcpu = {"CPU 0/KVM": "0", "CPU 1/KVM": "1"}
    return {tid: vcpu.get(name, "0-1") for tid, name in names.items()}


def stored(paths: HostPaths, cid: str) -> str:
    with Store.open_readonly(paths.state_dir) as store:
        rec = store.container(cid)
        assert rec is not None and rec.cpus is not None
        return rec.cpus.to_list()


@pytest.mark.qemu
@pytest.mark.kvm  # threads named "CPU N/KVM"
@pytest.mark.multi_cpu
def test_update_storms_end_with_the_store_on_the_kernel(
    qemu: Callable[..., QemuHandle], paths: HostPaths, bytecode_env: dict[str, str],
    tmp_path: Path,
) -> None:
    kata = Kata(tmp_path, bytecode_env)
    q = qemu(new_id("storm"), smp=2, debug_threads=True)
    cid = f"storm-{os.getpid()}"
    kata.create_sandbox(q)
    kata.create_container(q, cid, "0-1")
    names = thread_names(q.pid)
    assert affinities(q.pid) == expected("0-1", names)
    update = [*vmpin_cmd(), "update", cid, "--cpuset-cpus"]
    rng = random.Random(26)
    bad: list[str] = []
    started = time.monotonic()
    for storm in range(STORMS):
        wanted = [rng.choice(TARGETS) for _ in range(PARALLEL)]
        procs = [
            subprocess.Popen([*update, cpus], env=bytecode_env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
            for cpus in wanted
        ]  # fmt: skip
        errors = [(p.wait(60), p.stderr.read() if p.stderr else "") for p in procs]
        for p in procs:
            if p.stderr:
                p.stderr.close()
        assert all(rc == 0 for rc, _ in errors), errors
        last = stored(paths, cid)
        actual = affinities(q.pid)
        want = expected(last, {t: names[t] for t in actual if t in names})
        # (the table, not --json: the tests check every --json view against its pydantic
        # model, ~0.5 s of pydantic's import per audit, and the exit code is the verdict)
        audit = kata.vmpin("audit", check=False)
        if {t: actual[t] for t in want} != want or audit.returncode != 0:
            shown = kata.vmpin("audit", "--json", check=False).stdout
            violations = json.loads(shown)["violations"] if shown else audit.stderr
            bad.append(f"storm {storm}: store {last}, kernel {actual}, audit {violations}")
    elapsed = time.monotonic() - started
    print(f"{STORMS} storms of {PARALLEL}: {elapsed:.1f} s, {len(bad)} ended unlike the store")
    assert not bad, f"{len(bad)} of {STORMS} storms:\n" + "\n".join(bad[:10])


@pytest.mark.multi_cpu
def test_a_holder_overtaken_while_it_was_stopped_plans_again(
    paths: HostPaths, vm_dir: Path, bytecode_env: dict[str, str], mocker: Any
) -> None:
    """A pass holds the node lock and stops between its plan and its apply; an update meanwhile
    waits its budget for the lock, goes on without it (writing its token into the lock file)
    and pins the new set.  When the holder goes on it applies its older plan over that one,
    finds the token, and plans again: the kernel ends with the update's set.  (Without the
    second plan it would end with the older one, the store saying otherwise.)  Only then are
    the pins said to be in place (``on_pinned``, where the agent answers its waiters)."""
    sid = new_id("overtaken")
    vmm = fakevmm.start(vm_dir, sid, vcpus=2)
    try:
        with Store(paths.state_dir) as store:
            register(store, sid, "1")
        rec = Reconciler(paths, Store(paths.state_dir))
        rec.reconcile()
        assert all_on(vmm.pid, "1")
        with Store(paths.state_dir) as store:  # what the holder will plan from
            store.set_container_cpus(f"{sid}-app", CpuSet.parse("0"), "update")
        plans: list[NodePlan] = []
        real_plan = rec.plan

        def plan(*args: Any, **kw: Any) -> NodePlan:
            plans.append(real_plan(*args, **kw))
            if len(plans) == 1:  # stopped here, holding the lock: an update comes along
                upd = subprocess.run(
                    [*vmpin_cmd(), "update", f"{sid}-app", "--cpuset-cpus", "1"],
                    env=bytecode_env, capture_output=True, text=True, timeout=60,
                )
                assert upd.returncode == 0, upd.stderr
                assert all_on(vmm.pid, "1")
            return plans[-1]

        mocker.patch.object(rec, "plan", side_effect=plan)
        # the agent answers its waiters from on_pinned: never after the overtaken apply
        told: list[int] = []
        rec.on_pinned = lambda: told.append(len(plans))
        rec.reconcile()
        assert len(plans) == 2  # planned again once it saw the token
        assert told == [2]
        assert all_on(vmm.pid, "1")
        assert stored(paths, f"{sid}-app") == "1"
    finally:
        vmm.kill()


@pytest.mark.multi_cpu
@pytest.mark.parametrize("meanwhile", [None, "0-1"], ids=["alone", "another-acknowledged"])
def test_an_interrupted_update_undoes_only_its_own_write(
    paths: HostPaths, vm_dir: Path, bytecode_env: dict[str, str], meanwhile: str | None
) -> None:
    """``vmpin update`` A writes its set and is interrupted before its re-pin; meanwhile
    (``another-acknowledged``) update B writes its own, re-pins and answers.  A's undo runs
    last: it puts the old set back only if the store still holds A's write.  Before, it did
    so unconditionally and erased B (3 of 3): the store said the old set, the kernel held
    B's, and audit failed until the next pass."""
    from vmpin.service.update import update_container

    sid = new_id("undo")
    vmm = fakevmm.start(vm_dir, sid, vcpus=2)
    app = f"{sid}-app"
    try:
        with Store(paths.state_dir) as store:
            register(store, sid, "0")
        Reconciler(paths, Store(paths.state_dir)).reconcile()
        assert all_on(vmm.pid, "0")

        def interrupted(store: Store, **options: object) -> Reconciler:
            # A has written "1"; its pass is next.  B comes and goes, then A is interrupted.
            assert stored(paths, app) == "1"
            if meanwhile is not None:
                upd = subprocess.run([*vmpin_cmd(), "update", app, "--cpuset-cpus", meanwhile],
                                     env=bytecode_env, capture_output=True, text=True,
                                     timeout=60)  # fmt: skip
                assert upd.returncode == 0, upd.stderr
            raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            update_container(paths, app, cpuset_cpus="1", reconciler_factory=interrupted)
        want = meanwhile or "0"  # B's set stands; alone, A's is undone
        assert stored(paths, app) == want
        assert affinities(vmm.pid) == expected(want, thread_names(vmm.pid))
        audit = subprocess.run([*vmpin_cmd(), "audit", "--json"], env=bytecode_env,
                               capture_output=True, text=True, timeout=60)  # fmt: skip
        assert audit.returncode == 0, json.loads(audit.stdout)["violations"]
    finally:
        vmm.kill()
