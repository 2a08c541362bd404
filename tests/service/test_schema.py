"""``vmpin schema [COMMAND]``: the JSON Schema of every ``--json`` view, with DESIGN.md's keys.

The CLI validates each ``--json`` output against the same models before printing, so every
CLI/e2e test that parses ``--json`` also checks the output against its schema.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.conftest import vmpin_cmd

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
