"""End to end on a real libvirtd: domains pinned 1:1 through libvirt, drift, sharing with Kata.

Domains come from tests/support/libvirt_util.py (KVM or TCG, random names, destroyed and
undefined afterwards); the Kata-style sandbox is a real QEMU registered through the hooks as
in test_e2e_kata.  Every affinity is read from /proc/<pid>/task/<tid>/status, independently of
what vmpin or libvirt report.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

pytest.importorskip("libvirt")

from tests.e2e.test_e2e_kata import Kata, affinities, sid, thread_names
from tests.support.libvirt_util import DomainHandle, domain_factory, libvirtd_uri  # noqa: F401
from tests.support.qemu_util import QemuHandle, qemu_factory, require_qemu

pytestmark = [pytest.mark.libvirtd, pytest.mark.qemu, pytest.mark.multi_cpu]


@pytest.fixture
def qemu(vm_dir: Path) -> Iterator[Callable[..., QemuHandle]]:
    require_qemu()
    with qemu_factory(vm_dir) as start:
        yield start


@pytest.fixture
def node(tmp_path: Path, env: dict[str, str], libvirtd_uri: str) -> Kata:  # noqa: F811
    return Kata(tmp_path, {**env, "VMPIN_LIBVIRT": libvirtd_uri})


def domain_pid(node: Kata, h: DomainHandle) -> int:
    rows = json.loads(node.vmpin("sandboxes", "--json").stdout)
    (row,) = [r for r in rows if r["id"] == h.uuid]
    # the domain is its own one container, named after it
    assert row["runtime"] == "libvirt" and [c["name"] for c in row["containers"]] == [h.name]
    pid: int = row["vmm_pid"]
    return pid


def vcpu_tids(pid: int) -> dict[int, int]:
    """vCPU index -> tid from the kernel's thread names (libvirt sets debug-threads=on)."""
    return {
        int(n.split()[1].split("/")[0]): t
        for t, n in thread_names(pid).items()
        if n.startswith("CPU ")
    }


def test_domain_pinned_one_to_one_drift_found_and_repaired(
    node: Kata,
    domain_factory: Callable[..., DomainHandle],  # noqa: F811
) -> None:
    h = domain_factory(vcpus=2, iothreads=1)
    node.vmpin("reconcile", "--once")  # a node's first pass makes its state dir
    pid = domain_pid(node, h)
    vcpu = vcpu_tids(pid)
    # no mask anywhere (no metadata, no kubelet): left exactly as libvirt made it
    assert set(affinities(pid).values()) == {"0-1"}
    assert node.show(h.uuid)["mode"] == "none"

    node.vmpin("update", h.name, "--cpuset-cpus", "0-1")
    aff = affinities(pid)
    assert (aff[vcpu[0]], aff[vcpu[1]]) == ("0", "1")
    helpers = {aff[t] for t, n in thread_names(pid).items()
               if not n.startswith(("CPU ", "kvm-"))}  # fmt: skip
    assert helpers == {"0-1"}
    show = node.show(h.uuid)
    assert (show["runtime"], show["mode"], show["mask"]) == ("libvirt", "1:1", "0-1")
    roles = {t["role"] for t in show["threads"]}  # type: ignore[attr-defined]
    assert roles == {"vcpu", "iothread", "emulator"}
    assert node.vmpin("audit").returncode == 0
    gm = json.loads(node.vmpin("guest-map", h.name, "--json").stdout)
    assert (gm["host_cpus"], gm["guest_cpus"], gm["exact"]) == ("0-1", "0-1", True)
    # the guest map is published in the domain's metadata
    meta = subprocess.run(
        ["virsh", "-c", node.env["VMPIN_LIBVIRT"], "metadata", h.name,
         "https://github.com/vmpin/vmpin/xmlns/libvirt/guest-map/1"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert '"vcpu_to_host": {"0": 0, "1": 1}' in meta

    # an operator moves vCPU 0 with virsh: audit finds it, reconcile --once repairs only it
    subprocess.run(
        ["virsh", "-c", node.env["VMPIN_LIBVIRT"], "vcpupin", h.name, "0", "1", "--live"],
        check=True, capture_output=True,
    )  # fmt: skip
    assert affinities(pid)[vcpu[0]] == "1"
    audit = node.vmpin("audit", "--json", check=False)
    assert audit.returncode == 1
    violations = json.loads(audit.stdout)["violations"]
    assert [(v["sandbox"], v["tid"], v["role"], v["desired"], v["actual"]) for v in violations] == [
        (h.uuid, vcpu[0], "vcpu", "0", "1")
    ]
    fixed = json.loads(node.vmpin("reconcile", "--once", "--json").stdout)
    (mine,) = [o for o in fixed if o["id"] == h.uuid]
    assert [t["tid"] for t in mine["threads"] if t["action"] == "pinned"] == [vcpu[0]]
    assert affinities(pid)[vcpu[0]] == "0"
    assert node.vmpin("audit").returncode == 0


def test_domain_and_kata_sandbox_share_the_node(
    node: Kata,
    qemu: Callable[..., QemuHandle],
    domain_factory: Callable[..., DomainHandle],  # noqa: F811
) -> None:
    h = domain_factory(vcpus=2, iothreads=1)
    q = qemu(sid("lvk"), smp=2, debug_threads=True)
    node.create_sandbox(q)
    node.create_container(q, f"c-{q.sandbox_id}", "1")

    # Disjoint masks: each sandbox keeps to its own CPU, one 1:1 vCPU per CPU at most.
    node.vmpin("update", h.name, "--cpuset-cpus", "0")
    node.vmpin("reconcile", "--once")
    pid = domain_pid(node, h)
    names = thread_names(pid)
    assert {names[t]: a for t, a in affinities(pid).items() if a != "0"} == {}
    assert set(affinities(q.pid).values()) == {"1"}
    assert node.vmpin("audit").returncode == 0
    dshow, kshow = node.show(h.uuid), node.show(q.sandbox_id)
    assert (dshow["mode"], kshow["mode"]) == ("partial", "partial")

    # Overlapping masks: CPU 1 is in both, so neither pins a vCPU 1:1 there (no two vCPUs of
    # different sandboxes on one CPU), and the audit still holds.
    node.vmpin("update", h.name, "--cpuset-cpus", "0-1")
    node.vmpin("reconcile", "--once")
    dshow, kshow = node.show(h.uuid), node.show(q.sandbox_id)
    assert dshow["mode"] == "float" and kshow["mode"] == "float"
    vcpu = vcpu_tids(pid)
    assert (affinities(pid)[vcpu[0]], affinities(pid)[vcpu[1]]) == ("0-1", "0-1")
    assert set(affinities(q.pid).values()) == {"1"}
    audit = json.loads(node.vmpin("audit", "--json").stdout)
    assert audit["ok"] and audit["sandboxes"] == 2
    listed = {r["id"]: r["runtime"] for r in json.loads(node.vmpin("sandboxes", "--json").stdout)}
    assert listed == {h.uuid: "libvirt", q.sandbox_id: "kata"}
