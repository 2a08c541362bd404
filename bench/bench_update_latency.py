"""Benchmark 1: from ``vmpin update`` to every thread of a 32-vCPU sandbox carrying the new mask.

Setup: one real QEMU started as Kata starts it (tests/qemu_util.py: ``-name sandbox-lat32,
debug-threads=on -machine q35,accel=kvm -smp 32 -object iothread,id=io0 ...``, TCG where KVM
is missing), registered through the store API as a Kata sandbox with a pause container and a
workload container; the agent runs as ``vmpin serve`` (a subprocess, default settings).

This machine has 2 CPUs, so the update alternates the workload container between CPU 0 and
CPU 1: each time all 32 vCPU threads, the iothread and the emulator threads (~38 threads)
must move to the other CPU.  "Carrying the new mask" is read from the kernel
(sched_getaffinity of every thread of the QEMU process, polled every 0.2 ms), not taken from
vmpin's word.  Updates are 0.15 s apart: further apart than the agent's holdoff (0.1 s), so
each is an isolated update (a storm is benchmarked by tests/test_agent.py's storm test).

Three series (``--samples`` each, default 200):

``cli``     ``vmpin update lat32-app --cpuset-cpus N`` as a new process (what CRI tooling
            runs): from just before the fork to every thread on the new CPU; also the
            command's own run time (it returns once the agent's blocking reply says a pass
            that saw the write has finished -- or, with an agent that does not give that
            reply, once it has re-pinned in-process).  ``vmpin update`` runs as every
            command does (vmpin.entry: no typer, no pydantic).
``notify``  what ``vmpin update`` does once started, from this process: the store write,
            then the blocking ``dirty`` request (``{"op": "dirty", "wait": ...,
            "guest_map": "after"}``), the write synced while the agent works.  Timed from
            the write to the agent's reply (``notify_agent_reply``), from the request to
            the reply (``agent_reply``: the agent's part, its pass and the round trip; the
            command's own write is not in it) and from the write to every thread on the new
            CPU (``notify_to_all_threads``).  ``agent_blocking_reply``: every reply said
            done.
``no-agent``  (``--no-agent-samples``, default 50) ``vmpin update`` with no agent running:
            the command reconciles the sandbox itself.

Also ``bare_interpreter``: ``python -c pass`` (this venv), interleaved with the cli series,
for scale; and with ``--compare VMPIN`` another build's ``vmpin update`` interleaved with this
one's in the cli and no-agent series (``compare_*``), for a before/after in one run.

Run (as root)::

    python bench/bench_update_latency.py [--samples 200] [--smp 32] [--json OUT] [--tmpdir DIR]
        [--compare /path/to/other/venv/bin/vmpin]
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

from bench_idle_pass import env_for, vmpin_cmd  # noqa: E402
from fakenode import make_paths  # noqa: E402

from tests.support.qemu_util import launch  # noqa: E402
from vmpin.core.cpuset import CpuSet  # noqa: E402
from vmpin.linux.paths import HostPaths  # noqa: E402
from vmpin.service import control  # noqa: E402
from vmpin.state.records import ContainerRec, SandboxRec  # noqa: E402
from vmpin.state.store import Store  # noqa: E402

SID = "lat32"
POLL = 0.0002


def tids(pid: int) -> list[int]:
    return [int(t) for t in os.listdir(f"/proc/{pid}/task")]


def all_on(pid: int, cpu: int) -> bool:
    want = {cpu}
    for tid in tids(pid):
        try:
            if os.sched_getaffinity(tid) != want:
                return False
        except ProcessLookupError:
            continue
    return True


def wait_all_on(pid: int, cpu: int, timeout: float = 30.0) -> float:
    """Poll until every thread is on ``cpu``; the perf_counter time it was first seen."""
    deadline = time.perf_counter() + timeout
    while True:
        if all_on(pid, cpu):
            return time.perf_counter()
        if time.perf_counter() > deadline:
            raise TimeoutError(f"threads of {pid} not on CPU {cpu} after {timeout}s")
        time.sleep(POLL)


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    k = max(0, min(len(s) - 1, round(q / 100 * len(s) + 0.5) - 1))  # nearest rank
    return s[k]


def summary(ms: list[float]) -> dict[str, float]:
    return {
        "n": len(ms),
        "p50_ms": round(pct(ms, 50), 2),
        "p90_ms": round(pct(ms, 90), 2),
        "p99_ms": round(pct(ms, 99), 2),
        "max_ms": round(max(ms), 2),
        "mean_ms": round(statistics.fmean(ms), 2),
    }


def series_cli(
    paths: HostPaths, env: dict[str, str], pid: int, n: int, gap: float, first_cpu: int,
    bare: list[float] | None = None, compare: list[str] | None = None,
) -> tuple[list[float], list[float], int, list[float]]:
    """``vmpin update`` as a new process, ``n`` times: (to all threads, command run time, the
    last CPU, and -- with ``compare``, another vmpin run interleaved -- its to-all-threads)."""
    to_threads, cmd_time, other = [], [], []
    cpu = first_cpu
    for _ in range(n):
        if bare is not None:
            b0 = time.perf_counter()
            subprocess.run([sys.executable, "-c", "pass"], check=True)
            bare.append((time.perf_counter() - b0) * 1000)
        for exe, out in ((vmpin_cmd(), to_threads), *([(compare, other)] if compare else [])):
            cpu ^= 1
            t0 = time.perf_counter()
            proc = subprocess.Popen(
                [*exe, "update", f"{SID}-app", "--cpuset-cpus", str(cpu)],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
            seen = wait_all_on(pid, cpu)
            _, err = proc.communicate(timeout=60)
            done = time.perf_counter()
            if proc.returncode != 0:
                raise RuntimeError(f"vmpin update failed: {err.decode()}")
            out.append((seen - t0) * 1000)
            if out is to_threads:
                cmd_time.append((done - t0) * 1000)
            time.sleep(gap)
    return to_threads, cmd_time, cpu, other


def series_notify(
    paths: HostPaths, pid: int, n: int, gap: float, first_cpu: int
) -> tuple[list[float], list[float], list[float], bool, int]:
    """The agent's part: (write to all threads, write to the reply, request to the reply,
    whether every reply was blocking, the last CPU)."""
    out, replies, agent = [], [], []
    blocking = True
    cpu = first_cpu
    with Store(paths.state_dir) as store:
        store.defer_durability()  # as vmpin update writes: synced while the agent works
        for _ in range(n):
            cpu ^= 1
            t0 = time.perf_counter()
            store.set_container_cpus(f"{SID}-app", CpuSet({cpu}), "update")
            t_ask = time.perf_counter()
            # the request vmpin update makes (control.notify(..., wait=, meanwhile=,
            # maps_first=False)), its reply kept; the write is durable (store.sync) before
            # the reply is read, and the guest map is published after the reply
            msg = {"op": "dirty", "sandboxes": [SID], "wait": 10.0, "guest_map": "after"}
            reply = control.request(paths, msg, timeout=11.0, meanwhile=store.sync)
            t_reply = time.perf_counter()
            if not reply or not reply.get("ok"):
                raise RuntimeError(f"agent did not take the notification: {reply}")
            blocking = blocking and reply.get("done") is True
            replies.append((t_reply - t0) * 1000)
            agent.append((t_reply - t_ask) * 1000)
            out.append((wait_all_on(pid, cpu) - t0) * 1000)
            time.sleep(gap)
    return out, replies, agent, blocking, cpu


def metrics_text(port: int) -> str:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        return str(reply.read().decode())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--no-agent-samples", type=int, default=50)
    ap.add_argument("--smp", type=int, default=32)
    ap.add_argument("--gap", type=float, default=0.15, help="seconds between updates")
    ap.add_argument("--json", help="also write the result here")
    ap.add_argument("--compare", metavar="VMPIN",
                    help="another vmpin console script (e.g. a checkout of main's venv):"
                    " its update interleaved with this one's in the cli series (A/B)")
    ap.add_argument("--tmpdir", help="where the state, VM and shared dirs go (default: the"
                    " system's temp dir; on a node they are on /run, a tmpfs: /dev/shm)")
    args = ap.parse_args()

    root = Path(tempfile.mkdtemp(prefix="vmpin-lat-", dir=args.tmpdir))
    paths = make_paths(root)
    (root / "vm").mkdir()
    # Kata's shared dir: each update publishes the sandbox's new guest map, as on a node
    (Path(paths.publish_dir) / SID / "mounts").mkdir(parents=True)
    env = env_for(paths)
    qemu = launch(root / "vm", SID, smp=args.smp, debug_threads=True)
    agent = None
    try:
        with Store(paths.state_dir) as store:
            store.put_sandbox(SandboxRec(SID, "kata"))
            store.put_container(ContainerRec(SID, SID, True, name="pause"))
            store.put_container(
                ContainerRec(f"{SID}-app", SID, False, name="app", cpus=CpuSet({0}))
            )
        port = 19000 + os.getpid() % 1000
        agent = subprocess.Popen(
            [*vmpin_cmd(), "serve", "--metrics-port", str(port)],
            env=env,
            stderr=open(os.environ.get("VMPIN_BENCH_AGENT_LOG", os.devnull), "ab"),  # noqa: SIM115
        )
        deadline = time.monotonic() + 30
        while control.request(paths, {"op": "status"}) is None:
            if time.monotonic() > deadline or agent.poll() is not None:
                raise RuntimeError("agent did not start")
            time.sleep(0.05)
        wait_all_on(qemu.pid, 0)
        threads = len(tids(qemu.pid))
        bare: list[float] = []
        compare = [args.compare] if args.compare else None
        cli, cli_cmd, last, other = series_cli(
            paths, env, qemu.pid, args.samples, args.gap, 0, bare, compare
        )
        notify, replies, agent_reply, blocking, last = series_notify(
            paths, qemu.pid, args.samples, args.gap, last
        )
        body = metrics_text(port)
        agent_lat = {
            line.split()[0]: float(line.split()[1])
            for line in body.splitlines()
            if line.startswith(
                (
                    "vmpin_pin_latency_seconds_sum",
                    "vmpin_pin_latency_seconds_count",
                    "vmpin_sandbox_pass_seconds_sum",
                    "vmpin_sandbox_pass_seconds_count",
                )
            )
        }
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=30)
        agent = None
        no_agent: list[float] = []
        no_agent_other: list[float] = []
        if args.no_agent_samples:
            no_agent, _, _, no_agent_other = series_cli(
                paths, env, qemu.pid, args.no_agent_samples, args.gap, last, None, compare
            )
        result = {
            "benchmark": "update_latency",
            "accel": qemu.accel,
            "smp": args.smp,
            "qemu_threads": threads,
            "host_cpus": os.cpu_count(),
            "gap_s": args.gap,
            "cli_to_all_threads": summary(cli),
            "cli_command_runtime": summary(cli_cmd),
            "compare": args.compare,
            "compare_cli_to_all_threads": summary(other) if other else None,
            "compare_no_agent_cli_to_all_threads": summary(no_agent_other)
            if no_agent_other else None,
            "bare_interpreter": summary(bare),
            "notify_to_all_threads": summary(notify),
            "notify_agent_reply": summary(replies),
            "agent_reply": summary(agent_reply),
            "agent_blocking_reply": blocking,
            "no_agent_cli_to_all_threads": summary(no_agent) if no_agent else None,
            "agent_pin_latency_mean_ms": round(
                1000
                * agent_lat["vmpin_pin_latency_seconds_sum"]
                / max(1.0, agent_lat["vmpin_pin_latency_seconds_count"]),
                2,
            ),
            "agent_sandbox_pass_mean_ms": round(
                1000
                * agent_lat["vmpin_sandbox_pass_seconds_sum"]
                / max(1.0, agent_lat["vmpin_sandbox_pass_seconds_count"]),
                2,
            ),
        }
        print(json.dumps(result, indent=2))
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        return 0
    finally:
        if agent is not None:
            agent.kill()
            agent.wait()
        qemu.kill()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
