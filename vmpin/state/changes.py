"""The store's change log: which sandboxes' records, and which meta keys, moved since a point.

Issue 28: an event's pass in the agent read every table whole whenever the store had moved
(``Store.version``), and it always has by then -- the event is a write.  At 2,000 sandboxes
that was 26,000 rows a pass to learn that one sandbox changed.  ``PRAGMA data_version`` says
*that* another connection committed, never *what*; so the store says what, itself: triggers
on the tables a pass reads append one row per written row to ``changes`` -- the sandbox it
belongs to with the table written (``sandboxes``, ``containers``, ``threads``: in the ``key``
column), or the ``meta`` key -- whichever process writes, through whichever code path.  A
long-lived reader remembers the last ``seq`` it read and asks for the rows after it
(:func:`since`: the primary key's range, rows proportional to what changed), then re-reads
what those sandboxes had written through the indexes: an update of a container's CPUs, or
the pass marking a sandbox done, does not make its 37 thread rows be read again.
(Schema 4's triggers named no table: such a row stands for all three.)  vmpin's own
allocations (:mod:`vmpin.state.allocations`, schema 6) log a row naming the sandbox and
``allocations``: a pass that finds none since its last read of that table takes it as read
(it was read on every pass, issue 28).  A sandbox's ``done_gen`` written alone (a pass
marking it done) logs its new value (:data:`DONE`): the next event's pass read the row of
the last one's sandbox again for it.

The log keeps itself short: each trigger, after its row, removes the rows before the last
multiple of :data:`KEEP` but one (so it holds between one and two times that).  ``seq`` is
the table's rowid, never reused: only that trim deletes rows, and never the newest, after
which SQLite numbers the next (schema 7: not AUTOINCREMENT, whose ``sqlite_sequence`` row
each logged row read and wrote again -- ~13% of a ``vmpin update``'s transaction, and a
page more in every commit's WAL; the trim was a trigger of its own on the log, run for
every row, another ~6%: issue 28).  A reader further behind than what is kept finds a hole
before the first row it gets: :func:`since` then answers None, and the reader reads the
tables whole, as it would have without the log.

Lean: the store imports it (the Kata hook's path).  Triggers hold ``;`` in their bodies, so
they are created one by one (:func:`create`), not from the store's split schema text.
"""

from __future__ import annotations

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.lean.records)
if TYPE_CHECKING:
    import sqlite3

#: the log's rows kept, at least (see the module's docstring)
KEEP = 4096

#: the table (vmpin.state.store appends it to its schema; version 4, its ``seq`` no longer
#: AUTOINCREMENT since 7: :func:`rebuild`)
SCHEMA = """
CREATE TABLE IF NOT EXISTS changes (
    seq        INTEGER PRIMARY KEY,
    sandbox_id TEXT,
    key        TEXT
);
"""

#: the tables a sandbox's rows live in (what a sandbox's row in the log names)
TABLES = ("sandboxes", "containers", "threads")
#: what a row logged by the allocations table names (not a sandbox's own table: the
#: sandbox's records did not move, vmpin's allocation of its pod did)
ALLOCATIONS = "allocations"


def _logged(row: str, table: str) -> str:
    """The statement logging a sandbox's ``row`` ("new" or "old") of ``table``."""
    column = "id" if table == "sandboxes" else "sandbox_id"
    return f"INSERT INTO changes(sandbox_id, key) VALUES ({row}.{column}, '{table}')"


_KEY = "INSERT INTO changes(key) VALUES ({}.key)"

#: what a sandbox's row in the log names when its ``done_gen`` alone was written (a pass
#: marking it done), followed by the value written: what the record became is known
#: without reading it again (schema 6; the last pass's own write, read again by the next
#: event's pass, issue 28)
DONE = "done_gen="
#: the sandboxes table's columns but ``done_gen`` (vmpin.state.schema; the records':
#: vmpin.state.records.SANDBOX_COLS, which tests/state/test_changes.py compares)
_SANDBOX_BOOKS = ("id", "runtime", "vmm_pid", "vmm_start", "pod_uid", "pod_name",
                  "pod_namespace", "gen", "created_at", "updated_at")  # fmt: skip
_DONE_ALONE = " AND ".join(f"old.{c} IS new.{c}" for c in _SANDBOX_BOOKS)

#: what each trigger runs after its row(s): the rows before the last multiple of KEEP but one
#: removed (a range of the rowid that is empty but once every KEEP rows: two seeks).  By the
#: log's own top (schema 8), not last_insert_rowid(): a trigger that logs no row (the moved
#: one, nearly always) inherits that of the connection's last insert into another table,
#: whose rowids may run far ahead of the log's, and so wiped the log, its newest row too --
#: and the next seq was then handed out again.
_TRIM = (
    f"; DELETE FROM changes WHERE seq <= (SELECT max(seq) FROM changes) / {KEEP} * {KEEP}"
    f" - {KEEP}"
)
#: triggers of older schemas no longer made (dropped by :func:`create`)
_RETIRED = ("changes_keep_short",)

#: (trigger name, when, table, what it logs)
_TRIGGERS = (
    ("changes_sandboxes_ins", "AFTER INSERT", "sandboxes", _logged("new", "sandboxes")),
    # (one trigger, its key chosen: a trigger program more per write of the row cost each
    # writer, the agent's passes first)
    ("changes_sandboxes_upd", "AFTER UPDATE", "sandboxes",
     "INSERT INTO changes(sandbox_id, key) VALUES (new.id,"
     f" CASE WHEN {_DONE_ALONE} THEN '{DONE}' || new.done_gen ELSE 'sandboxes' END)"),
    ("changes_sandboxes_del", "AFTER DELETE", "sandboxes", _logged("old", "sandboxes")),
    # (INSERT OR REPLACE deletes the old row without a delete trigger: a container id
    # written again under another sandbox logs the sandbox it leaves, here)
    ("changes_containers_moved", "BEFORE INSERT", "containers",
     "INSERT INTO changes(sandbox_id, key) SELECT sandbox_id, 'containers' FROM containers"
     " WHERE id = new.id AND sandbox_id != new.sandbox_id"),
    ("changes_containers_ins", "AFTER INSERT", "containers", _logged("new", "containers")),
    # (the sandbox it leaves too, only when it moved: an update of its CPUs, every
    # ``vmpin update``, logs one row, not the same row twice)
    ("changes_containers_upd", "AFTER UPDATE", "containers",
     _logged("new", "containers") + "; INSERT INTO changes(sandbox_id, key) SELECT"
     " old.sandbox_id, 'containers' WHERE old.sandbox_id IS NOT new.sandbox_id"),
    ("changes_containers_del", "AFTER DELETE", "containers", _logged("old", "containers")),
    ("changes_threads_ins", "AFTER INSERT", "threads", _logged("new", "threads")),
    ("changes_threads_upd", "AFTER UPDATE", "threads", _logged("new", "threads")),
    ("changes_threads_del", "AFTER DELETE", "threads", _logged("old", "threads")),
    ("changes_allocations_ins", "AFTER INSERT", "allocations", _logged("new", ALLOCATIONS)),
    ("changes_allocations_upd", "AFTER UPDATE", "allocations", _logged("new", ALLOCATIONS)),
    ("changes_allocations_del", "AFTER DELETE", "allocations", _logged("old", ALLOCATIONS)),
    ("changes_meta_ins", "AFTER INSERT", "meta", _KEY.format("new")),
    ("changes_meta_upd", "AFTER UPDATE", "meta", _KEY.format("new")),
    ("changes_meta_del", "AFTER DELETE", "meta", _KEY.format("old")),
)  # fmt: skip


def create(db: sqlite3.Connection) -> None:
    """The triggers (the table is in :data:`SCHEMA`), inside the caller's transaction; an
    older schema's are replaced."""
    for name in _RETIRED:
        db.execute(f"DROP TRIGGER IF EXISTS {name}")
    for name, when, table, body in _TRIGGERS:
        db.execute(f"DROP TRIGGER IF EXISTS {name}")
        db.execute(f"CREATE TRIGGER {name} {when} ON {table} BEGIN {body}{_TRIM}; END")


def rebuild(db: sqlite3.Connection) -> None:
    """The log of a schema 4-6 store (``seq`` AUTOINCREMENT) made again as schema 7's, its rows
    and its top kept, inside the caller's transaction, before :func:`create`: a reader that
    follows it from a ``seq`` read before goes on from there.  A no-op for any other."""
    row = db.execute("SELECT sql FROM sqlite_master WHERE name = 'changes'").fetchone()
    if row is None or "AUTOINCREMENT" not in row[0].upper():
        return
    # (the triggers name the table: SQLite's rename checks them, so they go first)
    for (name,) in db.execute(
        "SELECT name FROM sqlite_master WHERE type = 'trigger' AND name LIKE 'changes!_%'"
        " ESCAPE '!'"
    ).fetchall():
        db.execute(f"DROP TRIGGER {name}")
    last = db.execute("SELECT seq FROM sqlite_sequence WHERE name = 'changes'").fetchone()
    db.execute("ALTER TABLE changes RENAME TO changes_autoincrement")
    db.execute(SCHEMA)
    db.execute("INSERT INTO changes SELECT seq, sandbox_id, key FROM changes_autoincrement")
    db.execute("DROP TABLE changes_autoincrement")
    if last is not None and last[0] > top(db):
        # the last seq handed out, its row gone (nothing vmpin does): kept as a row that
        # names nothing, so that no seq is handed out twice
        db.execute("INSERT INTO changes(seq) VALUES (?)", (last[0],))


class Delta:
    """What moved between two points of the log: sandbox ids (with the tables of theirs that
    were written), meta keys, and whether the allocations table was written."""

    __slots__ = ("allocations", "done", "keys", "sandboxes", "tables", "top")

    def __init__(
        self,
        top: int,
        keys: set[str],
        tables: dict[str, set[str]] | None = None,
        allocations: bool = False,
        done: dict[str, int] | None = None,
    ) -> None:
        self.top = top
        self.keys = keys
        #: each moved sandbox's tables written (of :data:`TABLES`; :data:`DONE`: its
        #: ``done_gen`` alone, to the value in :attr:`done`)
        self.tables: dict[str, set[str]] = tables if tables is not None else {}
        #: the ``done_gen`` written last, of each sandbox that names :data:`DONE`
        self.done: dict[str, int] = done if done is not None else {}
        self.sandboxes: set[str] = set(self.tables)
        #: a row of the allocations table was written (:data:`ALLOCATIONS`)
        self.allocations = allocations


#: :func:`top` of a database without the log (an older schema a read-only view opened)
NO_LOG = -1


def top(db: sqlite3.Connection) -> int:
    """The last ``seq`` handed out (0: none yet; :data:`NO_LOG`): read it *before* reading
    the tables whole, and every change after the read is in :func:`since` of it."""
    from vmpin.state.sqlite import sqlite3 as module

    try:
        row = db.execute("SELECT max(seq) FROM changes").fetchone()
    except module.OperationalError:  # no log at all: schema 3 or older
        return NO_LOG
    return int(row[0]) if row[0] is not None else 0


def since(db: sqlite3.Connection, seq: int) -> Delta | None:
    """What changed after ``seq`` (a :func:`top` or a Delta's ``top``); None when the log no
    longer holds all of it (the reader then reads the tables whole).

    One statement: the rows from ``seq`` on, its own row first.  That row still there says
    the log reaches back that far (it is trimmed oldest first, and only once rows newer than
    it were logged, which come along); gone, it was trimmed, and what came between may be
    too.  ``seq`` 0 (nothing logged yet when it was read) has no row: then the first row must
    be the first ever logged."""
    if seq == NO_LOG:
        return None
    from vmpin.state.sqlite import sqlite3 as module

    try:
        rows = db.execute(
            "SELECT seq, sandbox_id, key FROM changes WHERE seq >= ? ORDER BY seq", (seq,)
        ).fetchall()
    except module.OperationalError:  # no log at all: schema 3 or older
        return None
    if seq:
        if not rows:
            # (its row gone and none after it: the newest row deleted, which vmpin never
            # does; read whole once, the reader then follows from the top it reads anew)
            return None
        if rows[0][0] != seq:
            return None  # trimmed past it (or another database at this path)
        del rows[0]
    elif rows and rows[0][0] != 1:
        return None
    if not rows:
        return Delta(seq, set())
    tables: dict[str, set[str]] = {}
    keys: set[str] = set()
    done: dict[str, int] = {}
    allocations = False
    for _, sid, key in rows:
        if sid is not None:
            if key == ALLOCATIONS:
                allocations = True
                continue
            named = tables.get(sid)
            if named is None:
                named = tables[sid] = set()
            if key is None:
                named.update(TABLES)  # (schema 4's row: any of them)
            elif key.startswith(DONE):
                named.add(DONE)
                done[sid] = int(key[len(DONE) :])  # (the rows in order: the last one's)
            else:
                named.add(key)
        elif key is not None:
            keys.add(key)
    return Delta(int(rows[-1][0]), keys, tables, allocations, done)
