"""Count the instructions of one `vmpin hook prestart` per path, and of a bare interpreter.

Wall-clock ratios (bench/bench_hook.py) need a quiet machine; instruction counts do not: one
run under valgrind's callgrind is deterministic to ~0.1% with ``PYTHONHASHSEED=0`` (set here
for the hook and the bare interpreter alike: string hashes decide dict probing, ±0.2 M).
Each path is set up exactly as bench_hook.py sets it up (its functions: the same bundle,
state, cgroup, QEMU, agent), warmed up three times (the code cache and ``.pyc`` files get
written), and then one prestart is counted.  For the Kata paths each prestart is followed by
its untimed poststop, as there.

    python bench/bench_hook_ir.py [--path runc,kata-agent,kata] [--vmpin LAUNCHER] [--json]
                                  [--containerd-spec]

``--containerd-spec``: the counted hook's config.json as containerd's CRI writes one (~10 KiB,
bench_hook.containerd_members), not the bare ~0.4 KiB spec.

Needs root (cgroups, QEMU) and valgrind.  Instructions of the hook process only: the agent's
pass that a Kata hook waits for is another process's (bench_hook.py's wall-clock ratio
includes it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import bench_hook as bh  # noqa: E402 (beside this file)

CALLGRIND = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null"]


def count(argv: list[str], stdin: bytes, env: dict[str, str]) -> float:
    """Instructions (millions) of ``argv`` under callgrind."""
    proc = subprocess.run([*CALLGRIND, *argv], input=stdin, env=env, capture_output=True)
    err = proc.stderr.decode(errors="replace")
    found = re.search(r"Collected : (\d+)", err)
    if proc.returncode != 0 or found is None:
        raise SystemExit(f"{argv} failed under valgrind: {proc.returncode} {err[-2000:]}")
    return int(found.group(1)) / 1e6


def run(argv: list[str], stdin: bytes, env: dict[str, str]) -> None:
    proc = subprocess.run(argv, input=stdin, env=env, capture_output=True)
    if proc.returncode != 0 or proc.stderr:
        raise SystemExit(f"{argv} failed: {proc.returncode} {proc.stderr.decode().strip()}")


def measure(name: str, vmpin: list[str], containerd: bool = False) -> float:
    """Set the node up for one path (bench_hook.hook_node), count one prestart, take
    everything down again (by pid)."""
    extra = {"VMPIN_LIBVIRT": "none", "PYTHONHASHSEED": "0"}
    with bh.hook_node(name, vmpin, "bench-hook-ir", env=extra) as (work, env, pid, sid, kata):
        figure = 0.0
        for n in range(1, 5):
            cid = f"ctr{n}"
            b, ann = bh.write_bundle(work, cid, sid or f"pod{n}", "1" if kata else "0",
                                     containerd)
            doc = bh.state(cid, pid, b, ann, kata)
            if n < 4:
                run([*vmpin, "hook", "prestart"], doc, env)
            else:
                figure = count([*vmpin, "hook", "prestart"], doc, env)
            if kata:
                run([*vmpin, "hook", "poststop"], bh.state(sid, None, b, ann, True), env)
        return figure

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--path", default="runc,kata-agent,kata")
    ap.add_argument("--vmpin", help="the vmpin command (default: beside this python, or PATH)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--containerd-spec", action="store_true",
                    help="config.json as containerd's CRI writes one (~10 KiB)")
    args = ap.parse_args()
    vmpin = bh.find_vmpin(args.vmpin)
    paths = list(bh.PATHS) if args.path == "all" else args.path.split(",")
    env = dict(os.environ, PYTHONHASHSEED="0")
    bare = count([sys.executable, "-c", "pass"], b"", env)
    rows = [{"path": p, "instructions_m": round(m, 1), "ratio": round(m / bare, 3)}
            for p in paths for m in [measure(p, vmpin, args.containerd_spec)]]  # fmt: skip
    if args.json:
        print(json.dumps({"bare_m": round(bare, 1), "paths": rows}))
    else:
        print(f"bare interpreter: {bare:.1f} M")
        for row in rows:
            print(f"{row['path']:<11} {row['instructions_m']:6.1f} M  x{row['ratio']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
