"""A node of N fake-VMM Kata sandboxes, made and torn down for one benchmark size.

Shared by bench/bench_idle_pass.py (a node pass, audit, the agent), bench/bench_event_pass.py
(the agent's event pass), bench/bench_read.py and bench/bench_agent_reply.py: each sandbox is
a fake QEMU process (tests/support/fakevmm.py: ``-name sandbox-<id>``, 2 vCPU threads named
"CPU n/KVM", an iothread, the main thread; 4 threads each) registered through the store API
as a Kata sandbox with a pause container (no CPU set) and one workload container (CPU 0 or 1,
alternating), with Kata's shared directory (``<publish>/<id>/mounts``), so every pass keeps
each sandbox's guest map current as on a real node.  Sandbox ids are ``idle0000``, ...

Imported by the scripts here, which put the repository on ``sys.path`` first.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tests.support import fakevmm
from vmpin.core.cpuset import CpuSet
from vmpin.linux.paths import HostPaths
from vmpin.state.records import ContainerRec, SandboxRec
from vmpin.state.store import Store


def stop_agent(agent: subprocess.Popen[bytes]) -> None:
    """A bench's ``vmpin serve``, stopped by its pid: asked first, killed past 30 s."""
    agent.send_signal(signal.SIGTERM)
    try:
        agent.wait(timeout=30)
    except subprocess.TimeoutExpired:
        agent.kill()
        agent.wait()


def make_paths(root: Path) -> HostPaths:
    return HostPaths(
        state_dir=str(root / "state"),
        vm_dir=str(root / "vm"),
        runc_root=str(root / "runc"),
        kubelet_state=str(root / "no-kubelet"),
        publish_dir=str(root / "publish"),
    )


def _populate(root: Path, n: int, vmms: list[fakevmm.FakeVmm], vcpus: int) -> HostPaths:
    """Each VMM goes into ``vmms`` as it starts: a failure halfway leaves none unkilled."""
    paths = make_paths(root)
    (root / "vm").mkdir(parents=True)
    with Store(paths.state_dir) as store:
        for i in range(n):
            sid = f"idle{i:04d}"
            vmms.append(fakevmm.start(root / "vm", sid, vcpus=vcpus))
            # Kata's per-sandbox shared dir: each pass publishes (checks) the guest map too
            (root / "publish" / sid / "mounts").mkdir(parents=True)
            store.put_sandbox(SandboxRec(sid, "kata"))
            store.put_container(ContainerRec(sid, sid, True, name="pause"))
            store.put_container(
                ContainerRec(f"{sid}-app", sid, False, name="app", cpus=CpuSet.parse(str(i % 2)))
            )
    return paths


@contextlib.contextmanager
def fake_node(
    n: int, prefix: str, dir: str | None = None, vcpus: int = 2
) -> Iterator[tuple[Path, HostPaths, list[fakevmm.FakeVmm]]]:
    """A fresh temporary root holding ``n`` sandboxes: (root, paths, VMMs); afterwards every VMM
    killed by its pid and the root removed, whatever happened.  ``vcpus`` per VMM: a pass's
    per-thread work shows at 32 (a 37-thread VM, as bench_update_peer.py's)."""
    root = Path(tempfile.mkdtemp(prefix=prefix, dir=dir))
    vmms: list[fakevmm.FakeVmm] = []
    try:
        paths = _populate(root, n, vmms, vcpus)
        yield root, paths, vmms
    finally:
        for v in vmms:
            v.kill()
        shutil.rmtree(root, ignore_errors=True)


def sizes(spec: str) -> list[int]:
    """``--sandboxes 50,500,2000``: the node sizes, in the order given."""
    return [int(x) for x in spec.split(",") if x]


@contextlib.contextmanager
def widen() -> Iterator[None]:
    """This process and the fake VMMs it starts on every online CPU (processes here start on
    CPU 0 alone: the start-up pass would then have little to pin)."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, range(os.cpu_count() or 1))
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
