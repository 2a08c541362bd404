"""The store's change log (vmpin.state.changes) and the tables a long-lived observer follows
through it (vmpin.reconcile.tables): whoever writes, the tables followed are the tables read
whole (issue 28: an event's pass read every table whole to learn that one sandbox moved)."""

from __future__ import annotations

from pathlib import Path

from vmpin.core.cpuset import CpuSet
from vmpin.reconcile.observation import FULL, VmmKey
from vmpin.reconcile.tables import Tables
from vmpin.state import changes
from vmpin.state.schema import SCHEMA_VERSION
from vmpin.state.store import ContainerRec, SandboxRec, Store, ThreadRec


def _sandbox(store: Store, sid: str, cpus: str = "0") -> None:
    store.put_sandbox(SandboxRec(sid, "kata"))
    store.put_container(ContainerRec(sid, sid, True, name="pause"))
    store.put_container(ContainerRec(f"{sid}-app", sid, False, name="app", cpus=CpuSet.parse(cpus)))


def _whole(t: Tables) -> tuple[object, ...]:
    recorded, records, policies = t.current()
    return (
        dict(recorded.containers), dict(recorded.threads), dict(recorded.missing),
        dict(recorded.originals), list(records), policies,
    )  # fmt: skip


def test_every_write_names_its_sandbox_or_key(tmp_path: Path) -> None:
    with Store(str(tmp_path)) as store, Store(str(tmp_path)) as other:
        _sandbox(store, "a")
        _sandbox(store, "b")
        seq = changes.top(store.db)
        assert changes.since(store.db, seq).sandboxes == set()  # type: ignore[union-attr]
        other.set_container_cpus("b-app", CpuSet.parse("1"), "update")
        other.save_threads("a", 10, 20, [ThreadRec(11, "vcpu", 0, "CPU 0/KVM", "names")])
        other.set_meta(VmmKey("a", 10, 20).orig(11), "0-1")
        other.note_seen("b-app", runtime_seen="1")
        delta = changes.since(store.db, seq)
        assert delta is not None
        assert delta.sandboxes == {"a", "b"}
        assert delta.keys == {VmmKey("a", 10, 20).orig(11)}
        # a container written again under another sandbox: both sandboxes moved
        seq = delta.top
        other.put_container(ContainerRec("b-app", "a", False, name="app"))
        delta = changes.since(store.db, seq)
        assert delta is not None and delta.sandboxes == {"a", "b"}


def test_a_reader_further_behind_than_the_log_keeps_reads_whole(tmp_path: Path) -> None:
    with Store(str(tmp_path)) as store:
        _sandbox(store, "a")
        seq = changes.top(store.db)
        with store.transaction():
            for i in range(2 * changes.KEEP + 10):
                store.set_meta(f"k{i}", "v")
        assert changes.since(store.db, seq) is None  # the log was kept short meanwhile
        rows = store.db.execute("SELECT count(*) FROM changes").fetchone()[0]
        assert changes.KEEP <= rows <= 2 * changes.KEEP
        recent = changes.top(store.db) - 5
        delta = changes.since(store.db, recent)
        assert delta is not None and len(delta.keys) == 5


def test_a_write_that_logs_no_row_trims_by_the_log_not_by_another_tables_rowid(
    tmp_path: Path,
) -> None:
    """A trigger that logs nothing (a container written again under the same sandbox: the
    moved trigger's select is empty) trims all the same; the log's own top decides what
    goes, not the last rowid the connection inserted elsewhere.  A container table whose
    rowids run far ahead of the log (a store older than its log) once wiped the log whole,
    its newest row too, and the next seq was handed out again: a reader at that seq would
    have taken another write's row for its own and missed what came between."""
    with Store(str(tmp_path)) as store:
        _sandbox(store, "a")
        store.db.execute("UPDATE containers SET rowid = 100000 WHERE id = 'a-app'")
        store.db.commit()
        store.put_container(ContainerRec("a-app", "a", False, name="app"))  # rowid 100001
        seq = changes.top(store.db)
        store.put_container(ContainerRec("a", "a", True, name="pause"))
        store.set_meta("k", "v")
        assert changes.top(store.db) > seq  # never handed out again
        delta = changes.since(store.db, seq)
        assert delta is not None and delta.sandboxes == {"a"} and delta.keys == {"k"}
    # a schema 7 store (that trim) has its triggers made again when a writer opens it
    with Store(str(tmp_path)) as store:
        store.db.execute("PRAGMA user_version=7")
        store.db.execute("DROP TRIGGER changes_containers_moved")
        store.db.execute(
            "CREATE TRIGGER changes_containers_moved BEFORE INSERT ON containers BEGIN"
            " DELETE FROM changes WHERE seq <= last_insert_rowid(); END"
        )
        store.db.commit()
    with Store(str(tmp_path)) as store:
        sql = store.db.execute(
            "SELECT sql FROM sqlite_master WHERE name = 'changes_containers_moved'"
        ).fetchone()[0]
        assert "last_insert_rowid" not in sql and "max(seq)" in sql


def test_tables_followed_are_the_tables_read_whole(tmp_path: Path) -> None:
    with Store(str(tmp_path)) as store, Store(str(tmp_path)) as other:
        with store.transaction():  # (40: six of them moving is within what is followed)
            for i in range(40):
                _sandbox(store, f"s{i:02d}", str(i % 2))
        store.save_threads("s00", 10, 20, [ThreadRec(11, "vcpu", 0, "CPU 0/KVM", "names")])
        store.set_meta(VmmKey("s00", 10, 20).orig(11), "0-1")
        followed = Tables(store, FULL)
        # another process: an update, a new sandbox, one forgotten, thread roles and
        # original affinities moved, a pod's policy recorded
        other.set_container_cpus("s01-app", CpuSet.parse("0-1"), "update")
        _sandbox(other, "s99")
        other.delete_sandbox("s02")
        other.save_threads("s00", 10, 20, [ThreadRec(12, "vcpu", 0, "CPU 0/KVM", "names")])
        other.delete_meta([VmmKey("s00", 10, 20).orig(11)])
        other.set_meta(VmmKey("s00", 10, 20).orig(12), "1")
        other.set_meta(VmmKey("s03", 30, 40).missing(), "1")
        other.set_meta("podpolicy:s04", '{"annotations": {"vmpin.io/vcpus": "float"}, "at": 1}')
        assert followed.follow(store.version())
        assert followed.moved == {"s00", "s01", "s02", "s03", "s04", "s99"}
        assert _whole(followed) == _whole(Tables(store, FULL))
        # nothing moved: nothing read again
        assert followed.follow(store.version())
        assert followed.moved == set()


def test_a_containers_update_logs_its_sandbox_once_and_a_move_both(tmp_path: Path) -> None:
    with Store(str(tmp_path)) as store:
        _sandbox(store, "a")
        _sandbox(store, "b")
        seq = changes.top(store.db)
        store.set_container_cpus("b-app", CpuSet.parse("1"), "update")
        rows = store.db.execute("SELECT sandbox_id, key FROM changes WHERE seq > ?", (seq,))
        # (and its sandbox's row: the generation an update bumps)
        assert sorted(rows.fetchall()) == [("b", "containers"), ("b", "sandboxes")]
        seq = changes.top(store.db)
        store.db.execute("UPDATE containers SET sandbox_id='a' WHERE id='b-app'")
        rows = store.db.execute("SELECT sandbox_id, key FROM changes WHERE seq > ?", (seq,))
        assert sorted(rows.fetchall()) == [("a", "containers"), ("b", "containers")]


def test_a_sandboxs_row_names_the_table_written(tmp_path: Path) -> None:
    with Store(str(tmp_path)) as store, Store(str(tmp_path)) as other:
        _sandbox(store, "a")
        _sandbox(store, "b")
        seq = changes.top(store.db)
        other.set_container_cpus("b-app", CpuSet.parse("1"), "update")
        other.save_threads("a", 10, 20, [ThreadRec(11, "vcpu", 0, "CPU 0/KVM", "names")])
        delta = changes.since(store.db, seq)
        assert delta is not None
        assert "containers" in delta.tables["b"] and "threads" not in delta.tables["b"]
        assert "threads" in delta.tables["a"] and "containers" not in delta.tables["a"]
        seq = delta.top
        other.mark_done("b", 1)
        delta = changes.since(store.db, seq)
        # (its done_gen alone: the value is in the log, the row need not be read again)
        assert delta is not None and delta.tables == {"b": {changes.DONE}}
        assert delta.done == {"b": 1}


def test_an_update_reads_its_sandboxs_row_and_containers_again_not_its_threads(
    tmp_path: Path,
) -> None:
    with Store(str(tmp_path)) as store, Store(str(tmp_path)) as other:
        _sandbox(store, "a")
        store.save_threads("a", 10, 20, [ThreadRec(11, "vcpu", 0, "CPU 0/KVM", "names")])
        followed = Tables(store, FULL)
        other.set_container_cpus("a-app", CpuSet.parse("0-1"), "update")
        sql: list[str] = []
        store.db.set_trace_callback(sql.append)
        try:
            assert followed.follow(store.version())  # (a one-sandbox node: followed too)
        finally:
            store.db.set_trace_callback(None)
        assert followed.moved == {"a"}
        assert not [s for s in sql if "FROM threads" in s or "FROM meta" in s], sql
        assert _whole(followed) == _whole(Tables(store, FULL))


def test_schema_4s_log_is_read_as_any_table_and_its_triggers_replaced(tmp_path: Path) -> None:
    with Store(str(tmp_path)) as store:
        _sandbox(store, "a")
        seq = changes.top(store.db)
        # what a schema-4 store holds: a trigger whose row names no table
        with store.transaction():
            store.db.execute("DROP TRIGGER changes_threads_ins")
            store.db.execute(
                "CREATE TRIGGER changes_threads_ins AFTER INSERT ON threads"
                " BEGIN INSERT INTO changes(sandbox_id) VALUES (new.sandbox_id); END"
            )
            store.db.execute("PRAGMA user_version=4")
        store.save_threads("a", 10, 20, [ThreadRec(11, "vcpu", 0, "CPU 0/KVM", "names")])
        delta = changes.since(store.db, seq)
        assert delta is not None and delta.tables == {"a": set(changes.TABLES)}
    with Store(str(tmp_path)) as store:  # (opened again: brought to this schema)
        assert store.db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        seq = changes.top(store.db)
        store.save_threads("a", 10, 20, [ThreadRec(12, "vcpu", 0, "CPU 0/KVM", "names")])
        delta = changes.since(store.db, seq)
        assert delta is not None and delta.tables == {"a": {"threads"}}


def test_the_allocations_table_logs_its_writes_apart_from_the_sandboxes(tmp_path: Path) -> None:
    from vmpin.state import allocations as table
    from vmpin.state.allocations import Allocation

    with Store(str(tmp_path)) as store, Store(str(tmp_path)) as other:
        _sandbox(store, "a")
        seq = changes.top(store.db)
        row = Allocation("a", None, CpuSet.parse("1"), 1, "vmpin.io/exclusive-cpus=1", None, 1, 1)
        with other.transaction() as db:
            table.write(db, [row], [])
        delta = changes.since(store.db, seq)
        # (the sandbox's own records did not move: a pass follows no table of it again)
        assert delta is not None and delta.allocations and delta.tables == {}
        assert changes.since(store.db, delta.top).allocations is False  # type: ignore[union-attr]
        with other.transaction() as db:
            table.write(db, [], ["a"])
        assert changes.since(store.db, delta.top).allocations is True  # type: ignore[union-attr]


def test_the_log_is_read_in_one_statement(tmp_path: Path) -> None:
    with Store(str(tmp_path)) as store, Store(str(tmp_path)) as other:
        _sandbox(store, "a")
        seq = changes.top(store.db)
        other.set_container_cpus("a-app", CpuSet.parse("1"), "update")
        sql: list[str] = []
        store.db.set_trace_callback(sql.append)
        try:
            delta = changes.since(store.db, seq)
            assert delta is not None and delta.tables == {"a": {"containers", "sandboxes"}}
            assert changes.since(store.db, delta.top).tables == {}  # type: ignore[union-attr]
        finally:
            store.db.set_trace_callback(None)
        assert len(sql) == 2, sql
    # a fresh log (nothing logged when its top was read), and one whose first rows are gone
    with Store(str(tmp_path / "fresh")) as store:
        assert changes.top(store.db) == 0
        assert changes.since(store.db, 0).sandboxes == set()  # type: ignore[union-attr]
        _sandbox(store, "a")
        assert changes.since(store.db, 0).sandboxes == {"a"}  # type: ignore[union-attr]
        last = changes.top(store.db)
        store.db.execute("DELETE FROM changes WHERE seq = 1")
        assert changes.since(store.db, 0) is None
        assert changes.since(store.db, 1) is None
        # the log's last row gone (nothing vmpin does): read whole once, then followed from
        # the top read anew
        store.db.execute("DELETE FROM changes WHERE seq = ?", (last,))
        assert changes.since(store.db, last) is None
        again = changes.top(store.db)
        assert again == last - 1
        store.set_meta("k", "v")
        assert changes.since(store.db, again).keys == {"k"}  # type: ignore[union-attr]


def test_a_schema_5_store_gains_the_allocations_triggers(tmp_path: Path) -> None:
    with Store(str(tmp_path)) as store, store.transaction():
        for when in ("ins", "upd", "del"):
            store.db.execute(f"DROP TRIGGER changes_allocations_{when}")
        store.db.execute("PRAGMA user_version=5")
    ro = Store.open_readonly(str(tmp_path))  # (a read-only view reads schema 5 as it is)
    ro.close()
    with Store(str(tmp_path)) as store:
        assert store.db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 8
        names = {r[0] for r in store.db.execute("SELECT name FROM sqlite_master")}
        assert {"changes_allocations_ins", "changes_allocations_del"} <= names


def test_a_pass_marking_a_sandbox_done_is_followed_without_reading_its_row(
    tmp_path: Path,
) -> None:
    """The last pass's own write of ``done_gen`` (issue 28: the next event's pass read the
    row of its sandbox again for it) logs its value; any other write of the row, with it
    or not, names the row as before."""
    from vmpin.state.records import SANDBOX_COLS

    assert [c for c in SANDBOX_COLS if c != "done_gen"] == list(changes._SANDBOX_BOOKS)
    with Store(str(tmp_path)) as store, Store(str(tmp_path)) as other:
        with store.transaction():  # (16: three moving is within what is followed)
            for i in range(16):
                _sandbox(store, f"s{i:02d}")
        followed = Tables(store, FULL)
        other.mark_done("s01", 1)
        sql: list[str] = []
        store.db.set_trace_callback(sql.append)
        try:
            assert followed.follow(store.version())
        finally:
            store.db.set_trace_callback(None)
        assert followed.moved == {"s01"}
        assert not [s for s in sql if "FROM sandboxes" in s], sql
        assert _whole(followed) == _whole(Tables(store, FULL))
        # done_gen with another column, or another column alone: the row read again
        other.db.execute("UPDATE sandboxes SET done_gen=5, vmm_pid=7 WHERE id='s02'")
        other.set_vmm("s03", 9, 10)
        other.mark_done("s04", 3)
        delta = changes.since(store.db, followed.seq)
        assert delta is not None and delta.tables == {
            "s02": {"sandboxes"}, "s03": {"sandboxes"}, "s04": {changes.DONE}}
        assert followed.follow(store.version())
        assert _whole(followed) == _whole(Tables(store, FULL))
        assert followed.records[followed._at["s04"]].done_gen == 3


#: schema 6's log and its trim, as a store of that schema holds them
_V6_LOG = (
    "CREATE TABLE changes (seq INTEGER PRIMARY KEY AUTOINCREMENT, sandbox_id TEXT, key TEXT)",
    "CREATE TRIGGER changes_meta_ins AFTER INSERT ON meta"
    " BEGIN INSERT INTO changes(key) VALUES (new.key); END",
    f"CREATE TRIGGER changes_keep_short AFTER INSERT ON changes WHEN new.seq % {changes.KEEP} = 0"
    f" BEGIN DELETE FROM changes WHERE seq <= new.seq - {changes.KEEP}; END",
)


def test_a_schema_6_log_is_made_again_with_its_rows_and_its_top(tmp_path: Path) -> None:
    """Schema 7: the log's seq is a plain rowid (AUTOINCREMENT read and wrote its
    sqlite_sequence row again for every row logged, issue 28); a schema-6 store is brought
    to it with its rows and its last seq, so that a reader goes on from a seq it read."""
    with Store(str(tmp_path)) as store, store.transaction() as db:
        for (name,) in db.execute(
            "SELECT name FROM sqlite_master WHERE type='trigger'"
        ).fetchall():
            db.execute(f"DROP TRIGGER {name}")
        db.execute("DROP TABLE changes")
        for statement in _V6_LOG:
            db.execute(statement)
        rows = [(1, "a", "sandboxes"), (2, None, "k")]
        db.executemany("INSERT INTO changes VALUES (?,?,?)", rows)
        # (the last seq handed out, its row gone: still never handed out again)
        db.execute("UPDATE sqlite_sequence SET seq = 5 WHERE name = 'changes'")
        db.execute("PRAGMA user_version=6")
    with Store(str(tmp_path)) as store:
        db = store.db
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 8
        sql = db.execute("SELECT sql FROM sqlite_master WHERE name='changes'").fetchone()[0]
        assert "AUTOINCREMENT" not in sql.upper()
        names = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='trigger'")}
        assert "changes_keep_short" not in names and "changes_meta_ins" in names
        rows = db.execute("SELECT seq, sandbox_id, key FROM changes ORDER BY seq").fetchall()
        assert rows == [(1, "a", "sandboxes"), (2, None, "k"), (5, None, None)]
        assert changes.top(db) == 5
        delta = changes.since(db, 1)
        assert delta is not None and delta.keys == {"k"} and delta.top == 5
        store.set_meta("k2", "v")
        delta = changes.since(db, 5)
        assert delta is not None and delta.keys == {"k2"} and delta.top == 6
        assert db.execute("SELECT count(*) FROM sqlite_sequence").fetchone()[0] == 0


def test_an_updates_commit_writes_its_rows_pages_and_the_logs_alone(tmp_path: Path) -> None:
    """What an update's commit appends to the WAL: the container's page, its sandbox's and
    the log's -- not ``sqlite_sequence``'s (schema 6: a fourth page, issue 28)."""
    import os

    with Store(str(tmp_path)) as store:
        _sandbox(store, "a")
        store.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        wal = os.path.join(str(tmp_path), "state.db-wal")
        store.set_container_cpus("a-app", CpuSet.parse("1"), "update")
        frame = 24 + store.db.execute("PRAGMA page_size").fetchone()[0]
        assert (os.path.getsize(wal) - 32) // frame == 3
