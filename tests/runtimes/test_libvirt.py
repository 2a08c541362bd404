"""vmpin.runtimes.libvirt against a real libvirtd and real domains (KVM, or TCG).

The oracle for classification is independent of libvirt's answer: libvirt starts QEMU with
``debug-threads=on``, so the kernel's ``comm`` of each thread says "CPU N/KVM" (or /TCG) and
"IO iothreadN".  Pins are checked three ways: libvirt's pin info, sched_getaffinity of each
thread, and the cpuset cgroup libvirt gave that thread.
"""

from __future__ import annotations

import errno
import os
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

pytest.importorskip("libvirt")

from tests.support.libvirt_util import DomainHandle, domain_factory, libvirtd_uri  # noqa: F401
from tests.support.qemu_util import wait_until
from tests.support.session import new_id
from vmpin.core.cpuset import CpuSet
from vmpin.core.errors import LibvirtError
from vmpin.linux.paths import HostPaths
from vmpin.runtimes import libvirt as lv

pytestmark = pytest.mark.libvirtd
NCPUS = os.cpu_count() or 1


def comm(pid: int, tid: int) -> str:
    return Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()


def cpuset_of(tid: int) -> CpuSet:
    """The cpus of the cpuset cgroup (v1) the thread is in."""
    for line in Path(f"/proc/{tid}/cgroup").read_text().splitlines():
        _, controllers, rel = line.split(":", 2)
        if "cpuset" in controllers.split(","):
            return CpuSet.parse(Path(f"/sys/fs/cgroup/cpuset{rel}/cpuset.cpus").read_text())
    raise AssertionError(f"tid {tid}: no cpuset cgroup")


@pytest.fixture
def conn(libvirtd_uri: str) -> Iterator[lv.Connection]:  # noqa: F811
    c = lv.Connection(libvirtd_uri, HostPaths())
    yield c
    c.close()


def find(conn: lv.Connection, handle: DomainHandle) -> lv.Domain:
    doms, errors = conn.domains()
    assert not [e for e in errors if handle.name in e]
    (dom,) = [d for d in doms if d.uuid == handle.uuid]
    return dom


def test_discovers_domain_with_qemu_identity(
    conn: lv.Connection,
    domain_factory: Callable[..., DomainHandle],  # noqa: F811
) -> None:
    h = domain_factory(vcpus=2, iothreads=1)
    d = find(conn, h)
    assert d.name == h.name and d.nvcpus == 2
    # the pid is the QEMU running this domain: its command line names the guest
    cmdline = Path(f"/proc/{d.pid}/cmdline").read_bytes().split(b"\0")
    assert b"qemu-system-x86_64" in os.path.basename(cmdline[0])
    assert any(h.name.encode() in arg for arg in cmdline)
    assert int(Path(f"/proc/{d.pid}/stat").read_text().rsplit(")", 1)[1].split()[19]) == d.start
    assert d.metadata_mask is None and d.sandbox_id == h.uuid


def test_classifies_every_thread_exactly(
    conn: lv.Connection,
    domain_factory: Callable[..., DomainHandle],  # noqa: F811
) -> None:
    h = domain_factory(vcpus=2, iothreads=2)
    d = find(conn, h)
    cl = conn.classify(d)
    accel = "KVM" if h.kvm else "TCG"
    assert {i: comm(d.pid, t) for i, t in cl.vcpus().items()} == {
        0: f"CPU 0/{accel}",
        1: f"CPU 1/{accel}",
    }
    io = {t.label: comm(d.pid, t.tid) for t in cl.by_role("iothread")}
    assert io == {"iothread1": "IO iothread1", "iothread2": "IO iothread2"}
    emulator = {t.tid for t in cl.by_role("emulator")}
    assert d.pid in emulator
    # every thread of the process is classified once
    tids = {int(t) for t in os.listdir(f"/proc/{d.pid}/task")}
    assert {t.tid for t in cl.threads} == tids
    assert len(cl.threads) == len(tids)
    for t in cl.by_role("emulator"):
        assert t.layer == ("kvm-helper" if comm(d.pid, t.tid).startswith("kvm-") else "libvirt")


def test_hot_plugged_vcpu_is_classified_on_the_next_pass(
    conn: lv.Connection,
    domain_factory: Callable[..., DomainHandle],  # noqa: F811
) -> None:
    """An idle pass reuses the last classification; a new thread (vCPU hot-plug) ends that."""
    import libvirt

    h = domain_factory(vcpus=2, iothreads=1, maxvcpus=3)
    d = find(conn, h)
    first = conn.classify(d)
    assert conn.classify(d) is first  # same QEMU, same threads: libvirt is not asked again
    h.dom.setVcpusFlags(3, libvirt.VIR_DOMAIN_AFFECT_LIVE)  # type: ignore[attr-defined]
    assert wait_until(lambda: len(os.listdir(f"/proc/{d.pid}/task")) > len(first.threads), 10)
    again = conn.classify(d)
    assert sorted(again.vcpus()) == [0, 1, 2]
    assert comm(d.pid, again.vcpus()[2]) == f"CPU 2/{'KVM' if h.kvm else 'TCG'}"


def test_pins_one_to_one_through_libvirt_and_reads_back(
    conn: lv.Connection,
    domain_factory: Callable[..., DomainHandle],  # noqa: F811
) -> None:
    h = domain_factory(vcpus=2, iothreads=1)
    d = find(conn, h)
    cl = conn.classify(d)
    vcpu_cpus = {i: CpuSet([i % NCPUS]) for i in range(2)}
    helpers = CpuSet([NCPUS - 1])
    pins = conn.pin(d, vcpu_cpus, {1: helpers}, helpers)
    assert dict(pins.vcpus) == vcpu_cpus
    assert dict(pins.iothreads) == {1: helpers}
    assert pins.emulator == helpers
    for idx, tid in cl.vcpus().items():
        # libvirt moved the thread's affinity and its own cpuset cgroup together
        assert CpuSet(os.sched_getaffinity(tid)) == vcpu_cpus[idx]
        assert cpuset_of(tid) == vcpu_cpus[idx]
    (io,) = cl.by_role("iothread")
    assert CpuSet(os.sched_getaffinity(io.tid)) == helpers
    assert CpuSet(os.sched_getaffinity(d.pid)) == helpers
    # and libvirt reports the same when asked afresh
    assert conn.pins(d) == pins


@pytest.mark.multi_cpu
def test_raw_affinity_outside_libvirts_cgroup_is_refused(
    conn: lv.Connection,
    domain_factory: Callable[..., DomainHandle],  # noqa: F811
) -> None:
    """Why pinning goes through libvirt: its per-vCPU cpuset cgroup rejects the raw write."""
    h = domain_factory(vcpus=2, iothreads=1)
    d = find(conn, h)
    tid = conn.classify(d).vcpus()[0]
    conn.pin(d, {0: CpuSet([0])}, {}, None)
    with pytest.raises(OSError) as err:
        os.sched_setaffinity(tid, [1])
    assert err.value.errno == errno.EINVAL
    assert CpuSet(os.sched_getaffinity(tid)) == CpuSet([0])


def test_pin_beyond_host_cpus_is_refused_and_changes_nothing(
    conn: lv.Connection,
    domain_factory: Callable[..., DomainHandle],  # noqa: F811
) -> None:
    h = domain_factory()
    d = find(conn, h)
    before = conn.pins(d)
    with pytest.raises(Exception, match="beyond the host"):
        conn.pin(d, {0: CpuSet([NCPUS + 3])}, {}, None)
    assert conn.pins(d) == before


def test_metadata_mask_and_guest_map(
    conn: lv.Connection,
    domain_factory: Callable[..., DomainHandle],  # noqa: F811
) -> None:
    h = domain_factory()
    d = find(conn, h)
    paths = HostPaths()
    assert lv.choose_mask(paths, d).source == "none"
    assert lv.choose_mask(paths, d, CpuSet([0])) == lv.MaskChoice(
        CpuSet([0]), "shared-pool", "kubelet's shared pool"
    )
    conn.set_mask(h.uuid, CpuSet([0]))
    d = find(conn, h)
    assert d.metadata_mask == CpuSet([0])
    assert lv.choose_mask(paths, d, CpuSet([1])).source == "metadata"
    # persistent: the mask is in the domain's config too, where virsh shows it
    out = subprocess.run(
        ["virsh", "-c", conn.uri, "metadata", h.name, lv.MASK_NS, "--config"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert 'cpus="0"' in out
    conn.set_mask(h.uuid, None)
    assert find(conn, h).metadata_mask is None

    doc = {"version": 1, "containers": {h.name: {"host_cpus": "0", "guest_cpus": "0"}}}
    conn.publish_guest_map(h.uuid, doc)
    assert conn.guest_map(h.uuid) == doc


def test_bad_metadata_mask_is_an_error_against_that_domain(
    conn: lv.Connection,
    domain_factory: Callable[..., DomainHandle],  # noqa: F811
) -> None:
    good, bad = domain_factory(), domain_factory()
    subprocess.run(
        [
            "virsh", "-c", conn.uri, "metadata", bad.name, lv.MASK_NS, "--live",
            "--key", "vmpin", "--set", '<mask cpus="3-1"/>',
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    doms, errors = conn.domains()
    assert good.uuid in {d.uuid for d in doms}
    assert bad.uuid not in {d.uuid for d in doms}
    assert len([e for e in errors if bad.name in e]) == 1


def test_lifecycle_events_reach_the_callback(
    libvirtd_uri: str,  # noqa: F811
    domain_factory: Callable[..., DomainHandle],  # noqa: F811
) -> None:
    lv.start_event_loop()
    c = lv.Connection(libvirtd_uri, HostPaths())
    seen: list[tuple[str, str]] = []
    c.watch(lambda u, e: seen.append((u, e)))
    try:
        h = domain_factory()
        assert wait_until(lambda: (h.uuid, "started") in seen, 20), seen
        h.dom.destroy()  # type: ignore[attr-defined]
        assert wait_until(lambda: (h.uuid, "stopped") in seen, 20), seen
    finally:
        c.close()


def test_unreachable_daemon_is_one_error() -> None:
    sock = f"/tmp/vmpin-no-daemon-{uuid.uuid4().hex}"
    c = lv.Connection(f"qemu+unix:///system?socket={sock}", HostPaths())
    with pytest.raises(LibvirtError, match="libvirt qemu"):
        c.domains()


def test_kubevirt_launcher_daemon_reached_through_its_root(
    libvirtd_uri: str,  # noqa: F811
    domain_factory: Callable[..., DomainHandle],  # noqa: F811
) -> None:
    """A process named virt-launcher whose root holds a libvirt socket: its domains are found.

    Here the "launcher" shares the host's root and pid namespace (a real virt-launcher pod
    has its own); the path through /proc/<pid>/root and the socket= URI are the real ones.
    """
    h = domain_factory()
    proc = subprocess.Popen(["bash", "-c", "exec -a virt-launcher sleep 60"])
    try:
        assert wait_until(
            lambda: Path(f"/proc/{proc.pid}/cmdline").read_bytes()[:13] == b"virt-launcher"
        )
        found = [(u, p) for u, p in lv.kubevirt_uris(HostPaths()) if p == proc.pid]
        assert found == [
            (
                f"qemu+unix:///system?socket=/proc/{proc.pid}/root/var/run/libvirt/libvirt-sock",
                proc.pid,
            )
        ] or found == [
            (
                f"qemu+unix:///session?socket=/proc/{proc.pid}/root/var/run/libvirt/virtqemud-sock",
                proc.pid,
            )
        ]
        conns = [c for c in lv.connections(HostPaths(), ["kubevirt"]) if c.launcher_pid == proc.pid]
        (c,) = conns
        try:
            doms, _ = c.domains()
            d = next(d for d in doms if d.uuid == h.uuid)
            # thread ids come back through the NSpid translation (identity here)
            assert (
                c.classify(d).vcpus()
                == lv.Connection(libvirtd_uri, HostPaths()).classify(d).vcpus()
            )
        finally:
            c.close()
    finally:
        proc.kill()
        proc.wait()


def test_ns_tids_of_a_process_in_its_own_pid_namespace() -> None:
    proc = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", "sleep", "60"])
    try:
        child: list[int] = []

        def forked() -> bool:
            child[:] = [
                int(c)
                for c in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
            ]
            return bool(child)

        assert wait_until(forked, 5)
        assert lv._ns_host_tids(HostPaths(), child[0]) == {1: child[0]}
    finally:
        proc.kill()
        proc.wait()
        time.sleep(0)


@pytest.mark.cgroup_v1
def test_mask_from_the_pod_container_cgroup(tmp_path: Path) -> None:
    """KubeVirt: the QEMU sits below the pod container's cgroup; that cgroup's cpuset wins."""
    root = Path("/sys/fs/cgroup/cpuset")
    # the creator's tag in the name: a dead session's leftover is swept (tests/support/session)
    top = root / new_id("kubepods-vmpintest")
    pod = top / f"pod{uuid.uuid4()}"
    ctr = pod / uuid.uuid4().hex
    leaf = ctr / "machine" / "emulator"
    made = [top, pod, ctr, ctr / "machine", leaf]
    cpus = str(NCPUS - 1)
    proc = None
    try:
        for d in made:
            d.mkdir()
            (d / "cpuset.mems").write_text((root / "cpuset.mems").read_text())
            (d / "cpuset.cpus").write_text(cpus)
        proc = subprocess.Popen(["sleep", "60"])
        (leaf / "tasks").write_text(str(proc.pid))
        got = lv.pod_container_cpus(HostPaths(), proc.pid)
        assert got == (CpuSet.parse(cpus), "/" + str(ctr.relative_to(root)))
        d = lv.Domain("qemu:///system", "x", str(uuid.uuid4()), proc.pid, 0, 1, CpuSet([0]))
        assert lv.choose_mask(HostPaths(), d).source == "kubevirt"
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
        for d in reversed(made):
            if d.exists():
                wait_until(lambda d=d: not (d / "tasks").read_text().strip(), 5)  # type: ignore[misc]
                d.rmdir()
