"""Benchmark: what libvirt domains cost a pass, and that an idle pass pins nothing.

Setup: N (default 4) real domains on a running libvirtd (qemu:///system; KVM, or TCG where
KVM is missing), 2 vCPUs and one iothread each, masks alternating CPU 0 and CPU 1 in their
metadata.  A first pass pins them; then:

1. ``--passes`` idle passes (observe every domain, classify its threads through the monitor
   passthrough, plan, compare): wall and CPU time per pass and per domain, and the number of
   libvirt pin calls (must be 0);
2. drift: ``virsh vcpupin`` moves vCPU 0 of one domain, a pass repairs it: that pass's wall
   time and how many threads it re-pinned (must be 1).

Every domain is destroyed and undefined at the end.  Run (as root, libvirtd running)::

    python bench/bench_libvirt.py [--domains 4] [--passes 5] [--json OUT]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import libvirt  # noqa: E402

from tests.support.libvirt_util import URI, domain_xml  # noqa: E402
from tests.support.qemu_util import kvm_usable  # noqa: E402
from vmpin.linux.paths import HostPaths  # noqa: E402
from vmpin.reconcile.domains import LibvirtDomains  # noqa: E402
from vmpin.reconcile.reconciler import Reconciler  # noqa: E402
from vmpin.runtimes import libvirt as lv  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--domains", type=int, default=4)
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()

    pins = {"calls": 0}
    real_pin = lv.Connection.pin

    def counting_pin(self: lv.Connection, *a: object, **kw: object) -> lv.Pins:
        pins["calls"] += 1
        return real_pin(self, *a, **kw)  # type: ignore[arg-type]

    lv.Connection.pin = counting_pin  # type: ignore[method-assign]
    conn = libvirt.open(URI)
    made = []
    tmp = tempfile.mkdtemp(prefix="vmpin-bench-libvirt-")
    try:
        for i in range(args.domains):
            name = f"vmpin-bench-{uuid.uuid4().hex[:10]}"
            dom = conn.defineXML(domain_xml(name, 2, 1, kvm_usable(), mask=str(i % 2)))
            made.append(dom)
            dom.create()
        paths = HostPaths(state_dir=tmp, kubelet_state=f"{tmp}/none")
        rc = Reconciler(paths, domains=LibvirtDomains(paths, [URI]))
        first = rc.reconcile(apply=True)
        ours = {d.UUIDString() for d in made}
        assert {r.id for r in first} >= ours, [r.errors for r in first]

        walls, cpus = [], []
        pins["calls"] = 0
        for _ in range(args.passes):
            w0, c0 = time.perf_counter(), time.process_time()
            rc.reconcile(apply=True)
            walls.append(time.perf_counter() - w0)
            cpus.append(time.process_time() - c0)
        idle_pin_calls = pins["calls"]

        victim = made[0]
        subprocess.run(
            ["virsh", "-c", URI, "vcpupin", victim.name(), "0", "0-1", "--live"],
            check=True,
            capture_output=True,
        )
        w0 = time.perf_counter()
        reports = rc.reconcile(apply=True)
        repair_wall = time.perf_counter() - w0
        repinned = sum(r.changed for r in reports)
        out = {
            "domains": args.domains,
            "kvm": kvm_usable(),
            "idle_pass_wall_s_median": round(statistics.median(walls), 4),
            "idle_pass_cpu_s_median": round(statistics.median(cpus), 4),
            "idle_pass_wall_per_domain_ms": round(
                1000 * statistics.median(walls) / args.domains, 2
            ),
            "idle_pin_calls": idle_pin_calls,
            "repair_pass_wall_s": round(repair_wall, 4),
            "repair_repinned_threads": repinned,
        }
    finally:
        for dom in made:
            with contextlib.suppress(libvirt.libvirtError):
                dom.destroy()
            with contextlib.suppress(libvirt.libvirtError):
                dom.undefine()
        conn.close()
    print(json.dumps(out, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0 if idle_pin_calls == 0 and repinned == 1 else 1


if __name__ == "__main__":
    raise SystemExit(main())
