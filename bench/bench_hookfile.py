"""The installed hook file (`vmpin install`) against the venv's hook, interleaved.

Per round, in rotating order, each of these runs one prestart (a fresh container of its own):

``file``      the hook file (vmpin.service.hookfile), bytecode compiled by ``--python``, run
              as a runtime runs it (its path; ``python3`` on PATH is ``--python``);
``launcher``  ``--python bin/vmpin`` with the repository on PYTHONPATH: the venv's launcher
              and its code cache (vmpin.lean.codecache) on the *same* interpreter -- the
              fair comparison;
``venv``      the ``vmpin`` beside this interpreter (the venv's console script), when there;
``bare``      ``--python -c pass``, the floor.

Paths as in bench_hook.py: ``runc`` (a plain container's prestart, no agent: journal only)
and ``kata`` (a real QEMU sandbox, no agent: the hook pins in-process; each timed prestart is
followed by an untimed poststop).  A path's figure is the median, per variant, of wall and
CPU (children's user+sys) times, and of the per-round ratio file/launcher.

    python bench/bench_hookfile.py [--python /usr/bin/python3] [--path runc,kata]
                                   [--runs 60] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))

from bench_hook import state, write_bundle  # noqa: E402

from vmpin.service import hookfile  # noqa: E402

HOOK_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def run(argv: list[str], stdin: bytes, env: dict[str, str]) -> tuple[float, float]:
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(argv, input=stdin, env=env, capture_output=True)
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0 or proc.stderr:
        raise SystemExit(f"{argv} failed: {proc.returncode} {proc.stderr.decode().strip()}")
    return wall, (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)


def bench_path(name: str, args: argparse.Namespace) -> dict[str, object]:
    work = Path(tempfile.mkdtemp(prefix=f"vmpin-bench-hookfile-{name}-"))
    cleanup: list[Callable[[], None]] = [lambda: shutil.rmtree(work, ignore_errors=True)]
    try:
        bindir = work / "bin"
        bindir.mkdir()
        (bindir / "python3").symlink_to(args.python)
        hook = work / "vmpin-hook"
        bytecode = hookfile.write(str(hook), [args.python])
        paths = {"VMPIN_STATE_DIR": str(work / "state"), "VMPIN_VM_DIR": str(work / "vm"),
                 "VMPIN_RUNC_ROOT": str(work / "runc"), "VMPIN_KUBELET_STATE": str(work / "none"),
                 "VMPIN_PUBLISH_DIR": str(work / "publish"), "VMPIN_LIBVIRT": "none",
                 "VMPIN_KATA_CONFIG": str(work / "kata.toml")}  # fmt: skip
        (work / "vm").mkdir()
        file_env = {"PATH": f"{bindir}:{HOOK_PATH}", **paths}
        launcher_env = {"PATH": HOOK_PATH, "PYTHONPATH": str(REPO), **paths}
        variants: dict[str, tuple[list[str], dict[str, str]]] = {
            "file": ([str(hook)], file_env),
            "launcher": ([args.python, str(REPO / "bin" / "vmpin")], launcher_env),
        }
        venv = Path(sys.executable).with_name("vmpin")
        if venv.exists():
            variants["venv"] = ([str(venv)], launcher_env)
        kata = name == "kata"
        if kata:
            from tests.support.qemu_util import launch

            sid = f"bhf{os.getpid()}"
            q = launch(work / "vm", sid, smp=2, debug_threads=True)
            cleanup.append(q.kill)
            (work / "publish" / sid / "mounts").mkdir(parents=True)
            pid = q.pid
        else:
            sleeper = subprocess.Popen(["sleep", "3600"])

            def stop() -> None:
                sleeper.kill()
                sleeper.wait()

            cleanup.append(stop)
            pid, sid = sleeper.pid, ""
        n = 0
        times: dict[str, list[tuple[float, float]]] = {k: [] for k in [*variants, "bare"]}
        ratios: list[float] = []
        names = [*variants, "bare"]
        for i in range(args.warmup + args.runs):
            order = names[i % len(names):] + names[: i % len(names)]
            got: dict[str, tuple[float, float]] = {}
            for v in order:
                if v == "bare":
                    got[v] = run([args.python, "-c", "pass"], b"", file_env)
                    continue
                n += 1
                cid = f"{v}{n}"
                b, ann = write_bundle(work, cid, sid or f"pod{n}", "1" if kata else "0")
                argv, env = variants[v]
                got[v] = run([*argv, "hook", "prestart"], state(cid, pid, b, ann, kata), env)
                if kata:  # Kata's poststop names the sandbox (untimed)
                    run([*argv, "hook", "poststop"], state(sid, None, b, ann, True), env)
            if i >= args.warmup:
                for v, t in got.items():
                    times[v].append(t)
                ratios.append(got["file"][0] / got["launcher"][0])
        out: dict[str, object] = {"path": name, "python": args.python,
                                  "bytecode": bytecode.version_text, "runs": args.runs,
                                  "ratio_file_to_launcher": round(statistics.median(ratios), 3)}
        for v, ts in times.items():
            out[f"{v}_wall_ms"] = round(statistics.median(t[0] for t in ts) * 1000, 2)
            out[f"{v}_cpu_ms"] = round(statistics.median(t[1] for t in ts) * 1000, 2)
        return out
    finally:
        for undo in reversed(cleanup):
            try:
                undo()
            except OSError as err:
                print(f"cleanup: {err}", file=sys.stderr)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--python", default="/usr/bin/python3", help="the host's python3")
    ap.add_argument("--path", default="runc,kata", help="runc, kata or both")
    ap.add_argument("--runs", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    results = [bench_path(p.strip(), args) for p in args.path.split(",") if p.strip()]
    if args.json:
        print(json.dumps(results))
    else:
        for r in results:
            print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
