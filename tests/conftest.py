"""Shared fixtures: a private state dir and HostPaths per test, pointing at the real host."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from vmpin.linux.paths import HostPaths

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"


def vmpin_cmd() -> list[str]:
    """How tests run the CLI: the console script beside this interpreter (a venv's bin/, which
    need not be on PATH), else the one on PATH, else the module."""
    beside = os.path.join(os.path.dirname(sys.executable), "vmpin")
    if os.access(beside, os.X_OK):
        return [beside]
    exe = shutil.which("vmpin")
    return [exe] if exe else [sys.executable, "-m", "vmpin"]


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    d = tmp_path / "state"
    d.mkdir()
    return d


@pytest.fixture
def vm_dir(tmp_path: Path) -> Path:
    d = tmp_path / "vm"
    d.mkdir()
    return d


@pytest.fixture
def paths(state_dir: Path, vm_dir: Path, tmp_path: Path) -> HostPaths:
    runc_root = tmp_path / "runc"
    publish = tmp_path / "publish"
    return HostPaths(
        state_dir=str(state_dir),
        vm_dir=str(vm_dir),
        runc_root=str(runc_root),
        kubelet_state=str(tmp_path / "cpu_manager_state"),
        publish_dir=str(publish),
    )


@pytest.fixture
def env(paths: HostPaths) -> dict[str, str]:
    """Environment for a vmpin subprocess that uses this test's paths."""
    e = dict(os.environ)
    e.update(
        VMPIN_STATE_DIR=paths.state_dir,
        VMPIN_VM_DIR=paths.vm_dir,
        VMPIN_RUNC_ROOT=paths.runc_root,
        VMPIN_KUBELET_STATE=paths.kubelet_state,
        VMPIN_PUBLISH_DIR=paths.publish_dir,
    )
    return e
