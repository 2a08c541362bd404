"""Benchmark: the read commands against a bare interpreter, at N sandboxes (issue 14: <= 8x).

Setup: N (default 500) fake QEMU processes registered as Kata sandboxes, exactly as
bench/bench_idle_pass.py registers them (tests/support/fakevmm.py: 4 threads each, a pause
container and one workload container on CPU 0 or 1), then one ``vmpin reconcile --once`` so
that the node is as an agent keeps it (every thread pinned; ``audit`` finds nothing).

Each command -- ``containers``, ``sandboxes``, ``show <first sandbox>``, ``audit --json``
(and their ``--json`` forms with ``--all-json``) -- runs as a new process (the console script
``vmpin``, as an operator runs it), interleaved with ``python -c pass`` (the same venv's
interpreter): one pair per round, ``--rounds`` rounds.  Reported per command: the median of
the per-pair ratios (command / bare), the medians of both wall times, and where the time goes:
the command run twice in one process (``vmpin.entry.main``), the first run carrying the
imports and the second not, so ``import_ms`` = first - second and ``work_ms`` = second
(observe + plan + print: what a read command does).  With ``--compare VMPIN`` another build's
console script runs in each round too (its own pair with a bare interpreter):
``compare_ratio_median``, a before/after in one run.

With ``--agent`` every command is measured twice: first with no agent (``commands``), then
with ``vmpin serve`` up on the node (``commands_agent``: the read commands take the agent's
view of its plan, vmpin.service.agent_views; ``--agent-interval``, its periodic pass).  There
each command also reports ``agent_cpu_ms``: the agent's CPU time (user + system, from its
``/proc`` stat) per run over the rounds, which the machine's load does not inflate as it
does wall time (``audit``: its check of the host, or the pass it takes; a periodic pass that
falls within the rounds counts too: ``--agent-interval 3600`` leaves them out).

Run (as root; the fake VMMs need no KVM)::

    python bench/bench_read.py [--sandboxes 500] [--rounds 15] [--json OUT] [--compare VMPIN]
                               [--agent]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from bench_idle_pass import env_for, proc_cpu, vmpin_cmd  # noqa: E402
from fakenode import fake_node  # noqa: E402

#: run a command twice in one process: the first run pays the imports, the second does not
SPLIT = """
import io, json, os, sys, time
from vmpin.entry import main
args = json.loads(sys.argv[1])
out = sys.stdout
times = []
for _ in range(2):
    sys.stdout = io.StringIO()
    t0 = time.perf_counter()
    code = main(list(args))
    times.append(time.perf_counter() - t0)
sys.stdout = out
print(json.dumps({"code": code, "first_ms": times[0] * 1000, "second_ms": times[1] * 1000}))
"""


def wall(cmd: list[str], env: dict[str, str]) -> tuple[float, int]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0, proc.returncode


def measure(
    args: list[str], env: dict[str, str], rounds: int, compare: str | None = None,
    agent: int | None = None,
) -> dict[str, object]:  # fmt: skip
    """One command's figures (``agent``: the pid of the agent that answers it)."""
    bare_cmd = [sys.executable, "-c", "pass"]
    cmd = [*vmpin_cmd(), *args]
    other = [compare, *args] if compare else None
    ratios, ts, bs, other_ratios = [], [], [], []
    code = 0
    wall(cmd, env)  # warm the page cache once
    cpu = proc_cpu(agent) if agent is not None else 0.0
    for _ in range(rounds):
        b, _ = wall(bare_cmd, env)
        t, code = wall(cmd, env)
        ratios.append(t / b)
        ts.append(t * 1000)
        bs.append(b * 1000)
        if other:
            o, _ = wall(other, env)
            b2, _ = wall(bare_cmd, env)
            other_ratios.append(o / b2)
    # (the other build's runs ask the agent too)
    agent_ms = (proc_cpu(agent) - cpu) * 1000 / (rounds * (2 if other else 1)) if agent else None
    split = subprocess.run(
        [sys.executable, "-c", SPLIT, json.dumps(args)], env=env, capture_output=True,
        text=True, check=True,
    )
    parts = json.loads(split.stdout.strip().splitlines()[-1])
    return {
        "exit": code,
        "ratio_median": round(statistics.median(ratios), 2),
        "ratio_max": round(max(ratios), 2),
        "command_ms_median": round(statistics.median(ts), 1),
        "bare_ms_median": round(statistics.median(bs), 2),
        "in_process_first_ms": round(parts["first_ms"], 1),
        "import_ms": round(parts["first_ms"] - parts["second_ms"], 1),
        "work_ms": round(parts["second_ms"], 1),
        **({"compare_ratio_median": round(statistics.median(other_ratios), 2)}
           if other_ratios else {}),
        **({"agent_cpu_ms": round(agent_ms, 1)} if agent_ms is not None else {}),
    }


def start_agent(env: dict[str, str], interval: float, log: Path) -> subprocess.Popen[bytes]:
    """``vmpin serve`` on the bench's node, once it answers and has finished a full pass."""
    agent = subprocess.Popen(
        [*vmpin_cmd(), "serve", "--interval", str(interval), "--metrics-port", "0"],
        env=env, stdout=subprocess.DEVNULL, stderr=log.open("ab"),
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if agent.poll() is not None:
            raise SystemExit(f"the agent ended:\n{log.read_text()}")
        status = subprocess.run([*vmpin_cmd(), "status", "--json"], env=env,
                                capture_output=True, text=True)  # fmt: skip
        if status.returncode == 0:
            got = json.loads(status.stdout)
            if got.get("passes", 0) >= 1 and not got.get("pass_running") and not got["queue"]:
                return agent
        time.sleep(0.2)
    agent.kill()
    raise SystemExit("the agent did not finish its start-up pass in 120 s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sandboxes", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--all-json", action="store_true", help="also every command with --json")
    ap.add_argument("--json", help="also write the result here")
    ap.add_argument("--compare", metavar="VMPIN",
                    help="another vmpin console script (e.g. a checkout of main's venv), run"
                    " interleaved too: compare_ratio_median (A/B in one run)")
    ap.add_argument("--agent", action="store_true",
                    help="also measure every command with `vmpin serve` up (commands_agent)")
    ap.add_argument("--agent-interval", type=float, default=5.0,
                    help="the agent's --interval (seconds; default 5, the agent's own)")
    args = ap.parse_args()
    with fake_node(args.sandboxes, "vmpin-read-") as (root, paths, vmms):
        env = env_for(paths)
        subprocess.run([*vmpin_cmd(), "reconcile", "--once"], env=env, check=True,
                       stdout=subprocess.DEVNULL)
        first = "idle0000"
        commands = [["containers"], ["sandboxes"], ["show", first], ["audit", "--json"]]
        if args.all_json:
            commands += [["containers", "--json"], ["sandboxes", "--json"],
                         ["show", first, "--json"], ["audit"]]
        results = {" ".join(c): measure(c, env, args.rounds, args.compare) for c in commands}
        agent_results = None
        if args.agent:
            agent = start_agent(env, args.agent_interval, root / "agent.log")
            try:
                agent_results = {
                    " ".join(c): measure(c, env, args.rounds, args.compare, agent.pid)
                    for c in commands
                }
            finally:
                agent.terminate()
                agent.wait(30)
        result = {
            "benchmark": "read_commands",
            "sandboxes": args.sandboxes,
            "threads": sum(len(v.tids()) for v in vmms),
            "rounds": args.rounds,
            "cpus": os.cpu_count(),
            "commands": results,
            **({"agent_interval": args.agent_interval, "commands_agent": agent_results}
               if agent_results is not None else {}),
        }
        print(json.dumps(result, indent=2))
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        return 0


if __name__ == "__main__":
    sys.exit(main())
