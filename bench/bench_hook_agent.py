"""Where a Kata hook's wait goes inside the agent: its request's way from accept to answer.

bench_hook_split.py splits the hook's wall into its own work, the wait and the rest; this
splits the wait, on the same node (bench_hook.hook_node's "kata-agent": a real 2-vCPU QEMU,
Kata's shared dir, ``vmpin serve``).  The agent is started through this file, which wraps
the functions each phase ends in (``time.perf_counter()`` before and after; ~1 us each)
before running ``vmpin serve``; SIGUSR2 makes it write what it recorded.  Each of ``--runs``
prestarts (container on CPU 1) and its poststop (as in bench_hook.py) is a request the hook
waits on; per phase, the median over these requests of its end, in ms from the accept::

    admit       the connection taken (its peer checked, what came of its line read)
    handle      the request line read, the protocol's handling begun
    take        the planner woken with the batch (DirtyQueue.take_batch returns)
    ingest      the journal applied (the hook's event: Planner._ingest)
    observe     Observer.observe: the store's records, the VMM's threads read
    apply       the plan made (observe -> apply), then the pins (Applier.apply, before its
                record)
    record      the pass's store writes and the guest map (Applier._record)
    pass        the rest of the node pass (the node summary, the reports, the lock)
    maps        Waiters.pass_ends up to the guest maps published (Waiters._publish)
    send        the answer written (Reply.send begins: the hook wakes)

    python bench/bench_hook_agent.py [--runs 60] [--tree DIR] [--tmpdir DIR] [--json]

``--tree DIR``: that tree's vmpin (an A/B: interleave runs of two trees; the machine's load
moves every figure, the order of the phases does not).  Needs root (cgroups, QEMU).
"""

from __future__ import annotations

import os
import sys

#: the wrapped functions: (module, class, attribute, phase name)
PROBES = (
    ("vmpin.service.server", "ControlServer", "_admit", "admit"),
    ("vmpin.service.agent_protocol", "ControlProtocol", "handle", "handle"),
    ("vmpin.service.queue", "DirtyQueue", "take_batch", "take"),
    ("vmpin.service.agent_passes", "Planner", "_ingest", "ingest"),
    ("vmpin.reconcile.observe", "Observer", "observe", "observe"),
    ("vmpin.reconcile.apply", "Applier", "_record", "record"),
    ("vmpin.reconcile.apply", "Applier", "apply", "apply"),
    ("vmpin.service.agent_passes", "Planner", "_node_pass", "pass"),
    ("vmpin.service.agent_protocol", "Waiters", "_publish", "maps"),
    ("vmpin.service.server", "Reply", "send", "send"),
)
#: each phase ends at its probe's "<" (returned), but send at ">" (called: the line goes out)
PHASES = (("admit", "<"), ("handle", ">"), ("take", "<"), ("ingest", "<"), ("observe", "<"),
          ("apply", ">"), ("record", "<"), ("pass", "<"), ("maps", "<"), ("send", ">"))  # fmt: skip


def agent_main(tree: str, argv: list[str]) -> None:
    """``vmpin ARGV`` from ``tree``; as ``serve`` (the agent), with the probes in."""
    sys.path.insert(0, tree)
    if "serve" in argv and os.environ.get("BENCH_STAMPS"):
        _install_probes(os.environ["BENCH_STAMPS"])
    sys.argv = ["vmpin", *argv]
    from vmpin.entry import console

    console()


def _install_probes(out: str) -> None:
    import importlib
    import json
    import signal
    import time
    from collections.abc import Callable
    from typing import Any

    marks: list[tuple[str, float]] = []
    clock = time.perf_counter

    def wrap(owner: Any, attr: str, name: str) -> None:
        real: Callable[..., Any] = getattr(owner, attr)

        def probed(*args: Any, **kw: Any) -> Any:
            marks.append((name + ">", clock()))
            try:
                return real(*args, **kw)
            finally:
                marks.append((name + "<", clock()))

        setattr(owner, attr, probed)

    for module, cls, attr, name in PROBES:
        wrap(getattr(importlib.import_module(module), cls), attr, name)

    def dump(signum: int, frame: object) -> None:
        tmp = out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(marks, f)
        os.rename(tmp, out)

    signal.signal(signal.SIGUSR2, dump)


def phases(marks: list[tuple[str, float]]) -> dict[str, list[float]]:
    """Per phase, its end in ms from the accept, for each request whose marks are all there
    (a request's marks: from its ``admit>`` to the next one's; the first of each name)."""
    requests: list[dict[str, float]] = []
    for name, t in marks:
        if name == "admit>":
            requests.append({})
        if requests and name not in requests[-1]:
            requests[-1][name] = t
    out: dict[str, list[float]] = {name: [] for name, _ in PHASES}
    for req in requests:
        ends = [req.get(name + edge) for name, edge in PHASES]
        start = req.get("admit>")
        if start is None or None in ends:
            continue
        for (name, _), end in zip(PHASES, ends, strict=True):
            assert end is not None
            out[name].append((end - start) * 1e3)
    return out


def main() -> int:
    if sys.argv[1:2] == ["--as-vmpin"]:
        agent_main(sys.argv[2], sys.argv[3:])
        return 0
    import argparse
    import json
    import signal
    import statistics
    import time
    from pathlib import Path

    here = Path(__file__).resolve().parent
    sys.path.insert(0, str(here.parent))
    sys.path.insert(0, str(here))
    import bench_hook as bh

    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--runs", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--tree", default=str(here.parent), help="the vmpin tree to run")
    ap.add_argument("--tmpdir", help="where the node's dirs go (a node's /run is tmpfs)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    vmpin = [sys.executable, str(Path(__file__).resolve()), "--as-vmpin", args.tree]
    stamps = Path(args.tmpdir or "/tmp") / f"bench-hook-agent-{os.getpid()}.json"
    with bh.hook_node("kata-agent", vmpin, "bench-hook-agent", args.tmpdir,
                      env={"BENCH_STAMPS": str(stamps)}) as node:  # fmt: skip
        work, env, pid, sid, _ = node
        hooks = {k: v for k, v in env.items() if k != "BENCH_STAMPS"}
        for n in range(1, args.warmup + args.runs + 1):
            b, ann = bh.write_bundle(work, f"ctr{n}", sid, "1", False)
            bh.timed([*vmpin, "hook", "prestart"], bh.state(f"ctr{n}", pid, b, ann, True), hooks)
            bh.timed([*vmpin, "hook", "poststop"], bh.state(sid, None, b, ann, True), hooks)
        agent = next(int(p) for p in os.listdir("/proc") if p.isdigit() and _is_agent(p, work))
        os.kill(agent, signal.SIGUSR2)
        deadline = time.monotonic() + 10
        while not stamps.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        marks = json.loads(stamps.read_text())
        stamps.unlink()
    got = phases(marks)
    # (a prestart's request and its poststop's: both Kata hooks wait for their pass)
    ms = {k: round(statistics.median(v[2 * args.warmup :]), 3) for k, v in got.items()}
    result = {"tree": args.tree, "runs": args.runs, "ms_from_accept": ms,
              "load": round(os.getloadavg()[0], 2)}  # fmt: skip
    if args.json:
        print(json.dumps(result))
    else:
        prev = 0.0
        for name, end in ms.items():
            print(f"{name:8s} {end:7.3f} ms  (+{end - prev:.3f})")
            prev = end
        print(f"(medians of {args.runs} prestarts' and poststops' requests; load {result['load']})")
    return 0


def _is_agent(pid: str, work: object) -> bool:
    """Whether process ``pid`` is the agent this bench started on the node ``work``."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = f.read()
    except OSError:
        return False
    return b"--as-vmpin" in argv and b"serve" in argv and str(work).encode() in environ


if __name__ == "__main__":
    sys.exit(main())
