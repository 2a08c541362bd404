"""Time a plain container's hook and ``vmpin update`` on nodes of growing size (issue 26).

Each node: N plain containers in pods of five (store rows, tests/support/bignode.py), and one
Kata sandbox whose QEMU is real (tests/support/qemu_util.py, ``-smp 1``, KVM when usable)
with its vCPU pinned 1:1 on CPU 1; no agent.  On each node, interleaved with a bare
interpreter (``<python> -c pass``, order alternating):

``hook``    ``vmpin hook createRuntime`` of a new app container on CPU 0 (a fresh bundle each
            time, a real pid);
``update``  ``vmpin update <an app container> --cpuset-cpus 0``;
``reconcile`` ``vmpin reconcile --once`` (for scale only: a node pass reads the whole node, so
            its growth is not held to the limit; issue 28 asks it be as lean as update to
            start: no typer, no pydantic).

Reported per size: the median of each command's wall time, its median ratio to the bare
interpreter, and that ratio as a multiple of the same command's on the smallest node: its
growth (issue 26 asks that it stay within 1.5x from 100 to 10,000 containers; taken from the
ratios, as the machine's load moves both sides of a pair alike but not sizes run minutes
apart).  Also the node's
start-up pass (in-process), for scale.  QEMU is stopped by its pid; the node's files removed.

    python bench/bench_scale.py [--sizes 100,2000,10000] [--runs 20] [--json]
                                [--tree DIR]    # another checkout's vmpin (e.g. an old main)

Exits 1 when a command's growth factor is above --limit (default 1.5).
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from bench_hook import timed  # noqa: E402

from tests.support import bignode  # noqa: E402
from tests.support.qemu_util import launch  # noqa: E402
from tests.support.session import vmpin_env  # noqa: E402


def one_size(n: int, args: argparse.Namespace) -> dict[str, object]:
    work = Path(tempfile.mkdtemp(prefix=f"vmpin-bench-scale-{n}-"))
    qemu = None
    try:
        paths = bignode.host_paths(work)
        bignode.populate(paths, n)
        qemu = launch(Path(paths.vm_dir), bignode.VM, smp=1, debug_threads=True)
        env = vmpin_env(paths)
        env.pop("PYTHONDONTWRITEBYTECODE", None)  # as on a node
        tree = Path(args.tree).resolve() if args.tree else HERE.parent
        env["PYTHONPATH"] = str(tree)
        vmpin = [sys.executable, str(tree / "bin" / "vmpin")]
        t0 = time.perf_counter()
        timed([*vmpin, "reconcile", "--once"], b"", env)  # the node's pass: pins the VM
        first_pass = time.perf_counter() - t0
        bare = [sys.executable, "-c", "pass"]
        sleeper = subprocess.Popen(["sleep", "3600"])
        try:
            k = 0

            def hook() -> tuple[float, float]:
                nonlocal k
                k += 1
                cid = f"bench{k}"
                b, ann = bignode.bundle(work, cid, bignode.pod_id(k % max(1, n // 5)), "0")
                doc = bignode.state(cid, sleeper.pid, b, ann)
                return pair([*vmpin, "hook", "--strict", "createRuntime"], doc)

            def update() -> tuple[float, float]:
                return pair([*vmpin, "update", f"{bignode.pod_id(0)}-c1", "--cpuset-cpus", "0"],
                            b"")  # fmt: skip

            flip = [False]

            def pair(argv: list[str], stdin: bytes) -> tuple[float, float]:
                flip[0] = not flip[0]
                if flip[0]:
                    return timed(argv, stdin, env), timed(bare, b"", env)
                t = timed(bare, b"", env)
                return timed(argv, stdin, env), t

            def reconcile() -> tuple[float, float]:
                return pair([*vmpin, "reconcile", "--once"], b"")

            out: dict[str, object] = {"containers": n, "first_pass_s": round(first_pass, 3)}
            for name, fn in (("hook", hook), ("update", update), ("reconcile", reconcile)):
                for _ in range(args.warmup):
                    fn()
                pairs = [fn() for _ in range(args.runs)]
                out[f"{name}_ms"] = round(statistics.median(p[0] for p in pairs) * 1000, 2)
                out[f"{name}_ratio"] = round(statistics.median(p[0] / p[1] for p in pairs), 3)
            return out
        finally:
            sleeper.kill()
            sleeper.wait()
    finally:
        if qemu is not None:
            qemu.kill()
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="100,2000,10000")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--limit", type=float, default=1.5)
    ap.add_argument("--tree", help="a checkout whose bin/vmpin to time (default: this one)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = [one_size(n, args) for n in sizes]
    ok = True
    for name in ("hook", "update"):
        base = float(rows[0][f"{name}_ratio"])  # type: ignore[arg-type]
        for row in rows:
            row[f"{name}_growth"] = round(float(row[f"{name}_ratio"]) / base, 3)  # type: ignore[arg-type]
            ok = ok and float(row[f"{name}_growth"]) <= args.limit  # type: ignore[arg-type]
    if args.json:
        print(json.dumps({"sizes": rows, "limit": args.limit, "ok": ok}, indent=2))
    else:
        print(f"{'containers':>10} {'pass s':>7} {'hook ms':>8} {'x bare':>7} {'growth':>7}"
              f" {'update ms':>9} {'x bare':>7} {'growth':>7} {'reconcile ms':>12}")  # fmt: skip
        for r in rows:
            print(f"{r['containers']:>10} {r['first_pass_s']:>7} {r['hook_ms']:>8}"
                  f" {r['hook_ratio']:>7} {r['hook_growth']:>7} {r['update_ms']:>9}"
                  f" {r['update_ratio']:>7} {r['update_growth']:>7}"
                  f" {r['reconcile_ms']:>12}")  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    os.umask(0o022)
    sys.exit(main())
