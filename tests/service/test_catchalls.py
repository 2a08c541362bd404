"""Fault injection into the host side's catch-alls: what keeps a node alive when something
nobody foresaw goes wrong, and the control socket's last line of defence.

- ``vmpin hook``: any unforeseen exception is one line and exit 0 (fail-open), ``--strict``
  exit 1, and nothing is journaled half-way;
- the agent: a worker survives a sandbox whose pass crashes, and goes on serving the others;
- the control socket: a connection from another uid is closed unanswered (SO_PEERCRED), even
  when the socket file's mode would let it in;
- a Kata hook with the agent up hands its sandbox to the agent, which pins it.

Faults are injected at library edges (``os.fsync``, the affinity backend) with exceptions no
code path expects, standing in for bugs; everything else is real (processes, sockets, QEMU).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import socket
import sys
import tempfile
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from pytest_mock import MockerFixture

from tests.e2e.test_e2e_kata import Kata, affinities
from tests.service.test_agent import all_on, metric, register
from tests.support import fakevmm
from tests.support.agents import AgentProc
from tests.support.qemu_util import QemuHandle, qemu_factory, wait_until
from tests.support.session import new_id
from vmpin.core.cpuset import CpuSet
from vmpin.linux.affinity import SchedAffinity
from vmpin.linux.paths import HostPaths
from vmpin.reconcile.reconciler import Reconciler
from vmpin.service import control, hook
from vmpin.service.agent import Agent
from vmpin.state.journal import read_event
from vmpin.state.store import Store

NOBODY = 65534


class InjectedBug(Exception):
    """Not a VmpinError, not an OSError: what a catch-all is for."""


# -- the OCI hook fails open -------------------------------------------------------------------
def test_hook_unforeseen_error_is_fail_open(
    paths: HostPaths, tmp_path: Path, mocker: MockerFixture,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "config.json").write_text(json.dumps({"ociVersion": "1.0.2", "linux": {}}))
    state = {"ociVersion": "1.0.2", "id": new_id("ctr"), "status": "creating",
             "pid": os.getpid(), "bundle": str(bundle)}
    opts = {"state_dir": paths.state_dir, "vm_dir": paths.vm_dir, "runc_root": paths.runc_root}

    def run(*args: str) -> tuple[int, list[str]]:
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(json.dumps(state).encode())))
        rc = hook.main(opts, [*args, "prestart"])
        out, err = capsys.readouterr()
        assert out == ""
        return rc, err.splitlines()

    mocker.patch("os.fsync", side_effect=InjectedBug("injected: a bug"))
    assert run() == (0, ["vmpin hook prestart: unexpected InjectedBug: injected: a bug"])
    rc, lines = run("--strict")
    assert rc == 1 and len(lines) == 1 and "unexpected InjectedBug" in lines[0]
    # nothing journaled half-way: no temp file left for the store to trip on.  The event is
    # renamed into place before its sync (the sync failed here), so what the journal holds
    # is whole events of this container, which the next ingest applies: the start went on
    # (fail-open), and the store hears of it
    files = [p for p in Path(paths.state_dir).rglob("*") if p.is_file()]
    assert files and all(p.parent.name == "journal" and p.suffix == ".json" for p in files)
    assert {read_event(paths.state_dir, p.name).id for p in files} == {state["id"]}

    mocker.stopall()  # without the fault the same hook journals its event
    assert run("--strict") == (0, [])
    with Store(paths.state_dir) as store:
        assert store.container(state["id"]) is not None


# -- the agent: a worker outlives a crashing sandbox -------------------------------------------
class CrashingAffinity:
    """The real affinity backend, except for one process's threads: setting them raises."""

    def __init__(self, crash_pid: int) -> None:
        self.inner = SchedAffinity()
        self.crash_pid = crash_pid

    def get(self, tid: int) -> CpuSet:
        return self.inner.get(tid)

    def set(self, tid: int, cpus: CpuSet) -> CpuSet:
        if os.path.exists(f"/proc/{self.crash_pid}/task/{tid}"):
            raise InjectedBug(f"injected: a bug pinning tid {tid}")
        return self.inner.set(tid, cpus)


@pytest.mark.multi_cpu
def test_agent_worker_survives_a_crashing_sandbox(
    paths: HostPaths, vmms: Callable[[str], fakevmm.FakeVmm]
) -> None:
    bad_id, good_id = new_id("crash"), new_id("fine")
    bad, good = vmms(bad_id), vmms(good_id)
    with Store(paths.state_dir) as store:
        register(store, bad_id, "1")
        register(store, good_id, "1")
    agent = Agent(
        paths, partial(Reconciler, paths, affinity=CrashingAffinity(bad.pid)),
        interval=3600, workers=1, metrics_port=0,
    )
    agent.start()
    try:
        assert wait_until(
            lambda: agent.status()["passes"] >= 1 and not agent.status()["pass_running"], 20
        )
        assert all_on(good.pid, "1"), affinities(good.pid)
        st = agent.status()
        assert st["errors"] >= 1 and st["workers"] == 1 and st["healthy"], st
        # the one worker is still there: a later update of the good sandbox is applied ...
        with Store(paths.state_dir) as store:
            store.set_container_cpus(f"{good_id}-app", CpuSet.parse("0"), "update")
        assert control.notify(paths, [good_id])
        assert wait_until(lambda: all_on(good.pid, "0"), 20), affinities(good.pid)
        # ... and the bad one, asked again, fails again without taking anything down
        errors = agent.status()["errors"]
        assert control.notify(paths, [bad_id])
        assert wait_until(lambda: agent.status()["errors"] > errors, 20)
        assert agent.status()["workers"] == 1
        assert set(affinities(bad.pid).values()) == {"0-1"}  # never pinned
    finally:
        agent.request_stop()
        assert agent.shutdown() == 0


# -- the control socket refuses other uids -----------------------------------------------------
def as_nobody(sock_path: str) -> dict[str, Any]:
    """A real client of another uid: a forked child drops to nobody, connects, asks for the
    status and reports (through a pipe) its euid and whatever reply it got."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no pytest machinery from here on, only os._exit
        code = 1
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(10)
            s.connect(sock_path)
            buf = b""
            try:  # the agent may close it before the request is even sent: EPIPE
                s.sendall(b'{"op": "status"}\n')
                while chunk := s.recv(65536):
                    buf += chunk
            except (BrokenPipeError, ConnectionResetError):
                pass
            os.write(w, json.dumps({"uid": os.geteuid(), "reply": buf.decode()}).encode())
            code = 0
        except BaseException as err:
            os.write(w, json.dumps({"error": repr(err)}).encode())
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    seen: dict[str, Any] = json.loads(data)
    assert os.waitstatus_to_exitcode(status) == 0, seen
    return seen


@pytest.fixture
def open_state_dir() -> Iterator[HostPaths]:
    """A state dir another uid can reach (tmp_path's parents are 0700 root)."""
    top = tempfile.mkdtemp(prefix=new_id("vmpin-peer") + "-", dir="/tmp")
    try:
        os.chmod(top, 0o755)
        yield HostPaths(state_dir=os.path.join(top, "state"), vm_dir=os.path.join(top, "vm"))
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_control_socket_refuses_another_uid(open_state_dir: HostPaths) -> None:
    if os.geteuid() != 0:
        pytest.fail("needs root to run a peer as another uid")
    paths = open_state_dir
    agent = Agent(paths, partial(Reconciler, paths), interval=3600, workers=1, metrics_port=0)
    agent.start()
    try:
        os.chmod(paths.state_dir, 0o755)
        os.chmod(paths.control_socket, 0o666)  # the file mode no longer protects it ...

        def refused() -> float:
            v = agent.metrics.registry.get_sample_value("vmpin_errors_total", {"kind": "control"})
            return v or 0.0

        before = refused()
        seen = as_nobody(paths.control_socket)  # the kernel lets it connect ...
        assert seen == {"uid": NOBODY, "reply": ""}  # ... SO_PEERCRED does not: no answer
        assert refused() == before + 1
        reply = control.request(paths, {"op": "status"})  # root is still served
        assert reply is not None and reply["ok"]
    finally:
        agent.request_stop()
        assert agent.shutdown() == 0


# -- a Kata hook with the agent up -------------------------------------------------------------
@pytest.fixture
def qemu(vm_dir: Path) -> Iterator[Callable[..., QemuHandle]]:
    with qemu_factory(vm_dir) as start:
        yield start


@pytest.mark.qemu
@pytest.mark.multi_cpu
def test_kata_hook_with_the_agent_up_hands_over(
    qemu: Callable[..., QemuHandle], paths: HostPaths, env: dict[str, str], tmp_path: Path
) -> None:
    agent = AgentProc(paths, env, tmp_path / "agent.log", interval=3600)
    try:
        agent.wait_ready()
        q = qemu(new_id("kup"), smp=2, debug_threads=True)
        kata = Kata(tmp_path, env)
        kata.create_sandbox(q)  # each hook: exit 0, nothing on stderr (Kata.hook checks)
        kata.create_container(q, "c-up", "1")
        # the agent, not the hook, planned it: its event plans count, and QEMU lands on CPU 1
        assert wait_until(lambda: all_on(q.pid, "1"), 20), affinities(q.pid)
        assert metric(agent.port, "vmpin_events_total") >= 1
        assert metric(agent.port, "vmpin_plans_total", 'cause="event"') >= 1
        st = agent.status(q.sandbox_id)
        assert st is not None and st["sandbox"] is not None and st["sandbox"]["plans"] >= 1, st
        assert agent.stop() == 0
    finally:
        agent.kill()


# -- a store that cannot be written does not leave a VM floating -------------------------------
@pytest.mark.multi_cpu  # the fake VMM starts on every CPU, so its first pin is a real change
def test_first_pin_goes_ahead_when_the_store_cannot_be_written(
    paths: HostPaths, vmms: Callable[[str], fakevmm.FakeVmm], mocker: MockerFixture
) -> None:
    """A full disk fails the record of the threads' original affinities (taken before the
    first pin): the sandbox is pinned from the host's truth anyway."""
    import sqlite3

    sid = new_id("full")
    vmm = vmms(sid)
    with Store(paths.state_dir) as store:
        register(store, sid, "1")
    assert not all_on(vmm.pid, "1")
    mocker.patch.object(
        Store, "set_meta", side_effect=sqlite3.OperationalError("database or disk is full")
    )
    # the pass's own record at its end fails too, and that failure reaches the caller (the
    # agent turns it into `store_error`): but only after the host was brought into line
    with Store(paths.state_dir) as store, pytest.raises(sqlite3.OperationalError):
        Reconciler(paths, store).reconcile([sid])
    assert all_on(vmm.pid, "1"), affinities(vmm.pid)
