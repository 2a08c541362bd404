"""Plain (runc-less) pods driven through the real ``vmpin hook`` CLI, for allocation tests
(issue 30) on a fixture topology: each container is a bundle whose config.json carries
containerd's annotations (and, when given, a CPU limit), a cpuset cgroup directory under a
test cgroup root (real files the pass writes ``cpuset.cpus`` to, no tasks), and a real
process as its pid (one ``sleep`` shared by all: alive, with the start time the hook reads).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from tests.conftest import vmpin_cmd
from vmpin.core.cpuset import CpuSet

CRI = "io.kubernetes.cri."


class PlainPods:
    def __init__(self, tmp: Path, env: dict[str, str], sysfs: Path, online: CpuSet) -> None:
        self.tmp, self.online = tmp, online
        self.cgroot = tmp / "cg"
        self.env = {**env, "VMPIN_SYSFS_ROOT": str(sysfs), "VMPIN_CGROUP_ROOT": str(self.cgroot)}
        #: global options put before every command, the hooks' too (``--kubelet-config``...)
        self.flags: list[str] = []
        self.sleeper = subprocess.Popen(["sleep", "3600"])

    def close(self) -> None:
        self.sleeper.kill()
        self.sleeper.wait()

    def vmpin(self, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*vmpin_cmd(), *self.flags, *args], input=stdin,
                              capture_output=True, text=True, env=self.env,
                              timeout=120)  # fmt: skip

    def ids(self, pod: str) -> tuple[str, str]:
        return f"{pod}-pause", f"{pod}-app"

    def hook(self, stage: str, cid: str, state_annotations: dict[str, str] | None = None) -> str:
        bundle = self.tmp / "bundles" / cid
        st: dict[str, object] = {"ociVersion": "1.0.2", "id": cid, "bundle": str(bundle),
                                 "annotations": state_annotations or {}}  # fmt: skip
        if stage != "poststop":
            st["pid"] = self.sleeper.pid
            st["status"] = "creating"
        out = self.vmpin("hook", "--strict", stage, stdin=json.dumps(st))
        assert out.returncode == 0, out.stderr
        return out.stderr

    def create(self, pod: str, ann: dict[str, str], limit: int | None = None) -> list[str]:
        """The pod's pause container, then its app container (with ``limit`` CPUs as
        quota/period, as kubelet writes a Guaranteed container's); the hooks' stderr."""
        sid, app = self.ids(pod)
        errs = []
        for cid, sandbox in ((sid, True), (app, False)):
            a = {
                CRI + "container-type": "sandbox" if sandbox else "container",
                CRI + "sandbox-id": sid,
                CRI + "sandbox-uid": f"uid-{pod}",
                CRI + "sandbox-name": pod,
                CRI + "sandbox-namespace": "default",
                **ann,
            }
            if not sandbox:
                a[CRI + "container-name"] = "app"
            cpu = {"quota": limit * 100000, "period": 100000} if limit and not sandbox else {}
            b = self.tmp / "bundles" / cid
            b.mkdir(parents=True)
            (b / "config.json").write_text(json.dumps(
                {"ociVersion": "1.0.2", "annotations": a, "linux": {"resources": {"cpu": cpu}}}
            ))  # fmt: skip
            cg = self.cgroot / "cpuset" / cid
            cg.mkdir(parents=True)
            (cg / "cpuset.cpus").write_text(self.online.to_list() + "\n")
            (cg / "tasks").write_text("")
            errs.append(self.hook("createRuntime", cid, a))
        return errs

    def delete(self, pod: str) -> None:
        """poststop for the app container, then the pause container (the pod is gone)."""
        sid, app = self.ids(pod)
        for cid in (app, sid):
            self.hook("poststop", cid)
            cg = self.cgroot / "cpuset" / cid
            for name in os.listdir(cg):
                os.unlink(cg / name)
            cg.rmdir()

    def cgroups(self) -> dict[str, CpuSet]:
        """Every container's cpuset.cpus as the pass left it: the "kernel" of this node."""
        root = self.cgroot / "cpuset"
        if not root.exists():
            return {}
        return {
            p.name: CpuSet.parse((p / "cpuset.cpus").read_text())
            for p in sorted(root.iterdir())
        }

    def allocations(self) -> dict[str, dict[str, object]]:
        """The store's allocations table, read with sqlite3 (not through vmpin)."""
        import sqlite3

        db = sqlite3.connect(f"file:{self.env['VMPIN_STATE_DIR']}/state.db?mode=ro", uri=True)
        try:
            rows = db.execute("SELECT sandbox_id, cpus, size, reason FROM allocations").fetchall()
        finally:
            db.close()
        return {r[0]: {"cpus": r[1], "size": r[2], "reason": r[3]} for r in rows if r[0]}
