"""kubelet's cpu_manager_state, read from fixture files (tests/fixtures/kubelet)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from vmpin.core.cpuset import CpuSet
from vmpin.core.errors import KubeError
from vmpin.runtimes.kubelet import (
    Checkpoint,
    CheckpointReader,
    cpus_for,
    is_infra,
    parse_checkpoint,
    read_checkpoint,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "kubelet"
POD_A = "6b2f1a4e-7c1d-4c55-9a57-2f0a5c1e9d10"
POD_B = "0d9c3b8e-1111-4e2a-8f3b-0c2d4e6f8a9b"


def load(name: str) -> Checkpoint:
    cp = read_checkpoint(str(FIXTURES / name))
    assert cp is not None
    return cp


def test_v2_static() -> None:
    cp = load("v2-static.json")
    assert cp.policy == "static"
    assert cp.default == CpuSet.parse("0-7,14-15")
    assert cp.entries == {
        POD_A: {"app": CpuSet.parse("8-11"), "sidecar": CpuSet.parse("12-13")},
        POD_B: {"db": CpuSet.parse("16-19")},
    }
    assert cp.by_container_id == {}
    assert cp.mtime_ns == os.stat(FIXTURES / "v2-static.json").st_mtime_ns


def test_cpus_for_exclusive_then_shared_pool() -> None:
    cp = load("v2-static.json")
    assert cpus_for(cp, POD_A, "app") == CpuSet.parse("8-11")
    assert cpus_for(cp, POD_B, "db") == CpuSet.parse("16-19")
    # not in entries: the shared pool (another container of the pod, or another pod)
    assert cpus_for(cp, POD_A, "init") == CpuSet.parse("0-7,14-15")
    assert cpus_for(cp, "some-other-pod", "web") == CpuSet.parse("0-7,14-15")


def test_static_without_entries() -> None:
    cp = load("v2-static-no-entries.json")
    assert cp.entries == {}
    assert cpus_for(cp, POD_A, "app") == CpuSet.parse("0-15")


def test_v1_entries_are_keyed_by_container_id() -> None:
    cp = load("v1-static.json")
    assert cp.entries == {}
    cid = "0a8b7c6d5e4f3a2b1c0d9e8f7a6b5c4d3e2f1a0b9c8d7e6f5a4b3c2d1e0f9a8b"
    assert cp.by_container_id == {cid: CpuSet.parse("4-5")}
    # applied by container id (issue 25: accepted and never applied, the container got the pool)
    assert cpus_for(cp, POD_A, "app", cid) == CpuSet.parse("4-5")
    assert cpus_for(cp, POD_A, None, cid) == CpuSet.parse("4-5")
    # any other container of a pod runs on the shared pool
    assert cpus_for(cp, POD_A, "app", "f" * 64) == CpuSet.parse("0-3,6-7")
    assert cpus_for(cp, POD_A, "app") == CpuSet.parse("0-3,6-7")


@pytest.mark.parametrize(
    ("is_sandbox", "pod_uid", "name", "infra"),
    [
        (True, POD_A, "POD", True),  # CRI-O: ContainerType sandbox, container name POD
        (False, POD_A, "POD", True),  # CRI-O's name alone (a hook that missed the type)
        (True, POD_A, None, True),  # containerd: container-type sandbox, no container name
        (False, POD_A, "app", False),  # an app or init container
        (False, POD_A, None, False),
        (True, None, None, False),  # plain `runc run`: its own sandbox, and a workload
        (True, None, "web", False),
        (False, POD_A, "pod", False),  # names are DNS labels: only kubelet's "POD" is infra
    ],
)
def test_infra_container_is_never_assigned(
    is_sandbox: bool, pod_uid: str | None, name: str | None, infra: bool
) -> None:
    assert is_infra(is_sandbox, pod_uid, name) is infra


def test_policy_none_says_nothing() -> None:
    cp = load("none.json")
    assert cp.policy == "none"
    assert cp.default == CpuSet()
    assert cpus_for(cp, POD_A, "app") is None


def test_v4_reads_data_and_pod_entries() -> None:
    cp = load("v4-static.json")
    assert cpus_for(cp, POD_A, "app") == CpuSet.parse("2-5")
    assert cp.pods == {POD_A: CpuSet.parse("2-5")}
    # another container of that pod shares the pod-level CPUs, not the node's shared pool
    assert cpus_for(cp, POD_A, "sidecar") == CpuSet.parse("2-5")
    assert cpus_for(cp, POD_B, "db") == CpuSet.parse("0-1,6-7")


def test_v4_data_wins_over_a_stale_top_level() -> None:
    cp = load("v4-stale-top.json")
    assert cp.default == CpuSet.parse("0-1,4-7")
    assert cpus_for(cp, POD_A, "app") == CpuSet.parse("2-3")


def test_static_with_empty_pool_says_nothing() -> None:
    cp = Checkpoint("static", CpuSet(), {}, 0)
    assert cpus_for(cp, POD_A, "app") is None


def test_absent_file_is_none(tmp_path: Path) -> None:
    assert read_checkpoint(str(tmp_path / "cpu_manager_state")) is None


def test_never_writes(tmp_path: Path) -> None:
    path = tmp_path / "cpu_manager_state"
    shutil.copy(FIXTURES / "v2-static.json", path)
    before = path.read_bytes(), os.stat(path).st_mtime_ns
    read_checkpoint(str(path))
    assert (path.read_bytes(), os.stat(path).st_mtime_ns) == before


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        ({"defaultCpuSet": "0-3"}, "policyName"),
        ({"policyName": "", "defaultCpuSet": "0-3"}, "policyName"),
        ({"policyName": 7, "defaultCpuSet": "0-3"}, "policyName"),
        ({"policyName": "static", "defaultCpuSet": "0-"}, "defaultCpuSet"),
        ({"policyName": "static", "defaultCpuSet": 3}, "defaultCpuSet"),
        ({"policyName": "static", "defaultCpuSet": "0-3", "entries": []}, "entries"),
        ({"policyName": "static", "defaultCpuSet": "0-3", "entries": {"u": 5}}, "entries.u"),
        (
            {"policyName": "static", "defaultCpuSet": "0-3", "entries": {"u": {"c": "3-1"}}},
            "entries.u.c",
        ),
        ({"policyName": "static", "defaultCpuSet": "0-3", "entries": {"id": "x"}}, "entries.id"),
        ({"policyName": "static", "defaultCpuSet": "0-3", "checksum": -1}, "checksum"),
        ({"policyName": "static", "defaultCpuSet": "0-3", "checksum": 1.5}, "checksum"),
        ({"policyName": "static", "defaultCpuSet": "0-3", "checksum": 2**64}, "checksum"),
        ({"policyName": "static", "defaultCpuSet": "0-3", "checksum": "12"}, "checksum"),
    ],
)
def test_malformed_names_path_and_field(tmp_path: Path, doc: object, field: str) -> None:
    path = tmp_path / "cpu_manager_state"
    path.write_text(json.dumps(doc))
    with pytest.raises(KubeError) as info:
        read_checkpoint(str(path))
    assert str(path) in str(info.value)
    assert f"field {field!r}" in str(info.value)


@pytest.mark.parametrize("text", ["", "{", "[1, 2]", "null", '"static"'])
def test_not_a_checkpoint(tmp_path: Path, text: str) -> None:
    path = tmp_path / "cpu_manager_state"
    path.write_text(text)
    with pytest.raises(KubeError, match=str(path)):
        read_checkpoint(str(path))


def test_unreadable_names_the_path(tmp_path: Path) -> None:
    # root reads a mode-000 file anyway; a directory where the file should be is the
    # portable way to make open() fail with something other than ENOENT.
    path = tmp_path / "cpu_manager_state"
    path.mkdir()
    with pytest.raises(KubeError, match=str(path)):
        read_checkpoint(str(path))


# -- kubernetes' own vectors (pkg/kubelet/cm/cpumanager/state/state_checkpoint_test.go, and a
# file kubelet wrote on a real node, quoted in lx1036/code cpu-manager.md), verbatim ----------
V4_DATA = (
    r'"data": "{\"policyName\":\"static\",\"defaultCPUSet\":\"7-9\",'
    r'\"entries\":{\"pod\":{\"container1\":\"4-6\",\"container2\":\"1-3\"}}}"'
)
KUBELET_VECTORS = [
    (
        "written by kubelet, policy none",
        '{"policyName":"none","defaultCpuSet":"","checksum":3242152201}',
        ("none", "", {}, {}),
    ),
    (
        "written by kubelet, static",
        '{"policyName":"static","defaultCpuSet":"0,2-12,14-23","entries":'
        '{"235148fe-393f-47a8-a17d-bd55bc1a836b":{"cgroup1-0":"1,13"}},"checksum":1552716370}',
        (
            "static",
            "0,2-12,14-23",
            {"235148fe-393f-47a8-a17d-bd55bc1a836b": {"cgroup1-0": "1,13"}},
            {},
        ),
    ),
    (
        "v2 with the key spelled defaultCPUSet",
        '{"policyName": "static", "defaultCPUSet": "7-9", "entries": {"pod": '
        '{"container1": "4-6", "container2": "1-3"}}, "checksum": 1942532442}',
        ("static", "7-9", {"pod": {"container1": "4-6", "container2": "1-3"}}, {}),
    ),
    (
        "v3 with pod-level entries",
        '{"policyName": "static", "defaultCPUSet": "1-2", "entries": {"pod1": {"container1": '
        '"5-6", "container2": "3-4"}}, "podEntries": {"pod2": {"cpuSet":"7-9"}}, '
        '"checksum": 766259872}',
        ("static", "1-2", {"pod1": {"container1": "5-6", "container2": "3-4"}}, {"pod2": "7-9"}),
    ),
    (
        "v4: data is authoritative, the corrupted top level is not used",
        '{"policyName": "other", "defaultCPUSet": "1-9", "checksum": 1234, '
        + V4_DATA
        + ', "dataChecksum": 1420829534}',
        ("static", "7-9", {"pod": {"container1": "4-6", "container2": "1-3"}}, {}),
    ),
    (
        "v4 ignoring unknown fields in data",
        '{"policyName": "other", "defaultCPUSet": "1-9", "checksum": 1234, "data": '
        r'"{\"policyName\":\"none\",\"defaultCPUSet\":\"4-6\",\"unknownField\":\"value\"}"'
        ', "dataChecksum": 3492408555}',
        ("none", "4-6", {}, {}),
    ),
    (
        "v1 keyed by container id (older kubelets migrate it)",
        '{"policyName": "none", "defaultCPUSet": "1-3", "checksum": 1694838852}',
        ("none", "1-3", {}, {}),
    ),
]


@pytest.mark.parametrize(
    ("doc", "want"), [v[1:] for v in KUBELET_VECTORS], ids=[v[0] for v in KUBELET_VECTORS]
)
def test_kubelets_own_checkpoints(
    doc: str, want: tuple[str, str, dict[str, dict[str, str]], dict[str, str]]
) -> None:
    cp = parse_checkpoint(doc, "cpu_manager_state")
    policy, default, entries, pods = want
    assert cp.policy == policy
    assert cp.default == CpuSet.parse(default)
    assert cp.entries == {u: {n: CpuSet.parse(c) for n, c in e.items()} for u, e in entries.items()}
    assert cp.pods == {u: CpuSet.parse(c) for u, c in pods.items()}


KUBELET_REFUSES = [
    (
        "v2 with the checksum of other contents",
        '{"policyName": "static", "defaultCPUSet": "7-9", "entries": {"pod": '
        '{"container1": "4-6", "container2": "1-9"}}, "checksum": 1942532442}',
        "'checksum'",
    ),
    (
        "v4 whose dataChecksum does not match",
        '{"policyName": "static", "defaultCPUSet": "7-9", "checksum": 1942532442, '
        + V4_DATA
        + ', "dataChecksum": 1234}',
        "'dataChecksum'",
    ),
    (
        "v4 without a data section",
        '{"policyName": "static", "defaultCPUSet": "7-9", "checksum": 1942532442, '
        '"dataChecksum": 1234}',
        "'data'",
    ),
    (
        "v4 without dataChecksum",
        '{"policyName": "static", "defaultCPUSet": "7-9", "checksum": 1942532442, ' + V4_DATA + "}",
        "'dataChecksum'",
    ),
    (
        "v4 with an unparsable default CPU set",
        '{"policyName": "none", "defaultCPUSet": "7-9", "checksum": 98002435, "data": '
        r'"{\"policyName\":\"none\",\"defaultCPUSet\":\"1.3\"}", "dataChecksum": 3033143655}',
        "'defaultCpuSet'",
    ),
    (
        "v4 with an unparsable entry",
        '{"policyName": "static", "defaultCPUSet": "1-3", "entries": {"pod": {"container1": '
        '"4-6", "container2": "7-9"}}, "checksum": 1659543133, "data": '
        r'"{\"policyName\":\"static\",\"defaultCPUSet\":\"1-3\",\"entries\":{\"pod\":'
        r'{\"container1\":\"4-6\",\"container2\":\"asd\"}}}", "dataChecksum": 3794806925}',
        "'entries.pod.container2'",
    ),
    ("invalid JSON", "{", "malformed JSON"),
    (
        "a string where the checksum number goes",
        '{"policyName":"none","defaultCpuSet":"","checksum":"3242152201"}',
        "'checksum'",
    ),
]


@pytest.mark.parametrize(
    ("doc", "field"), [v[1:] for v in KUBELET_REFUSES], ids=[v[0] for v in KUBELET_REFUSES]
)
def test_what_kubelet_refuses_is_one_line(doc: str, field: str) -> None:
    with pytest.raises(KubeError) as info:
        parse_checkpoint(doc, "/var/lib/kubelet/cpu_manager_state")
    line = str(info.value)
    assert "\n" not in line
    assert "/var/lib/kubelet/cpu_manager_state" in line
    assert field in line


def test_keys_match_as_go_matches_them() -> None:
    # case-insensitive, exact name preferred, a repeated key decoded again (last wins)
    doc = (
        '{"POLICYNAME": "static", "DefaultCpuSet": "0-1", "defaultcpuset": "0-3", '
        '"ENTRIES": {"p": {"a": "4"}}, "entries": {"q": {"b": "5"}}}'
    )
    cp = parse_checkpoint(doc, "f")
    assert cp.policy == "static"
    assert cp.default == CpuSet.parse("0-3")
    # two objects decoded into the same map field merge
    assert cp.entries == {"p": {"a": CpuSet.parse("4")}, "q": {"b": CpuSet.parse("5")}}
    # map keys (pod uids, container names) are not folded
    assert cpus_for(cp, "P", "a") == CpuSet.parse("0-3")


def test_null_resets_a_map_and_leaves_a_string() -> None:
    cp = parse_checkpoint(
        '{"policyName":"static","defaultCpuSet":"0-3","defaultCpuSet":null,'
        '"entries":{"p":{"a":"4"}},"entries":null}',
        "f",
    )
    assert cp.default == CpuSet.parse("0-3")
    assert cp.entries == {}


def test_checksum_zero_is_accepted_without_pod_entries() -> None:
    # kubelet's v2 reader accepts checksum 0 ("old file backend") and has no podEntries
    cp = parse_checkpoint(
        '{"policyName":"static","defaultCpuSet":"0-3","podEntries":{"p":{"cpuSet":"4-5"}}}', "f"
    )
    assert cp.pods == {}
    assert cpus_for(cp, "p", "a") == CpuSet.parse("0-3")


def test_a_corrupted_file_keeps_the_last_good_one(tmp_path: Path) -> None:
    path = tmp_path / "cpu_manager_state"
    reader = CheckpointReader(str(path))
    assert reader.read() == (None, None)
    # no good checkpoint yet: nothing to fall back on, and the line says so
    path.write_text('{"policyName":"static","defaultCpuSet":"0-3","checksum":1}')
    cp, err = reader.read()
    assert cp is None
    assert err is not None and "corrupted" in err and "none read yet" in err
    shutil.copy(FIXTURES / "v2-static.json", path)
    good, err = reader.read()
    assert err is None and good is not None
    assert cpus_for(good, POD_A, "app") == CpuSet.parse("8-11")
    text = path.read_text().replace('"8-11"', '"8-12"')  # kubelet's checksum no longer holds
    tmp = tmp_path / "new"
    tmp.write_text(text)
    os.replace(tmp, path)  # kubelet writes by rename, so does this test
    cp, err = reader.read()
    assert cp is good
    assert err is not None and str(path) in err and "last good" in err
    path.unlink()
    assert reader.read() == (None, None)
