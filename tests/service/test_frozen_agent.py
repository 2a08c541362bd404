"""A stopped agent stalls no container start (issue 26).

Before, with the agent stopped (SIGSTOP; a stuck disk does the same), every Kata hook, and
every plain hook on a node with VMs, took 6 s, ``vmpin update`` 11 s, and a hook 36 s when
the agent was stopped while it held SQLite's write lock -- past Kata's 10 s hook timeout.
Now no hook or update waits on another process past the budget (vmpin.service.budget,
docs/hooks.md), and then does without: its own pass, pinning from what it can read.

A real agent (``vmpin serve``) is stopped with SIGSTOP:

- ``idle``: between passes;
- ``write-lock``: while a process holds the store's write lock (a helper that begins a write
  transaction and stops itself: for a hook, the same as an agent stopped inside its own);
- ``plan-lock``: while a process holds the node's plan lock (vmpin.state.locks; likewise).

Then a Kata container's hooks against a real QEMU (KVM, thread names), a plain container's
hooks beside it (a real runc container on CPU 1: it takes the VM's 1:1 pin away, and its
poststop gives it back), and a
``vmpin update`` must each return within the budget plus a margin, with every QEMU thread's
``Cpus_allowed_list`` right at once; an update that meets a write lock held past the budget
fails with one line and changes nothing.  Then SIGCONT: the helper lets go, the agent goes
on, applies what the hooks journaled, answers the next update, and audit passes.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.e2e.test_e2e_kata import Kata, affinities, qemu, sid, thread_names
from tests.e2e.test_e2e_runc import runc
from tests.support.agents import AgentProc
from tests.support.qemu_util import QemuHandle, wait_until
from tests.support.runc_util import RuncSession, new_id
from vmpin.linux.paths import HostPaths
from vmpin.service.budget import BUDGET

#: QEMU with KVM (threads named "CPU N/KVM"), runc on the v1 cpuset hierarchy, CPUs 0-1
pytestmark = [pytest.mark.qemu, pytest.mark.kvm, pytest.mark.runc, pytest.mark.cgroup_v1,
              pytest.mark.multi_cpu]  # fmt: skip
__all__ = ["qemu", "runc"]  # the fixtures, imported for this module's tests

#: on top of the budget: a vmpin process's start and imports, and the hook's own pass (one
#: QEMU: ~0.1 s), on a 2-CPU machine other jobs load
MARGIN = 1.0

HOLD = {
    "write-lock": """
import os, signal, sqlite3, sys
db = sqlite3.connect(os.path.join(sys.argv[1], "state.db"), isolation_level=None)
db.execute("BEGIN IMMEDIATE")
print("held", flush=True)
os.kill(os.getpid(), signal.SIGSTOP)
db.execute("ROLLBACK")
""",
    "plan-lock": """
import os, signal, sys, time
from vmpin.state.locks import NodeLock
lock = NodeLock(sys.argv[1])
assert lock.acquire(time.monotonic() + 30)
print("held", flush=True)
os.kill(os.getpid(), signal.SIGSTOP)
lock.close()
""",
}


def run_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0]


def stop(pid: int) -> None:
    os.kill(pid, signal.SIGSTOP)
    assert wait_until(lambda: run_state(pid) == "T", 10), run_state(pid)


def stop_between_writes(pid: int, paths: HostPaths) -> None:
    """Stop the agent where it holds no write transaction: the tests stop it idle, or give
    the lock to a holder of their own (stopped just after a hook's answer, the agent may
    still be writing its pass's bookkeeping; stopped there it would be the holder)."""
    for _ in range(50):
        stop(pid)
        db = sqlite3.connect(os.path.join(paths.state_dir, "state.db"), timeout=0,
                             isolation_level=None)  # fmt: skip
        try:
            db.execute("BEGIN IMMEDIATE")
            db.execute("ROLLBACK")
            return
        except sqlite3.OperationalError:
            os.kill(pid, signal.SIGCONT)
            time.sleep(0.05)
        finally:
            db.close()
    raise AssertionError("the agent held the store's write lock at every stop")


@contextlib.contextmanager
def stopped_holder(
    kind: str, paths: HostPaths, env: dict[str, str]
) -> Iterator[Callable[[], None]]:
    """A process that takes the lock ``kind`` names and stops itself; the function given
    continues it (it lets go and exits).  Killed by its pid whatever happens."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD[kind], paths.state_dir], env=env,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None

    def release() -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
        proc.wait(10)

    try:
        assert proc.stdout.readline() == "held\n"
        assert wait_until(lambda: run_state(proc.pid) == "T", 10)
        yield release
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        proc.stdout.close()


def one_to_one(names: dict[int, str]) -> dict[int, str]:
    """Two vCPUs on host CPUs 0 and 1, one each (topology order); the rest float over both."""
    vcpu = {"CPU 0/KVM": "0", "CPU 1/KVM": "1"}
    return {tid: vcpu.get(name, "0-1") for tid, name in names.items()}


def on(names: dict[int, str], cpus: str) -> dict[int, str]:
    return dict.fromkeys(names, cpus)


def pins(q: QemuHandle, names: dict[int, str]) -> dict[int, str]:
    return {tid: cpus for tid, cpus in affinities(q.pid).items() if tid in names}


def plain_hook(kata: Kata, stage: str, cid: str, bundle: Path, pid: int | None) -> None:
    """runc's hook call for a plain container (no CRI annotations: its own sandbox)."""
    state: dict[str, object] = {"ociVersion": "1.0.2", "id": cid, "bundle": str(bundle),
                                "status": "creating" if pid else "stopped"}  # fmt: skip
    if pid:
        state["pid"] = pid
    proc = kata.vmpin("hook", "--strict", stage, stdin=json.dumps(state))
    assert proc.stderr == "", proc.stderr


@pytest.mark.parametrize("holding", ["idle", "write-lock", "plan-lock"])
def test_hooks_and_update_with_the_agent_stopped(
    qemu: Callable[..., QemuHandle], runc: RuncSession, paths: HostPaths,
    env: dict[str, str], bytecode_env: dict[str, str], tmp_path: Path, holding: str,
) -> None:
    kata = Kata(tmp_path, bytecode_env)
    q = qemu(sid("frz"), smp=2, debug_threads=True)
    agent = AgentProc(paths, env, tmp_path / "agent.log", interval=60)
    ca, cb, plain = f"ca-{os.getpid()}", f"cb-{os.getpid()}", new_id("frz-plain")
    took: dict[str, float] = {}

    def timed(what: str, call: Callable[[], object]) -> None:
        started = time.monotonic()
        call()
        took[what] = round(time.monotonic() - started, 2)

    try:
        agent.wait_ready()
        kata.create_sandbox(q)
        kata.create_container(q, ca, "0")
        names = thread_names(q.pid)
        assert pins(q, names) == on(names, "0")
        stop_between_writes(agent.proc.pid, paths)
        with contextlib.ExitStack() as held:
            if holding != "idle":
                release = held.enter_context(stopped_holder(holding, paths, env))
            # a Kata container on CPU 1: the sandbox's two vCPUs become 1:1
            bundle = kata.bundle(cb, q.sandbox_id, "1", f"ctr-{cb}")
            for stage, state_id in (("prestart", cb), ("createRuntime", cb),
                                    ("poststart", q.sandbox_id)):  # fmt: skip
                timed(f"kata {stage}", lambda: kata.hook(stage, state_id, bundle, q.pid))  # noqa: B023
            assert pins(q, names) == one_to_one(names)
            # a plain container running on CPU 1 beside the VM: CPU 1 is not the VM's alone
            # any more, and when it goes, it is again
            pb = runc.bundle(plain, cpus="1", hooks=None)
            pid = runc.run(plain, pb)
            timed("plain prestart", lambda: plain_hook(kata, "prestart", plain, pb, pid))
            assert pins(q, names) == on(names, "0-1")
            runc.delete(plain)
            timed("plain poststop", lambda: plain_hook(kata, "poststop", plain, pb, None))
            assert pins(q, names) == one_to_one(names)
            # vmpin update: ca to CPU 1, so the sandbox is on CPU 1 alone
            upd: list[subprocess.CompletedProcess[str]] = []
            timed("update", lambda: upd.append(
                kata.vmpin("update", ca, "--cpuset-cpus", "1", check=False)))
            if holding == "write-lock":
                # nothing could be recorded: one line, and nothing changed
                assert upd[0].returncode == 2, upd[0]
                [line] = upd[0].stderr.splitlines()
                assert "locked" in line and "retry" in line, line
                assert pins(q, names) == one_to_one(names)
            else:
                assert upd[0].returncode == 0, upd[0].stderr
                assert pins(q, names) == on(names, "1")
            print(f"agent stopped, {holding}: {took}")
            slow = {k: v for k, v in took.items() if v >= BUDGET + MARGIN}
            assert not slow, f"past the budget ({BUDGET} s + {MARGIN} s): {took}"
            if holding != "idle":
                release()
        os.kill(agent.proc.pid, signal.SIGCONT)
        # the agent goes on: it answers, it applies what the hooks journaled, and it pins
        assert wait_until(lambda: agent.status() is not None, 20)
        after = "0" if holding != "write-lock" else "1"
        out = kata.vmpin("update", ca, "--cpuset-cpus", after)
        assert "re-pinned by the agent" in out.stdout, out.stdout
        assert pins(q, names) == (one_to_one(names) if after == "0" else on(names, "1"))
        listed = {c["id"]: c["cpus"] for c in json.loads(
            kata.vmpin("containers", "--json").stdout)}  # fmt: skip
        assert listed == {q.sandbox_id: None, ca: after, cb: "1"}, listed
        assert kata.vmpin("audit").returncode == 0
        status = agent.status()
        assert status is not None and status["errors"] == 0 and status["healthy"], status
        assert agent.stop() == 0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(agent.proc.pid, signal.SIGCONT)
        agent.kill()
