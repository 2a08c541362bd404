"""Spare files: made ahead off a start's path, taken by a rename on it (issue 14: creating
a file is 0.2-0.3 ms on this machine's ext4, a rename 0.02 ms)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from vmpin.linux.files import SPARES, make_spares, open_spare
from vmpin.linux.paths import HostPaths
from vmpin.state.journal import append, journal_dir


def spares(d: Path) -> list[str]:
    return sorted(os.listdir(d)) if d.exists() else []


def test_each_spare_is_taken_once_then_the_caller_creates(tmp_path: Path) -> None:
    d = tmp_path / "spare"
    assert make_spares(str(d)) == SPARES
    assert make_spares(str(d)) == 0  # all there
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    inodes = set()
    for i in range(SPARES):
        dest = tmp_path / f"out{i}"
        fd = open_spare(str(d), str(dest))
        assert fd is not None
        os.write(fd, b"x%d" % i)
        inodes.add(os.fstat(fd).st_ino)
        os.close(fd)
        assert dest.read_bytes() == b"x%d" % i
    assert len(inodes) == SPARES and spares(d) == []
    assert open_spare(str(d), str(tmp_path / "none")) is None
    assert not (tmp_path / "none").exists()
    assert make_spares(str(d)) == SPARES


@pytest.mark.parametrize("kind", ["hardlink", "symlink", "not-empty", "directory"])
def test_a_spare_someone_planted_is_not_written(tmp_path: Path, kind: str) -> None:
    """Only an empty regular file with one link is written: a hard link to a file elsewhere
    would be written through, a symlink followed."""
    d = tmp_path / "spare"
    d.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("precious")
    planted = d / ".spare-0"
    if kind == "hardlink":
        os.link(victim, planted)
    elif kind == "symlink":
        planted.symlink_to(victim)
    elif kind == "not-empty":
        planted.write_text("left over")
    else:
        planted.mkdir()
    (d / ".spare-1").touch()
    dest = tmp_path / "out"
    fd = open_spare(str(d), str(dest))
    assert fd is not None  # the next, genuine spare
    os.write(fd, b"mine")
    os.close(fd)
    assert dest.read_bytes() == b"mine"
    assert victim.read_text() == "precious"
    # a planted file was taken away and removed; what is not a file at all is left alone
    assert spares(d) == ([".spare-0"] if kind in ("directory", "symlink") else [])


def test_no_spare_across_filesystems(tmp_path: Path) -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs /dev/shm on another filesystem than the test's tmp dir")
    d = shm / f"vmpin-spares-{os.getpid()}"
    try:
        make_spares(str(d), 1)
        assert open_spare(str(d), str(tmp_path / "out")) is None
        assert spares(d) == [".spare-0"]  # left for a writer on its own filesystem
    finally:
        for n in spares(d):
            os.unlink(d / n)
        d.rmdir()


def test_the_journal_and_the_guest_map_write_into_spares(paths: HostPaths, tmp_path: Path) -> None:
    from vmpin.runtimes.publish import map_path, publish_map

    make_spares(paths.spare_dir)
    ino = {os.stat(os.path.join(paths.spare_dir, n)).st_ino for n in spares(Path(paths.spare_dir))}
    name = append(paths.state_dir, {"v": 1, "stage": "poststop", "ident": None, "runtime": "runc"})
    event = os.stat(os.path.join(journal_dir(paths.state_dir), name))
    assert event.st_ino in ino and stat.S_IMODE(event.st_mode) == 0o600
    sid = "spared"
    Path(paths.publish_dir, sid, "mounts").mkdir(parents=True)
    doc = {"version": 1, "sandbox": sid, "vcpu_to_host": {"0": 1}, "containers": {}}
    assert publish_map(paths, sid, doc).written
    published = os.stat(map_path(paths, sid))
    assert published.st_ino in ino and stat.S_IMODE(published.st_mode) == 0o644
    assert len(spares(Path(paths.spare_dir))) == SPARES - 2
