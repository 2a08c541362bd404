"""The guest side (vmpin.guest), run for real: a runc container stands in for the guest's.

Inside a Kata VM the agent runs ``vmpin guest hook STAGE`` with the container's OCI state on
stdin; here runc plays the agent (a container started without any CPU set, so on every CPU,
as Kata's guest containers are) and a plain process plays a container without a cgroup of its
own.  Every check reads the kernel's answer: the cgroup's ``cpuset.cpus`` and each task's
``/proc/<pid>/task/<tid>/status`` ``Cpus_allowed_list``.

The last test runs the whole channel: a real QEMU sandbox in a Store, ``vmpin reconcile
--once`` publishing its map, ``vmpin guest-map``, and the guest hook applying the file.

Everything a test starts it stops by the pid it started (runc containers through
tests/runc_util.py, QEMU through tests/qemu_util.py); cgroups it makes it removes.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from tests import runc_util
from tests.conftest import vmpin_cmd
from tests.runc_util import RuncSession, new_id
from vmpin import guest
from vmpin.paths import HostPaths

REPO = Path(__file__).resolve().parent.parent
CPUSET = Path("/sys/fs/cgroup/cpuset")
NCPUS = len(os.sched_getaffinity(0))

_MISSING = runc_util.missing()
needs_runc = pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))
needs_two_cpus = pytest.mark.skipif(NCPUS < 2, reason="needs 2 CPUs")
needs_v1_cpuset = pytest.mark.skipif(
    not (CPUSET / "cpuset.cpus").exists() or os.geteuid() != 0,
    reason="needs root and a cgroup v1 cpuset hierarchy at /sys/fs/cgroup/cpuset",
)


# -- helpers -----------------------------------------------------------------------------------
def write_map(path: Path, entries: Mapping[str, str], *, exact: bool = True, **extra: Any) -> Path:
    """A published map in format 1, as vmpin.publish writes it (only what the hook reads)."""
    doc = {
        "version": 1,
        "sandbox": "sb",
        "generation": 1,
        "mode": "1:1" if exact else "float",
        "nvcpus": NCPUS,
        "siblings": [],
        "containers": {
            cid: {
                "container": cid,
                "sandbox": "sb",
                "host_cpus": cpus,
                "guest_cpus": cpus,
                "exact": exact,
                "mode": "1:1" if exact else "float",
                "reason": "test" if exact else "float plan: vCPUs are not tied to host CPUs",
                "generation": 1,
            }
            for cid, cpus in entries.items()
        },
    }
    doc.update(extra)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))
    return path


def hook(
    state: Mapping[str, Any] | str | bytes,
    map_path: Path | str,
    *args: str,
    stage: str = "prestart",
    env: Mapping[str, str] | None = None,
    cmd: list[str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``vmpin guest hook STAGE ARGS`` with ``state`` on stdin, as the kata-agent does."""
    data = state if isinstance(state, str | bytes) else json.dumps(state)
    e = dict(os.environ)
    e["VMPIN_GUEST_MAP"] = str(map_path)
    e.update(env or {})
    argv = [*(cmd or vmpin_cmd()), "guest", "hook", stage, *args]
    return subprocess.run(
        argv,
        input=data if isinstance(data, str) else data.decode(),
        capture_output=True,
        text=True,
        env=e,
        timeout=60,
    )


def allowed(tid: int) -> str:
    """The kernel's Cpus_allowed_list of one task (``/proc/TID`` serves any thread)."""
    for line in Path(f"/proc/{tid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return line.split(":", 1)[1].strip()
    raise AssertionError(f"no Cpus_allowed_list for {tid}")


def threads_of(pid: int) -> list[int]:
    return sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))


def cpuset_dir(pid: int) -> Path:
    """The v1 cpuset cgroup directory of ``pid``."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, rel = line.split(":", 2)
        if "cpuset" in controllers.split(","):
            return CPUSET / rel.lstrip("/")
    raise AssertionError(f"pid {pid} has no v1 cpuset line")


def cgroup_tasks(d: Path) -> list[int]:
    return sorted(int(t) for t in (d / "tasks").read_text().split())


def wait_until(pred: Any, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return bool(pred())


def one_line(proc: subprocess.CompletedProcess[str]) -> str:
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert proc.stdout == ""
    assert lines[0].startswith("vmpin guest hook ")
    return lines[0]


@pytest.fixture
def runc(
    paths: HostPaths, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RuncSession]:
    if _MISSING is not None:
        pytest.skip(_MISSING)
    rootfs = runc_util.shared_rootfs(tmp_path_factory.getbasetemp())
    with RuncSession(paths, tmp_path, rootfs) as session:
        yield session


#: a container with several tasks: its shell and two sleeps (the cgroup holds all three).
BUSY = ("sh", "-c", "sleep 3600 & sleep 3600 & wait")


def start_container(runc: RuncSession, cid: str, args: tuple[str, ...] = BUSY) -> int:
    """A container WITHOUT cpus in its spec: it starts on every CPU, as in a Kata guest."""
    pid = runc.run(cid, cpus=None, hooks=None, args=args)
    cg = cpuset_dir(pid)
    assert wait_until(lambda: len(cgroup_tasks(cg)) >= (3 if args == BUSY else 1))
    assert (cg / "cpuset.cpus").read_text().strip() == f"0-{NCPUS - 1}"
    return pid


@contextlib.contextmanager
def plain_process() -> Iterator[tuple[int, int]]:
    """A multi-threaded process with a child, in this test's own cgroups: (pid, child pid)."""
    code = (
        "import subprocess, threading, time\n"
        "for _ in range(3):\n"
        "    threading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n"
        "child = subprocess.Popen(['sleep', '600'])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child = 0
    try:
        assert proc.stdout is not None
        child = int(proc.stdout.readline())
        yield proc.pid, child
    finally:
        if child:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        proc.kill()
        proc.wait(10)


# -- the reader (the contract's guest half) ---------------------------------------------------
@pytest.mark.parametrize(
    ("text", "cpus"),
    [("", set()), ("0", {0}), ("0-3,8", {0, 1, 2, 3, 8}), (" 1\n", {1}), ("2-2", {2})],
)
def test_parse_cpus(text: str, cpus: set[int]) -> None:
    assert guest.parse_cpus(text) == frozenset(cpus)


@pytest.mark.parametrize("bad", ["0,", ",3", "1-", "3-0", "0--3", "-1", "a", "0x3", "1 2"])
def test_parse_cpus_rejects(bad: str) -> None:
    with pytest.raises(guest.GuestError):
        guest.parse_cpus(bad)


def test_format_cpus() -> None:
    assert guest.format_cpus(frozenset({0, 1, 2, 5, 7, 8})) == "0-2,5,7-8"
    assert guest.format_cpus(frozenset()) == ""


def test_read_map_and_lookup(tmp_path: Path) -> None:
    m = guest.read_map(str(write_map(tmp_path / "m.json", {"c": "1-2"}, future_key=1)))
    e = guest.lookup(m, "c")
    assert e is not None and e.guest_cpus == frozenset({1, 2}) and e.exact
    assert guest.lookup(m, "other") is None


def test_parse_args_env_and_order() -> None:
    env = {"VMPIN_GUEST_MAP": "/m", "VMPIN_GUEST_PROC_ROOT": "/p", "VMPIN_GUEST_CGROUP_ROOT": "/c"}
    o = guest.parse_args(["--strict", "prestart", "--wait=1.5", "-v"], env)
    assert (o.stage, o.strict, o.verbose, o.wait) == ("prestart", True, True, 1.5)
    assert (o.map_path, o.proc, o.cgroup_root) == ("/m", "/p", "/c")
    o = guest.parse_args(["poststart", "--map", "/x", "--proc-root", "/q"], env)
    assert (o.map_path, o.proc, o.cgroup_root) == ("/x", "/q", "/c")
    d = guest.parse_args(["poststop"], {})
    assert (d.map_path, d.proc, d.cgroup_root) == (
        guest.DEFAULT_GUEST_MAP,
        "/proc",
        "/sys/fs/cgroup",
    )


# -- lean and self-contained ------------------------------------------------------------------
def test_hook_path_imports_nothing_heavy() -> None:
    """What `vmpin guest hook` loads: no store/sqlite3, typer, pydantic, psutil, no vmpin core."""
    code = (
        "import io, json, sys\n"
        "sys.stdin = io.TextIOWrapper(io.BytesIO(b'{}'))\n"
        "from vmpin.entry import main\n"
        "rc = main(['guest', 'hook', 'poststop'])\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    mods = set(json.loads(out.stdout.splitlines()[-1]))
    for heavy in ("sqlite3", "typer", "click", "pydantic", "psutil", "kubernetes", "libvirt"):
        assert heavy not in mods
    assert {m for m in mods if m.startswith("vmpin")} == {"vmpin", "vmpin.entry", "vmpin.guest"}


@needs_two_cpus
def test_runs_as_a_single_copied_file(tmp_path: Path) -> None:
    """guest.py alone (no vmpin package, no site-packages) pins a process: a guest image
    needs only python3 and this one file, called as kata-agent or the shipped wrapper does."""
    script = tmp_path / "vmpin-guest.py"
    shutil.copy(REPO / "vmpin" / "guest.py", script)
    m = write_map(tmp_path / "map.json", {"solo": "1"})
    with plain_process() as (pid, _):
        for argv in (["prestart"], ["guest", "hook", "poststart"]):
            proc = subprocess.run(
                [sys.executable, "-I", "-S", str(script), *argv],
                input=json.dumps({"id": "solo", "pid": pid}),
                capture_output=True,
                text=True,
                env={"VMPIN_GUEST_MAP": str(m), "VMPIN_GUEST_CGROUP_ROOT": str(tmp_path)},
                timeout=60,
            )
            assert (proc.returncode, proc.stderr) == (0, "")
            assert {allowed(t) for t in threads_of(pid)} == {"1"}


# -- the cgroup path, on real runc containers ---------------------------------------------------
@needs_runc
@needs_two_cpus
@pytest.mark.runc
@pytest.mark.parametrize("vcpus", ["1", "0"])
def test_pins_container_cgroup(runc: RuncSession, tmp_path: Path, vcpus: str) -> None:
    cid = new_id("vmpin-guest")
    pid = start_container(runc, cid)
    m = write_map(tmp_path / "map.json", {cid: vcpus, "other": "0-1"})
    state = runc.state(cid)  # runc's own OCI state: id, pid, bundle, status ...
    assert state["pid"] == pid
    proc = hook(state, m)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")
    cg = cpuset_dir(pid)
    assert (cg / "cpuset.cpus").read_text().strip() == vcpus
    tasks = cgroup_tasks(cg)
    assert len(tasks) >= 3
    assert {t: allowed(t) for t in tasks} == {t: vcpus for t in tasks}
    assert {t: allowed(t) for t in threads_of(pid)} == {t: vcpus for t in threads_of(pid)}
    # new processes in the container start pinned too: the cgroup, not only the affinity
    runc.cmd("exec", "-d", cid, "sleep", "3600")
    assert wait_until(lambda: len(cgroup_tasks(cg)) > len(tasks))
    assert {allowed(t) for t in cgroup_tasks(cg)} == {vcpus}


@needs_runc
@needs_two_cpus
@pytest.mark.runc
def test_as_a_real_runc_prestart_hook(runc: RuncSession, tmp_path: Path) -> None:
    """runc runs the guest hook itself at prestart (as kata-agent does in the guest), with
    --strict: had it failed, the container would not have started."""
    cid = new_id("vmpin-guest")
    m = write_map(tmp_path / "map.json", {cid: "1"})

    def argv(stage: str) -> list[str]:
        return [*runc_util.vmpin_argv(stage)[:-2], "guest", "hook", "--strict", stage]

    pid = runc.run(
        cid,
        cpus=None,
        hooks=argv,
        stages=("prestart", "poststart", "poststop"),
        env={"VMPIN_GUEST_MAP": str(m)},
        args=BUSY,
    )
    cg = cpuset_dir(pid)
    assert (cg / "cpuset.cpus").read_text().strip() == "1"
    assert wait_until(lambda: len(cgroup_tasks(cg)) >= 3)
    assert {allowed(t) for t in cgroup_tasks(cg)} == {"1"}
    runc.delete(cid)  # poststop: nothing to undo, and it must not fail


@needs_v1_cpuset
@needs_two_cpus
def test_parent_is_not_widened_silently(tmp_path: Path) -> None:
    """cgroup v1 keeps a child within its parent (EACCES): the hook says so and changes
    nothing; ``--widen-parents`` widens the parent and says that too."""
    parent = CPUSET / f"vmpin-test-{uuid.uuid4().hex[:10]}"
    child = parent / "ctr"
    proc = None
    try:
        for d in (parent, child):
            d.mkdir()
            (d / "cpuset.mems").write_text("0")
            (d / "cpuset.cpus").write_text("0")
        tasks_file = str(child / "tasks")

        def enter() -> None:  # join the child cgroup before exec
            with open(tasks_file, "w") as f:
                f.write(str(os.getpid()))

        proc = subprocess.Popen(["sleep", "600"], preexec_fn=enter)
        m = write_map(tmp_path / "map.json", {"ctr": "1"})
        state = {"id": "ctr", "pid": proc.pid}

        out = hook(state, m)
        line = one_line(out)
        assert out.returncode == 0
        assert "parent" in line and str(parent / "cpuset.cpus") in line and "not widened" in line
        assert (child / "cpuset.cpus").read_text().strip() == "0"
        assert allowed(proc.pid) == "0"
        assert hook(state, m, "--strict").returncode == 1

        out = hook(state, m, "--widen-parents")
        assert out.returncode == 0
        assert "widened" in one_line(out)
        assert (parent / "cpuset.cpus").read_text().strip() == "0-1"
        assert (child / "cpuset.cpus").read_text().strip() == "1"
        assert allowed(proc.pid) == "1"
    finally:
        if proc is not None:
            proc.kill()
            proc.wait(10)
        for d in (child, parent):
            with contextlib.suppress(FileNotFoundError):
                wait_until(lambda d=d: not (d / "tasks").read_text().strip(), 5)
                d.rmdir()


# -- the affinity path: no cgroup of its own ---------------------------------------------------
@needs_two_cpus
@pytest.mark.parametrize("vcpus", ["1", "0"])
def test_pins_every_thread_without_cgroup(tmp_path: Path, vcpus: str) -> None:
    if cpuset_dir(os.getpid()) != CPUSET and (CPUSET / "cpuset.cpus").exists():
        pytest.skip("this test process is not in the root cpuset")
    m = write_map(tmp_path / "map.json", {"plain": vcpus})
    with plain_process() as (pid, child):
        assert len(threads_of(pid)) >= 4
        assert {allowed(t) for t in threads_of(pid)} == {f"0-{NCPUS - 1}"}
        proc = hook({"id": "plain", "pid": pid}, m)
        assert (proc.returncode, proc.stderr) == (0, "")
        assert {t: allowed(t) for t in threads_of(pid)} == {t: vcpus for t in threads_of(pid)}
        assert allowed(child) == vcpus  # descendants too
        # the cgroups were left alone: the root cpuset still has every CPU
        if (CPUSET / "cpuset.cpus").exists():
            assert (CPUSET / "cpuset.cpus").read_text().strip() == f"0-{NCPUS - 1}"


# -- roots injected: fixture trees for cgroup v1 and v2 ------------------------------------------
def fake_roots(tmp_path: Path, version: int, effective: str | None) -> tuple[Path, Path, int]:
    """A procfs root and a cgroup root holding one container ``ctr`` (pid 999001)."""
    pid = 999001
    proc, cg = tmp_path / "proc", tmp_path / "cgroup"
    (proc / str(pid) / "task" / str(pid)).mkdir(parents=True)
    (proc / str(pid) / "status").write_text("Name:\tfake\nCpus_allowed_list:\t1\n")
    if version == 1:
        (proc / str(pid) / "cgroup").write_text("4:memory:/ctr\n3:cpuset:/kube/ctr\n0::/\n")
        d = cg / "cpuset" / "kube" / "ctr"
        d.mkdir(parents=True)
        (d / "tasks").write_text(f"{pid}\n")
    else:
        (proc / str(pid) / "cgroup").write_text("0::/kube/ctr\n")
        (cg / "cgroup.controllers").parent.mkdir(parents=True)
        (cg / "cgroup.controllers").write_text("cpuset cpu memory\n")
        d = cg / "kube" / "ctr"
        d.mkdir(parents=True)
        (d / "cgroup.controllers").write_text("cpuset cpu\n")
        (d / "cgroup.threads").write_text(f"{pid}\n")
    (d / "cpuset.cpus").write_text("0-1\n")
    if effective is not None:
        name = "cpuset.effective_cpus" if version == 1 else "cpuset.cpus.effective"
        (d / name).write_text(effective + "\n")
    return proc, cg, pid


@pytest.mark.parametrize(
    ("version", "effective"),
    [(1, None), (1, "1"), (2, "1")],  # v1 without effective_cpus: pre-3.16 kernels
)
def test_cgroup_found_through_injected_roots(tmp_path: Path, version: int, effective: str) -> None:
    proc_root, cg_root, pid = fake_roots(tmp_path, version, effective)
    m = write_map(tmp_path / "map.json", {"ctr": "1"})
    env = {"VMPIN_GUEST_PROC_ROOT": str(proc_root), "VMPIN_GUEST_CGROUP_ROOT": str(cg_root)}
    out = hook({"id": "ctr", "pid": pid}, m, "--verbose", env=env)
    assert out.returncode == 0
    line = one_line(out)
    assert "pinned to vCPUs 1 (cgroup: " in line
    ctr = cg_root / ("cpuset/kube/ctr" if version == 1 else "kube/ctr")
    assert (ctr / "cpuset.cpus").read_text() == "1\n"


def test_v2_parent_narrowing_is_reported(tmp_path: Path) -> None:
    """v2 accepts any list and intersects it with the parent's: the effective set tells."""
    proc_root, cg_root, pid = fake_roots(tmp_path, 2, effective="0")
    m = write_map(tmp_path / "map.json", {"ctr": "1"})
    env = {"VMPIN_GUEST_PROC_ROOT": str(proc_root), "VMPIN_GUEST_CGROUP_ROOT": str(cg_root)}
    out = hook({"id": "ctr", "pid": pid}, m, "--strict", env=env)
    assert out.returncode == 1
    assert "kernel gives 0" in one_line(out)


# -- fail-open ---------------------------------------------------------------------------------
BAD_MAPS: dict[str, tuple[str, str]] = {
    "not-json": ("{half", "is not JSON"),
    "not-an-object": ("[1, 2]", "is not a JSON object"),
    "wrong-version": (json.dumps({"version": 2, "containers": {}}), "has version 2"),
    "no-containers": (json.dumps({"version": 1}), "has no containers object"),
    "bad-cpus": (
        json.dumps({"version": 1, "containers": {"c": {"guest_cpus": "1-"}}}),
        "bad CPU list '1-'",
    ),
    "no-cpus": (
        json.dumps({"version": 1, "containers": {"c": {"exact": True}}}),
        "has no guest_cpus",
    ),
    "empty-cpus": (
        json.dumps({"version": 1, "containers": {"c": {"guest_cpus": ""}}}),
        "gives no vCPU",
    ),
}


@pytest.fixture
def victim() -> Iterator[int]:
    """A process the failing hooks are pointed at: it must keep every CPU."""
    with plain_process() as (pid, _):
        yield pid


def assert_fail_open(state: Any, m: Path | str, expect: str, victim: int, *args: str) -> None:
    before = {allowed(t) for t in threads_of(victim)}
    out = hook(state, m, *args)
    assert out.returncode == 0, out.stderr
    assert expect in one_line(out)
    strict = hook(state, m, "--strict", *args)
    assert strict.returncode == 1
    assert expect in one_line(strict)
    assert {allowed(t) for t in threads_of(victim)} == before


def test_missing_map(tmp_path: Path, victim: int) -> None:
    assert_fail_open({"id": "c", "pid": victim}, tmp_path / "nope.json", "no guest map", victim)


def test_unknown_container(tmp_path: Path, victim: int) -> None:
    m = write_map(tmp_path / "map.json", {"someone-else": "1"})
    assert_fail_open({"id": "c", "pid": victim}, m, "not in the guest map", victim)


@pytest.mark.parametrize("name", sorted(BAD_MAPS))
def test_malformed_map(tmp_path: Path, victim: int, name: str) -> None:
    m = tmp_path / "map.json"
    text, expect = BAD_MAPS[name]
    m.write_text(text)
    assert_fail_open({"id": "c", "pid": victim}, m, expect, victim)


@pytest.mark.parametrize(
    ("stdin", "expect"),
    [
        ("", "not JSON"),
        ("{half", "not JSON"),
        ("[]", "not a JSON object"),
        ('{"pid": 1}', "no container id"),
        ('{"id": "c", "pid": "12"}', "bad pid"),
        ('{"id": "c"}', "has no pid"),
    ],
)
def test_malformed_stdin(tmp_path: Path, victim: int, stdin: str, expect: str) -> None:
    m = write_map(tmp_path / "map.json", {"c": "1"})
    assert_fail_open(stdin, m, expect, victim)


def test_process_gone(tmp_path: Path) -> None:
    p = subprocess.Popen(["true"])
    p.wait()
    m = write_map(tmp_path / "map.json", {"c": "1"})
    out = hook({"id": "c", "pid": p.pid}, m)
    assert out.returncode == 0 and "gone" in one_line(out)


def test_bad_usage_is_fail_open_too(tmp_path: Path) -> None:
    m = write_map(tmp_path / "map.json", {"c": "1"})
    for args in (["--bogus"], ["--wait", "soon"]):
        out = hook({"id": "c", "pid": 1}, m, *args)
        assert out.returncode == 0 and one_line(out)
    out = hook({"id": "c", "pid": 1}, m, stage="nostage")
    assert out.returncode == 0 and "STAGE" in one_line(out)


def test_poststop_has_nothing_to_undo(tmp_path: Path) -> None:
    for stdin in ('{"id": "c"}', "garbage"):
        out = hook(stdin, tmp_path / "no-map.json", "--strict", stage="poststop")
        assert (out.returncode, out.stdout, out.stderr) == (0, "", "")


@needs_two_cpus
def test_floating_map_pins_and_says_so_only_when_verbose(tmp_path: Path) -> None:
    m = write_map(tmp_path / "map.json", {"c": f"0-{NCPUS - 1}"}, exact=False)
    with plain_process() as (pid, _):
        os.sched_setaffinity(pid, {0})  # so that the pin visibly happens
        quiet = hook({"id": "c", "pid": pid}, m)
        assert (quiet.returncode, quiet.stderr) == (0, "")
        assert allowed(pid) == f"0-{NCPUS - 1}"
        loud = hook({"id": "c", "pid": pid}, m, "--verbose")
        assert loud.returncode == 0
        assert "not exact" in one_line(loud) and "float" in one_line(loud)


@needs_two_cpus
def test_wait_for_a_late_map(tmp_path: Path) -> None:
    """The host may publish after the agent runs the hook: --wait polls for the entry."""
    m = tmp_path / "late" / "map.json"
    with plain_process() as (pid, _):
        timer = threading.Timer(0.5, write_map, args=(m, {"c": "1"}))
        timer.start()
        try:
            out = hook({"id": "c", "pid": pid}, m, "--wait", "10")
        finally:
            timer.join()
        assert (out.returncode, out.stderr) == (0, "")
        assert allowed(pid) == "1"


# -- end to end: QEMU sandbox -> reconcile -> published map -> guest hook -------------------------
@needs_runc
@needs_two_cpus
@pytest.mark.qemu
@pytest.mark.runc
def test_end_to_end(
    paths: HostPaths, env: dict[str, str], vm_dir: Path, runc: RuncSession, tmp_path: Path
) -> None:
    from tests.qemu_util import start_qemu
    from vmpin.cpuset import CpuSet
    from vmpin.store import ContainerRec, SandboxRec, Store

    sid = new_id("vmpin-sb")
    cids = {new_id("vmpin-c0"): "0", new_id("vmpin-c1"): "1"}
    # Kata's per-sandbox shared dir, which the runtime creates before any container
    shared = Path(paths.publish_dir) / sid / "mounts"
    shared.mkdir(parents=True)
    with start_qemu(vm_dir, sid, smp=2) as vm:
        with Store(paths.state_dir) as store:
            store.put_sandbox(SandboxRec(sid, "kata"))
            for cid, cpus in cids.items():
                store.put_container(ContainerRec(cid, sid, False, cpus=CpuSet.parse(cpus)))

        def vmpin(*args: str) -> subprocess.CompletedProcess[str]:
            p = subprocess.run(
                [*vmpin_cmd(), *args], capture_output=True, text=True, env=env, timeout=120
            )
            assert p.returncode == 0, f"vmpin {args}: {p.returncode}\n{p.stdout}\n{p.stderr}"
            return p

        vmpin("reconcile", "--once")
        published = shared / "vmpin" / "guest-map.json"
        doc = guest.read_map(str(published))
        assert doc["sandbox"] == sid and doc["mode"] == "1:1" and doc["nvcpus"] == 2
        assert doc["vcpu_to_host"] == {"0": 0, "1": 1}
        first = os.stat(published)

        for cid, cpus in cids.items():
            gm = json.loads(vmpin("guest-map", cid, "--json").stdout)
            assert (gm["guest_cpus"], gm["host_cpus"], gm["exact"]) == (cpus, cpus, True)
            entry = guest.lookup(doc, cid)
            assert entry is not None and entry.guest_cpus == guest.parse_cpus(cpus)
            assert entry.exact

        # an idle pass does not rewrite the map
        vmpin("reconcile", "--once")
        again = os.stat(published)
        assert (again.st_ino, again.st_mtime_ns) == (first.st_ino, first.st_mtime_ns)

        # the guest side: containers with those ids, pinned by the hook from that file
        for cid, cpus in cids.items():
            pid = start_container(runc, cid)
            out = hook(runc.state(cid), published)
            assert (out.returncode, out.stderr) == (0, "")
            cg = cpuset_dir(pid)
            assert (cg / "cpuset.cpus").read_text().strip() == cpus
            assert {allowed(t) for t in cgroup_tasks(cg)} == {cpus}
        assert not vm.killed
