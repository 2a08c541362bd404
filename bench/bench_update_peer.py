"""``vmpin update`` against the peer tool qemu-affinity: one 32-vCPU QEMU re-pinned, interleaved.

Issue 28's first row: the same re-pin done by ``vmpin update`` (with the agent up, and with
none) and by qemu-affinity (https://github.com/zegelin/qemu-affinity, PyPI ``qemu-affinity``
1.0.0: a small Python script that names QEMU's threads from ``/proc`` and calls
``sched_setaffinity`` on each), with a bare interpreter for scale.

Setup: one real QEMU started as Kata starts it (tests/support/qemu_util.py: ``-name
sandbox-peer32,debug-threads=on -machine q35,accel=kvm -smp 32 -object iothread,id=io0 ...``,
TCG where KVM is missing), recorded as a Kata sandbox (a pause container and a workload
container, as bench_update_latency.py does) in two state dirs that share its VM dir:

``agent``     state dir A, with ``vmpin serve`` running on it (``--interval`` a day: no
              periodic pass moves the threads back while the other tools have them);
``no-agent``  state dir B, no agent: the command reconciles in its own process.

Each round runs, in turn and ``--gap`` seconds apart, four processes, each timed from just
before its fork (the venv's interpreter for all of them, this environment):

``agent``     ``vmpin update peer32-app --cpuset-cpus N`` against state dir A;
``no_agent``  the same against state dir B;
``peer``      ``qemu-affinity PID -p N -t '*:N'``: the QEMU process's main thread, and every
              other thread by name (``*``), to CPU N -- the threads vmpin moves;
``bare``      ``python -c pass``.

The machine may have 2 CPUs, so each re-pin moves every thread (~37: 32 vCPUs, the
iothread, QEMU's main and helper threads) to the other CPU, the one the previous tool did
not choose; each tool's own targets alternate too.  "Moved" is read from the kernel
(``sched_getaffinity`` of every thread of QEMU, polled every 0.2 ms), not taken from the
tool's word.  Reported per series (as JSON on stdout, a table on stderr): from the fork to
every thread moved (``*_to_all_threads``) and to the process's exit (``*_runtime``; vmpin
update returns only once the threads moved), p50/p90/p99; the ratios of the p50s to the
peer's and to the bare interpreter's; and the agent's own timings from its metrics
(``--metrics-port``: its pin latency, its event pass's wall and CPU time, the mean per pass).

Run (as root; qemu-affinity on PATH, or ``--peer`` naming it, e.g. a scratch venv's
``pip install qemu-affinity``)::

    python bench/bench_update_peer.py [--rounds 100] [--smp 32] [--peer PATH] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from bench_idle_pass import env_for, vmpin_cmd  # noqa: E402
from bench_update_latency import metrics_text, summary, tids, wait_all_on  # noqa: E402
from fakenode import make_paths, stop_agent  # noqa: E402

from tests.support.qemu_util import launch  # noqa: E402
from vmpin.core.cpuset import CpuSet  # noqa: E402
from vmpin.linux.paths import HostPaths  # noqa: E402
from vmpin.service import control  # noqa: E402
from vmpin.state.records import ContainerRec, SandboxRec  # noqa: E402
from vmpin.state.store import Store  # noqa: E402

SID = "peer32"
SERIES = ("agent", "no_agent", "peer", "bare")
#: the agent's metrics read at the end: sums and counts, a mean per observation each
AGENT_METRICS = (
    "vmpin_pin_latency_seconds",
    "vmpin_sandbox_pass_seconds",
    "vmpin_event_pass_cpu_seconds",
)


def record(paths: HostPaths) -> None:
    """The QEMU as a Kata sandbox with a pause and a workload container, its CPU 0."""
    with Store(paths.state_dir) as store:
        store.put_sandbox(SandboxRec(SID, "kata"))
        store.put_container(ContainerRec(SID, SID, True, name="pause"))
        store.put_container(ContainerRec(f"{SID}-app", SID, False, name="app", cpus=CpuSet({0})))


def timed(argv: list[str], env: dict[str, str], pid: int | None, cpu: int) -> tuple[float, float]:
    """(ms from the fork to every thread of ``pid`` on ``cpu`` -- to the exit without a
    ``pid`` --, ms to the exit); a failed run raises."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    seen = wait_all_on(pid, cpu) if pid is not None else None
    _, err = proc.communicate(timeout=60)
    done = time.perf_counter()
    if proc.returncode != 0:
        raise RuntimeError(f"{argv[0]} exited {proc.returncode}: {err.decode()}")
    return ((seen if seen is not None else done) - t0) * 1000, (done - t0) * 1000


def report(result: dict[str, object]) -> str:
    """The figures as a table: p50 / p90 / p99 per series, then the ratios."""
    lines = [
        f"{result['smp']} vCPUs, {result['qemu_threads']} threads, {result['accel']},"
        f" {result['host_cpus']} host CPUs, {result['rounds']} rounds",
        f"{'ms':<24}{'p50':>9}{'p90':>9}{'p99':>9}",
    ]
    for key, value in result.items():
        if isinstance(value, dict):
            lines.append(
                f"{key:<24}" + "".join(f"{value[q]:>9.1f}" for q in ("p50_ms", "p90_ms", "p99_ms"))
            )
    lines += [
        f"{k} {v}"
        for k, v in result.items()
        if k.startswith(("ratio_", "agent_")) and not isinstance(v, dict)
    ]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=100, help="samples per series")
    ap.add_argument("--smp", type=int, default=32)
    ap.add_argument("--gap", type=float, default=0.15, help="seconds between two runs")
    ap.add_argument(
        "--peer",
        default=shutil.which("qemu-affinity"),
        help="the qemu-affinity script (default: the one on PATH)",
    )
    ap.add_argument("--json", help="also write the result here, as JSON")
    ap.add_argument("--tmpdir", help="where the state, VM and shared dirs go")
    args = ap.parse_args()
    if not args.peer:
        ap.error("qemu-affinity not found: pip install qemu-affinity, or give --peer PATH")

    root = Path(tempfile.mkdtemp(prefix="vmpin-peer-", dir=args.tmpdir))
    paths_a = make_paths(root / "a")
    # B: its own state, runc root and shared dir; the same VM dir (the same QEMU)
    paths_b = make_paths(root / "b")._replace(vm_dir=paths_a.vm_dir)
    for p in (paths_a, paths_b):
        # Kata's shared dir: each update publishes the sandbox's new guest map, as on a node
        (Path(p.publish_dir) / SID / "mounts").mkdir(parents=True)
    Path(paths_a.vm_dir).mkdir(parents=True)
    env_a, env_b = env_for(paths_a), env_for(paths_b)
    qemu = launch(Path(paths_a.vm_dir), SID, smp=args.smp, debug_threads=True)
    agent = None
    try:
        record(paths_a)
        record(paths_b)
        port = 19000 + os.getpid() % 1000
        agent = subprocess.Popen(
            [*vmpin_cmd(), "serve", "--metrics-port", str(port), "--interval", "86400"],
            env=env_a,
            stderr=open(os.environ.get("VMPIN_BENCH_AGENT_LOG", os.devnull), "ab"),  # noqa: SIM115
        )
        deadline = time.monotonic() + 30
        while control.request(paths_a, {"op": "status"}) is None:
            if time.monotonic() > deadline or agent.poll() is not None:
                raise RuntimeError("agent did not start")
            time.sleep(0.05)
        wait_all_on(qemu.pid, 0)
        threads = len(tids(qemu.pid))
        update = [*vmpin_cmd(), "update", f"{SID}-app", "--cpuset-cpus"]
        moved: dict[str, list[float]] = {s: [] for s in SERIES}
        runtime: dict[str, list[float]] = {s: [] for s in SERIES}
        cpu = 0
        for _ in range(args.rounds):
            for series in SERIES:
                if series != "bare":
                    cpu ^= 1
                n = str(cpu)
                argv, env = {
                    "agent": ([*update, n], env_a),
                    "no_agent": ([*update, n], env_b),
                    "peer": ([args.peer, str(qemu.pid), "-p", n, "-t", f"*:{n}"], env_a),
                    "bare": ([sys.executable, "-c", "pass"], env_a),
                }[series]
                to_all, ran = timed(argv, env, None if series == "bare" else qemu.pid, cpu)
                moved[series].append(to_all)
                runtime[series].append(ran)
                time.sleep(args.gap)
        body = metrics_text(port)
        sums = {
            line.split()[0]: float(line.split()[1])
            for line in body.splitlines()
            if line.startswith(tuple(f"{m}_{k}" for m in AGENT_METRICS for k in ("sum", "count")))
        }
        p50 = {s: summary(moved[s])["p50_ms"] for s in SERIES}
        result = {
            "benchmark": "update_peer",
            "accel": qemu.accel,
            "smp": args.smp,
            "qemu_threads": threads,
            "host_cpus": os.cpu_count(),
            "rounds": args.rounds,
            "gap_s": args.gap,
            "peer": args.peer,
            **{f"{s}_to_all_threads": summary(moved[s]) for s in SERIES if s != "bare"},
            **{f"{s}_runtime": summary(runtime[s]) for s in SERIES},
            "ratio_p50_agent_to_peer": round(p50["agent"] / p50["peer"], 3),
            "ratio_p50_no_agent_to_peer": round(p50["no_agent"] / p50["peer"], 3),
            "ratio_p50_agent_to_bare": round(p50["agent"] / p50["bare"], 3),
            "ratio_p50_no_agent_to_bare": round(p50["no_agent"] / p50["bare"], 3),
            "ratio_p50_peer_to_bare": round(p50["peer"] / p50["bare"], 3),
            **{
                f"agent_{m.removeprefix('vmpin_').removesuffix('_seconds')}_mean_ms": round(
                    1000 * sums.get(f"{m}_sum", 0.0) / max(1.0, sums.get(f"{m}_count", 0.0)), 2
                )
                for m in AGENT_METRICS
            },
        }
        print(report(result), file=sys.stderr)
        print(json.dumps(result, indent=2))
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        return 0
    finally:
        if agent is not None:
            stop_agent(agent)
        qemu.kill()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
