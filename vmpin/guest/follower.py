"""``vmpin guest follow``: re-pin recorded containers when the host republishes their vCPUs.

The hook pins a container once, when it starts; the host may change the container's CPUs
later (CRI UpdateContainerResources -> ``vmpin update``) and republish the map.  The
follower (a small loop, or ``--once``) re-applies an entry whose generation or vCPUs differ
from what the hook's record says was applied, through the same code as the hook
(:func:`vmpin.guest.pinning.pin_with`), to the same cgroup or the same process tree.  It
follows the map, not the kernel: drift made inside the guest is not its business.

A guest is small and the loop runs for the VM's life, so an idle look costs two ``stat``
calls; a failure is said once, not on every pass while it lasts; and nothing that goes
wrong in a pass stops the loop.  See ``docs/guest.md``.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from types import FrameType
from typing import Callable, NamedTuple

from vmpin.guest.common import GuestError, format_cpus
from vmpin.guest.inputs import lookup, read_map
from vmpin.guest.options import FOLLOW_USAGE, FollowOptions, parse_follow_args
from vmpin.guest.pinning import pin, pin_with
from vmpin.guest.records import (
    Record,
    forget,
    list_records,
    read_record,
    record_doc,
    remove_stale_temps,
    start_time,
    write_record,
)
from vmpin.wire.guestmap import GuestMap

#: a full pass at least this often (besides one whenever the map or a record changed,
#: looked at every ``--interval`` seconds) even when nothing changed:
#: it retries what failed, forgets records of containers whose poststop never ran, and
#: catches a record written within one timestamp tick of the previous look.
FULL_PASS_EVERY = 60.0


class PassResult(NamedTuple):
    """What one pass did: ``done`` for --verbose, ``notes`` always shown, ``failures``."""

    done: list[str]
    notes: list[str]
    failures: list[str]


def _save_if_changed(state_dir: str, path: str, old: Record, new: Record) -> None:
    """Write ``new`` unless it says what ``old`` says, or the record was removed meanwhile
    (poststop ran while we pinned: writing would bring back a stopped container's record)."""
    if record_doc(new) == record_doc(old) or not os.path.exists(path):
        return
    write_record(state_dir, new)


def follow_pass(opts: FollowOptions, full: bool = True) -> PassResult:
    """One pass over every record: forget the dead, re-pin what the map changed.

    ``full`` (``--once``, and every :data:`FULL_PASS_EVERY` seconds in the loop) also retries
    an entry whose pin failed before and cleans up temporaries; a loop pass leaves a known
    failure alone until the host publishes something else for that container.  The map is
    read only when some record is left to compare it with.
    """
    res = PassResult([], [], [])
    if full:
        remove_stale_temps(opts.state_dir, FULL_PASS_EVERY)
    paths = list_records(opts.state_dir)
    if not paths:
        return res
    guest_map: GuestMap | None = None
    map_err: GuestError | None = None
    try:
        guest_map = read_map(opts.map_path)
    except GuestError as err:
        map_err = err
    live = 0
    for path in paths:
        try:
            rec = read_record(path)
        except GuestError as err:
            forget(path)
            res.failures.append(f"{err}; forgotten")
            continue
        if start_time(opts.proc, rec.pid) != rec.start_time:
            # Exited, or its pid now belongs to another process: either way not ours.
            if forget(path):
                res.done.append(f"container {rec.container}: process {rec.pid} is gone; forgotten")
            continue
        live += 1
        if guest_map is None:
            continue
        try:
            entry = lookup(guest_map, rec.container)
        except GuestError as err:
            res.failures.append(str(err))
            continue
        if entry is None or rec.applied(entry):
            continue  # not mapped (any more): leave it as it is, like the hook
        if not full and rec.failed == (entry.generation, entry.guest_cpus):
            continue
        try:
            if rec.method is None:  # never applied: find its cgroup as the hook would
                result = pin(
                    opts.proc, opts.cgroup_root, rec.pid, entry.guest_cpus, opts.widen_parents
                )
            else:  # where the hook pinned it: that cgroup, else that process tree
                result = pin_with(
                    opts.proc, rec.pid, entry.guest_cpus, rec.cgroup, opts.widen_parents
                )
        except GuestError as err:
            res.failures.append(
                f"container {rec.container}: vCPUs {format_cpus(entry.guest_cpus)} "
                f"(generation {entry.generation}): {err}"
            )
            failed = rec._replace(failed=(entry.generation, entry.guest_cpus), by="follow")
            try:
                _save_if_changed(opts.state_dir, path, rec, failed)
            except GuestError as err2:
                res.failures.append(str(err2))
            continue
        res.done.append(
            f"container {rec.container} re-pinned to vCPUs {format_cpus(entry.guest_cpus)} "
            f"(generation {entry.generation}; {result.method}: {result.where}, "
            f"{result.tasks} tasks)"
        )
        res.notes.extend(f"container {rec.container}: {n}" for n in result.notes)
        new = rec._replace(
            method=result.method,
            cgroup=result.cgroup,
            guest_cpus=entry.guest_cpus,
            generation=entry.generation,
            failed=None,
            by="follow",
        )
        try:
            _save_if_changed(opts.state_dir, path, rec, new)
        except GuestError as err:
            res.failures.append(f"re-pinned, but {err}")
    if map_err is not None and live:
        res.failures.insert(0, str(map_err))
    return res


def _stat_key(path: str) -> tuple[int, int, int] | None:
    """(inode, mtime_ns, size), None when missing: changes whenever the file does.

    The host replaces the map by rename, so the inode changes even when a rewrite lands
    within one timestamp tick and keeps the size; for the state dir, a record written,
    replaced or removed changes the directory's mtime.
    """
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


class _Stop(BaseException):
    """Raised by the SIGTERM handler, only while the loop sleeps (never inside a pass)."""


def follow(opts: FollowOptions, say: Callable[[str], None]) -> int:
    """Run passes until SIGTERM/SIGINT (or one, with --once); the exit status.

    The loop is cheap when nothing changed: it stats the map and the state dir and compares
    them with the last pass before reading anything.  A failure line is printed when it
    first appears, not again on every pass while it lasts.
    """
    if opts.once:
        res = _guarded_pass(opts, True)
        _report(opts, res, say, set())
        return 1 if opts.strict and res.failures else 0

    state = {"stopping": False, "sleeping": False}

    def on_signal(signum: int, frame: FrameType | None) -> None:
        state["stopping"] = True
        if state["sleeping"]:
            raise _Stop

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    last_key: object = None
    last_full = float("-inf")
    said: set[str] = set()
    try:
        while not state["stopping"]:
            now = time.monotonic()
            full = now - last_full >= FULL_PASS_EVERY
            # Taken *before* the pass: a record the hook writes during it changes the key,
            # so the next look passes again (our own writes cost one extra, idle pass).
            key = (_stat_key(opts.map_path), _stat_key(opts.state_dir))
            if full or key != last_key:
                res = _guarded_pass(opts, full)
                said = _report(opts, res, say, said)
                last_key = key
                if full:
                    last_full = now
            state["sleeping"] = True
            if state["stopping"]:
                break
            time.sleep(opts.interval)
            state["sleeping"] = False
    except _Stop:
        pass
    return 0


def _guarded_pass(opts: FollowOptions, full: bool) -> PassResult:
    """A pass that turns any error into a failure line: the loop must outlive a bad pass."""
    try:
        return follow_pass(opts, full)
    except GuestError as err:
        return PassResult([], [], [str(err)])
    except Exception as err:  # a bug or an unforeseen OS error: report it, keep following
        return PassResult([], [], [f"unexpected {type(err).__name__}: {err}"])


def _report(
    opts: FollowOptions, res: PassResult, say: Callable[[str], None], said: set[str]
) -> set[str]:
    """Print a pass's lines; the failures printed (or still standing), for the next pass."""
    for line in res.done if opts.verbose else []:
        say(line)
    for line in res.notes:
        say(line)
    for line in res.failures:
        if line not in said:
            say(line)
    return set(res.failures)


def follow_main(args: list[str]) -> int:
    """``vmpin guest follow ARGS``; the exit status (2: bad usage)."""
    if "-h" in args or "--help" in args:
        print(FOLLOW_USAGE)
        return 0

    def say(line: str) -> None:
        print(f"vmpin guest follow: {line}", file=sys.stderr, flush=True)

    try:
        opts = parse_follow_args(args)
    except GuestError as err:
        say(str(err))
        return 2
    return follow(opts, say)
