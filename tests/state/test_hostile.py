"""Hostile input, faults and full disks: nothing lost, nothing poisoned, one clear line.

Every case runs the real thing: the hook as a subprocess on real files, real SQLite, a real
(tiny) tmpfs for a full or read-only state dir.  Each checks the three promises: no
traceback, nothing recorded lost, and one line naming what and where.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import vmpin_cmd
from vmpin.core.errors import SpecError, StateError
from vmpin.linux.paths import HostPaths
from vmpin.runtimes.oci import hook_event, parse_state
from vmpin.state import journal
from vmpin.state.journal import append, journal_dir, pending
from vmpin.state.store import Store
from vmpin.wire.hookevent import HookEvent, from_json

ANN = {"io.kubernetes.cri.container-type": "container", "io.kubernetes.cri.sandbox-id": "pod"}


def uid(prefix: str = "h") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def make_bundle(root: Path, name: str, cpus: str = "0", ann: dict[str, str] | None = None) -> Path:
    b = root / "bundles" / name
    b.mkdir(parents=True)
    spec = {"annotations": ann or {}, "linux": {"resources": {"cpu": {"cpus": cpus}}}}
    (b / "config.json").write_text(json.dumps(spec))
    return b


def hook(
    env: dict[str, str], stage: str, state: str | bytes, *, strict: bool = False
) -> subprocess.CompletedProcess[str]:
    data = state.encode() if isinstance(state, str) else state
    argv = [*vmpin_cmd(), "hook", *(["--strict"] if strict else []), stage]
    proc = subprocess.run(argv, input=data, capture_output=True, env=env, timeout=60)
    return subprocess.CompletedProcess(
        argv, proc.returncode, proc.stdout.decode(), proc.stderr.decode(errors="replace")
    )


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*vmpin_cmd(), *args], capture_output=True, text=True, env=env, timeout=60
    )


def one_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1, text
    assert "Traceback" not in text
    return lines[0]


def ids(env: dict[str, str]) -> list[str]:
    out = cli(env, "containers", "--json")
    assert out.returncode == 0, out.stderr
    return sorted(c["id"] for c in json.loads(out.stdout))


# -- validate at the door -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "state, what",
    [
        ('{"id": "X", "pid": 9223372036854775808, "bundle": "B"}', "pid"),
        ('{"id": "X", "pid": 1, "bundle": "B", "annotations": {"a": "\\ud800"}}', "surrogate"),
        ('{"id": "X", "pid": 1, "bundle": "B/\\ud800"}', "surrogate"),
        ('{"id": "X", "pid": 1, "bundle": "B", "annotations": {"\\udfff": "v"}}', "surrogate"),
        ("[" * 5000 + "]" * 5000, "nested"),
    ],
)
def test_hook_refuses_what_it_cannot_store(
    env: dict[str, str], tmp_path: Path, state: str, what: str
) -> None:
    good = make_bundle(tmp_path, uid())
    cid = uid()
    state = state.replace('"X"', f'"{cid}"').replace('"B', f'"{good}')
    opened = hook(env, "createRuntime", state)
    assert opened.returncode == 0  # fail-open ...
    assert what in one_line(opened.stderr)
    closed = hook(env, "createRuntime", state, strict=True)
    assert closed.returncode == 1  # ... or closed
    one_line(closed.stderr)
    assert pending(env["VMPIN_STATE_DIR"]) == []  # nothing journaled
    # and the node goes on: the next container is recorded, every command works
    b2 = make_bundle(tmp_path, uid())
    c2 = uid()
    ok = hook(env, "createRuntime", json.dumps({"id": c2, "pid": os.getpid(), "bundle": str(b2)}))
    assert ok.returncode == 0 and ok.stderr == ""
    assert ids(env) == [c2]


@pytest.mark.parametrize("key", ["io.kubernetes.pod.uid", "io.kubernetes.cri.sandbox-uid"])
def test_pod_uid_is_checked_as_an_id(env: dict[str, str], tmp_path: Path, key: str) -> None:
    """A pod uid ``../../x`` was stored, and every later audit exited 1 (issue 26)."""
    cid = uid()
    bad = make_bundle(tmp_path, cid, ann={key: "../../x", "io.kubernetes.container.name": "a"})
    state = json.dumps({"id": cid, "pid": os.getpid(), "bundle": str(bad)})
    opened = hook(env, "createRuntime", state)
    assert opened.returncode == 0  # fail-open, one line naming what is wrong
    line = one_line(opened.stderr)
    assert "pod uid" in line and "../../x" in line
    assert hook(env, "createRuntime", state, strict=True).returncode == 1
    assert pending(env["VMPIN_STATE_DIR"]) == []
    good = make_bundle(tmp_path, uid(), ann={key: "0f1e2d3c-aaaa-bbbb-cccc-000011112222"})
    c2 = uid()
    ok = hook(env, "createRuntime", json.dumps({"id": c2, "pid": os.getpid(), "bundle": str(good)}))
    assert ok.returncode == 0 and ok.stderr == ""
    assert ids(env) == [c2]
    assert cli(env, "audit").returncode == 0


def test_oversized_config_and_fifo_config_are_refused(env: dict[str, str], tmp_path: Path) -> None:
    big = make_bundle(tmp_path, uid())
    (big / "config.json").write_text(json.dumps({"annotations": {"k": "v" * (2 << 20)}}))
    fifo = tmp_path / "bundles" / uid()
    fifo.mkdir()
    os.mkfifo(fifo / "config.json")  # opening it for reading would block forever
    link = tmp_path / "bundles" / uid()
    link.mkdir()
    os.symlink("/dev/zero", link / "config.json")
    for b, why in ((big, "limit"), (fifo, "FIFO"), (link, "symlink")):
        out = hook(env, "createRuntime", json.dumps({"id": uid(), "pid": 1, "bundle": str(b)}),
                   strict=True)
        assert out.returncode == 1
        assert why in one_line(out.stderr)
    assert pending(env["VMPIN_STATE_DIR"]) == []


# -- ingest quarantines -------------------------------------------------------------------------
POISON: list[Any] = [
    b"{broken",
    b"[]",
    b'{"v": 1, "stage": "prestart", "id": "p1", "bundle": "/b", "annotations": {},'
    b' "host_pid": 9223372036854775808, "pid_start": null, "ident": null, "cpus": null,'
    b' "mems": null, "runtime": null}',
    b'{"v": 1, "stage": "prestart", "id": "p2", "bundle": "/b\\ud800", "annotations": {},'
    b' "host_pid": null, "pid_start": null, "ident": null, "cpus": null, "mems": null,'
    b' "runtime": null}',
    b'{"v": 1, "stage": "prestart", "id": "p3", "bundle": "/b", "annotations": {"a": 1},'
    b' "host_pid": null, "pid_start": null, "ident": null, "cpus": null, "mems": null,'
    b' "runtime": null}',
    b'{"v": 1, "stage": "prestart", "id": "p4", "bundle": "/b", "annotations": {},'
    b' "host_pid": null, "pid_start": null, "cpus": "0-", "mems": null, "runtime": "runc",'
    b' "has_config": true, "ident": {"container_id": "p4", "sandbox_id": "p4",'
    b' "is_sandbox": true, "pod_uid": null, "pod_name": null, "pod_namespace": null,'
    b' "name": null}}',
    b"[" * 3000 + b"]" * 3000,
]


def test_poisoned_entries_are_quarantined_and_the_rest_applied(
    paths: HostPaths, env: dict[str, str], tmp_path: Path
) -> None:
    d = Path(journal_dir(paths.state_dir))
    d.mkdir(parents=True)
    for i, raw in enumerate(POISON):
        (d / f"{i + 1:020d}-1.json").write_bytes(raw)
    c1 = uid()
    b1 = make_bundle(tmp_path, c1)
    append(paths.state_dir, hook_event(paths, "createRuntime", parse_state(
        json.dumps({"id": c1, "pid": os.getpid(), "bundle": str(b1)}))))
    out = cli(env, "containers", "--json")  # a read-only command applies them in memory
    assert out.returncode == 0 and "Traceback" not in out.stderr
    assert [c["id"] for c in json.loads(out.stdout)] == [c1]
    Store(paths.state_dir).close()  # the next writer applies them for good: must not raise
    bad = Path(journal.bad_dir(paths.state_dir))
    assert len(list(bad.glob("*.json"))) == len(POISON)
    assert len(list(bad.glob("*.reason"))) == len(POISON)
    assert journal.quarantined(paths.state_dir) == len(POISON)
    assert pending(paths.state_dir) == []
    # status says so, agent or not
    status = cli(env, "status")
    assert f"journal_bad={len(POISON)}" in status.stdout
    # and the store keeps opening: every later command works
    assert cli(env, "sandboxes", "--json").returncode == 0


def test_an_entry_failing_half_way_is_rolled_back_alone(
    paths: HostPaths, tmp_path: Path, mocker: Any
) -> None:
    """A fault inside one event's application (after its first write) undoes that event only."""
    cids = [uid() for _ in range(3)]
    for cid in cids:
        b = make_bundle(tmp_path, cid)
        append(paths.state_dir, hook_event(paths, "createRuntime", parse_state(
            json.dumps({"id": cid, "pid": os.getpid(), "bundle": str(b)}))))
    real = Store.put_container
    calls = {"n": 0}

    def flaky(self: Store, rec: Any, stored: Any = False) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise OverflowError("Python int too large to convert to SQLite INTEGER")
        real(self, rec, stored)

    mocker.patch.object(Store, "put_container", flaky)
    with Store(paths.state_dir) as store:
        got = sorted(c.id for c in store.containers())
        sandboxes = sorted(s.id for s in store.sandboxes())
    assert got == sorted([cids[0], cids[2]])
    assert sandboxes == got  # the failed event's sandbox row (written first) was undone too
    assert journal.quarantined(paths.state_dir) == 1


# -- keyed by container id ------------------------------------------------------------------------
def test_two_containers_with_one_bundle(env: dict[str, str], tmp_path: Path) -> None:
    b = make_bundle(tmp_path, "shared")
    c1, c2 = uid("a"), uid("b")
    for cid in (c1, c2):
        out = hook(env, "createRuntime", json.dumps({"id": cid, "pid": 1, "bundle": str(b)}),
                   strict=True)
        assert out.returncode == 0, out.stderr
    assert ids(env) == sorted([c1, c2])
    out = hook(env, "poststop", json.dumps({"id": c2, "bundle": str(b)}), strict=True)
    assert out.returncode == 0, out.stderr
    assert ids(env) == [c1]


def test_kata_poststop_with_the_sandbox_id_clobbers_no_one(
    env: dict[str, str], tmp_path: Path
) -> None:
    """Kata's poststop carries the sandbox id; the bundle names a container never recorded:
    neither the sandbox nor its other container may go."""
    sid, c1, c2 = uid("s"), uid("c"), uid("c")
    sb = make_bundle(tmp_path, sid, ann={"io.kubernetes.cri.container-type": "sandbox"})
    ann = {"io.kubernetes.cri.container-type": "container", "io.kubernetes.cri.sandbox-id": sid}
    b1 = make_bundle(tmp_path, c1, ann=ann)
    for cid, b in ((sid, sb), (c1, b1)):
        assert hook(env, "createRuntime", json.dumps({"id": cid, "pid": 1, "bundle": str(b)}),
                    strict=True).returncode == 0
    stray = tmp_path / "bundles" / c2
    stray.mkdir()
    out = hook(env, "poststop", json.dumps({"id": sid, "bundle": str(stray)}))
    assert out.returncode == 0
    assert ids(env) == sorted([sid, c1])
    # ... and the same poststop for the recorded container removes just that one
    hook(env, "poststop", json.dumps({"id": sid, "bundle": str(b1), "annotations": ann}))
    assert ids(env) == [sid]


# -- journal writes complete or absent ----------------------------------------------------------
def test_short_write_is_retried_to_completion(paths: HostPaths, mocker: Any) -> None:
    real = os.write
    mocker.patch("vmpin.state.journal.os.write", side_effect=lambda fd, b: real(fd, b[:7]))
    ev = HookEvent("prestart", "x", "/b", {"pad": "y" * 500})
    name = append(paths.state_dir, ev)
    assert from_json(Path(journal_dir(paths.state_dir), name).read_bytes()) == ev


def test_failed_write_leaves_nothing(paths: HostPaths, mocker: Any) -> None:
    real = os.write
    state = {"n": 0}

    def enospc(fd: int, b: Any) -> int:
        state["n"] += 1
        if state["n"] > 1:
            raise OSError(28, "No space left on device")
        return real(fd, bytes(b)[:10])

    mocker.patch("vmpin.state.journal.os.write", side_effect=enospc)
    with pytest.raises(StateError, match="event not recorded: No space left"):
        append(paths.state_dir, HookEvent("prestart", "x", "/b", {"pad": "y" * 100}))
    assert os.listdir(journal_dir(paths.state_dir)) == []


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Any:
    """A real 256 KiB tmpfs, unmounted afterwards (root only)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a tmpfs")
    mnt = tmp_path / f"tiny-{uuid.uuid4().hex[:8]}"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)]).returncode:
        pytest.skip("cannot mount a tmpfs here (no CAP_SYS_ADMIN)")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_state_dir_hook_says_so_and_loses_nothing_recorded(
    env: dict[str, str], tmp_path: Path, tiny_fs: Path
) -> None:
    state_dir = tiny_fs / "state"
    env = {**env, "VMPIN_STATE_DIR": str(state_dir)}
    b = make_bundle(tmp_path, uid())
    first = uid()
    assert hook(env, "createRuntime", json.dumps({"id": first, "pid": 1, "bundle": str(b)}),
                strict=True).returncode == 0
    assert ids(env) == [first]
    before = sorted(os.listdir(state_dir / "journal"))
    fd = os.open(tiny_fs / "filler", os.O_WRONLY | os.O_CREAT)
    try:  # fill the filesystem to the last byte
        for size in (4096, 512, 1):
            try:
                while os.write(fd, b"\0" * size):
                    pass
            except OSError:
                pass
    finally:
        os.close(fd)
    big = make_bundle(tmp_path, uid(), ann={"k": "v" * 30000})
    out = hook(env, "createRuntime", json.dumps({"id": uid(), "pid": 1, "bundle": str(big)}),
               strict=True)
    assert out.returncode == 1
    line = one_line(out.stderr)
    assert "No space left" in line and str(state_dir) in line
    assert sorted(os.listdir(state_dir / "journal")) == before  # no event, no temp file
    (tiny_fs / "filler").unlink()
    assert ids(env) == [first]


def test_read_only_state_dir_one_line_and_reads_still_work(
    env: dict[str, str], tmp_path: Path, tiny_fs: Path
) -> None:
    state_dir = tiny_fs / "state"
    env = {**env, "VMPIN_STATE_DIR": str(state_dir)}
    b = make_bundle(tmp_path, uid())
    first = uid()
    hook(env, "createRuntime", json.dumps({"id": first, "pid": 1, "bundle": str(b)}))
    assert ids(env) == [first]
    # a pending event, then the filesystem goes read-only
    hook(env, "createRuntime", json.dumps({"id": uid(), "pid": 1, "bundle": str(b)}))
    subprocess.run(["mount", "-o", "remount,ro", str(tiny_fs)], check=True)
    out = hook(env, "createRuntime", json.dumps({"id": uid(), "pid": 1, "bundle": str(b)}),
               strict=True)
    assert out.returncode == 1
    assert "Read-only" in one_line(out.stderr)
    listed = cli(env, "containers", "--json")
    assert "Traceback" not in listed.stderr
    if listed.returncode == 0:
        assert first in [c["id"] for c in json.loads(listed.stdout)]
    else:
        assert "state.db" in one_line(listed.stderr)


def test_leftovers_of_killed_hooks_are_swept(paths: HostPaths) -> None:
    """Age by the monotonic stamp in the name, never by mtime (issue 26: a wall clock stepped
    forward made a live hook's temp file look old; another process swept it mid-write)."""
    d = Path(journal_dir(paths.state_dir))
    d.mkdir(parents=True)
    now = time.monotonic_ns()
    old = d / f".{now - 120 * 10**9:020d}-99.json.tmp"  # a hook killed two minutes ago
    old.write_bytes(b'{"v":1,')
    live = d / f".{now:020d}-98.json.tmp"  # a hook writing right now ...
    live.write_bytes(b"{")
    os.utime(live, (1, 1))  # ... whose mtime reads 1970 after a clock step
    earlier_boot = d / f".{now + 3600 * 10**9:020d}-97.json.tmp"
    earlier_boot.write_bytes(b"{")
    stranger = d / ".notours.tmp"
    stranger.write_bytes(b"")
    Store(paths.state_dir).close()
    assert not old.exists() and not earlier_boot.exists()
    assert live.exists() and stranger.exists()


# -- bounded journal, durable ingest --------------------------------------------------------------
def test_plain_hooks_keep_the_backlog_bounded(
    paths: HostPaths, env: dict[str, str], tmp_path: Path
) -> None:
    b = make_bundle(tmp_path, "many")
    for i in range(journal.INGEST_THRESHOLD + 50):
        append(paths.state_dir, hook_event(paths, "createRuntime", parse_state(
            json.dumps({"id": f"m{i}", "pid": 1, "bundle": str(b)}))))
    out = hook(env, "createRuntime", json.dumps({"id": "last", "pid": 1, "bundle": str(b)}))
    assert out.returncode == 0, out.stderr
    assert journal.backlog(paths.state_dir) <= journal.INGEST_THRESHOLD
    assert len(ids(env)) == journal.INGEST_THRESHOLD + 51


def test_ingest_stops_between_batches_when_the_budget_is_spent(
    paths: HostPaths, tmp_path: Path
) -> None:
    b = make_bundle(tmp_path, "budget")
    for i in range(30):
        append(paths.state_dir, hook_event(paths, "createRuntime", parse_state(
            json.dumps({"id": f"q{i}", "pid": 1, "bundle": str(b)}))))
    with Store(paths.state_dir, ingest=False) as store:
        store.ingest(budget=0.0, batch=10)
        assert len(store.containers()) == 10
        assert len(pending(paths.state_dir)) == 20
        store.ingest()
        assert len(store.containers()) == 30


INGEST_AND_DIE = """
import os, sys
from vmpin.state.store import Store
s = Store(sys.argv[1], ingest=False)
s.ingest()
os._exit(0)  # like the hook: no close, no checkpoint on close
"""


def test_truncated_wal_loses_no_event_whose_file_is_gone(
    paths: HostPaths, tmp_path: Path
) -> None:
    import sys

    Store(paths.state_dir, ingest=False).close()
    b = make_bundle(tmp_path, "wal")
    cids = [f"w{i}" for i in range(20)]
    for cid in cids:
        append(paths.state_dir, hook_event(paths, "createRuntime", parse_state(
            json.dumps({"id": cid, "pid": 1, "bundle": str(b)}))))
    subprocess.run([sys.executable, "-c", INGEST_AND_DIE, paths.state_dir], check=True,
                   timeout=60)
    wal = Path(paths.state_dir, "state.db-wal")
    if wal.exists():
        os.truncate(wal, 0)  # what a power cut does to WAL pages never synced
    with Store(paths.state_dir) as store:
        assert sorted(c.id for c in store.containers()) == sorted(cids)


# -- corrupt store --------------------------------------------------------------------------------
def test_corrupt_store_one_line_then_doctor_rebuilds(
    paths: HostPaths, env: dict[str, str], tmp_path: Path
) -> None:
    b = make_bundle(tmp_path, uid())
    hook(env, "createRuntime", json.dumps({"id": uid(), "pid": 1, "bundle": str(b)}))
    assert len(ids(env)) == 1
    db = Path(paths.state_dir, "state.db")
    for extra in ("-wal", "-shm"):
        Path(str(db) + extra).unlink(missing_ok=True)
    db.write_bytes(b"this is not a database" * 200)
    for args in (("containers",), ("sandboxes", "--json"), ("reconcile", "--once")):
        out = cli(env, *args)
        assert out.returncode == 2
        line = one_line(out.stderr)
        assert str(db) in line and "vmpin doctor" in line
    hooked = hook(env, "createRuntime", json.dumps({"id": uid(), "pid": 1, "bundle": str(b)}))
    assert hooked.returncode == 0  # a plain hook only journals: not stopped by the database
    check = cli(env, "doctor", "--dry-run")
    assert check.returncode == 1 and "unusable" in check.stdout
    fixed = cli(env, "doctor")
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert "moved aside" in fixed.stdout and "rebuilt" in fixed.stdout
    assert list(Path(paths.state_dir).glob("state.db.corrupt-*"))
    assert cli(env, "containers").returncode == 0


def test_symlinked_database_is_refused(paths: HostPaths, tmp_path: Path) -> None:
    target = tmp_path / "elsewhere.db"
    os.symlink(target, Path(paths.state_dir, "state.db"))
    with pytest.raises(StateError, match="not a regular file"):
        Store(paths.state_dir)
    assert not target.exists()


def test_bad_event_refused_at_build(paths: HostPaths, tmp_path: Path) -> None:
    b = make_bundle(tmp_path, "surrogate", ann={"k": "v"})
    state = parse_state(json.dumps({"id": "s1", "pid": 1, "bundle": str(b)}))
    ev = hook_event(paths, "createRuntime", state)
    with pytest.raises(SpecError, match="cannot be stored"):
        ev._replace(annotations={"k": "\ud800"}).to_json()


def test_a_pid_without_start_time_is_not_kept(paths: HostPaths, tmp_path: Path) -> None:
    """The hook could not read the pid's start time (no such process): the pid is dropped,
    never followed later; a live pid is kept with its start time."""
    b = make_bundle(tmp_path, "nostart")
    gone, alive = uid(), uid()
    for cid, pid in ((gone, 4194304), (alive, os.getpid())):  # PID_MAX itself: never in use
        append(paths.state_dir, hook_event(paths, "createRuntime", parse_state(
            json.dumps({"id": cid, "pid": pid, "bundle": str(b)}))))
    with Store(paths.state_dir) as store:
        g, a = store.container(gone), store.container(alive)
    assert g is not None and g.pid is None and g.pid_start is None
    assert a is not None and a.pid == os.getpid() and a.pid_start is not None
