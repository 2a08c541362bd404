"""vmpin.linux.debugfs on its own: the parser, the mounted reader on a fixture tree, and the
private-namespace reader as a real child (its faults made by small real ``unshare`` stand-ins).

The reader against a real VM is tested with the classification (tests/runtimes/test_threads.py).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from pytest_mock import MockerFixture

from tests.support.qemu_util import debugfs_mount_points, wait_until
from vmpin.core.errors import HostError
from vmpin.linux import debugfs

HOST_DEBUG = "/sys/kernel/debug"


@pytest.mark.parametrize(
    ("text", "found", "other"),
    [
        ("", {}, []),
        ("700-12/vcpu0/pid:701\n700-12/vcpu1/pid:702\n", {12: {0: 701, 1: 702}}, []),
        ("700-12/vcpu3/pid:0\n", {12: {3: 0}}, []),  # has not run yet: the caller skips 0
        ("700-12/vcpu0/pid:701\n700-15/vcpu0/pid:703\n", {12: {0: 701}, 15: {0: 703}}, []),
        # another VMM's directory (a pid with ours as prefix) and malformed lines: not data
        ("7001-12/vcpu0/pid:9\n700-x/vcpu0/pid:9\n700-12/vcpuX/pid:9\n700-12/vcpu0/pid:\n"
         "700-12/vcpu0/tsc:9\n700-12/vcpu0/pid:9:9\n",
         {}, ["7001-12/vcpu0/pid:9", "700-x/vcpu0/pid:9", "700-12/vcpuX/pid:9",
              "700-12/vcpu0/pid:", "700-12/vcpu0/tsc:9", "700-12/vcpu0/pid:9:9"]),
        ("mount: /sys/kernel/debug: permission denied.\n   dmesg(1) may have more\n", {},
         ["mount: /sys/kernel/debug: permission denied.", "dmesg(1) may have more"]),
    ],
)  # fmt: skip
def test_parse(text: str, found: debugfs.VcpuPids, other: list[str]) -> None:
    assert debugfs._parse(text, 700) == (found, other)


def test_mounted_reader_on_a_fixture_tree(tmp_path: Path) -> None:
    kvm = tmp_path / "kernel" / "debug" / "kvm"
    for name, value in (("700-12/vcpu0", "701\n"), ("700-12/vcpu1", "0\n"), ("701-3/vcpu0", "9")):
        (kvm / name).mkdir(parents=True)
        (kvm / name / "pid").write_text(value)
    assert debugfs.kvm_dir(str(tmp_path)) == str(kvm)
    assert debugfs.vcpu_pids(str(tmp_path), 700, [12, 13], [0, 1, 2]) == {12: {0: 701, 1: 0}}
    assert debugfs.vcpu_pids(str(tmp_path), 702, [12], [0]) == {}


def _root() -> None:
    if os.geteuid() != 0:
        pytest.skip("not root: a mount namespace and a mount need CAP_SYS_ADMIN")
    if debugfs.find_binary("unshare") is None:
        pytest.skip("util-linux unshare is not installed")


def test_private_reader_leaves_the_host_tree_alone() -> None:
    """A real child: no VM has this test's pid, so nothing is found; nothing is mounted here."""
    _root()
    assert HOST_DEBUG not in debugfs_mount_points()
    assert debugfs.vcpu_pids_private("/sys", os.getpid(), 5.0) == {}
    assert HOST_DEBUG not in debugfs_mount_points()
    assert not os.path.exists(f"{HOST_DEBUG}/kvm")


def test_private_reader_mount_point_missing_is_one_line() -> None:
    _root()
    with pytest.raises(HostError, match=r"^private debugfs: mount -t debugfs failed: mount: "):
        debugfs.vcpu_pids_private("/nonexistent-sys", os.getpid(), 5.0)


def test_private_reader_timeout_kills_the_whole_group(tmp_path: Path) -> None:
    """Past the timeout the child and what it started (mount, in real life) are killed with
    their process group, and the child is reaped: no zombie, no orphan."""
    fake = tmp_path / "unshare"
    fake.write_text(
        '#!/bin/sh\nsleep 30 &\necho "$$ $!" > "$(dirname "$0")/pids"\nwait\n'
    )
    fake.chmod(0o755)
    t0 = time.monotonic()
    with pytest.raises(HostError, match=r"timed out after 0\.3 s"):
        debugfs.vcpu_pids_private("/sys", 1, 0.3, unshare=str(fake))
    assert time.monotonic() - t0 < 2.0
    child, grandchild = (int(p) for p in (tmp_path / "pids").read_text().split())
    assert not os.path.exists(f"/proc/{child}")  # reaped by us
    # the orphan was killed too; init reaps it (every ~2 s here), not us
    assert wait_until(lambda: _dead(grandchild), 5)


def _dead(pid: int) -> bool:
    """Gone, or a zombie (killed, not yet reaped by its new parent)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_private_reader_missing_binary(mocker: MockerFixture, tmp_path: Path) -> None:
    mocker.patch.object(debugfs, "SEARCH_PATH", str(tmp_path))
    with pytest.raises(HostError, match="no unshare binary"):
        debugfs.vcpu_pids_private("/sys", 1, 1.0)


def test_private_reader_spawn_refused(mocker: MockerFixture) -> None:
    """posix_spawn itself fails (exec refused): one line, and no fd is left open."""
    before = set(os.listdir("/proc/self/fd"))
    mocker.patch("os.posix_spawn", side_effect=PermissionError(13, "Permission denied"))
    with pytest.raises(HostError, match="cannot start /bin/unshare: Permission denied"):
        debugfs.vcpu_pids_private("/sys", 1, 1.0, unshare="/bin/unshare")
    assert set(os.listdir("/proc/self/fd")) <= before


def test_private_reader_exit_status_without_words(tmp_path: Path) -> None:
    fake = tmp_path / "unshare"
    fake.write_text("#!/bin/sh\nexit 3\n")
    fake.chmod(0o755)
    with pytest.raises(HostError, match=r"^private debugfs: exit status 3$"):
        debugfs.vcpu_pids_private("/sys", 1, 5.0, unshare=str(fake))
