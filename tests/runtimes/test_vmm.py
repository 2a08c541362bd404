"""Finding a sandbox's QEMU: -name parsing, pidfile, hint and scan, pid reuse.

The parsing tests are tables; the discovery tests start real QEMUs the way Kata does
(tests/qemu_util.py) and kill each one by its pid at teardown.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.qemu_util import QemuHandle, qemu_factory, reap_if_child, wait_until
from tests.support.session import new_id
from vmpin.core.errors import IdError, VmpinError
from vmpin.linux import procfs
from vmpin.linux.paths import HostPaths
from vmpin.runtimes.vmm import (
    Vmm,
    find_vmm,
    iothread_ids,
    is_same,
    is_vmm_of,
    parse_name_option,
    read_pidfile,
)

Q = "qemu-system-x86_64"


@pytest.fixture
def qemu(vm_dir: Path) -> Iterator[Callable[..., QemuHandle]]:
    with qemu_factory(vm_dir) as start:
        yield start


# -- -name ----------------------------------------------------------------------------------
NAME_CASES = [
    ([Q, "-name", "sandbox-abc"], ("sandbox-abc", False)),
    ([Q, "-name", "sandbox-abc,debug-threads=on"], ("sandbox-abc", True)),
    ([Q, "-name", "guest=sandbox-abc,debug-threads=on"], ("sandbox-abc", True)),
    ([Q, "-name", "debug-threads=on,guest=sandbox-abc"], ("sandbox-abc", True)),
    ([Q, "--name", "sandbox-abc,debug-threads=yes"], ("sandbox-abc", True)),
    ([Q, "-name", "sandbox-abc,debug-threads=off"], ("sandbox-abc", False)),
    ([Q, "-name", "sandbox-abc,debug-threads"], ("sandbox-abc", True)),
    ([Q, "-name", "sandbox-abc,process=qemu-abc"], ("sandbox-abc", False)),
    # ",," escapes a comma inside the value
    ([Q, "-name", "sandbox-a,,b,debug-threads=on"], ("sandbox-a,b", True)),
    # -name lists merge; the last value of a key wins
    ([Q, "-name", "sandbox-abc", "-name", "debug-threads=on"], ("sandbox-abc", True)),
    ([Q, "-name", "old", "-name", "guest=sandbox-abc"], ("sandbox-abc", False)),
    ([Q, "-m", "128"], (None, False)),
    ([Q, "-name"], (None, False)),  # no value: nothing to parse
    ([], (None, False)),
    # "-name" only counts as an option, not as the value of another
    ([Q, "-object", "-name", "-name", "sandbox-x"], ("sandbox-x", False)),
]


@pytest.mark.parametrize(("cmdline", "expected"), NAME_CASES)
def test_parse_name_option(cmdline: list[str], expected: tuple[str | None, bool]) -> None:
    assert parse_name_option(cmdline) == expected


def test_iothread_ids() -> None:
    cmd = [
        Q,
        "-object",
        "iothread,id=io0",
        "-object",
        "qom-type=iothread,id=io1,poll-max-ns=0",
        "-object",
        '{"qom-type":"iothread","id":"io2"}',
        "-object",
        "memory-backend-ram,id=mem0,size=128M",
        "-object",
        "{not json",
    ]
    assert iothread_ids(cmd) == ["io0", "io1", "io2"]


# -- pidfile --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"1234\n", 1234),
        (b"  77  ", 77),
        (b"", None),
        (b"\n", None),
        (b"abc", None),
        (b"-5", None),
        (b"0", None),
        (b"12 34", None),
        (b"\xff\xfe", None),
    ],
)
def test_read_pidfile(tmp_path: Path, content: bytes, expected: int | None) -> None:
    f = tmp_path / "pid"
    f.write_bytes(content)
    assert read_pidfile(str(f)) == expected


def test_read_pidfile_missing(tmp_path: Path) -> None:
    assert read_pidfile(str(tmp_path / "nope")) is None


def test_find_vmm_rejects_bad_sandbox_id(paths: HostPaths) -> None:
    with pytest.raises(IdError):
        find_vmm(paths, "../etc")


def test_find_vmm_nothing_there(paths: HostPaths) -> None:
    assert find_vmm(paths, "nosuch", scan=False) is None
    assert find_vmm(paths, "nosuch") is None


@pytest.mark.parametrize("content", ["", "garbage\n", f"{os.getpid()}\n", "999999999\n"])
def test_find_vmm_without_qemu_never_accepts_the_pidfile(
    paths: HostPaths, vm_dir: Path, content: str
) -> None:
    """Empty, garbage, a live non-QEMU pid (this test), a pid that does not exist: None."""
    (vm_dir / "sb").mkdir()
    (vm_dir / "sb" / "pid").write_text(content)
    assert find_vmm(paths, "sb", scan=False) is None
    assert find_vmm(paths, "sb", hint_pid=os.getpid()) is None


def test_is_same_for_a_non_vmm(paths: HostPaths) -> None:
    me = Vmm(os.getpid(), procfs.start_time(paths.proc, os.getpid()), (), False)
    assert not is_same(paths, me)  # no -name at all
    assert not is_same(paths, me, "sb")
    assert not is_vmm_of(paths, os.getpid(), "sb")


# -- real QEMU ------------------------------------------------------------------------------
@pytest.mark.qemu
@pytest.mark.parametrize("debug_threads", [False, True])
def test_find_by_pidfile(
    qemu: Callable[..., QemuHandle], paths: HostPaths, debug_threads: bool
) -> None:
    sid = new_id("sb1")
    q = qemu(sid, debug_threads=debug_threads, paused=True)
    vmm = find_vmm(paths, sid, scan=False)
    assert vmm is not None
    assert vmm.pid == q.pid
    assert vmm.start == q.start == procfs.start_time(paths.proc, q.pid)
    assert vmm.debug_threads is debug_threads
    assert vmm.name == f"sandbox-{sid}"
    assert vmm.cmdline[vmm.cmdline.index("-name") + 1].startswith(f"sandbox-{sid}")
    assert is_same(paths, vmm)
    assert is_same(paths, Vmm(q.pid, q.start, (), False), sid)  # rebuilt from the store
    assert not is_same(paths, Vmm(q.pid, q.start, (), False), "other")
    assert not is_same(paths, Vmm(q.pid, q.start + 1, (), False), sid)
    assert is_vmm_of(paths, q.pid, sid)
    assert not is_vmm_of(paths, q.pid, "sb")


@pytest.mark.qemu
@pytest.mark.parametrize("debug_threads", [False, True])
@pytest.mark.parametrize("how", ["deleted", "renamed", "empty", "garbage"])
def test_find_by_scan_without_a_usable_pidfile(
    qemu: Callable[..., QemuHandle], paths: HostPaths, debug_threads: bool, how: str
) -> None:
    sid = new_id("sb2")
    q = qemu(sid, debug_threads=debug_threads, paused=True)
    if how == "deleted":
        q.pidfile.unlink()
    elif how == "renamed":
        q.pidfile.rename(q.dir / "pid.old")
    else:
        q.pidfile.write_text("" if how == "empty" else "not a pid\n")
    assert find_vmm(paths, sid, scan=False) is None
    vmm = find_vmm(paths, sid)
    assert vmm is not None
    assert (vmm.pid, vmm.start, vmm.debug_threads) == (q.pid, q.start, debug_threads)


@pytest.mark.qemu
def test_stale_pidfile_pointing_at_a_live_non_qemu(
    qemu: Callable[..., QemuHandle], paths: HostPaths
) -> None:
    sid = new_id("sb3")
    q = qemu(sid, paused=True)
    q.pidfile.write_text(f"{os.getpid()}\n")  # the pid was "reused" by this test process
    assert find_vmm(paths, sid, scan=False) is None
    vmm = find_vmm(paths, sid)
    assert vmm is not None and vmm.pid == q.pid


@pytest.mark.qemu
def test_find_by_hint_pid(qemu: Callable[..., QemuHandle], paths: HostPaths) -> None:
    sid = new_id("sb4")
    q = qemu(sid, paused=True)
    q.pidfile.unlink()
    vmm = find_vmm(paths, sid, hint_pid=q.pid, scan=False)
    assert vmm is not None and vmm.pid == q.pid
    assert find_vmm(paths, sid, hint_pid=os.getpid(), scan=False) is None
    # the hint is the QEMU of another sandbox: not ours
    assert find_vmm(paths, "other", hint_pid=q.pid, scan=False) is None


@pytest.mark.qemu
def test_name_prefix_is_not_a_match(qemu: Callable[..., QemuHandle], paths: HostPaths) -> None:
    """ "sandbox-<a1>" is a substring of "sandbox-<a1>b": the scan must parse, not grep."""
    a1 = new_id("a1")
    a1b = a1 + "b"
    long = qemu(a1b, paused=True)
    long.pidfile.unlink()
    assert find_vmm(paths, a1) is None
    short = qemu(a1, paused=True)
    short.pidfile.unlink()
    found_short, found_long = find_vmm(paths, a1), find_vmm(paths, a1b)
    assert found_short is not None and found_short.pid == short.pid
    assert found_long is not None and found_long.pid == long.pid
    # each pidfile pointing at the other sandbox's QEMU is refused
    (short.dir / "pid").write_text(f"{long.pid}\n")
    assert find_vmm(paths, a1, scan=False) is None


@pytest.mark.qemu
def test_pid_reuse_detected_after_kill(qemu: Callable[..., QemuHandle], paths: HostPaths) -> None:
    sid = new_id("sb5")
    q = qemu(sid, paused=True)
    vmm = find_vmm(paths, sid)
    assert vmm is not None and is_same(paths, vmm)
    # SIGKILL without reaping: the zombie keeps pid and start time, but no cmdline
    os.kill(q.pid, signal.SIGKILL)
    assert wait_until(lambda: procfs.status(paths.proc, q.pid)["State"].startswith("Z"), 10)
    assert not is_same(paths, vmm)
    assert find_vmm(paths, sid) is None  # the pidfile names a zombie: refused
    q.kill()  # reaps it (adopted at launch) and waits until /proc/<pid> is gone
    assert not os.path.exists(f"/proc/{q.pid}")
    assert not reap_if_child(q.pid)
    assert not is_same(paths, vmm)
    assert find_vmm(paths, sid) is None


@pytest.mark.qemu
def test_newest_wins_when_two_qemus_claim_a_sandbox(
    qemu: Callable[..., QemuHandle], paths: HostPaths, vm_dir: Path
) -> None:
    sid = new_id("sb6")
    old = qemu(sid, paused=True)
    (vm_dir / sid).rename(vm_dir / f"{sid}-old")  # keep the first one's socket out of the way
    new = qemu(sid, paused=True)
    new.pidfile.unlink()
    vmm = find_vmm(paths, sid)
    assert vmm is not None and vmm.pid == new.pid != old.pid


def test_read_pidfile_rereads_a_changed_pidfile(tmp_path: Path, mocker: Any) -> None:
    """A pidfile read before and unchanged since is not read again; a new pid in it (same
    size, rewritten in place or replaced) or its removal is seen at once."""
    from vmpin.runtimes import vmm as vmm_module

    p = tmp_path / "pid"
    p.write_text("1234\n")
    time.sleep(0.15)  # older than the timestamp grain (vmpin.linux.files.SETTLE_NS)
    reads = mocker.spy(vmm_module, "read_bytes")
    assert read_pidfile(str(p)) == 1234
    assert read_pidfile(str(p)) == 1234
    assert reads.call_count == 1
    p.write_text("4321\n")  # in place, same size
    assert read_pidfile(str(p)) == 4321
    new = tmp_path / "pid.new"
    new.write_text("5678\n")
    os.replace(new, p)
    assert read_pidfile(str(p)) == 5678
    p.unlink()
    assert read_pidfile(str(p)) is None
    p.mkdir()  # not a regular file: refused, as before
    assert read_pidfile(str(p)) is None


@pytest.mark.qemu
def test_a_process_posing_as_qemu_is_not_adopted(
    qemu: Callable[..., QemuHandle], paths: HostPaths
) -> None:
    """The QEMU dies and leaves its pidfile; a user's process with QEMU's argv (``-name
    sandbox-<id>``) is not the sandbox's VMM: it does not run as the sandbox's runner, the
    VM dir's owner (issue 26: it was adopted, its threads pinned, the sandbox kept alive)."""
    import subprocess

    q = qemu(new_id("pose"), smp=1)
    sid, dead = q.sandbox_id, q.pid
    q.kill()
    assert read_pidfile(os.path.join(paths.vm_dir, sid, "pid")) == dead  # left behind

    def pose(uid: int | None) -> subprocess.Popen[bytes]:
        def drop() -> None:
            if uid is not None:
                os.setgid(uid)
                os.setuid(uid)

        return subprocess.Popen(
            [Q, "-c", "sleep 60; :", "qemu", "-name", f"sandbox-{sid}", "-smp", "1"],
            executable="/bin/sh", preexec_fn=drop, start_new_session=True,
        )  # fmt: skip

    def alone(p: subprocess.Popen[bytes]) -> bool:
        """Only the shell has QEMU's argv: its child (forked with the same argv) has exec'd
        sleep -- else a scan may find the child first, in the moment before its exec."""
        try:
            with open(f"/proc/{p.pid}/task/{p.pid}/children") as f:
                kids = [int(k) for k in f.read().split()]
            return (
                procfs.cmdline(paths.proc, p.pid)[0] == Q
                and bool(kids)
                and all(procfs.cmdline(paths.proc, k)[0] == "sleep" for k in kids)
            )
        except (OSError, IndexError, VmpinError):
            return False

    poser = pose(65534)
    try:
        assert wait_until(lambda: alone(poser), 5)
        assert find_vmm(paths, sid, hint_pid=dead, scan=True) is None
        assert find_vmm(paths, sid, hint_pid=poser.pid, scan=True) is None
        assert not is_vmm_of(paths, poser.pid, sid)
    finally:
        os.killpg(poser.pid, signal.SIGKILL)  # the shell and its sleep: the group it leads
        poser.wait()
    # the same command line run by the VM dir's owner is found: the argv check still passes,
    # the runner's uid is what told the two apart
    twin = pose(None)
    try:
        assert wait_until(lambda: alone(twin), 5)
        found = find_vmm(paths, sid, hint_pid=dead, scan=True)
        assert found is not None and found.pid == twin.pid
    finally:
        os.killpg(twin.pid, signal.SIGKILL)
        twin.wait()
