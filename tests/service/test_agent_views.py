"""The read commands through the agent (issue 28): ``containers``, ``sandboxes``, ``show`` and
``audit`` answered from the running agent's plan (vmpin.service.agent_views), printing exactly
what they print when they observe the node themselves.

A real ``vmpin serve`` (as tests/service/test_agent.py starts it, logging at DEBUG so that each
view it answers is a ``view answered`` line) and fake VMMs.  Each test also shows when the
commands do *not* take the agent's answer: no agent, an old agent that refuses the request,
settings other than the agent's.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from pytest_mock import MockerFixture

from tests.service.test_agent import register, run_cli
from tests.support import fakevmm
from tests.support.agents import AgentProc
from tests.support.qemu_util import wait_until
from vmpin.linux.paths import HostPaths
from vmpin.service import control
from vmpin.service.agent_views import AgentViews, _Plan
from vmpin.service.queue import DirtyQueue
from vmpin.service.settings import Settings
from vmpin.state.store import Store
from vmpin.wire.control import MAX_REPLY
from vmpin.wire.control_commands import View

COMMANDS = [
    ["containers"],
    ["sandboxes"],
    ["show", "va"],
    ["audit"],
]


def answered(agent: AgentProc) -> int:
    """How many views the agent has answered (its DEBUG log line for each)."""
    return agent.log.read_text(errors="replace").count('"view answered"')


@pytest.fixture
def debug_env(env: dict[str, str]) -> dict[str, str]:
    return {**env, "VMPIN_LOG_LEVEL": "DEBUG"}


@pytest.fixture
def agents(agents: Callable[..., AgentProc], debug_env: dict[str, str]) -> Callable[..., AgentProc]:
    """The suite's ``agents``, each logging at DEBUG, its interval an hour (a test asks for the
    passes it needs), started after its first pass."""
    return partial(agents, 3600.0, env=debug_env, wait_pass=1)


@pytest.fixture
def node(paths: HostPaths, vm_dir: Path) -> Iterator[dict[str, fakevmm.FakeVmm]]:
    """Three Kata sandboxes with fake VMMs (on CPU 0, CPU 1, no CPU set), and one never
    started; every thread pinned by one pass, as an agent keeps a node."""
    vmms: dict[str, fakevmm.FakeVmm] = {}
    try:
        with Store(paths.state_dir) as store:
            for sid, cpus in (("va", "0"), ("vb", "1"), ("vc", None), ("vn", "0")):
                register(store, sid, cpus)
                if sid != "vn":
                    vmms[sid] = fakevmm.start(vm_dir, sid, vcpus=2)
        yield vmms
    finally:
        for v in vmms.values():
            v.kill()


def outputs(env: dict[str, str], *options: str) -> list[tuple[int, str]]:
    """Each read command's exit code and output, in its table and its --json form."""
    out = []
    for cmd in COMMANDS:
        for form in ([], ["--json"]):
            done = run_cli(env, *options, *cmd, *form)
            assert done.returncode in (0, 1), done.stderr
            out.append((done.returncode, done.stdout))
    return out


@pytest.mark.multi_cpu
def test_every_read_command_prints_the_same_with_and_without_the_agent(
    node: dict[str, fakevmm.FakeVmm],
    agents: Callable[..., AgentProc],
    debug_env: dict[str, str],
) -> None:
    agent = agents()
    assert run_cli(debug_env, "reconcile", "--once").returncode == 0
    agent.wait_pass(1)
    through = outputs(debug_env)
    assert answered(agent) == 2 * len(COMMANDS)  # every one of them the agent's answer
    assert agent.stop() == 0
    alone = outputs(debug_env)
    assert through == alone
    assert all(code == 0 for code, _ in alone)  # (the node as the agent keeps it: audit ok)
    assert json.loads(alone[-1][1])["ok"] is True


@pytest.mark.multi_cpu
def test_audit_through_the_agent_reports_a_thread_moved_by_hand(
    node: dict[str, fakevmm.FakeVmm],
    agents: Callable[..., AgentProc],
    debug_env: dict[str, str],
) -> None:
    """A vCPU moved behind the agent's back since its last pass (its interval is an hour):
    ``audit`` gets a pass that starts after it asks, and that pass's audit reports it."""
    agent = agents()
    vmm = node["va"]
    vcpu = next(
        t for t in vmm.tids()
        if Path(f"/proc/{vmm.pid}/task/{t}/comm").read_text().startswith("CPU 0/")
    )  # fmt: skip
    assert os.sched_getaffinity(vcpu) == {0}
    os.sched_setaffinity(vcpu, {1})
    seen = answered(agent)
    done = run_cli(debug_env, "audit", "--json")
    assert answered(agent) == seen + 1
    assert done.returncode == 1, done.stdout
    drift = [v for v in json.loads(done.stdout)["violations"] if v["tid"] == vcpu]
    assert [(v["kind"], v["desired"], v["actual"]) for v in drift] == [("drift", "0", "1")]
    # that pass also repaired it (the agent's work): the next audit is clean
    assert os.sched_getaffinity(vcpu) == {0}
    again = run_cli(debug_env, "audit")
    assert again.returncode == 0 and answered(agent) == seen + 2, again.stdout


@pytest.mark.multi_cpu
def test_an_update_then_sandboxes_shows_the_new_set(
    node: dict[str, fakevmm.FakeVmm],
    agents: Callable[..., AgentProc],
    debug_env: dict[str, str],
) -> None:
    agent = agents()
    first = run_cli(debug_env, "sandboxes", "--json")
    assert {s["id"]: s["mask"] for s in json.loads(first.stdout)}["va"] == "0"
    assert run_cli(debug_env, "update", "va-app", "--cpuset-cpus", "1").returncode == 0
    seen = answered(agent)
    after = run_cli(debug_env, "sandboxes", "--json")
    assert answered(agent) == seen + 1
    rows = {s["id"]: s for s in json.loads(after.stdout)}
    assert rows["va"]["mask"] == "1" and not rows["va"]["dirty"]
    containers = {r["id"]: r for r in json.loads(run_cli(debug_env, "containers", "--json").stdout)}
    assert containers["va-app"]["cpus"] == "1"
    # and it is what the command sees by itself
    assert agent.stop() == 0
    assert run_cli(debug_env, "sandboxes", "--json").stdout == after.stdout


def test_other_settings_than_the_agents_observe_in_process(
    node: dict[str, fakevmm.FakeVmm],
    agents: Callable[..., AgentProc],
    debug_env: dict[str, str],
    paths: HostPaths,
) -> None:
    agent = agents()
    seen = answered(agent)
    # the agent's own policy, given explicitly: its answer stands
    assert run_cli(debug_env, "--helper-policy", "share", "sandboxes").returncode == 0
    assert answered(agent) == seen + 1
    # another policy, another root: the command observes with its own
    other = {**debug_env, "VMPIN_HELPER_POLICY": "none"}
    for env, options in (
        (debug_env, ["--helper-policy", "isolate", "--housekeeping", "0"]),
        (other, []),
        (debug_env, ["--proc-root", "/proc/"]),
        (debug_env, ["--sysfs-root", "/sys/"]),
    ):
        for cmd in COMMANDS:
            done = run_cli(env, *options, *cmd, "--json")
            assert done.returncode in (0, 1), done.stderr
    assert answered(agent) == seen + 1
    # the agent itself says why (the request carries the command's settings)
    mine = Settings.from_env({"helpers": "isolate"}, debug_env).view_key()
    reply = control.request(paths, View("sandboxes", mine, 1.0).to_obj(), timeout=5)
    assert reply is not None and reply["ok"] is False
    assert "helpers 'isolate' is not the agent's 'share'" in reply["error"]


def test_show_of_a_sandbox_the_agent_does_not_know_is_the_commands_own_error(
    node: dict[str, fakevmm.FakeVmm],
    agents: Callable[..., AgentProc],
    debug_env: dict[str, str],
) -> None:
    agent = agents()
    done = run_cli(debug_env, "show", "nosuch")
    assert done.returncode == 2 and "unknown sandbox 'nosuch'" in done.stderr
    assert answered(agent) == 0


@contextlib.contextmanager
def fake_agent(paths: HostPaths, reply: bytes) -> Iterator[list[bytes]]:
    """A socket where the agent's is, answering every request line with ``reply``."""
    got: list[bytes] = []
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(paths.control_socket)
    sock.listen(8)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            with conn:
                line = b""
                while not line.endswith(b"\n"):
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    line += chunk
                got.append(line)
                with contextlib.suppress(OSError):
                    conn.sendall(reply)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield got
    finally:
        stop.set()
        sock.shutdown(socket.SHUT_RDWR)
        sock.close()
        t.join(5)
        os.unlink(paths.control_socket)


def test_an_old_agent_or_none_at_all_leaves_the_command_to_observe(
    node: dict[str, fakevmm.FakeVmm], debug_env: dict[str, str], paths: HostPaths
) -> None:
    """No agent; an agent from before the view request (it refuses an unknown op); one whose
    answer is of another shape or past the reply limit: the same output each time."""
    alone = outputs(debug_env)
    old = b'{"ok": false, "error": "unknown op \'view\' (dirty, status, reconcile)"}\n'
    for reply in (old, b'{"ok": true}\n', b"not json\n"):
        with fake_agent(paths, reply) as got:
            assert outputs(debug_env) == alone
        assert len(got) == 2 * len(COMMANDS)
        assert all(json.loads(line)["op"] == "view" for line in got)


def test_a_reply_past_the_limit_is_no_answer(paths: HostPaths, state_dir: Path) -> None:
    huge = b'{"ok": true, "view": "audit", "age_s": 0, "pass": 1, "text": "'
    huge += b"x" * MAX_REPLY + b'"}\n'
    settings = Settings(paths).view_key()
    with fake_agent(paths, huge):
        assert control.view(paths, View("audit", settings, 1.0), 10.0) is None
    small = b'{"ok": true, "view": "audit", "age_s": 0.5, "pass": 3, "text": "{}"}\n'
    with fake_agent(paths, small):
        got = control.view(paths, View("audit", settings, 1.0), 10.0)
    assert got is not None and got.text == "{}" and got.number == 3


def test_the_agent_answers_views_from_one_plan_until_the_node_changes(
    node: dict[str, fakevmm.FakeVmm],
    agents: Callable[..., AgentProc],
    debug_env: dict[str, str],
    paths: HostPaths,
) -> None:
    """Nothing changed: each view comes from the same pass's plan, older each time.  A
    commit to the store (here, a new sandbox recorded by another process) makes the next view
    come from a pass that starts after it, which shows the sandbox."""
    agents()
    key = Settings.from_env({}, debug_env).view_key()

    def ask(view: str, **kw: Any) -> dict[str, Any]:
        reply = control.request(paths, View(view, key, 5.0, **kw).to_obj(), timeout=10)
        assert reply is not None and reply["ok"], reply
        return reply

    first, second = ask("sandboxes"), ask("containers")
    assert first["pass"] == second["pass"] and second["age_s"] >= first["age_s"]
    with Store(paths.state_dir) as store:
        register(store, "vd", "1")
    third = ask("sandboxes")
    assert third["pass"] > first["pass"]
    assert "vd" in {s["id"] for s in json.loads(third["text"])}
    # ``audit`` reads the host again after it asks: from a later pass when the plan it finds
    # is not one a pass would make again; else (the node as that pass left it, every value
    # it read from the host read again and equal: Observer.still) from that plan, no pass
    audits = [ask("audit", fresh=True) for _ in range(3)]
    assert audits[0]["pass"] >= third["pass"]
    assert audits[2]["pass"] == audits[1]["pass"] and audits[2]["text"] == audits[1]["text"]
    assert json.loads(audits[2]["text"])["ok"] is True
    # an old plan is not taken past max_age
    assert wait_until(lambda: ask("sandboxes", max_age=0.01)["pass"] > audits[2]["pass"], 10)
    assert json.loads(ask("show", sandbox="vd")["text"])["id"] == "vd"


def test_an_answer_from_the_agent_loads_neither_typing_nor_sqlite(
    env: dict[str, str], paths: HostPaths
) -> None:
    """The read commands are on the fast route (vmpin/lean): an answer from the agent is
    printed without the store (SQLite) or ``typing`` loaded."""
    reply = b'{"ok": true, "view": "sandboxes", "age_s": 0.1, "pass": 4, "text": "[]"}\n'
    lean_env = {k: v for k, v in env.items() if k != "VMPIN_CHECK_VIEWS"}  # (pydantic's)
    with fake_agent(paths, reply):
        done = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "vmpin", "sandboxes", "--json"],
            env=lean_env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert done.returncode == 0 and done.stdout == "[]\n", done.stderr[-2000:]
    loaded = {line.split("|")[-1].strip() for line in done.stderr.splitlines() if "|" in line}
    assert "vmpin.service.control" in loaded
    assert not loaded & {"typing", "_sqlite3", "sqlite3", "vmpin.state.store"}


def test_which_pass_a_view_answers_from(paths: HostPaths) -> None:
    """The rules of vmpin.service.agent_views on plans made by hand: a pass asked for answers
    when it read the whole node and changed nothing, or when it is the last try, or for
    ``audit``; an event's pass (which did not read everything) never does: it leaves no
    plan (test_an_events_pass_leaves_the_views_no_plan_and_reads_no_version)."""
    views = AgentViews(paths.state_dir, Settings(paths), DirtyQueue())
    req, audit = View("sandboxes", {}, 1.0), View("audit", {}, 1.0, fresh=True)

    def made(number: int, clean: bool) -> Any:
        return _Plan(number, None, None, clean, 1)  # type: ignore[arg-type]

    unclean, clean, event = made(5, False), made(5, True), None
    assert views._verdict(clean, 5, req, last_try=False) == "answer"
    assert views._verdict(unclean, 5, req, last_try=False) == "ask"
    assert views._verdict(unclean, 5, req, last_try=True) == "answer"
    assert views._verdict(unclean, 5, audit, last_try=False) == "answer"
    assert views._verdict(clean, 6, req, last_try=True) == "wait"  # (older than asked for)
    assert views._verdict(event, 6, req, last_try=True) == "wait"
    assert views._verdict(event, 0, req, last_try=False) == "ask"
    assert views._verdict(None, 0, req, last_try=False) == "ask"
    views.close()


def test_an_events_pass_leaves_the_views_no_plan_and_reads_no_version(
    paths: HostPaths, mocker: MockerFixture
) -> None:
    """No view is answered from an event's pass (it read its own sandboxes alone), so the
    views neither keep its plan nor read the store's versions for it: two SQLite reads of
    every pass under churn.  A full pass's plan is kept, with both."""
    from types import SimpleNamespace

    views = AgentViews(paths.state_dir, Settings(paths), DirtyQueue())
    reads = mocker.spy(views, "_data_version")
    store = mocker.Mock()
    store.version.return_value = (7, 0)
    for number, read_all in ((1, False), (2, True)):
        rec = SimpleNamespace(last_observed=(None, None, (7, 0), read_all), last_writes=0,
                              online_seen=None, domains=object())  # fmt: skip
        views.pass_begins(number)
        views.pass_ends(number, True, store, rec)  # type: ignore[arg-type]
        if not read_all:
            assert views._plan is None
            assert reads.call_count == 0 and store.version.call_count == 0
    p = views._plan
    assert p is not None and p.number == 2 and p.clean
    assert reads.call_count == 1 and store.version.call_count == 1
    views.close()
