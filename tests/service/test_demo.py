"""``vmpin demo`` as a newcomer runs it: a real QEMU and a real runc container, the table of
affinities before and after, the audit, and nothing left behind -- also when it is stopped
half-way (issue 29, item 6)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import vmpin_cmd
from tests.support.runc_util import missing as runc_missing

pytestmark = [pytest.mark.qemu, pytest.mark.runc, pytest.mark.cgroup_v1]


@pytest.fixture(autouse=True)
def _needs_runc() -> None:
    why = runc_missing()
    if why:
        pytest.skip(why)


def _left_behind(out: str) -> list[str]:
    """What the run named (QEMU pid, runc container, scratch dir) that still exists."""
    left = []
    for pid in re.findall(r"QEMU pid (\d+)", out):
        stat = Path(f"/proc/{pid}/stat")
        if stat.exists() and ") Z " not in stat.read_text() and "qemu" in Path(
            f"/proc/{pid}/cmdline"
        ).read_bytes().decode(errors="replace"):
            left.append(f"QEMU {pid}")
    for cid in set(re.findall(r"runc container (demo-[0-9a-f]+-runc)", out)):
        if Path(f"/sys/fs/cgroup/cpuset/{cid}").exists():
            left.append(f"cgroup of {cid}")
    for d in re.findall(r"scratch state in (\S+)\)", out):
        if Path(d).exists():
            left.append(d)
    return left


def test_demo_shows_the_job_and_leaves_nothing() -> None:
    proc = subprocess.run([*vmpin_cmd(), "demo"], capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "before vmpin" in out and "after create" in out and "after update" in out
    rows = [line for line in out.splitlines() if line.startswith(("qemu ", "runc "))]
    assert any(" vcpu 0 " in r for r in rows) and any(r.startswith("runc ") for r in rows)
    assert "3. vmpin audit: ok (0 violations)" in out
    assert out.count("cleaned up:") == 3
    assert _left_behind(out) == []


def test_demo_stopped_half_way_cleans_up() -> None:
    proc = subprocess.Popen([*vmpin_cmd(), "demo"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout is not None
    seen = []
    deadline = time.monotonic() + 120
    for line in proc.stdout:
        seen.append(line)
        if "runc container" in line or time.monotonic() > deadline:
            break
    proc.send_signal(signal.SIGTERM)  # (Ctrl-C takes the same path)
    rest, err = proc.communicate(timeout=120)
    out = "".join(seen) + rest
    assert "interrupted" in out, out + err
    assert "cleaned up:" in out
    assert _left_behind(out) == [], out
    assert proc.returncode != 0


def test_demo_says_what_is_missing(tmp_path: Path) -> None:
    """Without runc on PATH: one line naming the package, exit 2, nothing started."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    qemu = subprocess.run(["sh", "-c", "command -v qemu-system-x86_64"], capture_output=True,
                          text=True, check=True).stdout.strip()  # fmt: skip
    os.symlink(qemu, bin_dir / "qemu-system-x86_64")
    env = {**os.environ, "PATH": str(bin_dir)}
    proc = subprocess.run([*vmpin_cmd(), "demo"], capture_output=True, text=True, env=env,
                          timeout=60)  # fmt: skip
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "runc" in lines[0] and "apt-get install" in lines[0]
