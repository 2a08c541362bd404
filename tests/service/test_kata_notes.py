"""What ``vmpin doctor`` and ``vmpin audit`` say about Kata's own vCPU pinning, run as the CLI.

A Kata configuration with ``[runtime] enable_vcpus_pinning = true`` is reported by both (a
line per file in doctor; ``notes`` in audit's JSON and ``note`` lines in its text), never as
a violation: ``ok`` and the exit codes do not change.  A file that cannot be read is one line
naming it.  The sandboxes these notes are about are in tests/reconcile/test_kata_pinning.py
and tests/e2e/test_e2e_kata.py (real QEMU).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import vmpin_cmd
from vmpin.linux.paths import HostPaths
from vmpin.state.store import Store

ON = "[runtime]\nenable_vcpus_pinning = true\n"


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*vmpin_cmd(), *args], capture_output=True, text=True, env=env,
                          timeout=60)


@pytest.fixture
def conf(paths: HostPaths) -> Path:
    p = Path(paths.kata_config)
    p.parent.mkdir(parents=True, exist_ok=True)
    return p


@pytest.mark.parametrize(
    ("text", "line"),
    [(None, "Kata configuration: none found ({spec}): vmpin alone pins vCPUs"),
     (ON, "Kata configuration {spec}: [runtime] enable_vcpus_pinning = true: Kata pins vCPU i"),
     ("[runtime]\n", "Kata configuration {spec}: [runtime] enable_vcpus_pinning is off"),
     ("[runtime]\nenable_vcpus_pinning = yes\n",
      "Kata configuration {spec}: not valid TOML: Invalid value (at line 2, column 24)")],
    ids=["none", "on", "off", "malformed"],
)
def test_doctor_says_what_kata_configuration_sets(
    env: dict[str, str], conf: Path, paths: HostPaths, text: str | None, line: str
) -> None:
    if text is not None:
        conf.write_text(text)
    out = cli(env, "doctor", "--dry-run")
    assert out.returncode == 0, out.stdout + out.stderr  # informs, never unhealthy
    last = out.stdout.splitlines()[-1]
    assert last.startswith(line.format(spec=paths.kata_config)), last
    assert "Traceback" not in out.stderr


def test_doctor_says_it_before_the_state_dir_exists(env: dict[str, str], conf: Path,
                                                   tmp_path: Path) -> None:
    conf.write_text(ON)
    env = {**env, "VMPIN_STATE_DIR": str(tmp_path / "not-yet")}
    out = cli(env, "doctor", "--dry-run")
    assert out.returncode == 0
    assert [ln.split(":")[0] for ln in out.stdout.splitlines()] == [
        str(tmp_path / "not-yet"), f"Kata configuration {conf}"]


def test_audit_notes_are_not_violations(env: dict[str, str], conf: Path,
                                        paths: HostPaths) -> None:
    Store(paths.state_dir).close()
    conf.write_text(ON)
    out = cli(env, "audit", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)  # (validated against its view: VMPIN_CHECK_VIEWS)
    assert result["ok"] is True and result["violations"] == []
    assert result["notes"] == [
        f"Kata configuration {conf}: [runtime] enable_vcpus_pinning = true: Kata pins vCPU i"
        " to the i-th CPU of the sandbox's cpuset itself when the counts match; vmpin follows"
        " that layout and leaves vCPUs Kata placed"]
    text = cli(env, "audit")
    assert text.returncode == 0
    assert text.stdout.splitlines() == [f"note      {result['notes'][0]}",
                                        "ok: 0 sandboxes, 0 threads, 0 violations"]
    # a read-only command leaves the state dir as it found it (no answer kept there)
    assert "kata-config.json" not in os.listdir(paths.state_dir)
    # a malformed file is a note too, naming it; off is nothing to note
    conf.write_text("[runtime\n")
    result = json.loads(cli(env, "audit", "--json").stdout)
    assert result["ok"] and [n.split(": ")[1] for n in result["notes"]] == ["not valid TOML"]
    conf.write_text("[runtime]\nenable_vcpus_pinning = false\n")
    assert json.loads(cli(env, "audit", "--json").stdout)["notes"] == []


def test_a_pass_keeps_the_answer_for_the_hooks(env: dict[str, str], conf: Path,
                                               paths: HostPaths) -> None:
    """reconcile writes kata-config.json: the next hook's pass reads it without tomllib."""
    conf.write_text(ON)
    assert cli(env, "reconcile", "--once").returncode == 0
    kept = json.loads(Path(paths.kata_config_cache).read_text())
    assert kept["files"] == [[str(conf), True, None]]


def test_schema_has_notes(env: dict[str, str]) -> None:
    s = json.loads(cli(env, "schema", "audit").stdout)
    assert s["properties"]["notes"]["items"] == {"type": "string"}
    assert "notes" not in s["required"]  # additive: outputs may grow, scripts need not know
