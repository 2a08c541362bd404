"""Benchmark: what the private-namespace debugfs read (layer ``debugfs-ns``) costs a pass.

Setup: one real KVM QEMU started like Kata's (no thread names, 2 vCPUs) with a BIOS that is
``jmp $`` (tests/support/qemu_util.spin_bios): vCPU 0 runs guest code for the VM's whole life,
the case only debugfs can see.  The host's debugfs stays unmounted (checked before and after).
Measured, ``--rounds`` times each, interleaved:

0. ``spawn_true``: posix_spawn + waitpid of ``true``, the floor of any child (a reference for
   this machine's noise: other sessions share its two CPUs);
1. ``read``: :func:`vmpin.linux.debugfs.vcpu_pids_private` alone (spawn ``unshare``, mount in
   the child's namespace, read, reap);
2. ``classify_ns``: a VMM's first pass (nothing remembered, no QMP): ``classify()`` as
   vmpin runs it, which spawns the reader once and finds both vCPUs;
3. ``classify_no_ns``: the same pass without the layer (``debugfs_ns_timeout=None``) and
   without re-reads (``kvm_retries=0``): the work the layer adds to, which misses vCPU 0;
4. ``classify_no_ns_retries``: without the layer, with vmpin's default re-reads of the
   "running" threads (5 x 10 ms): what such a pass cost before, still missing vCPU 0.

With two CPUs or more the QEMU runs on the first one and the benchmark on the others.
Reported per series: median, p90 and max wall time (ms), and how many passes found every vCPU.
The extra cost of the layer per classification is ``classify_ns - classify_no_ns``.  A pass
with every vCPU remembered (every pass of a VMM after its first complete one) spawns nothing.
Run (as root, with KVM)::

    python bench/bench_debugfs.py [--rounds 50] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from tests.support.qemu_util import (  # noqa: E402
    debugfs_mount_points,
    kvm_usable,
    launch,
    spin_bios,
    wait_until,
)
from tests.support.session import new_id  # noqa: E402
from vmpin.linux import debugfs  # noqa: E402
from vmpin.linux.paths import HostPaths  # noqa: E402
from vmpin.runtimes.qmp import QmpClient  # noqa: E402
from vmpin.runtimes.threads import classify  # noqa: E402
from vmpin.runtimes.vmm import find_vmm  # noqa: E402

HOST_DEBUG = "/sys/kernel/debug"


def _stats(ms: list[float]) -> dict[str, float]:
    ordered = sorted(ms)
    return {
        "median_ms": round(statistics.median(ordered), 2),
        "p90_ms": round(ordered[int(0.9 * (len(ordered) - 1))], 2),
        "max_ms": round(ordered[-1], 2),
    }


def _online() -> set[int]:
    out: set[int] = set()
    with open("/sys/devices/system/cpu/online") as f:
        for part in f.read().strip().split(","):
            lo, _, hi = part.partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--json")
    args = ap.parse_args()
    if os.geteuid() != 0 or not kvm_usable():
        print("needs root and a usable KVM", file=sys.stderr)
        return 2
    assert HOST_DEBUG not in debugfs_mount_points() and not os.path.exists(f"{HOST_DEBUG}/kvm")
    with tempfile.TemporaryDirectory(prefix="vmpin-bench-debugfs-") as tmp:
        d = Path(tmp)
        q = launch(d / "vm", new_id("bdbg"), smp=2, accel="kvm",
                   extra=("-bios", str(spin_bios(d))))  # fmt: skip
        try:
            with QmpClient(str(q.qmp_sock), timeout=5.0) as qmp:
                cpus = {index: tid for index, tid, _ in qmp.query_cpus_fast()}

            def ran() -> bool:
                with open(f"/proc/{q.pid}/task/{cpus[0]}/schedstat") as f:
                    return int(f.read().split()[0]) > 50_000_000

            assert wait_until(ran, 20), "vCPU 0 never ran"
            # every process on these machines starts on CPU 0 (QEMU inherited it): with a
            # second CPU the benchmark and its children measure on the others, away from
            # the spinning vCPU and from whatever else runs on CPU 0
            online = sorted(_online())
            if len(online) > 1:
                for tid in os.listdir(f"/proc/{q.pid}/task"):
                    os.sched_setaffinity(int(tid), {online[0]})
                os.sched_setaffinity(0, set(online[1:]))
            paths = HostPaths(vm_dir=str(d / "vm"))
            vmm = find_vmm(paths, q.sandbox_id, hint_pid=q.pid, scan=False)
            assert vmm is not None
            true = debugfs.find_binary("true") or "/bin/true"

            def spawn_true() -> bool:
                os.waitpid(os.posix_spawn(true, [true], {}), 0)
                return True

            series: dict[str, Callable[[], bool]] = {
                "spawn_true": spawn_true,
                "read": lambda: debugfs.vcpu_pids_private("/sys", q.pid, 5.0) != {},
                "classify_ns": lambda: classify(paths, vmm, None).vcpus() == cpus,
                "classify_no_ns": lambda: classify(
                    paths, vmm, None, kvm_retries=0, debugfs_ns_timeout=None
                ).vcpus() == cpus,
                "classify_no_ns_retries": lambda: classify(
                    paths, vmm, None, debugfs_ns_timeout=None
                ).vcpus() == cpus,
            }
            times: dict[str, list[float]] = {k: [] for k in series}
            complete: dict[str, int] = dict.fromkeys(series, 0)
            for _ in range(args.rounds):
                for name, run in series.items():
                    t0 = time.perf_counter()
                    ok = run()
                    times[name].append((time.perf_counter() - t0) * 1000)
                    complete[name] += ok
        finally:
            q.kill()
    assert HOST_DEBUG not in debugfs_mount_points() and not os.path.exists(f"{HOST_DEBUG}/kvm")
    out: dict[str, object] = {
        name: {**_stats(ms), "complete": f"{complete[name]}/{args.rounds}"}
        for name, ms in times.items()
    }
    extra = statistics.median(times["classify_ns"]) - statistics.median(times["classify_no_ns"])
    out["layer_extra_ms_median"] = round(extra, 2)
    out["rounds"] = args.rounds
    out["cpus_online"] = len(_online())
    out["bench_cpus"] = sorted(os.sched_getaffinity(0))
    out["loadavg"] = os.getloadavg()[0]
    text = json.dumps(out, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
