"""The hook's journal: events built at hook time, applied to the store exactly once, in order."""

from __future__ import annotations

import json
import multiprocessing
import os
from pathlib import Path
from typing import Any

import pytest

from vmpin.core.errors import SpecError
from vmpin.linux.paths import HostPaths
from vmpin.runtimes.oci import hook_event, parse_state
from vmpin.state.journal import append, append_unsynced, journal_dir, pending, sync
from vmpin.state.store import Store
from vmpin.wire.hookevent import HookEvent

ANN = {"io.kubernetes.cri.container-type": "container", "io.kubernetes.cri.sandbox-id": "pod"}


def bundle(tmp_path: Path, cid: str, cpus: str | None = "1") -> Path:
    b = tmp_path / "bundles" / cid
    b.mkdir(parents=True)
    spec: dict[str, object] = {"annotations": ANN}
    if cpus is not None:
        spec["linux"] = {"resources": {"cpu": {"cpus": cpus}}}
    (b / "config.json").write_text(json.dumps(spec))
    return b


def event(paths: HostPaths, stage: str, cid: str, b: Path) -> HookEvent:
    state = parse_state(json.dumps({"id": cid, "bundle": str(b), "annotations": ANN}))
    return hook_event(paths, stage, state)


def test_events_apply_in_order_and_once(paths: HostPaths, tmp_path: Path) -> None:
    b = bundle(tmp_path, "c1")
    for stage in ("prestart", "createRuntime", "poststart", "poststop"):
        append(paths.state_dir, event(paths, stage, "c1", b))
    b2 = bundle(tmp_path, "c2", "0")
    append(paths.state_dir, event(paths, "createRuntime", "c2", b2))
    assert len(pending(paths.state_dir)) == 5
    with Store(paths.state_dir) as store:  # opening ingests
        assert [c.id for c in store.containers()] == ["c2"]
        assert pending(paths.state_dir) == []
        assert store.ingest() == []


def test_bad_input_is_refused_at_hook_time(paths: HostPaths, tmp_path: Path) -> None:
    b = bundle(tmp_path, "c3", "9-2")
    with pytest.raises(SpecError, match=r"linux\.resources\.cpu\.cpus"):
        event(paths, "prestart", "c3", b)
    assert pending(paths.state_dir) == []


def test_unreadable_event_is_skipped_not_fatal(
    paths: HostPaths, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    os.makedirs(journal_dir(paths.state_dir))
    Path(journal_dir(paths.state_dir), "00000000000000000001-1.json").write_text("{broken")
    append(paths.state_dir, event(paths, "prestart", "c4", bundle(tmp_path, "c4")))
    with Store(paths.state_dir) as store:
        assert [c.id for c in store.containers()] == ["c4"]
    assert "unreadable" in capsys.readouterr().err
    assert pending(paths.state_dir) == []


def _ingest(state_dir: str, q: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    with Store(state_dir, ingest=False) as store:
        q.put(store.ingest())


def test_concurrent_ingest_applies_each_event_once(paths: HostPaths, tmp_path: Path) -> None:
    """Two ingesting processes race; create-then-delete pairs must never resurrect."""
    Store(paths.state_dir, ingest=False).close()
    for i in range(60):
        b = bundle(tmp_path, f"k{i}")
        append(paths.state_dir, event(paths, "prestart", f"k{i}", b))
        if i % 2:
            append(paths.state_dir, event(paths, "poststop", f"k{i}", b))
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_ingest, args=(paths.state_dir, q)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    with Store(paths.state_dir) as store:
        ids = sorted(c.id for c in store.containers())
    assert ids == sorted(f"k{i}" for i in range(60) if i % 2 == 0)
    assert pending(paths.state_dir) == []


def test_policy_annotations_are_kept_per_sandbox_until_it_goes(
    paths: HostPaths, tmp_path: Path
) -> None:
    """The pod's vmpin.io/ and Crane annotations from the specs, merged over the sandbox's
    containers; other annotations are not kept; forgetting the sandbox forgets them."""
    ann = {**ANN, "vmpin.io/vcpus": "float", "unrelated/key": "x"}
    for cid, extra in (("c1", {}), ("c2", {"qos.gocrane.io/cpu-manager": "share"})):
        b = tmp_path / "bundles" / cid
        b.mkdir(parents=True)
        a = {**ann, **extra}
        (b / "config.json").write_text(json.dumps({"annotations": a}))
        state = parse_state(json.dumps({"id": cid, "bundle": str(b), "annotations": a}))
        append(paths.state_dir, hook_event(paths, "createRuntime", state))
    with Store(paths.state_dir) as store:
        assert store.policy_annotations("pod") == {
            "vmpin.io/vcpus": "float", "qos.gocrane.io/cpu-manager": "share"}
        store.delete_sandbox("pod")
        assert store.policy_annotations("pod") == {}


def test_non_durable_ingest_keeps_files_until_settled(paths: HostPaths, tmp_path: Path) -> None:
    """ingest(durable=False) applies at once and keeps each file (recorded as applied) until
    settle_journal has the events in the database file; nothing is applied twice."""
    b = bundle(tmp_path, "c1")
    append(paths.state_dir, event(paths, "prestart", "c1", b))
    with Store(paths.state_dir, ingest=False) as store:
        assert store.ingest(durable=False) == ["pod"]
        assert [c.id for c in store.containers()] == ["c1"]
        assert len(pending(paths.state_dir)) == 1  # kept: its commit was not synced
        # (synchronous is back to FULL for every later commit)
        assert store.db.execute("PRAGMA synchronous").fetchone()[0] == 2
        store.delete_container("c1")
        assert store.ingest(durable=False) == []  # recorded as applied: not again
        assert store.containers() == []
        assert store.settle_journal() == 1
        assert pending(paths.state_dir) == []
        assert store.settle_journal() == 0


def test_an_event_whose_commit_was_lost_is_applied_again_from_its_file(
    paths: HostPaths, tmp_path: Path
) -> None:
    """What settle_journal guards: the database file without the WAL that held a non-durable
    commit (a power loss before any sync) still gets the event, from the file that stayed."""
    import shutil

    with Store(paths.state_dir):
        pass  # the database exists, checkpointed
    saved = tmp_path / "db-before"
    shutil.copy(paths.db, saved)
    b = bundle(tmp_path, "c1")
    append(paths.state_dir, event(paths, "prestart", "c1", b))
    with Store(paths.state_dir, ingest=False) as store:
        store.ingest(durable=False)
        assert [c.id for c in store.containers()] == ["c1"]
    # the commit never reached the disk: the database file as it was, no WAL
    for suffix in ("-wal", "-shm"):
        Path(paths.db + suffix).unlink(missing_ok=True)
    shutil.copy(saved, paths.db)
    with Store(paths.state_dir) as store:  # opening ingests (durably) what is pending
        assert [c.id for c in store.containers()] == ["c1"]
    assert pending(paths.state_dir) == []


def test_non_durable_ingest_settles_past_its_bound(paths: HostPaths, tmp_path: Path) -> None:
    from vmpin.state.ingest import SETTLE_AFTER

    for i in range(SETTLE_AFTER + 1):
        b = bundle(tmp_path, f"c{i}")
        append(paths.state_dir, event(paths, "prestart", f"c{i}", b))
    with Store(paths.state_dir, ingest=False) as store:
        store.ingest(durable=False)
        assert len(store.containers()) == SETTLE_AFTER + 1
    assert pending(paths.state_dir) == []  # more than the bound: settled by the ingest itself


def test_deferred_connection_is_made_durable_by_settle(paths: HostPaths, tmp_path: Path) -> None:
    """defer_durability: commits without a sync; settle_journal checkpoints what it wrote."""
    from vmpin.core.cpuset import CpuSet
    from vmpin.state.records import ContainerRec, SandboxRec

    with Store(paths.state_dir) as store:
        store.defer_durability()
        assert store.db.execute("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL
        store.put_sandbox(SandboxRec("pod", "runc"))
        store.put_container(ContainerRec("c1", "pod", False, cpus=CpuSet.parse("1")))
        frames = store.db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        store.put_container(ContainerRec("c2", "pod", False, cpus=CpuSet.parse("0")))
        b = bundle(tmp_path, "c3")
        append(paths.state_dir, event(paths, "prestart", "c3", b))
        store.ingest(durable=False)
        # (stays NORMAL: a non-durable ingest on a deferred connection leaves it so)
        assert store.db.execute("PRAGMA synchronous").fetchone()[0] == 1
        assert store.settle_journal() == 1
        busy, log, done = store.db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        assert busy == 0 and log == done  # everything written is in the database file
        assert frames[0] == 0
        assert store.settle_journal() == 0  # nothing new: no checkpoint, nothing removed
    assert pending(paths.state_dir) == []


def test_sync_puts_a_deferred_commit_on_the_disk_and_says_what_failed(
    paths: HostPaths, mocker: object
) -> None:
    """Store.sync (vmpin update's, while the agent works): the WAL that holds the deferred
    commit and the state dir are fsynced; a failing sync is one line naming the file."""
    import errno

    from vmpin.core.cpuset import CpuSet
    from vmpin.core.errors import StateError
    from vmpin.state.records import ContainerRec, SandboxRec

    synced: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        real(fd)
        synced.append(os.path.realpath(f"/proc/self/fd/{fd}"))

    with Store(paths.state_dir) as store:
        store.defer_durability()
        store.put_sandbox(SandboxRec("pod", "runc"))
        store.put_container(ContainerRec("c1", "pod", False, cpus=CpuSet.parse("1")))
        patch = mocker.patch("os.fsync", side_effect=fsync)  # type: ignore[attr-defined]
        store.put_container(ContainerRec("c2", "pod", False, cpus=CpuSet.parse("0")))
        assert synced == []  # deferred: the commit did not wait for the disk
        store.sync()
        wal, state_dir = os.path.realpath(paths.db + "-wal"), os.path.realpath(paths.state_dir)
        assert synced == [wal, state_dir]
        patch.side_effect = OSError(errno.EIO, "Input/output error")
        with pytest.raises(StateError) as info:
            store.sync()
        assert str(info.value) == f"{paths.db}-wal: cannot sync: Input/output error"


def test_a_deferred_event_is_whole_at_once_and_synced_by_its_caller(
    paths: HostPaths, tmp_path: Path, mocker: Any
) -> None:
    """append_unsynced renames the whole file into place and syncs nothing; sync() then
    syncs the file (through the descriptor it was written by: opened once) and the journal
    directory, in that order, and closes the descriptor -- also when the event was applied
    and settled meanwhile (its file gone)."""
    real = os.fsync
    synced: list[str] = []

    def fsync(fd: int) -> None:
        synced.append(os.path.realpath(f"/proc/self/fd/{fd}"))
        real(fd)

    mocker.patch("os.fsync", side_effect=fsync)
    opened = mocker.spy(os, "open")
    name, fd = append_unsynced(paths.state_dir,
                               event(paths, "prestart", "c1", bundle(tmp_path, "c1")))  # fmt: skip
    jdir = os.path.realpath(journal_dir(paths.state_dir))
    assert synced == []
    assert json.loads(Path(jdir, name).read_text())["ident"]["container_id"] == "c1"
    assert [n for n in os.listdir(jdir) if n.endswith(".tmp")] == []
    sync(paths.state_dir, name, fd)
    assert synced == [os.path.join(jdir, name), jdir]
    jd = journal_dir(paths.state_dir)
    assert [p for c in opened.call_args_list for p in [c.args[0]] if p.startswith(jd)][-2:] == [
        os.path.join(jd, f".{name}.tmp"), jd]  # (the file's, the dir's; not the file again)
    with pytest.raises(OSError):
        os.fstat(fd)  # (closed)
    name, fd = append_unsynced(paths.state_dir,
                               event(paths, "prestart", "c2", bundle(tmp_path, "c2")))  # fmt: skip
    with Store(paths.state_dir, ingest=False) as store:
        store.defer_durability()
        assert store.ingest(durable=False) == ["pod"]
        assert store.settle_journal() == 2
    assert not os.path.exists(os.path.join(jdir, name))
    synced.clear()
    sync(paths.state_dir, name, fd)
    assert synced == [os.path.join(jdir, name) + " (deleted)", jdir]
    with pytest.raises(OSError):
        os.fstat(fd)


@pytest.mark.parametrize("cut", [0, 0.5])
def test_an_event_file_a_crash_left_empty_or_cut_short_is_never_applied(
    paths: HostPaths, tmp_path: Path, cut: float, capsys: pytest.CaptureFixture[str]
) -> None:
    """What a crash can leave of an event appended with durable=False before its sync (its
    hook had not returned): quarantined, not applied; the events after it are."""
    name = append(paths.state_dir, event(paths, "prestart", "c1", bundle(tmp_path, "c1")))
    path = Path(journal_dir(paths.state_dir), name)
    whole = path.read_bytes()
    path.write_bytes(whole[: int(len(whole) * cut)])
    append(paths.state_dir, event(paths, "prestart", "c2", bundle(tmp_path, "c2")))
    with Store(paths.state_dir) as store:
        assert [c.id for c in store.containers()] == ["c2"]
    assert name in capsys.readouterr().err
    assert pending(paths.state_dir) == []


@pytest.mark.parametrize("short", [False, True])
def test_a_hooks_connection_keeps_the_wal_short(tmp_path: Path, short: bool) -> None:
    """keep_wal_short: a connection that dies unclosed (a hook) checkpoints every SHORT_WAL
    pages, so the next lone opener rebuilds the WAL's index from a few frames, not ~1,000."""
    from vmpin.state.ingest import SHORT_WAL
    from vmpin.state.records import ContainerRec, SandboxRec

    with Store(str(tmp_path)) as store:
        store.put_sandbox(SandboxRec("s", "kata"))
        store.put_container(ContainerRec("c", "s", False, name="app"))
        store.defer_durability()
        if short:
            store.keep_wal_short()
        from vmpin.core.cpuset import CpuSet

        for i in range(200):
            store.set_container_cpus("c", CpuSet({i % 2}), "update")
        frames = store.db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()[1]
    if short:
        assert frames <= SHORT_WAL + 16, frames  # (+ the last commit's pages)
    else:
        assert frames > 4 * SHORT_WAL, frames  # SQLite's default lets it grow


def test_a_create_looks_its_container_up_by_id_once(paths: HostPaths, tmp_path: Path) -> None:
    """A create's state id is its container's id: one lookup by id, then by bundle (the
    container is new), not the same query twice (issue 14: the agent's pass a Kata hook
    waits for ingests it)."""
    store = Store(paths.state_dir)
    statements: list[str] = []
    store.db.set_trace_callback(statements.append)
    append(paths.state_dir, event(paths, "createRuntime", "c1", bundle(tmp_path, "c1")))
    assert store.ingest() == ["pod"]
    by_id = [s for s in statements if s.startswith("SELECT") and "WHERE id='c1'" in s]
    by_bundle = [s for s in statements if "WHERE bundle=" in s]
    # (and the write takes the row as the lookup found it: none; issue 28: put_container read
    # the row by id again for its created_at)
    assert (len(by_id), len(by_bundle)) == (1, 1), statements
    [rec] = store.containers()
    assert rec.id == "c1" and rec.created_at == rec.updated_at
    store.close()


def test_a_poststop_reads_its_container_once_and_counts_none_left_only_when_last(
    paths: HostPaths, tmp_path: Path
) -> None:
    """A poststop forgets the container its lookup found, not read again, and marks its
    sandbox dirty in one statement while containers are left (issue 28: a read of the row
    again, a count and the bump were three); the last one forgets the sandbox."""
    store = Store(paths.state_dir)
    for cid in ("c1", "c2"):
        append(paths.state_dir, event(paths, "createRuntime", cid, bundle(tmp_path, cid)))
    store.ingest()
    sandbox = store.sandbox("pod")
    assert sandbox is not None
    statements: list[str] = []
    store.db.set_trace_callback(statements.append)
    append(paths.state_dir, event(paths, "poststop", "c1", tmp_path / "bundles" / "c1"))
    assert store.ingest() == ["pod"]
    reads = [s for s in statements if s.startswith("SELECT") and "FROM containers" in s]
    assert len(reads) == 1, statements
    assert not [s for s in statements if "COUNT(*)" in s], statements
    after = store.sandbox("pod")
    assert after is not None and after.gen == sandbox.gen + 1
    assert [c.id for c in store.containers()] == ["c2"]
    append(paths.state_dir, event(paths, "poststop", "c2", tmp_path / "bundles" / "c2"))
    assert store.ingest() == ["pod"]
    assert store.containers() == [] and store.sandbox("pod") is None
    store.close()


def test_a_write_given_the_row_read_wants_the_callers_transaction(tmp_path: Path) -> None:
    from vmpin.state.store import ContainerRec

    with Store(str(tmp_path)) as store:
        rec = ContainerRec("c1", "pod", False)
        with pytest.raises(ValueError, match="open transaction"):
            store.put_container(rec, None)
        with pytest.raises(ValueError, match="open transaction"):
            store.delete_container("c1", rec)
        with store.transaction():
            store.put_container(rec, None)
        with store.transaction():
            with pytest.raises(ValueError, match="open transaction"):
                store.put_container(rec._replace(id="c2"), rec)
            assert store.delete_container("c1", rec) == rec
        assert store.container("c1") is None
