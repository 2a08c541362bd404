"""``vmpin update``'s input: ``-r`` read as runc decodes it, ``--cpuset-cpus`` read strictly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vmpin.core.cpuset import CpuSet
from vmpin.core.errors import SpecError
from vmpin.service.update import parse_update

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
