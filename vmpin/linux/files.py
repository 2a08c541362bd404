"""Reading files that someone else can write: the one place their rules live.

A bundle's ``config.json``, a ``-r`` resources file, runc's ``state.json``, kubelet's
checkpoint, a published guest map and the hooks' journal entries are all written by other
programs (or other users), and read by vmpin as root, sometimes while it holds a lock.  So
every such read goes through :func:`read_bytes`, which

- does not follow a symlink in the last component (``O_NOFOLLOW``: a link planted where a
  map or config is expected is refused, not read through), optionally relative to a
  directory fd (``dir_fd``) the caller opened without following links either;
- opens with ``O_NONBLOCK`` and then refuses anything but a regular file (``fstat``): opening
  a FIFO for reading would otherwise block until a writer comes, and ``/dev/zero`` or
  ``/dev/urandom`` would never end;
- reads at most ``limit`` bytes (a regular file can still be huge, or grow while read);

and :func:`load_json` parses untrusted JSON with a nesting limit (the C decoder raises
``RecursionError`` at ~1000 levels; a document that deep is not one vmpin reads), through
:mod:`vmpin.wire.jsonio` (json's C decoder without importing json and re).

Stdlib only, no ``typing`` import: the hook and the guest program use it.
"""

from __future__ import annotations

import os
import stat
import time

from vmpin.core.errors import PermissionDenied, SpecError, UnsafeFile
from vmpin.wire.jsonio import loads, loads_members

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.lean.records)
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    from vmpin.core.errors import VmpinError
    from vmpin.wire.jsonio import Selector

#: default size limit: every file vmpin reads this way is a few KiB (a Kata config.json with
#: all its annotations is ~20 KiB; a 1,000-pod kubelet checkpoint ~200 KiB).
MAX_BYTES = 4 << 20
#: default JSON nesting limit: OCI config.json nests ~6 deep, the guest map 3.
MAX_DEPTH = 64

_KINDS = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISLNK, "a symlink"),
)


def _kind(mode: int) -> str:
    for test, name in _KINDS:
        if test(mode):
            return name
    return "not a regular file"


def read_bytes(
    path: str, *, limit: int = MAX_BYTES, dir_fd: int | None = None, what: str = "file"
) -> bytes:
    """The whole content of the regular file ``path`` (relative to ``dir_fd`` when given).

    Raises :class:`UnsafeFile` (one line naming the path) for a symlink, FIFO, device,
    directory or a file over ``limit`` bytes; ``OSError`` (``FileNotFoundError`` included) as
    the caller's to translate, since only it knows what a missing file means.
    """
    return _read(path, limit, dir_fd, what)[0]


def read_host_file(
    path: str, what: str, failed: type[VmpinError], refused: type[VmpinError]
) -> tuple[bytes, int] | None:
    """Another program's file (runc's state, kubelet's checkpoint) and its mtime (ns, of the
    inode read, taken before the read: a later write moves it again); None when there is
    none.  What it cannot be is one line naming ``what`` and the path:
    :class:`PermissionDenied` when it may not be read, ``failed`` for another error of the
    read, ``refused`` for a FIFO, device or huge file where it should be."""
    try:
        raw, st = _read(path, MAX_BYTES, None, what)
    except FileNotFoundError:
        return None
    except OSError as err:
        if isinstance(err, PermissionError):  # EACCES, EPERM
            raise PermissionDenied(f"permission denied reading {what} {path}") from err
        raise failed(f"reading {what} {path}: {err.strerror}") from err
    except SpecError as err:
        raise refused(str(err)) from None
    return raw, st.st_mtime_ns


def _read(path: str, limit: int, dir_fd: int | None, what: str) -> tuple[bytes, os.stat_result]:
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, dir_fd=dir_fd)
    except OSError as err:
        # ELOOP: the last component is a symlink (O_NOFOLLOW); say so instead of "too many
        # levels of symbolic links".  (errno imported here, on a failure only: the hooks
        # load no errno module, procfs neither)
        import errno

        if err.errno == errno.ELOOP:
            raise UnsafeFile(f"{what} {path}: is a symlink, refused (not followed)") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFile(f"{what} {path}: is {_kind(st.st_mode)}, refused (regular files only)")
        if st.st_size > limit:
            raise UnsafeFile(f"{what} {path}: {st.st_size} bytes, over the limit of {limit}")
        chunks: list[bytes] = []
        size = 0
        while True:
            chunk = os.read(fd, min(1 << 20, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                raise UnsafeFile(f"{what} {path}: grew over the limit of {limit} bytes")
        return b"".join(chunks), st
    finally:
        os.close(fd)


def stale_stamp(stamp: str, max_age: float, now_ns: int) -> bool | None:
    """For a temp file named after ``time.monotonic_ns()`` when it was made: whether it is
    older than ``max_age`` seconds, or from an earlier boot (a stamp ahead of the clock);
    None when ``stamp`` is not such a number.  CLOCK_MONOTONIC is system-wide and no one
    sets it: an mtime is wall-clock time, and a clock stepped forward made a live writer's
    file look old to another process's sweep (issue 26)."""
    if not stamp.isdigit():
        return None
    made = int(stamp)
    return made > now_ns or now_ns - made > max_age * 1e9


def save_cache(path: str, data: bytes, hold: list[int] | None = None) -> None:
    """Replace the cache file ``path`` with ``data``, best effort: a reader sees the old file
    or the new one, never part of one, and a write that fails (a read-only or full state
    dir) leaves nothing behind and only means reading the source again next time.  No sync:
    a cache lost in a crash is rebuilt.

    ``hold``: the old file is opened and its descriptor appended there before the rename,
    for the caller to close once no one waits on it: the filesystem frees a file when its
    last link and descriptor go, and freeing it in the rename was ~1.5 ms of it on ext4
    under load (as for the guest maps: vmpin.runtimes.publish)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(tmp, flags, 0o600)
        try:
            if os.write(fd, data) != len(data):
                raise OSError(28, "short write")
        finally:
            os.close(fd)
        if hold is not None:
            held = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
            try:  # noqa: SIM105 (contextlib stays off the hook's path)
                hold.append(os.open(path, held))
            except OSError:
                pass  # (none yet, or not a file we may open: nothing to hold)
        os.replace(tmp, path)
    except OSError:
        try:  # noqa: SIM105 (contextlib stays off the hook's path)
            os.unlink(tmp)
        except OSError:
            pass


def listing(directory: str) -> list[str]:
    """The names in ``directory``, sorted; none when it is missing or cannot be listed (the
    VM dir: a pass records its entries and a hook compares them, vmpin.state.summary)."""
    try:
        return sorted(os.listdir(directory))
    except OSError:
        return []


def fsync_path(path: str) -> None:
    """fsync the file or directory at ``path`` (a directory: the renames and creations in
    it); OSError as the kernel gives it."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def identity(path: str, dir_fd: int | None = None) -> tuple[int, int, int, int, int] | None:
    """What tells a version of the regular file ``path`` from another, without reading it:
    (device, inode, size, mtime, ctime in ns) of the file itself (a final symlink is not
    followed); None when it is missing, unreadable or not a regular file.

    For a reader that re-reads the same small files every pass (a pidfile, a published map):
    an equal identity is the file it read before.  A rewrite in place changes mtime and
    ctime, a replacement by rename the inode.  (Timestamps have the kernel's tick as grain:
    a rewrite to the same size within one tick of the last read is missed until the next
    change: so a version is remembered only once :func:`settled`.)
    """
    try:
        st = os.stat(path, dir_fd=dir_fd, follow_symlinks=False)
    except (OSError, ValueError):
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    return version(st)


def version(st: os.stat_result) -> tuple[int, int, int, int, int]:
    """(device, inode, size, mtime, ctime in ns) of ``st``: what :func:`identity` tells a
    file's versions by, and a directory's too (an entry made or removed moves its mtime
    and ctime: a listing kept while its directory's version holds, as :func:`remember`
    keeps it once :func:`settled`)."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


#: a file unchanged for this long (ns) has a timestamp older than the kernel's tick: any later
#: change gets a later one
SETTLE_NS = 100_000_000


#: files a memo of :func:`remember` holds at most (then it starts afresh)
MEMO_LIMIT = 8192


def settled(ident: tuple[int, int, int, int, int]) -> bool:
    """True when the version :func:`identity` saw is old enough to be told from any change
    that follows it (its mtime and ctime more than :data:`SETTLE_NS` in the past)."""
    return time.time_ns() - max(ident[3], ident[4]) > SETTLE_NS


def remember(
    memo: dict[str, tuple[tuple[int, int, int, int, int], Any]],
    path: str,
    ident: tuple[int, int, int, int, int],
    value: Any,
) -> None:
    """Keep what was read from ``path`` with the identity of the version it was read from
    (taken before the read: a change during it is seen as one next time), once that version
    is :func:`settled`; the memo's reader trusts it while ``identity(path)`` is equal."""
    if not settled(ident):
        return
    if len(memo) >= MEMO_LIMIT and path not in memo:
        memo.clear()
    memo[path] = (ident, value)


def _depth_ok(doc: Any, max_depth: int) -> bool:
    """Iteratively: a walk that recursed would itself be the RecursionError we refuse."""
    stack: list[tuple[Any, int]] = [(doc, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            children: Any = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        if depth > max_depth:
            return False
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return True


def load_json(
    data: str | bytes,
    where: str,
    *,
    max_depth: int = MAX_DEPTH,
    object_pairs_hook: Callable[[list[tuple[str, Any]]], Any] | None = None,
    keep: Selector | None = None,
) -> Any:
    """Parse untrusted JSON; :class:`SpecError` naming ``where`` for anything malformed,
    undecodable or nested deeper than ``max_depth``. ``object_pairs_hook`` as for
    :func:`json.loads` (vmpin.core.gojson keeps repeated keys as Go's decoder sees them).

    ``keep``: only these members of the document's object are kept
    (:func:`vmpin.wire.jsonio.loads_members`); the depth limit then holds for what is kept,
    the rest is only checked to be JSON (the C scanner's own limit, ~1000 levels: beyond it
    the same SpecError)."""
    try:
        if keep is None:
            doc = loads(data, object_pairs_hook=object_pairs_hook)
        else:
            doc = loads_members(data, keep, object_pairs_hook=object_pairs_hook)
    except RecursionError:
        raise SpecError(f"{where}: JSON nested too deeply (limit {max_depth})") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise SpecError(f"{where}: malformed JSON: {err}") from None
    if not _depth_ok(doc, max_depth):
        raise SpecError(f"{where}: JSON nested too deeply (limit {max_depth})")
    return doc


def check_text(value: str, where: str) -> str:
    """``value`` unless it cannot be stored as UTF-8 (JSON's ``\\ud800`` escapes decode to lone
    surrogates, which SQLite and every encoder after it refuse)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise SpecError(f"{where}: text {value!r} is not valid Unicode (lone surrogate)") from None
    return value
