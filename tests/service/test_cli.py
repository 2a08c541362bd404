"""The CLI contract on an empty state: exit codes, JSON shapes, usage errors without tracebacks."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.conftest import vmpin_cmd
from vmpin import __version__


def vmpin(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*vmpin_cmd(), *args], env=env, capture_output=True, text=True,
                          timeout=60)


def test_version_and_help(env: dict[str, str]) -> None:
    v = vmpin(env, "--version")
    assert v.returncode == 0 and v.stdout.strip() == f"vmpin {__version__}"
    h = vmpin(env, "--help")
    assert h.returncode == 0
    for command in ("hook", "update", "containers", "sandboxes", "show", "guest-map",
                    "topology", "audit", "reconcile", "serve", "status"):
        assert command in h.stdout


def init(env: dict[str, str]) -> None:
    """Create the state as the writing commands do (read-only ones never create it)."""
    assert vmpin(env, "reconcile", "--once").returncode == 0


@pytest.mark.parametrize("command", ["containers", "sandboxes"])
def test_empty_listings(env: dict[str, str], command: str) -> None:
    init(env)
    out = vmpin(env, command, "--json")
    assert out.returncode == 0 and json.loads(out.stdout) == []


@pytest.mark.parametrize("args", [["containers"], ["sandboxes"], ["show", "x"],
                                  ["guest-map", "x"], ["audit"]])
def test_read_only_commands_need_existing_state(env: dict[str, str], args: list[str]) -> None:
    """A mistyped --state-dir is an error, not a new empty store (issue 9)."""
    out = vmpin(env, *args)
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"no vmpin state at {env['VMPIN_STATE_DIR']}" in out.stderr
    assert list(Path(env["VMPIN_STATE_DIR"]).iterdir()) == []


def test_empty_audit_and_reconcile(env: dict[str, str]) -> None:
    init(env)
    audit = vmpin(env, "audit", "--json")
    assert audit.returncode == 0
    assert json.loads(audit.stdout)["ok"] is True
    assert json.loads(audit.stdout)["violations"] == []
    rec = vmpin(env, "reconcile", "--once", "--json")
    assert rec.returncode == 0 and json.loads(rec.stdout) == []


@pytest.mark.parametrize(("args", "words"), [
    (["update", "--bogus"], "No such option"),
    (["nosuch"], "No such command"),
    (["show"], "Missing"),
    (["reconcile"], "--once"),
    (["show", "nosuch"], "unknown sandbox"),
    (["guest-map", "nosuch"], "unknown container"),
])
def test_bad_usage_exits_2_without_traceback(env: dict[str, str], args: list[str],
                                             words: str) -> None:
    init(env)
    out = vmpin(env, *args)
    assert out.returncode == 2, out.stderr
    assert words in out.stderr + out.stdout
    assert "Traceback" not in out.stderr


def test_status_without_agent_exits_1(env: dict[str, str]) -> None:
    out = vmpin(env, "status", "--json")
    assert out.returncode == 1
    assert json.loads(out.stdout)["ok"] is False


def test_global_options_win_over_env(env: dict[str, str], tmp_path: Path) -> None:
    """--state-dir on the command line wins over VMPIN_STATE_DIR."""
    other = tmp_path / "other-state"
    assert vmpin(env, "--state-dir", str(other), "reconcile", "--once").returncode == 0
    assert (other / "state.db").exists()
