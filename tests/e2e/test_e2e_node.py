"""The node-wide invariant on two real QEMU sandboxes, with and without the agent (issue 9).

After every hook, ``vmpin update`` and poststop returns, invariants 1, 3 and 4 are read
straight from /proc (``Cpus_allowed_list`` of every QEMU thread) and ``vmpin audit`` must
agree: exit 0 exactly when they hold.  A hand-made double pin makes both say no.  Read-only
commands leave ``state.db`` byte-identical.  (Invariant 2 and 5 need kubelet's checkpoint:
see test_conflict_is_reported_with_both_claimants.)
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.e2e.test_e2e_kata import Kata, affinities, qemu, sid, thread_names
from tests.support.agents import AgentProc
from tests.support.kubelet_util import write_checkpoint
from tests.support.qemu_util import QemuHandle
from vmpin.core.cpuset import CpuSet
from vmpin.linux.paths import HostPaths

#: real QEMUs, plans over host CPUs 0 and 1.
pytestmark = [pytest.mark.qemu, pytest.mark.multi_cpu]
__all__ = ["qemu"]  # the fixture, imported for this module's tests


@pytest.fixture
def kata(tmp_path: Path, env: dict[str, str]) -> Kata:
    return Kata(tmp_path, env)


def proc_problems(kata: Kata, qs: list[QemuHandle]) -> list[str]:
    """Invariants 1 and 3, from /proc: the plan comes from ``show``, the truth from /proc."""
    problems = []
    aff = {q.sandbox_id: affinities(q.pid) for q in qs}
    for q in qs:
        shown = kata.vmpin("show", q.sandbox_id, "--json", check=False)
        if shown.returncode != 0:
            continue  # not tracked: vmpin plans nothing for it (its threads count as others')
        show = json.loads(shown.stdout)
        for t in show["threads"]:  # type: ignore[attr-defined]
            actual = aff[q.sandbox_id].get(t["tid"])
            if actual is None:
                continue
            if t["desired"] is not None and actual != t["desired"]:
                problems.append(f"{q.sandbox_id} tid {t['tid']}: {actual} != {t['desired']}")
            if show["mode"] == "1:1" and t["role"] == "vcpu":
                cpu = int(t["desired"])
                for other, threads in aff.items():
                    if other == q.sandbox_id:
                        continue
                    for tid, a in threads.items():
                        if cpu in CpuSet.parse(a):
                            problems.append(f"CPU {cpu}: 1:1 for {q.sandbox_id}, and {other}/{tid}")
    return problems


def audit_ok(kata: Kata) -> tuple[bool, list[dict[str, object]]]:
    out = kata.vmpin("audit", "--json", check=False)
    data = json.loads(out.stdout)
    assert (out.returncode == 0) == data["ok"]
    return data["ok"], data["violations"]


def holds(kata: Kata, qs: list[QemuHandle]) -> None:
    problems = proc_problems(kata, qs)
    ok, violations = audit_ok(kata)
    assert not problems, problems
    assert ok, violations


def mode(kata: Kata, q: QemuHandle) -> str:
    return str(kata.show(q.sandbox_id)["mode"])


def vcpu_tid(q: QemuHandle) -> int:
    return next(t for t, n in thread_names(q.pid).items() if n == "CPU 0/KVM")


def scenario(kata: Kata, qemu: Callable[..., QemuHandle]) -> None:
    a = qemu(sid("na"), smp=1, debug_threads=True)
    b = qemu(sid("nb"), smp=1, debug_threads=True)
    ca, cb = f"ca-{uuid.uuid4().hex[:6]}", f"cb-{uuid.uuid4().hex[:6]}"
    before_b = set(affinities(b.pid).values())

    kata.create_sandbox(a)
    kata.create_container(a, ca, "0")
    # B runs in the VM dir, untracked, floating over every CPU: A may not be 1:1 on CPU 0
    assert mode(kata, a) == "float"
    holds(kata, [a, b])

    kata.create_sandbox(b)
    bundle_b = kata.create_container(b, cb, "1")
    # B's hook re-planned the node: A too is now 1:1 (nobody else may run on CPU 0)
    assert (mode(kata, a), mode(kata, b)) == ("1:1", "1:1")
    assert set(affinities(a.pid).values()) == {"0"} and set(affinities(b.pid).values()) == {"1"}
    holds(kata, [a, b])

    kata.vmpin("update", cb, "--cpuset-cpus", "0-1")
    # B now shares CPU 0 with A: A's 1:1 pin is given up, not kept next to B's threads
    assert mode(kata, a) == "float"
    holds(kata, [a, b])

    kata.vmpin("update", cb, "--cpuset-cpus", "1")
    assert (mode(kata, a), mode(kata, b)) == ("1:1", "1:1")
    holds(kata, [a, b])

    # a hand-made double pin: /proc and audit both say no, a pass repairs it
    os.sched_setaffinity(vcpu_tid(b), {0})
    assert proc_problems(kata, [a, b])
    ok, violations = audit_ok(kata)
    assert not ok and {"double-pin", "drift"} <= {v["kind"] for v in violations}
    kata.vmpin("reconcile", "--once")
    holds(kata, [a, b])

    # B's last container with a CPU set leaves: B's threads get back what they had (inv. 4)
    kata.hook("poststop", b.sandbox_id, bundle_b, None)
    assert set(affinities(b.pid).values()) == before_b
    assert mode(kata, a) == "float"  # B floats over every CPU again
    holds(kata, [a, b])


@pytest.mark.kvm  # vcpu_tid: threads named "CPU N/KVM"
def test_two_sandboxes_without_agent(qemu: Callable[..., QemuHandle], kata: Kata) -> None:
    scenario(kata, qemu)


@pytest.mark.kvm  # vcpu_tid: threads named "CPU N/KVM"
def test_two_sandboxes_with_agent(
    qemu: Callable[..., QemuHandle], kata: Kata, paths: HostPaths, env: dict[str, str],
    tmp_path: Path,
) -> None:
    agent = AgentProc(paths, env, tmp_path / "agent.log", interval=60)
    try:
        agent.wait_ready()
        scenario(kata, qemu)
    finally:
        agent.stop()


def _digest(state_dir: str) -> dict[str, str]:
    out = {}
    # state.db and its WAL; -shm is SQLite's shared-memory index, where every reader takes
    # a read mark (it is rebuilt from the WAL, never the data)
    for name in ("state.db", "state.db-wal"):
        p = os.path.join(state_dir, name)
        if os.path.isfile(p):
            with open(p, "rb") as f:
                out[name] = hashlib.sha256(f.read()).hexdigest()
    return out


def test_read_only_commands_leave_state_byte_identical(
    qemu: Callable[..., QemuHandle], kata: Kata, paths: HostPaths
) -> None:
    a = qemu(sid("ro"), smp=1)
    ca = f"ro-{uuid.uuid4().hex[:6]}"
    kata.create_sandbox(a)
    kata.create_container(a, ca, "1")
    # the VMM is killed: a writing pass would forget it; reading must not
    a.kill()
    before = _digest(paths.state_dir)
    assert "state.db" in before
    for args in (["containers"], ["sandboxes"], ["show", a.sandbox_id], ["guest-map", ca],
                 ["audit"], ["topology"], ["containers", "--json"], ["sandboxes", "--json"],
                 ["show", a.sandbox_id, "--json"], ["audit", "--json"]):
        kata.vmpin(*args, check=False)
    assert _digest(paths.state_dir) == before
    listed = json.loads(kata.vmpin("sandboxes", "--json").stdout)
    # fresh from the host: the sandbox is shown as vanished, and still in the store
    assert [(s["id"], s["vanished"], s["host_differs"]) for s in listed] == [
        (a.sandbox_id, True, True)]


def test_conflict_is_reported_with_both_claimants(
    qemu: Callable[..., QemuHandle], kata: Kata, paths: HostPaths
) -> None:
    """kubelet gives CPU 1 to pod A alone (the pool is CPU 0); pod B is then given CPU 1 by
    ``vmpin update``: a conflict naming both, never merged into anyone's 1:1 pin."""
    a = qemu(sid("cfa"), smp=1)
    b = qemu(sid("cfb"), smp=1)
    x, y = f"x-{uuid.uuid4().hex[:6]}", f"y-{uuid.uuid4().hex[:6]}"
    write_checkpoint(paths.kubelet_state, "0", {f"uid-{a.sandbox_id}": {f"ctr-{x}": "1"}})
    kata.create_sandbox(a)
    kata.create_container(a, x, "1")
    kata.create_sandbox(b)
    kata.create_container(b, y, "0")
    assert audit_ok(kata)[0]
    kata.vmpin("update", y, "--cpuset-cpus", "1")
    ok, violations = audit_ok(kata)
    assert not ok
    [conflict] = [v for v in violations if v["kind"] == "conflict"]
    claimants = conflict["claimants"]
    assert {(c["sandbox"], c["source"]) for c in claimants} == {  # type: ignore[attr-defined]
        (a.sandbox_id, "kubelet"), (b.sandbox_id, "vmpin")}
    assert conflict["actual"] == "1"
    assert mode(kata, a) != "1:1" and mode(kata, b) != "1:1"
