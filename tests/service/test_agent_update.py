"""``vmpin update`` done by the agent (the control socket's ``update``; issue 28), and the
race it must not lose (issue 26): a caller that gave up at its deadline and wrote the set
itself is never overwritten by an agent that had the request in hand meanwhile."""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.service.test_agent import all_on, register, run_cli
from tests.support import fakevmm
from tests.support.agents import AgentProc
from tests.support.qemu_util import wait_until
from tests.support.session import new_id
from vmpin.core.cpuset import CpuSet
from vmpin.linux.paths import HostPaths
from vmpin.service import control
from vmpin.service.agent_updates import AgentUpdates
from vmpin.service.update import update_container
from vmpin.state.records import ContainerRec, SandboxRec
from vmpin.state.store import Store
from vmpin.wire.control import request_to_json
from vmpin.wire.control_commands import request_from_json
from vmpin.wire.control_update import Update, UpdateReply


def _container(paths: HostPaths, cpus: str = "0") -> str:
    cid = new_id("aupd")
    with Store(paths.state_dir) as store:
        store.put_sandbox(SandboxRec(cid, "runc"))
        store.put_container(ContainerRec(cid, cid, True, cpus=CpuSet.parse(cpus),
                                         cpus_source="spec"))  # fmt: skip
    return cid


def _stored(paths: HostPaths, cid: str) -> tuple[str | None, str | None]:
    with Store(paths.state_dir) as store:
        rec = store.container(cid)
    assert rec is not None
    return (None if rec.cpus is None else rec.cpus.to_list()), rec.cpus_source


def _request(paths: HostPaths, cid: str, cpus: str, within: float = 1.0) -> Update:
    return Update(cid, cpus, time.monotonic() + within, within, dict(paths._asdict()))


class Planner:
    """Stands for the agent's planner: runs the update's ``meanwhile`` and answers as a pass
    that ended (``ok``) or as none in time, after ``during`` (what happens while it runs)."""

    def __init__(self, ok: bool = True, during: Callable[[], object] | None = None) -> None:
        self.ok, self.during = ok, during
        self.asked: list[str] = []

    def __call__(
        self,
        sid: str,
        wait: float,
        answer: Any,
        done: dict[str, Any],
        meanwhile: Callable[[], object],
    ) -> dict[str, Any]:
        self.asked.append(sid)
        meanwhile()
        if self.during is not None:
            self.during()
        if self.ok and done.get("done"):
            return done
        return {"ok": True, "queued": 1, "done": False}


# -- the wire ------------------------------------------------------------------------------------
def test_the_request_reads_back_as_written(paths: HostPaths) -> None:
    req = _request(paths, "c1", "0-3")
    assert request_from_json(request_to_json(req)) == req


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"container": "../x"}, "container id"),
        ({"cpus": 3}, "'cpus'"),
        ({"until": float("nan")}, "'until'"),
        ({"until": True}, "'until'"),
        ({"wait": 0}, "'wait'"),
        ({"roots": {"sys": 1}}, "'roots'"),
    ],
)
def test_a_malformed_request_is_refused(
    paths: HostPaths, change: dict[str, object], error: str
) -> None:
    from vmpin.core.errors import WireError

    obj = _request(paths, "c1", "0").to_obj() | change
    with pytest.raises(WireError, match=error):
        request_from_json(request_to_json(obj))


def test_a_reply_of_another_shape_is_no_answer() -> None:
    assert UpdateReply.from_obj({"ok": True, "queued": 1, "done": True}) is None  # a dirty's
    assert UpdateReply.from_obj({"ok": False, "error": "unknown op 'update'"}) is None
    assert UpdateReply.from_obj({"ok": True, "done": False, "error": "x"}) == UpdateReply(
        False, error="x"
    )


# -- the agent's side, in this process -----------------------------------------------------------
def test_the_agent_writes_syncs_and_answers_once_pinned(paths: HostPaths, mocker: Any) -> None:
    cid = _container(paths)
    events: list[str] = []
    real = os.fsync
    mocker.patch("os.fsync", side_effect=lambda fd: (events.append("sync"), real(fd))[1])
    planner = Planner(during=lambda: events.append("pass"))
    updates = AgentUpdates(paths, planner)
    try:
        reply = updates.answer(_request(paths, cid, "1"))
    finally:
        updates.close()
    assert reply == {"ok": True, "done": True, "id": cid, "sandbox": cid, "cpus": "1"}
    assert planner.asked == [cid]
    assert _stored(paths, cid) == ("1", "update")
    # durable before the answer, synced while the pass ran (not before it was queued)
    assert events[0] == "sync" and "pass" in events


def test_an_update_reads_the_row_once_and_lists_the_journal_once(
    paths: HostPaths, mocker: Any
) -> None:
    """What the agent does per update, counted so that it cannot creep back (issue 28): one
    transaction that reads the container (its checks; the record as written is made from
    that read, not read back), writes the row and bumps its sandbox's generation, and one
    listing of the journal dir (the ingest before the checks)."""
    cid = _container(paths)
    updates = AgentUpdates(paths, Planner())
    statements: list[str] = []
    updates._open().db.set_trace_callback(statements.append)
    listed = mocker.spy(os, "listdir")
    try:
        reply = updates.answer(_request(paths, cid, "1"))
    finally:
        updates.close()
    assert reply is not None and reply["done"] is True
    # (each statement of a trigger -- the change log's -- is traced as its outer statement
    # again: consecutive repeats are one statement)
    run = [s for k, s in enumerate(statements) if k == 0 or s != statements[k - 1]]
    kinds = [
        "SELECT " + s.split(" FROM ")[1].split()[0] if s.startswith("SELECT")
        else " ".join(s.split()[:2]).split("=")[0]
        for s in run
    ]  # fmt: skip
    assert kinds == [
        "PRAGMA busy_timeout", "BEGIN IMMEDIATE", "SELECT containers",
        "UPDATE containers", "UPDATE sandboxes", "COMMIT",
    ], statements  # fmt: skip
    assert [c.args for c in listed.call_args_list] == [(os.path.join(paths.state_dir, "journal"),)]


def test_the_online_list_is_read_outside_the_write_and_said_after_an_unknown_container(
    paths: HostPaths, mocker: Any
) -> None:
    """The checks are made in the write's transaction, but sysfs is read before it (no
    writer of the agent waits for it), and its failure is said in the checks' order."""
    import vmpin.linux.sysfs as sysfs
    from vmpin.core.errors import TopologyError

    cid = _container(paths)
    updates = AgentUpdates(paths, Planner())
    store = updates._open()
    real = sysfs.online_cpus
    in_transaction: list[bool] = []

    def online(root: str) -> Any:
        in_transaction.append(store.db.in_transaction)
        return real(root)

    mocker.patch.object(sysfs, "online_cpus", online)
    try:
        assert (updates.answer(_request(paths, cid, "1")) or {}).get("done") is True
        assert in_transaction == [False]
        mocker.patch.object(sysfs, "online_cpus", side_effect=TopologyError("no online list"))
        unknown = updates.answer(_request(paths, "nosuch-ctr", "1"))
        assert unknown is not None and "unknown container" in unknown["error"], unknown
        known = updates.answer(_request(paths, cid, "0"))
        assert known is not None and known["error"] == "no online list", known
    finally:
        updates.close()
    assert _stored(paths, cid) == ("1", "update")


def test_a_request_past_its_deadline_writes_nothing(paths: HostPaths) -> None:
    cid = _container(paths)
    planner = Planner()
    updates = AgentUpdates(paths, planner)
    try:
        req = _request(paths, cid, "1")._replace(until=time.monotonic() - 0.01)
        reply = updates.answer(req)
    finally:
        updates.close()
    assert reply is not None and reply["done"] is False
    assert planner.asked == [] and _stored(paths, cid) == ("0", "spec")


def test_an_agent_late_to_the_write_lock_never_overwrites_the_callers_own_write(
    paths: HostPaths,
) -> None:
    """The race of issue 26, staged: the agent has the request in hand but cannot write
    (another holds SQLite's write lock: the agent stopped, a slow disk) until past ``until``;
    the caller gives up at ``until``, writes the set itself, and a later update follows.
    The agent then must write nothing: it checks ``until`` inside its write transaction."""
    cid = _container(paths)
    req = _request(paths, cid, "1", within=0.4)
    holder = sqlite3.connect(os.path.join(paths.state_dir, "state.db"), isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    replies: list[dict[str, Any] | None] = []
    updates = AgentUpdates(paths, Planner())
    agent = threading.Thread(target=lambda: replies.append(updates.answer(req)))
    try:
        agent.start()
        while time.monotonic() < req.until + 0.05:
            time.sleep(0.01)
        # the caller's fallback and a later update, written while the agent still waits
        holder.execute(
            "UPDATE containers SET cpus='0-1', cpus_source='update' WHERE id=?", (cid,)
        )
        holder.execute("COMMIT")
        agent.join(10)
    finally:
        holder.close()
        updates.close()
    assert replies and replies[0] is not None and replies[0]["done"] is False, replies
    assert _stored(paths, cid) == ("0-1", "update")


@pytest.mark.parametrize("later_write", [False, True])
def test_a_write_whose_pass_did_not_end_in_time_is_put_back_unless_overtaken(
    paths: HostPaths, later_write: bool
) -> None:
    """Not done means the set as it was (the caller then writes it itself), but never at the
    cost of a later update written meanwhile (a compare-and-swap on the write's stamp)."""
    cid = _container(paths)

    def meanwhile() -> None:
        if later_write:
            with Store(paths.state_dir) as store:
                store.set_container_cpus(cid, CpuSet.parse("0-1"), "update")

    updates = AgentUpdates(paths, Planner(ok=False, during=meanwhile))
    try:
        reply = updates.answer(_request(paths, cid, "1"))
    finally:
        updates.close()
    assert reply is not None and reply["done"] is False and "in time" in reply["error"]
    assert _stored(paths, cid) == (("0-1", "update") if later_write else ("0", "spec"))


@pytest.mark.parametrize(
    ("cid", "cpus", "error"),
    [
        ("nosuch", "1", "unknown container"),
        (None, "0-4095", "online"),
        (None, "3-1", "cpus:"),
        (None, "", "empty"),
    ],
)
def test_bad_input_is_not_done_and_changes_nothing(
    paths: HostPaths, cid: str | None, cpus: str, error: str
) -> None:
    known = _container(paths)
    updates = AgentUpdates(paths, Planner())
    try:
        reply = updates.answer(_request(paths, cid or known, cpus))
    finally:
        updates.close()
    assert reply is not None and reply["done"] is False and error in reply["error"], reply
    assert _stored(paths, known) == ("0", "spec")


def test_other_roots_or_another_clock_are_refused(paths: HostPaths) -> None:
    cid = _container(paths)
    updates = AgentUpdates(paths, Planner())
    try:
        other = _request(paths, cid, "1")._replace(roots={**paths._asdict(), "sys": "/elsewhere"})
        assert updates.answer(other) == {
            "ok": False, "error": "update: host roots differ from the agent's (sys)"
        }
        # an ``until`` past ``wait`` by this clock: the caller's clock is not ours
        skewed = _request(paths, cid, "1")._replace(until=time.monotonic() + 30)
        reply = updates.answer(skewed)
        assert reply is not None and reply["ok"] is False and "clock" in reply["error"]
    finally:
        updates.close()
    assert _stored(paths, cid) == ("0", "spec")


# -- the caller's side ---------------------------------------------------------------------------
def test_no_agent_means_no_exchange(paths: HostPaths) -> None:
    assert control.update(paths, "c1", "1", 1.0) == (None, False)


def test_an_agent_that_never_answers_is_waited_for_once(paths: HostPaths) -> None:
    """A stopped agent: the socket accepts (the kernel queues the connection), no answer
    comes.  The command waits ``wait`` once, then re-pins itself -- not a second ``wait`` for
    the old request on the same agent."""
    import socket

    cid = _container(paths)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(paths.control_socket)
    sock.listen(8)
    try:
        t0 = time.monotonic()
        result = update_container(paths, cid, cpuset_cpus="1", wait=0.5)
        took = time.monotonic() - t0
    finally:
        sock.close()
    assert result["applied_by"] != "re-pinned by the agent"
    assert 0.5 <= took < 0.95, took
    assert _stored(paths, cid) == ("1", "update")


# -- end to end: `vmpin update` against the real agent ------------------------------------------
@pytest.mark.multi_cpu
def test_vmpin_update_is_written_by_the_agent_and_the_command_opens_no_store(
    agents: Callable[..., AgentProc],
    paths: HostPaths,
    env: dict[str, str],
    vmms: Callable[..., fakevmm.FakeVmm],
) -> None:
    sid = new_id("aupd")
    vmm = vmms(sid, vcpus=2)
    with Store(paths.state_dir) as store:
        register(store, sid, "0")
    agent = agents()
    assert wait_until(lambda: all_on(vmm.pid, "0"), 10)
    for cpus in ("1", "0-1", "0"):
        out = run_cli({**env, "PYTHONPROFILEIMPORTTIME": "1"}, "update", f"{sid}-app",
                      "--cpuset-cpus", cpus)  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == (
            f"{sid}-app: cpus {cpus} (sandbox {sid}: re-pinned by the agent)"
        )
        # the threads moved before the command returned (on 0-1, each vCPU on its own)
        if cpus != "0-1":
            assert all_on(vmm.pid, cpus)
        imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines()}
        assert "vmpin.service.update" in imported  # (the import log is there)
        assert not imported & {"vmpin.state.store", "_sqlite3", "vmpin.reconcile.reconciler"}
        assert _stored(paths, f"{sid}-app") == (cpus, "update")
    status = agent.status()
    assert status is not None and status["errors"] == 0, status
    assert agent.stop() == 0


def test_without_an_agent_the_command_loads_nothing_of_the_agents_protocol(
    paths: HostPaths, env: dict[str, str]
) -> None:
    cid = _container(paths)
    out = run_cli({**env, "PYTHONPROFILEIMPORTTIME": "1"}, "update", cid, "--cpuset-cpus", "1")
    assert out.returncode == 0, out.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines()}
    assert "vmpin.service.update" in imported
    assert not imported & {"vmpin.wire.control_commands", "vmpin.wire.control", "_socket"}
    assert _stored(paths, cid) == ("1", "update")
