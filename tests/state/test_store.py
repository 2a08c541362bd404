"""The SQLite store: round trips, generations, deletes, schema guard, and many writers at once."""

from __future__ import annotations

import multiprocessing
import os
import sqlite3
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from vmpin.core.cpuset import CpuSet
from vmpin.core.errors import IdError, StateError
from vmpin.state.records import ContainerRec, SandboxRec, ThreadRec
from vmpin.state.schema import SCHEMA_VERSION
from vmpin.state.store import Store


@pytest.fixture
def store(state_dir: Path) -> Iterator[Store]:
    with Store(str(state_dir)) as s:
        yield s


def _plain(rec: ContainerRec | SandboxRec) -> ContainerRec | SandboxRec:
    """A record without its timestamps, which the store sets."""
    return rec._replace(created_at=0.0, updated_at=0.0)


def _gen(store: Store, sandbox_id: str) -> tuple[int, int]:
    rec = store.sandbox(sandbox_id)
    assert rec is not None
    return rec.gen, rec.done_gen


FULL_CONTAINER = ContainerRec(
    id="c1",
    sandbox_id="sb1",
    is_sandbox=False,
    name="app",
    pod_uid="8c5f0e4e-1f4a-4f55-9a53-2b6cfb3c9e1d",
    pod_name="web-0",
    pod_namespace="prod",
    cpus=CpuSet.parse("2-3,56-57"),
    cpus_source="spec",
    mems="0",
    bundle="/run/containerd/k8s.io/c1",
    pid=4242,
    pid_start=123456789,
    cgroup="/kubepods/pod8c5f/c1",
    runtime_seen="2-3,56-57",
    kubelet_seen="2-3,56-57",
)

CONTAINERS = [
    ("every field", FULL_CONTAINER),
    ("no cpus", ContainerRec("c1", "sb1", False)),
    ("empty cpus", ContainerRec("c1", "sb1", False, cpus=CpuSet())),
    ("sandbox container", ContainerRec("sb1", "sb1", True, cpus=CpuSet([0]))),
    ("high cpus", ContainerRec("c1", "sb1", False, cpus=CpuSet([0, 8191]))),
]


@pytest.mark.parametrize(("what", "rec"), CONTAINERS, ids=[c[0] for c in CONTAINERS])
def test_container_round_trip(store: Store, what: str, rec: ContainerRec) -> None:
    store.put_sandbox(SandboxRec("sb1", "kata"))
    store.put_container(rec)
    got = store.container(rec.id)
    assert got is not None
    assert _plain(got) == rec
    assert got.created_at > 0 and got.updated_at >= got.created_at
    assert store.containers() == [got]
    assert store.containers("sb1") == [got]
    assert store.containers("other") == []


def test_container_survives_reopen(state_dir: Path) -> None:
    with Store(str(state_dir)) as s:
        s.put_sandbox(SandboxRec("sb1", "kata"))
        s.put_container(FULL_CONTAINER)
    with Store(str(state_dir)) as s:
        got = s.container("c1")
        assert got is not None and _plain(got) == FULL_CONTAINER
        assert s.container_by_bundle("/run/containerd/k8s.io/c1") == got
        assert s.container_by_bundle("/elsewhere") is None
        assert s.container("nope") is None


def test_put_container_replaces_and_keeps_created_at(store: Store) -> None:
    store.put_sandbox(SandboxRec("sb1", "kata"))
    store.put_container(FULL_CONTAINER)
    first = store.container("c1")
    assert first is not None
    store.put_container(FULL_CONTAINER._replace(cpus=CpuSet([9]), name="renamed"))
    second = store.container("c1")
    assert second is not None
    assert (second.cpus, second.name) == (CpuSet([9]), "renamed")
    assert second.created_at == first.created_at
    assert len(store.containers()) == 1


def test_sandbox_round_trip(store: Store) -> None:
    rec = SandboxRec(
        "sb1", "kata", vmm_pid=100, vmm_start=5, pod_uid="u", pod_name="p", pod_namespace="ns"
    )
    store.put_sandbox(rec)
    got = store.sandbox("sb1")
    assert got is not None
    assert _plain(got) == rec._replace(gen=1, done_gen=0)
    assert got.dirty
    assert store.sandboxes() == [got]
    assert store.sandbox("nope") is None


def test_put_sandbox_again_keeps_known_fields(store: Store) -> None:
    store.put_sandbox(SandboxRec("sb1", "kata", vmm_pid=100, vmm_start=5, pod_uid="u"))
    # A later hook that does not know the VMM (poststart) must not erase it.
    store.put_sandbox(SandboxRec("sb1", "kata-qemu"))
    got = store.sandbox("sb1")
    assert got is not None
    assert (got.runtime, got.vmm_pid, got.vmm_start, got.pod_uid, got.gen) == (
        "kata-qemu",
        100,
        5,
        "u",
        2,
    )
    store.set_vmm("sb1", None, None)
    got = store.sandbox("sb1")
    assert got is not None and (got.vmm_pid, got.vmm_start) == (None, None)


def test_sandboxes_sorted(store: Store) -> None:
    for sid in ("c", "a", "b"):
        store.put_sandbox(SandboxRec(sid, "runc"))
    assert [s.id for s in store.sandboxes()] == ["a", "b", "c"]
    assert [d[0] for d in store.dirty()] == ["a", "b", "c"]


def test_tracked_counts_what_the_records_say(store: Store) -> None:
    """The agent's gauges read two aggregates; they agree with the whole records."""
    store.put_sandbox(SandboxRec("k1", "kata"))
    store.put_sandbox(SandboxRec("r1", "runc"))
    store.put_sandbox(SandboxRec("empty", "kata"))
    for cid, sid in (("k1", "k1"), ("k1-a", "k1"), ("k1-b", "k1"), ("r1", "r1")):
        store.put_container(ContainerRec(cid, sid, cid == sid))
    counts: dict[str, int] = {}
    for c in store.containers():
        counts[c.sandbox_id] = counts.get(c.sandbox_id, 0) + 1
    expected = {s.id: (s.runtime, counts.get(s.id, 0)) for s in store.sandboxes()}
    assert store.tracked() == expected == {
        "k1": ("kata", 3), "r1": ("runc", 1), "empty": ("kata", 0)}  # fmt: skip


# -- generations -------------------------------------------------------------------------------


def test_generations_and_dirty(store: Store) -> None:
    store.put_sandbox(SandboxRec("sb1", "kata"))
    store.put_sandbox(SandboxRec("sb2", "runc"))
    assert _gen(store, "sb1") == (1, 0)
    assert store.dirty() == [("sb1", 1), ("sb2", 1)]

    store.mark_done("sb1", 1)
    assert store.dirty() == [("sb2", 1)]
    assert not store.sandbox("sb1").dirty  # type: ignore[union-attr]

    store.put_container(ContainerRec("c1", "sb1", False, cpus=CpuSet([1])))
    assert _gen(store, "sb1") == (2, 1)
    rec = store.set_container_cpus("c1", CpuSet([2, 3]), "update", runtime_seen="2-3")
    assert (rec.cpus, rec.cpus_source, rec.runtime_seen) == (CpuSet([2, 3]), "update", "2-3")
    assert _gen(store, "sb1") == (3, 1)
    assert store.dirty() == [("sb1", 3), ("sb2", 1)]

    # A reconcile that planned from gen 2 leaves the sandbox dirty: gen 3 came after.
    store.mark_done("sb1", 2)
    assert store.dirty() == [("sb1", 3), ("sb2", 1)]
    store.mark_done("sb1", 3)
    assert store.dirty() == [("sb2", 1)]

    # done_gen never moves back (a slow, older reconcile finishing late).
    store.mark_done("sb1", 1)
    assert _gen(store, "sb1") == (3, 3)

    store.mark_dirty(["sb1"])
    assert _gen(store, "sb1") == (4, 3)
    store.mark_done("sb1", 4)
    store.mark_done("sb2", 1)
    assert store.dirty() == []

    store.mark_dirty()  # after an agent restart: everything
    assert store.dirty() == [("sb1", 5), ("sb2", 2)]


def test_set_cpus_to_none(store: Store) -> None:
    store.put_sandbox(SandboxRec("sb1", "kata"))
    store.put_container(ContainerRec("c1", "sb1", False, cpus=CpuSet([1])))
    rec = store.set_container_cpus("c1", None, "kubelet", kubelet_seen="")
    assert (rec.cpus, rec.cpus_source, rec.kubelet_seen) == (None, "kubelet", "")


def test_note_seen_does_not_dirty(store: Store) -> None:
    store.put_sandbox(SandboxRec("sb1", "kata"))
    store.put_container(ContainerRec("c1", "sb1", False, cpus=CpuSet([1])))
    store.mark_done("sb1", 2)
    store.note_seen("c1", runtime_seen="1", cgroup="/kubepods/c1")
    got = store.container("c1")
    assert got is not None and (got.runtime_seen, got.cgroup, got.cpus) == (
        "1",
        "/kubepods/c1",
        CpuSet([1]),
    )
    assert store.dirty() == []
    with pytest.raises(ValueError):
        store.note_seen("c1", cpus="2")
    with pytest.raises(ValueError):
        store.note_seen("c1")


def test_restore_is_a_compare_and_swap_on_the_write(state_dir: Path, store: Store) -> None:
    """An undo puts the old set back only while the store holds the write it undoes: not
    after another writer's, even one that wrote the same set (issue 26)."""
    store.put_sandbox(SandboxRec("sb1", "kata"))
    store.put_container(ContainerRec("c1", "sb1", False, cpus=CpuSet([0])))
    mine = store.set_container_cpus("c1", CpuSet([1]), "update")
    with Store(str(state_dir)) as other:  # another update, acknowledged meanwhile
        theirs = other.set_container_cpus("c1", CpuSet([1]), "update")
    assert theirs.updated_at > mine.updated_at  # (a later stamp, the same clock tick or not)
    gen = _gen(store, "sb1")
    assert not store.restore_container_cpus(mine, CpuSet([0]), "spec")
    got = store.container("c1")
    assert got is not None and (got.cpus, got.cpus_source) == (CpuSet([1]), "update")
    assert _gen(store, "sb1") == gen  # nothing written, nothing to re-plan
    # undoing the last write does put the old set back, and re-plans the sandbox
    assert store.restore_container_cpus(theirs, CpuSet([0]), "spec")
    got = store.container("c1")
    assert got is not None and (got.cpus, got.cpus_source) == (CpuSet([0]), "spec")
    assert _gen(store, "sb1")[0] == gen[0] + 1
    assert not store.restore_container_cpus(theirs, CpuSet([0]), "spec")  # (once)


def test_every_write_of_a_container_leaves_a_later_stamp(store: Store) -> None:
    store.put_sandbox(SandboxRec("sb1", "kata"))
    store.put_container(ContainerRec("c1", "sb1", False, cpus=CpuSet([0])))
    stamps = []
    for _ in range(50):
        stamps.append(store.set_container_cpus("c1", CpuSet([1]), "update").updated_at)
        store.put_container(ContainerRec("c1", "sb1", False, cpus=CpuSet([1])))
        got = store.container("c1")
        assert got is not None
        stamps.append(got.updated_at)
    assert stamps == sorted(set(stamps))


def test_set_cpus_unknown_container(store: Store) -> None:
    with pytest.raises(StateError, match="unknown container"):
        store.set_container_cpus("nope", CpuSet([1]), "update")


def test_set_cpus_unknown_column(store: Store) -> None:
    store.put_sandbox(SandboxRec("sb1", "kata"))
    store.put_container(ContainerRec("c1", "sb1", False))
    with pytest.raises(ValueError, match="unknown columns"):
        store.set_container_cpus("c1", CpuSet([1]), "update", cgroup="x")


# -- deletes -----------------------------------------------------------------------------------


def _pod(store: Store) -> None:
    """Sandbox sb1 (its pause container and two app containers), and sandbox sb2 beside it."""
    store.put_sandbox(SandboxRec("sb1", "kata"))
    store.put_container(ContainerRec("sb1", "sb1", True))
    store.put_container(ContainerRec("c1", "sb1", False, cpus=CpuSet([2, 3])))
    store.put_container(ContainerRec("c2", "sb1", False, cpus=CpuSet([4, 5])))
    store.save_threads("sb1", 100, 7, [ThreadRec(101, "vcpu", 0, "CPU 0/KVM", "qmp")])
    store.put_sandbox(SandboxRec("sb2", "runc"))
    store.put_container(ContainerRec("d1", "sb2", False, cpus=CpuSet([6])))


def test_delete_sandbox_container_removes_sandbox(store: Store) -> None:
    _pod(store)
    gone = store.delete_container("sb1")
    assert gone is not None and gone.is_sandbox
    assert store.sandbox("sb1") is None
    assert store.containers("sb1") == []
    assert store.threads("sb1", 100, 7) == {}
    # The neighbour is untouched.
    assert store.sandbox("sb2") is not None
    assert [c.id for c in store.containers()] == ["d1"]


def test_delete_member_bumps_then_last_removes_sandbox(store: Store) -> None:
    _pod(store)
    store.delete_container("sb1")  # drop the pause container: a pod of members only
    store.put_sandbox(SandboxRec("sb1", "kata"))
    store.put_container(ContainerRec("c1", "sb1", False, cpus=CpuSet([2, 3])))
    store.put_container(ContainerRec("c2", "sb1", False, cpus=CpuSet([4, 5])))
    gen, _ = _gen(store, "sb1")
    store.mark_done("sb1", gen)

    assert store.delete_container("c1") is not None
    # Its sandbox's mask shrinks: dirty again.
    assert _gen(store, "sb1") == (gen + 1, gen)
    assert [c.id for c in store.containers("sb1")] == ["c2"]

    assert store.delete_container("c2") is not None
    assert store.sandbox("sb1") is None
    assert store.sandbox("sb2") is not None


def test_delete_member_keeps_sandbox_while_pause_lives(store: Store) -> None:
    _pod(store)
    store.delete_container("c1")
    store.delete_container("c2")
    assert store.sandbox("sb1") is not None
    assert [c.id for c in store.containers("sb1")] == ["sb1"]


def test_delete_unknown(store: Store) -> None:
    assert store.delete_container("nope") is None


def test_delete_sandbox(store: Store) -> None:
    _pod(store)
    store.delete_sandbox("sb1")
    assert store.sandbox("sb1") is None
    assert store.containers("sb1") == []
    assert store.threads("sb1", 100, 7) == {}
    assert store.sandbox("sb2") is not None


# -- threads and meta -------------------------------------------------------------------------


def test_threads_keyed_by_vmm(store: Store) -> None:
    threads = [
        ThreadRec(101, "vcpu", 0, "CPU 0/KVM", "qmp"),
        ThreadRec(102, "vcpu", 1, None, "kvm-debugfs"),
        ThreadRec(103, "iothread", None, "io0", "qmp"),
        ThreadRec(104, "emulator", None, None, "default"),
    ]
    store.save_threads("sb1", 100, 7, threads)
    assert store.threads("sb1", 100, 7) == {t.tid: t for t in threads}
    # Same pid, another start time: a reused pid is another VMM.
    assert store.threads("sb1", 100, 8) == {}
    store.save_threads("sb1", 100, 7, threads[:1])
    assert list(store.threads("sb1", 100, 7)) == [101]


def test_rows_read_share_their_repeated_strings(store: Store) -> None:
    """The agent keeps every row read between passes (issue 14's RSS budget): a sandbox id,
    pod, namespace, role or label read many times is one string, not one per row."""
    uid, ns = "8c5f0e4e-1f4a-4f55-9a53-2b6cfb3c9e1d", "prod"
    for sid in ("sb1", "sb2"):
        store.put_sandbox(SandboxRec(sid, "kata", pod_uid=uid, pod_namespace=ns))
        for cid in (sid, f"{sid}-app"):
            store.put_container(
                ContainerRec(cid, sid, cid == sid, name="app", pod_uid=uid, pod_namespace=ns,
                             cpus_source="spec", mems="0")
            )  # fmt: skip
        store.save_threads(sid, 100, 7, [ThreadRec(t, "vcpu", t, f"CPU {t}/KVM", "qmp")
                                         for t in (0, 1)])  # fmt: skip
    store.set_meta("orig-affinity:a", "0-63")
    store.set_meta("orig-affinity:b", "0-63")
    ctrs = store.containers()
    sbs = store.sandboxes()
    for field in ("sandbox_id", "pod_uid", "pod_namespace", "name", "cpus_source", "mems"):
        first = getattr(ctrs[0], field)
        assert len({id(getattr(c, field)) for c in ctrs if getattr(c, field) == first}) == 1, field
    assert {id(s.pod_uid) for s in sbs} == {id(ctrs[0].pod_uid)}
    # the same across tables: the sandbox's own id, its containers' sandbox_id, its threads' key
    threads = store.all_threads()
    assert sbs[0].id is ctrs[0].sandbox_id is next(k for k in threads if k[0] == "sb1")[0]
    recs = [t for by_tid in threads.values() for t in by_tid.values()]
    assert len({id(t.role) for t in recs}) == len({id(t.layer) for t in recs}) == 1
    assert len({id(t.label) for t in recs}) == 2  # "CPU 0/KVM" and "CPU 1/KVM", each shared
    (_, a), (_, b) = store.meta_prefix("orig-affinity:")
    assert a is b


def test_page_cache_is_bounded(state_dir: Path) -> None:
    """Every connection caches CACHE_KIB of pages, not SQLite's 2,000 KiB default: the agent
    holds three for its life (issue 14's RSS budget), and the read-only one of commands."""
    from vmpin.state.schema import CACHE_KIB

    with Store(str(state_dir)) as s:
        assert s.db.execute("PRAGMA cache_size").fetchone()[0] == -CACHE_KIB
    ro = Store.open_readonly(str(state_dir))
    try:
        assert ro.db.execute("PRAGMA cache_size").fetchone()[0] == -CACHE_KIB
    finally:
        ro.close()


def test_meta(store: Store) -> None:
    assert store.meta("k") is None
    store.set_meta("k", "v")
    store.set_meta("k", "w")
    assert store.meta("k") == "w"


def test_transaction_rolls_back(store: Store) -> None:
    store.put_sandbox(SandboxRec("sb1", "kata"))
    with pytest.raises(RuntimeError), store.transaction() as db:
        db.execute("DELETE FROM sandboxes")
        raise RuntimeError("boom")
    assert store.sandbox("sb1") is not None


# -- the file ----------------------------------------------------------------------------------


def test_wal_mode(store: Store) -> None:
    with sqlite3.connect(store.path) as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


def test_file_modes(tmp_path: Path) -> None:
    state = tmp_path / "new" / "state"
    old = os.umask(0o022)
    try:
        with Store(str(state)) as s:
            s.put_sandbox(SandboxRec("sb1", "kata"))
            assert stat.S_IMODE(os.stat(s.path).st_mode) == 0o600
            # SQLite gives its -wal and -shm files the database file's mode.
            for suffix in ("-wal", "-shm"):
                assert stat.S_IMODE(os.stat(s.path + suffix).st_mode) == 0o600, suffix
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(state).st_mode) == 0o700


def test_schema_too_new(state_dir: Path) -> None:
    Store(str(state_dir)).close()
    with sqlite3.connect(state_dir / "state.db") as db:
        db.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    with pytest.raises(StateError, match="newer"):
        Store(str(state_dir))


def test_state_dir_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    with pytest.raises(StateError):
        Store(str(tmp_path / "f"))


BAD_IDS = ["../x", "..", ".", ".hidden", "a/b", "", "a b", "a\n", "x" * 1025]


@pytest.mark.parametrize("bad", BAD_IDS, ids=repr)
def test_invalid_ids_rejected(store: Store, bad: str) -> None:
    store.put_sandbox(SandboxRec("sb1", "kata"))
    with pytest.raises(IdError):
        store.put_container(ContainerRec(bad, "sb1", False))
    with pytest.raises(IdError):
        store.put_container(ContainerRec("c1", bad, False))
    with pytest.raises(IdError):
        store.put_sandbox(SandboxRec(bad, "kata"))
    assert [s.id for s in store.sandboxes()] == ["sb1"]
    assert store.containers() == []


# -- many writers --------------------------------------------------------------------------------

WRITERS = 50
SANDBOXES = 5
UPDATES = 5


def _final_cpus(i: int) -> CpuSet:
    return CpuSet([i, 100 + UPDATES - 1])


def _writer(state_dir: str, i: int, go: multiprocessing.synchronize.Event) -> None:
    # Every process opens its own Store, as every hook does; all start at once on a fresh
    # state dir, so schema creation races too.
    go.wait(60)
    sid = f"sb{i % SANDBOXES}"
    with Store(state_dir) as s:
        s.put_sandbox(SandboxRec(sid, "kata"))
        s.put_container(ContainerRec(f"c{i}", sid, False, cpus=CpuSet([i])))
        for k in range(UPDATES):
            s.set_container_cpus(f"c{i}", CpuSet([i, 100 + k]), "update")


def _opener(state_dir: str, go: multiprocessing.synchronize.Event) -> None:
    go.wait(60)
    with Store(state_dir) as s:
        s.put_sandbox(SandboxRec("sb1", "kata"))


def test_concurrent_first_open() -> None:
    """Hooks racing to open a fresh database and write: switching it to WAL must not fail any.

    SQLite answers a lost race for the WAL switch with "database is locked" at once; without
    the store's retry about one round in ten fails here.
    """
    ctx = multiprocessing.get_context("fork")
    for round_ in range(6):
        with tempfile.TemporaryDirectory() as tmp:
            state_dir = os.path.join(tmp, "state")
            go = ctx.Event()
            procs = [ctx.Process(target=_opener, args=(state_dir, go)) for _ in range(WRITERS)]
            for p in procs:
                p.start()
            go.set()
            for p in procs:
                p.join(120)
            assert [p.exitcode for p in procs] == [0] * WRITERS, f"round {round_}"
            with Store(state_dir) as s:
                assert s.dirty() == [("sb1", WRITERS)]
            with sqlite3.connect(os.path.join(state_dir, "state.db")) as db:
                assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_concurrent_writer_processes(tmp_path: Path) -> None:
    state_dir = str(tmp_path / "state")
    ctx = multiprocessing.get_context("fork")
    go = ctx.Event()
    procs = [ctx.Process(target=_writer, args=(state_dir, i, go)) for i in range(WRITERS)]
    for p in procs:
        p.start()
    go.set()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0] * WRITERS

    with Store(state_dir) as s:
        containers = {c.id: c for c in s.containers()}
        assert set(containers) == {f"c{i}" for i in range(WRITERS)}
        for i in range(WRITERS):
            rec = containers[f"c{i}"]
            assert rec.cpus == _final_cpus(i), rec
            assert rec.sandbox_id == f"sb{i % SANDBOXES}"
        # No increment lost either: each write bumped its sandbox's generation once
        # (the first put_sandbox creates it at gen 1).
        per_sandbox = WRITERS // SANDBOXES
        expected_gen = per_sandbox * (1 + 1 + UPDATES)
        assert s.dirty() == [(f"sb{j}", expected_gen) for j in range(SANDBOXES)]


@pytest.mark.parametrize("name", ["a b", "q?x#y", "p%41", "é", "tab\tnl"])
def test_read_only_open_of_an_awkward_path(tmp_path: Path, name: str) -> None:
    """The read-only open names the file as an SQLite URI: ?, #, % and the rest are escaped
    (a path read as a query or a fragment would open another file, or none)."""
    state = tmp_path / name
    with Store(str(state)) as s:
        s.put_sandbox(SandboxRec("sb1", "kata"))
    ro = Store.open_readonly(str(state))
    try:
        assert [r.id for r in ro.sandboxes()] == ["sb1"]
    finally:
        ro.close()


def test_policy_inputs_are_recorded_with_source_and_time(store: Store) -> None:
    """Every policy input lives in the store (issue 25): the specs' per sandbox, the API's per
    pod uid, each with when it was recorded; an older vmpin's bare map still reads."""
    from vmpin.state.records import API_POLICY_META, POLICY_META

    store.set_meta(POLICY_META + "old", '{"vmpin.io/vcpus": "float"}')  # before issue 25
    store.set_meta(POLICY_META + "edited", "{not json")
    store.record_api_policies({"uid-a": {"vmpin.io/vcpus": "none"}, "uid-b": {}})
    oci, api = store.policy_records()
    assert oci["old"].annotations == {"vmpin.io/vcpus": "float"} and oci["old"].at is None
    assert oci["edited"].annotations == {}  # a hand edit: the node's policy, not a crash
    assert api["uid-a"].annotations == {"vmpin.io/vcpus": "none"} and api["uid-a"].source == "api"
    assert api["uid-a"].at is not None and api["uid-b"].annotations == {}
    store.record_api_policies({"uid-a": None})
    assert set(store.policy_records()[1]) == {"uid-b"}
    assert store.meta(API_POLICY_META + "uid-a") is None
    with pytest.raises(IdError):  # a pod uid is checked as any id the store keeps
        store.record_api_policies({"../../x": {}})
    assert set(store.policy_records()[1]) == {"uid-b"}  # and nothing was written
