"""Thread classification and the QMP client, against real QEMUs started like Kata's.

The fallback tests reproduce Kata's default: no debug-threads, and the QMP socket held by
another client (the shim).  The expected vCPU index -> tid map is always taken from QMP
before the socket is grabbed, so every layer is checked against the exact truth.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pytest_mock import MockerFixture

from tests.support.capabilities import HOST_LACKS
from tests.support.qemu_util import (
    QemuHandle,
    debugfs_mount_points,
    hold_qmp,
    launch,
    mounted_debugfs,
    qemu_factory,
    spin_bios,
    start_qemu,
    wait_until,
)
from tests.support.session import new_id
from vmpin.core.errors import ProcessGone, QmpError
from vmpin.linux import debugfs, procfs
from vmpin.linux.paths import HostPaths
from vmpin.runtimes.qmp import QmpClient, QmpTimeout, query_vmm
from vmpin.runtimes.threads import (
    Classification,
    VmmThread,
    classify,
    find_vhost_kthreads,
    vhost_kthreads_possible,
)
from vmpin.runtimes.vmm import Vmm, find_vmm
from vmpin.state.records import ThreadRec

#: the BIOS of a diskless QEMU spins a vCPU for a few seconds (~5 s seen here) before idling
FALLBACK_WAIT = 30.0


@pytest.fixture
def qemu(vm_dir: Path) -> Iterator[Callable[..., QemuHandle]]:
    with qemu_factory(vm_dir) as start:
        yield start


class IdleVm(NamedTuple):
    q: QemuHandle
    cpus: dict[int, int]
    iothreads: dict[str, int]
    #: the pass that first identified every vCPU, polling from boot with QMP held
    first_complete: Classification
    #: vCPU indexes some pass before it reported missing (vCPU 0 while the BIOS spins)
    seen_missing: frozenset[int]
    #: every polled pass until then: (vCPUs found, vCPUs reported missing)
    passes: tuple[tuple[dict[int, int], tuple[int, ...]], ...]


def in_kvm_run(q: QemuHandle, tid: int) -> bool:
    fields = procfs.syscall("/proc", q.pid, tid)
    return len(fields) > 2 and fields[2] == "0xae80"


@pytest.fixture(scope="module")
def idle_vm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[IdleVm]:
    """One Kata-like VM (no names, running) shared by the fallback tests.

    Its boot is itself the test of Kata's default case without any debugfs (an agent that
    may not mount one: ``debugfs_ns_timeout=None``): from start, with QMP held by another
    client, classify() is polled until it has found every vCPU.  A diskless QEMU's SeaBIOS
    keeps vCPU 0 busy for ~5 s here (longer on a loaded host) before it halts, and that wait
    is paid once per module.
    """
    with start_qemu(tmp_path_factory.mktemp("idle"), new_id("idle"), smp=2, accel="kvm") as q:
        cpus, iothreads = truth(q)
        paths = HostPaths(vm_dir=str(q.dir.parent))
        vmm = vmm_of(paths, q)
        seen_missing: set[int] = set()
        passes: list[tuple[dict[int, int], tuple[int, ...]]] = []

        def done(c: Classification) -> bool:
            seen_missing.update(c.missing_vcpus)
            passes.append((c.vcpus(), c.missing_vcpus))
            return len(c.vcpus()) == 2

        with hold_qmp(q.qmp_sock):
            first = classify_until(
                done, paths, vmm, str(q.qmp_sock), qmp_timeout=0.1, timeout=90,
                debugfs_ns_timeout=None,
            )  # fmt: skip
        yield IdleVm(q, cpus, iothreads, first, frozenset(seen_missing), tuple(passes))


def truth(q: QemuHandle) -> tuple[dict[int, int], dict[str, int]]:
    """vCPU index -> tid and iothread id -> tid, from QMP (the socket must be free)."""
    with QmpClient(str(q.qmp_sock), timeout=5.0) as qmp:
        cpus = {index: tid for index, tid, _props in qmp.query_cpus_fast()}
        iothreads = dict(qmp.query_iothreads())
    return cpus, iothreads


def vmm_of(paths: HostPaths, q: QemuHandle) -> Vmm:
    vmm = find_vmm(paths, q.sandbox_id, hint_pid=q.pid, scan=False)
    assert vmm is not None
    return vmm


def lpage_tids(q: QemuHandle) -> list[int]:
    out = []
    for tid in q.tids():
        try:
            if procfs.comm("/proc", q.pid, tid).startswith("kvm-nx-lpage"):
                out.append(tid)
        except ProcessGone:
            pass
    return out


def assert_consistent(c: Classification, q: QemuHandle) -> None:
    """Every thread of the process appears exactly once; helpers are never vCPUs."""
    tids = [t.tid for t in c.threads]
    assert len(tids) == len(set(tids))
    assert set(q.tids()) <= set(tids)
    for t in c.threads:
        assert t.role in ("vcpu", "iothread", "vhost", "emulator")
        assert (t.index is not None) == (t.role == "vcpu")
    for tid in lpage_tids(q):
        assert c.by_tid()[tid].role == "emulator"


def classify_until(
    cond: Callable[[Classification], bool],
    *args: object,
    timeout: float = FALLBACK_WAIT,
    **kw: object,
) -> Classification:
    deadline = time.monotonic() + timeout
    while True:
        c = classify(*args, **kw)  # type: ignore[arg-type]
        if cond(c) or time.monotonic() > deadline:
            return c
        time.sleep(0.1)


# -- QMP client -----------------------------------------------------------------------------
@pytest.mark.qemu
def test_qmp_client_against_qemu(qemu: Callable[..., QemuHandle]) -> None:
    q = qemu(new_id("qmp1"), smp=2, iothreads=("io0", "io1"), paused=True)
    with QmpClient(str(q.qmp_sock)) as qmp:
        assert qmp.greeting is not None and "QMP" in qmp.greeting
        assert qmp.peer_pid == q.pid
        cpus = qmp.query_cpus_fast()
        assert [c[0] for c in cpus] == [0, 1]
        assert {c[1] for c in cpus} <= set(q.tids())
        assert {"socket-id", "core-id", "thread-id"} <= set(cpus[0][2])
        iothreads = qmp.query_iothreads()
        assert sorted(i[0] for i in iothreads) == ["io0", "io1"]
        assert qmp.execute("query-name") == {"name": f"sandbox-{q.sandbox_id}"}
        with pytest.raises(QmpError, match="CommandNotFound"):
            qmp.execute("no-such-command")
        assert qmp.execute("query-status")["status"] == "prelaunch"  # still usable after error
    # closed on exit: the chardev is free again for the next client
    peer, cpus2, _ = query_vmm(str(q.qmp_sock))
    assert peer == q.pid and cpus2 == cpus


@pytest.mark.qemu
def test_qmp_held_by_another_client_times_out_quickly(qemu: Callable[..., QemuHandle]) -> None:
    q = qemu(new_id("qmp2"), paused=True)
    with hold_qmp(q.qmp_sock):
        t0 = time.monotonic()
        with pytest.raises(QmpTimeout, match="no greeting"), QmpClient(str(q.qmp_sock)):
            pass
        assert time.monotonic() - t0 < 0.6
        for _ in range(3):  # queued connects fill QEMU's backlog: then connect itself fails
            t0 = time.monotonic()
            with pytest.raises(QmpError):
                QmpClient(str(q.qmp_sock), timeout=0.3).connect()
            assert time.monotonic() - t0 < 0.6
    # once the holder leaves, QMP answers again (after the stale queued connections)
    assert wait_until(lambda: _qmp_ok(q.qmp_sock), 10)


def _qmp_ok(path: Path) -> bool:
    try:
        query_vmm(str(path), timeout=1.0)
    except QmpError:
        return False
    return True


def test_qmp_no_socket(tmp_path: Path) -> None:
    t0 = time.monotonic()
    with pytest.raises(QmpError, match="cannot connect"):
        QmpClient(str(tmp_path / "nope.sock")).connect()
    assert time.monotonic() - t0 < 0.5


class FakeQmp:
    """A tiny real QMP server on a unix socket, scripted per test (for protocol edge cases)."""

    def __init__(self, path: Path, script: Callable[[socket.socket], None]) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(1)
        self.thread = threading.Thread(target=self._serve, args=(script,), daemon=True)
        self.thread.start()

    def _serve(self, script: Callable[[socket.socket], None]) -> None:
        conn, _ = self.sock.accept()
        with conn:
            script(conn)

    def close(self) -> None:
        self.thread.join(5)
        self.sock.close()


def _recv_cmd(conn: socket.socket) -> dict[str, object]:
    buf = b""
    while b"\n" not in buf:
        chunk = conn.recv(4096)
        if not chunk:
            raise ConnectionError("client went away")
        buf += chunk
    cmd = json.loads(buf.split(b"\n")[0])
    assert isinstance(cmd, dict)
    return cmd


GREETING = b'{"QMP": {"version": {}, "capabilities": []}}\r\n'


def test_qmp_skips_events_and_foreign_replies(tmp_path: Path) -> None:
    def script(conn: socket.socket) -> None:
        conn.sendall(GREETING)
        cmd = _recv_cmd(conn)
        conn.sendall(json.dumps({"return": {}, "id": cmd["id"]}).encode() + b"\r\n")
        cmd = _recv_cmd(conn)
        assert cmd["execute"] == "query-iothreads"
        # an event, a reply to some other command, then ours split over two writes
        conn.sendall(b'{"event": "RESUME", "timestamp": {}}\r\n{"return": [], "id": "x"}\r\n')
        reply = json.dumps({"return": [{"id": "io0", "thread-id": 42}], "id": cmd["id"]})
        conn.sendall(reply[:10].encode())
        time.sleep(0.05)
        conn.sendall(reply[10:].encode() + b"\r\n")

    server = FakeQmp(tmp_path / "q.sock", script)
    try:
        with QmpClient(str(tmp_path / "q.sock")) as qmp:
            assert qmp.query_iothreads() == [("io0", 42)]
            assert [e["event"] for e in qmp.events] == ["RESUME"]
            assert qmp.peer_pid == os.getpid()
    finally:
        server.close()


@pytest.mark.parametrize(
    ("greeting", "match"),
    [
        (b"not json\r\n", "not JSON"),
        (b"[1, 2]\r\n", "not a JSON object"),
        (b'{"hello": 1}\r\n', "unexpected greeting"),
        (b"", "closed by QEMU"),
    ],
)
def test_qmp_bad_greetings(tmp_path: Path, greeting: bytes, match: str) -> None:
    def script(conn: socket.socket) -> None:
        conn.sendall(greeting)

    server = FakeQmp(tmp_path / "q.sock", script)
    try:
        with pytest.raises(QmpError, match=match):
            QmpClient(str(tmp_path / "q.sock"), timeout=2.0).connect()
    finally:
        server.close()


def test_qmp_command_timeout_and_malformed_reply(tmp_path: Path) -> None:
    def script(conn: socket.socket) -> None:
        conn.sendall(GREETING)
        cmd = _recv_cmd(conn)
        conn.sendall(json.dumps({"return": {}, "id": cmd["id"]}).encode() + b"\r\n")
        cmd = _recv_cmd(conn)
        conn.sendall(json.dumps({"return": [{"id": "io0"}], "id": cmd["id"]}).encode() + b"\n")
        _recv_cmd(conn)  # never answered
        time.sleep(0.5)

    server = FakeQmp(tmp_path / "q.sock", script)
    try:
        with QmpClient(str(tmp_path / "q.sock"), command_timeout=0.2) as qmp:
            with pytest.raises(QmpError, match="malformed"):
                qmp.query_iothreads()
            t0 = time.monotonic()
            with pytest.raises(QmpTimeout):
                qmp.execute("query-status")
            assert time.monotonic() - t0 < 0.5
            with pytest.raises(QmpError, match="not connected"):
                qmp.execute("query-status")
    finally:
        server.close()


# -- classification: QMP --------------------------------------------------------------------
@pytest.mark.qemu
@pytest.mark.parametrize("paused", [True, False])
def test_classify_via_qmp(qemu: Callable[..., QemuHandle], paths: HostPaths, paused: bool) -> None:
    q = qemu(new_id("c1"), smp=2, paused=paused)
    cpus, iothreads = truth(q)
    c = classify(paths, vmm_of(paths, q), str(q.qmp_sock))
    assert c.vcpus() == cpus
    assert sorted(cpus) == [0, 1]
    assert [(t.label, t.tid) for t in c.by_role("iothread")] == [("io0", iothreads["io0"])]
    assert c.layers[0] == "qmp"
    assert {c.by_tid()[tid].layer for tid in cpus.values()} == {"qmp"}
    assert c.missing_vcpus == ()
    assert_consistent(c, q)
    assert {t.role for t in c.threads} - {"vcpu", "iothread"} <= {"emulator"}


@pytest.mark.qemu
def test_classify_qmp_is_fast_and_never_needs_the_kvm_layer(
    qemu: Callable[..., QemuHandle], paths: HostPaths, mocker: MockerFixture
) -> None:
    q = qemu(new_id("c2"), paused=False)
    vmm = vmm_of(paths, q)
    # fault injection: if the KVM fallback were consulted, it would blow up
    mocker.patch("vmpin.linux.procfs.syscall", side_effect=AssertionError("KVM layer used"))
    t0 = time.monotonic()
    c = classify(paths, vmm, str(q.qmp_sock), kvm_retry_delay=5.0)
    assert time.monotonic() - t0 < 2.0
    assert sorted(c.vcpus()) == [0, 1]


# -- classification: names ------------------------------------------------------------------
@pytest.mark.qemu
@pytest.mark.kvm
@pytest.mark.parametrize("paused", [True, False])
def test_classify_via_names_with_qmp_held(
    qemu: Callable[..., QemuHandle], paths: HostPaths, paused: bool, mocker: MockerFixture
) -> None:
    q = qemu(new_id("n1"), smp=2, debug_threads=True, paused=paused)
    cpus, iothreads = truth(q)
    vmm = vmm_of(paths, q)
    assert vmm.debug_threads
    with hold_qmp(q.qmp_sock):
        mocker.patch("vmpin.linux.procfs.syscall", side_effect=AssertionError("KVM layer used"))
        c = classify(paths, vmm, str(q.qmp_sock), kvm_retry_delay=5.0)
    assert c.vcpus() == cpus
    assert {c.by_tid()[tid].label for tid in cpus.values()} == {"CPU 0/KVM", "CPU 1/KVM"}
    assert [(t.label, t.tid, t.layer) for t in c.by_role("iothread")] == [
        ("io0", iothreads["io0"], "names")
    ]
    assert c.layers == ["names"]
    assert any("qmp unavailable" in n for n in c.notes)
    # the monitor's own iothread is named "IO mon_iothread": an emulator thread
    mon = [t for t in c.threads if t.label == "IO mon_iothread"]
    assert mon and mon[0].role == "emulator"
    assert_consistent(c, q)


@pytest.mark.qemu
@pytest.mark.tcg
def test_classify_tcg_names_and_no_kvm_facts(
    qemu: Callable[..., QemuHandle], paths: HostPaths
) -> None:
    named = qemu(new_id("t1"), accel="tcg", debug_threads=True)
    plain = qemu(new_id("t2"), accel="tcg")
    truth_named, _ = truth(named)
    truth_plain, _ = truth(plain)
    with hold_qmp(named.qmp_sock), hold_qmp(plain.qmp_sock):
        c = classify(paths, vmm_of(paths, named), str(named.qmp_sock))
        assert c.vcpus() == truth_named
        assert {t.label for t in c.by_role("vcpu")} == {"CPU 0/TCG", "CPU 1/TCG"}
        c = classify(paths, vmm_of(paths, plain), str(plain.qmp_sock))
        assert c.vcpus() == {}
        assert any("no kvm-vcpu fds" in n for n in c.notes)
        # what it had learned from QMP earlier, it keeps
        earlier = {tid: ThreadRec(tid, "vcpu", ix, None, "qmp") for ix, tid in truth_plain.items()}
        c = classify(paths, vmm_of(paths, plain), str(plain.qmp_sock), earlier)
        assert c.vcpus() == truth_plain
        assert {t.layer for t in c.by_role("vcpu")} == {"remembered"}


# -- classification: the KVM fallback -------------------------------------------------------
@pytest.mark.qemu
@pytest.mark.kvm
def test_classify_fallback_from_boot_no_names_qmp_held(idle_vm: IdleVm) -> None:
    """Kata's default from boot: polled passes find every vCPU, exactly, without QMP, names
    or debugfs.

    While the BIOS spins, vCPU 0 reads "running": a pass retries it briefly, then reports it
    in missing_vcpus; a later pass finds it.
    """
    q, cpus, iothreads, c, seen_missing, passes = idle_vm
    assert c.vcpus() == cpus, c.notes
    assert {c.by_tid()[tid].layer for tid in cpus.values()} == {"kvm-syscall"}
    assert c.missing_vcpus == ()
    # every pass accounts for each vCPU, found or missing, and never names a wrong thread
    for found, missing in passes:
        assert set(found) | set(missing) == {0, 1} and not set(found) & set(missing), passes
        assert all(cpus[ix] == tid for ix, tid in found.items()), (passes, cpus)
    # the BIOS spin was seen: vCPU 0 was reported missing by an early pass, found by a later one
    assert 0 in seen_missing and len(passes) >= 2, passes
    assert any("qmp unavailable" in n for n in c.notes)
    assert c.by_tid()[iothreads["io0"]].role == "emulator"
    assert_consistent(c, q)


@pytest.mark.qemu
@pytest.mark.kvm
def test_classify_fallback_exact_mapping(idle_vm: IdleVm, paths: HostPaths) -> None:
    """Exact index -> tid from ioctl(KVM_RUN) + the kvm-vcpu fd links, QMP held, no names, no
    debugfs."""
    q, cpus, iothreads, *_ = idle_vm
    vmm = vmm_of(paths, q)
    with hold_qmp(q.qmp_sock):
        c = classify_until(
            lambda c: len(c.vcpus()) == 2, paths, vmm, str(q.qmp_sock), debugfs_ns_timeout=None
        )
    assert c.vcpus() == cpus, c.notes
    assert {c.by_tid()[tid].layer for tid in cpus.values()} == {"kvm-syscall"}
    assert c.missing_vcpus == ()
    assert "kvm-syscall" in c.layers and "qmp" not in c.layers
    # documented blind spot: without names or QMP an iothread is an emulator thread
    assert c.by_tid()[iothreads["io0"]].role == "emulator"
    assert c.by_tid()[iothreads["io0"]].layer == "none"
    assert lpage_tids(q), "expected KVM's kvm-nx-lpage-recovery thread inside QEMU"
    assert_consistent(c, q)


@pytest.mark.qemu
@pytest.mark.kvm
def test_kvm_nx_lpage_thread_looks_like_a_vcpu_but_is_not(
    idle_vm: IdleVm, paths: HostPaths
) -> None:
    """On this kernel the helper's syscall file reads ioctl(vCPU 0 fd, KVM_RUN) forever."""
    q, cpus, *_ = idle_vm
    helpers = lpage_tids(q)
    if not helpers:
        pytest.skip(HOST_LACKS + "a kvm-nx-lpage-recovery thread (kernel without the NX fix)")
    fields = procfs.syscall(paths.proc, q.pid, helpers[0])
    c = classify_until(
        lambda c: len(c.vcpus()) == 2, paths, vmm_of(paths, q), None, debugfs_ns_timeout=None
    )
    assert c.by_tid()[helpers[0]].role == "emulator"
    assert c.by_tid()[helpers[0]].layer == "names"
    assert c.vcpus() == cpus
    if len(fields) > 2 and fields[2] == "0xae80":
        # the trap is real here: its syscall names a kvm-vcpu fd, as a halted vCPU's would
        target = procfs.fd_target(paths.proc, q.pid, int(fields[1], 16))
        assert target is not None and target.startswith("anon_inode:kvm-vcpu:")


@pytest.mark.qemu
@pytest.mark.kvm
def test_classify_fallback_paused_finds_nothing_but_remembers(
    qemu: Callable[..., QemuHandle], paths: HostPaths
) -> None:
    q = qemu(new_id("p1"), smp=2, paused=True)
    cpus, iothreads = truth(q)
    vmm = vmm_of(paths, q)
    with hold_qmp(q.qmp_sock):
        t0 = time.monotonic()
        c = classify(paths, vmm, None, kvm_retries=2, kvm_retry_delay=0.01)
        assert time.monotonic() - t0 < 1.0
        assert c.vcpus() == {}
        assert c.missing_vcpus == (0, 1)
        assert any("no vCPU thread in KVM_RUN" in n for n in c.notes)
        assert_consistent(c, q)
        # an earlier pass (QMP, before the shim grabbed the socket) is remembered
        earlier = classify_from_truth(cpus, iothreads)
        t0 = time.monotonic()
        c = classify(paths, vmm, str(q.qmp_sock), earlier, qmp_timeout=0.1, kvm_retry_delay=5.0)
        assert time.monotonic() - t0 < 2.0  # nothing missing: no retry sleeps
    assert c.vcpus() == cpus
    assert c.by_tid()[iothreads["io0"]].role == "iothread"
    assert c.by_tid()[iothreads["io0"]].label == "io0"
    assert {t.layer for t in c.threads if t.role != "emulator"} == {"remembered"}
    assert "remembered" in c.layers and set(c.layers) <= {"names", "remembered"}
    assert c.missing_vcpus == ()


def classify_from_truth(cpus: dict[int, int], iothreads: dict[str, int]) -> dict[int, ThreadRec]:
    out = {tid: ThreadRec(tid, "vcpu", ix, None, "qmp") for ix, tid in cpus.items()}
    out.update({tid: ThreadRec(tid, "iothread", None, io, "qmp") for io, tid in iothreads.items()})
    return out


@pytest.mark.qemu
@pytest.mark.parametrize("record", [ThreadRec, VmmThread])
def test_current_evidence_beats_a_wrong_memory(
    qemu: Callable[..., QemuHandle], paths: HostPaths, record: type
) -> None:
    """Both record types work as memory: store.ThreadRec (idx) and VmmThread (index)."""
    q = qemu(new_id("r1"), smp=2, paused=True)
    cpus, _ = truth(q)
    emulator = q.pid  # the main thread
    wrong = {emulator: record(emulator, "vcpu", 0, None, "kvm-syscall")}
    c = classify(paths, vmm_of(paths, q), str(q.qmp_sock), wrong)
    assert c.vcpus() == cpus
    assert c.by_tid()[emulator].role == "emulator"
    assert any("remembered as vCPU 0" in n for n in c.notes)
    # and when nothing better is known, the same memory is used
    right = {tid: record(tid, "vcpu", ix, None, "qmp") for ix, tid in cpus.items()}
    with hold_qmp(q.qmp_sock):
        c = classify(paths, vmm_of(paths, q), None, right)
    assert c.vcpus() == cpus
    assert {t.layer for t in c.by_role("vcpu")} == {"remembered"}


@pytest.mark.qemu
@pytest.mark.kvm
def test_classify_fallback_via_debugfs(idle_vm: IdleVm, paths: HostPaths, tmp_path: Path) -> None:
    q, cpus, *_ = idle_vm
    with mounted_debugfs(tmp_path / "sys") as sys_root:
        dpaths = paths._replace(sys=str(sys_root))
        kvm_dirs = list((sys_root / "kernel" / "debug" / "kvm").glob(f"{q.pid}-*"))
        assert len(kvm_dirs) == 1
        for index, tid in cpus.items():
            assert int((kvm_dirs[0] / f"vcpu{index}" / "pid").read_text()) == tid
        c = classify(dpaths, vmm_of(paths, q), None, kvm_retry_delay=5.0)
    assert c.vcpus() == cpus
    assert {c.by_tid()[tid].layer for tid in cpus.values()} == {"debugfs"}
    assert "debugfs" in c.layers


# -- classification: debugfs in a private mount namespace (issue 25) ------------------------
class SpinVm(NamedTuple):
    q: QemuHandle
    cpus: dict[int, int]


def cpu_ns(q: QemuHandle, tid: int) -> int:
    """Time the thread has spent on a CPU (schedstat, ns)."""
    with open(f"/proc/{q.pid}/task/{tid}/schedstat") as f:
        return int(f.read().split()[0])


@pytest.fixture(scope="module")
def spin_vm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SpinVm]:
    """A Kata-like VM (no names) whose vCPU 0 runs guest code without pause for its whole life
    (tests/support/qemu_util.spin_bios): the case the syscall files can never see."""
    d = tmp_path_factory.mktemp("spin")
    bios = spin_bios(d)
    q = launch(d / "vm", new_id("spin"), smp=2, accel="kvm", extra=("-bios", str(bios)))
    try:
        cpus, _ = truth(q)
        # vCPU 0 has entered the guest (its debugfs pid is 0 until its first KVM_RUN)
        assert wait_until(lambda: cpu_ns(q, cpus[0]) > 50_000_000, 20), "vCPU 0 never ran"
        yield SpinVm(q, cpus)
    finally:
        q.kill()


@pytest.mark.qemu
@pytest.mark.kvm
def test_debugfs_ns_names_a_busy_vcpu_every_time(spin_vm: SpinVm, paths: HostPaths) -> None:
    """Issue 25: vCPU 0 never leaves the guest, debugfs is not mounted on the host, QMP is held
    and threads have no names.  Each of 20 fresh passes (nothing remembered) names both vCPUs
    exactly, through a debugfs mounted in a private mount namespace; the host's tree has no
    debugfs before or after.  (Before the debugfs-ns layer, every pass missed vCPU 0.)"""
    q, cpus = spin_vm
    host_kvm = Path("/sys/kernel/debug/kvm")
    assert not host_kvm.exists()
    assert "/sys/kernel/debug" not in debugfs_mount_points()
    vmm = vmm_of(paths, q)
    with hold_qmp(q.qmp_sock):
        passes = [classify(paths, vmm, str(q.qmp_sock), qmp_timeout=0.1) for _ in range(20)]
    assert [c.vcpus() for c in passes] == [cpus] * 20, [c.notes for c in passes]
    for c in passes:
        assert {c.by_tid()[tid].layer for tid in cpus.values()} == {"debugfs-ns"}
        assert c.missing_vcpus == ()
        assert "debugfs-ns" in c.layers
        assert_consistent(c, q)
    assert not host_kvm.exists()
    assert "/sys/kernel/debug" not in debugfs_mount_points()
    # the control: vCPU 0 really was busy throughout, the syscall files never show it
    blind = [classify(paths, vmm, None, kvm_retries=2, debugfs_ns_timeout=None) for _ in range(5)]
    assert [(c.vcpus(), c.missing_vcpus) for c in blind] == [({1: cpus[1]}, (0,))] * 5
    assert {c.by_tid()[cpus[0]].role for c in blind} == {"emulator"}


@pytest.mark.qemu
@pytest.mark.kvm
def test_debugfs_ns_never_for_a_fixture_sysfs_root(
    spin_vm: SpinVm, paths: HostPaths, tmp_path: Path, mocker: MockerFixture
) -> None:
    """A sysfs root that is not the host's /sys never spawns the private reader."""
    q, cpus = spin_vm
    spawn = mocker.patch("os.posix_spawn", side_effect=AssertionError("child spawned"))
    c = classify(paths._replace(sys=str(tmp_path / "sys")), vmm_of(paths, q), None, kvm_retries=0)
    assert spawn.call_count == 0
    assert c.vcpus() == {1: cpus[1]} and c.missing_vcpus == (0,)


@pytest.mark.qemu
@pytest.mark.kvm
def test_debugfs_ns_not_spawned_when_the_syscall_files_suffice(
    idle_vm: IdleVm, paths: HostPaths, mocker: MockerFixture
) -> None:
    """Every vCPU asleep in KVM_RUN (the idle VM): one look at the syscall files names them
    all, and no child is spawned (it costs ~10 ms: bench/bench_debugfs.py).

    An idle guest still wakes now and then (a timer), and on a loaded host a vCPU can be
    caught running at every retry; then the fallback is right to spawn.  So each
    classification that the syscall files alone answered must have spawned nothing, and most
    of them must be such (the idle VM's vCPUs sleep nearly all the time)."""
    q, cpus, *_ = idle_vm
    spawn = mocker.spy(os, "posix_spawn")
    by_syscalls = 0
    for _ in range(10):
        before = spawn.call_count
        c = classify(paths, vmm_of(paths, q), None)
        assert c.vcpus() == cpus
        if {c.by_tid()[tid].layer for tid in cpus.values()} == {"kvm-syscall"}:
            by_syscalls += 1
            assert spawn.call_count == before
    assert by_syscalls >= 5


def _fake_unshare(bin_dir: Path, body: str) -> None:
    bin_dir.mkdir(exist_ok=True)
    exe = bin_dir / "unshare"
    exe.write_text("#!/bin/sh\n" + body + "\n")
    exe.chmod(0o755)


REAL_UNSHARE = debugfs.find_binary("unshare")
#: setpriv (util-linux) drops CAP_SYS_ADMIN for real: the kernel's own EPERM
DROP_SYS_ADMIN = "/usr/bin/setpriv --bounding-set -sys_admin --inh-caps -sys_admin --"


@pytest.mark.qemu
@pytest.mark.kvm
@pytest.mark.parametrize(
    ("fault", "body", "why"),
    [
        ("no unshare binary", None, "no unshare binary"),
        ("unshare EPERM", f'exec {DROP_SYS_ADMIN} {REAL_UNSHARE} "$@"',
         "unshare failed: Operation not permitted"),
        ("mount EPERM", f'shift 4; exec {REAL_UNSHARE} --mount --propagation private --'
         f' {DROP_SYS_ADMIN} "$@"', "mount -t debugfs failed: mount: /sys/kernel/debug:"
         " permission denied"),
        ("timeout", 'echo $$ > "$(dirname "$0")/pid"; exec sleep 30', "timed out after 0.3 s"),
        ("exec refused", "", "cannot start"),
    ],
)  # fmt: skip
def test_debugfs_ns_faults_fall_back_to_the_syscall_files(
    spin_vm: SpinVm,
    paths: HostPaths,
    tmp_path: Path,
    mocker: MockerFixture,
    fault: str,
    body: str | None,
    why: str,
) -> None:
    """Whatever stops the private read, the pass goes on as before, with a note saying why:
    vCPU 1 (asleep in KVM_RUN) from its syscall file, busy vCPU 0 missing; nothing raises,
    nothing is left behind."""
    if REAL_UNSHARE is None or not os.access("/usr/bin/setpriv", os.X_OK):
        pytest.skip("util-linux unshare and setpriv are needed to make these faults")
    q, cpus = spin_vm
    bin_dir = tmp_path / "bin"
    if body is not None:
        _fake_unshare(bin_dir, body)
    mocker.patch.object(debugfs, "SEARCH_PATH", str(bin_dir))
    if fault == "exec refused":
        mocker.patch("os.posix_spawn", side_effect=PermissionError(13, "Permission denied"))
    t0 = time.monotonic()
    c = classify(paths, vmm_of(paths, q), None, debugfs_ns_timeout=0.3)
    assert time.monotonic() - t0 < 2.0
    notes = [n for n in c.notes if n.startswith("debugfs-ns unavailable")]
    assert len(notes) == 1 and why in notes[0], c.notes
    assert (c.vcpus(), c.missing_vcpus) == ({1: cpus[1]}, (0,))
    assert c.by_tid()[cpus[1]].layer == "kvm-syscall"
    if fault == "timeout":  # the child was killed and reaped: not even a zombie is left
        pid = int((bin_dir / "pid").read_text())
        assert not os.path.exists(f"/proc/{pid}")


# -- faults ---------------------------------------------------------------------------------
@pytest.mark.qemu
def test_thread_gone_mid_classification_is_skipped(
    qemu: Callable[..., QemuHandle], paths: HostPaths, mocker: MockerFixture
) -> None:
    q = qemu(new_id("g1"), smp=2, paused=True)
    cpus, _ = truth(q)
    vanishing = cpus[1]
    real_comm = procfs.comm

    def comm(proc: str, pid: int, tid: int | None = None) -> str:
        if tid == vanishing:
            raise ProcessGone(f"tid {tid} is gone (comm)")
        return real_comm(proc, pid, tid)

    mocker.patch("vmpin.linux.procfs.comm", side_effect=comm)
    c = classify(paths, vmm_of(paths, q), str(q.qmp_sock))
    assert vanishing not in c.by_tid()
    assert c.vcpus() == {0: cpus[0]}
    assert any(f"tid {vanishing} exited" in n for n in c.notes)


@pytest.mark.qemu
@pytest.mark.kvm
def test_thread_gone_during_kvm_scan_is_skipped(
    idle_vm: IdleVm, paths: HostPaths, mocker: MockerFixture
) -> None:
    q, cpus, *_ = idle_vm
    vmm = vmm_of(paths, q)
    real_syscall = procfs.syscall

    def syscall(proc: str, pid: int, tid: int | None = None) -> list[str]:
        if tid == cpus[0]:
            raise ProcessGone(f"tid {tid} is gone (syscall)")
        return real_syscall(proc, pid, tid)

    mocker.patch("vmpin.linux.procfs.syscall", side_effect=syscall)
    c = classify_until(lambda c: 1 in c.vcpus(), paths, vmm, None, debugfs_ns_timeout=None)
    assert cpus[0] not in c.by_tid()
    assert c.vcpus() == {1: cpus[1]}
    assert c.missing_vcpus == (0,)
    assert any(f"tid {cpus[0]} exited" in n for n in c.notes)


@pytest.mark.qemu
@pytest.mark.kvm
def test_remembered_vcpus_mean_no_syscall_reads_at_all(
    idle_vm: IdleVm, paths: HostPaths, mocker: MockerFixture
) -> None:
    """A steady-state pass (every vCPU known from before) costs no sleeps, no syscall reads
    and no private debugfs child."""
    q, cpus, *_ = idle_vm
    vmm = vmm_of(paths, q)
    first = classify_until(lambda c: len(c.vcpus()) == 2, paths, vmm, None)
    mocker.patch("vmpin.linux.procfs.syscall", side_effect=AssertionError("syscall read"))
    mocker.patch("os.posix_spawn", side_effect=AssertionError("child spawned"))
    t0 = time.monotonic()
    c = classify(paths, vmm, None, first.by_tid(), kvm_retry_delay=5.0)
    assert time.monotonic() - t0 < 1.0
    assert c.vcpus() == cpus
    assert {t.layer for t in c.by_role("vcpu")} == {"remembered"}


@pytest.mark.qemu
def test_classify_a_dead_or_reused_vmm_raises_process_gone(
    qemu: Callable[..., QemuHandle], paths: HostPaths
) -> None:
    q = qemu(new_id("g3"), paused=True)
    vmm = vmm_of(paths, q)
    with pytest.raises(ProcessGone):
        classify(paths, vmm._replace(start=vmm.start + 1), None)
    q.kill()
    with pytest.raises(ProcessGone):
        classify(paths, vmm, None)


# -- names on a real process that is not QEMU ------------------------------------------------
NAMER = r"""
import os, sys, threading
stop, out = threading.Event(), threading.Lock()
def named(name):
    tid = threading.get_native_id()
    with open(f"/proc/self/task/{tid}/comm", "w") as f:
        f.write(name)
    with out:  # one line per thread, never interleaved
        sys.stdout.write(f"{tid} {name}\n")
        sys.stdout.flush()
    stop.wait()
for n in sys.argv[1:]:
    threading.Thread(target=named, args=(n.replace("PID", str(os.getpid())),), daemon=True).start()
sys.stdin.read()
"""


@pytest.fixture
def named_threads() -> Iterator[Callable[..., tuple[int, dict[str, int]]]]:
    """A real process whose threads carry the names we choose; killed by pid afterwards."""
    procs: list[subprocess.Popen[str]] = []

    def start(*names: str) -> tuple[int, dict[str, int]]:
        p = subprocess.Popen(
            [sys.executable, "-c", NAMER, *names],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        procs.append(p)
        assert p.stdout is not None
        tids = {}
        for _ in names:
            line = p.stdout.readline()
            if not line:
                raise AssertionError(f"namer exited early: rc={p.wait(5)}")
            tid, name = line.rstrip("\n").split(" ", 1)
            tids[name] = int(tid)
        return p.pid, tids

    try:
        yield start
    finally:
        for p in procs:
            p.kill()
            p.wait(10)


def test_names_layer_on_real_threads(
    paths: HostPaths, named_threads: Callable[..., tuple[int, dict[str, int]]]
) -> None:
    pid, tids = named_threads(
        "vhost-PID", "CPU 3/KVM", "IO iothread-dat", "IO io0", "kvm-nx-lpage-re", "worker"
    )
    cmdline = ("qemu-system-x86_64", "-object", "iothread,id=iothread-data-0")
    vmm = Vmm(pid, procfs.start_time(paths.proc, pid), cmdline, True)
    c = classify(paths, vmm, None, vhost_kthreads={})
    by = c.by_tid()
    assert by[tids[f"vhost-{pid}"]] == VmmThread(
        tids[f"vhost-{pid}"], "vhost", None, f"vhost-{pid}", "names"
    )
    assert by[tids["CPU 3/KVM"]].role == "vcpu" and by[tids["CPU 3/KVM"]].index == 3
    # comm is cut at 15 bytes: the id is completed from the command line
    assert by[tids["IO iothread-dat"]].label == "iothread-data-0"
    assert by[tids["IO io0"]].label == "io0"
    assert by[tids["kvm-nx-lpage-re"]].role == "emulator"
    assert by[tids["worker"]].role == "emulator" and by[tids["worker"]].layer == "none"
    assert by[pid].role == "emulator"


# -- vhost kernel threads (pre-6.4 kernels), on a fixture /proc tree --------------------------
def _stat(pid: int, comm: str, ppid: int, start: int) -> str:
    tail = ["S", str(ppid)] + ["0"] * 50
    tail[19] = str(start)
    return f"{pid} ({comm}) " + " ".join(tail) + "\n"


def _task(root: Path, pid: int, comm: str, ppid: int, start: int, tid: int | None = None) -> None:
    d = root / str(pid) if tid is None else root / str(pid) / "task" / str(tid)
    d.mkdir(parents=True, exist_ok=True)
    (d / "comm").write_text(comm + "\n")
    (d / "stat").write_text(_stat(tid or pid, comm, ppid, start))


def fake_kernel(root: Path, release: str, modules: tuple[str, ...]) -> HostPaths:
    """Paths whose procfs root names kernel ``release`` and whose sysfs root has ``modules``
    (``/sys/module/<name>``; a name with a slash is a file under it)."""
    proc, sys_root = root / "proc", root / "sys"
    (proc / "sys" / "kernel").mkdir(parents=True, exist_ok=True)
    (proc / "sys" / "kernel" / "osrelease").write_text(release + "\n")
    for name in modules:
        where = sys_root / "module" / name
        if "/" in name:
            where.parent.mkdir(parents=True, exist_ok=True)
            where.write_text("Y\n")
        else:
            where.mkdir(parents=True, exist_ok=True)
    return HostPaths(proc=str(proc), sys=str(sys_root))


def fake_proc(root: Path, children_file: bool) -> Path:
    """QEMU pid 100 (threads 100, 101) with vhost kthreads 300 (owner 100) and 302 (owner 101),
    on a 5.15 kernel with vhost_net loaded."""
    proc = root / "proc"
    fake_kernel(root, "5.15.0-91-generic", ("vhost", "vhost_net"))
    _task(proc, 100, "qemu-system-x86", 1, 5000)
    (proc / "100" / "cmdline").write_text("qemu-system-x86_64\0-name\0sandbox-k\0")
    _task(proc, 100, "qemu-system-x86", 1, 5000, tid=100)
    _task(proc, 100, "qemu-system-x86", 1, 5001, tid=101)
    _task(proc, 2, "kthreadd", 0, 1)
    _task(proc, 300, "vhost-100", 2, 6000)
    _task(proc, 301, "kworker/0:1", 2, 6000)
    _task(proc, 302, "vhost-101", 2, 6000)
    _task(proc, 303, "vhost-999", 2, 6000)  # another VMM's
    _task(proc, 304, "vhost-100", 1, 6000)  # a user process that merely took the name
    if children_file:
        (proc / "2" / "task" / "2").mkdir(parents=True)
        (proc / "2" / "task" / "2" / "children").write_text("300 301 302 303 ")
    return proc


@pytest.mark.parametrize("children_file", [True, False])
def test_vhost_kthreads_from_a_fixture_tree(
    paths: HostPaths, tmp_path: Path, children_file: bool
) -> None:
    proc = fake_proc(tmp_path, children_file)
    fpaths = paths._replace(proc=str(proc), sys=str(tmp_path / "sys"))
    index = find_vhost_kthreads(fpaths)
    assert index == {
        100: [(300, "vhost-100")],
        101: [(302, "vhost-101")],
        999: [(303, "vhost-999")],
    }
    vmm = Vmm(100, 5000, ("qemu-system-x86_64", "-name", "sandbox-k"), False)
    c = classify(fpaths, vmm, None)
    assert [(t.tid, t.role, t.layer) for t in c.threads] == [
        (100, "emulator", "none"),
        (101, "emulator", "none"),
        (300, "vhost", "names"),
        (302, "vhost", "names"),
    ]
    assert any("cannot list" in n for n in c.notes)  # no fd table in the fixture


@pytest.mark.parametrize(
    ("release", "modules", "possible"),
    [
        # no vhost module at all (this machine's kernel): no worker of any kind
        ("6.1.0-18-amd64", (), False),
        ("5.15.0-91-generic", ("kvm", "tun"), False),
        # before 6.4 every vhost worker is a kernel thread
        ("5.15.0-91-generic", ("vhost", "vhost_net"), True),
        ("6.3.13", ("vhost_vsock",), True),
        # 6.4 on: threads of their owner, unless the kernel lets vhost use kthreads again
        ("6.4.0", ("vhost", "vhost_vsock"), False),
        ("6.12.48+deb13-amd64", ("vhost", "vhost_net"), False),
        ("6.17.1", ("vhost", "vhost/parameters/fork_from_owner_default"), True),
        # a release that does not parse counts as an old kernel
        ("weird", ("vhost",), True),
    ],
)
def test_vhost_kthreads_possible_by_kernel(
    tmp_path: Path, release: str, modules: tuple[str, ...], possible: bool
) -> None:
    paths = fake_kernel(tmp_path, release, modules)
    assert vhost_kthreads_possible(paths) is possible


def test_no_kthread_scan_where_none_can_exist(
    paths: HostPaths, tmp_path: Path, mocker: MockerFixture
) -> None:
    """On a 6.4+ kernel (or one without vhost) the kernel threads are not read at all: a
    pass that classifies a new VMM costs the same on a host of 2 or 2,000 kernel threads."""
    proc = fake_proc(tmp_path, children_file=True)
    fake_kernel(tmp_path, "6.12.48+deb13-amd64", ("vhost", "vhost_net"))
    comm = mocker.spy(procfs, "comm")
    assert find_vhost_kthreads(paths._replace(proc=str(proc), sys=str(tmp_path / "sys"))) == {}
    assert comm.call_count == 0


# -- the name parsers stand in for re (kept off the Kata hook): the same answers as the regexes
_CPU_NAME_RE = r"CPU (\d+)/(\w+)"


def _names_sample() -> list[str]:
    return ["CPU 0/KVM", "CPU 12/TCG", "CPU 1/", "CPU /KVM", "CPU 1/KVM x", "CPU 1/KV-M",
            "CPU ٣/KVM", "CPU 1/ßé_9", "CPU 01/KVM", "cpu 0/KVM", "CPU 0/KVM/x", "CPU 0",
            "vhost-123", "vhost-", "vhost-12a", "vhost-٣", "vhost-1\n", "CPU 1/KVM\n",
            "anon_inode:kvm-vcpu:3", "anon_inode:kvm-vcpu:", "anon_inode:kvm-vcpu:3 "]  # fmt: skip


@settings(max_examples=500, deadline=None)
@given(st.sampled_from(_names_sample()) | st.text(alphabet="CPU /vhost-0123٣_aéK\n", max_size=14))
def test_name_parsers_agree_with_the_regexes(text: str) -> None:
    import re

    from vmpin.runtimes.threads import _cpu_name, _number_after

    m = re.fullmatch(_CPU_NAME_RE, text)
    assert _cpu_name(text) == (int(m.group(1)) if m else None)
    for prefix in ("vhost-", "anon_inode:kvm-vcpu:"):
        m = re.fullmatch(re.escape(prefix) + r"(\d+)", text)
        assert _number_after(prefix, text) == (int(m.group(1)) if m else None)
