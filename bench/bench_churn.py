"""Benchmark 2: churn -- 120 sandboxes of two containers, created, updated and deleted for 60 s.

What runs, all real processes on this host:

- the agent: ``vmpin serve`` (a subprocess, default settings: 2 workers, 5 s passes);
- 120 sandboxes, each a QEMU-shaped process (bench/fakevmm.py: ``-name sandbox-<id>``,
  a pidfile in ``<vm dir>/<id>/pid``, threads "CPU 0/KVM", "CPU 1/KVM", "IO io0" and the main
  thread), with two containers: the sandbox ("pause") container and a workload container,
  each with a CPU set in its OCI bundle's ``config.json``;
- creation and deletion go through the real hook path: ``vmpin hook createRuntime`` (OCI
  state on stdin, the bundle's config.json with containerd's CRI annotations) for each
  container, ``vmpin hook poststop`` at deletion (for the workload container with the
  *sandbox* id in the state, as Kata sends it), the VMM killed and its VM dir removed between
  the two, as Kata's StopVM does;
- updates go through ``vmpin.service.update.update_container`` -- the code ``vmpin update`` runs,
  minus the interpreter start-up -- which writes the new set, notifies the agent and waits
  until the agent has planned from that write (else re-pins in-process).

``--threads`` driver threads (default 4) pick operations at random for the duration: 80 %
updates (a random container of a random sandbox gets "0", "1" or "0-1"), 20 % recreations
(delete a sandbox: poststop hooks, VMM killed; create a new one in its place).  One
operation at a time per sandbox, so "the last update" of a container is well defined.

Beside the round trips (wall time: the machine's load moves them), the agent's own figures,
scraped from its metrics: ``event_pass_cpu_mean_ms`` (``vmpin_event_pass_cpu_seconds``: the
planner thread's CPU time per node pass run for events alone -- load does not move it),
``node_passes_per_event`` and ``plans_per_event``.  An event's pass whose work grows with
the node shows in the first at once (issue 28: the round trips had grown ~4x unnoticed);
``bench/bench_event_pass.py`` measures that pass at 60 / 500 / 2,000 sandboxes.

And where a round trip's time goes, so that a wait the agent's design adds shows apart from
the machine's load: ``update_phases`` splits each update into its exchange with the agent
(``agent_ms``: connecting, the request, the answer read; the update's sync runs meanwhile)
and the rest (``own_ms``: the store opened, the journal applied, the write); the agent's
metrics say what the exchange was made of -- ``queue_wait_mean_ms`` (notification -> the
start of the pass that takes it: the rest of the pass running when it came),
``event_pass_wall_mean_ms`` (that pass's start -> its threads pinned; over
``event_pass_cpu_mean_ms``, the CPU contention), ``pass_tail_mean_ms`` (the planner's time
after the answers, which a request arriving then waits for).  A queue wait near or above
the pass's wall time means requests wait for whole passes not theirs.

At the end the bench waits until the agent is idle and checks: ``vmpin audit`` exits 0;
the store holds exactly the live containers, each with the CPU set it was last given (zero
lost events); every thread of every VMM is inside its sandbox's mask; no sandbox is dirty;
the database passes ``PRAGMA integrity_check``.

Run (as root)::

    python bench/bench_churn.py [--sandboxes 120] [--duration 60] [--threads 4] [--json OUT]
                                [--tmpdir /dev/shm]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from bench_idle_pass import env_for, vmpin_cmd  # noqa: E402
from fakenode import make_paths, stop_agent  # noqa: E402

from tests.support import fakevmm  # noqa: E402
from vmpin.core.cpuset import CpuSet  # noqa: E402
from vmpin.linux.paths import HostPaths  # noqa: E402
from vmpin.service import control  # noqa: E402
from vmpin.service.update import update_container  # noqa: E402
from vmpin.state.store import Store  # noqa: E402

CHOICES = ("0", "1", "0-1")
#: seconds each update thread spent exchanging with the agent (control._send, wrapped below)
_EXCHANGE = threading.local()
_send = control._send


def _timed_send(*args: Any, **kw: Any) -> bytes | None:
    t0 = time.perf_counter()
    try:
        return _send(*args, **kw)
    finally:
        _EXCHANGE.seconds = getattr(_EXCHANGE, "seconds", 0.0) + time.perf_counter() - t0


control._send = _timed_send  # (every request, notify and post of this process goes through it)


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[max(0, min(len(s) - 1, round(q / 100 * len(s) + 0.5) - 1))]


def summary(ms: list[float]) -> dict[str, float] | None:
    if not ms:
        return None
    return {
        "n": len(ms),
        "p50_ms": round(pct(ms, 50), 1),
        "p99_ms": round(pct(ms, 99), 1),
        "max_ms": round(max(ms), 1),
        "mean_ms": round(statistics.fmean(ms), 1),
    }


class Sandbox:
    def __init__(self, sid: str, vmm: fakevmm.FakeVmm, bundles: dict[str, Path]) -> None:
        self.id = sid
        self.vmm = vmm
        self.bundles = bundles  # container id -> bundle dir


class Churn:
    def __init__(self, root: Path, paths: HostPaths, env: dict[str, str], seed: int) -> None:
        self.root = root
        self.paths = paths
        self.env = env
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.live: dict[str, Sandbox] = {}
        self.busy: set[str] = set()
        self.want: dict[str, str] = {}  # container id -> CPU list it was last given
        self.serial = 0
        self.hook_ms: list[float] = []
        self.update_ms: list[float] = []
        #: each update's exchange with the agent, and the rest of it (ms)
        self.agent_ms: list[float] = []
        self.own_ms: list[float] = []
        self.counts = {
            "updates": 0,
            "creates": 0,
            "deletes": 0,
            "hooks": 0,
            "updates_applied_in_process": 0,
            "hook_failures": 0,
        }
        self.all_vmms: list[fakevmm.FakeVmm] = []

    # -- the hook path -----------------------------------------------------------------------
    def hook(self, stage: str, state: dict[str, object]) -> None:
        t0 = time.perf_counter()
        proc = subprocess.run(
            [*vmpin_cmd(), "hook", "--strict", stage],
            env=self.env,
            input=json.dumps(state).encode(),
            capture_output=True,
            timeout=120,
        )
        with self.lock:
            self.hook_ms.append((time.perf_counter() - t0) * 1000)
            self.counts["hooks"] += 1
            if proc.returncode != 0:
                self.counts["hook_failures"] += 1
        if proc.returncode != 0:
            raise RuntimeError(f"hook {stage} failed: {proc.stderr.decode().strip()}")

    def bundle(self, cid: str, sid: str, kind: str, cpus: str) -> Path:
        d = self.root / "bundles" / cid
        d.mkdir(parents=True, exist_ok=True)
        config = {
            "ociVersion": "1.0.2",
            "annotations": {
                "io.kubernetes.cri.container-type": kind,
                "io.kubernetes.cri.sandbox-id": sid,
                "io.kubernetes.cri.sandbox-name": f"pod-{sid}",
                "io.kubernetes.cri.sandbox-namespace": "bench",
                "io.kubernetes.cri.sandbox-uid": f"uid-{sid}",
                "io.kubernetes.cri.container-name": "pause" if kind == "sandbox" else "app",
            },
            "linux": {"resources": {"cpu": {"cpus": cpus}}},
        }
        (d / "config.json").write_text(json.dumps(config))
        return d

    def create(self) -> None:
        with self.lock:
            sid = f"sb{self.serial:05d}"
            self.serial += 1
            self.busy.add(sid)
        vmm = fakevmm.start(self.root / "vm", sid, vcpus=2)
        with self.lock:
            self.all_vmms.append(vmm)
        app = f"{sid}-app"
        cpus = {sid: self.rng.choice(CHOICES), app: self.rng.choice(CHOICES)}
        bundles = {
            sid: self.bundle(sid, sid, "sandbox", cpus[sid]),
            app: self.bundle(app, sid, "container", cpus[app]),
        }
        self.hook(
            "createRuntime",
            {
                "ociVersion": "1.0.2",
                "id": sid,
                "status": "creating",
                "pid": vmm.pid,
                "bundle": str(bundles[sid]),
            },
        )
        self.hook(
            "createRuntime",
            {
                "ociVersion": "1.0.2",
                "id": app,
                "status": "creating",
                "pid": vmm.pid,
                "bundle": str(bundles[app]),
            },
        )
        with self.lock:
            self.live[sid] = Sandbox(sid, vmm, bundles)
            self.want.update(cpus)
            self.counts["creates"] += 1
            self.busy.discard(sid)

    def delete(self, sb: Sandbox) -> None:
        app = f"{sb.id}-app"
        # Kata's poststop carries the sandbox id; the bundle says which container stopped
        self.hook(
            "poststop",
            {
                "ociVersion": "1.0.2",
                "id": sb.id,
                "status": "stopped",
                "bundle": str(sb.bundles[app]),
            },
        )
        sb.vmm.kill()
        # as Kata's StopVM does (qemu.cleanupVM: os.RemoveAll of <vm dir>/<id>); left, 265
        # dead sandboxes' dirs in 30 s made every event pass stat each (not a node's churn)
        shutil.rmtree(self.root / "vm" / sb.id, ignore_errors=True)
        self.hook(
            "poststop",
            {
                "ociVersion": "1.0.2",
                "id": sb.id,
                "status": "stopped",
                "bundle": str(sb.bundles[sb.id]),
            },
        )
        with self.lock:
            del self.live[sb.id]
            self.want.pop(sb.id, None)
            self.want.pop(app, None)
            self.counts["deletes"] += 1
            self.busy.discard(sb.id)
        for d in sb.bundles.values():
            shutil.rmtree(d, ignore_errors=True)

    def update(self, sb: Sandbox) -> None:
        cid = self.rng.choice([sb.id, f"{sb.id}-app"])
        cpus = self.rng.choice(CHOICES)
        _EXCHANGE.seconds = 0.0
        t0 = time.perf_counter()
        result = update_container(self.paths, cid, cpuset_cpus=cpus)
        ms = (time.perf_counter() - t0) * 1000
        agent_ms = _EXCHANGE.seconds * 1000
        with self.lock:
            self.want[cid] = cpus
            self.update_ms.append(ms)
            self.agent_ms.append(agent_ms)
            self.own_ms.append(ms - agent_ms)
            self.counts["updates"] += 1
            if "agent" not in result["applied_by"]:
                self.counts["updates_applied_in_process"] += 1
            self.busy.discard(sb.id)

    def pick(self) -> Sandbox | None:
        with self.lock:
            free = [s for sid, s in self.live.items() if sid not in self.busy]
            if not free:
                return None
            sb = self.rng.choice(free)
            self.busy.add(sb.id)
            return sb

    def driver(self, deadline: float, errors: list[BaseException]) -> None:
        try:
            while time.monotonic() < deadline:
                sb = self.pick()
                if sb is None:
                    time.sleep(0.01)
                    continue
                if self.rng.random() < 0.8:
                    self.update(sb)
                else:
                    self.delete(sb)
                    self.create()
        except BaseException as err:
            errors.append(err)


def agent_idle(paths: HostPaths, timeout: float = 120) -> dict[str, object]:
    deadline = time.monotonic() + timeout
    quiet = 0
    while time.monotonic() < deadline:
        st = control.request(paths, {"op": "status"}, timeout=5)
        with Store(paths.state_dir) as store:
            dirty = store.dirty()
        if st and st["queue"] == 0 and st["running"] == 0 and not dirty:
            quiet += 1
            if quiet >= 3:
                return st
        else:
            quiet = 0
        time.sleep(0.2)
    raise TimeoutError("agent did not go idle")


def scrape(port: int) -> dict[str, float]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for line in body.splitlines():
        if line.startswith("vmpin_") and "_bucket{" not in line:
            name, _, value = line.rpartition(" ")
            if "_bucket" not in name:
                out[name] = float(value)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sandboxes", type=int, default=120)
    ap.add_argument("--duration", type=float, default=60)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", help="also write the result here")
    ap.add_argument(
        "--tmpdir",
        help="where the state, VM and bundle dirs go (a node's /run/vmpin is a tmpfs: "
        "/dev/shm here; the default, $TMPDIR or /tmp, may be a disk, where fsyncs wait)",
    )
    args = ap.parse_args()

    root = Path(tempfile.mkdtemp(prefix="vmpin-churn-", dir=args.tmpdir))
    paths = make_paths(root)
    (root / "vm").mkdir()
    env = env_for(paths)
    port = 19000 + os.getpid() % 1000
    agent = subprocess.Popen(
        [*vmpin_cmd(), "serve", "--metrics-port", str(port)],
        env=env,
        stderr=open(root / "agent.log", "wb"),  # noqa: SIM115 (the agent's, closed at exit)
    )
    churn = Churn(root, paths, env, args.seed)
    try:
        deadline = time.monotonic() + 30
        while control.request(paths, {"op": "status"}) is None:
            if time.monotonic() > deadline or agent.poll() is not None:
                raise RuntimeError("agent did not start")
            time.sleep(0.05)
        t0 = time.monotonic()
        errors: list[BaseException] = []

        def populate(n: int) -> None:
            try:
                for _ in range(n):
                    churn.create()
            except BaseException as err:
                errors.append(err)

        per = [
            args.sandboxes // args.threads + (i < args.sandboxes % args.threads)
            for i in range(args.threads)
        ]
        ts = [threading.Thread(target=populate, args=(n,)) for n in per]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        if errors:
            raise errors[0]
        populate_s = time.monotonic() - t0
        with open(f"/proc/{agent.pid}/stat") as f:
            agent_nice = int(f.read().rsplit(")", 1)[1].split()[16])
        before = scrape(port)

        c0 = time.monotonic()
        deadline = c0 + args.duration
        ts = [
            threading.Thread(target=churn.driver, args=(deadline, errors))
            for _ in range(args.threads)
        ]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        churn_s = time.monotonic() - c0
        if errors:
            raise errors[0]
        idle_t0 = time.monotonic()
        st = agent_idle(paths)
        settle_s = time.monotonic() - idle_t0
        after = scrape(port)

        audit = subprocess.run(
            [*vmpin_cmd(), "audit", "--json"], env=env, capture_output=True, text=True, timeout=300
        )
        audit_js = json.loads(audit.stdout) if audit.stdout.strip() else {}
        lost = []
        with Store(paths.state_dir) as store:
            stored = {c.id: c.cpus for c in store.containers()}
            sandboxes = {s.id for s in store.sandboxes()}
            dirty = store.dirty()
        for cid, cpus in churn.want.items():
            if stored.get(cid) != CpuSet.parse(cpus):
                lost.append(cid)
        extra = sorted(set(stored) - set(churn.want))
        off_mask = []
        for sid, sb in churn.live.items():
            mask = CpuSet.parse(churn.want[sid]) | CpuSet.parse(churn.want[f"{sid}-app"])
            for tid in sb.vmm.tids():
                try:
                    if not CpuSet(os.sched_getaffinity(tid)).issubset(mask):
                        off_mask.append((sid, tid))
                except ProcessLookupError:
                    pass
        integrity = sqlite3.connect(paths.db).execute("PRAGMA integrity_check").fetchone()[0]

        def delta(name: str) -> float:
            return after.get(name, 0.0) - before.get(name, 0.0)

        lat_n = delta("vmpin_pin_latency_seconds_count")
        ev_n = delta("vmpin_event_pass_cpu_seconds_count")
        events = delta("vmpin_events_total")

        def mean_ms(histogram: str) -> float | None:
            n = delta(f"{histogram}_count")
            return round(1000 * delta(f"{histogram}_sum") / n, 2) if n else None
        result = {
            "benchmark": "churn",
            "sandboxes": args.sandboxes,
            "driver_threads": args.threads,
            "host_cpus": os.cpu_count(),
            "tmpdir": str(root.parent),  # (tmpfs or a disk: the fsyncs' cost differs)
            "populate_s": round(populate_s, 1),
            "churn_s": round(churn_s, 1),
            "settle_s": round(settle_s, 2),
            "operations": dict(churn.counts),
            "update_round_trip": summary(churn.update_ms),
            "update_phases": {
                "agent_ms": summary(churn.agent_ms),
                "own_ms": summary(churn.own_ms),
            },
            "hook_wall": summary(churn.hook_ms),
            "agent": {
                # its nice value (VMPIN_AGENT_NICE; default vmpin.service.agent.DEFAULT_NICE)
                "nice": agent_nice,
                "events": delta("vmpin_events_total"),
                "coalesced": delta("vmpin_events_coalesced_total"),
                "plans_event": delta('vmpin_plans_total{cause="event"}'),
                "plans_periodic": delta('vmpin_plans_total{cause="periodic"}'),
                # what each event costs the agent, in CPU (not wall: the load of the machine
                # does not move it) and in node passes: the figures that would have shown
                # issue 28's regression (a pass whose work grew with the node)
                "event_pass_cpu_mean_ms": round(
                    1000 * delta("vmpin_event_pass_cpu_seconds_sum") / ev_n, 2
                )
                if ev_n
                else None,
                "event_passes": ev_n,
                # where a waiter's time goes (see the module's docstring)
                "queue_wait_mean_ms": mean_ms("vmpin_queue_wait_seconds"),
                "event_pass_wall_mean_ms": mean_ms("vmpin_event_pass_seconds"),
                "pass_tail_mean_ms": mean_ms("vmpin_pass_tail_seconds"),
                "node_passes_per_event": round(delta("vmpin_node_passes_total") / events, 3)
                if events
                else None,
                "plans_per_event": round(delta('vmpin_plans_total{cause="event"}') / events, 3)
                if events
                else None,
                "pin_latency_mean_ms": round(
                    1000 * delta("vmpin_pin_latency_seconds_sum") / lat_n, 2
                )
                if lat_n
                else None,
                "affinity_writes": sum(
                    v for k, v in after.items() if k.startswith("vmpin_affinity_writes_total")
                ),
                "errors": {
                    k: v for k, v in after.items() if k.startswith("vmpin_errors_total") and v
                },
                "drift_repaired": {
                    k: v
                    for k, v in after.items()
                    if k.startswith("vmpin_drift_repaired_total") and v
                },
                "status": {
                    k: st[k]
                    for k in (
                        "sandboxes",
                        "containers",
                        "threads_pinned",
                        "plans",
                        "events",
                        "errors",
                    )
                },
            },
            "end": {
                "audit_exit": audit.returncode,
                "audit_ok": audit_js.get("ok"),
                "audit_violations": len(audit_js.get("violations", [])),
                "live_sandboxes": len(churn.live),
                "stored_sandboxes": len(sandboxes),
                "lost_updates": len(lost),
                "stale_containers": len(extra),
                "threads_off_mask": len(off_mask),
                "dirty_sandboxes": len(dirty),
                "integrity_check": integrity,
            },
        }
        print(json.dumps(result, indent=2))
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        ok = (
            audit.returncode == 0
            and not lost
            and not extra
            and not off_mask
            and not dirty
            and integrity == "ok"
            and sandboxes == set(churn.live)
        )
        if not ok:
            print(
                f"FAILED: lost={lost[:5]} extra={extra[:5]} off={off_mask[:5]} "
                f"audit={audit.stdout[-2000:]} {audit.stderr[-500:]}",
                file=sys.stderr,
            )
        return 0 if ok else 1
    finally:
        stop_agent(agent)
        for v in churn.all_vmms:
            v.kill()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
