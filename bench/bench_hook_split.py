"""Where a hook's wall time goes when it talks to the agent: its own work, the wait, the rest.

bench/bench_hook.py times a hook whole; for the agent paths that whole is the hook's own work
plus the agent's: a Kata hook waits for the agent's event pass (and the guest map) before it
returns.  Here each timed prestart runs under ``strace -f -ttt -T --seccomp-bpf``, tracing
only ``execve``, ``connect``, ``sendto``, ``recvfrom`` and ``exit_group`` (seccomp: no other
syscall stops the hook), which marks, with no change to the hook:

``own``    exec -> the request sent (``sendto`` returns): the interpreter, the imports, the
           event read and journaled, the protocol's modules, the connect;
``wait``   sent -> the answer read (the last ``recvfrom`` returns): the agent's pass, and
           the journal's syncs the hook runs meanwhile;
``after``  answered -> ``exit_group`` (runc-agent: the hook does not wait for the answer, so
           its wait is 0 and this is sent -> exit).

Medians in ms over ``--runs`` prestarts (each Kata one followed by its untimed poststop, as in
bench_hook.py), next to a bare interpreter's wall under the same strace.  Under ptrace each
traced syscall costs a few us more: compare runs of this script with each other, not with
bench_hook.py's ratios.

    python bench/bench_hook_split.py [--path kata-agent|runc-agent] [--runs 40]
                                     [--vmpin LAUNCHER] [--tmpdir DIR] [--containerd-spec]
                                     [--json]

Needs root (cgroups, QEMU) and strace >= 5.3 (``--seccomp-bpf``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import bench_hook as bh  # noqa: E402 (beside this file)

TRACE = ["strace", "-f", "-ttt", "-T", "--seccomp-bpf",
         "-e", "trace=execve,connect,sendto,recvfrom,exit_group"]  # fmt: skip
#: "PID SECONDS.USEC syscall(... = RESULT <DURATION>" (strace -f -ttt -T); a call another
#: traced thread interrupted is split: "... <unfinished ...>", then "<... syscall resumed>..."
CALL = re.compile(r"^(\d+)\s+(\d+\.\d+) (?:<\.\.\. )?(\w+)(?: resumed>|\()")
DURATION = re.compile(r"<(\d+\.\d+)>$")


def marks(trace: str) -> dict[str, float]:
    """The moments (seconds) the split needs, from one strace output: the first process's
    calls (the hook's), each as (name, start, end)."""
    calls: list[tuple[str, float, float]] = []
    pending: dict[tuple[str, str], float] = {}
    hook = None
    for line in trace.splitlines():
        m = CALL.match(line)
        if m is None:
            continue
        pid, t, name = m.group(1), float(m.group(2)), m.group(3)
        hook = hook or pid
        if pid != hook:
            continue
        if line.endswith("<unfinished ...>"):
            pending[(pid, name)] = t
            continue
        start = pending.pop((pid, name), t) if "resumed>" in line else t
        d = DURATION.search(line)
        calls.append((name, start, start + float(d.group(1)) if d else t))
    start = next(t for name, t, _ in calls if name == "execve")
    sent = [end for name, _, end in calls if name == "sendto"]
    # (a plain container's hook does not wait for the answer: vmpin.service.control.post)
    answered = [end for name, _, end in calls if name == "recvfrom"] or sent
    end = next(t for name, t, _ in reversed(calls) if name == "exit_group")
    if not sent:
        raise SystemExit(f"no request to the agent in the trace:\n{trace[-2000:]}")
    return {"start": start, "sent": sent[0], "answered": answered[-1], "end": end}


def traced(argv: list[str], stdin: bytes, env: dict[str, str], out: Path) -> tuple[float, str]:
    """``argv`` run under strace: its wall time (s) and the trace."""
    t0 = time.perf_counter()
    proc = subprocess.run([*TRACE, "-o", str(out), *argv], input=stdin, env=env,
                          capture_output=True)  # fmt: skip
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0 or proc.stderr:
        raise SystemExit(f"{argv} failed: {proc.returncode} {proc.stderr.decode().strip()}")
    return elapsed, out.read_text()


def split(name: str, args: argparse.Namespace, vmpin: list[str]) -> dict[str, object]:
    """Set the node up as bench_hook does (hook_node), trace ``args.runs`` prestarts, take
    everything down again (by pid)."""
    with bh.hook_node(name, vmpin, "bench-split", args.tmpdir) as (work, env, pid, sid, kata):
        rows: dict[str, list[float]] = {"own": [], "wait": [], "after": [], "hook": [],
                                        "bare": []}  # fmt: skip
        for n in range(1, args.warmup + args.runs + 1):
            cid = f"ctr{n}"
            b, ann = bh.write_bundle(work, cid, sid or f"pod{n}", "1" if kata else "0",
                                     args.containerd_spec)  # fmt: skip
            wall, trace = traced([*vmpin, "hook", "prestart"], bh.state(cid, pid, b, ann, kata),
                                 env, work / "trace")  # fmt: skip
            bare, _ = traced([sys.executable, "-c", "pass"], b"", env, work / "trace")
            if kata:
                bh.timed([*vmpin, "hook", "poststop"], bh.state(sid, None, b, ann, True), env)
            if n <= args.warmup:
                continue
            m = marks(trace)
            rows["own"].append(m["sent"] - m["start"])
            rows["wait"].append(m["answered"] - m["sent"])
            rows["after"].append(m["end"] - m["answered"])
            rows["hook"].append(wall)
            rows["bare"].append(bare)
        figures = {k: round(statistics.median(v) * 1e3, 3) for k, v in rows.items()}
        return {"path": name, "runs": args.runs, "ms": figures}

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--path", default="kata-agent", choices=("kata-agent", "runc-agent"))
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--vmpin", help="the vmpin command (default: beside this python, or PATH)")
    ap.add_argument("--tmpdir", help="where the node's dirs go (a node's /run is tmpfs)")
    ap.add_argument("--containerd-spec", action="store_true",
                    help="config.json as containerd's CRI writes one (~10 KiB)")  # fmt: skip
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if shutil.which("strace") is None:
        raise SystemExit("needs strace")
    result = split(args.path, args, bh.find_vmpin(args.vmpin))
    result["load"] = round(os.getloadavg()[0], 2)
    if args.json:
        print(json.dumps(result))
    else:
        ms = result["ms"]
        assert isinstance(ms, dict)
        print(f"{args.path}: own {ms['own']:.2f} ms, wait {ms['wait']:.2f} ms, after"
              f" {ms['after']:.2f} ms; hook {ms['hook']:.2f} ms, bare interpreter"
              f" {ms['bare']:.2f} ms (medians of {args.runs}, under strace; load"
              f" {result['load']})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
