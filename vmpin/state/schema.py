"""The state database's shape: its tables, their version, and what every connection sets.

The schema is versioned with ``PRAGMA user_version``; a database from a newer vmpin is
refused rather than misread.  A new version adds tables (``CREATE ... IF NOT EXISTS``), so an
older database is brought up to date by running the schema again.
"""

from __future__ import annotations

import os
import time

from vmpin.core.errors import StateError
from vmpin.state import allocations, changes

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.lean.records)
if TYPE_CHECKING:
    import sqlite3

    from vmpin.state.writer import Writer
else:
    # the C module _sqlite3, without the sqlite3 package's imports nor functools' (see there)
    from vmpin.state.sqlite import sqlite3

#: 3: vmpin's own allocations (vmpin.state.allocations); 4: its change log; 5: the log names
#: the table a sandbox's row was written in (its triggers replaced); 6: the allocations table
#: logs its writes too (triggers added: an older database gains them when a writer opens it);
#: 7: the log's ``seq`` a plain rowid, its trim in each trigger (vmpin.state.changes.rebuild);
#: 8: that trim by the log's own top (7's could wipe the log: its triggers replaced)
SCHEMA_VERSION = 8
#: schema versions a read-only view reads (2 and 3 lack only tables added since: without
#: the change log, vmpin.state.changes, a long-lived reader reads the tables whole; before 6
#: the log says nothing of the allocations, which a read-only view reads at every version)
READABLE = (0, 2, 3, 4, 5, 6, 7, SCHEMA_VERSION)
#: the shortest busy wait a store with a deadline is given, even once the deadline passed
#: (seconds): a live writer holds the lock for about a millisecond, a stopped one for ever
MIN_BUSY = 0.05
#: each connection's page cache, KiB (SQLite's default is 2,000).  The agent holds three
#: connections for its life, and at 2,000 sandboxes their caches filled to ~3.3 MiB of its
#: 50 MB budget (issue 14) for pages the OS page cache holds anyway: a pass that reads the
#: tables again reads each page once (an idle pass reads none), so a miss is one pread.
CACHE_KIB = 512

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sandboxes (
    id            TEXT PRIMARY KEY,
    runtime       TEXT NOT NULL,
    vmm_pid       INTEGER,
    vmm_start     INTEGER,
    pod_uid       TEXT,
    pod_name      TEXT,
    pod_namespace TEXT,
    gen           INTEGER NOT NULL DEFAULT 1,
    done_gen      INTEGER NOT NULL DEFAULT 0,
    created_at    REAL NOT NULL,
    updated_at    REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS containers (
    id            TEXT PRIMARY KEY,
    sandbox_id    TEXT NOT NULL,
    is_sandbox    INTEGER NOT NULL,
    name          TEXT,
    pod_uid       TEXT,
    pod_name      TEXT,
    pod_namespace TEXT,
    cpus          TEXT,
    cpus_source   TEXT,
    mems          TEXT,
    bundle        TEXT,
    pid           INTEGER,
    pid_start     INTEGER,
    cgroup        TEXT,
    runtime_seen  TEXT,
    kubelet_seen  TEXT,
    created_at    REAL NOT NULL,
    updated_at    REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS containers_sandbox ON containers(sandbox_id);
CREATE INDEX IF NOT EXISTS containers_bundle ON containers(bundle);
CREATE TABLE IF NOT EXISTS threads (
    sandbox_id TEXT NOT NULL,
    vmm_pid    INTEGER NOT NULL,
    vmm_start  INTEGER NOT NULL,
    tid        INTEGER NOT NULL,
    role       TEXT NOT NULL,
    idx        INTEGER,
    label      TEXT,
    layer      TEXT NOT NULL,
    PRIMARY KEY (sandbox_id, tid)
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT);
CREATE TABLE IF NOT EXISTS journal (name TEXT PRIMARY KEY);
""" + allocations.SCHEMA + changes.SCHEMA


def state_error(path: str, err: BaseException) -> StateError:
    """One line for a database that cannot be used, naming the file and what to do."""
    text = str(err)
    if "readonly" in text or "read-only" in text:
        hint = "the state dir is read-only: make it writable (the agent pins meanwhile)"
    elif "full" in text:
        hint = "the state dir's filesystem is full: free space (nothing was recorded)"
    elif "locked" in text or "busy" in text:
        hint = "another vmpin holds the database: retry"
    else:
        hint = "run `vmpin doctor` to move it aside and rebuild it from the host"
    return StateError(f"{path}: {text}: {hint}")


def connect(
    target: str, timeout: float, *, uri: bool = False, shared: bool = False
) -> sqlite3.Connection:
    """A connection as the store uses them: autocommit (transactions are the store's own,
    :meth:`vmpin.state.writer.Writer.transaction`), ``timeout`` for another's write lock, a
    small page cache.  ``shared``: used from several threads, one at a time (the caller
    serialises them)."""
    db = sqlite3.connect(
        target, uri=uri, timeout=timeout, isolation_level=None, check_same_thread=not shared
    )
    try:
        db.execute(f"PRAGMA busy_timeout={int(timeout * 1000)}")
        db.execute(f"PRAGMA cache_size=-{CACHE_KIB}")
    except sqlite3.Error:
        db.close()
        raise
    return db


def left(deadline: float) -> float:
    """Seconds to wait for a lock before ``deadline``, and never less than MIN_BUSY."""
    return max(MIN_BUSY, deadline - time.monotonic())


_URI_SAFE = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789/_.-~")


def uri_path(path: str) -> str:
    """``path`` as an SQLite URI filename: every byte but the unreserved ones as %HH (what
    urllib.parse.quote does, without its import of re on every read command)."""
    raw = os.fsencode(path)
    return "".join(chr(b) if b in _URI_SAFE else f"%{b:02X}" for b in raw)


def ensure(store: Writer) -> None:
    """Bring ``store``'s database to :data:`SCHEMA_VERSION` (creating its tables), in WAL
    mode, syncing at each commit; refuse one from a newer vmpin."""
    db = store.db
    version = db.execute("PRAGMA user_version").fetchone()[0]
    if version == SCHEMA_VERSION:
        db.execute("PRAGMA synchronous=FULL")  # durable by default: see vmpin.state.ingest
        return
    if version > SCHEMA_VERSION:
        raise StateError(
            f"{store.path}: schema version {version} is newer than this vmpin ({SCHEMA_VERSION})"
        )
    # WAL must be switched on outside a transaction; it is persistent once set.  Processes
    # opening a fresh database at once race here, and SQLite answers the losers "database
    # is locked" at once (a lock upgrade: busy_timeout would deadlock), so retry.
    for attempt in range(1000):
        try:
            db.execute("PRAGMA journal_mode=WAL")
            break
        except sqlite3.OperationalError as err:
            if attempt == 999:
                raise StateError(f"{store.path}: cannot switch to WAL: {err}") from err
            time.sleep(0.01)
    db.execute("PRAGMA synchronous=FULL")
    with store.transaction():
        if db.execute("PRAGMA user_version").fetchone()[0] < SCHEMA_VERSION:
            # executescript() would COMMIT the open transaction: run statements one by one.
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    db.execute(statement)
            changes.rebuild(db)  # (schema 4-6's log: its seq AUTOINCREMENT)
            changes.create(db)  # (its triggers hold ";": not in the text split above)
            db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
    try:  # noqa: SIM105 (contextlib stays off the hook's path)
        os.chmod(store.path, 0o600)
    except OSError:
        pass
