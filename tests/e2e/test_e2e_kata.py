"""End to end on real QEMU: hook -> tracked container -> sandbox mask -> threads pinned -> audit.

Each QEMU is started as Kata starts it (tests/qemu_util.py) and registered the way Kata's shim
runs host hooks: prestart/createRuntime with the container's id and bundle, poststart and
poststop with the *sandbox* id.  Every check reads /proc/<pid>/task/<tid>/status.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import vmpin_cmd
from tests.support.qemu_util import QemuHandle, hold_qmp, qemu_factory, require_qemu
from tests.support.session import new_id
from vmpin.linux.paths import HostPaths

#: real QEMUs, plans over host CPUs 0 and 1.
pytestmark = [pytest.mark.qemu, pytest.mark.multi_cpu]

CRI = "io.kubernetes.cri."


def sid(prefix: str) -> str:
    """A sandbox id no concurrent test run shares (the /proc scan matches -name globally)."""
    return new_id(prefix)


@pytest.fixture
def qemu(vm_dir: Path) -> Iterator[Callable[..., QemuHandle]]:
    require_qemu()
    with qemu_factory(vm_dir) as start:
        yield start


def affinities(pid: int) -> dict[int, str]:
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                for line in f:
                    if line.startswith("Cpus_allowed_list:"):
                        out[int(tid)] = line.split(":", 1)[1].strip()
        except FileNotFoundError:
            pass
    return out


def thread_names(pid: int) -> dict[int, str]:
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                out[int(tid)] = f.read().strip()
        except FileNotFoundError:
            pass
    return out


class Kata:
    """Plays the Kata shim's part: bundles with CRI annotations, host hooks via the CLI."""

    def __init__(self, tmp: Path, env: dict[str, str]) -> None:
        self.tmp, self.env = tmp, env

    def vmpin(self, *args: str, stdin: str | None = None, check: bool = True
              ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run([*vmpin_cmd(), *args], input=stdin, capture_output=True,
                              text=True, env=self.env, timeout=60)
        if check and proc.returncode != 0:
            raise AssertionError(f"vmpin {' '.join(args)} -> {proc.returncode}\n"
                                 f"{proc.stdout}\n{proc.stderr}")
        return proc

    def bundle(self, cid: str, sandbox: str, cpus: str | None, name: str) -> Path:
        b = self.tmp / "bundles" / cid
        b.mkdir(parents=True)
        ann = {CRI + "container-type": "sandbox" if cid == sandbox else "container",
               CRI + "sandbox-id": sandbox, CRI + "sandbox-uid": f"uid-{sandbox}",
               CRI + "sandbox-name": f"pod-{sandbox}", CRI + "sandbox-namespace": "default",
               CRI + "container-name": name}
        spec: dict[str, object] = {"ociVersion": "1.0.2", "annotations": ann, "linux": {}}
        if cpus is not None:
            spec["linux"] = {"resources": {"cpu": {"cpus": cpus}}}
        (b / "config.json").write_text(json.dumps(spec))
        return b

    def hook(self, stage: str, state_id: str, bundle: Path, pid: int | None) -> None:
        ann = json.loads((bundle / "config.json").read_text())["annotations"]
        state = {"ociVersion": "", "id": state_id, "status": "", "bundle": str(bundle),
                 "annotations": ann}
        if pid is not None:
            state["pid"] = pid
        proc = self.vmpin("hook", "--strict", stage, stdin=json.dumps(state))
        assert proc.stderr == "", proc.stderr

    def create_sandbox(self, q: QemuHandle) -> None:
        b = self.bundle(q.sandbox_id, q.sandbox_id, None, "POD")
        for stage in ("prestart", "createRuntime"):
            self.hook(stage, q.sandbox_id, b, q.pid)
        self.hook("poststart", q.sandbox_id, b, q.pid)

    def create_container(self, q: QemuHandle, cid: str, cpus: str | None) -> Path:
        b = self.bundle(cid, q.sandbox_id, cpus, f"ctr-{cid}")
        for stage in ("prestart", "createRuntime"):
            self.hook(stage, cid, b, q.pid)
        self.hook("poststart", q.sandbox_id, b, q.pid)  # Kata: the sandbox id, not cid
        return b

    def show(self, sandbox: str) -> dict[str, object]:
        data: dict[str, object] = json.loads(self.vmpin("show", sandbox, "--json").stdout)
        return data


@pytest.fixture
def kata(tmp_path: Path, env: dict[str, str]) -> Kata:
    return Kata(tmp_path, env)


@pytest.mark.kvm  # no names and QMP held: only the KVM fallback can tell vCPUs apart
@pytest.mark.parametrize("debug_threads", [False, True], ids=["no-names", "debug-threads"])
@pytest.mark.parametrize("qmp_held", [False, True], ids=["qmp-free", "qmp-held"])
def test_mask_follows_container_cpus(
    qemu: Callable[..., QemuHandle], kata: Kata, debug_threads: bool, qmp_held: bool
) -> None:
    q = qemu(sid("sbx1"), smp=2, debug_threads=debug_threads)
    holder = hold_qmp(q.qmp_sock) if qmp_held else None
    sock = holder.__enter__() if holder else None
    try:
        kata.create_sandbox(q)
        kata.create_container(q, "ctr1", "1")
        assert set(affinities(q.pid).values()) == {"1"}, affinities(q.pid)

        kata.vmpin("update", "ctr1", "--cpuset-cpus", "0")
        assert set(affinities(q.pid).values()) == {"0"}, affinities(q.pid)

        show = kata.show(q.sandbox_id)
        assert show["mask"] == "0" and show["runtime"] == "kata"
        roles = {t["role"] for t in show["threads"]}  # type: ignore[attr-defined]
        assert "emulator" in roles
        layers = show["layers"]
        if not qmp_held:
            assert "qmp" in layers  # type: ignore[operator]
        elif debug_threads:
            assert "names" in layers  # type: ignore[operator]
        assert kata.vmpin("audit", "--json").returncode == 0
    finally:
        if holder:
            holder.__exit__(None, None, None)
        del sock


@pytest.mark.kvm  # vCPU threads named "CPU N/KVM"
def test_two_containers_pin_vcpus_one_to_one_and_audit_repairs(
    qemu: Callable[..., QemuHandle], kata: Kata
) -> None:
    q = qemu(sid("sbx2"), smp=2, debug_threads=True)
    kata.create_sandbox(q)
    kata.create_container(q, "ca", "0")
    kata.create_container(q, "cb", "1")
    names = thread_names(q.pid)
    aff = affinities(q.pid)
    vcpu = {n: t for t, n in names.items() if n.startswith("CPU ")}
    assert aff[vcpu["CPU 0/KVM"]] == "0" and aff[vcpu["CPU 1/KVM"]] == "1"
    others = {aff[t] for t, n in names.items() if not n.startswith("CPU ")}
    assert others == {"0-1"}

    show = kata.show(q.sandbox_id)
    assert show["mode"] == "1:1"
    vcpus = {t["index"]: t["desired"] for t in show["threads"]  # type: ignore[attr-defined]
             if t["role"] == "vcpu"}
    assert vcpus == {0: "0", 1: "1"}
    assert kata.vmpin("audit").returncode == 0

    # someone moves vCPU 1 by hand: audit says so, reconcile puts it back and nothing else
    os.sched_setaffinity(vcpu["CPU 1/KVM"], {0})
    audit = kata.vmpin("audit", "--json", check=False)
    assert audit.returncode == 1
    violations = json.loads(audit.stdout)["violations"]
    assert {(v["tid"], v["role"], v["desired"], v["actual"]) for v in violations} >= {
        (vcpu["CPU 1/KVM"], "vcpu", "1", "0")}
    fixed = json.loads(kata.vmpin("reconcile", "--once", "--json").stdout)
    assert [t["tid"] for o in fixed for t in o["threads"] if t["action"] == "pinned"] == [
        vcpu["CPU 1/KVM"]]
    assert affinities(q.pid)[vcpu["CPU 1/KVM"]] == "1"
    assert kata.vmpin("audit").returncode == 0

    # guest map: host CPU 0 is vCPU 0, host CPU 1 is vCPU 1
    ga = json.loads(kata.vmpin("guest-map", "ca", "--json").stdout)
    gb = json.loads(kata.vmpin("guest-map", "cb", "--json").stdout)
    assert (ga["host_cpus"], ga["guest_cpus"]) == ("0", "0")
    assert (gb["host_cpus"], gb["guest_cpus"]) == ("1", "1")


def test_poststop_with_sandbox_id_forgets_only_that_container(
    qemu: Callable[..., QemuHandle], kata: Kata
) -> None:
    q = qemu(sid("sbx3"), smp=2)
    kata.create_sandbox(q)
    kata.create_container(q, "c0", "0")
    b1 = kata.create_container(q, "c1", "1")
    # Kata's poststop carries the sandbox id; the bundle says which container stopped.
    kata.hook("poststop", q.sandbox_id, b1, None)
    listed = json.loads(kata.vmpin("containers", "--json").stdout)
    assert sorted(c["id"] for c in listed) == sorted(["c0", q.sandbox_id])
    assert set(affinities(q.pid).values()) == {"0"}
    # the sandbox's own poststop tears the sandbox down
    kata.hook("poststop", q.sandbox_id, kata.tmp / "bundles" / q.sandbox_id, None)
    assert json.loads(kata.vmpin("sandboxes", "--json").stdout) == []


def test_vanished_vmm_is_forgotten(qemu: Callable[..., QemuHandle], kata: Kata) -> None:
    q = qemu(sid("sbx4"), smp=1)
    kata.create_sandbox(q)
    kata.create_container(q, "c", "1")
    q.kill()
    os.unlink(q.pidfile) if q.pidfile.exists() else None
    out = json.loads(kata.vmpin("reconcile", "--once", "--json").stdout)
    assert out[0]["vanished"] is True
    assert json.loads(kata.vmpin("sandboxes", "--json").stdout) == []


def test_pid_reuse_is_not_trusted(kata: Kata, paths: HostPaths, vm_dir: Path) -> None:
    """A pidfile naming a live process that is not that sandbox's QEMU is ignored."""
    # the baseline comes before any hook runs, and spans both CPUs (multi_cpu widened it), so
    # a hook that trusted the pidfile and pinned this process to the container's CPU 1 shows
    before = {tid: os.sched_getaffinity(tid) for tid in map(int, os.listdir("/proc/self/task"))}
    assert all(len(cpus) >= 2 for cpus in before.values()), before
    s5 = sid("sbx5")
    d = vm_dir / s5
    d.mkdir()
    (d / "pid").write_text(str(os.getpid()))
    b = kata.bundle(s5, s5, None, "POD")
    kata.hook("prestart", s5, b, os.getpid())
    kata.bundle("c5", s5, "1", "c5")
    kata.hook("prestart", "c5", kata.tmp / "bundles" / "c5", None)
    kata.vmpin("reconcile", "--once")
    show = kata.show(s5)
    assert show["vmm_pid"] is None and show["threads"] == []
    assert {tid: os.sched_getaffinity(tid) for tid in before} == before


def test_sandbox_recorded_before_its_vm_is_upgraded(
    qemu: Callable[..., QemuHandle], kata: Kata, vm_dir: Path
) -> None:
    """Hooks that ran before the VM dir existed recorded a plain sandbox; its VMM wins later."""
    s = sid("late")
    b = kata.bundle(s, s, None, "POD")
    kata.hook("createRuntime", s, b, None)
    cb = kata.bundle("late-c", s, "1", "app")
    kata.hook("createRuntime", "late-c", cb, None)
    assert json.loads(kata.vmpin("sandboxes", "--json").stdout)[0]["runtime"] == "runc"
    q = qemu(s, smp=2)
    kata.vmpin("reconcile", "--once")
    assert json.loads(kata.vmpin("sandboxes", "--json").stdout)[0]["runtime"] == "kata"
    assert set(affinities(q.pid).values()) == {"1"}


@pytest.mark.parametrize("vcpu_policy", ["auto", "float"])
def test_kata_own_vcpu_pinning_is_left_alone(
    qemu: Callable[..., QemuHandle], kata: Kata, paths: HostPaths, vcpu_policy: str
) -> None:
    """Kata's ``enable_vcpus_pinning`` pins vCPU i to the i-th CPU of the sandbox's cpuset at
    its container events.  Played here with sched_setaffinity, as Kata's runtime does it:
    ``reconcile --once`` moves no vCPU, ``audit`` passes and says why, ``doctor`` names the
    file.  ``auto``: vmpin's 1:1 plan is Kata's layout; ``float``: vmpin would float the vCPUs
    but leaves them where Kata pinned them."""
    conf = Path(paths.kata_config)
    conf.parent.mkdir(parents=True)
    conf.write_text('[runtime]\nenable_vcpus_pinning = true\nsandbox_cgroup_only = true\n')
    kata.env = {**kata.env, "VMPIN_VCPU_POLICY": vcpu_policy}
    q = qemu(sid("kpin"), smp=2)
    kata.create_sandbox(q)
    kata.create_container(q, "kp", "0-1")
    show = kata.show(q.sandbox_id)
    vcpu = {t["index"]: t["tid"] for t in show["threads"]  # type: ignore[attr-defined]
            if t["role"] == "vcpu"}
    assert sorted(vcpu) == [0, 1]
    for index, tid in vcpu.items():  # Kata: vCPU i on the i-th CPU of the cpuset "0-1"
        os.sched_setaffinity(tid, {index})
    before = affinities(q.pid)

    out = json.loads(kata.vmpin("reconcile", "--once", "--json").stdout)
    # (the report lists the threads that are not "ok")
    actions = {t["tid"]: t["action"] for o in out for t in o["threads"]}
    assert {actions.get(tid, "ok") for tid in vcpu.values()} == (
        {"ok"} if vcpu_policy == "auto" else {"unmanaged"})
    assert "pinned" not in actions.values()
    assert affinities(q.pid) == before  # nothing moved, vCPUs least of all
    if vcpu_policy == "auto":
        assert "in Kata's order" in str(kata.show(q.sandbox_id)["reason"])

    audit = kata.vmpin("audit", "--json")
    result = json.loads(audit.stdout)
    assert result["ok"] and result["violations"] == []
    assert result["notes"][0].startswith(f"Kata configuration {conf}: [runtime]"
                                         " enable_vcpus_pinning = true")
    mine = [n for n in result["notes"] if n.startswith(f"sandbox {q.sandbox_id}: Kata pins")]
    assert len(mine) == 1
    assert ("Kata's layout" if vcpu_policy == "auto" else "left where Kata pinned") in mine[0]
    text = kata.vmpin("audit").stdout
    assert f"note      Kata configuration {conf}" in text and text.rstrip().endswith(
        "0 violations")
    doctor = kata.vmpin("doctor", "--dry-run").stdout
    assert f"Kata configuration {conf}: [runtime] enable_vcpus_pinning = true" in doctor

    # Kata's pinning off: the same vCPUs are vmpin's again, and float moves them (contrast)
    conf.write_text('[runtime]\nenable_vcpus_pinning = false\n')
    if vcpu_policy == "float":
        assert kata.vmpin("audit", check=False).returncode == 1
        kata.vmpin("reconcile", "--once")
        assert {affinities(q.pid)[tid] for tid in vcpu.values()} == {"0-1"}
    assert json.loads(kata.vmpin("audit", "--json").stdout)["notes"] == []
