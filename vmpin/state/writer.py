"""Writing the store: every change, each in a ``BEGIN IMMEDIATE`` transaction.

Dozens of hook processes start at once on a busy node, each its own short-lived process.
WAL mode lets readers run beside the one writer; every write is a ``BEGIN IMMEDIATE``
transaction, so writers queue on the database lock (``busy_timeout``) instead of failing,
and a hook killed mid-way leaves either its whole change or none of it.

Events never carry state: every change writes the *level* (a container's CPU set) and bumps
its sandbox's generation ``gen``.  Whoever reconciles records the generation it planned
from in ``done_gen``; a sandbox with ``gen > done_gen`` is dirty.  A thousand updates to one
sandbox therefore cost one plan, and a crash between a write and its reconcile loses
nothing: the next pass sees the sandbox still dirty.
"""

from __future__ import annotations

import time

from vmpin.core.errors import StateError
from vmpin.core.ids import check_id
from vmpin.state.reader import Reader
from vmpin.state.records import API_POLICY_META, CONTAINER_COLS, POLICY_META, policy_json
from vmpin.state.schema import left as _left

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.lean.records)
if TYPE_CHECKING:
    import sqlite3
    from collections.abc import Iterable, Mapping
    from threading import Lock
    from types import TracebackType
    from typing import Literal

    from vmpin.core.cpuset import CpuSet
    from vmpin.state.records import ContainerRec, SandboxRec, ThreadRec

#: the least step between two writes' ``updated_at`` on one container row (seconds; a
#: float64 near today's epoch resolves ~0.24 us)
_TICK = 1e-6
#: SQLite's result code for a lock another connection holds
_SQLITE_BUSY = 5


class Writer(Reader):
    """The store's reads and its writes (what :class:`vmpin.state.store.Store` opens)."""

    readonly = False
    #: no wait for SQLite's locks goes past this (``time.monotonic()``), bar MIN_BUSY
    deadline: float | None = None
    #: how many transactions are open, nested (:class:`_Transaction`)
    _depth = 0
    #: the lock the writers of one process share (the agent's: its planner, its updates'
    #: connection, its main thread's full passes), taken before SQLite's: they queue on it,
    #: each woken as the one before commits, instead of on SQLite's busy handler, which
    #: sleeps 1, 2, 5, 10... ms between tries (an update waited ~17 ms on average for the
    #: planner's transactions under churn, issue 28).  None: SQLite's alone (one per process)
    local_lock: Lock | None = None
    #: the busy_timeout (ms) a transaction with a deadline last set on this connection
    #: (None: none yet; see :func:`_begin_by`)
    busy_ms: int | None = None

    def transaction(self) -> _Transaction:
        """A write transaction: the database lock is taken at the start, not at first write.

        Nested uses join the outer transaction (applying journaled events calls the same
        methods as everyone else, all inside one transaction)."""
        return _Transaction(self)

    # -- containers ------------------------------------------------------------------------
    def put_container(
        self, rec: ContainerRec, stored: ContainerRec | Literal[False] | None = False
    ) -> None:
        """Insert or replace a container and mark its sandbox dirty, in one transaction.

        ``stored``: the row of ``rec.id`` as the caller read it in the transaction it holds
        open around this call (None: there is none), not read again (the journal's ingest
        has just looked the container up: issue 28); False: read here."""
        check_id(rec.id, "container id")
        check_id(rec.sandbox_id, "sandbox id")
        if stored is not False and (not self._depth or (stored and stored.id != rec.id)):
            raise ValueError("stored: the row as read in the caller's open transaction")
        now = time.time()
        with self.transaction() as db:
            if stored is False:
                old = db.execute(
                    "SELECT created_at, updated_at FROM containers WHERE id=?", (rec.id,)
                ).fetchone()
            else:
                old = None if stored is None else (stored.created_at, stored.updated_at)
            values = {k: getattr(rec, k) for k in CONTAINER_COLS}
            values["cpus"] = None if rec.cpus is None else rec.cpus.to_list()
            values["is_sandbox"] = int(rec.is_sandbox)
            values["created_at"] = old[0] if old else now
            # (each write of a row leaves a later updated_at: see restore_container_cpus)
            values["updated_at"] = max(now, old[1] + _TICK) if old else now
            cols = ",".join(CONTAINER_COLS)
            marks = ",".join("?" for _ in CONTAINER_COLS)
            db.execute(
                f"INSERT OR REPLACE INTO containers ({cols}) VALUES ({marks})",
                [values[k] for k in CONTAINER_COLS],
            )
            self._bump(db, rec.sandbox_id, now)

    def set_container_cpus(
        self,
        container_id: str,
        cpus: CpuSet | None,
        source: str,
        old: ContainerRec | None = None,
        /,
        **seen: str | None,
    ) -> ContainerRec:
        """Record a container's new CPU set (an update) and mark its sandbox dirty; the
        record as this write left it (its ``updated_at`` names this write, see
        :meth:`restore_container_cpus`).

        The row is read in the write's transaction, and the record this write leaves made
        from it: nothing else can write the row between the two.  ``old``: the row as the
        caller read it in the transaction it holds open around this call (``vmpin update``'s
        checks: vmpin.service.update.record_update), not read again (issue 28: a read of
        the row before an update's write, and one after it, were one statement more on
        every ``vmpin update``).  Not ``UPDATE ... RETURNING``: with another connection's
        commit since this one's last statement (the agent's planner, before each update) it
        was ~30 us slower than the write and a read."""
        allowed = {"runtime_seen", "kubelet_seen"}
        if set(seen) - allowed:
            raise ValueError(f"unknown columns {set(seen) - allowed}")
        if old is not None and (not self._depth or old.id != container_id):
            raise ValueError("old: the row as read in the caller's open transaction")
        now = time.time()
        sets = ["cpus=?", "cpus_source=?", "updated_at=?", *(f"{k}=?" for k in seen)]
        with self.transaction() as db:
            if old is None:
                old = self.container(container_id)
                if old is None:
                    raise StateError(f"unknown container {container_id!r}")
            # every write of the row leaves a later stamp than the one before it, even
            # within one clock tick or after the clock stepped back
            stamp = max(now, old.updated_at + _TICK)
            db.execute(
                f"UPDATE containers SET {','.join(sets)} WHERE id=?",
                [
                    None if cpus is None else cpus.to_list(),
                    source,
                    stamp,
                    *seen.values(),
                    container_id,
                ],
            )
            self._bump(db, old.sandbox_id, now)
        return old._replace(
            cpus=cpus,
            cpus_source=source,
            updated_at=stamp,
            runtime_seen=seen.get("runtime_seen", old.runtime_seen),
            kubelet_seen=seen.get("kubelet_seen", old.kubelet_seen),
        )

    def restore_container_cpus(
        self, written: ContainerRec, cpus: CpuSet | None, source: str
    ) -> bool:
        """Put a container's CPU set back to ``cpus`` (from ``source``) -- only if the store
        still holds the write ``written`` (what :meth:`set_container_cpus` returned): a
        compare-and-swap, True when it swapped.

        For a write that is to be undone (``vmpin update`` whose re-pin failed or was
        interrupted).  Unconditional, the undo erased whatever was written since: another
        update, acknowledged meanwhile, was lost from the store while the kernel held it (3
        of 3, issue 26).  The write is known by its stamp (``updated_at``: each write of a
        row leaves a later one), not by its value, which a later write may repeat.
        """
        now = time.time()
        with self.transaction() as db:
            cur = db.execute(
                "UPDATE containers SET cpus=?, cpus_source=?, updated_at=MAX(?, updated_at + ?)"
                " WHERE id=? AND cpus IS ? AND cpus_source IS ? AND updated_at=?",
                (
                    None if cpus is None else cpus.to_list(),
                    source,
                    now,
                    _TICK,
                    written.id,
                    None if written.cpus is None else written.cpus.to_list(),
                    written.cpus_source,
                    written.updated_at,
                ),
            )
            if cur.rowcount != 1:
                return False
            self._bump(db, written.sandbox_id, now)
        return True

    def note_seen(self, container_id: str, **seen: str | None) -> None:
        """Remember what a runtime or kubelet last said, without changing the desired set."""
        allowed = {"runtime_seen", "kubelet_seen", "cgroup"}
        if not seen or set(seen) - allowed:
            raise ValueError(f"bad columns {set(seen)}")
        sets = ",".join(f"{k}=?" for k in seen)
        with self.transaction() as db:
            db.execute(f"UPDATE containers SET {sets} WHERE id=?", [*seen.values(), container_id])

    def delete_container(
        self, container_id: str, old: ContainerRec | None = None
    ) -> ContainerRec | None:
        """Forget a container; forgetting a sandbox container forgets its whole sandbox.

        ``old``: its row as the caller read it in the transaction it holds open around this
        call, not read again (the journal's ingest has just looked it up: issue 28)."""
        if old is not None and (not self._depth or old.id != container_id):
            raise ValueError("old: the row as read in the caller's open transaction")
        rec = self.container(container_id) if old is None else old
        if rec is None:
            return None
        now = time.time()
        with self.transaction() as db:
            db.execute("DELETE FROM containers WHERE id=?", (container_id,))
            if rec.is_sandbox:
                db.execute("DELETE FROM containers WHERE sandbox_id=?", (rec.sandbox_id,))
                db.execute("DELETE FROM sandboxes WHERE id=?", (rec.sandbox_id,))
                self._forget_threads(db, rec.sandbox_id)
                return rec
            # Its sandbox marked dirty while it has containers left: one statement where a
            # count and the bump were two; the count only when nothing was bumped.
            bumped = db.execute(
                "UPDATE sandboxes SET gen=gen+1, updated_at=? WHERE id=?"
                " AND EXISTS (SELECT 1 FROM containers WHERE sandbox_id=?)",
                (now, rec.sandbox_id, rec.sandbox_id),
            ).rowcount
            if not bumped and not db.execute(
                "SELECT COUNT(*) FROM containers WHERE sandbox_id=?", (rec.sandbox_id,)
            ).fetchone()[0]:
                db.execute("DELETE FROM sandboxes WHERE id=?", (rec.sandbox_id,))
                self._forget_threads(db, rec.sandbox_id)
        return rec

    # -- sandboxes -------------------------------------------------------------------------
    def put_sandbox(self, rec: SandboxRec) -> None:
        """Insert a sandbox, or update its runtime/VMM/pod fields, and mark it dirty."""
        check_id(rec.id, "sandbox id")
        now = time.time()
        with self.transaction() as db:
            db.execute(
                "INSERT INTO sandboxes (id, runtime, vmm_pid, vmm_start, pod_uid, pod_name,"
                " pod_namespace, gen, done_gen, created_at, updated_at)"
                " VALUES (?,?,?,?,?,?,?,1,0,?,?)"
                " ON CONFLICT(id) DO UPDATE SET runtime=excluded.runtime,"
                " vmm_pid=COALESCE(excluded.vmm_pid, vmm_pid),"
                " vmm_start=COALESCE(excluded.vmm_start, vmm_start),"
                " pod_uid=COALESCE(excluded.pod_uid, pod_uid),"
                " pod_name=COALESCE(excluded.pod_name, pod_name),"
                " pod_namespace=COALESCE(excluded.pod_namespace, pod_namespace),"
                " gen=gen+1, updated_at=excluded.updated_at",
                (
                    rec.id,
                    rec.runtime,
                    rec.vmm_pid,
                    rec.vmm_start,
                    rec.pod_uid,
                    rec.pod_name,
                    rec.pod_namespace,
                    now,
                    now,
                ),
            )

    def set_vmm(self, sandbox_id: str, vmm_pid: int | None, vmm_start: int | None) -> None:
        with self.transaction() as db:
            db.execute(
                "UPDATE sandboxes SET vmm_pid=?, vmm_start=?, updated_at=? WHERE id=?",
                (vmm_pid, vmm_start, time.time(), sandbox_id),
            )

    def delete_sandbox(self, sandbox_id: str) -> None:
        with self.transaction() as db:
            db.execute("DELETE FROM containers WHERE sandbox_id=?", (sandbox_id,))
            db.execute("DELETE FROM sandboxes WHERE id=?", (sandbox_id,))
            self._forget_threads(db, sandbox_id)

    def mark_dirty(self, sandbox_ids: Iterable[str] | None = None) -> None:
        """Bump generations: of the given sandboxes, or of all (after an agent restart)."""
        now = time.time()
        with self.transaction() as db:
            if sandbox_ids is None:
                db.execute("UPDATE sandboxes SET gen=gen+1, updated_at=?", (now,))
            else:
                for sid in sandbox_ids:
                    self._bump(db, sid, now)

    def mark_done(self, sandbox_id: str, gen: int) -> None:
        """Record that the sandbox was planned from generation ``gen`` (never moves back)."""
        with self.transaction() as db:
            db.execute(
                "UPDATE sandboxes SET done_gen=MAX(done_gen, ?) WHERE id=?", (gen, sandbox_id)
            )

    @staticmethod
    def _forget_threads(db: sqlite3.Connection, sandbox_id: str) -> None:
        db.execute("DELETE FROM threads WHERE sandbox_id=?", (sandbox_id,))
        db.execute("DELETE FROM meta WHERE key LIKE ?", (f"missing-vcpus:{sandbox_id}:%",))
        db.execute("DELETE FROM meta WHERE key=?", (POLICY_META + sandbox_id,))

    @staticmethod
    def _bump(db: sqlite3.Connection, sandbox_id: str, now: float) -> None:
        db.execute("UPDATE sandboxes SET gen=gen+1, updated_at=? WHERE id=?", (now, sandbox_id))

    # -- remembered thread roles -----------------------------------------------------------
    def save_threads(
        self, sandbox_id: str, vmm_pid: int, vmm_start: int, threads: Iterable[ThreadRec]
    ) -> None:
        with self.transaction() as db:
            db.execute("DELETE FROM threads WHERE sandbox_id=?", (sandbox_id,))
            db.executemany(
                "INSERT INTO threads VALUES (?,?,?,?,?,?,?,?)",
                [
                    (sandbox_id, vmm_pid, vmm_start, t.tid, t.role, t.idx, t.label, t.layer)
                    for t in threads
                ],
            )

    # -- meta ------------------------------------------------------------------------------
    def delete_meta(self, keys: Iterable[str]) -> None:
        with self.transaction() as db:
            db.executemany("DELETE FROM meta WHERE key=?", [(k,) for k in keys])

    def set_meta(self, key: str, value: str) -> None:
        with self.transaction() as db:
            db.execute("INSERT OR REPLACE INTO meta VALUES (?,?)", (key, value))

    def record_api_policies(self, changes: Mapping[str, Mapping[str, str] | None]) -> None:
        """Record pods' policy annotations as the Kubernetes API shows them now (pod uid ->
        annotations; None: the API no longer has the pod), in one transaction.

        The agent writes them, so that ``audit``, ``reconcile --once`` and the hooks plan with
        the policy the operator set through the API, not only the agent (issue 25: the
        agent's choice read as drift, and ``reconcile --once`` reverted it).
        """
        now = time.time()
        rows = []
        gone = []
        for uid, shown in changes.items():
            check_id(uid, "pod uid")
            if shown is None:
                gone.append((API_POLICY_META + uid,))
            else:
                rows.append((API_POLICY_META + uid, policy_json(shown, now)))
        with self.transaction() as db:
            db.executemany("DELETE FROM meta WHERE key=?", gone)
            db.executemany("INSERT OR REPLACE INTO meta VALUES (?,?)", rows)


def _busy_timeout(store: Writer, ms: int) -> None:
    store.db.execute(f"PRAGMA busy_timeout={ms}")
    store.busy_ms = ms


def _begin_by(store: Writer, deadline: float) -> None:
    """``BEGIN IMMEDIATE``, waiting for another connection's write lock no longer than what
    is left of the caller's budget (``deadline``, vmpin.service.budget), not 30 s.

    The wait in force is set only when it is longer than what is left: a pragma is a
    statement SQLite compiles again each time (~6% of ``vmpin update``'s transaction in
    the agent, issue 28), and the lock is free nearly always, whatever the wait.  When
    the shorter wait in force ran out with the lock still taken, the rest is waited."""
    wait = int(_left(deadline) * 1000)
    if store.busy_ms is None or store.busy_ms > wait:
        _busy_timeout(store, wait)
    try:
        store.db.execute("BEGIN IMMEDIATE")
    except store.db.OperationalError as err:
        rest = int((deadline - time.monotonic()) * 1000)
        if getattr(err, "sqlite_errorcode", 0) & 0xFF != _SQLITE_BUSY or rest < 1:
            raise
        _busy_timeout(store, rest)
        store.db.execute("BEGIN IMMEDIATE")


class _Transaction:
    """:meth:`Writer.transaction`'s context manager; ``with`` yields the connection.

    A class rather than ``contextlib.contextmanager``: contextlib is not imported on the
    hook's path (it is ~0.5 ms, with its own imports, of a Kata hook that pins in-process).
    The outermost one begins (``BEGIN IMMEDIATE``) and commits, or rolls back on any
    exception, which then propagates; nested ones only join."""

    __slots__ = ("_outer", "_store")

    def __init__(self, store: Writer) -> None:
        self._store = store
        self._outer = False

    def __enter__(self) -> sqlite3.Connection:
        store = self._store
        if store._depth:
            store._depth += 1
            return store.db
        lock = store.local_lock
        if lock is not None and not lock.acquire(
            timeout=-1 if store.deadline is None else _left(store.deadline)
        ):
            from vmpin.state.sqlite import sqlite3

            raise sqlite3.OperationalError("database is locked (by this process's other writer)")
        try:
            if store.deadline is None:
                store.db.execute("BEGIN IMMEDIATE")
            else:
                _begin_by(store, store.deadline)
        except BaseException:
            if lock is not None:
                lock.release()
            raise
        store._depth = 1
        self._outer = True
        return store.db

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        store = self._store
        if not self._outer:
            store._depth -= 1
            return
        try:
            store.db.execute("COMMIT" if kind is None else "ROLLBACK")
        finally:
            store._depth = 0
            if store.local_lock is not None:
                store.local_lock.release()
