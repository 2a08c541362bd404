"""The state dir's lock files (vmpin.state.locks): owner-only, and never waited on past a
deadline.

Every lock a hook or ``vmpin update`` takes must be one that no other user can open (whoever
can open a file can ``flock`` it for ever): ``<state dir>/locks`` is 0700 and ours, each lock
file 0600, ours, a regular file with one link, and anything else found in its place is
replaced.  Holders are real processes (a forked child that takes the lock and waits).
"""

from __future__ import annotations

import fcntl
import multiprocessing
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from vmpin.core.errors import StateError
from vmpin.state import locks
from vmpin.state.locks import NodeLock, open_lock_file

NOBODY = 65534


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def node_lock_file(state_dir: Path) -> Path:
    return state_dir / "locks" / "node.lock"


def _hold(state_dir: str, ready: multiprocessing.synchronize.Event,
          go: multiprocessing.synchronize.Event) -> None:
    lock = NodeLock(state_dir)
    assert lock.acquire(time.monotonic() + 10)
    ready.set()
    go.wait(30)
    lock.close()


@pytest.fixture
def holder(state_dir: Path) -> Iterator[multiprocessing.synchronize.Event]:
    """Another process holding the node lock until the event returned is set."""
    ctx = multiprocessing.get_context("fork")
    ready, go = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_hold, args=(str(state_dir), ready, go))
    proc.start()
    try:
        assert ready.wait(10)
        yield go
    finally:
        go.set()
        proc.join(10)
        if proc.exitcode is None:
            proc.kill()
            proc.join()


def test_made_owner_only(state_dir: Path) -> None:
    lock = NodeLock(str(state_dir))
    assert lock.acquire(time.monotonic() + 1)
    path = node_lock_file(state_dir)
    assert mode(path.parent) == 0o700 and path.parent.stat().st_uid == os.geteuid()
    assert mode(path) == 0o600 and path.stat().st_uid == os.geteuid()
    lock.close()


@pytest.mark.parametrize("planted", ["mode", "owner", "symlink", "fifo", "hardlink", "dir"])
def test_a_lock_file_others_could_open_is_replaced(
    state_dir: Path, tmp_path: Path, planted: str
) -> None:
    path = node_lock_file(state_dir)
    path.parent.mkdir(mode=0o700)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("")
    if planted == "mode":
        path.write_text("")
        path.chmod(0o666)
    elif planted == "owner":
        path.write_text("")
        path.chmod(0o600)
        os.chown(path, NOBODY, NOBODY)
    elif planted == "symlink":
        path.symlink_to(elsewhere)
    elif planted == "fifo":
        os.mkfifo(path, 0o600)
    elif planted == "hardlink":
        elsewhere.chmod(0o600)
        os.link(elsewhere, path)
    else:
        path.mkdir()
    # whoever planted it holds it locked, for ever
    theirs = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    fcntl.flock(theirs, fcntl.LOCK_EX)
    fd = open_lock_file(str(path))
    try:
        st = os.fstat(fd)
        assert stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_nlink == 1
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # theirs locks nothing of ours
    finally:
        os.close(fd)
        os.close(theirs)
    assert elsewhere.exists() and elsewhere.read_text() == ""  # nothing done through it


def test_a_locks_dir_others_could_enter_is_narrowed(state_dir: Path) -> None:
    d = state_dir / "locks"
    d.mkdir()
    d.chmod(0o755)
    lock = NodeLock(str(state_dir))
    assert lock.acquire(time.monotonic() + 1)
    lock.close()
    assert mode(d) == 0o700


@pytest.mark.parametrize("case", ["state dir others may write", "locks dir a symlink",
                                  "locks dir of another owner"])  # fmt: skip
def test_no_lock_where_others_could_swap_it(state_dir: Path, tmp_path: Path, case: str) -> None:
    if case == "state dir others may write":
        state_dir.chmod(0o777)
    elif case == "locks dir a symlink":
        (tmp_path / "theirs").mkdir(mode=0o700)
        (state_dir / "locks").symlink_to(tmp_path / "theirs")
    else:
        (state_dir / "locks").mkdir(mode=0o700)
        os.chown(state_dir / "locks", NOBODY, NOBODY)
    why = "others could replace its lock files" if case.startswith("state") else "refused"
    with pytest.raises(StateError, match=why):
        NodeLock(str(state_dir)).acquire(time.monotonic() + 1)
    assert not (tmp_path / "theirs" / "node.lock").exists()


def test_never_waited_on_past_the_deadline(
    state_dir: Path, holder: multiprocessing.synchronize.Event
) -> None:
    """A holder that does not let go (stopped): False at the deadline, and the holder is told
    someone went on without the lock (a token in the file); it is told once."""
    lock = NodeLock(str(state_dir))
    started = time.monotonic()
    assert not lock.acquire(started + 0.3)
    assert 0.3 <= time.monotonic() - started < 0.3 + 0.5
    assert node_lock_file(state_dir).read_bytes().strip()
    holder.set()  # let go: now it is taken at once
    assert lock.acquire(time.monotonic() + 10)
    assert not lock.overtaken()
    other = NodeLock(str(state_dir))
    assert not other.acquire(time.monotonic() + 0.05)  # goes on without it
    assert lock.overtaken()
    assert not lock.overtaken()  # (said once)
    lock.close()
    other.close()


def test_the_wait_ends_as_soon_as_the_holder_lets_go(
    state_dir: Path, holder: multiprocessing.synchronize.Event
) -> None:
    lock = NodeLock(str(state_dir))
    started = time.monotonic()
    holder.set()
    assert lock.acquire(started + 10)
    assert time.monotonic() - started < 2
    lock.close()


def test_constants() -> None:
    assert locks.WAIT < 60  # a stopped holder stops no pass for good
