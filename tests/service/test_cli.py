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


# -- one route: the table's parser runs every command; typer explains what it refuses ------------
#: what the console script loaded, reported into the file named by $PROBE_OUT
PROBE = """
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


#: argv click reads as commands (and the table's parser must read alike), and argv both refuse
ACCEPTED = [
    ["containers"], ["containers", "--json"], ["show", "s1", "--json"], ["show", "--json", "s1"],
    ["--vm-dir=/v", "--helper-policy", "isolate", "--housekeeping", "0", "show", "s1"],
    ["--state-dir", "a", "--state-dir", "b", "audit", "--json", "--json"],
    ["update", "c1", "--cpuset-cpus", "0"], ["update", "--json", "c1", "-r", "-"],
    ["update", "c1", "--cpuset-cpus=0", "--json"], ["update", "c1", "--cpuset-cpus", "--json"],
    ["update", "c1", "-rFILE"], ["update", "c1", "-r", "a", "-r", "b"], ["update", "c1"],
    ["update", "--", "-c1"], ["show", "-"], ["reconcile"], ["reconcile", "--once", "--json"],
    ["serve", "--interval", " 5 ", "--workers", "1_000"], ["serve", "--metrics-port", "-1"],
    ["serve", "--interval=1e9", "--node-name", "n", "--kubeconfig", "/k"],
    ["hook", "--strict", "prestart"], ["--helper-policy", "x", "hook", "prestart", "--strict"],
    ["schema"], ["schema", "show"], ["install", "--root", "/r", "--env", "A=1", "--env", "B=2"],
    ["uninstall", "--root=/r", "--prefix", "/p"], ["explain", "0"], ["guest-map", "c1"],
    ["topology"], ["demo"], ["doctor", "--dry-run"], ["status", "--json"], ["cluster"],
]
REFUSED = [
    [], ["--help"], ["-h"], ["nosuch"], ["--bogus"], ["--state-dir"], ["containers", "-h"],
    ["update", "--help"], ["update", "--bogus"], ["show"], ["show", "a", "b"],
    ["containers", "--json=1"], ["--state-dir", "containers"], ["containers", "--", "x"],
    ["update", "c1", "--cpuset-cpus"], ["serve", "--interval", "x"], ["serve", "--workers", "1.5"],
    ["serve", "--interval"], ["serve", "extra"], ["reconcile", "--once=1"], ["install"],
    ["containers", "--json", "--state-dir", "x"], ["guest"], ["guest", "nosuch"],
    ["guest", "hook", "--help"], ["--helper-policy", "x", "hook", "--bogus", "prestart"],
    ["schema", "a", "b"], ["hook", "--help"], ["containers", "-x"],
]


def test_the_table_parser_reads_argv_as_click_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both readers of the one table agree: what click accepts, clispec.parse reads to the
    same global options, command and values (so typer never runs a command); what it refuses,
    clispec.parse leaves to typer.  In-process: click is asked through the typer app with its
    commands' run replaced by a recorder."""
    from vmpin import cli
    from vmpin.service import clispec

    monkeypatch.setenv("VMPIN_KUBECONFIG", "/from-env")
    monkeypatch.delenv("NODE_NAME", raising=False)
    monkeypatch.delenv("VMPIN_METRICS_ADDRESS", raising=False)
    ran: list[tuple[dict[str, str], str, dict[str, object]]] = []
    monkeypatch.setattr(cli, "run", lambda given, name, values: ran.append(
        (given, name, values)) or 0)
    for args in ACCEPTED + REFUSED:
        ran.clear()
        code = cli.explain(list(args))
        parsed = clispec.parse(list(args))
        if args in ACCEPTED:
            assert (code, ran) == (0, [parsed]), args
        else:
            assert (ran, parsed) == ([], None), args
            assert code in (0, 2), args


def test_commands_and_bodies_are_one_table() -> None:
    """Every command of the table has one body, taking exactly its arguments and options."""
    import inspect

    from vmpin.service import clispec, commands

    own = [name for name, spec in clispec.COMMANDS.items() if spec.own]
    assert own == ["guest hook", "guest follow"]  # (vmpin.entry runs vmpin.guest's)
    for name, spec in clispec.COMMANDS.items():
        if spec.own:
            assert spec.module == ""
            continue
        params = list(inspect.signature(commands.body(name)).parameters)
        assert sorted(params[1:]) == sorted(p.key for p in (*spec.args, *spec.options)), name


def test_commands_need_no_typer(env: dict[str, str], tmp_path: Path, node: str) -> None:
    """Every command runs without typer (nor, off the tests' VMPIN_CHECK_VIEWS, pydantic);
    and with libvirt left at its default (qemu:///system when its daemon runs), a read
    command loads libvirt only where that daemon runs."""
    from vmpin.runtimes.libvirtd import SYSTEM_SOCKETS

    quiet = {k: v for k, v in env.items() if k not in ("VMPIN_CHECK_VIEWS", "VMPIN_LIBVIRT")}
    daemon = any(os.path.exists(s) for s in SYSTEM_SOCKETS)
    probe = tmp_path / "probe.json"
    for args, want in ((["sandboxes", "--json"], ["libvirt"] if daemon else []),
                       (["--libvirt", "none", "topology"], []),
                       (["--libvirt", "none", "show", node], [])):  # fmt: skip
        out = subprocess.run([sys.executable, "-c", PROBE, *args],
                             env={**quiet, "PROBE_OUT": str(probe)}, capture_output=True,
                             text=True, timeout=60)  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert json.loads(probe.read_text()) == want, args
    out = subprocess.run([sys.executable, "-c", PROBE, "sandboxes", "--json"],
                         env={**quiet, "PROBE_OUT": str(probe)}, capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    assert [s["id"] for s in json.loads(out.stdout)] == [node]
    for args in (["--help"], ["show"]):  # typer explains: help, or usage and exit 2
        out = subprocess.run([sys.executable, "-c", PROBE, *args],
                             env={**quiet, "PROBE_OUT": str(probe)}, capture_output=True,
                             text=True, timeout=60)  # fmt: skip
        assert out.returncode == (0 if args == ["--help"] else 2)
        assert "typer" in json.loads(probe.read_text())


def test_a_broken_store_is_one_line(env: dict[str, str]) -> None:
    init(env)
    (Path(env["VMPIN_STATE_DIR"]) / "state.db").write_bytes(b"not a database" * 512)
    for args in (["containers"], ["audit", "--json"], ["update", "x", "--cpuset-cpus", "0"]):
        out = vmpin(env, *args)
        assert out.returncode == 2, args
        assert out.stderr.startswith("vmpin: error: ") and out.stderr.count("\n") == 1, args
        assert "state.db" in out.stderr, args
