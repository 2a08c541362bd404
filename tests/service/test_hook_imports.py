"""The hook path stays lean: what `vmpin hook` actually loads, checked at run time (a plain
container's hook journals its event and loads neither sqlite3 nor typing).

import-linter checks the static imports of vmpin.service.hook and vmpin.guest.program; this
checks the whole
dispatch (vmpin.entry -> hook -> in-process reconcile of a plain container) in a fresh
interpreter, where a lazy import in the wrong place would show.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

FORBIDDEN = ("typer", "click", "pydantic", "psutil", "kubernetes", "libvirt",
             "prometheus_client", "dataclasses", "typing", "sqlite3", "vmpin.cli",
             "vmpin.service.agent", "vmpin.reconcile.reconciler")

PROBE = """
import io, json, sys
before = set(sys.modules)  # what site loaded here (an editable install may load typing)
sys.stdin = io.TextIOWrapper(io.BytesIO(sys.argv[1].encode()))
sys.argv = ["vmpin"] + sys.argv[2:]
from vmpin.entry import main
code = main()
print(json.dumps({"code": code, "modules": sorted(set(sys.modules) - before)}))
"""


def test_hook_imports_nothing_heavy(tmp_path: Path) -> None:
    bundle = tmp_path / "b"
    bundle.mkdir()
    (bundle / "config.json").write_text(json.dumps(
        {"linux": {"resources": {"cpu": {"cpus": "0"}}}}))
    state = json.dumps({"id": "lean1", "pid": 1, "bundle": str(bundle)})
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, state, "--state-dir", str(tmp_path / "s"),
         "--runc-root", str(tmp_path / "runc"), "hook", "--strict", "prestart"],
        capture_output=True, text=True, timeout=60, check=True,
    )
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["code"] == 0, proc.stderr
    loaded = set(out["modules"])
    assert "vmpin.state.journal" in loaded
    assert not [m for m in FORBIDDEN if m in loaded]
    # ...and the event it journaled is in the store for the next reader
    listed = subprocess.run(
        [sys.executable, "-m", "vmpin", "--state-dir", str(tmp_path / "s"), "containers",
         "--json"], capture_output=True, text=True, timeout=60, check=True)
    assert [(c["id"], c["cpus"]) for c in json.loads(listed.stdout)] == [("lean1", "0")]


def test_cli_commands_still_reach_typer(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "vmpin", "hook", "--help"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "Fail-open" in proc.stdout
