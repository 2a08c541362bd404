"""``vmpin update``'s input: ``-r`` read as runc decodes it, ``--cpuset-cpus`` read strictly;
and its re-pin through the agent's blocking reply."""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path

import pytest

from tests.support.session import new_id
from vmpin.core.cpuset import CpuSet
from vmpin.core.errors import SpecError
from vmpin.linux.paths import HostPaths
from vmpin.service.update import parse_update
from vmpin.state.store import ContainerRec, SandboxRec, Store

# Documents `runc update -r FILE` applies (Go's encoding/json; runc's fs2 manager writes
# `unified` files verbatim after the cpu fields).  Each names CPUs: none is "nothing to do".
RUNC_ACCEPTS = [
    ({"CPU": {"CPUS": "1-2"}}, "1-2"),
    ({"Cpu": {"cpus": "0,,1"}}, "0-1"),
    ({"unified": {"cpuset.cpus": "3"}}, "3"),
    ({"cpu": {"cpus": "0-1"}, "unified": {"cpuset.cpus": "5"}}, "5"),
    ({"cpu": {"cpus": "0-7:1/2"}}, "0,2,4,6"),
]


@pytest.mark.parametrize(("doc", "cpus"), RUNC_ACCEPTS)
def test_resources_file_as_runc_reads_it(tmp_path: Path, doc: object, cpus: str) -> None:
    path = tmp_path / "r.json"
    path.write_text(json.dumps(doc))
    assert parse_update(None, str(path)) == CpuSet.parse(cpus)


def test_memory_only_resources_are_nothing_for_vmpin(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    path.write_text('{"memory": {"limit": 67108864}}')
    assert parse_update(None, str(path)) is None


@pytest.mark.parametrize("text", ["3-1", "0-7:2/4", "1,,0", "N"])
def test_cpuset_cpus_stays_strict(text: str) -> None:
    # what a user types gets the strict list grammar and one clear line
    with pytest.raises(SpecError) as info:
        parse_update(text, None)
    assert str(info.value).startswith("--cpuset-cpus: ")
    assert repr(text) in str(info.value)
    assert "\n" not in str(info.value)


# -- the re-pin: the agent's blocking reply, else this process --------------------------------
class OneReplyAgent:
    """A control socket that answers one request with ``reply`` (a stand-in for the agent's
    side of the blocking ``dirty``, which another part of the agent implements)."""

    def __init__(self, path: str, reply: dict[str, object]) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(1)
        self.reply = reply
        self.request: dict[str, object] = {}
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        with conn:
            buf = b""
            while not buf.endswith(b"\n"):
                buf += conn.recv(65536)
            self.request = json.loads(buf)
            conn.sendall(json.dumps(self.reply).encode() + b"\n")

    def close(self) -> None:
        self.thread.join(10)
        self.sock.close()


def _runc_container(paths: HostPaths) -> str:
    cid = new_id("upd")
    with Store(paths.state_dir) as store:
        store.put_sandbox(SandboxRec(cid, "runc"))
        store.put_container(ContainerRec(cid, cid, True, cpus=CpuSet.parse("0"),
                                         cpus_source="spec"))
    return cid


@pytest.mark.parametrize(("done", "applied"), [(True, "re-pinned by the agent"),
                                                (False, "this process")])
def test_update_waits_for_the_agents_reply(paths: HostPaths, done: bool, applied: str) -> None:
    """update asks with ``wait`` and takes the reply as the signal (no polling of the store):
    done -> the agent re-pinned; not done (no pass in time) -> this process re-pins."""
    from vmpin.service.update import update_container

    cid = _runc_container(paths)
    agent = OneReplyAgent(paths.control_socket, {"ok": True, "queued": 1, "done": done})
    try:
        result = update_container(paths, cid, cpuset_cpus="0", wait=3.0)
    finally:
        agent.close()
    assert agent.request == {"op": "dirty", "sandboxes": [cid], "wait": 3.0}
    if done:
        assert result["applied_by"] == applied
    else:
        assert result["applied_by"] != "re-pinned by the agent"
    with Store(paths.state_dir) as store:
        rec = store.container(cid)
        assert rec is not None and rec.cpus == CpuSet.parse("0") and rec.cpus_source == "update"
