"""Time `vmpin hook prestart` against `python3 -c pass`: the hook delays every container start.

Each run is a real create of a new container: a fresh bundle whose config.json carries CRI
annotations and `linux.resources.cpu.cpus`, OCI state on stdin with the pid of a real process
sitting in a real cpuset cgroup, and no agent running -- so the hook records the container in
SQLite and reconciles its sandbox in-process (the slow path; with `vmpin serve` up it only
hands the sandbox over).  The two commands are interleaved so that machine noise hits both.

    python3 bench/bench_hook.py [--runs 200] [--vmpin PATH] [--json]

Prints the medians and their ratio; exits 1 when the ratio is above --limit (default 2.5).
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
from pathlib import Path

CGROUP = "/sys/fs/cgroup/cpuset"


def find_vmpin(explicit: str | None) -> list[str]:
    if explicit:
        return [explicit]
    beside = Path(sys.executable).with_name("vmpin")
    if beside.exists():
        return [str(beside)]
    found = shutil.which("vmpin")
    return [found] if found else [sys.executable, "-m", "vmpin"]


def timed(argv: list[str], stdin: bytes, env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(argv, input=stdin, env=env, capture_output=True)
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0 or proc.stderr:
        raise SystemExit(f"{argv} failed: {proc.returncode} {proc.stderr.decode().strip()}")
    return elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--vmpin", help="path of the vmpin console script")
    ap.add_argument("--limit", type=float, default=2.5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="vmpin-bench-hook-"))
    env = dict(os.environ, VMPIN_STATE_DIR=str(work / "state"), VMPIN_VM_DIR=str(work / "vm"),
               VMPIN_RUNC_ROOT=str(work / "runc"), VMPIN_KUBELET_STATE=str(work / "none"))
    cgroup = Path(CGROUP) / f"vmpin-bench-{os.getpid()}"
    sleeper = subprocess.Popen(["sleep", "3600"])
    try:
        if Path(CGROUP).is_dir():
            cgroup.mkdir()
            (cgroup / "cpuset.mems").write_text("0")
            (cgroup / "cpuset.cpus").write_text("0")
            (cgroup / "cgroup.procs").write_text(str(sleeper.pid))
        vmpin = [*find_vmpin(args.vmpin), "hook", "prestart"]
        bare = [sys.executable, "-c", "pass"]
        # warm the page cache and create the database once, as on a node that runs pods
        timed(bare, b"", env)
        hook_t, bare_t = [], []
        for i in range(args.runs + 1):
            bundle = work / "bundles" / f"ctr{i}"
            bundle.mkdir(parents=True)
            ann = {"io.kubernetes.cri.container-type": "container",
                   "io.kubernetes.cri.sandbox-id": f"pod{i}",
                   "io.kubernetes.cri.container-name": "app"}
            (bundle / "config.json").write_text(json.dumps(
                {"ociVersion": "1.0.2", "annotations": ann,
                 "linux": {"resources": {"cpu": {"cpus": "0", "mems": "0"}}}}))
            state = json.dumps({"ociVersion": "1.0.2", "id": f"ctr{i}", "status": "creating",
                                "pid": sleeper.pid, "bundle": str(bundle),
                                "annotations": ann}).encode()
            h = timed(vmpin, state, env)
            b = timed(bare, b"", env)
            if i:  # the first run creates the database: not a container start's cost
                hook_t.append(h)
                bare_t.append(b)
        hook_ms = statistics.median(hook_t) * 1000
        bare_ms = statistics.median(bare_t) * 1000
        ratio = hook_ms / bare_ms
        result = {"runs": args.runs, "hook_median_ms": round(hook_ms, 1),
                  "hook_p90_ms": round(statistics.quantiles(hook_t, n=10)[8] * 1000, 1),
                  "bare_median_ms": round(bare_ms, 1), "ratio": round(ratio, 2),
                  "limit": args.limit}
        if args.json:
            print(json.dumps(result))
        else:
            print(f"vmpin hook prestart: median {result['hook_median_ms']} ms "
                  f"(p90 {result['hook_p90_ms']} ms) over {args.runs} runs")
            print(f"python3 -c pass:     median {result['bare_median_ms']} ms")
            print(f"ratio:               {result['ratio']} (limit {args.limit})")
        return 0 if ratio <= args.limit else 1
    finally:
        sleeper.kill()
        sleeper.wait()
        if cgroup.is_dir():
            cgroup.rmdir()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
