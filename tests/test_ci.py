"""CI runs the README's test command, and the suite's markers are what pyproject registers."""

from __future__ import annotations

import re

import pytest

from tests.conftest import ROOT
from tests.support import capabilities


def readme_test_command() -> str:
    block = re.search(r"# run the tests[^\n]*\n(.+)\n", (ROOT / "README.md").read_text())
    assert block, "README.md names no test command"
    return block.group(1).strip()


def test_ci_runs_exactly_the_readme_test_command() -> None:
    cmd = readme_test_command()
    assert cmd.startswith(".venv/bin/python -m pytest")
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    runs = [line for line in lines if "-m pytest" in line and not line.startswith("#")]
    assert runs == [f"{cmd} || rc=$?"], runs
    assert "export VMPIN_TEST_STRICT=1" in lines


def test_every_capability_marker_is_registered() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    registered = {m.split(":", 1)[0] for m in ini["markers"]}
    assert set(capabilities.MARKERS) | {"host"} == registered
    assert "--strict-markers" in ini["addopts"]
    assert set(capabilities.TOUCHES_HOST) == set(capabilities.MARKERS) - {"multi_cpu"}
