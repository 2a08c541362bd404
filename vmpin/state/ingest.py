"""Applying the hooks' journal to the store, and when its effect is durable.

A hook journals its event (vmpin.state.journal) rather than writing the store: whoever opens
the store next applies the pending events once each, in order, and removes a journal file
only once its event is in the database file.  Each function takes the store it works on
(:class:`vmpin.state.store.Store`, whose methods of the same names call them).
"""

from __future__ import annotations

import os
import sys
import time

from vmpin.core.errors import SpecError, StateError, UnsafeFile
from vmpin.linux.files import fsync_path
from vmpin.runtimes.oci import identify
from vmpin.state import allocations, journal
from vmpin.state.records import (
    CONTAINER_COLS,
    POLICY_META,
    ContainerRec,
    SandboxRec,
    container_row,
    policy_json,
    policy_record,
)
from vmpin.state.schema import state_error

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.lean.records)
if TYPE_CHECKING:
    import sqlite3
    from collections.abc import Mapping

    from vmpin.state.store import Store
    from vmpin.wire.hookevent import HookEvent
else:
    from vmpin.state.sqlite import sqlite3

#: journal events applied per transaction (one fsync each): 10,000 pending events cost
#: 20 commits, and a hook's time budget is checked between them.
INGEST_BATCH = 500
#: applied journal files a non-durable ingest leaves before it settles them itself
SETTLE_AFTER = 64
#: WAL pages past which a hook's connection checkpoints (:func:`keep_wal_short`)
SHORT_WAL = 64


def ingest(
    store: Store,
    *,
    budget: float | None = None,
    batch: int = INGEST_BATCH,
    consume: bool = True,
    durable: bool = True,
) -> list[str]:
    """Apply pending events once each, in order, in transactions of ``batch`` events; the
    sandboxes they touched.

    ``budget`` (seconds) stops between batches once spent (a hook's share of its
    runtime's timeout); what is left waits for the next ingest.  An entry that cannot be
    read or applied is quarantined (:func:`_quarantine`), never raised: one bad file must
    not stop every later store open.  A journal file is unlinked only once its effect is
    durable: committed with ``synchronous=FULL`` *and* checkpointed from the WAL into the
    database file (so even a lost or truncated WAL cannot lose an event whose file is
    gone; until then a file stays, recorded as applied, and is removed by the next ingest).

    ``consume=False`` (an in-memory copy for a read-only command) moves and removes no
    journal file: they stay for the next writer.

    ``durable=False`` does not wait for the disk: the events are committed without a sync
    and their files stay (recorded as applied) until :func:`settle_journal`, which the
    agent runs after answering the hook that waits for its pass, and which this does
    itself past :data:`SETTLE_AFTER` such files.  Nothing can be lost that way: a file goes
    only once a checkpoint has its event in the database file, and an event whose commit
    did not reach the disk is applied again from its file.
    """
    # (the journal dir listed once: for the temporary files and the events)
    listed = journal.listing(store.state_dir)
    if not listed:
        return []  # (most passes: nothing to sweep, nothing pending)
    if consume:
        journal.sweep_tmp(store.state_dir, names=listed)
    names = journal.pending(store.state_dir, listed)
    if not names:
        return []
    deadline = None if budget is None else time.monotonic() + budget
    touched: list[str] = []
    relaxed = not durable and not store.db.in_transaction and not store.deferred
    try:
        if relaxed:
            store.db.execute("PRAGMA synchronous=NORMAL")  # (WAL: no sync at commit)
        try:
            for start in range(0, len(names), max(1, batch)):
                chunk = names[start : start + batch]
                _ingest_batch(store, chunk, touched, consume, settle=durable)
                if deadline is not None and time.monotonic() >= deadline:
                    break
        finally:
            if relaxed:
                store.db.execute("PRAGMA synchronous=FULL")
    except sqlite3.Error as err:
        raise state_error(store.path, err) from None
    if consume and not durable and len(names) > SETTLE_AFTER:
        settle_journal(store)
    return touched


def _ingest_batch(
    store: Store, names: list[str], touched: list[str], consume: bool, settle: bool = True
) -> None:
    bad: list[tuple[str, str]] = []
    with store.transaction() as db:
        done = _applied(db, names)
        for name in names:
            if name in done:
                continue
            try:
                ev = journal.read_event(store.state_dir, name)
            except FileNotFoundError:
                continue  # another process applied and removed it
            except (OSError, UnsafeFile) as err:
                bad.append((name, f"unreadable: {getattr(err, 'strerror', None) or err}"))
                db.execute("INSERT OR IGNORE INTO journal VALUES (?)", (name,))
                continue
            except Exception as err:  # whatever it is, it is this entry's
                bad.append((name, f"{type(err).__name__}: {err}"))
                db.execute("INSERT OR IGNORE INTO journal VALUES (?)", (name,))
                continue
            # A savepoint per event: a failure half-way through one event undoes exactly
            # that event, and the batch goes on.
            db.execute("SAVEPOINT ev")
            try:
                sid = _apply(store, ev)
            except sqlite3.OperationalError:
                raise  # the database itself (locked, full, read-only): not this entry's fault
            except Exception as err:  # whatever it is, it is this entry's
                db.execute("ROLLBACK TO ev")
                bad.append((name, f"{type(err).__name__}: {err}"))
                sid = None
            db.execute("RELEASE ev")
            if sid and sid not in touched:
                touched.append(sid)
            db.execute("INSERT OR IGNORE INTO journal VALUES (?)", (name,))
        # names sort by time: a recorded name older than every file still pending was
        # unlinked, and no process can come across it again
        pending = journal.pending(store.state_dir)
        if pending:
            db.execute("DELETE FROM journal WHERE name < ?", (pending[0],))
    if not consume:
        return
    for name, reason in bad:
        _quarantine(store.state_dir, name, reason)
    if not settle or not _checkpointed(store.db):
        return  # files stay until a checkpoint has them in the database file
    quarantined = {n for n, _ in bad}
    _remove_files(store.state_dir, [n for n in names if n not in quarantined])


# -- one event -----------------------------------------------------------------------------
def _resolve(
    store: Store, ev: HookEvent
) -> tuple[ContainerRec | None, dict[str, ContainerRec | None]]:
    """The recorded container an event is about, keyed by container id, never by bundle
    alone: two containers may share a bundle path, and Kata's poststart/poststop carry the
    *sandbox* id (the container's id then comes from the bundle: recorded at create, or
    the bundle dir's name as containerd and CRI-O make it); and what was read by id (id ->
    its record or None), so that a write of one of them need not read it again (issue 28).

    By bundle only when exactly one record has that bundle and that record *is* the
    event's container (same id) or belongs to the sandbox the event names (Kata); a bundle
    shared by containers of different ids is ambiguous and resolves to nothing rather than
    clobbering one of them.  (Two statements, by id and by bundle, where a new container
    is looked up: one statement with both, an OR of two indexes, cost SQLite more than
    the two, issue 28.)"""
    ident = ev.ident
    bundle = ev.bundle
    # A record found by id is this container only if its bundle agrees: a container's
    # bundle never changes, so another bundle means another container (Kata's sandbox id
    # with a container's bundle) or a new one reusing the id.
    by_ident = ident.container_id if ident else None
    looked: dict[str, ContainerRec | None] = {}
    # (a create's state id is its container id: looked up once)
    for cid in (by_ident, ev.id if ev.id != by_ident else None):
        if not cid:
            continue
        rec = looked[cid] = store.container(cid)
        if rec is not None and (not bundle or rec.bundle in (None, bundle)):
            return rec, looked
    if not bundle:
        return None, looked
    cols = ",".join(CONTAINER_COLS)
    rows = store.db.execute(
        f"SELECT {cols} FROM containers WHERE bundle=? AND (id=? OR sandbox_id=?)",
        (bundle, ev.id, ev.id),
    ).fetchall()
    exact = [r for r in rows if r[0] == ev.id]
    if len(exact) == 1:
        return container_row(exact[0]), looked
    if len(rows) == 1:
        return container_row(rows[0]), looked
    return None, looked


def _apply(store: Store, ev: HookEvent) -> str | None:
    """Apply one event; the sandbox it touched (None when nothing is left to re-pin)."""
    if ev.stage == "poststop":
        return _forget(store, ev)
    bundle = ev.bundle
    existing, looked = _resolve(store, ev)
    if existing is not None:
        sandbox = store.sandbox(existing.sandbox_id)
        if (
            ev.host_pid
            and ev.pid_start is not None
            and existing.pid is None
            and sandbox
            and sandbox.runtime == "runc"
        ):
            # (pid, start time) read by the hook at this very stage: the identity to follow
            store.put_container(
                existing._replace(pid=ev.host_pid, pid_start=ev.pid_start), existing
            )
        return existing.sandbox_id
    ident = ev.ident
    if ident is None or not ev.has_config:
        raise SpecError(f"hook {ev.stage} for {ev.id!r}: container unknown and no spec")
    sandbox = store.sandbox(ident.sandbox_id)
    runtime = sandbox.runtime if sandbox else ev.runtime
    assert runtime is not None  # (vmpin.wire.hookevent: an event naming one names its runtime)
    if sandbox is None:
        # For Kata the state pid may be the VMM: kept as an unverified hint (no start time).
        hint = ev.host_pid if runtime == "kata" else None
        store.put_sandbox(
            SandboxRec(
                ident.sandbox_id,
                runtime,
                hint,
                None,
                ident.pod_uid,
                ident.pod_name,
                ident.pod_namespace,
            )
        )
    _keep_policy_annotations(store, ident.sandbox_id, ev.annotations)
    # A pid is kept only with the start time the hook read with it: without one nothing
    # can prove later that the pid still names this container's process.
    pid = ev.host_pid if runtime == "runc" and ev.pid_start is not None else None
    store.put_container(
        ContainerRec(
            id=ident.container_id,
            sandbox_id=ident.sandbox_id,
            is_sandbox=ident.is_sandbox,
            name=ident.name,
            pod_uid=ident.pod_uid,
            pod_name=ident.pod_name,
            pod_namespace=ident.pod_namespace,
            cpus=ev.cpus,
            cpus_source="spec",
            mems=ev.mems,
            bundle=bundle,
            pid=pid,
            pid_start=ev.pid_start if pid else None,
        ),
        # (the row of that id as _resolve read it: ident's id is looked up first)
        looked.get(ident.container_id, False),
    )
    allocations.record_limit(store.db, ident.container_id, ev.cpu_limit)
    return ident.sandbox_id


def _keep_policy_annotations(store: Store, sandbox_id: str, annotations: Mapping[str, str]) -> None:
    """Record a sandbox's per-pod policy annotations as its containers' specs carry them.

    containerd's ``pod_annotations`` (hooks/containerd/) and CRI-O, by itself, pass the
    pod's annotations into the OCI spec; vmpin.core.podpolicy reads them.  Later
    containers' annotations add to the sandbox's, they never remove: a pod's annotations
    are the same in every one of its containers' specs.
    """
    from vmpin.core.podpolicy import is_policy_key

    ours = {k: v for k, v in annotations.items() if is_policy_key(k)}
    if not ours:
        return
    key = POLICY_META + sandbox_id
    old = store.meta(key)
    before = policy_record(old, "oci").annotations if old else {}
    merged = {**before, **ours}
    if merged != before or old is None:
        store.set_meta(key, policy_json(merged, time.time()))


def _forget(store: Store, ev: HookEvent) -> str | None:
    """poststop: forget the container the event is about (see :func:`_resolve`)."""
    rec = _resolve(store, ev)[0]
    # A Kata poststop of a non-sandbox container carries the sandbox id: when its
    # annotations say it is not the sandbox, it must not tear the whole sandbox down.
    if (
        rec is not None
        and rec.id == ev.id
        and rec.is_sandbox
        and ev.annotations
        and not identify(ev.id, ev.annotations).is_sandbox
    ):
        rec = None
    if rec is None:
        return None
    store.delete_container(rec.id, rec)
    return None if rec.is_sandbox else rec.sandbox_id


# -- durability ----------------------------------------------------------------------------
def settle_journal(store: Store) -> int:
    """Remove the journal files whose events are applied, once a checkpoint has them in
    the database file (see :func:`ingest`); how many were removed.  On a connection that
    defers durability, any write of its own since the last is made durable too (by that
    checkpoint, or by a sync when no journal file waits)."""
    names = journal.pending(store.state_dir)
    # (a deferred connection's own writes since the last settle want to be durable too)
    wrote = store.deferred and store.db.total_changes != store.settled_at
    if not names and not wrote:
        return 0
    if not names:
        # Its own writes alone: a sync of the WAL makes them durable, as a checkpoint would.
        # A checkpoint would move every frame into the database file, and the next writer
        # -- the next `vmpin update`, before it asks the agent -- then starts the WAL over
        # and syncs its new header and the directory: two syncs on the command's path, ~6
        # ms of its ~60 on this disk (issue 28).  SQLite's own checkpoint keeps the WAL short.
        sync(store)
        store.settled_at = store.db.total_changes
        return 0
    try:
        applied = _applied(store.db, names) if names else set()
        if not (applied or wrote) or not _checkpointed(store.db):
            return 0
    except sqlite3.Error as err:
        raise state_error(store.path, err) from None
    store.settled_at = store.db.total_changes
    return _remove_files(store.state_dir, [n for n in names if n in applied])


def unapplied(store: Store, names: list[str]) -> list[str]:
    """Those of ``names`` (journal file names, sorted) no ingest has applied yet."""
    if not names:
        return []
    try:
        done = _applied(store.db, names)
    except sqlite3.Error as err:
        raise state_error(store.path, err) from None
    return [n for n in names if n not in done]


def defer_durability(store: Store) -> None:
    """Commit without syncing from now on (WAL with ``synchronous=NORMAL``); a crash of
    the process loses nothing (the OS has the WAL), only a power loss could.  For writers
    someone waits for, whose writes are one of:

    - journal events and bookkeeping the next pass redoes from the host (the agent's
      planner, a Kata hook's own pass): the journal files stay until a checkpoint has
      their events in the database file (:func:`settle_journal`);
    - a write the caller acknowledges (``vmpin update``): it calls :func:`sync` before
      it answers, while the agent's pass runs rather than before it starts.
    """
    store.db.execute("PRAGMA synchronous=NORMAL")
    store.deferred = True


def keep_wal_short(store: Store) -> None:
    """For a connection that ends with its process, unclosed (a hook leaves by
    ``os._exit``: closing would checkpoint on a container's start): checkpoint once the
    WAL holds :data:`SHORT_WAL` pages, not SQLite's default 1,000.

    Why: the next process to open the database alone (no agent holds it) finds no one
    else on the shared memory, resets it and rebuilds the WAL's index by reading every
    frame since the last checkpoint, ~2 us a frame: with the default, ~1 ms of every
    Kata start on a node without an agent, ~2 ms before each checkpoint.  A checkpoint
    of this small WAL is a few pages and a sync, once every few starts.
    """
    store.db.execute(f"PRAGMA wal_autocheckpoint={SHORT_WAL}")


def sync(store: Store) -> None:
    """Make every commit so far durable: fsync the WAL and the state dir, as
    ``synchronous=FULL`` does at each commit (with the directory on the WAL's first
    sync).  A commit no longer in the WAL is in the database file, which a checkpoint
    syncs before the WAL is reused."""
    for path in (store.path + "-wal", store.state_dir):
        try:
            fsync_path(path)
        except FileNotFoundError:
            continue  # no WAL: the last connection's close checkpointed it all
        except OSError as err:
            raise StateError(f"{path}: cannot sync: {err.strerror}") from None
    store.synced_at = store.db.total_changes


def _applied(db: sqlite3.Connection, names: list[str]) -> set[str]:
    """Those of ``names`` (sorted, not empty) the journal table records as applied."""
    return {
        r[0]
        for r in db.execute(
            "SELECT name FROM journal WHERE name BETWEEN ? AND ?", (names[0], names[-1])
        )
    }


def _remove_files(state_dir: str, names: list[str]) -> int:
    """Unlink these journal files (their events are in the database file); how many."""
    d = journal.journal_dir(state_dir)
    removed = 0
    for name in names:
        try:
            os.unlink(os.path.join(d, name))
            removed += 1
        except FileNotFoundError:
            pass  # another process removed it
    return removed


def _checkpointed(db: sqlite3.Connection) -> bool:
    """Copy the WAL into the database file; True when all of it got there (PASSIVE: a
    reader elsewhere may hold older frames; then the journal files wait a little)."""
    busy, log_frames, done = db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
    return bool(busy == 0 and log_frames == done)


def _quarantine(state_dir: str, name: str, reason: str) -> None:
    """Move an entry that cannot be applied to ``journal/bad/`` with a ``.reason`` file."""
    d = journal.journal_dir(state_dir)
    bad = journal.bad_dir(state_dir)
    print(
        f"vmpin: journal entry {os.path.join(d, name)}: {reason}; moved to {bad}/",
        file=sys.stderr,
    )
    try:
        os.makedirs(bad, mode=0o700, exist_ok=True)
        with open(
            os.path.join(bad, name + ".reason"),
            "w",
            encoding="utf-8",
            errors="backslashreplace",
        ) as f:
            f.write(reason + "\n")
        os.rename(os.path.join(d, name), os.path.join(bad, name))
    except FileNotFoundError:
        pass  # moved by another process
    except OSError as err:
        print(f"vmpin: cannot quarantine {name}: {err.strerror}", file=sys.stderr)
