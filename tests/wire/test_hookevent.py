"""The hook event's wire format: journal files written before it had a home still read, and
what it writes is byte for byte what they were."""

from __future__ import annotations

import pytest

from vmpin.core.cpuset import CpuSet
from vmpin.core.errors import SpecError
from vmpin.wire.hookevent import MAX_EVENT, HookEvent, Identity, from_json, from_obj

#: a createRuntime event as vmpin.state.journal.build wrote it (2026-11, before this module)
OLD_CREATE = (
    b'{"v":1,"stage":"createRuntime","id":"c1","bundle":"/tmp/wh/b/c1","annotations":'
    b'{"k":"\xc3\xa9"},"host_pid":1,"pid_start":14,"ident":{"container_id":"c1","sandbox_id":'
    b'"pod1","is_sandbox":false,"pod_uid":"uid-1","pod_name":"web","pod_namespace":"default",'
    b'"name":"app"},"cpus":"2-3,5","mems":"0","runtime":"runc","has_config":true,"cpu_limit":2}'
)
#: a poststop whose container could not be named, as it wrote it
OLD_POSTSTOP = (
    b'{"v":1,"stage":"poststop","id":"pod1","bundle":"","annotations":{},"host_pid":null,'
    b'"pid_start":null,"ident":null,"cpus":null,"mems":null,"runtime":null}'
)


def test_old_files_read_and_write_back_the_same_bytes() -> None:
    ev = from_json(OLD_CREATE)
    assert ev == HookEvent(
        "createRuntime", "c1", "/tmp/wh/b/c1", {"k": "é"}, 1, 14,
        Identity("c1", "pod1", False, "uid-1", "web", "default", "app"),
        CpuSet.parse("2-3,5"), "0", "runc", True, 2,
    )  # fmt: skip
    assert ev.to_json() == OLD_CREATE
    gone = from_json(OLD_POSTSTOP)
    assert gone.ident is None and not gone.has_config and gone.cpu_limit is None
    assert gone.to_json() == OLD_POSTSTOP


def test_unknown_keys_are_ignored() -> None:
    assert from_json(OLD_CREATE[:-1] + b',"later":{"x":[1]}}') == from_json(OLD_CREATE)


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"v": 2}, "version"),
        ({"stage": "later"}, "unknown stage"),
        ({"host_pid": 0}, "not a process id"),
        ({"host_pid": True}, "host_pid"),
        ({"cpus": "0-"}, "cpus"),
        ({"runtime": "lxc"}, "runtime"),
        ({"runtime": None}, "runtime"),
        ({"cpu_limit": 0}, "cpu_limit"),
        ({"pid_start": -1}, "pid_start"),
        ({"annotations": {"a": 1}}, "annotations"),
        ({"ident": {"container_id": "c1"}}, "ident"),
        ({"bundle": "/b\ud800"}, "cannot be stored"),
        ({"annotations": {"k": "v" * MAX_EVENT}}, "over"),
    ],
)
def test_what_is_refused(change: dict[str, object], why: str) -> None:
    from vmpin.wire.jsonio import loads

    obj = loads(OLD_CREATE)
    with pytest.raises(SpecError, match=why):
        from_obj({**obj, **change})


def test_a_missing_field_is_refused() -> None:
    from vmpin.wire.jsonio import loads

    obj = loads(OLD_POSTSTOP)
    del obj["cpus"]
    with pytest.raises(SpecError, match="'cpus' missing"):
        from_obj(obj)
    with pytest.raises(SpecError, match="malformed"):
        from_json(b"{")
    with pytest.raises(SpecError, match="nested"):
        from_json(b"[" * 3000 + b"]" * 3000)
