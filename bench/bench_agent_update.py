"""The agent's side of ``vmpin update``, phase by phase (issue 28).

A fake node (bench/fakenode.py) with one Kata sandbox whose fake VMM has ``--vcpus`` vCPU
threads (32: a 37-thread VM, as bench_update_peer.py's), and a real agent (``vmpin serve``
as a subprocess).  Each of ``--rounds`` rounds is the in-process
:func:`vmpin.service.control.update` exchange that ``vmpin update`` makes (the container's
set alternating CPU 0 and 1), timed from just before the request is sent to its answer, and
checked: the answer done, every thread of the VMM on the new CPU.  Rounds are ``--gap``
seconds apart (a ``vmpin update`` process's own start-up lies between two on a node; 0:
back to back, the agent's work after one answer then meets the next request).

Inside the agent, the phases: the agent is started through this file (``_agent``), which
wraps the functions each phase ends in (time.monotonic(), the same clock in both processes,
and the thread's CPU) before running ``vmpin serve``; SIGUSR2 makes it write what it
recorded.  The wrappers cost ~1 us each, ~40 per round.  Per round, each phase's wall time
(ms, from the previous phase's end) and, where one thread runs it, that thread's CPU::

    accept      the connection taken by a connection thread (from the client's call: its
                own part until connected is ``client_connected``)
    read        the request line read
    checks      the request parsed (ControlProtocol.handle), checked (AgentUpdates.answer)
    ingest      record_update: the hooks' journal applied (Store.ingest)
    known       record_update: the container's record read, the set checked not empty (a
                tree that reads them in the write's transaction: nothing, see write)
    topology    record_update: the host's topology read (read_topology; the cache file), or
                its online CPUs (online_cpus, where the tree has it)
    write       record_update: the transaction (the deadline checked, the set written; the
                record read and checked in it, where the tree does that)
    handover    the sandbox queued for the planner (DirtyQueue.add_all)
    wake        the planner's take_batch returning the batch (its thread woken, the GIL)
    prepass     the pass begun: ingest, the API's policies, the batch's records
    pins        Reconciler.reconcile, up to the answer: observe, plan, apply (the pins),
                then Waiters.pass_ends answering -- from Reconciler.on_pinned, before the
                node summary, where the tree has it; else after the pass
    answer      the answer written on the socket (Reply.send, by the planner)
    client      the client's recv returning (its wake-up)

besides (``besides_ms``): the whole exchange (``total``); the agent's side (``agent``: from
the connection taken to the answer sent; ``agent_but_pins``: less the pins); the handler's
sync (Store.sync, while the pass runs) and its CPU from the request read to its wake-up
after the answer; the pass's CPU (``pass_cpu``: the planner, from its wake-up to the
answer); how often the handler answered (``answered_by_handler``: its sync was not done
when the pins were; then ``late_answer``, from the pins to that answer); the planner's work
after the answer (``tail``; each part's CPU in ``tail_cpu_ms``); the other threads seen
running Python between the planner's wake-up and its answer (``others_in_pass``: the
settler), the settlings, and the cyclic collector's runs and time in the round.
``agent_cpu_ms_per_round``: the agent's threads' CPU (/proc schedstat) over the measured
rounds, in all and per thread name.

Wall times move with the machine's load (another process on the CPUs, caches cold after
the gap); CPU times less so.  ``--tree DIR`` measures another tree's vmpin (an A/B).

Run (as root)::

    TMPDIR=/dev/shm VMPIN_LIBVIRT=none python bench/bench_agent_update.py [--rounds 200]
        [--vcpus 32] [--gap 0.03] [--switch-interval S] [--tree DIR] [--profile SORT]
        [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
#: the tree whose vmpin is measured (``--tree``: another worktree's, for an A/B)
TREE = os.environ.get("BENCH_TREE") or str(HERE.parent)
sys.path.insert(0, TREE)
sys.path.insert(0, str(HERE))

#: the planner's work after the answer (Planner._batch), in its order
TAIL = ["pass_ends", "publish_late", "release_maps", "_account", "progress", "_settle",
        "_waited"]  # fmt: skip

#: (phase, the probe that ends it): in the order a round passes them
PHASES = [
    ("accept", "accept"),
    ("read", "read"),
    ("checks", "record_in"),
    ("ingest", "ingest_out"),
    ("known", "topology_in"),
    ("topology", "topology_out"),
    ("write", "record_out"),
    ("handover", "queue_out"),
    ("wake", "take_out"),
    ("prepass", "reconcile_in"),
    ("pins", "send_in"),
    ("answer", "send_out"),
]


# -- the agent's side: the probes ------------------------------------------------------------
def _install_probes(out: str) -> None:
    """Wrap the functions the phases end in; SIGUSR2 writes the records to ``out``."""
    import socket
    import threading
    from collections.abc import Callable

    import vmpin.linux.sysfs as sysfs
    import vmpin.service.agent_updates as agent_updates
    import vmpin.service.server as server
    from vmpin.reconcile.reconciler import Reconciler
    from vmpin.service.agent_passes import Planner
    from vmpin.service.agent_protocol import Waiters
    from vmpin.service.queue import DirtyQueue
    from vmpin.state.store import Store

    records: list[tuple[str, float, float, str]] = []
    mono, cpu, current = time.monotonic, time.thread_time, threading.current_thread

    def stamp(name: str) -> None:
        records.append((name, mono(), cpu(), current().name))

    def wrap(owner: Any, attr: str, before: str | None, after: str | None) -> None:
        real: Callable[..., Any] = getattr(owner, attr)

        def probed(*args: Any, **kw: Any) -> Any:
            if before:
                stamp(before)
            try:
                return real(*args, **kw)
            finally:
                if after:
                    stamp(after)

        setattr(owner, attr, probed)

    wrap(socket.socket, "accept", None, "accept")
    # (the line read, or found whole at the accept: the slot then answering, in any tree)
    wrap(server.Slots, "answering", None, "read")
    wrap(agent_updates.AgentUpdates, "answer", "answer_in", "answer_out")
    wrap(agent_updates, "record_update", "record_in", "record_out")
    wrap(sysfs, "read_topology", "topology_in", "topology_out")
    if hasattr(sysfs, "online_cpus"):  # (a tree whose update checks the online list alone)
        wrap(sysfs, "online_cpus", "topology_in", "topology_out")
    wrap(Store, "ingest", "ingest_in", "ingest_out")
    wrap(Store, "sync", "sync_in", "sync_out")
    wrap(Store, "settle_journal", "settle_in", "settle_out")
    wrap(DirtyQueue, "add_all", "queue_in", "queue_out")
    wrap(DirtyQueue, "take_batch", None, "take_out")
    wrap(Waiters, "pass_begins", "begin", None)
    wrap(Waiters, "wait", None, "wait_out")
    wrap(Reconciler, "reconcile", "reconcile_in", "reconcile_out")
    wrap(Waiters, "pass_ends", "ends_in", "ends_out")
    wrap(server.Reply, "send", "send_in", "send_out")
    wrap(Planner, "_batch", None, "batch_out")
    # the planner's work after the answer, each part timed (see TAIL)
    from vmpin.service.agent_accounting import Accounting
    from vmpin.service.agent_views import AgentViews

    for owner, attr in (
        (AgentViews, "pass_ends"),
        (Waiters, "publish_late"),
        (Reconciler, "release_maps"),
        (Planner, "_account"),
        (Accounting, "progress"),
        (Planner, "_settle"),
        (Planner, "_waited"),
    ):
        wrap(owner, attr, f"{attr}_in", f"{attr}_out")  # fmt: skip

    # the cyclic collector's runs (the agent keeps it on), each as gc_<generation>_in/_out
    import gc

    def collecting(phase: str, info: dict[str, int]) -> None:
        stamp(f"gc{info['generation']}_{'in' if phase == 'start' else 'out'}")

    gc.callbacks.append(collecting)

    profiles: dict[str, Any] = {}
    if os.environ.get("BENCH_PROFILE"):
        import cProfile

        def profiled(owner: Any, attr: str, name: str) -> None:
            real: Callable[..., Any] = getattr(owner, attr)
            prof = profiles[name] = cProfile.Profile()

            def run(*args: Any, **kw: Any) -> Any:
                prof.enable()
                try:
                    return real(*args, **kw)
                finally:
                    prof.disable()

            setattr(owner, attr, run)

        # (one thread each at a time: a connection's request, the planner's batch)
        profiled(server.ControlServer, "_serve_conn", "handler")
        profiled(Planner, "_run_batch", "planner")

    def dump(signum: int, frame: object) -> None:
        for name, prof in profiles.items():
            prof.dump_stats(f"{out}.{name}.pstats")
        tmp = out + ".tmp"
        names = {t.native_id: t.name for t in threading.enumerate()}
        with open(tmp, "w") as f:
            json.dump({"records": records, "threads": names}, f)
        os.rename(tmp, out)

    signal.signal(signal.SIGUSR2, dump)


def agent_main(argv: list[str]) -> None:
    """``_agent OUT [SWITCH] -- serve ...``: ``vmpin serve`` with the probes in."""
    out, switch, rest = argv[0], argv[1], argv[3:]
    if switch != "-":
        sys.setswitchinterval(float(switch))
    _install_probes(out)
    from vmpin.entry import console

    sys.argv = ["vmpin", *rest]
    console()


# -- the bench's side ------------------------------------------------------------------------
def threads_cpu_ns(pid: int) -> dict[int, int]:
    """Each of the agent's threads' CPU so far (/proc schedstat, ns)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                out[int(tid)] = int(f.read().split()[0])
        except (OSError, ValueError):
            pass
    return out


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[max(0, min(len(s) - 1, round(q / 100 * len(s) + 0.5) - 1))]  # nearest rank


def summary(ms: list[float]) -> dict[str, float]:
    if not ms:
        return {}
    return {
        "p50": round(pct(ms, 50), 3),
        "p90": round(pct(ms, 90), 3),
        "p99": round(pct(ms, 99), 3),
        "mean": round(statistics.fmean(ms), 3),
        "n": len(ms),
    }


def all_on(pid: int, cpu: int) -> bool:
    want = {cpu}
    return all(os.sched_getaffinity(int(t)) == want for t in os.listdir(f"/proc/{pid}/task"))


def first(recs: list[tuple[str, float, float, str]], name: str, after: float = 0.0,
          thread: str | None = None) -> tuple[str, float, float, str] | None:  # fmt: skip
    for r in recs:
        if r[0] == name and r[1] >= after and (thread is None or r[3] == thread):
            return r
    return None


def analyse(rounds: list[tuple[float, float]], records: list[list[Any]]) -> dict[str, Any]:
    """Each round's records (those from its send to the next round's send), as phases."""
    recs = sorted((tuple(r) for r in records), key=lambda r: r[1])
    wall: dict[str, list[float]] = {name: [] for name, _ in PHASES}
    cpu: dict[str, list[float]] = {name: [] for name, _ in PHASES}
    extra: dict[str, list[float]] = {
        "client": [], "total": [], "agent": [], "agent_but_pins": [],
        "sync": [], "sync_cpu": [], "handler_cpu": [],
        "pass_cpu": [], "tail": [], "tail_cpu": [], "handler_woken": [],
        "others_in_pass": [], "settles": [], "answered_by_handler": [], "late_answer": [],
        "gc0_runs": [], "gc1_runs": [], "gc2_runs": [], "gc_ms": [],
    }  # fmt: skip
    tail_cpu: dict[str, list[float]] = {part: [] for part in TAIL}
    starts = [s for s, _ in rounds] + [float("inf")]
    for k, (sent, got) in enumerate(rounds):
        mine = [r for r in recs if starts[k] <= r[1] < starts[k + 1]]
        prev_t, prev = sent, None
        seen: list[tuple[str, float, float, str]] = []
        for phase, probe in PHASES:
            r = first(mine, probe, prev_t)
            if r is None:
                break
            wall[phase].append((r[1] - prev_t) * 1000)
            if prev is not None and prev[3] == r[3]:
                cpu[phase].append((r[2] - prev[2]) * 1000)
            prev_t, prev = r[1], r
            seen.append(r)
        else:
            extra["client"].append((got - prev_t) * 1000)
            extra["total"].append((got - sent) * 1000)
            at = {phase: r for (phase, _), r in zip(PHASES, seen, strict=True)}
            # the agent's side: from the connection taken to the answer sent, and the same
            # without the pass's pins
            agent_ms = (at["answer"][1] - at["accept"][1]) * 1000
            extra["agent"].append(agent_ms)
            extra["agent_but_pins"].append(agent_ms - wall["pins"][-1])
            handler = at["read"][3]  # (the connection thread: it read the request)
            planner = at["wake"][3]  # (the planner: take_batch returned on it)
            a, b = first(mine, "sync_in", thread=handler), first(mine, "sync_out", thread=handler)
            if a and b:
                extra["sync"].append((b[1] - a[1]) * 1000)
                extra["sync_cpu"].append((b[2] - a[2]) * 1000)
            w = first(mine, "wait_out", thread=handler)
            if w:
                extra["handler_woken"].append((w[1] - seen[-1][1]) * 1000)
                extra["handler_cpu"].append((w[2] - at["read"][2]) * 1000)
            by_handler = seen[-1][3] != planner
            extra["answered_by_handler"].append(float(by_handler))
            if by_handler:  # (its sync was not done when the pins were)
                extra["late_answer"].append((at["answer"][1] - at["pins"][1]) * 1000)
            else:
                extra["pass_cpu"].append((seen[-1][2] - at["wake"][2]) * 1000)
            for part in TAIL:
                a = first(mine, f"{part}_in", at["answer"][1], planner)
                b = first(mine, f"{part}_out", at["answer"][1], planner)
                if a and b:
                    tail_cpu[part].append((b[2] - a[2]) * 1000)
            end = first(mine, "batch_out", thread=planner)
            if end:
                extra["tail"].append((end[1] - seen[-1][1]) * 1000)
                if not by_handler:
                    extra["tail_cpu"].append((end[2] - seen[-1][2]) * 1000)
            # another thread's Python between the planner's wake-up and its answer
            t0, t1 = at["wake"][1], seen[-1][1]
            others = {r[3] for r in mine if t0 < r[1] < t1 and r[3] not in (planner, handler)}
            extra["others_in_pass"].append(float(len(others)))
            extra["settles"].append(float(sum(1 for r in mine if r[0] == "settle_in")))
            # the collector's time in the round, from the request read to the answer
            gc_ms = 0.0
            t0, t1 = at["read"][1], seen[-1][1]
            for g in range(3):
                ins = [r for r in mine if r[0] == f"gc{g}_in" and t0 <= r[1] <= t1]
                outs = [r for r in mine if r[0] == f"gc{g}_out" and t0 <= r[1]]
                for a, b in zip(ins, outs, strict=False):
                    gc_ms += (b[1] - a[1]) * 1000
                extra[f"gc{g}_runs"].append(float(len(ins)))
            extra["gc_ms"].append(gc_ms)
    return {
        "phases_ms": {p: summary(wall[p]) for p, _ in PHASES},
        "phases_cpu_ms": {p: summary(cpu[p]) for p, _ in PHASES if cpu[p]},
        "besides_ms": {k: summary(v) for k, v in extra.items()},
        "tail_cpu_ms": {k: summary(v) for k, v in tail_cpu.items()},
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from bench_idle_pass import env_for
    from fakenode import fake_node, stop_agent

    from vmpin.service import control

    with fake_node(1, "vmpin-agentupd-", vcpus=args.vcpus) as (root, paths, vmms):
        out = str(root / "probes.json")
        switch = "-" if args.switch_interval is None else str(args.switch_interval)
        cmd = [sys.executable, __file__, "_agent", out, switch, "--",
               "serve", "--interval", "3600", "--metrics-port", "0"]  # fmt: skip
        agent = subprocess.Popen(cmd, env=env_for(paths), stderr=subprocess.DEVNULL)
        try:
            from bench_idle_pass import wait_agent_pass

            wait_agent_pass(paths, 1)
            cid, pid = "idle0000-app", vmms[0].pid
            rounds: list[tuple[float, float]] = []
            sending: list[float] = []
            failures = 0
            # the client's own part: from the call to its request sent (connected, as
            # control._send then sends at once)
            connected: list[float] = []
            real_connect = control._connect

            def timed_connect(sock: Any, path: str, patience: float) -> None:
                real_connect(sock, path, patience)
                connected.append(time.monotonic())

            control._connect = timed_connect  # type: ignore[assignment]
            cpu0 = threads_cpu_ns(agent.pid)
            for k in range(args.warmup + args.rounds):
                if k == args.warmup:
                    cpu0 = threads_cpu_ns(agent.pid)
                    t_measured = time.monotonic()
                want = (k + 1) % 2
                t0 = time.monotonic()
                reply, answered = control.update(paths, cid, str(want), 1.0)
                t1 = time.monotonic()
                ok = answered and reply is not None and reply.done and all_on(pid, want)
                if k >= args.warmup:
                    rounds.append((t0, t1))
                    sending.append((connected[-1] - t0) * 1000)
                    failures += int(not ok)
                time.sleep(args.gap)
            cpu1 = threads_cpu_ns(agent.pid)
            span = time.monotonic() - t_measured
            agent.send_signal(signal.SIGUSR2)
            deadline = time.monotonic() + 10
            while not os.path.exists(out) and time.monotonic() < deadline:
                time.sleep(0.02)
            dumped = json.loads(Path(out).read_text())
            records = dumped["records"]
            # each thread's CPU per round, by its name (the connection threads summed)
            by_name: dict[str, float] = {}
            for tid, ns in cpu1.items():
                name = dumped["threads"].get(str(tid), "other")
                by_name[name] = by_name.get(name, 0.0) + (ns - cpu0.get(tid, 0)) / 1e6
            threads_ms = {k: round(v / args.rounds, 3) for k, v in sorted(by_name.items())}
            cpu_ns = sum(cpu1.values()) - sum(cpu0.get(t, 0) for t in cpu1)
            if args.profile:
                import pstats

                for name in ("handler", "planner"):
                    print(f"-- the agent's {name}, {args.rounds + args.warmup} rounds")
                    stats = pstats.Stats(f"{out}.{name}.pstats")
                    stats.sort_stats(args.profile).print_stats(40)
        finally:
            stop_agent(agent)
    result: dict[str, Any] = {
        "benchmark": "agent_update",
        "tree": TREE,
        "vcpus": args.vcpus,
        "rounds": args.rounds,
        "gap_s": args.gap,
        "switch_interval": args.switch_interval or sys.getswitchinterval(),
        "failures": failures,
        "agent_cpu_ms_per_round": round(cpu_ns / 1e6 / args.rounds, 3),
        "threads_cpu_ms_per_round": threads_ms,
        "span_s": round(span, 2),
    }
    result.update(analyse(rounds, records))
    result["besides_ms"]["client_connected"] = summary(sending)
    return result


def table(result: dict[str, Any]) -> str:
    lines = [f"{'phase':<16}{'wall p50':>10}{'wall mean':>11}{'cpu p50':>10}"]
    for p, _ in PHASES:
        w = result["phases_ms"][p]
        c = result["phases_cpu_ms"].get(p, {})
        lines.append(f"{p:<16}{w.get('p50', 0):>10.3f}{w.get('mean', 0):>11.3f}"
                     f"{c.get('p50', float('nan')):>10.3f}")  # fmt: skip
    for k, v in result["besides_ms"].items():
        if v:
            lines.append(f"{k:<16}{v['p50']:>10.3f}{v['mean']:>11.3f}")
    lines.append("the planner's tail, CPU:")
    for k, v in result["tail_cpu_ms"].items():
        if v:
            lines.append(f"  {k:<14}{v['p50']:>10.3f}{v['mean']:>11.3f}")
    return "\n".join(lines)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "_agent":
        agent_main(sys.argv[2:])
        return 0
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--vcpus", type=int, default=32)
    ap.add_argument("--gap", type=float, default=0.03, help="seconds between two rounds")
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="the agent's sys.setswitchinterval (diagnostic)")  # fmt: skip
    ap.add_argument("--json", help="also write the result here")
    ap.add_argument("--tree", help="measure the vmpin of this tree (default: this one's)")
    ap.add_argument(
        "--profile",
        metavar="SORT",
        help=(
            "profile the agent's request handling and planner batches (cProfile; the phases' "
            "times then include its cost); print the top functions by SORT (tottime, cumtime)"
        ),
    )
    args = ap.parse_args()
    if args.tree and os.path.realpath(args.tree) != os.path.realpath(TREE):
        env = dict(os.environ, BENCH_TREE=args.tree)
        os.execve(sys.executable, [sys.executable, *sys.argv], env)  # (imports from it)
    if args.profile:
        os.environ["BENCH_PROFILE"] = "1"
    result = run(args)
    print(table(result))
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, dict)}))
    print("the agent's threads, CPU ms per round:", json.dumps(result["threads_cpu_ms_per_round"]))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["failures"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
