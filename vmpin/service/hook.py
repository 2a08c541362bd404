"""``vmpin hook STAGE``: the OCI hook, on the hot path of every container start.

What it does: parse the state on stdin and the bundle's config.json, read what only this
moment knows (the pid's start time, which runtime runs the sandbox: vmpin.runtimes.oci), and
journal that as one event (vmpin.wire.hookevent, vmpin.state.journal) -- the store applies it
exactly once.  Then bring the sandbox into line:

- a Kata sandbox (its QEMU floats until pinned): apply the journal now, and hand the sandbox
  to the running agent, or reconcile it here when no agent answers in time;
- a plain container on a node without VMs: runc has just written the spec's cpuset into its
  cgroup, which is already vmpin's plan for it, so only the agent (when up) is told; the
  event is applied by whichever vmpin process opens the store next.  This keeps sqlite3 (and
  the 28 ms that re + json + sqlite3 cost to import) off the start of every plain container.
- a plain container while VM sandboxes run (the VM dir is not empty): its CPUs can change
  their plans (a vCPU pinned 1:1 on a CPU this container now uses; issue 9: the invariant
  holds when the hook returns, agent or not).  The last pass's node summary
  (vmpin.state.summary) says whether they can: when not (a container on the shared pool, on
  CPUs others use already), the event is only journaled, as without VMs, so the hook's cost
  does not grow with the node (issue 26: 1.9 s at 10,000 containers); else the node is
  re-planned as for Kata.
- a plain container whose pod asks vmpin for exclusive CPUs, or any container while vmpin
  holds allocations (vmpin.state.allocating.MARKER): re-planned as for Kata, so its pod is
  allocated, or the shared pool shrinks or grows, before the hook returns (issue 30).

Never stalled by another process (issue 26): every wait on one -- the agent's answer, the
node's plan lock, SQLite's write lock -- ends by the hook's budget (vmpin.service.budget: 2 s
in all, the agent's answer 1 s of it), and past it the hook does without.  An agent stopped
inside a transaction holds the store's write lock: the hook then pins from the store as
last committed plus the journal's pending events, in a copy in memory, and leaves its event
in the journal for the next writer (:func:`reconcile_here`).

Fail-open: a container must never fail to start because of vmpin, so any problem prints one
line to stderr and exits 0; ``--strict`` makes it exit 1 (the runtime then fails the start).
What is refused: input that could not be stored (vmpin.runtimes.oci.hook_event: pids beyond
PID_MAX, text that is not UTF-8, oversized documents, symlinked/FIFO/device config.json) and
an event that could not be written completely (full or read-only state dir): then nothing
is journaled, and the line says so.

Kata's quirks (FACTS.md), and how each is handled:

- ``ociVersion``/``status`` may be empty: not required.
- For poststart and poststop the state's ``id`` is the *sandbox* id: the container is found
  by its bundle (recorded at create), never by that id; when it was not recorded, its id is
  taken from the bundle path (containerd and CRI-O name the bundle dir after the container).
- The state's pid is the VMM's (or the shim's thread id) for Kata, the container's init for
  runc: it is stored as the container's pid only for plain containers, and for Kata only
  used as a hint when looking for the VMM.

Lean by rule (see the import-linter contract in pyproject.toml and
tests/service/test_hook_imports.py, which checks every path in a fresh interpreter): the
project's small modules and vmpin.wire.jsonio; no json or re (bin/vmpin is not pip's wrapper,
which imports re), no typer, pydantic, psutil, kubernetes, dataclasses or typing; sqlite3 only
when this process must reconcile (Kata or VMs running, and no agent answered).
"""

from __future__ import annotations

import os
import sys
import time

from vmpin.core.errors import SpecError, VmpinError
from vmpin.linux.files import listing
from vmpin.linux.paths import ENVVARS as PATH_OPTIONS
from vmpin.linux.paths import HostPaths
from vmpin.runtimes.oci import hook_event
from vmpin.state.allocating import asks_exclusive
from vmpin.state.allocating import present as allocations_present
from vmpin.state.journal import INGEST_BUDGET, INGEST_THRESHOLD, append, append_unsynced, backlog
from vmpin.state.journal import sync as journal_sync
from vmpin.wire.hookevent import STAGES

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.lean.records)
if TYPE_CHECKING:
    from vmpin.service.settings import Settings
    from vmpin.state.store import Store
    from vmpin.wire.hookevent import HookEvent

USAGE = "usage: vmpin hook [--strict] STAGE   (STAGE: " + ", ".join(STAGES) + "; state on stdin)"


def main(opts: dict[str, str], args: list[str]) -> int:
    # A hook is a short-lived process: what it allocates (modules, classes, one pass's
    # records) is freed by reference counting or at exit, and the cyclic collector's runs
    # while it imports and plans found nothing (~0.5-1 ms of a Kata hook that pins
    # in-process).  Back on after, for a caller that goes on (tests).
    import gc

    collecting = gc.isenabled()
    gc.disable()
    try:
        return _main(opts, args)
    finally:
        if collecting:
            gc.enable()


def _main(opts: dict[str, str], args: list[str]) -> int:
    strict = "--strict" in args
    rest = [a for a in args if a != "--strict"]
    stage = rest[0] if rest else ""
    try:
        if len(rest) != 1 or stage not in STAGES:
            raise SpecError(f"bad stage {stage!r}: {USAGE}")
        settings, paths = _settings(opts)
        if sys.stdin is None or sys.stdin.isatty():
            raise SpecError("no OCI state on stdin")
        data = sys.stdin.buffer.read()
        run(paths, stage, data, settings)
        return 0
    except VmpinError as err:
        print(f"vmpin hook {stage or '?'}: {err}", file=sys.stderr)
    except Exception as err:  # fail-open means *any* failure, not only the foreseen ones
        print(f"vmpin hook {stage or '?'}: unexpected {type(err).__name__}: {err}", file=sys.stderr)
    return 1 if strict else 0


__all__ = ["main", "reconcile_here", "run"]


def _settings(opts: dict[str, str]) -> tuple[Settings | None, HostPaths]:
    """The hook's Settings when its options hold more than host roots (a policy given to
    ``vmpin hook`` behind a global option: vmpin.service.commands_agent), else None, and its
    paths.  A runtime's hook is given host roots at most: only a pass in this process needs
    the rest of the Settings (:func:`reconcile_here` reads them then), and their module was
    0.8 M of the runc hook's 46.4 M instructions (a bare interpreter 39.0 M), for the paths."""
    if all(key in PATH_OPTIONS for key in opts):
        return None, HostPaths.from_env(opts, os.environ)
    from vmpin.service.settings import Settings

    settings = Settings.from_env(opts)
    return settings, settings.paths


def run(paths: HostPaths, stage: str, data: bytes, settings: Settings | None = None) -> str | None:
    """Handle one hook invocation; returns the sandbox id it touched (None when nothing).

    The event is journaled (see vmpin.state.journal).  A Kata sandbox (or a plain container
    while VMs run) is then brought into line before the hook returns: by the agent when one
    answers the blocking notify (its pass applies the journal and plans the node; the hook
    never opens the store), else right here.  A plain container's event on a node without VMs
    waits for the agent or the next vmpin command.  No wait on another process goes past
    the budget's seconds from here (vmpin.service.budget, imported by the paths that wait:
    a plain container's journaling waits on no one).
    """
    started = time.monotonic()
    event = hook_event(paths, stage, data)
    ident = event.ident
    sandbox = ident.sandbox_id if ident else None
    name: str | None = None
    replan = (
        event.runtime == "kata"
        or (sandbox is None and stage == "poststop")
        # vmpin allocates exclusive CPUs here (issue 30): the pool moves with every pod
        or allocations_present(paths.state_dir)
        or asks_exclusive(event.annotations)
    )
    if not replan:
        vms = listing(paths.vm_dir)
        if vms:
            # VMs run: their plans may depend on this container -- unless the node summary
            # of the last pass says they cannot (vmpin.state.summary); then the event is
            # journaled as on a node without VMs, at a cost that does not grow with the node.
            replan, name = _beside_vms(paths, event, vms)
    if replan:
        from vmpin.service.budget import AGENT_WAIT, BUDGET
        from vmpin.service.control import notify

        deadline = started + BUDGET
        # The event's file is whole before the agent hears of it; it and the journal's
        # directory are synced while the agent's pass runs (a disk's two syncs, ~0.5 ms,
        # off the start's path) and always before this hook says the event is recorded,
        # i.e. returns (issue 14).  (Journaled already, and synced: by _beside_vms.)
        synced = [True] if name is not None else []
        journaled = ("", -1) if name is not None else append_unsynced(paths.state_dir, event)

        def sync() -> None:
            if not synced:
                synced.append(True)  # (the descriptor is closed by the first try)
                journal_sync(paths.state_dir, *journaled)

        # The invariant is to hold when the hook returns: the agent replies "done" only after
        # a node pass that started after this request (so it ingested our event) has ended.
        # (An agent that took the request ran the syncs; a "done" implies it took it.)
        try:
            # (the agent's answer first: the deadline is the whole budget away still)
            done = notify(paths, [sandbox] if sandbox else [], wait=AGENT_WAIT, meanwhile=sync)
            if not done:
                if settings is None:
                    from vmpin.service.settings import Settings

                    settings = Settings.from_env()  # (the paths: this call's, see _pass)
                reconcile_here(settings, paths, sandbox, deadline)
        finally:
            # No agent took the request: synced here, after this process's own pass (a
            # failure is then the hook's one line, and the pins stand).  A thread that synced
            # beside the pass was measured too (issue 14): on this machine no faster on ext4,
            # and ~0.02x slower on tmpfs (its GIL hand-offs), so there is none.
            sync()
        return sandbox
    # (else journaled by _beside_vms, durably)
    journaled = append_unsynced(paths.state_dir, event) if name is None else ("", -1)
    try:
        # Renamed into place first, then synced (the Kata path's order, issue 14): the
        # file's sync commits the rename with it, and the directory's then finds little left
        # to write (ext4; the directory's sync: 3.6 -> 1.5 ms at load 30 in a loop of
        # appends, 0.3 -> 0.1-0.35 ms in this hook at load 2).  A sync that fails is the
        # hook's one line ("not recorded durably"), the event left in the journal, as there.
        if sandbox is not None and os.path.exists(paths.control_socket):
            from vmpin.service.control import notify

            # without waiting for the answer.  No socket file, no agent: control's module is
            # not even imported (0.3 M of the runc hook's instructions); the file just seen
            # is not looked for again (seen=True)
            notify(paths, [sandbox], answered=False, seen=True)
    finally:
        if name is None:
            journal_sync(paths.state_dir, *journaled)  # before the hook says it is recorded
    if backlog(paths.state_dir) > INGEST_THRESHOLD:
        # No one has applied the journal for a while (no agent, no CLI): keep it bounded
        # here, in batches within a time budget, so no later hook inherits a huge backlog.
        from vmpin.core.errors import StateError
        from vmpin.service.budget import BUDGET
        from vmpin.state.store import Store

        deadline = started + BUDGET
        try:  # noqa: SIM105 (contextlib stays off the hook's path)
            Store(paths.state_dir, ingest=False, deadline=deadline).ingest(budget=INGEST_BUDGET)
        except StateError:
            pass  # the write lock is another's past the budget: it applies the journal next
    return sandbox


def _beside_vms(paths: HostPaths, event: HookEvent, vms: list[str]) -> tuple[bool, str | None]:
    """A plain container's event while VMs run: (whether the node must be re-planned, the
    journal name when the event was journaled here).

    The node summary (vmpin.state.summary) is judged first; an event it lets through is
    journaled, durably, and then the summary must still be the one it was judged by: a pass
    that replaced it meanwhile either saw the event (it looks for such events after writing
    its summary) or wrote the summary this loop judges next.
    """
    from vmpin.linux.sysfs import online_text
    from vmpin.state import summary

    checkpoint = summary.checkpoint_id(paths.kubelet_state)
    online = online_text(paths.sys)
    name = None
    for _ in range(3):
        got = summary.read(paths.state_dir)
        if got is None:
            return True, name
        ident, s = got
        if summary.stale(s, vms, checkpoint, online) or summary.event_needs_pass(s, event):
            return True, name
        if name is None:
            name = append(paths.state_dir, event)
        if summary.current(paths.state_dir, ident):
            return False, name
    return True, name


def reconcile_here(
    settings: Settings, paths: HostPaths, sandbox: str | None, deadline: float | None = None
) -> None:
    """No agent answered: apply the journal and re-plan the node in this process, waiting
    for no lock past ``deadline`` (``time.monotonic()``; None: the store's defaults)."""
    from vmpin.core.errors import StateError
    from vmpin.state.sqlite import sqlite3
    from vmpin.state.store import Store

    mine = [sandbox] if sandbox else []
    try:
        # Not closed on purpose: the last connection to close checkpoints the WAL into the
        # database, a synchronous write on a container start.  The console script leaves
        # with os._exit(); what was committed is in the WAL for the next connection.
        store = Store(paths.state_dir, ingest=False, deadline=deadline)
        # Nothing here waits for the disk (Store.defer_durability): what this pass writes is
        # the journal's events, whose files stay until the next agent or command settles
        # them (Store.ingest), and bookkeeping the next pass redoes from the host.  The
        # event's own file is synced after this pass, before the hook returns (run()).
        store.defer_durability()
        store.keep_wal_short()  # the next start without an agent reads all of it again
        # Another process may have applied our event already: then re-pin our sandbox anyway.
        touched = store.ingest(budget=INGEST_BUDGET, durable=False) or mine
        _pass(settings, paths, store, touched, deadline)
    except (StateError, sqlite3.OperationalError):
        # The store's write lock is another process's past the budget: an agent stopped
        # inside a transaction (SIGSTOP, a stuck disk), which may never let go.  Pin from
        # what can be read without it -- the store as last committed, the journal's pending
        # events (ours among them) applied to a copy in memory -- and leave the events in
        # the journal for whoever writes next.  What this pass would record (thread roles,
        # done_gen, original affinities) is redone by the next pass from the host.
        if deadline is None:
            raise
        left = max(0.0, deadline - time.monotonic())
        copy = Store.open_readonly(paths.state_dir, timeout=max(left, 0.05), copy=True)
        _pass(settings, paths, copy, mine, deadline)


def _pass(
    settings: Settings,
    paths: HostPaths,
    store: Store,
    touched: list[str],
    deadline: float | None,
) -> None:
    from vmpin.service.settings import build_reconciler

    # a sandbox forgotten (poststop) is re-planned too: its pins are to be undone
    # (the journal just applied; the node's plan lock waited for until the deadline, at most)
    rec = build_reconciler(
        settings._replace(paths=paths), store, qmp_timeout=0.1, ingest_first=False,
        deadline=deadline,
    )  # fmt: skip
    for report in rec.reconcile(touched):
        for err in report.errors:
            print(f"vmpin: sandbox {report.id}: {err}", file=sys.stderr)
