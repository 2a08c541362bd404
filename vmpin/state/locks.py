"""The state dir's lock files: owner-only, and never waited on past a deadline.

``<state dir>/locks/node.lock`` is the node's plan lock, the one writer order for the node.
Every pass that applies -- a hook's own, ``vmpin update``'s, ``reconcile --once``, the
agent's -- holds it from the moment it observes the node until its pins, its records and its
guest maps are written (:class:`vmpin.reconcile.reconciler.Reconciler`).  Without it two
passes could observe the store one after the other and apply in the opposite order: 12 of
80 storms of 20 parallel ``vmpin update`` ended with the kernel holding an older set than
the store (issue 26).  A writer's store write comes before its pass takes the lock, so the
last pass to take it has seen the last write.

Never waited on past the caller's deadline: a holder may be stopped (SIGSTOP, a stuck disk),
and a hook must return well within Kata's 10 s hook timeout (docs/hooks.md).
:meth:`NodeLock.acquire` polls until the deadline and then says no; the caller goes on
without the lock, after writing a token of its own into the lock file.  A holder that finds
another token there than when it took the lock (:meth:`NodeLock.overtaken`: someone ran a
pass beside it, and it may have applied an older plan over that one's) plans again; a pass
that ran without the lock plans again when the store moved while it ran.  So the last write
to the store is what the kernel ends with, lock or not; the lock only makes that cheap (no
pass is planned twice).

Owner-only: ``flock`` needs nothing but an open descriptor, so whoever can open a lock file
can hold it for ever and stall every pass.  The locks directory is made 0700 and checked (a
real directory, ours, nothing for group or others), its parent (the state dir) must be ours
and writable by no one else, and a lock file must be a regular file of ours, mode 0600, one
link; one that is not (an older vmpin's, a hand-made one) is replaced -- the directory is
ours and 0700, so only root could have put it there.  The agent's ``agent.lock`` is opened
with the same checks (:func:`open_lock_file`).

Lean: the hook's own pass takes the node lock (os, fcntl and stat only).
"""

from __future__ import annotations

import errno
import fcntl
import os
import time
from stat import S_IMODE, S_ISDIR, S_ISREG

from vmpin.core.errors import StateError

LOCKS = "locks"
NODE = "node.lock"
#: how long a pass that names no deadline waits for the node lock (the agent, ``reconcile
#: --once``): far longer than any pass holds it, short enough that a stopped holder does
#: not stop the node's repairs for good
WAIT = 10.0
#: the polling interval's bounds (seconds): a pass holds the lock for milliseconds
_POLL_MIN = 0.0005
_POLL_MAX = 0.01


def lock_dir(state_dir: str) -> str:
    return os.path.join(state_dir, LOCKS)


def check_parent(state_dir: str) -> None:
    """The state dir: a directory of ours that no one else may write (or they could put their
    own ``locks`` in place of ours)."""
    try:
        st = os.lstat(state_dir)
    except OSError as err:
        raise StateError(f"{state_dir}: {err.strerror}") from None
    if not S_ISDIR(st.st_mode):
        raise StateError(f"{state_dir}: not a directory (a symlink?): no lock taken there")
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise StateError(
            f"{state_dir}: owner uid {st.st_uid}, mode {S_IMODE(st.st_mode):04o}: others could"
            " replace its lock files; make it owned by this user and 0700"
        )


def _ensure_lock_dir(state_dir: str) -> str:
    """``<state dir>/locks``, made 0700 if missing, checked (and narrowed to 0700) if not."""
    d = lock_dir(state_dir)
    try:
        os.mkdir(d, 0o700)
    except FileExistsError:
        pass
    except FileNotFoundError:
        os.makedirs(state_dir, mode=0o700, exist_ok=True)
        return _ensure_lock_dir(state_dir)
    except OSError as err:
        raise StateError(f"{d}: cannot create: {err.strerror}") from None
    check_parent(state_dir)
    try:
        st = os.lstat(d)
    except OSError as err:
        raise StateError(f"{d}: {err.strerror}") from None
    if not S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise StateError(f"{d}: not a directory of uid {os.geteuid()} (a symlink?): refused")
    if S_IMODE(st.st_mode) != 0o700:
        # ours: whatever someone could open in it before is replaced below (each file checked)
        try:
            os.chmod(d, 0o700)
        except OSError as err:
            raise StateError(f"{d}: cannot make it 0700: {err.strerror}") from None
    return d


_FLAGS = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _sound(fd: int) -> bool:
    st = os.fstat(fd)
    return (
        S_ISREG(st.st_mode)
        and st.st_uid == os.geteuid()
        and S_IMODE(st.st_mode) == 0o600
        and st.st_nlink == 1
    )


def open_lock_file(path: str) -> int:
    """A descriptor of the lock file ``path`` (made 0600 if missing), which no one but this
    user can open: a regular file of ours, mode 0600, one link.  Anything else found there
    (a symlink, a FIFO, another owner or mode, a hard link) is removed and made anew: its
    directory must be ours (the caller checks), so only root could have put it there."""
    for _ in range(3):
        try:
            fd = os.open(path, _FLAGS, 0o600)
        except OSError as err:
            if err.errno not in (errno.ELOOP, errno.ENXIO, errno.EISDIR, errno.EACCES):
                raise StateError(f"{path}: cannot open the lock: {err.strerror}") from None
            fd = -1
        if fd >= 0:
            if _sound(fd):
                return fd
            os.close(fd)
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                os.rmdir(path)
            else:
                os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as err:
            raise StateError(f"{path}: not an owner-only lock file, and cannot be replaced:"
                             f" {err.strerror}") from None
    raise StateError(f"{path}: not an owner-only lock file (replaced three times): refused")


#: the token a pass that goes on without the lock writes (see NodeLock.acquire)
_TOKEN = 48


def _stamp(fd: int) -> bytes:
    return os.pread(fd, _TOKEN, 0)


class NodeLock:
    """The node's plan lock (see the module's docstring); one per process is enough.

    ``acquire(deadline)`` -> True when held, False when the deadline passed first (a token
    is then written into the lock file: the holder will know).  ``overtaken()``: whether
    anyone went on without the lock since it was taken (or since the last ``overtaken()``).
    ``release()``: let go.
    """

    __slots__ = ("_fd", "_held", "_stamp", "error", "path", "state_dir", "went_unlocked")

    def __init__(self, state_dir: str) -> None:
        self.state_dir = state_dir
        self.path = os.path.join(lock_dir(state_dir), NODE)
        self._fd = -1
        self._held = False
        self._stamp = b""
        #: the last :meth:`take` went on without the lock (held past its deadline)
        self.went_unlocked = False
        #: why the lock could not be used at all in the last :meth:`take` (its file or
        #: directory is not owner-only and cannot be made so); None when it could
        self.error: str | None = None

    def take(self, deadline: float | None) -> bool:
        """A pass's way in: :meth:`acquire` until ``deadline`` (default :data:`WAIT` seconds
        from now); whether held.  An unusable lock must not stop the pins: the pass goes on
        without it, as past its deadline, and :attr:`error` says why (the agent reports it)."""
        try:
            held = self.acquire(time.monotonic() + WAIT if deadline is None else deadline)
        except StateError as err:
            self.error = str(err)
            held = False
        else:
            self.error = None
        self.went_unlocked = not held
        return held

    @property
    def held(self) -> bool:
        return self._held

    def _open(self) -> int:
        if self._fd < 0:
            _ensure_lock_dir(self.state_dir)
            self._fd = open_lock_file(self.path)
        return self._fd

    def acquire(self, deadline: float) -> bool:
        """Take the lock, polling until ``deadline`` (``time.monotonic()``); False when it
        passed first (another process holds the lock: stopped, or slower than the caller
        may wait).  Raises StateError when the lock file is not owner-only and cannot be
        made so."""
        fd = self._open()
        pause = _POLL_MIN
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                time.sleep(min(pause, left))
                pause = min(pause * 2, _POLL_MAX)
                continue
            self._held = True
            self._stamp = _stamp(fd)
            return True
        # Going on without it: the holder is told, so that it plans again when it goes on
        # (its plan may be older than the one this caller applies).  A token of this call's
        # own, not a timestamp: file times move in clock ticks, and two marks in one tick
        # would read as one.
        token = f"{os.getpid()} {time.monotonic_ns()} {os.urandom(4).hex()}"
        try:  # noqa: SIM105 (contextlib stays off the hook's path)
            os.pwrite(fd, token.encode().ljust(_TOKEN), 0)
        except OSError:
            pass
        return False

    def overtaken(self) -> bool:
        """Whether another process went on without the lock since this one took it, or since
        the last call that said so."""
        if not self._held:
            return False
        now = _stamp(self._fd)
        if now == self._stamp:
            return False
        self._stamp = now
        return True

    def release(self) -> None:
        if self._held:
            self._held = False
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        self.release()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        # a reconciler's lock goes with it (a process may build many: tests, the CLI's
        # update of a domain); the kernel drops the flock with the descriptor
        if self._fd >= 0:
            try:  # noqa: SIM105 (contextlib stays off the hook's path)
                _close(self._fd)
            except OSError:
                pass
            self._fd = -1


_close = os.close  # (kept for __del__ at interpreter exit, when module globals may be gone)
