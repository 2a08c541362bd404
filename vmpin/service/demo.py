"""``vmpin demo``: the job vmpin does, shown on this machine in a minute, then cleaned away.

A newcomer's first question is what vmpin is for, and the host's topology does not answer it.
This starts what a mixed node runs -- a throwaway QEMU the way Kata starts it (``-name
sandbox-<id>``, pidfile and QMP socket in a VM dir, no names on its threads) and a runc
container whose config.json runs vmpin's hooks -- then plays the runtimes' part: Kata's host
hooks for the sandbox and its container, CRI UpdateContainerResources as ``vmpin update``,
and ``vmpin audit``.  Each QEMU thread's and the container's affinity is shown before vmpin,
after its pin and after the update.

Nothing of the node is touched: the demo has its own state dir, VM dir and runc root in a
temporary directory, and every process it starts is killed by its pid (checked against its
start time) and every cgroup runc made is removed -- also on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from vmpin.core.cpuset import CpuSet
from vmpin.core.errors import HostError, SpecError, VmpinError
from vmpin.linux import procfs
from vmpin.linux.paths import HostPaths
from vmpin.linux.sysfs import online_text
from vmpin.reconcile.observe import pid_alive

CRI = "io.kubernetes.cri."
#: what the demo runs, and the Debian packages that bring each (README's first command)
NEEDS = {"qemu-system-x86_64": "qemu-system-x86", "runc": "runc"}
BUSYBOX = ("/bin/busybox", "/usr/bin/busybox")
#: the host's own roots: the demo's processes and CPUs are the host's (its state is not)
HOST = HostPaths()


class Demo:
    """One run: its temporary roots, what it started, and how to take it all down."""

    def __init__(self, out: Any = None) -> None:
        self.out = out or sys.stdout
        self.tmp = Path(tempfile.mkdtemp(prefix="vmpin-demo-"))
        self.sid = f"demo-{uuid.uuid4().hex[:8]}"
        self.cid = f"{self.sid}-ctr"
        self.runc_id = f"{self.sid}-runc"
        self.state, self.vm_dir = self.tmp / "state", self.tmp / "vm"
        self.runc_root = self.tmp / "runc"
        self.env = {
            **os.environ,
            "VMPIN_STATE_DIR": str(self.state),
            "VMPIN_VM_DIR": str(self.vm_dir),
            "VMPIN_RUNC_ROOT": str(self.runc_root),
            "VMPIN_KUBELET_STATE": str(self.tmp / "no-kubelet"),
            "VMPIN_PUBLISH_DIR": str(self.tmp / "shared"),
            "VMPIN_LIBVIRT": "none",
            "KUBECONFIG": str(self.tmp / "no-kubeconfig"),
        }
        self.qemu: tuple[int, int] | None = None  # (pid, start time)
        self.runc_started = False

    # -- the run ---------------------------------------------------------------------------
    def run(self) -> int:
        online = _online()
        last, rest = online.sorted()[-1], online.sorted()[:-1] or online.sorted()
        pool = CpuSet(rest)
        self.say(f"vmpin demo: a Kata-style sandbox and a runc container on CPUs {online}"
                 f" (scratch state in {self.tmp})")  # fmt: skip
        qpid = self.start_qemu()
        rpid = self.start_runc(pool)
        before = self.affinities(qpid, rpid)
        self.kata_hooks(qpid, str(last))
        self.say(f"\n1. created: Kata's hooks for sandbox {self.sid} and container {self.cid}"
                 f" (CPUs {last}); runc's own hooks for {self.runc_id} (CPUs {pool})")  # fmt: skip
        pinned = self.affinities(qpid, rpid)
        wide = online.to_list()
        self.vmpin("update", self.cid, "--cpuset-cpus", wide)
        self.say(f"2. kubelet moves {self.cid} to CPUs {wide} (CRI UpdateContainerResources,"
                 " here `vmpin update`): vmpin re-pins the sandbox")  # fmt: skip
        updated = self.affinities(qpid, rpid)
        roles = self.roles()
        self.say("")
        rows = [["thread", "role", "before vmpin", "after create", "after update"]]
        for key in sorted(before, key=lambda k: (k[0] != "qemu", k[1])):
            what, tid = key
            role = roles.get(tid, "container" if what == "runc" else "?")
            rows.append([f"{what} {tid}", role, before[key], pinned.get(key, "-"),
                         updated.get(key, "-")])  # fmt: skip
        self.table(rows)
        audit = self.vmpin("audit", "--json", check=False)
        result: dict[str, Any] = json.loads(audit.stdout) if audit.stdout.strip() else {}
        n = len(result.get("violations") or [])
        self.say(f"\n3. vmpin audit: {'ok' if result.get('ok') else 'NOT ok'}"
                 f" ({n} violation{'s' if n != 1 else ''})")  # fmt: skip
        return 0 if audit.returncode == 0 else 1

    # -- the pieces ------------------------------------------------------------------------
    def say(self, line: str) -> None:
        print(line, file=self.out, flush=True)

    def table(self, rows: list[list[str]]) -> None:
        widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
        for r in rows:
            self.say("  ".join(str(v).ljust(w) for v, w in zip(r, widths, strict=True)).rstrip())

    def vmpin(self, *args: str, stdin: str | None = None, check: bool = True
              ) -> subprocess.CompletedProcess[str]:  # fmt: skip
        proc = subprocess.run([*_vmpin_argv(), *args], input=stdin, capture_output=True,
                              text=True, env=self.env, timeout=120, check=False)  # fmt: skip
        if check and proc.returncode != 0:
            raise HostError(f"vmpin {' '.join(args)} failed: {proc.stderr.strip()}")
        return proc

    def start_qemu(self) -> int:
        d = self.vm_dir / self.sid
        d.mkdir(parents=True)
        tries = [("kvm", "host"), ("kvm", "host,-arch-capabilities"), ("tcg", "max")]
        if not _kvm_usable():
            tries = tries[2:]
        err = ""
        for accel, cpu in tries:
            argv = [shutil.which("qemu-system-x86_64") or "qemu-system-x86_64",
                    "-name", f"sandbox-{self.sid}", "-machine", f"q35,accel={accel}",
                    "-cpu", cpu, "-smp", "1", "-m", "128", "-nodefaults", "-display", "none",
                    "-object", "iothread,id=io0",
                    "-qmp", f"unix:{d}/qmp.sock,server=on,wait=off", "-pidfile", f"{d}/pid",
                    "-daemonize"]  # fmt: skip
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
            if proc.returncode == 0:
                pid = int((d / "pid").read_text().strip())
                self.qemu = (pid, procfs.start_time(HOST.proc, pid))
                self.say(f"  QEMU pid {pid} ({accel}), started as Kata starts it")
                return pid
            lines = proc.stderr.strip().splitlines()
            err = lines[-1] if lines else f"exit {proc.returncode}"
        raise HostError(f"QEMU did not start: {err}")

    def start_runc(self, cpus: CpuSet) -> int:
        rootfs = self.tmp / "rootfs"
        (rootfs / "bin").mkdir(parents=True)
        busybox = next(p for p in BUSYBOX if os.path.exists(p))
        shutil.copy2(busybox, rootfs / "bin" / "busybox")
        for applet in ("sh", "sleep"):
            (rootfs / "bin" / applet).symlink_to("busybox")
        bundle = self.tmp / "bundles" / self.runc_id
        bundle.mkdir(parents=True)
        subprocess.run(["runc", "spec"], cwd=bundle, check=False, capture_output=True)
        config = json.loads((bundle / "config.json").read_text())
        config["root"] = {"path": str(rootfs), "readonly": True}
        config["process"].update(args=["sleep", "600"], terminal=False)
        config["linux"].setdefault("resources", {})["cpu"] = {"cpus": cpus.to_list(), "mems": "0"}
        env = [f"{k}={v}" for k, v in self.env.items() if k.startswith("VMPIN_")]
        env.append("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
        if os.environ.get("PYTHONPATH"):
            env.append(f"PYTHONPATH={os.environ['PYTHONPATH']}")
        argv = _vmpin_argv()
        config["hooks"] = {
            stage: [{"path": argv[0], "args": [*argv, "hook", stage], "env": env}]
            for stage in ("prestart", "createRuntime", "poststart", "poststop")
        }
        (bundle / "config.json").write_text(json.dumps(config))
        self.runc_started = True
        # a detached container inherits runc's stdio: a pipe here would never reach EOF
        with tempfile.TemporaryFile() as err:
            proc = subprocess.run(["runc", "--root", str(self.runc_root), "run", "-d",
                                   "--bundle", str(bundle), self.runc_id], check=False,
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                  stderr=err, timeout=60)  # fmt: skip
            err.seek(0)
            why = err.read().decode(errors="replace").strip()
        if proc.returncode != 0:
            raise HostError(f"runc could not run the demo's container: {why}")
        state = json.loads((self.runc_root / self.runc_id / "state.json").read_text())
        pid = int(state["init_process_pid"])
        self.say(f"  runc container {self.runc_id}: pid {pid}, its hooks in config.json")
        return pid

    def kata_hooks(self, qpid: int, cpus: str) -> None:
        """What Kata's runtime does on the host: hooks with the sandbox's and the container's
        bundles (containerd's CRI annotations), poststart carrying the sandbox id."""
        for cid, ctype, name, spec_cpus in ((self.sid, "sandbox", None, None),
                                            (self.cid, "container", "app", cpus)):  # fmt: skip
            ann = {CRI + "container-type": ctype, CRI + "sandbox-id": self.sid,
                   CRI + "sandbox-uid": f"uid-{self.sid}", CRI + "sandbox-name": "demo",
                   CRI + "sandbox-namespace": "default"}  # fmt: skip
            if name:
                ann[CRI + "container-name"] = name
            b = self.tmp / "bundles" / cid
            b.mkdir(parents=True)
            linux = {"resources": {"cpu": {"cpus": spec_cpus}}} if spec_cpus else {}
            (b / "config.json").write_text(json.dumps({"annotations": ann, "linux": linux}))
            for stage, sid in (("prestart", cid), ("createRuntime", cid),
                               ("poststart", self.sid)):  # fmt: skip
                state = {"ociVersion": "", "id": sid, "status": "", "pid": qpid,
                         "bundle": str(b), "annotations": ann}  # fmt: skip
                self.vmpin("hook", "--strict", stage, stdin=json.dumps(state))

    def affinities(self, qpid: int, rpid: int) -> dict[tuple[str, int], str]:
        out: dict[tuple[str, int], str] = {}
        for what, pid in (("qemu", qpid), ("runc", rpid)):
            for tid in procfs.tids(HOST.proc, pid):
                try:
                    out[(what, tid)] = procfs.affinity(HOST.proc, pid, tid).to_list()
                except VmpinError:
                    continue
        return out

    def roles(self) -> dict[int, str]:
        shown = json.loads(self.vmpin("show", self.sid, "--json").stdout)
        return {
            t["tid"]: t["role"] + (f" {t['index']}" if t["index"] is not None else "")
            for t in shown["threads"]
        }

    # -- taking it down --------------------------------------------------------------------
    def cleanup(self) -> list[str]:
        done = []
        if self.runc_started:
            proc = subprocess.run(["runc", "--root", str(self.runc_root), "delete", "-f",
                                   self.runc_id], capture_output=True, text=True,
                                  timeout=60, check=False)  # fmt: skip
            if proc.returncode == 0:
                done.append(f"runc container {self.runc_id} deleted (and its cgroup)")
            else:
                done.append(f"runc container {self.runc_id}: {proc.stderr.strip()}")
        if self.qemu is not None:
            pid, start = self.qemu
            if pid_alive(HOST, pid, start):
                os.kill(pid, signal.SIGKILL)
                deadline = time.monotonic() + 10
                while pid_alive(HOST, pid, start) and time.monotonic() < deadline:
                    time.sleep(0.02)
            done.append(f"QEMU pid {pid} killed")
        shutil.rmtree(self.tmp, ignore_errors=True)
        done.append(f"{self.tmp} removed")
        return done


def _online() -> CpuSet:
    return CpuSet.parse(online_text(HOST.sys) or "0")


def _kvm_usable() -> bool:
    try:
        os.close(os.open("/dev/kvm", os.O_RDWR))
    except OSError:
        return False
    return True


def _vmpin_argv() -> list[str]:
    beside = Path(sys.executable).with_name("vmpin")
    return [str(beside)] if beside.exists() else [sys.executable, "-m", "vmpin"]


def missing() -> str | None:
    """What this machine lacks for the demo, as one line (None: nothing)."""
    if os.geteuid() != 0:
        return "the demo starts a VM and a container and pins them: run it as root"
    lacking = [pkg for exe, pkg in NEEDS.items() if shutil.which(exe) is None]
    if not any(os.path.exists(p) for p in BUSYBOX):
        lacking.append("busybox-static")
    if lacking:
        return f"the demo needs {', '.join(lacking)}: apt-get install {' '.join(lacking)}"
    if not os.path.isdir("/sys/fs/cgroup"):
        return "no cgroup filesystem at /sys/fs/cgroup: runc cannot run here"
    return None


@contextmanager
def _interruptible() -> Iterator[None]:
    """SIGTERM as Ctrl-C: either way the demo cleans up before it exits."""

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def main() -> int:
    why = missing()
    if why:
        raise SpecError(why)
    demo = Demo()
    code = 130
    try:
        with _interruptible():
            code = demo.run()
    except KeyboardInterrupt:
        demo.say("\ninterrupted")
    except (OSError, subprocess.SubprocessError, ValueError) as err:
        raise HostError(f"demo: {err}") from None
    finally:
        for line in demo.cleanup():
            demo.say(f"cleaned up: {line}")
    return code
