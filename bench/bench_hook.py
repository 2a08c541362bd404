"""Time `vmpin hook` on every path against `<same python> -c pass`: hooks delay every start.

Paths (``--path``, or ``all``):

``runc``        a plain container's prestart on a node without VMs and no agent: the hook
                journals the event (a fresh bundle with CRI annotations and
                ``linux.resources.cpu.cpus``; the state's pid is a real process in a real
                cpuset cgroup).
``runc-agent``  the same with ``vmpin serve`` up: the hook journals and notifies the agent.
``kata``        a Kata container's prestart in a sandbox whose QEMU is real (started as Kata
                starts it, tests/support/qemu_util.py, ``-smp 2``, KVM when usable), no agent:
                the hook applies the journal and re-pins the sandbox in-process.  Each timed
                prestart (container on CPU 1) is followed by an untimed poststop, so every
                timed hook really moves QEMU's threads.
``kata-agent``  the same with ``vmpin serve`` up: the hook journals and sends the blocking
                notify; the agent's pass does the pinning (an agent that does not know
                ``wait`` makes the hook reconcile in-process).

Each measurement is a pair, hook and bare interpreter back to back (their order alternating),
so machine noise hits both; a series' figure is the median of its pair ratios, the path's
figure the median of all pair ratios.  Agents and QEMUs are started here and stopped by pid.

    python bench/bench_hook.py [--path all|PATH[,PATH...]] [--runs 100] [--series 3]
                               [--vmpin PATH] [--json] [--tmpdir DIR] [--no-code-cache]
                               [--containerd-spec]

The Kata sandbox has Kata's shared dir (``<publish>/<id>/mounts``), so each timed prestart
publishes the guest map as on a node (before 2026-11-25 it had none, and the Kata figures
left the map out).

Exits 1 when a path's ratio is above its limit (--limit, default 1.5; Kata without an agent
--kata-limit, default 2.0).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

CGROUP = "/sys/fs/cgroup/cpuset"
CRI = "io.kubernetes.cri."
PATHS = ("runc", "runc-agent", "kata", "kata-agent")


def find_vmpin(explicit: str | None) -> list[str]:
    if explicit:
        return [explicit]
    beside = Path(sys.executable).with_name("vmpin")
    if beside.exists():
        return [str(beside)]
    found = shutil.which("vmpin")
    return [found] if found else [sys.executable, "-m", "vmpin"]


def code_cache_file(vmpin: list[str]) -> str | None:
    """Where the hook's code cache (vmpin.lean.codecache) of this vmpin lives, if known."""
    python = vmpin[0] if len(vmpin) > 1 else None
    if python is None:
        with open(vmpin[0], "rb") as f:
            first = f.readline()
        python = first[2:].decode().strip() if first.startswith(b"#!") else sys.executable
    probe = ("import vmpin; from vmpin.lean.codecache import cache_path;"
             " print(cache_path(vmpin.__path__[0]))")  # fmt: skip
    # -I: not the package in the current directory (a checkout), the one vmpin runs
    out = subprocess.run([python, "-I", "-c", probe], capture_output=True, text=True)
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def timed(argv: list[str], stdin: bytes, env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(argv, input=stdin, env=env, capture_output=True)
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0 or proc.stderr:
        raise SystemExit(f"{argv} failed: {proc.returncode} {proc.stderr.decode().strip()}")
    return elapsed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Agent:
    """``vmpin serve`` for the agent paths; stopped by its pid (SIGTERM, then SIGKILL)."""

    def __init__(self, vmpin: list[str], env: dict[str, str], state_dir: Path, log: Path):
        self.sock = state_dir / "control.sock"
        self._log = open(log, "ab")  # noqa: SIM115 (closed in stop())
        self.proc = subprocess.Popen(
            [*vmpin, "serve", "--interval", "3600", "--metrics-port", str(free_port())],
            env=env, stdout=subprocess.DEVNULL, stderr=self._log,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while not self._answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"vmpin serve did not come up: {log.read_text()}")
            time.sleep(0.05)

    def _answers(self) -> bool:
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(2)
                s.connect(str(self.sock))
                s.sendall(b'{"op":"status"}\n')
                return s.recv(65536).endswith(b"\n")
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


def containerd_members() -> dict[str, object]:
    """What containerd's CRI writes into a container's config.json beside the annotations
    and resources (the process, root, mounts, namespaces, masked paths and the
    RuntimeDefault seccomp profile), in its sizes: ~10 KiB in all, where the bare spec is
    ~0.4 KiB.  Synthetic and deterministic (the profile's ~370 syscall names are made up)."""
    pod = "/var/lib/kubelet/pods/0f3c1a7e-4b2d-4e8a-9c1f-2a6b7d8e9f00"
    caps = [f"CAP_{name}" for name in ("CHOWN", "DAC_OVERRIDE", "FSETID", "FOWNER", "MKNOD",
            "NET_RAW", "SETGID", "SETUID", "SETFCAP", "SETPCAP", "NET_BIND_SERVICE",
            "SYS_CHROOT", "KILL", "AUDIT_WRITE")]  # fmt: skip
    mounts = [{"destination": d, "type": t, "source": t, "options": ["nosuid", "noexec"]}
              for d, t in (("/proc", "proc"), ("/dev", "tmpfs"), ("/dev/pts", "devpts"),
                           ("/dev/mqueue", "mqueue"), ("/sys", "sysfs"),
                           ("/sys/fs/cgroup", "cgroup"))]  # fmt: skip
    binds = ("/etc/hosts", "/dev/termination-log", "/etc/hostname", "/etc/resolv.conf",
             "/dev/shm", "/var/run/secrets/kubernetes.io/serviceaccount")  # fmt: skip
    mounts += [{"destination": d, "type": "bind", "source": f"{pod}/volumes/{i}{d}",
                "options": ["rbind", "rprivate", "rw"]} for i, d in enumerate(binds)]
    syscalls: list[dict[str, object]] = [
        {"names": [f"syscall_{i:03d}" for i in range(370)], "action": "SCMP_ACT_ALLOW"}]
    syscalls += [{"names": ["personality"], "action": "SCMP_ACT_ALLOW",
                  "args": [{"index": 0, "value": v, "op": "SCMP_CMP_EQ"}]}
                 for v in (0, 8, 131072, 131080, 4294967295)]  # fmt: skip
    return {
        "process": {"user": {"uid": 0, "gid": 0}, "args": ["/bin/sh", "-c", "sleep infinity"],
                    "env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]
                    + [f"KUBERNETES_SERVICE_{i}=10.96.0.{i}" for i in range(12)],
                    "cwd": "/", "capabilities": {k: caps for k in ("bounding", "effective",
                                                                   "permitted")},
                    "noNewPrivileges": True, "oomScoreAdj": 1000},
        "root": {"path": "rootfs"},
        "mounts": mounts,
        "linux": {
            "cgroupsPath": "kubepods-besteffort-pod0f3c1a7e.slice:cri-containerd:0123abcd",
            "namespaces": [{"type": t} for t in ("pid", "ipc", "uts", "mount", "network")],
            "maskedPaths": ["/proc/acpi", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
                            "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug",
                            "/proc/scsi", "/sys/firmware"],
            "readonlyPaths": ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys",
                              "/proc/sysrq-trigger"],
            "seccomp": {"defaultAction": "SCMP_ACT_ERRNO", "architectures": [
                "SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"], "syscalls": syscalls},
        },
    }  # fmt: skip


def write_bundle(
    root: Path, cid: str, sandbox: str, cpus: str | None, containerd: bool = False
) -> tuple[Path, dict]:
    """A bundle whose config.json has the CRI annotations and, given ``cpus``, the CPU part
    of the resources; ``containerd``: also the rest of a spec as containerd's CRI writes it
    (:func:`containerd_members`: a hook reads config.json at every start)."""
    bundle = root / "bundles" / cid
    bundle.mkdir(parents=True)
    ann = {CRI + "container-type": "sandbox" if cid == sandbox else "container",
           CRI + "sandbox-id": sandbox, CRI + "sandbox-uid": f"uid-{sandbox}",
           CRI + "sandbox-name": f"pod-{sandbox}", CRI + "sandbox-namespace": "default",
           CRI + "container-name": "POD" if cid == sandbox else "app"}  # fmt: skip
    spec: dict[str, object] = {"ociVersion": "1.0.2", "annotations": ann, "linux": {}}
    if cpus is not None:
        spec["linux"] = {"resources": {"cpu": {"cpus": cpus, "mems": "0"}}}
    if containerd:
        members = containerd_members()
        linux: dict[str, object] = members.pop("linux")  # type: ignore[assignment]
        spec.update(members)
        spec["linux"] = {**linux, **spec["linux"]}  # type: ignore[dict-item]
    (bundle / "config.json").write_text(json.dumps(spec))
    return bundle, ann


def state(cid: str, pid: int | None, bundle: Path, ann: dict, kata: bool) -> bytes:
    doc: dict[str, object] = {"ociVersion": "" if kata else "1.0.2", "id": cid,
                              "status": "" if kata else "creating", "bundle": str(bundle),
                              "annotations": ann}  # fmt: skip
    if pid is not None:
        doc["pid"] = pid
    return json.dumps(doc).encode()


class Node(NamedTuple):
    """One path's node (:func:`hook_node`): its dirs, the hooks' environment, the process a
    container's state names (a Kata sandbox's QEMU, a runc container's sleeper) and the
    sandbox id ("" for runc: each container its own pod)."""

    work: Path
    env: dict[str, str]
    pid: int
    sid: str
    kata: bool


@contextlib.contextmanager
def hook_node(
    name: str,
    vmpin: list[str],
    tool: str,
    tmpdir: str | None = None,
    env: dict[str, str] | None = None,
    code_cache: bool = True,
) -> Iterator[Node]:
    """Set the node up for path ``name`` (:data:`PATHS`), yield it, take everything down
    again (by pid): this bench, bench_hook_ir and bench_hook_split measure the same node.

    ``tool`` names the work dir; ``env`` is added to the hooks' environment; ``code_cache``
    False removes the hook's code cache and keeps it from being written.  A Kata sandbox is
    a real QEMU with Kata's shared dir (``<publish>/<id>/mounts``: each prestart publishes
    the guest map as on a node), its sandbox container hooked; a runc container is a sleeper
    in a cpuset cgroup of its own.  The ``-agent`` paths have ``vmpin serve`` up."""
    work = Path(tempfile.mkdtemp(prefix=f"vmpin-{tool}-{name}-", dir=tmpdir))
    hook_env = dict(os.environ, VMPIN_STATE_DIR=str(work / "state"),
                    VMPIN_VM_DIR=str(work / "vm"), VMPIN_RUNC_ROOT=str(work / "runc"),
                    VMPIN_KUBELET_STATE=str(work / "none"),
                    VMPIN_PUBLISH_DIR=str(work / "publish"), VMPIN_LOG_LEVEL="WARNING",
                    **(env or {}))  # fmt: skip
    # As on a node, where nothing tells Python not to write bytecode: the first hooks (the
    # warm-up) write the hook's code cache and the timed ones use it.  ``code_cache`` False
    # removes it and keeps it from being written.
    hook_env.pop("PYTHONDONTWRITEBYTECODE", None)
    if not code_cache:
        hook_env["PYTHONDONTWRITEBYTECODE"] = "1"
        cache = code_cache_file(vmpin)
        if cache and os.path.exists(cache):
            os.unlink(cache)
    (work / "vm").mkdir()
    kata = name.startswith("kata")
    cleanup: list[Callable[[], object]] = []
    try:
        if kata:
            from tests.support.qemu_util import launch

            sid = f"bh{os.getpid()}{name.replace('-', '')}"
            q = launch(work / "vm", sid, smp=2, debug_threads=True)
            cleanup.append(q.kill)
            (work / "publish" / sid / "mounts").mkdir(parents=True)
            b, ann = write_bundle(work, sid, sid, None)
            for stage in ("prestart", "createRuntime", "poststart"):
                timed([*vmpin, "hook", "--strict", stage], state(sid, q.pid, b, ann, True),
                      hook_env)  # fmt: skip
            pid = q.pid
        else:
            cgroup = Path(CGROUP) / f"vmpin-{tool}-{os.getpid()}-{name}"
            if Path(CGROUP).is_dir():
                cgroup.mkdir()
                cleanup.append(cgroup.rmdir)  # (after the sleeper is gone: undone in reverse)
                (cgroup / "cpuset.mems").write_text("0")
                (cgroup / "cpuset.cpus").write_text("0")
            sleeper = subprocess.Popen(["sleep", "3600"])
            cleanup.append(lambda: (sleeper.kill(), sleeper.wait()))
            if cgroup.is_dir():
                (cgroup / "cgroup.procs").write_text(str(sleeper.pid))
            pid, sid = sleeper.pid, ""
        if name.endswith("-agent"):
            agent = Agent(vmpin, hook_env, work / "state", work / "agent.log")
            cleanup.append(agent.stop)
        yield Node(work, hook_env, pid, sid, kata)
    finally:
        for undo in reversed(cleanup):
            try:
                undo()
            except OSError as err:
                print(f"cleanup: {err}", file=sys.stderr)
        shutil.rmtree(work, ignore_errors=True)


def run_path(name: str, args: argparse.Namespace, vmpin: list[str]) -> dict[str, object]:
    """Set the node up for one path, time it, take everything down again (by pid)."""
    with hook_node(name, vmpin, "bench-hook", args.tmpdir, code_cache=args.code_cache) as node:
        return _time_path(name, args, vmpin, node)


def _time_path(
    name: str, args: argparse.Namespace, vmpin: list[str], node: Node
) -> dict[str, object]:
    """The path's figures on its node: pairs of a prestart and a bare interpreter."""
    work, env, pid, sid, kata = node
    hook = [*vmpin, "hook", "prestart"]
    bare = [sys.executable, "-c", "pass"]
    n = 0

    def one() -> tuple[float, float]:
        nonlocal n
        n += 1
        cid = f"ctr{n}"
        b, ann = write_bundle(work, cid, sid or f"pod{n}", "1" if kata else "0",
                              args.containerd_spec)
        doc = state(cid, pid, b, ann, kata)
        if n % 2:
            h = timed(hook, doc, env)
            t = timed(bare, b"", env)
        else:
            t = timed(bare, b"", env)
            h = timed(hook, doc, env)
        if kata:  # Kata's poststop names the sandbox; undo the pin (untimed)
            timed([*vmpin, "hook", "poststop"], state(sid, None, b, ann, True), env)
        return h, t

    for _ in range(args.warmup):
        one()
    series = []
    all_ratios: list[float] = []
    hooks: list[float] = []
    bares: list[float] = []
    for _ in range(args.series):
        pairs = [one() for _ in range(args.runs)]
        ratios = [h / t for h, t in pairs]
        all_ratios += ratios
        hooks += [h for h, _ in pairs]
        bares += [t for _, t in pairs]
        series.append(round(statistics.median(ratios), 3))
    limit = args.kata_limit if name == "kata" else args.limit
    ratio = statistics.median(all_ratios)
    cache = code_cache_file(vmpin)
    return {"path": name, "ratio": round(ratio, 3), "series": series,
            "hook_median_ms": round(statistics.median(hooks) * 1000, 2),
            "bare_median_ms": round(statistics.median(bares) * 1000, 2),
            "runs": args.runs, "limit": limit, "ok": ratio <= limit,
            "code_cache": bool(cache and os.path.exists(cache))}  # fmt: skip


def _paths(text: str) -> list[str]:
    """``--path``: ``all`` or a comma-separated list of paths, in the order given."""
    if text == "all":
        return list(PATHS)
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in PATHS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown path {', '.join(unknown) or repr(text)}: choose all or {', '.join(PATHS)}"
        )
    return names


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--path", type=_paths, default="all",
                    help=f"all, or one or more of {', '.join(PATHS)} (comma-separated)")
    ap.add_argument("--runs", type=int, default=100, help="pairs per series")
    ap.add_argument("--series", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--vmpin", help="path of the vmpin command (default: beside this python)")
    ap.add_argument("--limit", type=float, default=1.5)
    ap.add_argument("--kata-limit", type=float, default=2.0, help="Kata without an agent")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--containerd-spec", action="store_true",
                    help="the timed hooks' config.json as containerd's CRI writes one (~10 KiB:"
                    " process, mounts, seccomp profile), not the bare ~0.4 KiB spec")
    ap.add_argument("--no-code-cache", dest="code_cache", action="store_false",
                    help="time the hooks without their code cache (vmpin.lean.codecache)")
    ap.add_argument(
        "--tmpdir",
        help="where the state dir, the VM dir and Kata's shared dir go (default: the system's"
        " temp dir).  On a node they are under /run, a tmpfs; --tmpdir /dev/shm measures that,"
        " where a disk's fsyncs (journal, store, guest map) cost nothing",
    )
    args = ap.parse_args()
    vmpin = find_vmpin(args.vmpin)
    results = [run_path(p, args, vmpin) for p in args.path]
    if args.json:
        print(json.dumps({"python": sys.executable, "vmpin": vmpin, "tmpdir": args.tmpdir,
                          "paths": results}))
    else:
        for r in results:
            print(f"{r['path']:<11} ratio {r['ratio']:.2f} (series {r['series']}, limit "
                  f"{r['limit']}): hook {r['hook_median_ms']} ms, bare {r['bare_median_ms']} ms")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
