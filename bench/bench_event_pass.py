"""Benchmark: the agent's event pass at 60 / 500 / 2,000 sandboxes -- what one update costs.

Issue 28: churn's update round trip had grown ~4x, and nothing measured the pass an event
runs.  Here the agent's planner (vmpin.service.agent_passes.Planner, with the options the
agent builds its reconciler with) runs in this process over N fake-VMM sandboxes made as
bench/fakenode.py makes them; then K times: one container's CPU set is written by
another connection (as ``vmpin update`` does), and the planner runs the event pass for its
sandbox (``Planner._run_batch``: ingest, the node pass with ``fresh``, accounting, maps,
settling).  Reported per pass, as medians over the K passes:

- ``cpu_ms``: the pass's CPU time (``time.thread_time``: the machine's load does not count);
- ``sql_statements``, ``sql_rows``: statements run and rows handed to Python on the agent's
  store connection (the connection wrapped to count); ``sql_steps_k``: SQLite virtual machine
  steps, in thousands (a scan inside an aggregate counts here);
- ``files_opened``, ``dirs_listed``: ``open`` / ``os.listdir`` / ``os.scandir`` audit events;
- ``planned``: sandboxes whose plan was made again (``plan._plan_sandbox`` calls);
- ``checkpoints_per_pass``, ``settle_wall_ms``: WAL checkpoints the settling after a pass
  runs (each syncs the WAL and the database file) and its wall time (the disk's: the one
  figure here that depends on the machine).

What an event pass does must not grow with the node: every figure but CPU should be the same
at every N, and CPU close to it.  ``--profile`` prints the hottest functions of the passes at
the largest N.

Run (as root)::

    python bench/bench_event_pass.py [--sandboxes 60,500,2000] [--updates 30] [--json OUT]

``--churn``: the passes are churn's instead (bench/bench_churn.py: most of an event's passes
there are for a sandbox created or deleted): by turns, a sandbox comes to the node -- its VMM,
started beforehand outside the VM dir (``--spares`` of them), moved in, its sandbox and
workload containers written by the other connection -- and the last one to come goes (its
records deleted, its VMM killed, its VM dir removed); each pass plans the sandbox that came
or went, the node staying at N or N+1 sandboxes.

On a loaded machine ``cpu_ms`` moves with the load; instructions per pass do not: run one
size under callgrind with ``--updates 41`` and with ``--updates 1`` (``VMPIN_LIBVIRT=none``)
and divide the difference of the two "Collected" figures by 40::

    valgrind --tool=callgrind --callgrind-out-file=/dev/null \
        python bench/bench_event_pass.py --sandboxes 500 --updates 41

(with ``--churn``, give both runs the same ``--spares``, e.g. 21: starting a VMM costs this
process instructions too).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import shutil
import sqlite3
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from fakenode import fake_node, sizes, widen  # noqa: E402

from tests.support import fakevmm  # noqa: E402
from vmpin.core.cpuset import CpuSet  # noqa: E402
from vmpin.linux.paths import HostPaths  # noqa: E402
from vmpin.reconcile import plan as plan_module  # noqa: E402
from vmpin.reconcile.reconciler import Reconciler  # noqa: E402
from vmpin.service.agent_accounting import Accounting  # noqa: E402
from vmpin.service.agent_passes import Planner  # noqa: E402
from vmpin.service.agent_protocol import Waiters  # noqa: E402
from vmpin.service.metrics import Metrics  # noqa: E402
from vmpin.service.queue import DirtyQueue, Work  # noqa: E402
from vmpin.state.records import ContainerRec, SandboxRec  # noqa: E402
from vmpin.state.store import Store  # noqa: E402


class Counts:
    """What the pass being measured does: statements, rows, VM steps, files, directories."""

    def __init__(self) -> None:
        self.on = False
        self.reset()

    def reset(self) -> None:
        self.statements = self.rows = self.steps = self.files = self.dirs = 0
        self.opened: list[str] = []
        self.sql: list[str] = []


COUNTS = Counts()


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if not COUNTS.on:
        return
    if event == "open":
        COUNTS.files += 1
        COUNTS.opened.append(str(args[0]))
    elif event in ("os.listdir", "os.scandir"):
        COUNTS.dirs += 1


class _Cursor:
    """A cursor that counts the rows it hands out."""

    def __init__(self, cur: sqlite3.Cursor) -> None:
        self._cur = cur

    def fetchone(self) -> Any:
        row = self._cur.fetchone()
        if row is not None and COUNTS.on:
            COUNTS.rows += 1
        return row

    def fetchall(self) -> list[Any]:
        rows = self._cur.fetchall()
        if COUNTS.on:
            COUNTS.rows += len(rows)
        return rows

    def __iter__(self) -> Any:
        for row in self._cur:
            if COUNTS.on:
                COUNTS.rows += 1
            yield row

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cur, name)


class _Connection:
    """The store's connection, its cursors counted (everything else passed through)."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def execute(self, *args: Any) -> _Cursor:
        return _Cursor(self._db.execute(*args))

    def executemany(self, *args: Any) -> _Cursor:
        return _Cursor(self._db.executemany(*args))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._db, name)


def _trace(sql: str) -> None:
    if COUNTS.on:
        COUNTS.statements += 1
        COUNTS.sql.append(sql)


def _step() -> int:
    if COUNTS.on:
        COUNTS.steps += 1
    return 0


def planner_for(paths: HostPaths) -> Planner:
    metrics = Metrics()

    def factory(store: Store, **kw: Any) -> Reconciler:
        return Reconciler(paths, store, **kw)

    def fault(where: str, err: BaseException) -> None:
        raise err

    return Planner(
        paths, factory, DirtyQueue(), Waiters(fault), Accounting(paths, metrics), metrics,
        fault=fault, pause=lambda s: True, fatal=lambda: None, interval=5.0,
    )  # fmt: skip


class Churn:
    """``--churn``'s sandboxes: VMMs started beforehand in ``<root>/spare``, each moved into
    the VM dir when its sandbox comes (starting one costs this process what is not the
    agent's); the last to come goes at the next turn."""

    def __init__(self, root: Path, paths: HostPaths, spares: int, vcpus: int) -> None:
        self.vm_dir = Path(paths.vm_dir)
        self.publish = Path(paths.publish_dir)
        self.vmms = [
            fakevmm.start(root / "spare", f"new{i:04d}", vcpus=vcpus) for i in range(spares)
        ]
        self.next = 0
        self.here: fakevmm.FakeVmm | None = None

    def step(self, writer: Store) -> str:
        """The next turn's change, written: the sandbox it is about."""
        if self.here is not None:
            vmm, self.here = self.here, None
            writer.delete_container(f"{vmm.sandbox_id}-app")
            writer.delete_container(vmm.sandbox_id)
            vmm.kill()
            shutil.rmtree(self.vm_dir / vmm.sandbox_id, ignore_errors=True)
            return vmm.sandbox_id
        vmm = self.vmms[self.next]
        self.next += 1
        sid = vmm.sandbox_id
        os.rename(vmm.dir, self.vm_dir / sid)
        (self.publish / sid / "mounts").mkdir(parents=True)
        writer.put_sandbox(SandboxRec(sid, "kata"))
        writer.put_container(ContainerRec(sid, sid, True, name="pause"))
        writer.put_container(
            ContainerRec(f"{sid}-app", sid, False, name="app", cpus=CpuSet.parse("0-1"))
        )
        self.here = vmm
        return sid

    def close(self) -> None:
        for v in self.vmms:
            v.kill()


def event_passes(
    paths: HostPaths,
    n: int,
    updates: int,
    profile: cProfile.Profile | None,
    churn: Churn | None = None,
) -> dict[str, Any]:
    planner = planner_for(paths)
    store = Store(paths.state_dir)
    writer = Store(paths.state_dir)  # `vmpin update`'s connection
    try:
        reconciler = planner._setup(store)
        store.db.set_trace_callback(_trace)
        store.db.set_progress_handler(_step, 1000)
        store.db = _Connection(store.db)  # type: ignore[assignment]
        now = time.monotonic()
        ids = [f"idle{i:04d}" for i in range(n)]
        startup = [Work(sid, "startup", None, now) for sid in ids]
        c0 = time.thread_time()
        planner._run_batch(startup, store, reconciler)
        startup_cpu = time.thread_time() - c0
        planner._run_batch(startup, store, reconciler)  # (what the start-up pass wrote, read)
        planned: list[int] = []
        real = plan_module._plan_sandbox

        def counting(*a: Any, **kw: Any) -> Any:
            planned[-1] += 1
            return real(*a, **kw)

        plan_module._plan_sandbox = counting  # type: ignore[assignment]
        # the settling after each pass (journal files, and a checkpoint of the pass's own
        # writes: the WAL and the database file synced): its wall time, disk-bound
        settles: list[float] = []
        settle = planner._settle

        def timed(store: Store) -> None:
            w0 = time.perf_counter()
            settle(store)
            settles.append(time.perf_counter() - w0)

        planner._settle = timed  # type: ignore[method-assign]
        per: dict[str, list[float]] = {k: [] for k in (
            "cpu_ms", "sql_statements", "sql_rows", "sql_steps_k", "files_opened",
            "dirs_listed", "planned",
        )}  # fmt: skip
        example: dict[str, Any] = {}
        try:
            for k in range(updates):
                if churn is not None:
                    sid = churn.step(writer)
                else:
                    sid = ids[(k * 7919) % n]
                    # between the sandbox's own CPU and both: its mask moves, its pin changes
                    i = int(sid[4:])
                    cpus = f"{i % 2}" if k % 2 else "0-1"
                    writer.set_container_cpus(f"{sid}-app", CpuSet.parse(cpus), "update")
                batch = [Work(sid, "event", time.monotonic(), time.monotonic())]
                planned.append(0)
                COUNTS.reset()
                COUNTS.on = True
                if profile is not None:
                    profile.enable()
                c0 = time.thread_time()
                planner._run_batch(batch, store, reconciler)
                cpu = time.thread_time() - c0
                if profile is not None:
                    profile.disable()
                COUNTS.on = False
                per["cpu_ms"].append(cpu * 1000)
                per["sql_statements"].append(COUNTS.statements)
                per["sql_rows"].append(COUNTS.rows)
                per["sql_steps_k"].append(COUNTS.steps)
                per["files_opened"].append(COUNTS.files)
                per["dirs_listed"].append(COUNTS.dirs)
                per["planned"].append(planned[-1])
                if k == updates - 1:
                    example = {"sql": COUNTS.sql, "files": COUNTS.opened}
        finally:
            plan_module._plan_sandbox = real  # type: ignore[assignment]
        out: dict[str, Any] = {
            "startup_pass_cpu_s": round(startup_cpu, 3),
            "checkpoints_per_pass": sum(
                1 for sql in example.get("sql", ()) if "wal_checkpoint" in sql
            ),
            "settle_wall_ms": round(1000 * statistics.median(settles), 2) if settles else None,
        }
        for key, values in per.items():
            out[key] = round(statistics.median(values), 2)
            out[key + "_max"] = round(max(values), 2)
        out["example_pass"] = example
        return out
    finally:
        writer.close()
        store.close()


def one_size(n: int, args: argparse.Namespace, profile: cProfile.Profile | None) -> dict[str, Any]:
    with fake_node(n, "vmpin-event-", vcpus=args.vcpus) as (root, paths, _):
        churn = None
        try:
            if args.churn:
                spares = args.spares if args.spares is not None else args.updates // 2 + 1
                churn = Churn(root, paths, spares, args.vcpus)
            result = {
                "sandboxes": n, **event_passes(paths, n, args.updates, profile, churn)
            }  # fmt: skip
        finally:
            if churn is not None:
                churn.close()
        brief = {k: v for k, v in result.items() if k != "example_pass"}
        print(json.dumps(brief), file=sys.stderr)
        return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sandboxes", default="60,500,2000", help="comma-separated sizes")
    ap.add_argument("--updates", type=int, default=30)
    ap.add_argument("--vcpus", type=int, default=2, help="vCPU threads per fake VMM")
    ap.add_argument("--churn", action="store_true",
                    help="passes for a sandbox that comes and goes, by turns (not updates)")
    ap.add_argument("--spares", type=int, help="--churn's VMMs started (default: updates/2+1)")
    ap.add_argument("--profile", action="store_true", help="profile the largest size's passes")
    ap.add_argument("--sort", default="tottime", help="the profile's order (pstats)")
    ap.add_argument("--top", type=int, default=25, help="the profile's lines")
    ap.add_argument("--profile-out", help="also write the profile there (pstats' format)")
    ap.add_argument("--examples", action="store_true", help="print one pass's SQL and files")
    ap.add_argument("--json", help="also write the result here")
    args = ap.parse_args()
    ns = sizes(args.sandboxes)
    sys.addaudithook(_audit)
    results = []
    with widen():
        for n in ns:
            profile = cProfile.Profile() if args.profile and n == max(ns) else None
            results.append(one_size(n, args, profile))
            if profile is not None:
                stats = pstats.Stats(profile, stream=sys.stderr)
                stats.sort_stats(args.sort).print_stats(args.top)
                if args.profile_out:
                    stats.dump_stats(args.profile_out)
    if not args.examples:
        for r in results:
            r.pop("example_pass", None)
    out = {"benchmark": "event_pass", "cpus": os.cpu_count(), "updates": args.updates,
           "churn": args.churn,
           "sizes": results}  # fmt: skip
    print(json.dumps(out, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
