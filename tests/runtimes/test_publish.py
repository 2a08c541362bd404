"""The host half of the guest channel (vmpin.runtimes.publish): where, what, atomically, only
on change.

Every test writes a real file under a temporary publish dir laid out like Kata's
``/run/kata-containers/shared/sandboxes/<sandbox>/mounts/``, and reads it back with the
guest's own reader (vmpin.guest.inputs), the contract's other half.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import time
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import FIXTURES
from vmpin.core.cpuset import CpuSet
from vmpin.core.errors import HostError, IdError
from vmpin.core.guestmap import map_sandbox
from vmpin.core.planner import Thread, plan_sandbox
from vmpin.core.topology import Topology
from vmpin.guest.inputs import lookup, read_map
from vmpin.linux.paths import HostPaths
from vmpin.linux.sysfs import read_topology
from vmpin.runtimes import publish
from vmpin.state.locks import NodeLock
from vmpin.wire.guestmap import DEFAULT_GUEST_MAP

SID = "sb-1"


def cs(text: str) -> CpuSet:
    return CpuSet.parse(text)


@cache
def xeon() -> Topology:
    return read_topology(str(FIXTURES / "sysfs" / "xeon-gold-6258r-2s"))


def sandbox_map(containers: dict[str, str | None], mask: str = "8,64,9,65") -> dict[str, Any]:
    """A real map: the planner's 1:1 plan on a 2-socket Xeon (SMT siblings 8/64, 9/65)."""
    topo = xeon()
    threads = [Thread(1000, "emulator")] + [Thread(2000 + i, "vcpu", i) for i in range(4)]
    plan = plan_sandbox(topo, SID, cs(mask), threads)
    return map_sandbox(plan, {c: None if v is None else cs(v) for c, v in containers.items()}, topo)


@pytest.fixture
def shared(paths: HostPaths) -> Path:
    """Kata's per-sandbox shared dir (``mounts/``), as the runtime would have made it."""
    d = Path(paths.publish_dir) / SID / "mounts"
    d.mkdir(parents=True)
    return d


def test_default_location_is_kata_shared_dir(paths: HostPaths) -> None:
    assert publish.map_path(paths, SID) == os.path.join(
        paths.publish_dir, SID, "mounts", "vmpin", "guest-map.json"
    )
    assert HostPaths().publish_dir == "/run/kata-containers/shared/sandboxes"
    # ... which the guest sees under its shared containers dir
    assert publish.guest_path() == DEFAULT_GUEST_MAP
    assert DEFAULT_GUEST_MAP == "/run/kata-containers/shared/containers/vmpin/guest-map.json"


def test_content(paths: HostPaths, shared: Path) -> None:
    gm = sandbox_map({"a": "8,64", "b": "9,65", "pause": None})
    res = publish.publish_map(paths, SID, gm, now=1700000000.0)
    assert res.written and res.generation == 1 and res.path == str(shared / "vmpin/guest-map.json")
    doc = json.loads(Path(res.path).read_text())
    assert doc["version"] == 1 and doc["sandbox"] == SID
    assert doc["generation"] == 1 and doc["published_at"] == 1700000000.0
    assert doc["mode"] == "1:1" and doc["nvcpus"] == 4
    assert doc["vcpu_to_host"] == {"0": 8, "1": 64, "2": 9, "3": 65}
    assert doc["siblings"] == [[0, 1], [2, 3]]
    a = doc["containers"]["a"]
    assert (a["guest_cpus"], a["host_cpus"], a["exact"], a["generation"]) == (
        "0-1",
        "8,64",
        True,
        1,
    )
    assert doc["containers"]["b"]["guest_cpus"] == "2-3"
    pause = doc["containers"]["pause"]
    assert pause["host_cpus"] is None and pause["guest_cpus"] == "0-3" and not pause["exact"]
    # Each entry is what `vmpin guest-map CONTAINER --json` prints, plus its generation.
    for cid, entry in gm["containers"].items():
        assert {k: v for k, v in doc["containers"][cid].items() if k != "generation"} == entry
    assert os.stat(res.path).st_mode & 0o777 == 0o644


def test_parseable_by_the_guest_reader(paths: HostPaths, shared: Path) -> None:
    res = publish.publish_map(paths, SID, sandbox_map({"a": "8,64", "b": "9,65"}))
    m = read_map(res.path)
    a = lookup(m, "a")
    b = lookup(m, "b")
    assert a is not None and a.guest_cpus == frozenset({0, 1}) and a.exact and a.generation == 1
    assert b is not None and b.guest_cpus == frozenset({2, 3})
    assert lookup(m, "nope") is None


def test_unchanged_is_not_rewritten(paths: HostPaths, shared: Path) -> None:
    gm = sandbox_map({"a": "8,64", "b": "9,65"})
    first = publish.publish_map(paths, SID, gm)
    before = os.stat(first.path)
    again = publish.publish_map(paths, SID, sandbox_map({"a": "8,64", "b": "9,65"}))
    after = os.stat(first.path)
    assert not again.written and again.reason == "unchanged" and again.generation == 1
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_change_bumps_generation_per_entry(paths: HostPaths, shared: Path) -> None:
    publish.publish_map(paths, SID, sandbox_map({"a": "8,64", "b": "9,65"}))
    # b's CPUs move to a floating share; a's entry is untouched and keeps its generation
    res = publish.publish_map(paths, SID, sandbox_map({"a": "8,64", "b": "9"}))
    assert res.written and res.generation == 2
    doc = json.loads(Path(res.path).read_text())
    assert doc["generation"] == 2
    assert doc["containers"]["a"]["generation"] == 1
    assert doc["containers"]["b"]["generation"] == 2 and doc["containers"]["b"]["guest_cpus"] == "2"
    # a container that left is gone from the map
    res3 = publish.publish_map(paths, SID, sandbox_map({"a": "8,64"}))
    assert res3.generation == 3 and set(read_map(res3.path).containers) == {"a"}


def test_a_change_to_its_own_map_is_rendered_without_reading_it(
    paths: HostPaths, shared: Path, mocker: Any
) -> None:
    """The map this process wrote, untouched since, is not read back to render a change
    (publish._WRITTEN); a map another writer put there is, and so is one whose content
    may be unchanged (judged by the file)."""
    publish.publish_map(paths, SID, sandbox_map({"a": "8,64", "b": "9,65"}))
    spy = mocker.spy(publish, "read_published")
    res = publish.publish_map(paths, SID, sandbox_map({"a": "8,64", "b": "9"}))
    assert res.written and res.generation == 2 and spy.call_count == 0
    doc = json.loads(Path(res.path).read_text())
    assert doc["containers"]["a"]["generation"] == 1 and doc["containers"]["b"]["generation"] == 2
    other = Path(res.path).with_name("other.json")
    other.write_text(json.dumps({**doc, "generation": 7}))
    os.replace(other, res.path)  # another writer's map
    res = publish.publish_map(paths, SID, sandbox_map({"a": "8,64"}))
    assert res.written and res.generation == 8 and spy.call_count == 1
    res = publish.publish_map(paths, SID, sandbox_map({"a": "8,64"}))
    assert not res.written and res.generation == 8 and spy.call_count == 2


def test_atomic_replace(paths: HostPaths, shared: Path) -> None:
    """A reader holding the old file keeps a whole old map; the new one is a new inode."""
    first = publish.publish_map(paths, SID, sandbox_map({"a": "8,64"}))
    with open(first.path) as old:
        ino = os.fstat(old.fileno()).st_ino
        publish.publish_map(paths, SID, sandbox_map({"a": "9,65"}))
        assert json.loads(old.read())["containers"]["a"]["guest_cpus"] == "0-1"
    assert os.stat(first.path).st_ino != ino
    assert json.loads(Path(first.path).read_text())["containers"]["a"]["guest_cpus"] == "2-3"
    assert os.listdir(os.path.dirname(first.path)) == ["guest-map.json"]  # no temp files left


def test_failed_rename_keeps_old_map(paths: HostPaths, shared: Path, mocker: Any) -> None:
    """A fault at the rename (disk full, EIO) leaves the old map whole and no temp file."""
    first = publish.publish_map(paths, SID, sandbox_map({"a": "8,64"}))
    old = Path(first.path).read_bytes()
    mocker.patch("vmpin.runtimes.publish.os.replace", side_effect=OSError(5, "Input/output error"))
    with pytest.raises(HostError, match="Input/output error"):
        publish.publish_map(paths, SID, sandbox_map({"a": "9,65"}))
    assert Path(first.path).read_bytes() == old
    assert os.listdir(os.path.dirname(first.path)) == ["guest-map.json"]


def test_map_preallocated_and_written_where_preallocation_fails(
    paths: HostPaths, shared: Path, mocker: Any
) -> None:
    """A map that replaces one has its blocks allocated before the write (ext4 then has
    nothing to flush at the rename over the old map); the first map, renamed to a new name,
    needs none; a filesystem that cannot preallocate gets the same whole map."""
    spy = mocker.spy(publish.os, "posix_fallocate")
    first = publish.publish_map(paths, SID, sandbox_map({"a": "8,64"}))
    spy.assert_not_called()
    second = publish.publish_map(paths, SID, sandbox_map({"a": "9,65"}))
    (_fd, offset, length), _ = spy.call_args
    assert second.generation == 2 and (offset, length) == (0, os.path.getsize(first.path))
    mocker.patch.object(publish.os, "posix_fallocate", side_effect=OSError(95, "not supported"))
    res = publish.publish_map(paths, SID, sandbox_map({"a": "8,64"}))
    assert res.written and read_map(res.path).containers["a"]["guest_cpus"] == "0-1"
    assert os.listdir(os.path.dirname(first.path)) == ["guest-map.json"]


def test_first_map_in_a_new_dir_still_counts_a_racing_writers_map(
    paths: HostPaths, shared: Path, mocker: Any
) -> None:
    """This call made the map's directory, but another writer put a map in it before this
    one looked: that map is read, and the generation moves on from it."""
    real_identity = publish.identity

    def identity(path: str, dir_fd: int | None = None) -> Any:
        # the other writer, between this call's mkdir and its look at the map
        if dir_fd is not None and not (shared / "vmpin" / "guest-map.json").exists():
            mocker.stopall()
            publish.publish_map(paths, SID, sandbox_map({"a": "8,64"}))
        return real_identity(path, dir_fd)

    mocker.patch.object(publish, "identity", side_effect=identity)
    res = publish.publish_map(paths, SID, sandbox_map({"a": "9,65"}))
    assert res.written and res.generation == 2
    assert read_map(res.path).containers["a"]["guest_cpus"] == "2-3"


def test_a_replaced_map_can_be_held_open_for_its_caller_to_free(
    paths: HostPaths, shared: Path
) -> None:
    """``hold``: the map replaced stays open (freed at the caller's close, not in the
    rename); nothing is held for a first map, and never more than HOLD_MAX."""
    held: list[int] = []
    first = publish.publish_map(paths, SID, sandbox_map({"a": "8,64"}), hold=held)
    assert held == []  # nothing was replaced
    old_ino = os.stat(first.path).st_ino
    publish.publish_map(paths, SID, sandbox_map({"a": "9,65"}), hold=held)
    (fd,) = held
    st = os.fstat(fd)
    assert st.st_ino == old_ino and st.st_nlink == 0  # the old map, unlinked, still open
    assert json.loads(os.pread(fd, 1 << 16, 0))["containers"]["a"]["guest_cpus"] == "0-1"
    assert read_map(first.path).containers["a"]["guest_cpus"] == "2-3"
    os.close(fd)
    full = list(range(publish.HOLD_MAX))  # (stand-ins: a full list takes no more)
    publish.publish_map(paths, SID, sandbox_map({"a": "8,64"}), hold=full)
    assert full == list(range(publish.HOLD_MAX))


def test_stale_temp_from_a_dead_writer_is_removed(paths: HostPaths, shared: Path) -> None:
    (shared / "vmpin").mkdir()
    stale = shared / "vmpin" / ".guest-map.json.999999.deadbeef.tmp"
    stale.write_text("{half")
    # a live writer's (a pass that went on without the node lock may be writing it): kept,
    # unless it is older than any live write (its pid was reused)
    live = shared / "vmpin" / f".guest-map.json.{os.getpid()}.cafe.tmp"
    live.write_text("{writing")
    old = shared / "vmpin" / f".guest-map.json.{os.getppid()}.f00d.tmp"
    old.write_text("{half")
    os.utime(old, (time.time() - 2 * publish.TMP_MAX_AGE,) * 2)
    publish.publish_map(paths, SID, sandbox_map({"a": "8,64"}))
    publish.publish_map(paths, SID, sandbox_map({"a": "9,65"}))
    assert not stale.exists() and not old.exists()
    assert live.exists()


def test_a_map_dir_left_clean_is_not_listed_again(
    paths: HostPaths, shared: Path, mocker: Any
) -> None:
    """A change to this process's own map in a directory its last write left with no temp
    map, and unchanged since (publish._WRITTEN: its version), lists nothing to sweep; a
    temp made there since moves the directory, and is swept at the next write; so is one
    that a live writer still held at the sweep, once it is a dead writer's."""
    publish.publish_map(paths, SID, sandbox_map({"a": "8,64"}))  # (the directory made)
    publish.publish_map(paths, SID, sandbox_map({"a": "9,65"}))  # (swept: found clean)
    listed = mocker.spy(publish.os, "listdir")
    for cpus in ("8,64", "9,65", "8,64"):
        assert publish.publish_map(paths, SID, sandbox_map({"a": cpus})).written
    assert listed.call_count == 0
    stale = shared / "vmpin" / ".guest-map.json.999999.deadbeef.tmp"
    stale.write_text("{half")
    publish.publish_map(paths, SID, sandbox_map({"a": "9,65"}))
    assert listed.call_count == 1 and not stale.exists()
    writer = subprocess.Popen(["sleep", "60"])
    live = shared / "vmpin" / f".guest-map.json.{writer.pid}.{time.monotonic_ns()}.tmp"
    live.write_text("{writing")
    publish.publish_map(paths, SID, sandbox_map({"a": "8,64"}))
    assert listed.call_count == 2 and live.exists()
    writer.kill()
    writer.wait()
    # the writer died, its file left as it was (the directory unmoved): listed again, the
    # last listing having left a temp behind
    publish.publish_map(paths, SID, sandbox_map({"a": "9,65"}))
    assert listed.call_count == 3 and not live.exists()


def test_a_live_writers_temp_survives_a_clock_step(paths: HostPaths, shared: Path) -> None:
    """Temp maps are aged by the monotonic stamp in their names, as the journal's are: a live
    writer's file whose mtime reads 1970 after a wall-clock step is kept; a stamp two
    minutes old, or one from an earlier boot, is swept."""
    (shared / "vmpin").mkdir()
    now = time.monotonic_ns()
    live = shared / "vmpin" / f".guest-map.json.{os.getppid()}.{now}.tmp"
    live.write_text("{writing")
    os.utime(live, (1, 1))
    old = shared / "vmpin" / f".guest-map.json.{os.getppid()}.{now - 120 * 10**9}.tmp"
    old.write_text("{half")
    reboot = shared / "vmpin" / f".guest-map.json.{os.getppid()}.{now + 3600 * 10**9}.tmp"
    reboot.write_text("{half")
    publish.publish_map(paths, SID, sandbox_map({"a": "8,64"}))
    publish.publish_map(paths, SID, sandbox_map({"a": "9,65"}))
    assert live.exists() and not old.exists() and not reboot.exists()


def test_corrupt_map_is_replaced(paths: HostPaths, shared: Path) -> None:
    (shared / "vmpin").mkdir()
    (shared / "vmpin" / "guest-map.json").write_text("{not json")
    res = publish.publish_map(paths, SID, sandbox_map({"a": "8,64"}))
    assert res.written and res.generation == 1
    assert lookup(read_map(res.path), "a") is not None


def test_not_shared_writes_nothing(paths: HostPaths) -> None:
    """No mounts/ dir: Kata shares nothing with this guest (or the sandbox is gone)."""
    res = publish.publish_map(paths, SID, sandbox_map({"a": "8,64"}))
    assert not res.written and "not shared" in res.reason
    assert not os.path.exists(paths.publish_dir)  # nothing created, nothing left behind


def test_location_configurable(tmp_path: Path) -> None:
    # another publish dir
    p = HostPaths(publish_dir=str(tmp_path / "elsewhere"))
    (tmp_path / "elsewhere" / SID / "mounts").mkdir(parents=True)
    res = publish.publish_map(p, SID, sandbox_map({"a": "8,64"}))
    assert res.written and res.path.startswith(str(tmp_path / "elsewhere" / SID / "mounts"))
    # a template for the map's directory ...
    (tmp_path / "guests" / SID).mkdir(parents=True)
    t = HostPaths(publish_dir=str(tmp_path / "guests" / "{sandbox}" / "vmpin"))
    res = publish.publish_map(t, SID, sandbox_map({"a": "8,64"}))
    assert res.path == str(tmp_path / "guests" / SID / "vmpin" / "guest-map.json")
    assert res.written
    # ... or for the file itself
    f = HostPaths(
        publish_dir=str(tmp_path / "guests" / "{sandbox}" / "cpus" / "map-{sandbox}.json")
    )
    res = publish.publish_map(f, SID, sandbox_map({"a": "8,64"}))
    assert res.path == str(tmp_path / "guests" / SID / "cpus" / f"map-{SID}.json")
    assert read_map(res.path).sandbox == SID


def test_location_from_environment(tmp_path: Path) -> None:
    p = HostPaths.from_env(None, env={"VMPIN_PUBLISH_DIR": str(tmp_path / "x" / "{sandbox}")})
    assert publish.map_path(p, SID) == str(tmp_path / "x" / SID / "guest-map.json")


@pytest.mark.parametrize("bad", ["../etc", "a/b", ".hidden", ""])
def test_sandbox_id_cannot_name_another_path(paths: HostPaths, bad: str) -> None:
    with pytest.raises(IdError):
        publish.map_path(paths, bad)


def test_write_refused_is_a_host_error(paths: HostPaths, shared: Path) -> None:
    (shared / "vmpin").mkdir()
    (shared / "vmpin" / "guest-map.json").mkdir()  # a directory where the file should go
    with pytest.raises(HostError):
        publish.publish_map(paths, SID, sandbox_map({"a": "8,64"}))


def test_remove_map(paths: HostPaths, shared: Path) -> None:
    res = publish.publish_map(paths, SID, sandbox_map({"a": "8,64"}))
    assert publish.remove_map(paths, SID)
    assert not os.path.exists(res.path) and not (shared / "vmpin").exists()
    assert shared.is_dir()  # Kata's own dir stays
    assert not publish.remove_map(paths, SID)


def _publish_many(state_dir: str, publish_dir: str, n: int, writer: int) -> None:
    p = HostPaths(state_dir=state_dir, publish_dir=publish_dir)
    lock = NodeLock(state_dir)
    for i in range(n):
        # a container no other publish names: every publish is a change, so none may be lost
        cpu = "8,64" if (writer + i) % 2 else "9,65"
        # as vmpin's passes do: under the node's plan lock (publish_map takes none itself)
        assert lock.acquire(time.monotonic() + 30)
        try:
            publish.publish_map(p, SID, sandbox_map({f"w{writer}-{i}": cpu}))
        finally:
            lock.release()


def test_concurrent_writers(paths: HostPaths, shared: Path) -> None:
    """Hook processes publishing at once: the map stays whole, generations count each change
    (60 changes make generation 60 exactly: a lost update under the node lock would show)."""
    ctx = multiprocessing.get_context("fork")
    procs = [
        ctx.Process(target=_publish_many, args=(paths.state_dir, paths.publish_dir, 15, k))
        for k in range(4)
    ]
    for pr in procs:
        pr.start()
    for pr in procs:
        pr.join(60)
        assert pr.exitcode == 0
    path = publish.map_path(paths, SID)
    doc = read_map(path)
    assert doc.generation == 4 * 15
    # the last writer's last map is what stays
    assert len(doc.containers) == 1 and set(doc.containers) <= {f"w{k}-14" for k in range(4)}
    assert os.listdir(os.path.dirname(path)) == ["guest-map.json"]


def test_a_settled_current_map_is_checked_without_reading_it(
    paths: HostPaths, shared: Path, mocker: Any
) -> None:
    """An idle pass re-checks a map it found current with one lstat; anything that changes
    the file (a rewrite in place, a replacement, a removal) sends it down the full path."""
    gm = sandbox_map({"a": "8,64"})
    first = publish.publish_map(paths, SID, gm)
    assert first.written
    time.sleep(0.15)  # older than the timestamp grain (vmpin.linux.files.SETTLE_NS)
    read = mocker.spy(publish, "read_published")
    again = publish.publish_map(paths, SID, gm)  # read once, found current: remembered
    assert (again.written, again.reason, again.generation) == (False, "unchanged", 1)
    assert read.call_count == 1
    assert publish.publish_map(paths, SID, gm) == again
    assert read.call_count == 1  # not read again
    path = Path(first.path)
    good = path.read_bytes()
    # rewritten in place, same size: the map is read and put back
    path.write_bytes(good.replace(b'"a"', b'"z"'))
    fixed = publish.publish_map(paths, SID, gm)
    assert fixed.written and read.call_count == 2
    assert lookup(read_map(fixed.path), "a") is not None
    # removed: written again
    time.sleep(0.15)
    publish.publish_map(paths, SID, gm)  # (remembered again)
    path.unlink()
    assert publish.publish_map(paths, SID, gm).written


def test_a_users_flock_on_the_map_dir_stalls_no_one(paths: HostPaths, shared: Path) -> None:
    """An unprivileged user who can open ``vmpin/`` (0755: the guest reads it) and flock it
    hung every Kata hook and the agent's planner (issue 26).  Nothing locks that directory now
    (the passes publish under the node's owner-only plan lock): a publish goes through while
    the user holds it."""
    import subprocess
    import sys

    publish.publish_map(paths, SID, sandbox_map({"c1": "8"}))
    vmpin_dir = shared / "vmpin"
    assert oct(vmpin_dir.stat().st_mode & 0o777) == "0o755"
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import fcntl, os, sys, time\n"
         # opened before the privileges go: pytest's tmp dir is not traversable by nobody,
         # where Kata's shared dir under /run is; the lock is then taken as nobody
         "fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)\n"
         "os.setgid(65534); os.setuid(65534)\n"
         "fcntl.flock(fd, fcntl.LOCK_EX)\n"
         "print('held', flush=True)\n"
         "time.sleep(60)\n", str(vmpin_dir)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        t0 = time.monotonic()
        out = publish.publish_map(paths, SID, sandbox_map({"c1": "9"}))
        assert time.monotonic() - t0 < 1.0
        assert out.written
    finally:
        holder.kill()
        holder.wait()
