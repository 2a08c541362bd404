"""The CLI contract: exit codes, JSON shapes, usage errors without tracebacks; and the fast
route (update and the read commands without typer) against the typer route, argv for argv."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import vmpin_cmd
from tests.support import fakevmm
from tests.support.session import new_id
from vmpin import __version__
from vmpin.core.cpuset import CpuSet
from vmpin.linux.paths import HostPaths
from vmpin.state.records import ContainerRec, SandboxRec
from vmpin.state.store import Store


def vmpin(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*vmpin_cmd(), *args], env=env, capture_output=True, text=True,
                          timeout=60)


def test_version_and_help(env: dict[str, str]) -> None:
    v = vmpin(env, "--version")
    assert v.returncode == 0 and v.stdout.strip() == f"vmpin {__version__}"
    h = vmpin(env, "--help")
    assert h.returncode == 0
    for command in ("hook", "update", "containers", "sandboxes", "show", "guest-map",
                    "topology", "audit", "reconcile", "serve", "status"):
        assert command in h.stdout


def init(env: dict[str, str]) -> None:
    """Create the state as the writing commands do (read-only ones never create it)."""
    assert vmpin(env, "reconcile", "--once").returncode == 0


@pytest.mark.parametrize("command", ["containers", "sandboxes"])
def test_empty_listings(env: dict[str, str], command: str) -> None:
    init(env)
    out = vmpin(env, command, "--json")
    assert out.returncode == 0 and json.loads(out.stdout) == []


@pytest.mark.parametrize("args", [["containers"], ["sandboxes"], ["show", "x"],
                                  ["guest-map", "x"], ["audit"]])
def test_read_only_commands_need_existing_state(env: dict[str, str], args: list[str]) -> None:
    """A mistyped --state-dir is an error, not a new empty store (issue 9), and the error says
    what is missing and what would create it (issue 25)."""
    env = {**env, "VMPIN_STATE_DIR": env["VMPIN_STATE_DIR"] + "-typo"}
    out = vmpin(env, *args)
    assert out.returncode == 2, out.stdout + out.stderr
    line = out.stderr.strip()
    assert line.count("\n") == 0, line
    assert f"no vmpin state at {env['VMPIN_STATE_DIR']}" in line
    assert "--state-dir" in line and "vmpin reconcile --once" in line
    assert not Path(env["VMPIN_STATE_DIR"]).exists()


@pytest.mark.parametrize("command", ["containers", "sandboxes", "audit"])
def test_fresh_node_lists_an_empty_node(env: dict[str, str], command: str) -> None:
    """The node's state dir exists (the DaemonSet, the unit made it) and nothing ran yet:
    an empty node, and one line on stderr saying why (issue 25: exit 2 told nobody why)."""
    out = vmpin(env, command, "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    data = json.loads(out.stdout)
    if command == "audit":
        assert data["ok"] is True and data["violations"] == [] and data["sandboxes"] == 0
    else:
        assert data == []
    assert "nothing recorded at" in out.stderr and "hooks" in out.stderr
    assert out.stderr.count("\n") == 1
    assert list(Path(env["VMPIN_STATE_DIR"]).iterdir()) == []  # and nothing written


def test_empty_audit_and_reconcile(env: dict[str, str]) -> None:
    init(env)
    audit = vmpin(env, "audit", "--json")
    assert audit.returncode == 0
    assert json.loads(audit.stdout)["ok"] is True
    assert json.loads(audit.stdout)["violations"] == []
    rec = vmpin(env, "reconcile", "--once", "--json")
    assert rec.returncode == 0 and json.loads(rec.stdout) == []


@pytest.mark.parametrize(("args", "words"), [
    (["update", "--bogus"], "No such option"),
    (["nosuch"], "No such command"),
    (["show"], "Missing"),
    (["reconcile"], "--once"),
    (["show", "nosuch"], "unknown sandbox"),
    (["guest-map", "nosuch"], "unknown container"),
])
def test_bad_usage_exits_2_without_traceback(env: dict[str, str], args: list[str],
                                             words: str) -> None:
    init(env)
    out = vmpin(env, *args)
    assert out.returncode == 2, out.stderr
    assert words in out.stderr + out.stdout
    assert "Traceback" not in out.stderr


def test_status_without_agent_exits_1(env: dict[str, str]) -> None:
    out = vmpin(env, "status", "--json")
    assert out.returncode == 1
    assert json.loads(out.stdout)["ok"] is False


def test_global_options_win_over_env(env: dict[str, str], tmp_path: Path) -> None:
    """--state-dir on the command line wins over VMPIN_STATE_DIR."""
    other = tmp_path / "other-state"
    assert vmpin(env, "--state-dir", str(other), "reconcile", "--once").returncode == 0
    assert (other / "state.db").exists()


# -- the fast route (vmpin.entry -> vmpin.service.commands) and the typer route agree ------------
#: the typer route, forced: what vmpin.entry falls back to for anything not plainly fast
TYPER = "import sys; from vmpin.cli import run; sys.exit(run(sys.argv[1:]))"
#: the console script's route, reporting what it loaded into the file named by $PROBE_OUT
FAST = """
import json, os, sys
from vmpin.entry import main
code = main(sys.argv[1:])
sys.stdout.flush()
with open(os.environ["PROBE_OUT"], "w") as f:
    json.dump(sorted(m for m in ("typer", "pydantic", "vmpin.cli", "libvirt")
                     if m in sys.modules),
              f)
sys.exit(code)
"""


def both(env: dict[str, str], tmp_path: Path, args: list[str], stdin: str = "") -> list[str]:
    """Run ``args`` on both routes; assert the same stdout, stderr and exit code; return what
    the fast route's process loaded of typer/pydantic (empty when it took the fast route)."""
    probe = tmp_path / "probe.json"
    fast = subprocess.run([sys.executable, "-c", FAST, *args], env={**env, "PROBE_OUT": str(probe)},
                          input=stdin, capture_output=True, text=True, timeout=120)
    slow = subprocess.run([sys.executable, "-c", TYPER, *args], env=env, input=stdin,
                          capture_output=True, text=True, timeout=120)
    assert (fast.returncode, fast.stdout, fast.stderr) == (
        slow.returncode, slow.stdout, slow.stderr), args
    assert "Traceback" not in fast.stderr
    loaded: list[str] = json.loads(probe.read_text())
    return loaded


@pytest.fixture
def node(env: dict[str, str], paths: HostPaths, vm_dir: Path) -> Iterator[str]:
    """A tracked Kata sandbox with a live (fake) QEMU: pause + ``<sid>-app`` on CPU 0."""
    sid = new_id("fast")
    vmm = fakevmm.start(vm_dir, sid, vcpus=2)
    try:
        with Store(paths.state_dir) as store:
            store.put_sandbox(SandboxRec(sid, "kata"))
            store.put_container(ContainerRec(sid, sid, True, name="pause"))
            store.put_container(ContainerRec(f"{sid}-app", sid, False, name="app",
                                             cpus=CpuSet.parse("0")))
        yield sid
    finally:
        vmm.kill()


FAST_CASES = [
    ["containers"], ["containers", "--json"], ["sandboxes"], ["sandboxes", "--json"],
    ["show", "{sid}"], ["show", "{sid}", "--json"], ["audit"], ["audit", "--json"],
    ["--vm-dir={vm}", "--helper-policy", "isolate", "--housekeeping", "0", "show", "{sid}"],
    ["update", "{sid}-app", "--cpuset-cpus", "0"], ["update", "--json", "{sid}-app", "-r", "-"],
    ["update", "{sid}-app", "--cpuset-cpus=0", "--json"],
    ["reconcile", "--once"], ["reconcile", "--json", "--once"], ["reconcile"],
    # bad input, answered by the commands' bodies on both routes
    ["show", "nosuch"], ["update", "nosuch", "--cpuset-cpus", "0"],
    ["update", "{sid}-app", "--cpuset-cpus", "3-1"], ["update", "{sid}-app", "--cpuset-cpus", "7"],
    ["update", "{sid}-app"], ["update", "{sid}-app", "--cpuset-cpus", "0", "-r", "-"],
    ["update", "{sid}-app", "--cpuset-cpus", ""], ["--libvirt", "bogus:", "containers"],
    ["--helper-policy", "bogus", "containers"], ["update", "{sid}-app", "-r", "/nonexistent"],
    # serve: refused before the agent starts (it would run until stopped), on both routes
    ["serve", "--interval", "0"], ["serve", "--interval=nan", "--metrics-port", "0"],
    ["serve", "--workers", "0"], ["serve", "--workers=65", "--interval", "1e9"],
    ["serve", "--metrics-port", "70000"], ["serve", "--interval", " 5 ", "--workers", "1_000"],
    ["--vm-dir={vm}", "serve", "--metrics-port", "0", "--node-name", "n", "--kubeconfig",
     "/nonexistent", "--interval=-1"],
]
#: argv the fast route leaves to typer (usage errors, --help): the same by construction
TYPER_CASES = [
    ["update", "--bogus"], ["show"], ["show", "a", "b"], ["containers", "-h"], ["update", "--help"],
    ["audit", "--json", "--json"], ["containers", "--json=1"], ["--state-dir", "containers"],
    ["update", "{sid}-app", "--cpuset-cpus"], ["containers", "--", "x"],
    ["serve", "--help"], ["serve", "--interval", "x"], ["serve", "--workers", "1.5"],
    ["serve", "--metrics-port", "-1"], ["serve", "--interval"], ["serve", "extra"],
    ["reconcile", "--once=1"], ["reconcile", "--help"],
]


def test_fast_and_typer_routes_agree(env: dict[str, str], tmp_path: Path, node: str,
                                     vm_dir: Path) -> None:
    stdin = json.dumps({"cpu": {"cpus": "0"}})
    for case in FAST_CASES + TYPER_CASES:
        args = [a.format(sid=node, vm=vm_dir) for a in case]
        typer_loaded = [m for m in both(env, tmp_path, args, stdin) if m in ("typer", "vmpin.cli")]
        assert typer_loaded == ([] if case in FAST_CASES else ["typer", "vmpin.cli"]), (
            args, typer_loaded)


def test_fast_route_reports_a_broken_store_as_typer_does(env: dict[str, str],
                                                         tmp_path: Path) -> None:
    init(env)
    (Path(env["VMPIN_STATE_DIR"]) / "state.db").write_bytes(b"not a database" * 512)
    for args in (["containers"], ["audit", "--json"], ["update", "x", "--cpuset-cpus", "0"]):
        assert both(env, tmp_path, args) == []


def test_typer_app_declares_the_option_table() -> None:
    """One home: the typer app's options are clispec's, flag for flag, help for help."""
    import typer.main
    from typer.core import TyperArgument, TyperGroup, TyperOption

    from vmpin.cli import app
    from vmpin.service import clispec, commands

    group = typer.main.get_command(app)
    assert isinstance(group, TyperGroup)

    def declared(cmd: object) -> dict[str, tuple[tuple[str, ...], bool, str | None]]:
        return {p.opts[0]: (tuple(p.opts), not p.is_flag, p.help)
                for p in getattr(cmd, "params", []) if isinstance(p, TyperOption)
                and p.name not in ("help", "version")}

    def table(opts: tuple[clispec.Opt, ...]) -> dict[str, tuple[tuple[str, ...], bool, str]]:
        return {o.flags[0]: (tuple(sorted(o.flags, key=lambda f: f.startswith("--"))), o.value,
                             o.help) for o in opts}

    def norm(d: dict[str, tuple[tuple[str, ...], bool, str | None]]) -> object:
        return {k: (tuple(sorted(v[0])), v[1], v[2]) for k, v in d.items()}

    assert norm(declared(group)) == norm(table(clispec.GLOBALS))
    # the hooks' own parse (vmpin.entry, kept free of vmpin.service for the guest) agrees
    from vmpin.entry import GLOBAL_OPTIONS

    assert {o.flags[0]: o.key for o in clispec.GLOBALS if o.path} == GLOBAL_OPTIONS
    assert set(clispec.FAST) == set(commands.BODIES)
    for name, spec in clispec.FAST.items():
        cmd = group.commands[name]
        assert norm(declared(cmd)) == norm(table(spec.options)), name
        args = [p for p in cmd.params if isinstance(p, TyperArgument)]
        assert [(p.metavar, p.name) for p in args] == [(a.metavar, a.key) for a in spec.args]
        # defaults and environment variables: the fast route applies clispec's
        options = {p.name: p for p in cmd.params if isinstance(p, TyperOption)}
        for o in spec.options:
            if o.value:
                assert (options[o.key].default, options[o.key].envvar) == (o.default, o.envvar)


def test_fast_route_needs_no_pydantic(env: dict[str, str], tmp_path: Path, node: str) -> None:
    """Off the tests' VMPIN_CHECK_VIEWS, a --json read loads neither pydantic nor typer; and
    with libvirt left at its default (qemu:///system when its daemon runs), not libvirt
    either on a node where no daemon runs."""
    from vmpin.runtimes.libvirtd import SYSTEM_SOCKETS

    quiet = {k: v for k, v in env.items() if k not in ("VMPIN_CHECK_VIEWS", "VMPIN_LIBVIRT")}
    daemon = any(os.path.exists(s) for s in SYSTEM_SOCKETS)
    probe = tmp_path / "probe.json"
    out = subprocess.run([sys.executable, "-c", FAST, "sandboxes", "--json"],
                         env={**quiet, "PROBE_OUT": str(probe)}, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert [s["id"] for s in json.loads(out.stdout)] == [node]
    assert json.loads(probe.read_text()) == (["libvirt"] if daemon else [])
