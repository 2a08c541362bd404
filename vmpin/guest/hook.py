"""``vmpin guest hook STAGE``: inside a Kata VM, pin a starting container to its mapped vCPUs.

The kata-agent runs it from ``guest_hook_path/{prestart,poststart,poststop}/`` with the
container's OCI state on stdin; it

1. reads the OCI state (inside the guest: the container's id, its init pid there, its
   bundle); Kata's guest container ids are the host ones, which is the map's key;
2. reads the published map (``--map``, else ``$VMPIN_GUEST_MAP``, else
   :data:`~vmpin.wire.guestmap.DEFAULT_GUEST_MAP`) and finds the container;
3. pins it (:mod:`vmpin.guest.pinning`): its cpuset cgroup when it has one of its own, else
   every thread's affinity, read back both ways;
4. records what it pinned (:mod:`vmpin.guest.records`) for ``vmpin guest follow``, which
   re-pins when the host later changes the container's CPUs; ``poststop`` removes the record.

Fail-open, like the host hook: a container never fails to start because of vmpin, so any
problem is one line on stderr and exit 0; ``--strict`` makes it exit 1.  ``poststop`` has
nothing else to undo.  A non-exact entry (a floating plan: its vCPUs are all vCPUs) is
applied as given and mentioned only with ``--verbose``.  The hook's path never loads the
follower (a contract in pyproject.toml): it runs at every container start.
"""

from __future__ import annotations

import contextlib
import sys
from typing import NamedTuple

from vmpin.guest.common import GuestError, format_cpus
from vmpin.guest.inputs import State, find_entry, parse_state
from vmpin.guest.options import STAGES, USAGE, Options, parse_args
from vmpin.guest.pinning import pin
from vmpin.guest.records import (
    Record,
    forget,
    read_record,
    record_path,
    start_time,
    write_record,
)
from vmpin.wire.guestmap import Entry


class Report(NamedTuple):
    """What one invocation did: a line for ``--verbose``, notes that are always shown."""

    line: str
    notes: tuple[str, ...] = ()


def run(opts: Options, data: bytes) -> Report | None:
    """Handle one invocation; None when there was nothing to do (poststop).

    Every pinning stage also records the container for ``vmpin guest follow`` -- after a
    failure too, when the process lives, so that the follower pins it once the map names
    it (the host may publish after the last hook ran).
    """
    if opts.stage == "poststop":
        forget_stopped(opts.state_dir, data)
        return None  # the container's cgroup and threads are gone: nothing else to undo
    state = parse_state(data)
    if not state.pid:
        raise GuestError(f"OCI state of {state.id} has no pid")
    born = start_time(opts.proc, state.pid)
    entry: Entry | None = None
    try:
        entry = find_entry(opts.map_path, state.id, opts.wait)
        result = pin(opts.proc, opts.cgroup_root, state.pid, entry.guest_cpus, opts.widen_parents)
    except GuestError:
        if born is not None:
            record_attempt(opts, state, born, entry)
        raise
    line = (
        f"container {state.id} pinned to vCPUs {format_cpus(entry.guest_cpus)} "
        f"({result.method}: {result.where}, {result.tasks} tasks)"
    )
    if not entry.exact:
        line += f"; map not exact ({entry.mode}: {entry.reason})"
    notes = list(result.notes)
    # Not being able to record is worth a line even without --verbose: the container is
    # pinned now, but an update of its CPUs will not reach it.
    if born is None:
        notes.append(f"not recorded in {opts.state_dir}: no start time for pid {state.pid}")
    else:
        rec = Record(
            state.id,
            state.pid,
            born,
            result.method,
            result.cgroup,
            entry.guest_cpus,
            entry.generation,
            None,
            f"hook {opts.stage}",
        )
        try:
            write_record(opts.state_dir, rec)
        except GuestError as err:
            notes.append(f"not recorded for `vmpin guest follow`: {err}")
    return Report(line, tuple(notes))


def record_attempt(opts: Options, state: State, born: int, entry: Entry | None) -> None:
    """After a failed pin: record the container as not pinned yet, best effort and silently
    (the failure itself is the line on stderr).

    A record of the same process that says something *was* applied (prestart pinned, then
    poststart failed) is kept as it is: it is still true.
    """
    try:
        path = record_path(opts.state_dir, state.id)
        try:
            old = read_record(path)
        except GuestError:
            old = None
        if old is not None and (old.pid, old.start_time) == (state.pid, born) and old.method:
            return
        failed = (entry.generation, entry.guest_cpus) if entry is not None else None
        rec = Record(
            state.id, state.pid, born, None, None, None, None, failed, f"hook {opts.stage}"
        )
        write_record(opts.state_dir, rec)
    except GuestError:
        return


def forget_stopped(state_dir: str, data: bytes) -> None:
    """poststop: remove the container's record, and never fail or say anything.

    The OCI state at poststop may lack a pid, or be missing altogether; and a record the
    hook cannot remove here is forgotten by the follower once its process is gone.
    """
    with contextlib.suppress(GuestError, OSError):
        forget(record_path(state_dir, parse_state(data).id))


def main(args: list[str]) -> int:
    """The hook's entry point (``vmpin guest hook ARGS``); returns the exit status."""
    if "-h" in args or "--help" in args:
        print(USAGE)
        return 0
    strict = "--strict" in args
    stage = next((a for a in args if a in STAGES), "?")
    try:
        opts = parse_args(args)
        if sys.stdin is None or sys.stdin.isatty():
            raise GuestError("no OCI state on stdin")
        report = run(opts, sys.stdin.buffer.read())
        if report is not None and (opts.verbose or report.notes):
            # Notes (a widened parent, a cgroup left unwritten) are shown without --verbose
            # too: they are changes or failures someone should see.
            print(
                f"vmpin guest hook {stage}: " + "; ".join([report.line, *report.notes]),
                file=sys.stderr,
            )
        return 0
    except GuestError as err:
        print(f"vmpin guest hook {stage}: {err}", file=sys.stderr)
    except Exception as err:  # fail-open means *any* failure, not only the foreseen ones
        print(f"vmpin guest hook {stage}: unexpected {type(err).__name__}: {err}", file=sys.stderr)
    return 1 if strict else 0
