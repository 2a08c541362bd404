"""Every hook path stays lean: what `vmpin hook` actually loads, checked at run time.

import-linter checks the static imports of vmpin.service.hook and vmpin.guest; this
runs the real launcher (bin/vmpin, what pip installs as the `vmpin` command) in a fresh
interpreter without site (``-S``: nothing is loaded before it but the interpreter's own
start), on every path a hook can take, and lists every module it loaded:

- runc, no agent: journals only;
- runc, agent answering: journals and notifies (socket, no sqlite3);
- Kata, agent answering the blocking notify: journals and waits for the agent's pass; never
  opens the store (no sqlite3), never plans here;
- Kata, no agent: reconciles a real QEMU in-process (sqlite3, but still no json, typing or
  dataclasses);
- a plain container while a VM runs, no agent: re-plans the node in-process.

The agent is a small real socket server here, speaking the control protocol
(vmpin.service.control): the point is what the *hook* loads, whatever the agent replies.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.fakeagent import ProtocolAgent
from tests.support.qemu_util import QemuHandle, hold_qmp, qemu_factory, spin_bios, wait_until
from tests.support.session import new_id
from vmpin.linux.paths import HostPaths
from vmpin.runtimes.qmp import QmpClient

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER = ROOT / "bin" / "vmpin"
CRI = "io.kubernetes.cri."

#: never on any hook path (json and dataclasses pull in re and inspect: vmpin.wire.jsonio and
#: vmpin.lean.records stand in for them; the agent's socket and QMP's use _socket)
FORBIDDEN = ("typer", "click", "pydantic", "psutil", "kubernetes", "libvirt",
             "prometheus_client", "vmpin.cli", "vmpin.service.agent",
             "vmpin.service.agent_accounting", "vmpin.service.agent_passes",
             "vmpin.service.agent_protocol", "vmpin.service.watch", "json", "typing",
             "dataclasses", "inspect", "socket", "selectors", "subprocess")  # fmt: skip
#: not where the hook only journals and notifies
LEAN = ("re", "enum", "functools", "contextlib", "collections")
#: only where this process re-plans (no agent answered and VMs are involved)
RECONCILE = ("_sqlite3", "vmpin.state.store", "vmpin.reconcile.reconciler")
#: not even there: the sqlite3 package (its dbapi2 imports datetime; the store uses the C
#: module _sqlite3 directly), functools and what it pulls in (_sqlite3 loads without it:
#: vmpin.state.sqlite), re (thread names are parsed with str methods), contextlib,
#: struct (QMP's peer credentials are read by hand), tomllib (Kata's configuration is parsed
#: once per change and the answer kept in the state dir: vmpin.runtimes.kataconfig)
NOT_EVEN_TO_RECONCILE = ("sqlite3", "sqlite3.dbapi2", "datetime", "re", "enum", "contextlib",
                         "struct", "functools", "collections", "collections.abc", "types",
                         "operator", "reprlib", "tomllib")  # fmt: skip

# Runs the launcher as the kernel would (its code as __main__), with os._exit (which the
# launcher calls after a hook) reporting the modules first; imports nothing itself.
PROBE = """
import sys, os
before = set(sys.modules)
path, state = sys.argv[1], sys.argv[2]
sys.argv = [path] + sys.argv[3:]
r, w = os.pipe()
os.write(w, state.encode())
os.close(w)
os.dup2(r, 0)
sys.stdin = open(0, "r", closefd=False)
real_exit = os._exit
def report(code):
    loaded = sorted(set(sys.modules) - before)
    sys.stdout.write("MODULES " + str(code) + " " + " ".join(loaded) + "\\n")
    sys.stdout.flush()
    real_exit(code)
os._exit = report
with open(path) as f:
    code = compile(f.read(), path, "exec")
exec(code, {"__name__": "__main__", "__file__": path})
"""


def hook(env: dict[str, str], stage: str, state: dict[str, object]) -> tuple[set[str], str]:
    """Run the launcher's hook in a fresh `python -S`; the modules it loaded, and stderr."""
    proc = subprocess.run(
        [sys.executable, "-S", "-c", PROBE, str(LAUNCHER), json.dumps(state), "hook",
         "--strict", stage],
        capture_output=True, text=True, timeout=60, env={**env, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("MODULES ")]
    assert lines, (proc.returncode, proc.stdout, proc.stderr)
    _, code, *mods = lines[-1].split(" ")
    assert code == "0", proc.stderr
    return set(mods), proc.stderr


def bundle(tmp: Path, cid: str, sandbox: str, cpus: str | None) -> tuple[Path, dict[str, str]]:
    b = tmp / "bundles" / cid
    b.mkdir(parents=True)
    ann = {CRI + "container-type": "sandbox" if cid == sandbox else "container",
           CRI + "sandbox-id": sandbox, CRI + "container-name": "app"}  # fmt: skip
    spec: dict[str, object] = {"annotations": ann}
    if cpus is not None:
        spec["linux"] = {"resources": {"cpu": {"cpus": cpus}}}
    (b / "config.json").write_text(json.dumps(spec))
    return b, ann


def state(cid: str, b: Path, ann: dict[str, str], pid: int | None) -> dict[str, object]:
    doc: dict[str, object] = {"id": cid, "bundle": str(b), "annotations": ann}
    if pid is not None:
        doc["pid"] = pid
    return doc


def assert_lean(loaded: set[str], reconciled: bool) -> None:
    assert "vmpin.state.journal" in loaded and "vmpin.wire.jsonio" in loaded
    assert not [m for m in FORBIDDEN if m in loaded]
    assert not [m for m in NOT_EVEN_TO_RECONCILE if m in loaded]
    here = [m for m in RECONCILE if m in loaded]
    assert here == (list(RECONCILE) if reconciled else [])
    if not reconciled:
        assert not [m for m in LEAN if m in loaded]
        # the hook's paths come from its host roots; the rest of the Settings only for a
        # pass in this process (vmpin.service.hook._settings: ~0.8 M instructions)
        assert "vmpin.service.settings" not in loaded


@pytest.fixture
def agent(paths: HostPaths) -> Iterator[ProtocolAgent]:
    a = ProtocolAgent(paths)
    yield a
    a.close()


@pytest.fixture
def qemu(vm_dir: Path) -> Iterator[Callable[..., QemuHandle]]:
    with qemu_factory(vm_dir) as start:
        yield start


def test_runc_no_agent(env: dict[str, str], tmp_path: Path, paths: HostPaths) -> None:
    b, ann = bundle(tmp_path, "lean1", "lean1", "0")
    loaded, _ = hook(env, "prestart", state("lean1", b, ann, os.getpid()))
    assert_lean(loaded, reconciled=False)
    assert "socket" not in loaded  # no socket file: not even imported
    # ...nor control's module; and the state pid (this process: its command line does not
    # name the sandbox) is told from a VMM without vmm's module (vmpin.runtimes.oci._cmdline)
    assert "vmpin.service.control" not in loaded
    assert "vmpin.runtimes.vmm" not in loaded
    assert "errno" not in loaded  # (procfs tells errors by OSError's subclasses)
    # NamedTuples only: the dataclass half of vmpin.lean.records stays unloaded (~0.3 M),
    # and so do the dataclass templates (~0.3 M more)
    assert "vmpin.lean.dataclass" not in loaded
    assert "vmpin.lean.initshapes" not in loaded
    # the allocations' two cheap tests are vmpin.state.allocating's: the allocations' own
    # module and its record class stay unloaded (~0.4 M); and no runtime adapter's error
    # class is made (vmpin.core.errors keeps the shared ones: tests/core/test_errors.py)
    assert "vmpin.state.allocations" not in loaded
    # it waits on no other process: the budget's module is the waiting paths' (~0.05 M)
    assert "vmpin.service.budget" not in loaded
    assert not {"vmpin.core.topology", "vmpin.core.planner", "vmpin.linux.affinity",
                "vmpin.runtimes.qmp", "vmpin.runtimes.kubelet"} & loaded  # fmt: skip
    # ...and the event it journaled is in the store for the next reader
    listed = subprocess.run(
        [sys.executable, "-m", "vmpin", "--state-dir", paths.state_dir, "containers", "--json"],
        capture_output=True, text=True, timeout=60, check=True, env=env,
    )  # fmt: skip
    assert [(c["id"], c["cpus"]) for c in json.loads(listed.stdout)] == [("lean1", "0")]


def test_runc_agent_answering(
    env: dict[str, str], tmp_path: Path, agent: ProtocolAgent
) -> None:
    b, ann = bundle(tmp_path, "lean2", "lean2", "0")
    loaded, _ = hook(env, "prestart", state("lean2", b, ann, os.getpid()))
    assert_lean(loaded, reconciled=False)
    # the hook does not wait for the agent's answer (control.post): the request is read
    # after it left
    deadline = time.monotonic() + 10
    while not agent.requests and time.monotonic() < deadline:
        time.sleep(0.01)
    assert agent.requests == [{"op": "dirty", "sandboxes": ["lean2"]}]


@pytest.mark.qemu
def test_kata_agent_answering_never_opens_the_store(
    env: dict[str, str], tmp_path: Path, agent: ProtocolAgent,
    qemu: Callable[..., QemuHandle], paths: HostPaths,
) -> None:  # fmt: skip
    q = qemu(new_id("leank"), smp=2)
    b, ann = bundle(tmp_path, "c1", q.sandbox_id, "1")
    loaded, _ = hook(env, "prestart", state("c1", b, ann, q.pid))
    assert_lean(loaded, reconciled=False)
    assert [r.get("sandboxes") for r in agent.requests] == [[q.sandbox_id]]
    assert all(isinstance(r.get("wait"), float) for r in agent.requests)
    assert not os.path.exists(os.path.join(paths.state_dir, "vmpin.db"))
    assert len(os.listdir(os.path.join(paths.state_dir, "journal"))) == 1


@pytest.mark.qemu
@pytest.mark.multi_cpu
def test_kata_no_agent_reconciles_in_process(
    env: dict[str, str], tmp_path: Path, qemu: Callable[..., QemuHandle], paths: HostPaths
) -> None:
    q = qemu(new_id("leank"), smp=2, debug_threads=True)
    # Kata's shared dir: the hook publishes the guest map too (json-free: vmpin.wire.jsonio
    # writes it indented with sorted keys)
    shared = Path(paths.publish_dir) / q.sandbox_id / "mounts"
    shared.mkdir(parents=True)
    b, ann = bundle(tmp_path, "c1", q.sandbox_id, "1")
    loaded, err = hook(env, "prestart", state("c1", b, ann, q.pid))
    assert err == ""
    assert_lean(loaded, reconciled=True)
    assert "vmpin.runtimes.publish" in loaded
    published = json.loads((shared / "vmpin" / "guest-map.json").read_text())
    assert "c1" in published["containers"]
    # the real work was done here: every QEMU thread is on CPU 1
    for tid in os.listdir(f"/proc/{q.pid}/task"):
        assert os.sched_getaffinity(int(tid)) == {1}, tid


@pytest.mark.qemu
@pytest.mark.multi_cpu
def test_kata_pinning_configuration_known_from_the_state_dir(
    env: dict[str, str], tmp_path: Path, qemu: Callable[..., QemuHandle], paths: HostPaths
) -> None:
    """A node whose Kata configuration turns on enable_vcpus_pinning: once a pass has read it
    (here ``reconcile --once``; on a node, the agent), a hook that pins in-process follows
    Kata's layout without parsing TOML (no tomllib, re or datetime)."""
    conf = Path(paths.kata_config)
    conf.parent.mkdir(parents=True)
    conf.write_text("[runtime]\nenable_vcpus_pinning = true\n")
    subprocess.run([sys.executable, "-m", "vmpin", "reconcile", "--once"], env=env,
                   check=True, capture_output=True, timeout=60)
    assert os.path.exists(paths.kata_config_cache)
    q = qemu(new_id("leank"), smp=2, debug_threads=True)
    b, ann = bundle(tmp_path, "c1", q.sandbox_id, "0-1")
    loaded, err = hook(env, "prestart", state("c1", b, ann, q.pid))
    assert err == ""
    assert_lean(loaded, reconciled=True)
    assert "vmpin.runtimes.kataconfig" in loaded


@pytest.mark.kvm
def test_kata_no_agent_no_names_qmp_held_reads_debugfs_privately(
    env: dict[str, str], tmp_path: Path, qemu: Callable[..., QemuHandle]
) -> None:
    """Kata's default (no names, the shim holds QMP) with vCPU 0 busy in the guest: the
    in-process pass reads KVM's debugfs in a private mount namespace (a posix_spawn'ed child),
    still without subprocess, selectors or contextlib, and records both vCPUs exactly."""
    q = qemu(new_id("leank"), smp=2, extra=("-bios", str(spin_bios(tmp_path))))
    with QmpClient(str(q.qmp_sock), timeout=5.0) as qmp:
        cpus = {index: tid for index, tid, _props in qmp.query_cpus_fast()}
    # vCPU 0 has entered the guest (KVM's debugfs names it from its first KVM_RUN on)
    assert wait_until(lambda: _cpu_ns(q.pid, cpus[0]) > 50_000_000, 20)
    b, ann = bundle(tmp_path, "c1", q.sandbox_id, "1")
    with hold_qmp(q.qmp_sock):
        loaded, _ = hook(env, "prestart", state("c1", b, ann, q.pid))
    assert_lean(loaded, reconciled=True)
    assert "vmpin.linux.debugfs" in loaded and "subprocess" not in loaded
    shown = subprocess.run(
        [sys.executable, "-m", "vmpin", "show", q.sandbox_id, "--json"],
        capture_output=True, text=True, timeout=60, check=True, env=env,
    )  # fmt: skip
    vcpus = {t["index"]: (t["tid"], t["layer"]) for t in json.loads(shown.stdout)["threads"]
             if t["role"] == "vcpu"}  # fmt: skip
    assert vcpus == {ix: (tid, "debugfs-ns") for ix, tid in cpus.items()}


def _cpu_ns(pid: int, tid: int) -> int:
    with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
        return int(f.read().split()[0])


@pytest.mark.qemu
def test_plain_container_while_vms_run(
    env: dict[str, str], tmp_path: Path, qemu: Callable[..., QemuHandle]
) -> None:
    qemu(new_id("leank"), smp=2)
    b, ann = bundle(tmp_path, "plain1", "plain1", "0")
    loaded, err = hook(env, "prestart", state("plain1", b, ann, os.getpid()))
    assert err == ""
    assert_lean(loaded, reconciled=True)


def test_cli_commands_still_reach_typer(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "vmpin", "hook", "--help"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "Fail-open" in proc.stdout


def test_installed_command_is_the_launcher() -> None:
    """The `vmpin` beside this interpreter is bin/vmpin with its shebang set by pip (not pip's
    console-script wrapper, which imports re)."""
    installed = Path(sys.executable).with_name("vmpin")
    if not installed.exists():
        pytest.skip("vmpin is not installed beside this interpreter")
    first, rest = installed.read_text().split("\n", 1)
    assert first.startswith("#!") and "python" in first and "import re" not in rest
    assert rest == LAUNCHER.read_text().split("\n", 1)[1]


def test_post_does_not_wait_for_an_answer(paths: HostPaths) -> None:
    """control.post (a plain container's hook): against a listening socket nobody serves
    yet (a hung agent), the line is delivered and post returns True at once; a client that
    waited for an answer would hit its timeout and say False."""
    from vmpin.service.control import post

    os.makedirs(paths.state_dir, exist_ok=True)
    hung = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    hung.bind(paths.control_socket)
    hung.listen(8)  # not accepted until post has returned
    try:
        assert post(paths, {"op": "dirty", "sandboxes": ["p1"]}, timeout=5.0) is True
        conn, _ = hung.accept()
        with conn:
            assert json.loads(conn.recv(65536)) == {"op": "dirty", "sandboxes": ["p1"]}
    finally:
        hung.close()
    os.unlink(paths.control_socket)
    assert post(paths, {"op": "dirty", "sandboxes": ["p1"]}) is False  # no agent: nothing
