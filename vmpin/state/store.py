"""Durable state: containers, sandboxes and remembered thread roles, in SQLite under the state dir.

:class:`Store` is the store as its writers open it: the reads (vmpin.state.reader), the
writes (vmpin.state.writer) and the hooks' journal applied on open (vmpin.state.ingest), on
one connection, cheap to open, so each process opens its own.  A read-only command opens
:meth:`Store.open_readonly` instead and holds a :class:`~vmpin.state.reader.Reader`: no
write is in its type.  The tables and their version are vmpin.state.schema's; the records,
vmpin.state.records'.
"""

from __future__ import annotations

import os
import sys
from stat import S_ISREG

from vmpin.core.errors import StateError
from vmpin.state import ingest as _ingest
from vmpin.state import journal, schema
from vmpin.state.ingest import INGEST_BATCH, SETTLE_AFTER, SHORT_WAL
from vmpin.state.reader import Reader
from vmpin.state.records import (
    API_POLICY_META,
    POLICY_META,
    ContainerRec,
    PolicyRecord,
    SandboxRec,
    ThreadRec,
    policy_record,
)
from vmpin.state.schema import CACHE_KIB, MIN_BUSY, SCHEMA_VERSION, state_error
from vmpin.state.writer import Writer

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.lean.records)
if TYPE_CHECKING:
    import sqlite3
    from typing import Literal, overload
else:
    # the C module _sqlite3, without the sqlite3 package's imports nor functools' (see there)
    from vmpin.state.sqlite import sqlite3

#: names that moved to the rooms above, still importable from here (new code imports them
#: from their homes)
__all__ = [
    "API_POLICY_META", "CACHE_KIB", "INGEST_BATCH", "MIN_BUSY", "POLICY_META", "SCHEMA_VERSION",
    "SETTLE_AFTER", "SHORT_WAL", "ContainerRec", "PolicyRecord", "Reader", "SandboxRec", "Store",
    "ThreadRec", "Writer", "policy_record", "state_error",
]  # fmt: skip


class Store(Writer):
    """The state database, read and written, with the hooks' journal applied."""

    #: commits do not sync (:meth:`defer_durability`)
    deferred = False
    #: total_changes at the last :meth:`settle_journal`
    settled_at = 0
    #: total_changes at the last :meth:`sync` (-1: none yet)
    synced_at = -1
    #: why the last ingest could not write (read-only or full state dir), else None
    write_error: str | None = None

    def __init__(
        self,
        state_dir: str,
        *,
        timeout: float = 30.0,
        ingest: bool = True,
        deadline: float | None = None,
        shared: bool = False,
    ) -> None:
        """Open (creating if needed) the state in ``state_dir``; with ``ingest``, first apply
        whatever the hooks journaled since, so every reader sees every recorded event.
        ``shared``: used by several threads, one at a time (the agent's updates).

        ``timeout``: how long a write waits for another connection's write lock.  With
        ``deadline`` (``time.monotonic()``) instead, no such wait goes past it (each gets
        what is left, and at least :data:`MIN_BUSY`): a hook's or ``vmpin update``'s budget,
        where a stopped holder must not stall a container start (vmpin.service.budget).
        """
        if deadline is not None:
            self.deadline = deadline
            timeout = schema.left(deadline)
        path = os.path.join(state_dir, "state.db")
        try:
            os.makedirs(state_dir, mode=0o700, exist_ok=True)
        except OSError as err:
            raise StateError(f"{state_dir}: cannot create state dir: {err.strerror}") from None
        try:
            # Create the file 0600 before SQLite does: it would use 0644, and the -wal and -shm
            # files it creates next copy the database file's mode.  Only when it is missing
            # (O_EXCL): closing any fd of an open database drops every POSIX lock this process
            # holds on it, so another process would take over the WAL under the feet of this
            # process's other connections (the agent's workers) -- they then read a stale WAL.
            os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
        except FileExistsError:
            pass
        except OSError as err:
            raise StateError(f"{path}: {err.strerror}") from None
        try:
            st = os.lstat(path)
        except OSError as err:
            raise StateError(f"{path}: {err.strerror}") from None
        if not S_ISREG(st.st_mode):
            # SQLite would follow a symlink planted here and write wherever it points
            raise StateError(f"{path}: not a regular file (a symlink?): refused")
        try:
            super().__init__(state_dir, schema.connect(path, timeout, shared=shared))
            schema.ensure(self)
        except sqlite3.Error as err:
            try:  # noqa: SIM105 (contextlib stays off the hook's path)
                self.db.close()
            except (AttributeError, sqlite3.Error):
                pass
            raise state_error(path, err) from None

        if ingest:
            try:
                self.ingest()
            except StateError as err:
                # Readers still read what is stored; a writer will meet the error itself.
                self.write_error = str(err)
                print(f"vmpin: {err}", file=sys.stderr)

    if TYPE_CHECKING:

        @overload
        @classmethod
        def open_readonly(
            cls, state_dir: str, *, timeout: float = ..., fresh: bool = ...,
            copy: Literal[False] = ...,
        ) -> Reader: ...  # fmt: skip
        @overload
        @classmethod
        def open_readonly(
            cls, state_dir: str, *, timeout: float = ..., fresh: bool = ..., copy: Literal[True]
        ) -> Store: ...

    @classmethod
    def open_readonly(
        cls,
        state_dir: str,
        *,
        timeout: float = 30.0,
        fresh: bool = False,
        copy: bool = False,
    ) -> Reader:
        """Open existing state for reading only: no directory, file, schema or journal write.

        Read-only commands use this, so that ``state.db`` stays byte-identical.  A state dir
        holding neither a database nor a journal is a fresh node when ``fresh`` (the caller
        knows it is the node's own state dir, not a mistyped one): an empty store in memory,
        with :attr:`fresh` set so the command can say so; otherwise a :class:`StateError`
        that says what is missing and what would create it.
        SQLite's ``mode=ro`` connection never checkpoints the WAL into the database file.
        Events the hooks journaled and no writer applied yet are applied to an in-memory
        copy (SQLite's backup API), leaving the journal files for the next writer.

        ``copy``: always that in-memory copy, as a :class:`Store` that may then be written
        (a hook's own pass when another process holds the write lock past its budget: its
        records go nowhere, its pins are made all the same).  Reading needs no lock in WAL
        mode: the copy is the store as last committed, whoever holds the write lock.
        """
        path = os.path.join(state_dir, "state.db")
        pending = journal.pending(state_dir) if os.path.isdir(state_dir) else []
        stored = os.path.isfile(path)
        if not stored and not pending and not fresh:
            raise StateError(
                f"no vmpin state at {state_dir}: no hook, update, reconcile or agent has"
                " written there (check --state-dir / VMPIN_STATE_DIR; on a new node, install"
                " the hooks or run `vmpin reconcile --once`)"
            )
        empty = not stored and not pending
        db = None
        try:
            if stored:
                db = schema.connect(f"file:{schema.uri_path(path)}?mode=ro", timeout, uri=True)
                version = db.execute("PRAGMA user_version").fetchone()[0]
                if version not in schema.READABLE:
                    raise StateError(
                        f"{path}: schema version {version}, this vmpin reads {SCHEMA_VERSION}"
                    )
            if pending or copy or not stored:
                memory = sqlite3.connect(":memory:", isolation_level=None)
                if db is not None:
                    db.backup(memory)
                    db.close()
                writer = cls.__new__(cls)
                Reader.__init__(writer, state_dir, memory, fresh=empty)
                writer.readonly = True
                schema.ensure(writer)
                writer.ingest(consume=False)
                if copy:
                    return writer
                db = memory
        except sqlite3.Error as err:
            raise state_error(path, err) from None
        assert db is not None
        return Reader(state_dir, db, fresh=empty)

    # -- the hooks' journal, and durability (vmpin.state.ingest) -------------------------------
    def ingest(
        self,
        *,
        budget: float | None = None,
        batch: int = INGEST_BATCH,
        consume: bool = True,
        durable: bool = True,
    ) -> list[str]:
        """:func:`vmpin.state.ingest.ingest`: apply the pending events; the sandboxes touched."""
        return _ingest.ingest(self, budget=budget, batch=batch, consume=consume, durable=durable)

    def settle_journal(self) -> int:
        """:func:`vmpin.state.ingest.settle_journal`: remove the files of applied events."""
        return _ingest.settle_journal(self)

    def unapplied(self, names: list[str]) -> list[str]:
        """:func:`vmpin.state.ingest.unapplied`: those of ``names`` not applied yet."""
        return _ingest.unapplied(self, names)

    def defer_durability(self) -> None:
        """:func:`vmpin.state.ingest.defer_durability`: commit without syncing from now on."""
        _ingest.defer_durability(self)

    def keep_wal_short(self) -> None:
        """:func:`vmpin.state.ingest.keep_wal_short`: checkpoint at a short WAL."""
        _ingest.keep_wal_short(self)

    def sync(self) -> None:
        """:func:`vmpin.state.ingest.sync`: make every commit so far durable."""
        _ingest.sync(self)
