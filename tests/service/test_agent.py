"""The node agent (``vmpin serve``): the real process, its socket, its passes, its crashes.

Most tests run the agent as a subprocess exactly as an operator would (the ``agents`` fixture,
tests/support/agents.py) and kill it by its pid at the end.  Sandboxes are registered with
the store API; their VMMs are a real QEMU (tests marked ``qemu``) or bench/fakevmm.py's
QEMU-shaped processes where several are needed.  The
:class:`DirtyQueue` tests are plain unit tests on a fake clock.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import random
import signal
import socket
import sqlite3
import stat
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, vmpin_cmd
from tests.support.qemu_util import wait_until
from tests.support.session import new_id
from vmpin.core.cpuset import CpuSet
from vmpin.linux.paths import HostPaths
from vmpin.reconcile.reconciler import Reconciler
from vmpin.service import control
from vmpin.service.agent import Agent, DirtyQueue
from vmpin.state.records import ContainerRec, SandboxRec
from vmpin.state.store import Store

sys.path.insert(0, str(ROOT / "bench"))
from tests.support import fakevmm
from tests.support.agents import AgentProc
from tests.support.counting import CountingAffinity


# -- helpers -------------------------------------------------------------------------------------
def affinities(pid: int) -> dict[int, CpuSet]:
    out = {}
    for t in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            out[int(t)] = CpuSet(os.sched_getaffinity(int(t)))
    return out


def all_on(pid: int, cpus: str) -> bool:
    want = CpuSet.parse(cpus)
    got = affinities(pid)
    return bool(got) and all(a == want for a in got.values())


def metric(port: int, name: str, labels: str = "") -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    key = f"{name}{{{labels}}}" if labels else name
    for line in body.splitlines():
        if line.startswith(key + " "):
            return float(line.split()[-1])
    raise KeyError(key)


@pytest.fixture
def fake_vmms(vm_dir: Path) -> Iterator[Callable[..., fakevmm.FakeVmm]]:
    vmms: list[fakevmm.FakeVmm] = []

    def start(sandbox_id: str, vcpus: int = 2) -> fakevmm.FakeVmm:
        v = fakevmm.start(vm_dir, sandbox_id, vcpus=vcpus)
        vmms.append(v)
        return v

    try:
        yield start
    finally:
        for v in vmms:
            v.kill()


def register(store: Store, sid: str, cpus: str | None) -> None:
    """A Kata sandbox with its pause container and one workload container ``<sid>-app``."""
    store.put_sandbox(SandboxRec(sid, "kata"))
    store.put_container(ContainerRec(sid, sid, True, name="pause"))
    store.put_container(
        ContainerRec(
            f"{sid}-app", sid, False, name="app", cpus=CpuSet.parse(cpus) if cpus else None
        )
    )


def run_cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*vmpin_cmd(), *args], env=env, capture_output=True, text=True, timeout=60
    )


# -- the dirty set, on a fake clock --------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def take(q: DirtyQueue) -> list[str]:
    """The ids of one batch, now (the fake clock never advances by itself)."""
    batch = q.take_batch(timeout=0)
    assert batch is not None
    return [w.sandbox_id for w in batch]


def test_queue_coalesces_while_queued_and_reruns_once_after_a_running_pass() -> None:
    clock = Clock()
    q = DirtyQueue(holdoff=0.1, clock=clock)
    assert q.add("a", "event", clock.now)
    assert not q.add("a", "event", clock.now)  # folded into the queued entry
    batch = q.take_batch(timeout=0)
    assert batch is not None and [(w.sandbox_id, w.cause) for w in batch] == [("a", "event")]
    assert take(q) == []
    # events during the pass: exactly one more pass, after the holdoff
    assert q.add("a", "event", clock.now)
    for _ in range(50):
        assert not q.add("a", "event", clock.now)
    q.done("a")
    assert take(q) == []
    clock.now += 0.1
    assert take(q) == ["a"]
    q.done("a")
    clock.now += 5
    assert take(q) == [] and q.idle()


def test_queue_batch_lists_events_before_background_and_promotes() -> None:
    clock = Clock()
    q = DirtyQueue(holdoff=0.1, clock=clock)
    for sid in ("p1", "p2", "p3"):
        q.add(sid, "periodic")
    clock.now += 1
    q.add("e1", "event", clock.now)
    q.add("p3", "event", clock.now)  # a queued periodic entry becomes an event
    batch = q.take_batch(timeout=0)
    assert batch is not None
    order = [(w.sandbox_id, w.cause) for w in batch]
    assert order[:2] == [("e1", "event"), ("p3", "event")]
    assert sorted(order[2:]) == [("p1", "periodic"), ("p2", "periodic")]
    q.done_all(w.sandbox_id for w in batch)
    assert q.idle()


def test_queue_backoff_doubles_in_a_storm_and_resets_when_quiet() -> None:
    clock = Clock()
    q = DirtyQueue(holdoff=0.1, max_holdoff=1.0, clock=clock)
    starts = []
    end = clock.now + 3.0
    q.add("s", "event", clock.now)
    while clock.now < end:
        if take(q):
            starts.append(round(clock.now - 100, 2))
            q.add("s", "event", clock.now)  # the storm goes on during every pass
            clock.now += 0.005
            q.done("s")
        clock.now += 0.01
    # 0, ~0.1, ~0.3, ~0.7, ~1.5, then once a second: not one pass per event
    assert 5 <= len(starts) <= 7, starts
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert all(g2 >= g1 for g1, g2 in itertools.pairwise(gaps)), gaps
    assert max(gaps) <= 1.03
    while take(q):
        q.done("s")
    clock.now += 1.5  # quiet for longer than the backoff: the next event goes at once
    q.add("s", "event", clock.now)
    assert take(q) == ["s"]


def test_queue_one_batch_takes_every_ready_entry_and_leaves_held_ones() -> None:
    """The coalescing: one node pass covers every sandbox ready when it starts (a full pass
    over n sandboxes is one batch), while a sandbox still in its hold-off waits for its own."""
    clock = Clock()
    q = DirtyQueue(holdoff=0.1, clock=clock)
    q.add("held", "event", clock.now)
    assert take(q) == ["held"]
    q.done("held")  # an event-driven pass just ended: the next event waits 0.1 s
    ids = [f"s{i}" for i in range(500)]
    for sid in ids:
        q.add(sid, "periodic")
    q.add("held", "event", clock.now)
    q.add("e1", "event", clock.now)
    batch = take(q)
    assert batch[0] == "e1" and sorted(batch[1:]) == sorted(ids)
    assert take(q) == []  # "held" waits out its hold-off
    q.add("s7", "event", clock.now)  # during the pass: once more afterwards, no hold-off owed
    q.done_all(batch)
    assert take(q) == ["s7"]
    q.done("s7")
    clock.now += 0.1
    assert take(q) == ["held"]


def test_queue_urgent_event_skips_the_holdoff() -> None:
    """A caller that blocks on the pass (``wait``) is not held off; a plain event is."""
    clock = Clock()
    q = DirtyQueue(holdoff=0.1, clock=clock)
    q.add("a", "event", clock.now)
    assert take(q) == ["a"]
    q.done("a")
    q.add("a", "event", clock.now)
    assert take(q) == []  # held off
    q.add("a", "event", clock.now, urgent=True)  # pulled forward
    assert take(q) == ["a"]
    q.add("a", "event", clock.now, urgent=True)  # during its pass: right after it
    q.done("a")
    assert take(q) == ["a"]
    q.done("a")


def test_queue_kick_asks_for_a_pass_with_nothing_queued() -> None:
    q = DirtyQueue(holdoff=0.1, clock=Clock())
    q.kick()
    assert q.take_batch(timeout=None) == []  # returns at once, an empty batch
    q.close()
    assert q.take_batch() is None


def test_queue_add_all_is_one_step_for_a_waiting_planner() -> None:
    """A full pass queues every sandbox at once: a planner already waiting takes them all in
    one batch (one node pass), never the first few and then the rest."""
    q = DirtyQueue(holdoff=0.1)
    ids = [f"s{i:04d}" for i in range(2000)]
    batches: list[list[str]] = []
    planner = threading.Thread(
        target=lambda: batches.append([w.sandbox_id for w in q.take_batch(timeout=30) or []])
    )
    planner.start()
    time.sleep(0.05)  # let it wait on the queue (the order is not timing: any wait is fine)
    assert q.add_all(ids, "periodic") == [True] * len(ids)
    planner.join(timeout=30)
    assert batches == [ids]
    q.close()


def test_queue_drain_drops_periodic_work_keeps_events() -> None:
    clock = Clock()
    q = DirtyQueue(holdoff=0.1, clock=clock)
    for sid in ("p1", "p2", "p3"):
        q.add(sid, "periodic")
    q.add("e1", "event", clock.now)
    q.add("p2", "event", clock.now)  # promoted: an event now, kept
    assert q.drop_background() == 2
    taken = take(q)
    q.done_all(taken)
    assert sorted(taken) == ["e1", "p2"] and q.idle()


def test_queue_periodic_pass_does_not_delay_an_event() -> None:
    clock = Clock()
    q = DirtyQueue(holdoff=0.1, clock=clock)
    q.add("a", "periodic")
    assert take(q) == ["a"]
    q.add("a", "event", clock.now)  # arrives while the periodic pass runs
    q.done("a")
    batch = q.take_batch(timeout=0)
    assert batch is not None and [(w.sandbox_id, w.cause) for w in batch] == [("a", "event")]


# -- the real process ------------------------------------------------------------------------------
def test_serve_status_socket_metrics_and_clean_sigterm(
    agents: Callable[..., AgentProc], paths: HostPaths, env: dict[str, str]
) -> None:
    agent = agents()
    sock = paths.control_socket
    st = os.stat(sock)
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_uid == os.getuid()

    out = run_cli(env, "--state-dir", paths.state_dir, "status")
    assert out.returncode == 0, out.stderr
    assert "ok=True" in out.stdout and "healthy=True" in out.stdout
    js = json.loads(run_cli(env, "--state-dir", paths.state_dir, "status", "--json").stdout)
    assert js["ok"] is True and js["pid"] == agent.proc.pid

    # metrics on loopback, every family the issue asks for
    body = urllib.request.urlopen(f"http://127.0.0.1:{agent.port}/metrics", timeout=5).read()
    for family in (
        "vmpin_sandboxes",
        "vmpin_containers",
        "vmpin_threads_pinned",
        "vmpin_drift_repaired_total",
        "vmpin_pin_latency_seconds_bucket",
        "vmpin_errors_total",
        "vmpin_plans_total",
        "vmpin_affinity_writes",
    ):
        assert f"\n# TYPE {family}".encode() in body or f"\n{family}".encode() in body, family

    # malformed requests get an answer, not a hang, and count as control errors
    for bad in (
        b"garbage",
        b"[1]",
        b'{"op": "nope"}',
        b'{"op": "dirty", "sandboxes": ["../x"]}',
        b'{"op": "dirty", "sandboxes": "x"}',
    ):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(sock)
            s.sendall(bad + b"\n")
            reply = json.loads(s.makefile().readline())
        assert reply["ok"] is False and reply["error"], bad
    assert metric(agent.port, "vmpin_errors_total", 'kind="control"') == 5

    # a second agent on the same state dir refuses, and the first keeps answering
    second = run_cli(env, "--state-dir", paths.state_dir, "serve", "--metrics-port", "0")
    assert second.returncode != 0
    assert "another vmpin agent" in second.stderr
    assert agent.status() is not None

    assert agent.stop(signal.SIGTERM) == 0
    assert not os.path.lexists(sock)
    out = run_cli(env, "--state-dir", paths.state_dir, "status")
    assert out.returncode == 1

    # structured logs: every stderr line is one JSON object
    lines = agent.log.read_text().splitlines()
    events = [json.loads(line)["event"] for line in lines]
    assert events[0] == "agent started" and events[-1] == "agent stopped"
    # no credentials here: the agent runs as before and says so exactly once
    assert sum(e.startswith("no Kubernetes API configured") for e in events) == 1
    assert all({"ts", "level", "event"} <= set(json.loads(line)) for line in lines)


def test_stale_socket_is_replaced(
    agents: Callable[..., AgentProc], paths: HostPaths
) -> None:
    Store(paths.state_dir).close()
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(paths.control_socket)  # left behind by a kill -9: nobody listens
    stale.close()
    assert control.request(paths, {"op": "status"}) is None
    agent = agents()
    assert agent.status() is not None
    assert stat.S_IMODE(os.stat(paths.control_socket).st_mode) == 0o600


@pytest.mark.qemu
@pytest.mark.kvm  # vCPU threads named "CPU N/KVM"
@pytest.mark.multi_cpu
def test_real_qemu_update_drift_and_vanish(
    agents: Callable[..., AgentProc],
    paths: HostPaths,
    env: dict[str, str],
    vm_dir: Path,
) -> None:
    sbq = new_id("sbq")
    from tests.support.qemu_util import start_qemu

    with (
        start_qemu(vm_dir, sbq, smp=2, debug_threads=True, accel="kvm") as qemu,
        Store(paths.state_dir) as store,
    ):
        register(store, sbq, "1")
        agent = agents()
        assert wait_until(lambda: all_on(qemu.pid, "1"), 10), affinities(qemu.pid)

        # `vmpin update` hands the sandbox to the agent, which re-pins every QEMU thread
        out = run_cli(env, "update", f"{sbq}-app", "--cpuset-cpus", "0")
        assert out.returncode == 0, out.stderr
        assert "by the agent" in out.stdout or "handed to the agent" in out.stdout
        assert wait_until(lambda: all_on(qemu.pid, "0"), 10), affinities(qemu.pid)
        assert metric(agent.port, "vmpin_pin_latency_seconds_count") >= 1

        # drift behind vmpin's back: one vCPU moved by hand, repaired by a periodic pass
        vcpus = [
            t
            for t in qemu.tids()
            if "CPU 1/KVM" in Path(f"/proc/{qemu.pid}/task/{t}/comm").read_text()
        ]
        assert vcpus
        os.sched_setaffinity(vcpus[0], {1})
        assert wait_until(lambda: all_on(qemu.pid, "0"), 10), affinities(qemu.pid)
        assert wait_until(
            lambda: metric(agent.port, "vmpin_drift_repaired_total", 'kind="thread"') >= 1, 5
        )
        st = agent.status(sbq)
        assert st is not None and st["sandbox"]["threads_pinned"] == len(qemu.tids())
        assert metric(agent.port, "vmpin_sandboxes", 'runtime="kata"') == 1
        assert metric(agent.port, "vmpin_containers", 'runtime="kata"') == 2

        # the VMM vanishes without a poststop: the next pass forgets the sandbox
        qemu.kill()
        assert wait_until(lambda: store.sandbox(sbq) is None, 10)
        assert wait_until(
            lambda: metric(agent.port, "vmpin_drift_repaired_total", 'kind="vanished"') == 1, 5
        )
        assert wait_until(lambda: (agent.status() or {}).get("sandboxes") == 0, 5)
        assert agent.stop() == 0


@pytest.mark.multi_cpu
def test_successive_cli_updates_are_all_applied_by_the_agent(
    agents: Callable[..., AgentProc],
    paths: HostPaths,
    env: dict[str, str],
    fake_vmms: Callable[..., fakevmm.FakeVmm],
) -> None:
    """Each `vmpin update` is its own process that opens and closes the database while the
    agent keeps its connections open: every one must be seen and applied by the agent.

    (Regression: a Store that closed a raw fd of the open database dropped the agent's POSIX
    locks, the first CLI to exit then checkpointed and removed the WAL, and the agent read a
    stale snapshot from then on.)"""
    succ = new_id("succ")
    vmm = fake_vmms(succ, vcpus=2)
    with Store(paths.state_dir) as store:
        register(store, succ, "0")
    agents()
    assert wait_until(lambda: all_on(vmm.pid, "0"), 10)
    for cpus in ("1", "0", "1", "0-1", "0"):
        t0 = time.monotonic()
        out = run_cli(env, "update", f"{succ}-app", "--cpuset-cpus", cpus)
        assert out.returncode == 0, out.stderr
        assert "by the agent" in out.stdout or "handed to the agent" in out.stdout, out.stdout
        assert time.monotonic() - t0 < 8
        if cpus != "0-1":
            assert wait_until(lambda cpus=cpus: all_on(vmm.pid, cpus), 5)  # type: ignore[misc]
    with Store(paths.state_dir) as store:
        rec = store.sandbox(succ)
        assert rec is not None and rec.done_gen == rec.gen


@pytest.mark.qemu
@pytest.mark.multi_cpu
def test_storm_of_1000_updates_costs_a_handful_of_plans(
    agents: Callable[..., AgentProc], paths: HostPaths, vm_dir: Path
) -> None:
    storm = new_id("storm")
    from tests.support.qemu_util import start_qemu

    with (
        start_qemu(vm_dir, storm, smp=2, debug_threads=True) as qemu,
        Store(paths.state_dir) as store,
    ):
        register(store, storm, "0-1")
        agent = agents()
        agent.wait_pass(1)
        before = agent.status(storm)
        assert before is not None and before["sandbox"] is not None
        event_plans_before = metric(agent.port, "vmpin_plans_total", 'cause="event"')
        passes_before = int(before["passes"])

        masks = ["0", "1", "0-1"]
        t0 = time.monotonic()
        for i in range(1000):
            store.set_container_cpus(f"{storm}-app", CpuSet.parse(masks[i % 3]), "update")
            assert control.notify(paths, [storm])
        last = "1"  # the storm's last word
        store.set_container_cpus(f"{storm}-app", CpuSet.parse(last), "update")
        assert control.notify(paths, [storm])
        storm_s = time.monotonic() - t0

        assert wait_until(lambda: all_on(qemu.pid, last), 10), affinities(qemu.pid)
        assert wait_until(lambda: store.dirty() == [], 10)
        after = agent.status(storm)
        assert after is not None
        event_plans = metric(agent.port, "vmpin_plans_total", 'cause="event"') - event_plans_before
        plans = int(after["sandbox"]["plans"]) - int(before["sandbox"]["plans"])
        periodic = int(after["passes"]) - passes_before
        print(
            f"storm {storm_s:.2f}s: 1001 updates -> {event_plans:.0f} event plans, "
            f"{plans} plans in all ({periodic} periodic passes ran meanwhile)"
        )
        # passes start at 0, 0.1, 0.3, 0.7, 1.5 s, then once a second (backoff 0.1 s doubling
        # to 1 s): five for a one-second storm, not a thousand
        assert 1 <= event_plans <= 3 + math.log2(1 + storm_s / 0.1) + storm_s
        assert plans <= event_plans + periodic + 1
        assert metric(agent.port, "vmpin_events_total") >= 1001
        # nothing is left to do: the last update is what is pinned, and stays so
        time.sleep(1.0)
        assert all_on(qemu.pid, last)
        rec = store.sandbox(storm)
        assert rec is not None and rec.done_gen == rec.gen
        assert agent.stop() == 0


@pytest.mark.multi_cpu
def test_kill9_mid_churn_then_restart_is_clean(
    agents: Callable[..., AgentProc],
    paths: HostPaths,
    env: dict[str, str],
    fake_vmms: Callable[..., fakevmm.FakeVmm],
) -> None:
    rng = random.Random(7)
    store = Store(paths.state_dir)
    live: dict[str, fakevmm.FakeVmm] = {}
    want: dict[str, str] = {}  # container -> the CPU list it was last given
    serial = [0]

    def create(store: Store) -> None:
        sid = new_id(f"ch{serial[0]}")
        serial[0] += 1
        live[sid] = fake_vmms(sid, vcpus=2)
        cpus = rng.choice(["0", "1", "0-1"])
        register(store, sid, cpus)
        want[f"{sid}-app"] = cpus
        control.notify(paths, [sid])

    for _ in range(6):
        create(store)
    agent = agents()
    stop = threading.Event()
    errors: list[BaseException] = []
    lost = [0]

    def churn() -> None:
        # sqlite connections belong to one thread: the churn opens its own, as a hook would
        try:
            store = Store(paths.state_dir)
            while not stop.is_set():
                r = rng.random()
                if r < 0.8:
                    sid = rng.choice(sorted(live))
                    cpus = rng.choice(["0", "1", "0-1"])
                    store.set_container_cpus(f"{sid}-app", CpuSet.parse(cpus), "update")
                    want[f"{sid}-app"] = cpus
                    if not control.notify(paths, [sid]):
                        lost[0] += 1  # the agent is dead: nobody applies this one
                elif r < 0.9 and len(live) > 3:
                    sid = rng.choice(sorted(live))
                    live.pop(sid).kill()
                    store.delete_container(sid)  # poststop of the pause container
                    want.pop(f"{sid}-app")
                    control.notify(paths, [sid])
                else:
                    create(store)
                time.sleep(0.002)
            store.close()
        except BaseException as err:  # surfaced in the test thread
            errors.append(err)

    t = threading.Thread(target=churn)
    t.start()
    try:
        time.sleep(1.0)
        os.kill(agent.proc.pid, signal.SIGKILL)  # mid-churn, wherever it is
        agent.proc.wait()
        time.sleep(0.5)  # churn goes on with nobody applying it
    finally:
        stop.set()
        t.join()
    assert not errors, errors
    assert lost[0] > 0  # updates were stored while no agent ran
    assert os.path.lexists(paths.control_socket)  # the dead agent's socket is still there

    again = agents()
    again.wait_pass(1)
    done = [json.loads(line) for line in again.log.read_text().splitlines()]
    assert any(d["event"] == "pass done" and d["cause"] == "startup" for d in done)
    audit = run_cli(env, "audit", "--json")
    assert audit.returncode == 0, audit.stdout + audit.stderr
    result = json.loads(audit.stdout)
    assert result["ok"] and result["sandboxes"] == len(live)
    assert store.dirty() == []
    # nothing lost: every container holds the CPUs it was last given, and its VMM runs there
    for cid, cpus in want.items():
        rec = store.container(cid)
        assert rec is not None and rec.cpus == CpuSet.parse(cpus), cid
    for sid, vmm in live.items():
        mask = CpuSet.parse(want[f"{sid}-app"])
        assert all(a.issubset(mask) for a in affinities(vmm.pid).values()), sid
    check = sqlite3.connect(paths.db).execute("PRAGMA integrity_check").fetchone()
    assert check == ("ok",)
    store.close()
    assert again.stop() == 0


@pytest.mark.multi_cpu  # the VMMs start on every CPU, as on a node, so each pin is a change
def test_idle_pass_makes_no_affinity_call(
    paths: HostPaths, fake_vmms: Callable[..., fakevmm.FakeVmm]
) -> None:
    with Store(paths.state_dir) as store:
        for i in range(4):
            sid = new_id(f"idle{i}")
            fake_vmms(sid, vcpus=2)
            register(store, sid, str(i % 2))
    counter = CountingAffinity()
    agent = Agent(
        paths,
        partial(Reconciler, paths, affinity=counter),
        interval=3600,
        workers=2,
        metrics_port=0,
    )
    agent.start()
    try:
        assert wait_until(
            lambda: agent.status()["passes"] == 1 and not agent.status()["pass_running"], 10
        )
        assert counter.sets == 4 * 4  # main, 2 vCPUs, 1 iothread per sandbox
        counter.sets = 0
        for n in (2, 3):
            assert agent.full_pass("periodic")
            assert wait_until(
                lambda n=n: (
                    agent.status()["passes"] == n  # type: ignore[misc]
                    and not agent.status()["pass_running"]
                ),
                10,
            )
        assert counter.sets == 0
        st = agent.status()
        assert st["last_pass_repaired"] == 0 and st["threads_pinned"] == 16
    finally:
        agent.request_stop()
        assert agent.shutdown() == 0


def test_hook_path_does_not_import_the_agent() -> None:
    code = (
        "import sys, vmpin.entry, vmpin.service.hook, vmpin.service.control; "
        "print(sorted(m for m in sys.modules if m.startswith(('prometheus', 'vmpin.service.agent', "
        "'vmpin.service.metrics'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.strip() == "[]"


@pytest.mark.multi_cpu
@pytest.mark.runc
@pytest.mark.cgroup_v1
def test_runc_container_under_agent_kill9_and_restart(
    agents: Callable[..., AgentProc], paths: HostPaths, env: dict[str, str],
    tmp_path: Path,
) -> None:
    """A real runc container whose hooks journal their events for a running agent; the agent
    dies (kill -9), runc update and a hand edit of the cgroup happen while it is down, and one
    pass of the restarted agent puts everything right."""
    from tests.support.runc_util import RuncSession

    agent = agents()
    with RuncSession(paths, tmp_path / "runc-work") as runc:
        cid = new_id("vmpin-agent")
        pid = runc.run(cid, cpus="1")
        cg = Path(f"/sys/fs/cgroup/cpuset/{cid}/cpuset.cpus")

        def listed() -> dict[str, Any]:
            out = run_cli(env, "containers", "--json")
            return {c["id"]: c for c in json.loads(out.stdout)}

        assert listed()[cid]["cpus"] == "1"
        assert run_cli(env, "update", cid, "--cpuset-cpus", "0").returncode == 0
        assert cg.read_text().strip() == "0"

        os.kill(agent.proc.pid, signal.SIGKILL)
        agent.proc.wait(10)
        runc.update(cid, "0-1")  # legitimate, behind vmpin's back
        restarted = agents()
        assert wait_until(lambda: listed()[cid]["cpus"] == "0-1", 10)
        cg.write_text("1")  # drift, behind everyone's back
        assert wait_until(lambda: cg.read_text().strip() == "0-1", 10)
        audit = run_cli(env, "audit", "--json")
        assert audit.returncode == 0, audit.stdout
        with open(f"/proc/{pid}/status") as f:
            assert "Cpus_allowed_list:\t0-1" in f.read()
        runc.delete(cid)
        assert wait_until(lambda: cid not in listed(), 10)
        assert restarted.stop() == 0


# -- one node pass per batch, and the blocking reply ----------------------------------------------
class PassGate:
    """Wraps ``Reconciler.reconcile`` (pytest-mock injects it) to number node passes, log
    their start and end, and hold a pass at its start while the gate is shut."""

    def __init__(self, mocker: Any) -> None:
        self.real = Reconciler.reconcile
        self.log: list[tuple[str, int]] = []
        self.calls = 0
        self.open = threading.Event()
        self.open.set()
        self.held = threading.Event()  # set while a pass waits at the shut gate
        self._lock = threading.Lock()
        mocker.patch.object(Reconciler, "reconcile", autospec=True, side_effect=self._reconcile)

    def _reconcile(self, rec: Reconciler, *args: Any, **kw: Any) -> Any:
        with self._lock:
            self.calls += 1
            n = self.calls
            self.log.append(("start", n))
        if not self.open.is_set():
            self.held.set()
            self.open.wait(60)
        told = rec.on_pinned  # (the agent's: where it answers its waiters)
        if told is not None:

            def pinned() -> object:
                with self._lock:
                    self.log.append(("pinned", n))
                return told()

            rec.on_pinned = pinned
        try:
            return self.real(rec, *args, **kw)
        finally:
            rec.on_pinned = told
            with self._lock:
                self.log.append(("end", n))

    def note(self, what: str) -> None:
        with self._lock:
            self.log.append((what, self.calls))

    def shut_and_hold(self, agent: Agent) -> None:
        """Shut the gate and make the planner run into it (a pass that starts now)."""
        self.held.clear()
        self.open.clear()
        assert agent.full_pass("periodic")
        assert self.held.wait(20)


@pytest.fixture
def inproc_agent(paths: HostPaths) -> Iterator[Callable[..., Agent]]:
    started: list[Agent] = []

    def start(**kw: Any) -> Agent:
        kw = {"interval": 3600, "workers": 2, "metrics_port": 0, **kw}
        agent = Agent(paths, partial(Reconciler, paths), **kw)
        agent.start()
        started.append(agent)
        assert wait_until(
            lambda: agent.status()["passes"] >= 1 and not agent.status()["pass_running"], 20
        )
        return agent

    try:
        yield start
    finally:
        for agent in started:
            if agent._lockfd is not None:  # not shut down by the test itself
                agent.request_stop()
                agent.shutdown()


def dirty_wait(paths: HostPaths, ids: list[str], wait: float) -> dict[str, Any]:
    reply = control.request(paths, {"op": "dirty", "sandboxes": ids, "wait": wait}, wait + 10)
    assert reply is not None
    return reply


@pytest.mark.multi_cpu
def test_a_full_pass_over_n_sandboxes_is_one_node_pass(
    paths: HostPaths,
    fake_vmms: Callable[..., fakevmm.FakeVmm],
    inproc_agent: Callable[..., Agent],
    mocker: Any,
) -> None:
    """Coalescing: every sandbox of a full pass is planned by one Reconciler.reconcile (it
    applies the whole node anyway), not one each -- counted with a spy, not timed."""
    n = 12
    ids = [new_id(f"nb{i}") for i in range(n)]
    with Store(paths.state_dir) as store:
        for i, sid in enumerate(ids):
            fake_vmms(sid, vcpus=2)
            register(store, sid, str(i % 2))
    spy = mocker.spy(Reconciler, "reconcile")
    agent = inproc_agent()
    startup = spy.call_count
    assert 1 <= startup <= 2, spy.call_args_list  # (a watcher event may land in its own)
    first = spy.call_args_list[0].args[1]
    assert sorted(first) == sorted(ids)  # the start-up pass asked about every sandbox at once
    for sid in ids:  # ... and every sandbox was planned by it
        st = agent.status(sid)["sandbox"]
        assert st is not None and st["plans"] >= 1 and st["threads_pinned"] == 4, (sid, st)
    for k in (2, 3):
        before = spy.call_count
        assert agent.full_pass("periodic")
        assert wait_until(
            lambda k=k: (  # type: ignore[misc]
                agent.status()["passes"] == k and not agent.status()["pass_running"]
            ),
            20,
        )
        assert spy.call_count - before == 1
    st = agent.status()
    assert st["node_passes"] == spy.call_count and st["plans"] >= 3 * n
    assert st["last_pass_sandboxes"] == n and st["threads_pinned"] == 4 * n


@pytest.mark.multi_cpu
def test_blocking_dirty_replies_after_a_pass_that_started_after_it(
    paths: HostPaths,
    fake_vmms: Callable[..., fakevmm.FakeVmm],
    inproc_agent: Callable[..., Agent],
    mocker: Any,
) -> None:
    """done:true only once a node pass that *started after the request* has its pins in
    place (Reconciler.on_pinned, before the pass's summary and end): a pass already running
    when it arrives (held here at the gate) does not count, because it may have read the
    store before the caller's write."""
    sid = new_id("blk")
    vmm = fake_vmms(sid, vcpus=2)
    with Store(paths.state_dir) as store:
        register(store, sid, "0")
    gate = PassGate(mocker)
    agent = inproc_agent()
    assert all_on(vmm.pid, "0")
    gate.shut_and_hold(agent)  # pass A runs (held): it started before the request
    held_pass = gate.calls
    events = agent.status()["events"]
    with Store(paths.state_dir) as store:
        store.set_container_cpus(f"{sid}-app", CpuSet.parse("1"), "update")
    replies: list[dict[str, Any]] = []

    def caller() -> None:
        reply = dirty_wait(paths, [sid], 30)
        gate.note("reply")
        replies.append(reply)

    t = threading.Thread(target=caller)
    t.start()
    try:
        assert wait_until(lambda: agent.status()["events"] > events, 10)  # it has arrived
        assert not replies  # held pass A still runs: no answer yet
    finally:
        gate.open.set()
        t.join(40)
    assert replies and replies[0] == {"ok": True, "queued": 1, "done": True}, replies
    # the invariant holds when the caller returns: no waiting on the caller's side
    assert all_on(vmm.pid, "1"), affinities(vmm.pid)
    reply_at = gate.log.index(("reply", gate.calls))
    assert ("start", held_pass + 1) in gate.log[:reply_at]
    assert ("pinned", held_pass + 1) in gate.log[:reply_at]
    # without a pass in the way it is one pass, and the reply says so at once
    with Store(paths.state_dir) as store:
        store.set_container_cpus(f"{sid}-app", CpuSet.parse("0"), "update")
    assert control.notify(paths, [sid], wait=30)
    assert all_on(vmm.pid, "0"), affinities(vmm.pid)
    # with no sandbox named, a pass runs all the same (a journaled hook event, say)
    before = gate.calls
    assert dirty_wait(paths, [], 30) == {"ok": True, "queued": 0, "done": True}
    assert gate.calls > before


@pytest.mark.multi_cpu
def test_blocking_dirty_times_out_with_done_false(
    paths: HostPaths,
    fake_vmms: Callable[..., fakevmm.FakeVmm],
    inproc_agent: Callable[..., Agent],
    mocker: Any,
) -> None:
    sid = new_id("slow")
    fake_vmms(sid, vcpus=2)
    with Store(paths.state_dir) as store:
        register(store, sid, "0")
    gate = PassGate(mocker)
    agent = inproc_agent()
    gate.shut_and_hold(agent)  # a pass that will not end while the caller waits
    try:
        assert dirty_wait(paths, [sid], 0.2) == {"ok": True, "queued": 1, "done": False}
        assert not control.notify(paths, [sid], wait=0.2)  # the caller then does it itself
        assert agent.status()["ok"]  # the accept loop was never blocked
    finally:
        gate.open.set()
    # once the planner is free the queued work runs, and a later blocking call succeeds
    assert control.notify(paths, [sid], wait=30)


@pytest.mark.multi_cpu
def test_blocking_dirty_is_answered_by_the_planner_before_its_thread_wakes(
    paths: HostPaths,
    fake_vmms: Callable[..., fakevmm.FakeVmm],
    inproc_agent: Callable[..., Agent],
    mocker: Any,
) -> None:
    """The answer leaves from the planner at the end of the pass (issue 14: waking the
    connection's thread first cost the waiting hook a thread wake-up and a GIL hand-off);
    a waiter past its deadline answers itself, once."""
    from vmpin.service.server import Reply

    sid = new_id("who")
    vmm = fake_vmms(sid, vcpus=2)
    with Store(paths.state_dir) as store:
        register(store, sid, "0")
    senders: list[tuple[str, dict[str, Any]]] = []
    real_send = Reply.send

    def send(self: Reply, reply: dict[str, Any]) -> None:
        senders.append((threading.current_thread().name, reply))
        real_send(self, reply)

    mocker.patch.object(Reply, "send", send)
    agent = inproc_agent()
    with Store(paths.state_dir) as store:
        store.set_container_cpus(f"{sid}-app", CpuSet.parse("1"), "update")
    assert dirty_wait(paths, [sid], 30) == {"ok": True, "queued": 1, "done": True}
    assert all_on(vmm.pid, "1"), affinities(vmm.pid)
    assert [name for name, _ in senders] == ["vmpin-planner"], senders
    # a pass that does not end in time: the connection's own thread says done:false
    gate = PassGate(mocker)
    gate.shut_and_hold(agent)
    senders.clear()
    try:
        assert dirty_wait(paths, [sid], 0.2) == {"ok": True, "queued": 1, "done": False}
    finally:
        gate.open.set()
    assert [name for name, _ in senders] == ["vmpin-conn"], senders
    # ... and the pass that ends later does not answer it a second time
    assert dirty_wait(paths, [sid], 30)["done"] is True
    assert [name for name, _ in senders] == ["vmpin-conn", "vmpin-planner"], senders


@pytest.mark.multi_cpu
def test_blocking_dirty_publishes_the_guest_map_before_or_after_its_answer(
    paths: HostPaths,
    fake_vmms: Callable[..., fakevmm.FakeVmm],
    inproc_agent: Callable[..., Agent],
    mocker: Any,
) -> None:
    """A hook's wait (the default) is answered once the guest map is on disk: the guest hook
    of the container Kata starts next reads it.  ``vmpin update``'s (``"guest_map":
    "after"``) is answered once the threads are pinned, and the map follows (the guest's
    follower polls for it; issue 14: the map's write was a quarter of the update's wait).
    The publish is held at a gate to see which came first."""
    from vmpin.runtimes import publish

    sid = new_id("gm")
    vmm = fake_vmms(sid, vcpus=1)
    Path(paths.publish_dir, sid, "mounts").mkdir(parents=True)
    map_file = Path(paths.publish_dir, sid, "mounts", "vmpin", "guest-map.json")

    def host_of_vcpu0() -> object:
        try:
            return json.loads(map_file.read_text())["vcpu_to_host"]["0"]
        except (OSError, ValueError, KeyError):
            return None

    with Store(paths.state_dir) as store:
        register(store, sid, "0")
    inproc_agent()
    assert wait_until(lambda: host_of_vcpu0() == 0, 20), map_file
    real_publish = publish.publish_map
    entered, release = threading.Event(), threading.Event()

    def gated(*args: Any, **kw: Any) -> Any:
        entered.set()
        assert release.wait(60)
        return real_publish(*args, **kw)

    mocker.patch.object(publish, "publish_map", side_effect=gated)
    deferred: list[bool] = []  # per pass: were its maps kept for after the answers?
    real_reconcile = Reconciler.reconcile

    def reconcile(rec: Reconciler, *args: Any, **kw: Any) -> Any:
        deferred.append(rec.maps_later is not None)
        return real_reconcile(rec, *args, **kw)

    mocker.patch.object(Reconciler, "reconcile", autospec=True, side_effect=reconcile)
    # vmpin update's wait: the answer comes while the map's write is held
    with Store(paths.state_dir) as store:
        store.set_container_cpus(f"{sid}-app", CpuSet.parse("1"), "update")
    msg = {"op": "dirty", "sandboxes": [sid], "wait": 10, "guest_map": "after"}
    assert control.request(paths, msg, 15) == {"ok": True, "queued": 1, "done": True}
    assert all_on(vmm.pid, "1"), affinities(vmm.pid)
    assert entered.wait(30) and host_of_vcpu0() == 0  # held: not written yet
    assert deferred == [True]
    release.set()
    assert wait_until(lambda: host_of_vcpu0() == 1, 20), map_file
    # a hook's wait: no answer while the map's write is held, and the map is there with it
    entered.clear()
    release.clear()
    with Store(paths.state_dir) as store:
        store.set_container_cpus(f"{sid}-app", CpuSet.parse("0"), "update")
    replies: list[dict[str, Any]] = []
    waiter = threading.Thread(target=lambda: replies.append(dirty_wait(paths, [sid], 30)))
    waiter.start()
    try:
        assert entered.wait(30)
        waiter.join(0.3)
        assert not replies, replies  # the pass is done, but its map is not written yet
    finally:
        release.set()
        waiter.join(40)
    assert replies == [{"ok": True, "queued": 1, "done": True}]
    assert host_of_vcpu0() == 0, map_file.read_text()
    # no one waiting for the pins alone: the maps were written in the pass, as made
    assert deferred == [True, False]


@pytest.mark.multi_cpu
def test_a_pass_frees_the_maps_it_replaced_after_its_answers(
    paths: HostPaths,
    fake_vmms: Callable[..., fakevmm.FakeVmm],
    inproc_agent: Callable[..., Agent],
    mocker: Any,
) -> None:
    """The guest map a pass replaces is held open until the pass has answered (the file
    is freed then, not in the rename a hook waits on: issue 14), and never after."""
    from vmpin.runtimes import publish
    from vmpin.service.server import Reply

    sid = new_id("hm")
    fake_vmms(sid, vcpus=1)
    Path(paths.publish_dir, sid, "mounts").mkdir(parents=True)
    map_file = Path(paths.publish_dir, sid, "mounts", "vmpin", "guest-map.json")
    with Store(paths.state_dir) as store:
        register(store, sid, "0")
    inproc_agent()
    assert wait_until(map_file.exists, 20), map_file
    old_ino = map_file.stat().st_ino
    held_at_answer: list[list[int]] = []
    real_send = Reply.send

    def send(self: Reply, reply: dict[str, Any]) -> None:
        # the old map is open in this process while the waiter is answered
        held_at_answer.append(sorted(_open_inodes(old_ino)))
        real_send(self, reply)

    mocker.patch.object(Reply, "send", send)
    spy = mocker.spy(publish, "publish_map")
    with Store(paths.state_dir) as store:
        store.set_container_cpus(f"{sid}-app", CpuSet.parse("1"), "update")
    assert dirty_wait(paths, [sid], 30)["done"] is True
    assert map_file.stat().st_ino != old_ino
    assert spy.call_args.kwargs["hold"] is not None
    assert held_at_answer and held_at_answer[0] == [old_ino], held_at_answer
    assert wait_until(lambda: not _open_inodes(old_ino), 10)  # then freed


def _open_inodes(ino: int) -> list[int]:
    """The inode ``ino`` when this process holds it open (once per descriptor)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.stat(f"/proc/self/fd/{fd}").st_ino == ino:
                found.append(ino)
        except OSError:
            continue
    return found


def test_blocking_dirty_refuses_a_bad_guest_map_order(
    paths: HostPaths, inproc_agent: Callable[..., Agent]
) -> None:
    inproc_agent()
    msg = {"op": "dirty", "sandboxes": [], "wait": 1, "guest_map": "never"}
    reply = control.request(paths, msg, 10)
    assert reply is not None and reply["ok"] is False and "guest_map" in reply["error"], reply


def test_connection_threads_are_kept_for_the_next_connection(
    paths: HostPaths, inproc_agent: Callable[..., Agent], mocker: Any
) -> None:
    """A connection's thread serves the next one (starting one was ~0.2-0.3 ms of each
    blocking round trip, and handing it over from an accept thread ~0.15 ms): threads wait
    in accept() themselves; a burst gets a thread per connection, at most IDLE_THREADS
    stay, and none is left once the agent stops."""
    from vmpin.service import server

    agent = inproc_agent()
    served: list[threading.Thread] = []  # (the objects: a dead thread's ident is reused)
    real_handle = agent.handle

    def handle(line: bytes, answer: Any = None) -> Any:
        served.append(threading.current_thread())
        return real_handle(line, answer)

    mocker.patch.object(agent, "handle", handle)
    assert agent._server is not None
    agent._server.handle = handle
    for _ in range(8):
        assert dirty_wait(paths, [], 30)["done"] is True
    # (the planner answers before the thread is free again, so the next request may find
    # it still busy: the spare threads take turns, one more is started when none is left)
    assert len(set(served)) <= 4, served

    def conn_threads() -> int:
        return sum(1 for t in threading.enumerate() if t.name == "vmpin-conn")

    replies: list[dict[str, Any]] = []
    callers = [
        threading.Thread(target=lambda: replies.append(dirty_wait(paths, [], 30)))
        for _ in range(20)
    ]
    for t in callers:
        t.start()
    for t in callers:
        t.join(60)
    assert len(replies) == 20 and all(r["done"] for r in replies)
    assert wait_until(lambda: conn_threads() <= server.IDLE_THREADS, 10), conn_threads()
    agent.request_stop()
    assert agent.shutdown() == 0
    assert wait_until(lambda: conn_threads() == 0, 10), conn_threads()


def test_blocking_dirty_refuses_a_bad_wait(
    paths: HostPaths, inproc_agent: Callable[..., Agent]
) -> None:
    agent = inproc_agent()
    before = agent.metrics.registry.get_sample_value("vmpin_errors_total", {"kind": "control"})
    bad = [0, -1, 60.5, 1e9, "1", True, None, [1], {"s": 1}]
    for wait in bad:
        reply = control.request(paths, {"op": "dirty", "sandboxes": [], "wait": wait})
        assert reply is not None and reply["ok"] is False, wait
        assert "wait" in reply["error"] and "\n" not in reply["error"], reply
    # NaN and Infinity are not JSON, but Python's reader takes them
    for raw in (b"NaN", b"Infinity"):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(paths.control_socket)
            s.sendall(b'{"op": "dirty", "sandboxes": [], "wait": ' + raw + b"}\n")
            reply = json.loads(s.makefile().readline())
        assert reply["ok"] is False and "wait" in reply["error"], raw
    after = agent.metrics.registry.get_sample_value("vmpin_errors_total", {"kind": "control"})
    assert after == (before or 0) + len(bad) + 2
    # the edges that are allowed
    assert dirty_wait(paths, [], 60)["done"] is True
    assert dirty_wait(paths, [], 0.001)["ok"] is True


@pytest.mark.multi_cpu
def test_blocking_storm_of_waiters_costs_a_few_node_passes(
    paths: HostPaths,
    fake_vmms: Callable[..., fakevmm.FakeVmm],
    inproc_agent: Callable[..., Agent],
    mocker: Any,
) -> None:
    """Forty callers blocking at once (hooks of a burst of container starts) are all answered
    by the pass that starts after them: the waiters coalesce as the events do."""
    ids = [new_id(f"ws{i}") for i in range(4)]
    with Store(paths.state_dir) as store:
        for sid in ids:
            fake_vmms(sid, vcpus=2)
            register(store, sid, "0")
    gate = PassGate(mocker)
    agent = inproc_agent()
    gate.shut_and_hold(agent)
    first = gate.calls
    replies: list[dict[str, Any]] = []
    lock = threading.Lock()

    def caller(i: int) -> None:
        reply = dirty_wait(paths, [ids[i % len(ids)]], 30)
        with lock:
            replies.append(reply)

    callers = [threading.Thread(target=caller, args=(i,)) for i in range(40)]
    events = agent.status()["events"]
    for t in callers:
        t.start()
    assert wait_until(lambda: agent.status()["events"] >= events + 40, 20)
    gate.open.set()
    for t in callers:
        t.join(40)
    assert len(replies) == 40 and all(r["done"] for r in replies), replies
    assert gate.calls - first <= 2, gate.log  # the one after the held pass (+ a straggler)


@pytest.mark.multi_cpu
def test_drain_answers_waiters_and_exits_clean(
    paths: HostPaths,
    fake_vmms: Callable[..., fakevmm.FakeVmm],
    inproc_agent: Callable[..., Agent],
    mocker: Any,
) -> None:
    """SIGTERM's drain while a pass is stuck: a blocked caller gets done:false (it then pins
    in-process) instead of hanging until its own timeout, and the agent exits 0."""
    sid = new_id("drn")
    fake_vmms(sid, vcpus=2)
    with Store(paths.state_dir) as store:
        register(store, sid, "0")
    gate = PassGate(mocker)
    agent = inproc_agent(drain_timeout=0.2)
    gate.shut_and_hold(agent)
    replies: list[dict[str, Any]] = []
    events = agent.status()["events"]
    t = threading.Thread(target=lambda: replies.append(dirty_wait(paths, [sid], 60)))
    t.start()
    try:
        assert wait_until(lambda: agent.status()["events"] > events, 10)
        agent.request_stop()
        assert agent.shutdown() == 0
        t.join(30)
        assert replies == [{"ok": True, "queued": 1, "done": False}]
        assert not os.path.lexists(paths.control_socket)
    finally:
        gate.open.set()


@pytest.mark.qemu
@pytest.mark.kvm
@pytest.mark.multi_cpu
def test_real_qemu_blocking_notify_returns_with_every_thread_pinned(
    agents: Callable[..., AgentProc], paths: HostPaths, vm_dir: Path
) -> None:
    """The hooks' and `vmpin update`'s contract, against the real agent process and a real
    QEMU: when a blocking notify returns True, every thread already carries the new mask (read
    back from the kernel at once, no waiting)."""
    sid = new_id("bq")
    from tests.support.qemu_util import start_qemu

    with (
        start_qemu(vm_dir, sid, smp=4, debug_threads=True, accel="kvm") as qemu,
        Store(paths.state_dir) as store,
    ):
        register(store, sid, "0-1")
        agent = agents(interval=3600)
        agent.wait_pass(1)
        for cpus in ("1", "0", "1", "0-1", "0", "1") * 3:
            store.set_container_cpus(f"{sid}-app", CpuSet.parse(cpus), "update")
            assert control.notify(paths, [sid], wait=10)
            # (on 0-1 the last two vCPUs get one CPU each: every thread within the mask)
            mask = CpuSet.parse(cpus)
            got = affinities(qemu.pid)
            assert len(got) > 4 and all(a.issubset(mask) for a in got.values()), (cpus, got)
        rec = store.sandbox(sid)
        assert rec is not None and rec.done_gen == rec.gen
        assert agent.stop() == 0


def test_sigusr1_dumps_every_threads_stack(agents: Callable[..., AgentProc]) -> None:
    """An agent that does not stop or answer can be asked what it is doing (faulthandler)."""
    agent = agents(interval=3600)
    agent.wait_pass(1)
    agent.proc.send_signal(signal.SIGUSR1)
    # one header per thread, "Current thread 0x..." for the one holding the GIL if any (an
    # idle agent may have none: then every header is "Thread 0x...")
    headers = "(most recent call first)"
    assert wait_until(lambda: agent.log.read_text(errors="replace").count(headers) >= 2, 10)
    # (the dump is written a frame at a time: read until it got as far as vmpin's frames)
    assert wait_until(
        lambda: "vmpin/service/agent.py" in agent.log.read_text(errors="replace"), 10
    ), agent.log.read_text(errors="replace")  # the main thread and the planner at least
    assert agent.proc.poll() is None  # and it goes on
    assert agent.stop() == 0


def _tgkill(pid: int, tid: int, sig: int) -> None:
    """Send ``sig`` to one thread of another process (tgkill(2): os has no wrapper)."""
    import ctypes
    import platform

    number = {"x86_64": 234, "aarch64": 131}.get(platform.machine())
    if number is None:
        pytest.skip(f"tgkill's syscall number on {platform.machine()} is not known here")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(number, pid, tid, sig) != 0:
        raise OSError(ctypes.get_errno(), "tgkill")


def test_sigterm_taken_by_another_thread_stops_the_agent(
    agents: Callable[..., AgentProc],
) -> None:
    """The kernel may hand SIGTERM to any thread; the main loop must wake up all the same
    (signal.set_wakeup_fd), not sleep until the next periodic pass (an hour here)."""
    agent = agents(interval=3600)
    agent.wait_pass(1)
    pid = agent.proc.pid
    others = [int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid]
    assert others  # the planner, the control socket's accept loop, ...
    _tgkill(pid, others[0], signal.SIGTERM)
    assert agent.proc.wait(timeout=30) == 0
    assert '"stopping"' in agent.log.read_text()
    agent.stop()
