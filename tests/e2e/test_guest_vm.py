"""The whole point of the guest map, proven on a real Linux guest (tests/support/guest_image.py).

One 2-vCPU sandbox VM, booted the way Kata boots it, with the host's publish dir shared at
Kata's guest path.  The host side is driven only through vmpin's CLI (Kata's host hooks,
``vmpin update``, ``show``, ``guest-map``, ``reconcile --once``); the guest side only through
the one-file guest program (``python3 -I -S vmpin-guest.pyz``), as a guest image ships it.

The proof: vmpin pins vCPU 0 and 1 to host CPUs 1 and 0 -- crossed, so that a mix-up of
vCPU index and host CPU shows -- by giving it a topology (a fixture sysfs, ``--sysfs-root``)
in which CPU 1 comes first.  The sandbox has two containers, ``busy`` (host CPU 1) and
``other`` (host CPU 0): with one container holding both CPUs its guest map would be both
vCPUs, and where a process runs inside would prove nothing.  In the guest a busy loop stands
for ``busy``'s process; the guest hook pins it to the vCPU the host published.  On the host
that vCPU's thread must then accumulate the CPU time (``/proc/PID/task/TID/stat`` utime +
stime), on the host CPU vmpin pinned it to (field 39, the CPU it last ran on).  Then the
containers swap CPUs (``vmpin update``), ``vmpin guest follow --once`` re-pins inside, and
the time moves to the other vCPU thread and the other host CPU.  A third test tampers with
the published map and sees the same measurement fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import vmpin_cmd
from tests.support import guest_image
from tests.support.guest_image import KATA_SHARED, Guest
from tests.support.session import new_id
from vmpin.guest import bundle
from vmpin.wire.guestmap import MAP_DIRNAME, MAP_FILENAME

pytestmark = [pytest.mark.qemu, pytest.mark.guest, pytest.mark.multi_cpu]

CRI = "io.kubernetes.cri."
REPO = Path(__file__).resolve().parents[2]
#: where the guest unpacks vmpin and its CLI's dependencies (guest_image.python_libs).
PYLIB = "/run/pylib"
PYZ = "/mnt/vmpin/vmpin-guest.pyz"
#: a measurement samples at least this long, and until the vCPU threads used this many clock
#: ticks (1.5 CPU-seconds at 100 Hz) or for at most MAX_WINDOW: on a loaded host the busy
#: vCPU gets a small slice of its CPU, and a fixed window would measure mostly noise.
MIN_WINDOW, MAX_WINDOW, MIN_TICKS = 2.0, 20.0, 150
#: the mapped vCPU's thread must hold this share of both vCPU threads' time (a wrong map
#: puts it on the other thread: ~0.1-0.3 measured)...
MIN_SHARE = 0.65
#: ...and be seen on its expected host CPU in this share of the samples where it ran.
MIN_ON_CPU = 0.9


def crossed_sysfs(root: Path) -> Path:
    """A 2-CPU topology whose placement order is [1, 0]: CPU 1 on package 0, CPU 0 on 1.

    read_topology orders by package first, so a 1:1 plan puts vCPU 0 on host CPU 1.
    """
    cpu = root / "devices/system/cpu"
    cpu.mkdir(parents=True)
    (cpu / "online").write_text("0-1\n")
    (cpu / "possible").write_text("0-1\n")
    for n, package in ((0, 1), (1, 0)):
        topo = cpu / f"cpu{n}" / "topology"
        topo.mkdir(parents=True)
        (topo / "physical_package_id").write_text(f"{package}\n")
        (topo / "core_id").write_text("0\n")
        (topo / "die_id").write_text("0\n")
        (topo / "thread_siblings_list").write_text(f"{n}\n")
        (topo / "core_cpus_list").write_text(f"{n}\n")
    return root


@dataclass
class Node:
    """The host half: vmpin's CLI with this test's private paths, and the booted guest."""

    guest: Guest
    sandbox: str
    env: dict[str, str]
    bundles: Path
    map_file: Path
    busy: str
    other: str
    work: Path
    busy_pid: int = 0

    def vmpin(self, *args: str, stdin: str | None = None) -> str:
        proc = subprocess.run([*vmpin_cmd(), *args], input=stdin, capture_output=True,
                              text=True, env=self.env, timeout=120, check=False)
        if proc.returncode != 0:
            raise AssertionError(f"vmpin {' '.join(args)} -> {proc.returncode}\n"
                                 f"{proc.stdout}\n{proc.stderr}")
        return proc.stdout

    def hook(self, stage: str, state_id: str, cid: str, cpus: str | None) -> None:
        """Kata's shim running a host hook (poststart carries the sandbox id)."""
        b = self.bundles / cid
        if not b.exists():
            b.mkdir(parents=True)
            ann = {CRI + "container-type": "sandbox" if cid == self.sandbox else "container",
                   CRI + "sandbox-id": self.sandbox, CRI + "sandbox-uid": f"uid-{self.sandbox}",
                   CRI + "sandbox-name": "pod", CRI + "sandbox-namespace": "default",
                   CRI + "container-name": cid}
            spec: dict[str, object] = {"ociVersion": "1.0.2", "annotations": ann, "linux": {}}
            if cpus is not None:
                spec["linux"] = {"resources": {"cpu": {"cpus": cpus}}}
            (b / "config.json").write_text(json.dumps(spec))
        ann = json.loads((b / "config.json").read_text())["annotations"]
        state = {"ociVersion": "", "id": state_id, "status": "", "bundle": str(b),
                 "annotations": ann, "pid": self.guest.qemu.pid}
        self.vmpin("hook", "--strict", stage, stdin=json.dumps(state))

    def create(self, cid: str, cpus: str | None) -> None:
        for stage in ("prestart", "createRuntime"):
            self.hook(stage, cid, cid, cpus)
        self.hook("poststart", self.sandbox, cid, cpus)

    def vcpus(self) -> dict[int, tuple[int, str]]:
        """vCPU index -> (host thread id, desired host CPUs), from ``vmpin show``."""
        show = json.loads(self.vmpin("show", self.sandbox, "--json"))
        return {t["index"]: (t["tid"], t["desired"]) for t in show["threads"]
                if t["role"] == "vcpu"}

    def guest_cpus(self, cid: str) -> str:
        data = json.loads(self.vmpin("guest-map", cid, "--json"))
        assert data["exact"] is True, data
        return str(data["guest_cpus"])

    def guest_hook(self, stage: str, cid: str, pid: int) -> str:
        res = self.guest.run(["python3", "-I", "-S", PYZ, stage, "--strict", "--verbose"],
                             stdin=json.dumps({"id": cid, "pid": pid, "bundle": "/"}))
        return str(res["stderr"])

    def follow_once(self) -> str:
        res = self.guest.run(["python3", "-I", "-S", PYZ, "follow", "--once", "--strict",
                              "--verbose"])
        return str(res["stderr"])


def _stat(pid: int, tid: int) -> tuple[str, int, int]:
    """(state, utime+stime ticks, CPU last run on: field 39) of one host thread."""
    with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
        fields = f.read().decode().rpartition(")")[2].split()
    # fields[0] is field 3 (state); utime, stime are fields 14, 15; processor is field 39.
    return fields[0], int(fields[11]) + int(fields[12]), int(fields[36])


def measure(node: Node) -> dict[int, dict[str, object]]:
    """Per vCPU: its share of both vCPU threads' CPU time, and on which host CPUs it was seen
    running (sampled every 50 ms), over a window of MIN_WINDOW..MAX_WINDOW seconds."""
    pid = node.guest.qemu.pid
    tids = {i: tid for i, (tid, _) in node.vcpus().items()}
    start = {i: _stat(pid, t)[1] for i, t in tids.items()}
    seen: dict[int, dict[int, int]] = {i: {} for i in tids}
    began = time.monotonic()
    used = dict.fromkeys(tids, 0)
    while True:
        for i, t in tids.items():
            state, ticks, cpu = _stat(pid, t)
            used[i] = ticks - start[i]
            if state == "R":
                seen[i][cpu] = seen[i].get(cpu, 0) + 1
        spent = time.monotonic() - began
        if spent >= MAX_WINDOW or (spent >= MIN_WINDOW and sum(used.values()) >= MIN_TICKS):
            break
        time.sleep(0.05)
    total = sum(used.values()) or 1
    return {i: {"tid": tids[i], "ticks": used[i], "share": round(used[i] / total, 3),
                "on_cpus": seen[i], "seconds": round(spent, 1)} for i in tids}


def check_runs_on(node: Node, vcpu: int, host_cpu: int) -> dict[int, dict[str, object]]:
    """The busy process's time is on vCPU ``vcpu``'s thread, and that thread on ``host_cpu``."""
    m = measure(node)
    share = float(m[vcpu]["share"])  # type: ignore[arg-type]
    on = m[vcpu]["on_cpus"]
    assert isinstance(on, dict)
    runs = sum(on.values())
    on_cpu = on.get(host_cpu, 0) / runs if runs else 0.0
    assert share >= MIN_SHARE and on_cpu >= MIN_ON_CPU, (
        f"expected the busy guest process on vCPU {vcpu} = host CPU {host_cpu}; measured "
        f"per vCPU {m} (share needed {MIN_SHARE}, on-CPU share {on_cpu:.2f} needed {MIN_ON_CPU})"
    )
    print(f"guest proof: vCPU {vcpu} on host CPU {host_cpu}: {m}")  # shown with -s / -rP
    return m


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    base = tmp_path_factory.mktemp("guestvm")
    sandbox = new_id("gvm")  # names this session: a killed run's VM is swept by the next
    publish, vm_dir, share = base / "publish", base / "vm", base / "share"
    work = base / "work"
    mounts = publish / sandbox / "mounts"  # Kata's shared dir exists before vmpin publishes
    for d in (mounts, vm_dir, share, work, base / "state"):
        d.mkdir(parents=True)
    bundle.build(str(share / "vmpin-guest.pyz"))
    env = dict(os.environ)
    env.update(VMPIN_STATE_DIR=str(base / "state"), VMPIN_VM_DIR=str(vm_dir),
               VMPIN_RUNC_ROOT=str(base / "runc"), VMPIN_KUBELET_STATE=str(base / "kubelet"),
               VMPIN_PUBLISH_DIR=str(publish),
               VMPIN_SYSFS_ROOT=str(crossed_sysfs(base / "sysfs")))
    shares = {KATA_SHARED: mounts, "/mnt/vmpin": share, "/mnt/work": work}
    with guest_image.boot(vm_dir, sandbox, base, shares) as g:
        n = Node(g, sandbox, env, base / "bundles", mounts / MAP_DIRNAME / MAP_FILENAME,
                 f"busy-{uuid.uuid4().hex[:6]}", f"other-{uuid.uuid4().hex[:6]}", work)
        n.create(sandbox, None)
        n.create(n.busy, "1")
        n.create(n.other, "0")
        n.busy_pid = g.spawn(["sh", "-c", "while :; do :; done"])
        yield n
        # seconds per guest command, shown with -s: what this module costs under TCG
        print("guest commands:", *g.log, sep="\n  ")


def test_guest_process_runs_on_its_vcpu_and_follows_an_update(node: Node) -> None:
    # vmpin crossed the pins: vCPU 0 -> host CPU 1, vCPU 1 -> host CPU 0
    assert {i: d for i, (_, d) in node.vcpus().items()} == {0: "1", 1: "0"}
    assert node.guest_cpus(node.busy) == "0" and node.guest_cpus(node.other) == "1"
    assert node.map_file.exists()

    said = node.guest_hook("prestart", node.busy, node.busy_pid)
    assert "pinned to vCPUs 0" in said, said
    check_runs_on(node, vcpu=0, host_cpu=1)

    # kubelet swaps the containers' CPUs; vmpin republishes; the follower re-pins inside
    node.vmpin("update", node.busy, "--cpuset-cpus", "0")
    node.vmpin("update", node.other, "--cpuset-cpus", "1")
    assert {i: d for i, (_, d) in node.vcpus().items()} == {0: "1", 1: "0"}
    assert node.guest_cpus(node.busy) == "1"
    said = node.follow_once()
    assert f"container {node.busy} re-pinned to vCPUs 1" in said, said
    check_runs_on(node, vcpu=1, host_cpu=0)


def test_proof_fails_when_the_guest_map_is_wrong(node: Node) -> None:
    """Publish a map that sends ``busy`` to the wrong vCPU: the measurement must object."""
    node.vmpin("reconcile", "--once")
    right = node.guest_cpus(node.busy)
    host_cpu = {i: int(d) for i, (_, d) in node.vcpus().items()}
    node.guest_hook("prestart", node.busy, node.busy_pid)
    check_runs_on(node, vcpu=int(right), host_cpu=host_cpu[int(right)])

    wrong = 1 - int(right)
    doc = json.loads(node.map_file.read_text())
    doc["generation"] += 1
    doc["containers"][node.busy].update(guest_cpus=str(wrong), generation=doc["generation"])
    tmp = node.map_file.with_suffix(".tampered")
    tmp.write_text(json.dumps(doc))
    tmp.rename(node.map_file)
    assert f"re-pinned to vCPUs {wrong}" in node.follow_once()
    # the time follows the (wrong) map: measured first, so the move inside the guest has
    # settled before the true placement is checked (on a loaded host the guest's migration of
    # the busy process can lag the follower by seconds)
    check_runs_on(node, vcpu=wrong, host_cpu=host_cpu[wrong])
    with pytest.raises(AssertionError, match="measured per vCPU"):
        check_runs_on(node, vcpu=int(right), host_cpu=host_cpu[int(right)])

    # the host republishes the true map (its content differs) and the guest follows it back
    node.vmpin("reconcile", "--once")
    assert json.loads(node.map_file.read_text())["containers"][node.busy]["guest_cpus"] == right
    assert f"re-pinned to vCPUs {right}" in node.follow_once()
    check_runs_on(node, vcpu=int(right), host_cpu=host_cpu[int(right)])


# -- cgroup v2 for real: runc and vmpin's runc path inside the guest ----------------------------
#: where the guest-side vmpin keeps its state and runc its containers (guest tmpfs).
V2 = "/run/vmpin-v2"
#: cgroup layouts under the v2 root, each made by runc's cgroupfs driver (cgroupsPath).  The
#: systemd driver's names are made the same way: the guest has no systemd (busybox init), so
#: runc --systemd-cgroup cannot ask it for a scope (docs/guest.md says so); what vmpin reads
#: is the hierarchy, which is the same either way.
LAYOUTS = {
    "runc": None,
    "cgfs": "/kubepods/burstable/pod{uid}/{cid}",
    "sysd": "/kubepods.slice/kubepods-burstable.slice/"
    "kubepods-burstable-pod{uid_}.slice/cri-containerd-{cid}.scope",
}


class GuestV2:
    """vmpin and runc inside the guest, on the guest's cgroup v2 hierarchy."""

    def __init__(self, node: Node) -> None:
        self.g = node.guest
        self.work = node.work
        self.env = {
            "PYTHONPATH": PYLIB,
            "VMPIN_STATE_DIR": f"{V2}/state",
            "VMPIN_RUNC_ROOT": f"{V2}/runc",
            "VMPIN_VM_DIR": f"{V2}/vm",
            "VMPIN_PUBLISH_DIR": f"{V2}/publish",
            "VMPIN_KUBELET_STATE": f"{V2}/no-kubelet",
        }

    def sh(self, script: str, check: bool = True) -> dict[str, object]:
        return self.g.run(["sh", "-c", script], env=self.env, check=check)

    def vmpin(self, *args: str, check: bool = True) -> dict[str, object]:
        return self.g.run(["python3", "-m", "vmpin", *args], env=self.env, check=check)

    def containers(self) -> dict[str, dict[str, object]]:
        out = json.loads(str(self.vmpin("containers", "--json")["stdout"]))
        return {c["id"]: c for c in out}

    def read(self, path: str) -> str:
        return str(self.sh(f"cat {path}")["stdout"]).strip()

    def bundle(self, cid: str, cpus: str, cgroups_path: str | None) -> str:
        """config.json from the host's ``runc spec`` (same runc), hooks running vmpin."""
        spec = self.work / f"spec-{cid}"
        spec.mkdir()
        subprocess.run(["runc", "spec"], cwd=spec, check=True)
        cfg = json.loads((spec / "config.json").read_text())
        cfg["root"] = {"path": f"{V2}/rootfs", "readonly": True}
        cfg["process"].update(args=["sleep", "3600"], terminal=False)
        cfg["linux"]["resources"] = {"cpu": {"cpus": cpus, "mems": "0"}}
        if cgroups_path:
            cfg["linux"]["cgroupsPath"] = cgroups_path
        hook_env = [f"{k}={v}" for k, v in self.env.items()] + ["PATH=/usr/bin:/bin:/sbin"]
        cfg["hooks"] = {
            stage: [{"path": "/usr/bin/python3", "env": hook_env, "timeout": 60,
                     "args": ["python3", "-m", "vmpin", "hook", stage]}]
            for stage in ("prestart", "createRuntime", "poststart", "poststop")
        }
        (spec / "config.json").write_text(json.dumps(cfg))
        self.sh(f"mkdir -p {V2}/b/{cid} && cp /mnt/work/spec-{cid}/config.json {V2}/b/{cid}/")
        return f"{V2}/b/{cid}"


@pytest.fixture(scope="module")
def v2(node: Node) -> GuestV2:
    g = GuestV2(node)
    guest_image.python_libs(node.work / "pylib.tar", REPO)
    g.sh(f"mkdir -p {PYLIB} && tar -xf /mnt/work/pylib.tar -C {PYLIB}")
    # cgroup2 at the usual place with cpuset enabled for children; a busybox rootfs on tmpfs
    # (runc runs with --no-pivot: the guest's root is the initramfs, where pivot_root fails).
    g.sh("grep -q ' /sys/fs/cgroup cgroup2 ' /proc/mounts || mount -t cgroup2 none /sys/fs/cgroup;"
         " echo +cpuset > /sys/fs/cgroup/cgroup.subtree_control;"
         f" mkdir -p {V2}/rootfs/bin {V2}/state && cp /bin/busybox {V2}/rootfs/bin/ &&"
         f" ln -sf busybox {V2}/rootfs/bin/sleep && ln -sf busybox {V2}/rootfs/bin/sh")
    assert "cpuset" in g.read("/sys/fs/cgroup/cgroup.subtree_control")
    return g


@pytest.mark.runc
def test_runc_on_cgroup_v2_in_the_guest(v2: GuestV2) -> None:
    """One container per layout, all at once (each vmpin command costs seconds under TCG)."""
    runc = f"runc --root {V2}/runc"
    cgs: dict[str, str] = {}
    for layout, template in sorted(LAYOUTS.items()):
        cid = f"v2-{layout}-{uuid.uuid4().hex[:8]}"
        uid = str(uuid.uuid4())
        rel = (template.format(uid=uid, uid_=uid.replace("-", "_"), cid=cid) if template
               else f"/{cid}")  # runc's default: /<id> below its own cgroup (the root here)
        cgs[cid] = f"/sys/fs/cgroup{rel}"
        b = v2.bundle(cid, "1", template and rel)
        v2.sh(f"{runc} create --no-pivot --bundle {b} {cid} && {runc} start {cid}")
    try:
        pids = {cid: json.loads(str(v2.sh(f"{runc} state {cid}")["stdout"]))["pid"]
                for cid in cgs}
        # the hooks told vmpin; each v2 cgroup is where its layout says, with the CPUs
        listed = v2.containers()
        for cid, cg in cgs.items():
            assert (listed[cid]["cpus"], listed[cid]["runtime"]) == ("1", "runc"), listed[cid]
            assert v2.read(f"{cg}/cpuset.cpus.effective") == "1", cid
            assert "Cpus_allowed_list:\t1" in v2.read(f"/proc/{pids[cid]}/status"), cid
        assert v2.vmpin("audit")["rc"] == 0

        # runc update rewrites the cgroup and fires no hook: one pass adopts it
        v2.sh("; ".join(f"{runc} update --cpuset-cpus 0 {cid}" for cid in cgs))
        v2.vmpin("reconcile", "--once")
        listed = v2.containers()
        for cid, cg in cgs.items():
            assert (listed[cid]["cpus"], listed[cid]["cpus_source"]) == ("0", "runc"), listed
            assert v2.read(f"{cg}/cpuset.cpus") == "0", cid

        # a hand edit of a cgroup is drift: audit says so, a pass puts the plan back
        v2.sh("; ".join(f"echo 1 > {cg}/cpuset.cpus" for cg in cgs.values()))
        audit = v2.vmpin("audit", "--json", check=False)
        assert audit["rc"] == 1, audit
        drifted = [v for v in json.loads(str(audit["stdout"]))["violations"]
                   if v["role"] == "container" and v["actual"] == "1"]
        assert {v["sandbox"] for v in drifted} == set(cgs), audit  # a runc ctr is its sandbox
        v2.vmpin("reconcile", "--once")
        for cid, cg in cgs.items():
            assert v2.read(f"{cg}/cpuset.cpus") == "0", cid
            assert "Cpus_allowed_list:\t0" in v2.read(f"/proc/{pids[cid]}/status"), cid
        assert v2.vmpin("audit")["rc"] == 0

        # vmpin update (CRI UpdateContainerResources) reaches a v2 cgroup at once
        cid = next(iter(cgs))
        v2.vmpin("update", cid, "--cpuset-cpus", "0-1")
        assert v2.read(f"{cgs[cid]}/cpuset.cpus") == "0-1"
    finally:
        v2.sh("; ".join(f"{runc} delete -f {cid}" for cid in cgs), check=False)  # poststop
    assert not set(cgs) & set(v2.containers())

