"""Real runc containers for tests: a busybox rootfs, bundles with vmpin's hooks, and cleanup.

Not a conftest: test modules that need runc import it and wrap :class:`RuncSession` in a
fixture of their own::

    @pytest.fixture
    def runc(paths, tmp_path):
        with RuncSession(paths, tmp_path) as session:
            yield session

Everything goes through ``runc --root <paths.runc_root>``, so tests never see (or touch) a
container of anyone else.  Cleanup is by what was created: the ids this session ran
(``runc delete -f``), their init pids (SIGKILL, only while ``/proc/PID/stat``'s start time
still matches), and the cgroup directories runc recorded for them.

Facts checked on this machine (runc 1.1.5, cgroup v1 cpuset, cgroupfs driver):

- with no ``linux.cgroupsPath`` the container's cgroup is ``<runc's own cgroup>/<id>`` in
  every hierarchy, i.e. ``/sys/fs/cgroup/cpuset/<id>`` when runc runs in the root cpuset;
- hooks get a clean environment (only the hook's ``env``) and the bundle as cwd;
- prestart, createRuntime and poststart see the container's host pid; createContainer runs
  in the container's namespaces before pivot_root and sees pid 1; poststop has no pid and
  runs at ``runc delete``;
- startContainer runs inside the container after pivot_root: its path must exist in the
  container's rootfs, and when it fails the container stops at once (``runc run -d`` still
  exits 0).  So vmpin's hook cannot be a startContainer hook: :data:`HOST_STAGES` leaves it
  out, and a test that wants all six stages gives startContainer ``/bin/true`` (busybox).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from tests.support.session import new_id as new_id  # ids name their creator (the sweep)
from vmpin.core.errors import ProcessGone
from vmpin.linux import procfs
from vmpin.linux.cgroups import cgroup_of_pid
from vmpin.linux.paths import ENVVARS, HostPaths
from vmpin.wire.hookevent import STAGES

REPO = Path(__file__).resolve().parents[2]
BUSYBOX = "/usr/bin/busybox"
#: the stages whose hooks run on the host side, where vmpin can run at all.
HOST_STAGES = tuple(s for s in STAGES if s != "startContainer")
#: applets the rootfs gets as symlinks to busybox.
APPLETS = ("sh", "sleep", "cat", "true", "false", "ls", "echo", "nproc", "taskset", "ps")

HookArgv = Callable[[str], Sequence[str]]


def runc_binary() -> str | None:
    return shutil.which("runc") or next(
        (p for p in ("/usr/sbin/runc", "/usr/bin/runc") if os.access(p, os.X_OK)), None
    )


def missing() -> str | None:
    """Why runc tests cannot run here, or None when they can."""
    if runc_binary() is None:
        return "runc is not installed"
    if not os.access(BUSYBOX, os.X_OK):
        return f"{BUSYBOX} is missing (apt-get install busybox-static)"
    if os.geteuid() != 0:
        return "runc containers need root"
    return None




# -- rootfs ---------------------------------------------------------------------------------
_ROOTFS: dict[str, Path] = {}


def build_rootfs(dest: Path) -> Path:
    """A minimal rootfs: the static busybox and symlinks for :data:`APPLETS`."""
    bindir = dest / "bin"
    bindir.mkdir(parents=True, exist_ok=True)
    shutil.copy2(BUSYBOX, bindir / "busybox")
    for applet in APPLETS:
        link = bindir / applet
        if not link.exists():
            link.symlink_to("busybox")
    return dest


def shared_rootfs(base: Path) -> Path:
    """One rootfs per test session (read-only in every bundle, so containers can share it).

    ``base`` is where to build it the first time, e.g. ``tmp_path_factory.getbasetemp()``.
    """
    key = "rootfs"
    if key not in _ROOTFS:
        _ROOTFS[key] = build_rootfs(Path(base) / "busybox-rootfs")
    return _ROOTFS[key]


# -- hooks ----------------------------------------------------------------------------------
def vmpin_argv(stage: str) -> list[str]:
    """``vmpin hook STAGE`` as an absolute argv a hook can exec with no PATH to search.

    The console script beside this interpreter (not a pyenv shim, which needs its own
    environment) when installed, else ``python -m vmpin``.
    """
    script = Path(sys.executable).with_name("vmpin")
    if script.exists():
        return [str(script), "hook", stage]
    return [sys.executable, "-m", "vmpin", "hook", stage]


def true_argv(stage: str) -> list[str]:
    """A hook that does nothing; ``/bin/true`` exists on the host and in the busybox rootfs."""
    return ["/bin/true", stage]


def hook_env(paths: HostPaths, extra: Mapping[str, str] | None = None) -> list[str]:
    """The environment of every hook: runc gives hooks nothing but this list."""
    env = {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        # So that `python -m vmpin` finds the package even when it is not installed.
        "PYTHONPATH": str(REPO),
    }
    env.update({var: getattr(paths, name) for name, var in ENVVARS.items()})
    env.update(extra or {})
    return [f"{k}={v}" for k, v in env.items()]


def hooks_section(
    argv: HookArgv,
    env: list[str],
    stages: Iterable[str] = HOST_STAGES,
    timeout: int | None = 30,
) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for stage in stages:
        args = list(argv(stage))
        hook: dict[str, Any] = {"path": args[0], "args": args, "env": env}
        if timeout:
            hook["timeout"] = timeout
        out[stage] = [hook]
    return out


# -- the session ----------------------------------------------------------------------------
class RuncError(RuntimeError):
    pass


class RuncSession:
    """Creates bundles and containers under one runc root; cleans up what it created."""

    def __init__(self, paths: HostPaths, workdir: Path, rootfs: Path | None = None) -> None:
        runc = runc_binary()
        if runc is None:
            raise RuncError("runc is not installed")
        self.runc = runc
        self.paths = paths
        self.workdir = Path(workdir)
        self.rootfs = rootfs if rootfs is not None else build_rootfs(self.workdir / "rootfs")
        #: id -> (init pid, its start time) for every container this session started.
        self.started: dict[str, tuple[int, int]] = {}
        #: id -> the cgroup directories runc recorded for it.
        self.cgroup_dirs: dict[str, list[str]] = {}
        self.created: list[str] = []

    # context manager
    def __enter__(self) -> RuncSession:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cleanup()

    # commands
    def cmd(self, *args: str, check: bool = True, timeout: float = 60) -> str:
        """Run ``runc --root ROOT ARGS``; its stdout.  Output goes through files, not pipes:
        a detached container inherits runc's stdio and would hold a pipe open forever."""
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            proc = subprocess.run(
                [self.runc, "--root", self.paths.runc_root, *args],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                timeout=timeout,
                cwd=self.workdir,
            )
            out.seek(0)
            err.seek(0)
            stdout, stderr = out.read().decode(), err.read().decode()
        if check and proc.returncode != 0:
            raise RuncError(f"runc {' '.join(args)} failed ({proc.returncode}): {stderr.strip()}")
        return stdout

    def bundle(
        self,
        cid: str,
        cpus: str | None = None,
        mems: str | None = "0",
        annotations: Mapping[str, str] | None = None,
        hooks: HookArgv | None = vmpin_argv,
        stages: Iterable[str] = HOST_STAGES,
        env: Mapping[str, str] | None = None,
        args: Sequence[str] = ("sleep", "3600"),
        cgroups_path: str | None = None,
    ) -> Path:
        """A bundle for ``cid``: ``runc spec`` edited for a detached, hook-carrying container.

        ``hooks`` maps a stage to its argv (default: vmpin's hook); None leaves hooks out.
        ``env`` is added to every hook's environment after the VMPIN_* variables.
        """
        bundle = self.workdir / "bundles" / cid
        bundle.mkdir(parents=True)
        subprocess.run([self.runc, "spec"], cwd=bundle, check=True)
        config_path = bundle / "config.json"
        config = json.loads(config_path.read_text())
        config["root"] = {"path": str(self.rootfs), "readonly": True}
        config["process"]["args"] = list(args)
        config["process"]["terminal"] = False
        linux = config.setdefault("linux", {})
        if cpus is not None:
            cpu = linux.setdefault("resources", {}).setdefault("cpu", {})
            cpu["cpus"] = cpus
            if mems is not None:
                cpu["mems"] = mems
        if cgroups_path is not None:
            linux["cgroupsPath"] = cgroups_path
        if annotations:
            config["annotations"] = dict(annotations)
        if hooks is not None:
            config["hooks"] = hooks_section(hooks, hook_env(self.paths, env), stages)
        config_path.write_text(json.dumps(config, indent=2))
        return bundle

    def run(self, cid: str, bundle: Path | None = None, **bundle_args: Any) -> int:
        """``runc run -d``: the container's init pid.  Makes a bundle unless given one."""
        if bundle is None:
            bundle = self.bundle(cid, **bundle_args)
        self.created.append(cid)
        self.cmd("run", "-d", "--bundle", str(bundle), cid)
        self._remember(cid)
        if cid not in self.started:
            raise RuncError(f"runc ran {cid} but its state names no init pid")
        return self.started[cid][0]

    def _remember(self, cid: str) -> None:
        state_file = Path(self.paths.runc_root) / cid / "state.json"
        try:
            state = json.loads(state_file.read_text())
        except (OSError, ValueError):
            return
        pid = state.get("init_process_pid")
        if isinstance(pid, int) and pid > 0:
            self.started[cid] = (pid, int(state.get("init_process_start", 0)))
        dirs = state.get("cgroup_paths") or {}
        self.cgroup_dirs[cid] = sorted(set(dirs.values()))

    def state(self, cid: str) -> dict[str, Any]:
        result: dict[str, Any] = json.loads(self.cmd("state", cid))
        return result

    def update(self, cid: str, cpus: str, mems: str | None = None) -> None:
        extra = ["--cpuset-mems", mems] if mems is not None else []
        self.cmd("update", "--cpuset-cpus", cpus, *extra, cid)

    def delete(self, cid: str) -> None:
        """``runc delete -f``: kills the container and runs its poststop hooks."""
        self.cmd("delete", "-f", cid)
        self._reap(cid)

    def _reap(self, cid: str) -> None:
        pid, start = self.started.pop(cid, (0, 0))
        if pid and _start_time(pid) == start:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for path in self.cgroup_dirs.pop(cid, []):
            # runc delete removes them; this is for a delete that failed half-way.
            with contextlib.suppress(OSError):
                os.rmdir(path)
        if cid in self.created:
            self.created.remove(cid)

    def cleanup(self) -> None:
        """Delete every container this session created; kill their pids; remove cgroups."""
        for cid in list(self.created):
            self.cmd("delete", "-f", cid, check=False)
            self._reap(cid)


def _start_time(pid: int) -> int | None:
    """The pid's start time, so a pid reused by another process is never killed."""
    try:
        return procfs.start_time("/proc", pid)
    except ProcessGone:
        return None


def own_cpuset_cgroup() -> str:
    """This process's cpuset cgroup: where runc nests the cgroups of cgroupsPath-less containers."""
    ref = cgroup_of_pid(HostPaths(), os.getpid())
    return ref.rel if ref is not None else "/"
