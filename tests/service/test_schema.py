"""``vmpin schema [COMMAND]``: the JSON Schema of every ``--json`` view, with DESIGN.md's keys.

Under the tests (VMPIN_CHECK_VIEWS, set by tests/conftest.py) the CLI validates each ``--json``
output against the same models before printing, so every CLI/e2e test that parses ``--json``
also checks the output against its schema; an operator's run does not import pydantic, and
the last tests here check that run's output against the models from outside.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.conftest import vmpin_cmd
from tests.support import fakevmm
from tests.support.session import new_id
from vmpin.core.cpuset import CpuSet
from vmpin.linux.paths import HostPaths
from vmpin.state.records import ContainerRec, SandboxRec
from vmpin.state.store import Store

DESIGN_KEYS = {
    "containers": ["id", "sandbox", "name", "cpus", "runtime"],
    "sandboxes": ["id", "runtime", "vmm_pid", "mask", "containers"],
    "show": ["id", "runtime", "mask", "threads", "guest_map"],
    "guest-map": ["container", "sandbox", "host_cpus", "guest_cpus"],
    "audit": ["ok", "violations"],
    "topology": ["online", "isolated", "sockets", "numa_nodes", "cores", "threads_per_core",
                 "cpus"],
}


def schema(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*vmpin_cmd(), "schema", *args], env=env, capture_output=True,
                          text=True, timeout=60)


def _object(s: dict, defs: dict) -> dict:  # type: ignore[type-arg]
    if "$ref" in s:
        return _object(defs[s["$ref"].split("/")[-1]], defs)
    if s.get("type") == "array":
        return _object(s["items"], defs)
    return s


@pytest.mark.parametrize("command", sorted(DESIGN_KEYS))
def test_schema_requires_design_keys(env: dict[str, str], command: str) -> None:
    out = schema(env, command)
    assert out.returncode == 0, out.stderr
    s = json.loads(out.stdout)
    obj = _object(s, s.get("$defs", {}))
    assert set(DESIGN_KEYS[command]) <= set(obj["required"])


def test_audit_violation_kinds_and_claimants(env: dict[str, str]) -> None:
    s = json.loads(schema(env, "audit").stdout)
    violation = s["$defs"]["ViolationView"]
    assert set(violation["properties"]["kind"]["enum"]) == {
        "drift", "double-pin", "foreign-on-exclusive", "conflict", "stale-pin", "error"}
    assert "claimants" in violation["properties"]


def test_all_schemas_and_unknown_command(env: dict[str, str]) -> None:
    every = json.loads(schema(env).stdout)
    assert set(DESIGN_KEYS) <= set(every)
    bad = schema(env, "nosuch")
    assert bad.returncode == 2 and "no --json view" in bad.stderr


# -- the fast route prints without pydantic; its output is checked here ----------------------
def test_fast_route_json_matches_its_views(env: dict[str, str], paths: HostPaths,
                                           vm_dir: Path) -> None:
    """``update`` and the read commands, run as an operator runs them (no VMPIN_CHECK_VIEWS:
    the process validates nothing), print JSON that the views' models accept -- on a node
    with a live (fake) QEMU, before its first pass (audit finds drift) and after an update."""
    from vmpin.wire.viewschema import check

    quiet = {k: v for k, v in env.items() if k != "VMPIN_CHECK_VIEWS"}
    sid = new_id("view")
    vmm = fakevmm.start(vm_dir, sid, vcpus=2)
    try:
        with Store(paths.state_dir) as store:
            store.put_sandbox(SandboxRec(sid, "kata"))
            store.put_container(ContainerRec(sid, sid, True, name="pause"))
            store.put_container(ContainerRec(f"{sid}-app", sid, False, name="app",
                                             cpus=CpuSet.parse("0")))
        runs = [("audit", ["audit", "--json"]),
                ("update", ["update", f"{sid}-app", "--cpuset-cpus", "0", "--json"]),
                ("containers", ["containers", "--json"]), ("sandboxes", ["sandboxes", "--json"]),
                ("show", ["show", sid, "--json"]), ("audit", ["audit", "--json"])]
        seen = []
        for view, args in runs:
            out = subprocess.run([*vmpin_cmd(), *args], env=quiet, capture_output=True,
                                 text=True, timeout=60)
            assert out.returncode in (0, 1), out.stderr
            data = json.loads(out.stdout)
            check(view, data)
            seen.append(data)
        assert seen[0]["ok"] is False and seen[0]["violations"]  # drift before the first pass
        assert seen[-1]["ok"] is True
        assert [t["role"] for t in seen[4]["threads"]].count("vcpu") == 2
    finally:
        vmm.kill()


def test_check_rejects_a_view_that_lost_a_key() -> None:
    """The check the tests rely on can fail: a DESIGN.md key missing is an error."""
    from pydantic import ValidationError

    from vmpin.wire.viewschema import check

    check("update", {"id": "c", "sandbox": "s", "cpus": "0", "applied_by": "x"})
    with pytest.raises(ValidationError):
        check("update", {"id": "c", "sandbox": "s", "applied_by": "x"})
