"""The journal: hook events as files, in front of the store, each applied exactly once.

Why a journal in front of SQLite: the hook delays every container start, and on this kind of
node importing ``sqlite3`` alone costs a third of a bare interpreter's start, and opening
the database, with its durable commits, more (the hook's budget is 1.5x a bare interpreter;
it reads and writes JSON through :mod:`vmpin.wire.jsonio`, without ``json`` and ``re``).  So
the hook does everything that needs the *moment* -- read the bundle (it may be gone later),
read the pid's start time (the pid may be reused later), detect the runtime, validate: all of
it :func:`vmpin.runtimes.oci.hook_event` -- and appends the result, a
:class:`vmpin.wire.hookevent.HookEvent`, as one small JSON file (every write checked, fsync,
rename, fsync the directory: all or nothing).  Whoever opens the store next (the agent, the
CLI, a Kata hook without an agent) applies pending events in order
(:meth:`vmpin.state.store.Store.ingest`), inside a transaction that also records each
event's name, so an event is applied exactly once even when two processes ingest at once.
This module owns the journal's files (the event's format is vmpin.wire.hookevent's); it
never imports the store.

For a plain runc container nothing is lost by applying later: at create runc has already
written the spec's cpuset into the container's cgroup, which is exactly vmpin's plan for it,
and a plain container's poststop changes no other container's placement.  A Kata sandbox is
different (its QEMU floats until pinned): its hooks wait for the agent's pass (which ingests),
or ingest and reconcile in-process when no agent answers.

Hostile input stops here, not in the store: the hook refuses what could not be stored (a pid
beyond ``PID_MAX``, text that is not valid UTF-8, oversized documents: vmpin.runtimes.oci,
vmpin.wire.hookevent), :func:`read_event` re-checks every file at ingest (a journal file is a
file: anyone with access to the state dir may have put it there), and what still cannot be
applied is quarantined under ``journal/bad/`` by the store, never retried and never fatal.

The backlog stays small without an agent: a plain container's hook that finds more than
:data:`INGEST_THRESHOLD` pending events applies a batch itself (within
:data:`INGEST_BUDGET` seconds), so the journal holds at most about that many events plus
what concurrent hooks are writing; the agent, the CLI and Kata hooks apply it too.
"""
from __future__ import annotations

import os
import time

from vmpin.core.errors import StateError
from vmpin.linux.files import fsync_path, read_bytes, stale_stamp
from vmpin.wire.hookevent import MAX_EVENT, HookEvent, from_json

JOURNAL = "journal"
BAD = "bad"
#: a plain hook applies the journal itself past this many pending events (see the docstring).
INGEST_THRESHOLD = 256
#: seconds a hook may spend applying the journal (containerd's default hook timeout is far
#: longer, Kata's shipped one 10 s: a hook must never be the reason a start times out).
INGEST_BUDGET = 2.0
#: a ``.tmp`` file older than this was left by a killed hook (a live one writes in ~1 ms and
#: no hook outlives its runtime's timeout); the next ingest removes it.
TMP_MAX_AGE = 60.0


# -- the journal -------------------------------------------------------------------------------
def journal_dir(state_dir: str) -> str:
    return os.path.join(state_dir, JOURNAL)


def append(state_dir: str, event: HookEvent) -> str:
    """Write one event file, complete or not at all; its name sorts in the order events happened.

    Every write is checked (a nearly full filesystem gives short writes), the file is fsynced
    before the rename publishes it, and the directory after, so an event the hook reported
    as recorded survives a crash.  Any failure removes the temporary file and raises
    StateError naming the file (the hook prints it; ``--strict`` fails the start).
    """
    return _write(state_dir, event, durable=True)[0]


def append_unsynced(state_dir: str, event: HookEvent) -> tuple[str, int]:
    """:func:`append` without either sync: the whole file renamed into place, and its name
    and its still open descriptor, which the caller must hand to :func:`sync` (it closes
    it) before it reports the event recorded (a Kata hook: while the agent's pass runs, or
    after its own when no agent answers; a disk's two syncs are ~0.5 ms of every start,
    issue 14; a plain one: at once, since the file's sync then commits the rename too and
    the directory's has nothing left to write).  The descriptor is kept for the file's sync,
    not opened again by name: one open and close fewer on every start.

    Readers never see a partial file (the rename comes after the writes); a crash before
    the sync may lose the event, or leave its file empty or cut short, which ingest
    quarantines and never applies.  Nothing was promised then: the hook had not returned.
    """
    return _write(state_dir, event, durable=False)


def _write(state_dir: str, event: HookEvent, *, durable: bool) -> tuple[str, int]:
    """The event's file written and renamed into place (see :func:`append`): its name, and,
    when not ``durable``, its descriptor, open (-1 when durable: closed, both synced)."""
    data = event.to_json()
    d = journal_dir(state_dir)
    # CLOCK_MONOTONIC is system-wide: names from different hook processes sort by time.
    name = f"{time.monotonic_ns():020d}-{os.getpid()}.json"
    tmp = os.path.join(d, f".{name}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        try:
            fd = os.open(tmp, flags, 0o600)
        except FileNotFoundError:  # the journal's first event: its directory is made then
            # (not by makedirs at every event: three system calls of every container start)
            os.makedirs(d, mode=0o700, exist_ok=True)
            fd = os.open(tmp, flags, 0o600)
    except OSError as err:
        raise StateError(f"{tmp}: cannot journal the event: {err.strerror}") from None
    try:
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                if written <= 0:  # (POSIX: a full disk gives ENOSPC, but never loop forever)
                    raise OSError(28, os.strerror(28))
                view = view[written:]
            if durable:
                os.fsync(fd)
            os.rename(tmp, os.path.join(d, name))
        except BaseException:
            os.close(fd)
            raise
        if durable:
            os.close(fd)
            fd = -1
            fsync_path(d)  # the rename itself survives a crash
    except BaseException as err:
        # whatever failed (ENOSPC, EIO, anything), no temp file is left in the state dir
        try:  # noqa: SIM105 (contextlib would cost every hook its import)
            os.unlink(tmp)
        except OSError:
            pass
        if not isinstance(err, OSError):
            raise
        # (the hint only where it is the cause: ENOSPC, EDQUOT, EROFS)
        hint = (
            " (the state dir's filesystem is full or read-only)"
            if err.errno in (28, 122, 30)
            else ""
        )
        raise StateError(
            f"{os.path.join(d, name)}: event not recorded: {err.strerror}{hint}"
        ) from None
    return name, fd


def sync(state_dir: str, name: str, fd: int) -> None:
    """Make the event ``name``, appended by :func:`append_unsynced` (``fd``: its open
    descriptor, closed here whatever happens), survive a crash: fsync its file, then the
    journal directory (its rename); StateError naming what failed.

    (A file applied and settled meanwhile -- removed, its event in the database file -- is
    synced through its descriptor all the same: a few blocks at most, never written again.)
    """
    d = journal_dir(state_dir)
    path = os.path.join(d, name)
    try:
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        path = d
        fsync_path(d)
    except OSError as err:
        raise StateError(f"{path}: event not recorded durably: {err.strerror}") from None


def sweep_tmp(state_dir: str, now_ns: int | None = None, names: list[str] | None = None) -> int:
    """Remove temporary files of hooks killed mid-write; how many.

    Their age is read from their names: :func:`append` names a temp file after the
    ``CLOCK_MONOTONIC`` time it was made, a clock no one sets.  The file's mtime is wall-clock
    time, and a clock stepped forward made a live hook's file look a minute old: another
    process swept it mid-write and the hook blamed a full or read-only disk (issue 26).  A
    stamp ahead of the clock is from an earlier boot (a state dir on a disk).

    ``names``: the journal dir as :func:`listing` just read it (an ingest lists it once for
    this and :func:`pending`); else it is listed here.
    """
    d = journal_dir(state_dir)
    removed = 0
    if names is None:
        try:
            names = os.listdir(d)
        except OSError:
            return 0
    names = [n for n in names if n.startswith(".") and n.endswith(".tmp")]
    # The clock is read after the listing: a file listed was made, and its stamp taken,
    # before it.  Read before, a hook that named its file in between had a stamp "ahead of
    # the clock", taken for an earlier boot's, and its live file was swept from under it
    # ("event not recorded: No such file or directory"; seen with 50 hooks at once, issue 30).
    now_ns = time.monotonic_ns() if now_ns is None else now_ns
    for n in names:
        # None: not a name append() makes, not ours to remove; False: maybe a live hook's
        if not stale_stamp(n[1:].split("-", 1)[0], TMP_MAX_AGE, now_ns):
            continue
        try:
            os.unlink(os.path.join(d, n))
            removed += 1
        except OSError:
            pass  # gone meanwhile
    return removed


def bad_dir(state_dir: str) -> str:
    return os.path.join(journal_dir(state_dir), BAD)


def quarantined(state_dir: str) -> int:
    """How many journal entries were moved aside as unusable (``journal/bad/*.json``)."""
    try:
        return sum(1 for n in os.listdir(bad_dir(state_dir)) if n.endswith(".json"))
    except OSError:
        return 0


def read_event(state_dir: str, name: str) -> HookEvent:
    """The event in the journal file ``name``, checked (:func:`vmpin.wire.hookevent.from_obj`).

    FileNotFoundError when another process applied and removed it; OSError or VmpinError
    (naming the entry) when it cannot be read or is not a valid event."""
    raw = read_bytes(os.path.join(journal_dir(state_dir), name), limit=MAX_EVENT,
                     what="journal entry")  # fmt: skip
    return from_json(raw, f"journal entry {name}")


def backlog(state_dir: str) -> int:
    """How many events are pending (cheap: one listdir, no sort)."""
    try:
        names = os.listdir(journal_dir(state_dir))
    except OSError:
        return 0
    return sum(1 for n in names if n.endswith(".json") and not n.startswith("."))


def listing(state_dir: str) -> list[str]:
    """The journal dir's names, as listed (none when it does not exist yet); a journal dir
    that cannot be listed (EMFILE, ENOMEM, EIO) is a StateError naming it: every ingest
    starts here, and an OSError from it ended the agent's main loop (issue 26)."""
    d = journal_dir(state_dir)
    try:
        return os.listdir(d)
    except FileNotFoundError:
        return []
    except OSError as err:
        raise StateError(f"{d}: cannot list the journal: {err.strerror}") from err


def pending(state_dir: str, names: list[str] | None = None) -> list[str]:
    """The pending events' file names, oldest first, of ``names`` (:func:`listing`'s, when
    the caller has it already) or of the journal dir listed now."""
    if names is None:
        names = listing(state_dir)
    return sorted(n for n in names if n.endswith(".json") and not n.startswith("."))
