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
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import vmpin_cmd
from tests.support import capabilities, runc_util
from tests.support.runc_util import RuncSession, new_id
from vmpin.guest import bundle, follower
from vmpin.guest.common import GuestError, format_cpus, parse_cpus
from vmpin.guest.inputs import lookup, read_map
from vmpin.guest.options import DEFAULT_GUEST_STATE, DEFAULT_INTERVAL, parse_args, parse_follow_args
from vmpin.guest.records import start_time
from vmpin.linux.paths import HostPaths
from vmpin.wire.guestmap import DEFAULT_GUEST_MAP

REPO = Path(__file__).resolve().parents[2]
CPUSET = Path("/sys/fs/cgroup/cpuset")
#: the online CPUs, not this process's affinity (every process here starts on {0}): a test
#: that needs several CPUs is marked multi_cpu and runs with its affinity widened to them all.
NCPUS = len(capabilities.online_cpus())

_MISSING = runc_util.missing()


def needs_runc(test: Callable[..., Any]) -> Callable[..., Any]:
    """runc containers, whose cgroups these tests read in the v1 cpuset (:func:`cpuset_dir`)."""
    return pytest.mark.cgroup_v1(pytest.mark.runc(test))


needs_two_cpus = pytest.mark.multi_cpu
needs_v1_cpuset = pytest.mark.cgroup_v1


# -- helpers -----------------------------------------------------------------------------------
def write_map(path: Path, entries: Mapping[str, str], *, exact: bool = True, **extra: Any) -> Path:
    """A published map in format 1, as vmpin.runtimes.publish writes it (only what the hook
    reads)."""
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
    assert parse_cpus(text) == frozenset(cpus)


@pytest.mark.parametrize("bad", ["0,", ",3", "1-", "3-0", "0--3", "-1", "a", "0x3", "1 2"])
def test_parse_cpus_rejects(bad: str) -> None:
    with pytest.raises(GuestError):
        parse_cpus(bad)


@pytest.mark.parametrize("bad", ["99999", "0-8192", "8192"])
def test_guest_caps_cpus_like_the_host(bad: str, tmp_path: Path) -> None:
    """The guest parses CPU lists with the host's parser: no CPU past vmpin.core.cpuset's cap
    (the guest's old copy accepted 99999)."""
    with pytest.raises(GuestError):
        parse_cpus(bad)
    m = read_map(str(write_map(tmp_path / "m.json", {"c": bad, "ok": "1"})))
    with pytest.raises(GuestError, match="entry of c"):
        lookup(m, "c")
    ok = lookup(m, "ok")  # one bad entry is an error against its container only
    assert ok is not None and ok.guest_cpus == frozenset({1})


def test_format_cpus() -> None:
    assert format_cpus(frozenset({0, 1, 2, 5, 7, 8})) == "0-2,5,7-8"
    assert format_cpus(frozenset()) == ""


def test_read_map_and_lookup(tmp_path: Path) -> None:
    m = read_map(str(write_map(tmp_path / "m.json", {"c": "1-2"}, future_key=1)))
    e = lookup(m, "c")
    assert e is not None and e.guest_cpus == frozenset({1, 2}) and e.exact
    assert lookup(m, "other") is None


def test_parse_args_env_and_order() -> None:
    env = {"VMPIN_GUEST_MAP": "/m", "VMPIN_GUEST_PROC_ROOT": "/p", "VMPIN_GUEST_CGROUP_ROOT": "/c"}
    o = parse_args(["--strict", "prestart", "--wait=1.5", "-v"], env)
    assert (o.stage, o.strict, o.verbose, o.wait) == ("prestart", True, True, 1.5)
    assert (o.map_path, o.proc, o.cgroup_root) == ("/m", "/p", "/c")
    o = parse_args(["poststart", "--map", "/x", "--proc-root", "/q"], env)
    assert (o.map_path, o.proc, o.cgroup_root) == ("/x", "/q", "/c")
    d = parse_args(["poststop"], {})
    assert (d.map_path, d.proc, d.cgroup_root) == (
        DEFAULT_GUEST_MAP,
        "/proc",
        "/sys/fs/cgroup",
    )


# -- lean and self-contained ------------------------------------------------------------------
def assert_loads_what_the_zipapp_ships(mods: set[str], not_loaded: set[str]) -> None:
    """``mods`` (a guest command's ``sys.modules``) holds nothing heavy, and of vmpin exactly
    what the zipapp ships (its list is closed) but ``not_loaded``, plus the console entry
    point.  The zipapp's own entry (vmpin.guest.program) is never loaded through the package;
    the other command's module must not be either: each runs in a small guest, the hook at
    every container start."""
    for heavy in ("sqlite3", "typer", "click", "pydantic", "psutil", "kubernetes", "libvirt"):
        assert heavy not in mods
    shipped = {
        rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        for rel in bundle.GUEST_MODULES
    }
    assert not_loaded <= shipped
    # (shapes: precompiled record templates, used where present; the zipapp compiles them)
    templates = {"vmpin.lean.shapes", "vmpin.lean.initshapes"}
    assert {m for m in mods if m.startswith("vmpin")} - templates == (
        shipped - not_loaded - {"vmpin.guest.program"}
    ) | {"vmpin.entry"}
    assert {"vmpin.core.cpuset", "vmpin.linux.procfs", "vmpin.linux.affinity",
            "vmpin.wire.guestmap"} <= shipped


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
    assert_loads_what_the_zipapp_ships(
        set(json.loads(out.stdout.splitlines()[-1])), not_loaded={"vmpin.guest.follower"}
    )


@needs_two_cpus
def test_runs_as_a_single_copied_file(tmp_path: Path) -> None:
    """The zipapp alone (no vmpin package, no site-packages) pins a process: a guest image
    needs only python3 and this one file, called as kata-agent or the shipped wrapper does."""
    script = Path(bundle.build(str(tmp_path / "vmpin-guest.pyz")))
    m = write_map(tmp_path / "map.json", {"solo": "1"})
    with plain_process() as (pid, _):
        for argv in (["prestart"], ["guest", "hook", "poststart"]):
            proc = subprocess.run(
                [sys.executable, "-I", "-S", str(script), *argv],
                input=json.dumps({"id": "solo", "pid": pid}),
                capture_output=True,
                text=True,
                env={
                    "VMPIN_GUEST_MAP": str(m),
                    "VMPIN_GUEST_CGROUP_ROOT": str(tmp_path),
                    "VMPIN_GUEST_STATE": str(tmp_path / "guest-state"),
                },
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


def run_with_guest_hooks(runc: RuncSession, cid: str, map_file: Path, state: Path) -> int:
    """A container whose runc plays the kata-agent: `vmpin guest hook --strict` at
    prestart, poststart and poststop, reading ``map_file`` and keeping records in ``state``."""

    def argv(stage: str) -> list[str]:
        return [*runc_util.vmpin_argv(stage)[:-2], "guest", "hook", "--strict", stage]

    return runc.run(
        cid,
        cpus=None,
        hooks=argv,
        stages=("prestart", "poststart", "poststop"),
        env={"VMPIN_GUEST_MAP": str(map_file), "VMPIN_GUEST_STATE": str(state)},
        args=BUSY,
    )


@needs_runc
@needs_two_cpus
@pytest.mark.runc
def test_as_a_real_runc_prestart_hook(runc: RuncSession, tmp_path: Path) -> None:
    """runc runs the guest hook itself at prestart (as kata-agent does in the guest), with
    --strict: had it failed, the container would not have started."""
    cid = new_id("vmpin-guest")
    m = write_map(tmp_path / "map.json", {cid: "1"})

    pid = run_with_guest_hooks(runc, cid, m, tmp_path / "guest-state")
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
    parent = CPUSET / new_id()
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
        "invalid CPU list '1-'",
    ),
    "no-cpus": (
        json.dumps({"version": 1, "containers": {"c": {"exact": True}}}),
        "has no guest_cpus",
    ),
    "empty-cpus": (
        json.dumps({"version": 1, "containers": {"c": {"guest_cpus": ""}}}),
        "gives no vCPU",
    ),
    # issue 26: "unexpected RecursionError"
    "deeply-nested": ('{"version": 1, "containers": ' + "[" * 100_000 + "]" * 100_000 + "}",
                      "nested too deeply"),
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
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
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
    from tests.support.qemu_util import start_qemu
    from vmpin.core.cpuset import CpuSet
    from vmpin.state.records import ContainerRec, SandboxRec
    from vmpin.state.store import Store

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
        doc = read_map(str(published))
        assert doc.sandbox == sid and doc.mode == "1:1" and doc.nvcpus == 2
        assert doc.vcpu_to_host == {"0": 0, "1": 1}
        first = os.stat(published)

        for cid, cpus in cids.items():
            gm = json.loads(vmpin("guest-map", cid, "--json").stdout)
            assert (gm["guest_cpus"], gm["host_cpus"], gm["exact"]) == (cpus, cpus, True)
            entry = lookup(doc, cid)
            assert entry is not None and entry.guest_cpus == parse_cpus(cpus)
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
        # and the map tells the truth on the host: vCPU i's thread runs on vcpu_to_host[i]
        from vmpin.runtimes.qmp import QmpClient

        with QmpClient(str(vm.qmp_sock), timeout=5.0) as qmp:
            vcpus = {index: tid for index, tid, _ in qmp.query_cpus_fast()}
        assert sorted(vcpus) == [0, 1]
        assert {i: allowed(t) for i, t in vcpus.items()} == {
            i: str(doc.vcpu_to_host[str(i)]) for i in vcpus
        }


# -- the follower: `vmpin guest follow` re-applies a republished map ----------------------------
#
# The hook records what it pinned in a guest-side state dir; the host later changes a
# container's CPUs and republishes (a new generation); the follower re-pins the container
# the way the hook did.  Containers are real (runc) or plain processes; every assertion reads
# the kernel's cpuset.cpus / Cpus_allowed_list.
@pytest.fixture(autouse=True)
def guest_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every hook and follower of this module records into the test's own state dir: the
    default (/run/vmpin-guest) belongs to this machine, not to the tests."""
    d = tmp_path / "guest-state"
    monkeypatch.setenv("VMPIN_GUEST_STATE", str(d))
    return d


def record_of(state: Path, cid: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((state / f"{cid}.json").read_text())
    return doc


def republish(path: Path, cid: str, cpus: str) -> int:
    """Give ``cid`` new vCPUs as the host does: next generation, the entry's own generation
    set to it, the file replaced by rename (so readers see a new inode).  The generation."""
    doc = json.loads(path.read_text())
    gen = int(doc["generation"]) + 1
    entry = doc["containers"].get(cid) or {
        "container": cid,
        "sandbox": "sb",
        "exact": True,
        "mode": "1:1",
        "reason": "test",
    }
    entry.update(host_cpus=cpus, guest_cpus=cpus, generation=gen)
    doc["containers"][cid] = entry
    doc["generation"] = gen
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)
    return gen


def follow(
    state: Path, map_path: Path | str, *args: str, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``vmpin guest follow ARGS`` as a subprocess, with the map and state dir given."""
    e = dict(os.environ)
    e.update(VMPIN_GUEST_MAP=str(map_path), VMPIN_GUEST_STATE=str(state))
    e.update(env or {})
    return subprocess.run(
        [*vmpin_cmd(), "guest", "follow", *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        env=e,
        timeout=60,
    )


def follow_lines(proc: subprocess.CompletedProcess[str]) -> list[str]:
    lines = proc.stderr.splitlines()
    assert proc.stdout == ""
    assert all(line.startswith("vmpin guest follow: ") for line in lines), proc.stderr
    return lines


def publish_host_cpus(paths: HostPaths, sandbox: str, containers: Mapping[str, str]) -> Path:
    """Publish the sandbox's map through the host's own code: this machine's topology, a
    1:1 plan over every CPU, vmpin.core.guestmap and vmpin.runtimes.publish (generations and
    all)."""
    from vmpin.core.cpuset import CpuSet
    from vmpin.core.guestmap import map_sandbox
    from vmpin.core.planner import Thread, plan_sandbox
    from vmpin.linux.sysfs import read_topology
    from vmpin.runtimes import publish

    (Path(paths.publish_dir) / sandbox / "mounts").mkdir(parents=True, exist_ok=True)
    topo = read_topology("/sys")
    threads = [Thread(1000, "emulator")] + [Thread(2000 + i, "vcpu", i) for i in range(NCPUS)]
    plan = plan_sandbox(topo, sandbox, CpuSet.parse(f"0-{NCPUS - 1}"), threads)
    gm = map_sandbox(plan, {c: CpuSet.parse(v) for c, v in containers.items()}, topo)
    res = publish.publish_map(paths, sandbox, gm)
    assert res.written, res.reason
    return Path(res.path)


def mapped(map_path: Path, cid: str) -> tuple[str, int]:
    """The container's guest vCPUs and entry generation as published (the planner decides
    which vCPU a host CPU is; on this machine they coincide, elsewhere they may not)."""
    entry = lookup(read_map(str(map_path)), cid)
    assert entry is not None
    return format_cpus(entry.guest_cpus), entry.generation


def in_root_cpuset() -> bool:
    return not (CPUSET / "cpuset.cpus").exists() or cpuset_dir(os.getpid()) == CPUSET


@needs_runc
@needs_two_cpus
@pytest.mark.runc
def test_follow_repins_a_runc_container_after_an_update(
    runc: RuncSession, paths: HostPaths, guest_state: Path
) -> None:
    """The gap this closes: pinned at start by the hook, the container's CPUs change on the
    host, the host republishes, and `guest follow --once` moves the container's cgroup."""
    cid = new_id("vmpin-follow")
    sid = new_id("vmpin-sb")
    pid = start_container(runc, cid)
    m = publish_host_cpus(paths, sid, {cid: "1", "neighbour": "0"})
    first, gen1 = mapped(m, cid)
    out = hook(runc.state(cid), m)
    assert (out.returncode, out.stdout, out.stderr) == (0, "", "")
    cg = cpuset_dir(pid)
    assert (cg / "cpuset.cpus").read_text().strip() == first

    rec = record_of(guest_state, cid)
    assert rec["container"] == cid and rec["pid"] == pid
    assert rec["start_time"] == runc.started[cid][1]  # runc's own idea of the start time
    assert (rec["method"], rec["cgroup"]) == ("cgroup", str(cg))
    assert (rec["guest_cpus"], rec["generation"]) == (first, gen1)

    # nothing changed yet: the follower has nothing to do
    out = follow(guest_state, m, "--once")
    assert (out.returncode, out.stdout, out.stderr) == (0, "", "")
    assert (cg / "cpuset.cpus").read_text().strip() == first

    # CRI UpdateContainerResources -> vmpin update -> republished: new vCPUs, new generation
    m = publish_host_cpus(paths, sid, {cid: "0", "neighbour": "0"})
    second, gen2 = mapped(m, cid)
    assert second != first and gen2 > gen1
    out = follow(guest_state, m, "--once")
    assert (out.returncode, out.stdout, out.stderr) == (0, "", "")
    assert (cg / "cpuset.cpus").read_text().strip() == second
    tasks = cgroup_tasks(cg)
    assert len(tasks) >= 3
    assert {t: allowed(t) for t in tasks} == {t: second for t in tasks}
    assert {t: allowed(t) for t in threads_of(pid)} == {t: second for t in threads_of(pid)}
    rec = record_of(guest_state, cid)
    assert (rec["guest_cpus"], rec["generation"], rec["by"]) == (second, gen2, "follow")
    assert rec["cgroup"] == str(cg) and rec["failed"] is None

    # no change: no write.  Someone else widens the cgroup behind the follower's back; a
    # follower that rewrote what it had already applied would put `second` back.
    widened = f"0-{NCPUS - 1}"
    (cg / "cpuset.cpus").write_text(widened)
    record_file = guest_state / f"{cid}.json"
    before = os.stat(record_file)
    out = follow(guest_state, m, "--once", "--verbose")
    assert (out.returncode, out.stdout, out.stderr) == (0, "", "")
    assert (cg / "cpuset.cpus").read_text().strip() == widened
    after = os.stat(record_file)
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


@needs_two_cpus
def test_follow_repins_every_thread_of_a_process_without_cgroup(
    tmp_path: Path, guest_state: Path
) -> None:
    """The affinity path: what the hook pinned thread by thread, the follower re-pins the same
    way -- every thread of the process and of its descendants."""
    if not in_root_cpuset():
        pytest.skip("this test process is not in the root cpuset")
    m = write_map(tmp_path / "map.json", {"plain": "1"})
    with plain_process() as (pid, child):
        out = hook({"id": "plain", "pid": pid}, m)
        assert (out.returncode, out.stderr) == (0, "")
        rec = record_of(guest_state, "plain")
        assert (rec["method"], rec["cgroup"], rec["guest_cpus"], rec["generation"]) == (
            "affinity",
            None,
            "1",
            1,
        )
        assert {allowed(t) for t in threads_of(pid)} == {"1"}

        gen = republish(m, "plain", "0")
        out = follow(guest_state, m, "--once", "--verbose")
        assert out.returncode == 0
        (line,) = follow_lines(out)
        assert "container plain re-pinned to vCPUs 0" in line and "affinity" in line
        assert {t: allowed(t) for t in threads_of(pid)} == {t: "0" for t in threads_of(pid)}
        assert allowed(child) == "0"
        rec = record_of(guest_state, "plain")
        assert (rec["method"], rec["guest_cpus"], rec["generation"]) == ("affinity", "0", gen)
        # the cgroups were left alone
        if (CPUSET / "cpuset.cpus").exists():
            assert (CPUSET / "cpuset.cpus").read_text().strip() == f"0-{NCPUS - 1}"


def test_follow_forgets_a_record_whose_process_is_gone(tmp_path: Path, guest_state: Path) -> None:
    m = write_map(tmp_path / "map.json", {"gone": "0"})
    p = subprocess.Popen(["sleep", "600"])
    try:
        out = hook({"id": "gone", "pid": p.pid}, m)
        assert (out.returncode, out.stderr) == (0, "")
        assert (guest_state / "gone.json").exists()
    finally:
        p.kill()
        p.wait(10)
    republish(m, "gone", "0")
    out = follow(guest_state, m, "--once", "--verbose")
    assert out.returncode == 0
    (line,) = follow_lines(out)
    assert f"process {p.pid} is gone; forgotten" in line
    assert not (guest_state / "gone.json").exists()
    out = follow(guest_state, m, "--once", "--strict")
    assert (out.returncode, out.stderr) == (0, "")


@needs_two_cpus
def test_follow_leaves_a_reused_pid_alone(tmp_path: Path, guest_state: Path) -> None:
    """A record whose pid now belongs to another process (another start time) is forgotten,
    and that process is not touched."""
    m = write_map(tmp_path / "map.json", {"old": "1"})
    with plain_process() as (pid, child):
        out = hook({"id": "old", "pid": pid}, m)
        assert (out.returncode, out.stderr) == (0, "")
        record_file = guest_state / "old.json"
        rec = json.loads(record_file.read_text())
        rec["start_time"] -= 1  # the container that had this pid has exited; a stranger has it
        record_file.write_text(json.dumps(rec))
        republish(m, "old", "0")
        out = follow(guest_state, m, "--once", "--strict")
        assert (out.returncode, out.stderr) == (0, "")
        assert {allowed(t) for t in threads_of(pid)} == {"1"}
        assert allowed(child) == "1"
        assert not record_file.exists()


@needs_two_cpus
def test_follow_loop_follows_and_exits_0_on_sigterm(tmp_path: Path, guest_state: Path) -> None:
    m = write_map(tmp_path / "map.json", {"loop": "1"})
    with plain_process() as (pid, _):
        assert hook({"id": "loop", "pid": pid}, m).returncode == 0
        e = dict(os.environ, VMPIN_GUEST_MAP=str(m), VMPIN_GUEST_STATE=str(guest_state))
        proc = subprocess.Popen(
            [*vmpin_cmd(), "guest", "follow", "--interval", "0.1", "--verbose"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=e,
        )
        try:
            time.sleep(0.3)
            assert proc.poll() is None
            republish(m, "loop", "0")
            assert wait_until(lambda: {allowed(t) for t in threads_of(pid)} == {"0"})
            assert wait_until(lambda: record_of(guest_state, "loop")["guest_cpus"] == "0")
            proc.send_signal(signal.SIGTERM)
            stdout, stderr = proc.communicate(timeout=10)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        assert proc.returncode == 0, stderr
        assert stdout == ""
        lines = stderr.splitlines()
        assert len(lines) == 1 and "container loop re-pinned to vCPUs 0" in lines[0], stderr


def test_follow_loop_reads_the_map_only_when_something_changed(
    tmp_path: Path, guest_state: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In the loop an idle pass is two stat() calls: the map is parsed on the first pass,
    after the host replaced it, and once more after the follower's own record write (which
    changes the state dir) -- not on every tick.  Stopped by a real SIGTERM while asleep."""
    m = write_map(tmp_path / "map.json", {"c": f"0-{NCPUS - 1}"})
    with plain_process() as (pid, _):
        assert hook({"id": "c", "pid": pid}, m).returncode == 0
        reads: list[str] = []
        real_read_map = read_map

        def counting_read_map(path: str) -> dict[str, object]:
            reads.append(path)
            return real_read_map(path)

        ticks: list[float] = []

        def fake_sleep(seconds: float) -> None:
            ticks.append(seconds)
            if len(ticks) == 5:
                republish(m, "c", "0")
            if len(ticks) == 30:
                os.kill(os.getpid(), signal.SIGTERM)  # handled by the follower: it stops

        monkeypatch.setattr(follower, "read_map", counting_read_map)
        monkeypatch.setattr(follower.time, "sleep", fake_sleep)
        opts = parse_follow_args(
            ["--interval", "0.05", "--verbose"],
            {"VMPIN_GUEST_MAP": str(m), "VMPIN_GUEST_STATE": str(guest_state)},
        )
        lines: list[str] = []
        saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            assert follower.follow(opts, lines.append) == 0
        finally:
            for s, handler in saved.items():
                signal.signal(s, handler)
        assert len(ticks) == 30 and set(ticks) == {0.05}
        assert len(reads) == 3, reads
        assert len(lines) == 1 and "re-pinned to vCPUs 0" in lines[0]
        assert allowed(pid) == "0"


def stat_line(pid: int, start: int) -> str:
    """A /proc/PID/stat line whose field 22 (start time) is ``start``; comm has ") (" in it."""
    fields = ["S", *(str(n) for n in range(4, 22)), str(start), "0", "0"]
    return f"{pid} (a) (b) {' '.join(fields)}\n"


def test_start_time_reads_field_22(tmp_path: Path) -> None:
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "stat").write_text(stat_line(7, 4242))
    assert start_time(str(tmp_path), 7) == 4242
    assert start_time(str(tmp_path), 8) is None
    me = Path(f"/proc/{os.getpid()}/stat").read_text().rpartition(")")[2].split()[19]
    assert start_time("/proc", os.getpid()) == int(me)


def test_follow_failure_is_one_line_strict_exits_1_and_hook_keeps_what_held(
    tmp_path: Path, guest_state: Path
) -> None:
    """Injected roots (cgroup v2 whose parent narrows to vCPU 1): the hook pins 1 and records
    it; the host moves the container to 0, which the kernel would not give: the follower says
    so in one line (exit 0; 1 with --strict), and records the failure."""
    proc_root, cg_root, pid = fake_roots(tmp_path, 2, effective="1")
    (proc_root / str(pid) / "stat").write_text(stat_line(pid, 555))
    env = {"VMPIN_GUEST_PROC_ROOT": str(proc_root), "VMPIN_GUEST_CGROUP_ROOT": str(cg_root)}
    m = write_map(tmp_path / "map.json", {"ctr": "1"})
    out = hook({"id": "ctr", "pid": pid}, m, env=env)
    assert (out.returncode, out.stderr) == (0, "")
    rec = record_of(guest_state, "ctr")
    assert (rec["pid"], rec["start_time"], rec["method"]) == (pid, 555, "cgroup")
    assert (rec["cgroup"], rec["cgroup_version"]) == (str(cg_root / "kube" / "ctr"), 2)

    gen = republish(m, "ctr", "0")
    out = follow(guest_state, m, "--once", env=env)
    assert out.returncode == 0
    (line,) = follow_lines(out)
    assert "container ctr: vCPUs 0" in line and "kernel gives 1" in line
    rec = record_of(guest_state, "ctr")
    assert rec["failed"] == {"generation": gen, "guest_cpus": "0"}
    assert (rec["guest_cpus"], rec["generation"]) == ("1", 1)  # what still holds
    strict = follow(guest_state, m, "--once", "--strict", env=env)
    assert strict.returncode == 1 and len(follow_lines(strict)) == 1

    # the hook failing later (poststart) does not overwrite a record that something held
    out = hook({"id": "ctr", "pid": pid}, m, stage="poststart", env=env)
    assert out.returncode == 0 and "kernel gives 1" in one_line(out)
    assert (record_of(guest_state, "ctr")["guest_cpus"]) == "1"


@needs_two_cpus
def test_follow_pins_a_container_the_hook_found_no_entry_for(
    tmp_path: Path, guest_state: Path
) -> None:
    """The host may publish after the last hook ran: the hook records the container as not
    pinned yet, and the follower pins it once the map names it."""
    m = write_map(tmp_path / "map.json", {"someone-else": "0"})
    with plain_process() as (pid, _):
        out = hook({"id": "late", "pid": pid}, m)
        assert out.returncode == 0 and "not in the guest map" in one_line(out)
        rec = record_of(guest_state, "late")
        assert (rec["pid"], rec["method"], rec["guest_cpus"], rec["failed"]) == (
            pid,
            None,
            None,
            None,
        )
        out = follow(guest_state, m, "--once", "--strict")  # still not mapped: nothing to do
        assert (out.returncode, out.stderr) == (0, "")
        gen = republish(m, "late", "1")
        out = follow(guest_state, m, "--once", "--strict")
        assert (out.returncode, out.stderr) == (0, "")
        assert {allowed(t) for t in threads_of(pid)} == {"1"}
        rec = record_of(guest_state, "late")
        assert (rec["guest_cpus"], rec["generation"]) == ("1", gen)


def test_poststop_removes_the_record_and_nothing_else(tmp_path: Path, guest_state: Path) -> None:
    m = write_map(tmp_path / "map.json", {"c": "0"})
    with plain_process() as (pid, _):
        assert hook({"id": "c", "pid": pid}, m).returncode == 0
        assert (guest_state / "c.json").exists()
        out = hook({"id": "c"}, m, "--strict", stage="poststop")
        assert (out.returncode, out.stdout, out.stderr) == (0, "", "")
        assert not (guest_state / "c.json").exists()
        assert allowed(pid) == "0"  # nothing undone
    for stdin in ('{"id": "c"}', '{"id": "../../etc/passwd"}', '{"id": ".x"}', "garbage"):
        out = hook(stdin, m, "--strict", stage="poststop")
        assert (out.returncode, out.stdout, out.stderr) == (0, "", "")
    assert sorted(os.listdir(guest_state)) == []


@needs_runc
@needs_two_cpus
@pytest.mark.runc
def test_runc_runs_the_hook_that_records_and_forgets(runc: RuncSession, tmp_path: Path) -> None:
    """runc, playing the kata-agent, runs prestart/poststart/poststop: the record appears
    with the container's pid and cgroup, and `runc delete` (poststop) removes it."""
    cid = new_id("vmpin-guest")
    state = tmp_path / "runc-guest-state"
    m = write_map(tmp_path / "map.json", {cid: "1"})

    pid = run_with_guest_hooks(runc, cid, m, state)
    rec = record_of(state, cid)
    assert (rec["pid"], rec["cgroup"], rec["guest_cpus"]) == (pid, str(cpuset_dir(pid)), "1")
    assert rec["by"] == "hook poststart"
    runc.delete(cid)
    assert not (state / f"{cid}.json").exists()


def test_follow_forgets_unreadable_records(tmp_path: Path, guest_state: Path) -> None:
    m = write_map(tmp_path / "map.json", {"c": "0"})
    guest_state.mkdir()
    (guest_state / "half.json").write_text('{"version": 1, "contai')
    (guest_state / "other.json").write_text(
        json.dumps({"version": 1, "container": "someone", "pid": 1, "start_time": 1})
    )
    (guest_state / ".c.json.123.abcd.tmp").write_text("{}")  # a writer's temporary: not a record
    out = follow(guest_state, m, "--once")
    assert out.returncode == 0
    lines = follow_lines(out)
    assert len(lines) == 2 and all("forgotten" in line for line in lines)
    assert sorted(os.listdir(guest_state)) == [".c.json.123.abcd.tmp"]  # too young to remove


def test_follow_with_nothing_recorded_is_silent(tmp_path: Path, guest_state: Path) -> None:
    """No records, no state dir, no map: nothing to follow, nothing to say (and the map is
    not even read)."""
    out = follow(guest_state, tmp_path / "no-map.json", "--once", "--strict")
    assert (out.returncode, out.stdout, out.stderr) == (0, "", "")
    assert not guest_state.exists()


def test_follow_map_trouble_is_reported_when_something_is_recorded(
    tmp_path: Path, guest_state: Path
) -> None:
    m = write_map(tmp_path / "map.json", {"c": "0"})
    with plain_process() as (pid, _):
        assert hook({"id": "c", "pid": pid}, m).returncode == 0
        m.unlink()
        out = follow(guest_state, m, "--once")
        assert out.returncode == 0
        (line,) = follow_lines(out)
        assert "no guest map" in line
        assert follow(guest_state, m, "--once", "--strict").returncode == 1
        assert (guest_state / "c.json").exists()  # the container lives: keep following it


def test_parse_follow_args_and_bad_usage(tmp_path: Path) -> None:
    env = {"VMPIN_GUEST_MAP": "/m", "VMPIN_GUEST_STATE": "/s"}
    o = parse_follow_args([], env)
    assert (o.once, o.interval, o.strict, o.map_path, o.state_dir) == (
        False,
        DEFAULT_INTERVAL,
        False,
        "/m",
        "/s",
    )
    o = parse_follow_args(["--once", "--interval=0.5", "--state", "/t", "-v"], env)
    assert (o.once, o.interval, o.state_dir, o.verbose) == (True, 0.5, "/t", True)
    d = parse_follow_args([], {})
    assert (d.map_path, d.state_dir) == (DEFAULT_GUEST_MAP, DEFAULT_GUEST_STATE)
    for bad in (["--interval", "0"], ["--interval", "soon"], ["--bogus"], ["extra"]):
        out = follow(tmp_path / "s", tmp_path / "m.json", *bad)
        assert out.returncode == 2
        assert len(follow_lines(out)) == 1


def test_follow_imports_nothing_heavy(tmp_path: Path) -> None:
    """`vmpin guest follow` runs in a small guest image: as lean as the guest hook."""
    code = (
        "import json, sys\n"
        "from vmpin.entry import main\n"
        "rc = main(['guest', 'follow', '--once'])\n"
        "print(json.dumps([rc, sorted(sys.modules)]))\n"
    )
    env = dict(
        os.environ, VMPIN_GUEST_STATE=str(tmp_path / "s"), VMPIN_GUEST_MAP=str(tmp_path / "m.json")
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        env=env,
    )
    rc, mods = json.loads(out.stdout.splitlines()[-1])
    assert rc == 0
    assert_loads_what_the_zipapp_ships(set(mods), not_loaded={"vmpin.guest.hook"})


@needs_two_cpus
def test_follow_runs_from_the_single_copied_file(tmp_path: Path) -> None:
    """The zipapp alone (no package, no site-packages): hook, then `follow --once`, both ways
    the file can be called."""
    script = Path(bundle.build(str(tmp_path / "vmpin-guest.pyz")))
    m = write_map(tmp_path / "map.json", {"solo": "1"})
    env = {
        "VMPIN_GUEST_MAP": str(m),
        "VMPIN_GUEST_CGROUP_ROOT": str(tmp_path),
        "VMPIN_GUEST_STATE": str(tmp_path / "solo-state"),
    }

    def run(*argv: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-I", "-S", str(script), *argv],
            input=stdin,
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )

    with plain_process() as (pid, _):
        out = run("prestart", stdin=json.dumps({"id": "solo", "pid": pid}))
        assert (out.returncode, out.stderr) == (0, "")
        for argv, cpus in ((["follow", "--once"], "0"), (["guest", "follow", "--once"], "1")):
            republish(m, "solo", cpus)
            out = run(*argv, "--strict")
            assert (out.returncode, out.stderr) == (0, "")
            assert {allowed(t) for t in threads_of(pid)} == {cpus}


def test_guest_follow_unit_file() -> None:
    """The example systemd unit for the guest image runs the follower after boot, in Kata's
    guest target, and restarts it."""
    import configparser

    unit = (
        REPO
        / "hooks"
        / "kata-guest"
        / "usr"
        / "lib"
        / "systemd"
        / "system"
        / "vmpin-guest-follow.service"
    )
    cp = configparser.ConfigParser(strict=False, interpolation=None)
    cp.optionxform = str  # type: ignore[assignment,method-assign]
    cp.read_string(unit.read_text())
    exec_start = cp["Service"]["ExecStart"].split()
    assert exec_start[1:3] == ["guest", "follow"]
    assert "--once" not in exec_start
    assert cp["Install"]["WantedBy"] == "kata-containers.target"
    assert cp["Service"]["Restart"] in ("always", "on-failure")
