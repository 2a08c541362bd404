"""The agent's side of issue #14: node passes per full pass, and the blocking reply.

Two measurements, each a subcommand:

``passes``  N fake QEMU processes (tests/support/fakevmm.py: 4 threads each, registered as
            Kata sandboxes, as in bench_idle_pass.py).  An in-process
            :class:`vmpin.service.agent.Agent` whose ``Reconciler.reconcile`` is counted:
            the node passes its start-up pass and each of ``--passes`` periodic full passes
            cost (before issue #14: one per sandbox, N per full pass).  Then the real agent
            (``vmpin serve`` as a subprocess): its RSS (VmRSS, VmHWM from /proc) after the
            start-up pass and after ``--passes`` idle passes, and the CPU of those passes.
``reply``   one real QEMU started as Kata starts it (tests/support/qemu_util.py, ``-smp 32``,
            KVM; ~37 threads), registered as a Kata sandbox; ``vmpin serve`` as a
            subprocess.  Each of ``--updates`` updates: the caller's store write (not timed),
            then ``control.notify(..., wait=5)`` -- ``{"op":"dirty","wait":5}`` -- timed from
            just before the request is sent to its reply; then every thread of the QEMU is
            read back from the kernel (sched_getaffinity) and must carry the new CPU: a reply
            that came before the pin counts as a failure.  Updates alternate CPU 0 and 1 and
            go back to back (a blocking caller is not held off, so no gap is needed).
            Interleaved with each, the same kind of update done by a node pass in this
            process (``Reconciler.reconcile``, what the agent's pass runs): the floor the
            reply stands on; ``agent_overhead_ms`` is the median of the pair differences
            (wake-ups, socket, the agent's accounting).
            The state dir is on a tmpfs (``--root``, default /dev/shm) as ``/run/vmpin``
            is on a node: on a disk, each pass's one commit (``synchronous=FULL``) adds an
            fsync of a few ms that is the disk's, not the agent's.

Run (as root)::

    python bench/bench_agent_reply.py passes [--sandboxes 500] [--passes 3] [--json OUT]
    python bench/bench_agent_reply.py reply [--updates 200] [--smp 32] [--root DIR] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from bench_idle_pass import (  # noqa: E402
    env_for,
    proc_cpu,
    vmpin_cmd,
    wait_agent_pass,
)
from fakenode import fake_node, make_paths, stop_agent  # noqa: E402

from vmpin.core.cpuset import CpuSet  # noqa: E402
from vmpin.linux.paths import HostPaths  # noqa: E402
from vmpin.reconcile.reconciler import Reconciler  # noqa: E402
from vmpin.service import control  # noqa: E402
from vmpin.service.agent import Agent  # noqa: E402
from vmpin.state.records import ContainerRec, SandboxRec  # noqa: E402
from vmpin.state.store import Store  # noqa: E402


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[max(0, min(len(s) - 1, round(q / 100 * len(s) + 0.5) - 1))]  # nearest rank


def summary(ms: list[float]) -> dict[str, float]:
    return {
        "p50": round(pct(ms, 50), 2),
        "p90": round(pct(ms, 90), 2),
        "p99": round(pct(ms, 99), 2),
        "max": round(max(ms), 2),
        "mean": round(statistics.fmean(ms), 2),
    }


def memory(pid: int) -> dict[str, float]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[f"{key}_mb"] = round(int(value.split()[0]) / 1024, 1)
    return out


def start_agent(paths: HostPaths) -> subprocess.Popen[bytes]:
    cmd = [*vmpin_cmd(), "serve", "--interval", "3600", "--metrics-port", "0"]
    return subprocess.Popen(cmd, env=env_for(paths), stderr=subprocess.DEVNULL)


# -- passes ------------------------------------------------------------------------------------
def wait_pass(agent: Agent, number: int, timeout: float = 600) -> dict[str, Any]:
    """The in-process agent's status once its pass ``number`` has ended."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = agent.status()
        if st["passes"] >= number and not st["pass_running"] and st.get("last_pass_cause"):
            return st
        time.sleep(0.01)
    raise TimeoutError("pass did not finish")


def count_passes(paths: HostPaths, passes: int) -> dict[str, Any]:
    calls = [0]
    real = Reconciler.reconcile

    def counted(self: Reconciler, *args: Any, **kw: Any) -> Any:
        calls[0] += 1
        return real(self, *args, **kw)

    Reconciler.reconcile = counted  # type: ignore[method-assign]
    try:
        agent = Agent(paths, partial(Reconciler, paths), interval=3600, metrics_port=0)
        agent.start()
        wait_pass(agent, 1)
        startup = calls[0]
        per_pass = []
        for k in range(passes):
            before = calls[0]
            assert agent.full_pass("periodic")
            wait_pass(agent, 2 + k)
            per_pass.append(calls[0] - before)
        agent.request_stop()
        agent.shutdown()
    finally:
        Reconciler.reconcile = real  # type: ignore[method-assign]
    return {"startup_node_passes": startup, "periodic_node_passes": per_pass}


def real_agent_memory(paths: HostPaths, passes: int) -> dict[str, Any]:
    agent = start_agent(paths)
    try:
        st = wait_agent_pass(paths, 1)
        out: dict[str, Any] = {
            "startup_pass_cpu_s": st.get("last_pass_cpu_s"),
            "after_startup": memory(agent.pid),
        }
        cpus = []
        for k in range(passes):
            c0 = proc_cpu(agent.pid)
            control.request(paths, {"op": "reconcile"})
            wait_agent_pass(paths, 2 + k)
            cpus.append(proc_cpu(agent.pid) - c0)
        out["idle_pass_cpu_s_median"] = round(statistics.median(cpus), 3)
        out["after_idle_passes"] = memory(agent.pid)
        st = control.request(paths, {"op": "status"}) or {}
        out["node_passes"] = st.get("node_passes")
        out["full_passes"] = st.get("passes")
        return out
    finally:
        stop_agent(agent)


def cmd_passes(args: argparse.Namespace) -> dict[str, Any]:
    with fake_node(args.sandboxes, "vmpin-passes-") as (_, paths, _):
        return {
            "benchmark": "agent_passes",
            "sandboxes": args.sandboxes,
            "in_process": count_passes(paths, args.passes),
            "real_agent": real_agent_memory(paths, args.passes),
        }


# -- reply -------------------------------------------------------------------------------------
def all_on(pid: int, cpu: int) -> tuple[bool, int]:
    want = {cpu}
    tids = os.listdir(f"/proc/{pid}/task")
    return all(os.sched_getaffinity(int(t)) == want for t in tids), len(tids)


def cmd_reply(args: argparse.Namespace) -> dict[str, Any]:
    from tests.support.qemu_util import launch

    root = Path(tempfile.mkdtemp(prefix="vmpin-reply-", dir=args.root))
    paths = make_paths(root)
    (root / "vm").mkdir(parents=True)
    sid = "reply32"
    qemu = launch(root / "vm", sid, args.smp, True, False, ("io0",), None)
    agent = None
    try:
        with Store(paths.state_dir) as store:
            store.put_sandbox(SandboxRec(sid, "kata"))
            store.put_container(ContainerRec(sid, sid, True, name="pause"))
            store.put_container(
                ContainerRec(f"{sid}-app", sid, False, name="app", cpus=CpuSet({0}))
            )
        agent = start_agent(paths)
        wait_agent_pass(paths, 1)
        ms: list[float] = []
        floor: list[float] = []
        failures = 0
        threads = 0
        cpu = 0
        with Store(paths.state_dir) as store:
            reconciler = Reconciler(paths, store)
            for _ in range(args.updates):
                cpu ^= 1
                store.set_container_cpus(f"{sid}-app", CpuSet({cpu}), "update")
                t0 = time.perf_counter()
                done = control.notify(paths, [sid], wait=5.0)
                ms.append((time.perf_counter() - t0) * 1000)
                pinned, threads = all_on(qemu.pid, cpu)
                failures += int(not (done and pinned))
                cpu ^= 1  # the floor: the same update as a node pass in this process
                store.set_container_cpus(f"{sid}-app", CpuSet({cpu}), "update")
                t0 = time.perf_counter()
                reconciler.reconcile([sid])
                floor.append((time.perf_counter() - t0) * 1000)
                reconciler.last_plan = None
        st = control.request(paths, {"op": "status"}) or {}
        return {
            "benchmark": "agent_reply",
            "smp": args.smp,
            "threads": threads,
            "updates": args.updates,
            "not_pinned_at_reply": failures,
            "reply_ms": summary(ms),
            "in_process_pass_ms": summary(floor),
            "agent_overhead_ms": round(
                statistics.median(a - b for a, b in zip(ms, floor, strict=True)), 2
            ),
            "node_passes": st.get("node_passes"),
        }
    finally:
        if agent is not None:
            stop_agent(agent)
        qemu.kill()
        shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    p = sub.add_parser("passes", help="node passes per full pass; the agent's RSS")
    p.add_argument("--sandboxes", type=int, default=500)
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--json", help="also write the result here")
    r = sub.add_parser("reply", help="blocking dirty reply latency, real 32-vCPU QEMU")
    r.add_argument("--updates", type=int, default=200)
    r.add_argument("--smp", type=int, default=32)
    r.add_argument(
        "--root",
        default="/dev/shm" if os.path.isdir("/dev/shm") else None,
        help="where the state dir goes (a tmpfs, as /run is on a node)",
    )
    r.add_argument("--json", help="also write the result here")
    args = ap.parse_args()
    result = cmd_passes(args) if args.what == "passes" else cmd_reply(args)
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    if args.what == "reply":
        return 0 if result["not_pinned_at_reply"] == 0 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
