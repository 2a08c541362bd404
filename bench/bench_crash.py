"""kill -9 at random points of a hook churn, then truncated WALs: is any acknowledged event lost?

Churn: ``--writers`` processes each run the real hook code (:func:`vmpin.service.hook.run`)
for a stream of plain containers -- createRuntime, then for half of them poststop -- and
report on a pipe what was *acknowledged* (the hook returned: its event is durable in the
journal).  Beside them ``--ingesters`` processes open the store and ingest in a loop.  Every
``--kill-every`` seconds a random writer or ingester gets SIGKILL (mid-write, mid-transaction,
between commit and unlink, wherever it happens to be) and is replaced.

Then ``--truncations`` rounds of: 20 more acknowledged events, an ingest that leaves like the
hook does (``os._exit``, no checkpoint on close), the WAL truncated to nothing (the worst a
power cut can do to WAL pages never synced), and a fresh store open.

Checked at the end: every container whose create was acknowledged and whose poststop was
never started is in the store (``lost`` otherwise), and none whose poststop was acknowledged
is (``resurrected``); containers killed between the two are undetermined and not counted.

    python3 bench/bench_crash.py [--seconds 30] [--writers 3] [--ingesters 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from vmpin.linux.paths import HostPaths
from vmpin.state.store import Store


def writer(paths: HostPaths, bundle: str, prefix: str, conn: Any) -> None:
    from vmpin.service.hook import run

    sys.stderr = open(os.devnull, "w")  # noqa: SIM115
    i = 0
    while True:
        cid = f"{prefix}-{i}"
        i += 1
        state = json.dumps({"id": cid, "pid": os.getpid(), "bundle": bundle}).encode()
        run(paths, "createRuntime", state)
        conn.send(("C", cid))
        if i % 2:
            conn.send(("P", cid))  # poststop started: from here on, undetermined until acked
            run(paths, "poststop", json.dumps({"id": cid, "bundle": bundle}).encode())
            conn.send(("D", cid))


def ingester(paths: HostPaths) -> None:
    sys.stderr = open(os.devnull, "w")  # noqa: SIM115
    while True:
        with Store(paths.state_dir, ingest=False) as store:
            store.ingest(batch=random.choice([1, 10, 500]))
        time.sleep(random.random() * 0.02)


INGEST_AND_LEAVE = """
import os, sys
from vmpin.state.store import Store
Store(sys.argv[1], ingest=False).ingest()
os._exit(0)
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--writers", type=int, default=3)
    ap.add_argument("--ingesters", type=int, default=2)
    ap.add_argument("--kill-every", type=float, default=0.05)
    ap.add_argument("--truncations", type=int, default=50)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    ctx = mp.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="vmpin-crash-") as tmp:
        root = Path(tmp)
        paths = HostPaths(state_dir=str(root / "state"), vm_dir=str(root / "vm"),
                          runc_root=str(root / "runc"), publish_dir=str(root / "pub"))
        (root / "vm").mkdir()
        bundle = root / "bundle"
        bundle.mkdir()
        (bundle / "config.json").write_text(
            json.dumps({"linux": {"resources": {"cpu": {"cpus": "0"}}}}))
        Store(paths.state_dir).close()
        acked: set[str] = set()
        stopping: set[str] = set()
        deleted: set[str] = set()
        procs: dict[int, tuple[str, Any, Any]] = {}
        generation = 0

        def spawn(kind: str) -> None:
            nonlocal generation
            generation += 1
            if kind == "writer":
                r, w = ctx.Pipe(duplex=False)
                p = ctx.Process(target=writer, args=(paths, str(bundle), f"g{generation}", w))
                p.start()
                w.close()
                procs[p.pid] = (kind, p, r)
            else:
                p = ctx.Process(target=ingester, args=(paths,))
                p.start()
                procs[p.pid] = (kind, p, None)

        def drain() -> None:
            for _kind, _p, r in procs.values():
                if r is None:
                    continue
                try:
                    while r.poll():
                        tag, cid = r.recv()
                        {"C": acked, "P": stopping, "D": deleted}[tag].add(cid)
                except (EOFError, OSError):
                    pass

        for _ in range(args.writers):
            spawn("writer")
        for _ in range(args.ingesters):
            spawn("ingester")
        kills = 0
        end = time.monotonic() + args.seconds
        while time.monotonic() < end:
            time.sleep(random.random() * args.kill_every * 2)
            drain()
            pid = random.choice(list(procs))
            kind, p, r = procs.pop(pid)
            os.kill(pid, signal.SIGKILL)  # a process this script started, by its pid
            p.join()
            kills += 1
            if r is not None:
                try:
                    while r.poll():
                        tag, cid = r.recv()
                        {"C": acked, "P": stopping, "D": deleted}[tag].add(cid)
                except (EOFError, OSError):
                    pass
                r.close()
            spawn(kind)
        drain()
        for pid, (_kind, p, r) in list(procs.items()):
            os.kill(pid, signal.SIGKILL)
            p.join()
            if r is not None:
                r.close()
        truncated = 0
        import subprocess

        from vmpin.service.hook import run as hook_run

        real_stderr = sys.stderr
        for round_ in range(args.truncations):
            for k in range(20):  # fresh acknowledged events for this round
                cid = f"t{round_}-{k}"
                hook_run(paths, "createRuntime", json.dumps(
                    {"id": cid, "pid": os.getpid(), "bundle": str(bundle)}).encode())
                # (run() returned: the event is in the journal, fsynced -- acknowledged)
                acked.add(cid)
            subprocess.run([sys.executable, "-c", INGEST_AND_LEAVE, paths.state_dir],
                           check=True, timeout=120)
            wal = Path(paths.state_dir, "state.db-wal")
            if wal.exists() and wal.stat().st_size:
                # The whole WAL, not a random length: with synchronous=FULL a power cut can
                # only lose what was never synced, and the worst case of that is all of it.
                # (Cutting a synced, already checkpointed WAL in the middle is not a crash:
                # it makes SQLite overlay older pages on newer ones -- "malformed".)
                os.truncate(wal, 0)
                truncated += 1
            with Store(paths.state_dir) as store:
                store.containers()
        sys.stderr = real_stderr
        with Store(paths.state_dir) as store:
            present = {c.id for c in store.containers()}
        must_have = acked - stopping
        lost = sorted(must_have - present)
        resurrected = sorted(deleted & present)
        result = {
            "seconds": args.seconds,
            "kills": kills,
            "acknowledged_creates": len(acked),
            "acknowledged_deletes": len(deleted),
            "undetermined": len(stopping - deleted),
            "wal_truncations": truncated,
            "lost": len(lost),
            "resurrected": len(resurrected),
            "examples_lost": lost[:5],
        }
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        for k, v in result.items():
            print(f"{k:22} {v}")
    return 1 if lost or resurrected else 0


if __name__ == "__main__":
    sys.exit(main())
