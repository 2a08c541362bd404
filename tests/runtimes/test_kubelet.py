"""kubelet's cpu_manager_state, read from fixture files (tests/fixtures/kubelet)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from vmpin.core.cpuset import CpuSet
from vmpin.core.errors import KubeError
from vmpin.runtimes.kubelet import Checkpoint, cpus_for, read_checkpoint

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
    assert cpus_for(cp, POD_A, "app") == CpuSet.parse("0-3,6-7")


def test_policy_none_says_nothing() -> None:
    cp = load("none.json")
    assert cp.policy == "none"
    assert cp.default == CpuSet()
    assert cpus_for(cp, POD_A, "app") is None


def test_unknown_keys_are_ignored() -> None:
    cp = load("extra-keys.json")
    assert cpus_for(cp, POD_A, "app") == CpuSet.parse("2-5")
    assert cp.default == CpuSet.parse("0-1,6-7")


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
        ({"policyName": "static"}, "defaultCpuSet"),
        ({"policyName": "static", "defaultCpuSet": "0-"}, "defaultCpuSet"),
        ({"policyName": "static", "defaultCpuSet": 3}, "defaultCpuSet"),
        ({"policyName": "static", "defaultCpuSet": "0-3", "entries": []}, "entries"),
        ({"policyName": "static", "defaultCpuSet": "0-3", "entries": {"u": 5}}, "entries.u"),
        (
            {"policyName": "static", "defaultCpuSet": "0-3", "entries": {"u": {"c": "3-1"}}},
            "entries.u.c",
        ),
        (
            {"policyName": "static", "defaultCpuSet": "0-3", "entries": {"u": {"c": None}}},
            "entries.u.c",
        ),
        ({"policyName": "static", "defaultCpuSet": "0-3", "entries": {"id": "x"}}, "entries.id"),
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
