"""Benchmark 3: one periodic pass over 500 idle sandboxes -- its CPU time, and no affinity call.

Setup: N (default 500) fake QEMU processes (bench/fakevmm.py: ``-name sandbox-<id>``, 2 vCPU
threads named "CPU n/KVM", an iothread, the main thread; 4 threads each), each registered
through the store API as a Kata sandbox with a pause container (no CPU set) and one workload
container (CPU 0 or 1, alternating).  The start-up pass pins every thread; every later pass
finds nothing to do, and must do nothing.

Two measurements:

1. *In process*: an :class:`vmpin.service.agent.Agent` whose reconcilers get an ``AffinityBackend``
   wrapper counting ``set()`` calls.  After the start-up pass the counter is reset, then
   ``--passes`` periodic passes run; reported: wall and CPU time per pass (process CPU, all
   threads: ``time.process_time``), and the number of ``set()`` calls (must be 0).
2. *The real agent* (``vmpin serve`` as a subprocess): after its start-up pass, one pass is
   requested over the control socket while ``strace -f --seccomp-bpf -e
   trace=sched_setaffinity`` is attached; reported: the agent's CPU time for that pass (from
   /proc/<pid>/stat, a pass without strace) and the number of sched_setaffinity calls strace
   saw (must be 0).

Run (as root)::

    python bench/bench_idle_pass.py [--sandboxes 500] [--passes 5] [--workers 2] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from tests.support import fakevmm  # noqa: E402
from tests.support.counting import CountingAffinity  # noqa: E402
from vmpin.core.cpuset import CpuSet  # noqa: E402
from vmpin.linux.paths import HostPaths  # noqa: E402
from vmpin.reconcile.reconciler import Reconciler  # noqa: E402
from vmpin.service import control  # noqa: E402
from vmpin.service.agent import Agent  # noqa: E402
from vmpin.state.store import ContainerRec, SandboxRec, Store  # noqa: E402


def make_paths(root: Path) -> HostPaths:
    return HostPaths(
        state_dir=str(root / "state"),
        vm_dir=str(root / "vm"),
        runc_root=str(root / "runc"),
        kubelet_state=str(root / "no-kubelet"),
        publish_dir=str(root / "publish"),
    )


def env_for(paths: HostPaths) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        VMPIN_STATE_DIR=paths.state_dir,
        VMPIN_VM_DIR=paths.vm_dir,
        VMPIN_RUNC_ROOT=paths.runc_root,
        VMPIN_KUBELET_STATE=paths.kubelet_state,
        VMPIN_PUBLISH_DIR=paths.publish_dir,
        VMPIN_LOG_LEVEL=os.environ.get("VMPIN_LOG_LEVEL", "WARNING"),
    )
    return env


def vmpin_cmd() -> list[str]:
    beside = os.path.join(os.path.dirname(sys.executable), "vmpin")
    if os.access(beside, os.X_OK):
        return [beside]
    exe = shutil.which("vmpin")
    return [exe] if exe else [sys.executable, "-m", "vmpin"]


def setup(root: Path, n: int) -> tuple[HostPaths, list[fakevmm.FakeVmm]]:
    paths = make_paths(root)
    (root / "vm").mkdir(parents=True)
    vmms = []
    with Store(paths.state_dir) as store:
        for i in range(n):
            sid = f"idle{i:04d}"
            vmms.append(fakevmm.start(root / "vm", sid, vcpus=2))
            store.put_sandbox(SandboxRec(sid, "kata"))
            store.put_container(ContainerRec(sid, sid, True, name="pause"))
            store.put_container(
                ContainerRec(f"{sid}-app", sid, False, name="app", cpus=CpuSet.parse(str(i % 2)))
            )
    return paths, vmms


def wait_pass(agent: Agent, number: int, timeout: float = 600) -> dict[str, object]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = agent.status()
        if st["passes"] >= number and not st["pass_running"] and st.get("last_pass_cause"):
            return st
        time.sleep(0.01)
    raise TimeoutError("pass did not finish")


def in_process(paths: HostPaths, passes: int, workers: int) -> dict[str, object]:
    counter = CountingAffinity()

    def factory(store: Store) -> Reconciler:
        return Reconciler(paths, store, affinity=counter)

    agent = Agent(paths, factory, interval=3600, workers=workers, metrics_port=0)
    t0 = time.monotonic()
    agent.start()
    st = wait_pass(agent, 1)
    startup = {
        "wall_s": round(time.monotonic() - t0, 3),
        "sets": counter.sets,
        "threads_pinned": st["threads_pinned"],
        "sandboxes": st["sandboxes"],
    }
    counter.sets = counter.gets = 0
    walls, cpus = [], []
    for k in range(passes):
        c0, w0 = time.process_time(), time.monotonic()
        assert agent.full_pass("periodic")
        st = wait_pass(agent, 2 + k)
        cpus.append(time.process_time() - c0)
        walls.append(time.monotonic() - w0)
    agent.request_stop()
    agent.shutdown()
    return {
        "startup_pass": startup,
        "idle_passes": passes,
        "idle_pass_wall_s_median": round(statistics.median(walls), 4),
        "idle_pass_cpu_s_median": round(statistics.median(cpus), 4),
        "idle_pass_cpu_s_max": round(max(cpus), 4),
        "idle_affinity_set_calls": counter.sets,
        "idle_affinity_get_calls": counter.gets,
        "repaired_in_last_pass": st.get("last_pass_repaired"),
    }


def proc_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def status(paths: HostPaths) -> dict[str, object]:
    reply = control.request(paths, {"op": "status"}, timeout=5)
    if reply is None:
        raise RuntimeError("agent not answering")
    return reply


def wait_agent_pass(paths: HostPaths, number: int, timeout: float = 600) -> dict[str, object]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        reply = control.request(paths, {"op": "status"}, timeout=5)
        if reply and reply["passes"] >= number and not reply["pass_running"]:
            return reply
        time.sleep(0.05)
    raise TimeoutError("agent pass did not finish")


def real_agent(paths: HostPaths, workers: int) -> dict[str, object]:
    cmd = [
        *vmpin_cmd(),
        "serve",
        "--interval",
        "3600",
        "--workers",
        str(workers),
        "--metrics-port",
        "0",
    ]
    agent = subprocess.Popen(cmd, env=env_for(paths), stderr=subprocess.DEVNULL)
    out: dict[str, object] = {}
    try:
        st = wait_agent_pass(paths, 1)
        out["startup_pass_cpu_s"] = st.get("last_pass_cpu_s")
        # one untraced idle pass: its CPU time as the kernel accounts it
        c0 = proc_cpu(agent.pid)
        control.request(paths, {"op": "reconcile"})
        st = wait_agent_pass(paths, 2)
        out["idle_pass_cpu_s_proc"] = round(proc_cpu(agent.pid) - c0, 3)
        out["idle_pass_cpu_s_reported"] = st.get("last_pass_cpu_s")
        out["idle_pass_wall_s_reported"] = st.get("last_pass_duration_s")
        if shutil.which("strace"):
            log = Path(paths.state_dir) / "strace.txt"
            tracer = subprocess.Popen(
                [
                    "strace",
                    "-f",
                    "-qq",
                    "--seccomp-bpf",
                    "-e",
                    "trace=sched_setaffinity",
                    "-o",
                    str(log),
                    "-p",
                    str(agent.pid),
                ],
                stderr=subprocess.DEVNULL,
            )
            time.sleep(1.0)  # let strace attach to every thread
            control.request(paths, {"op": "reconcile"})
            wait_agent_pass(paths, 3)
            tracer.send_signal(signal.SIGINT)
            tracer.wait(timeout=30)
            lines = [ln for ln in log.read_text().splitlines() if "sched_setaffinity" in ln]
            out["strace_sched_setaffinity_calls"] = len(lines)
    finally:
        agent.send_signal(signal.SIGTERM)
        try:
            agent.wait(timeout=30)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sandboxes", type=int, default=500)
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--json", help="also write the result here")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="vmpin-idle-"))
    vmms: list[fakevmm.FakeVmm] = []
    try:
        t0 = time.monotonic()
        paths, vmms = setup(root, args.sandboxes)
        threads = sum(len(v.tids()) for v in vmms)
        setup_s = round(time.monotonic() - t0, 1)
        inproc = in_process(paths, args.passes, args.workers)
        real = real_agent(paths, args.workers)
        result: dict[str, object] = {
            "benchmark": "idle_pass",
            "sandboxes": args.sandboxes,
            "threads": threads,
            "workers": args.workers,
            "cpus": os.cpu_count(),
            "setup_s": setup_s,
            "in_process": inproc,
            "real_agent": real,
        }
        print(json.dumps(result, indent=2))
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        ok = inproc["idle_affinity_set_calls"] == 0 and not real.get(
            "strace_sched_setaffinity_calls", 0
        )
        return 0 if ok else 1
    finally:
        for v in vmms:
            v.kill()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
