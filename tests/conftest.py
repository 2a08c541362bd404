"""Shared fixtures (a private state dir and HostPaths per test, pointing at the real host) and
the suite's honesty rules.

Markers (tests/support/capabilities.py owns the probes): every test that drives a component
for real carries its marker (``qemu``, ``tcg``, ``kvm``, ``runc``, ``containerd``, ``podman``,
``libvirtd``, ``cgroup_v1``, ``cgroup_v2``, ``multi_cpu``), so ``-m "not qemu and not runc"``
starts no QEMU and no container; every test with a marker of :data:`capabilities.TOUCHES_HOST`
also gets ``host``, so ``-m "not host"`` runs only tests that start nothing outside their
own processes and tmp dirs.  A test whose component is missing is skipped with the probe's
reason; with ``VMPIN_TEST_STRICT=1`` (``.ci/run``) it FAILS instead, and so does any skip
raised inside a test that carries an integration marker, unless the reason is a property of
the host (:data:`capabilities.HOST_LACKS`: cgroup v2 on a v1 host, no KVM).  A ``multi_cpu``
test runs with its affinity widened to every online CPU (processes here start on {0}).

At session start, what dead test sessions left behind (their QEMUs, their cgroups) is swept,
by the creator identity each id carries (tests/support/session.py), never by name alone.
"""

from __future__ import annotations

import collections
import os
import shutil
import sys
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import capabilities, fakevmm
from tests.support.session import Swept, sweep, vmpin_env
from vmpin.linux.paths import HostPaths

ROOT = Path(__file__).resolve().parent.parent
pytest_plugins = ["tests.support.agents"]  # the ``agents`` fixture: ``vmpin serve`` subprocesses
FIXTURES = Path(__file__).resolve().parent / "fixtures"
# every --json view any vmpin prints under the tests is checked against its pydantic model
# (Settings.check_views: off in production, where pydantic costs a read command
# four bare interpreters)
os.environ.setdefault("VMPIN_CHECK_VIEWS", "1")


def vmpin_cmd() -> list[str]:
    """How tests run the CLI: the console script beside this interpreter (a venv's bin/, which
    need not be on PATH), else the one on PATH, else the module."""
    beside = os.path.join(os.path.dirname(sys.executable), "vmpin")
    if os.access(beside, os.X_OK):
        return [beside]
    exe = shutil.which("vmpin")
    return [exe] if exe else [sys.executable, "-m", "vmpin"]


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    d = tmp_path / "state"
    d.mkdir()
    return d


@pytest.fixture
def vm_dir(tmp_path: Path) -> Path:
    d = tmp_path / "vm"
    d.mkdir()
    return d


@pytest.fixture
def paths(state_dir: Path, vm_dir: Path, tmp_path: Path) -> HostPaths:
    runc_root = tmp_path / "runc"
    publish = tmp_path / "publish"
    return HostPaths(
        state_dir=str(state_dir),
        vm_dir=str(vm_dir),
        runc_root=str(runc_root),
        kubelet_state=str(tmp_path / "cpu_manager_state"),
        publish_dir=str(publish),
        # Kata's configuration: this test's own (none unless it writes one), never the host's
        kata_config=str(tmp_path / "kata" / "configuration.toml"),
    )


@pytest.fixture
def env(paths: HostPaths) -> dict[str, str]:
    """Environment for a vmpin subprocess that uses this test's paths."""
    return vmpin_env(paths)


@pytest.fixture
def vmms(vm_dir: Path) -> Iterator[Callable[..., fakevmm.FakeVmm]]:
    """Start fake VMMs in this test's VM dir (tests/support/fakevmm.py: ``start(sid, vcpus=2,
    ...)``); each is killed by its pid when the test ends."""
    started: list[fakevmm.FakeVmm] = []

    def start(sid: str, **kw: Any) -> fakevmm.FakeVmm:
        started.append(fakevmm.start(vm_dir, sid, **kw))
        return started[-1]

    try:
        yield start
    finally:
        for v in started:
            v.kill()


@pytest.fixture
def bytecode_env(env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """``env`` for vmpin processes that run as on a node, from compiled bytecode: written
    once under the session's tmp dir and read by every later process.  This environment sets
    ``PYTHONDONTWRITEBYTECODE``, so otherwise every vmpin process compiles vmpin from source
    (0.19 s of an update's 0.26 s here): for tests that time vmpin or start hundreds."""
    out = {k: v for k, v in env.items() if k != "PYTHONDONTWRITEBYTECODE"}
    out["PYTHONPYCACHEPREFIX"] = str(tmp_path_factory.getbasetemp() / "pycache")
    return out


# -- the suite's honesty rules ---------------------------------------------------------------
STRICT = os.environ.get("VMPIN_TEST_STRICT", "") not in ("", "0")
MARKERS = tuple(capabilities.MARKERS)
#: fixtures that imply a marker, so a test cannot use one and forget the other.
FIXTURE_MARKERS = {
    "runc": "runc",
    "qemu": "qemu",
    "qemu_factory": "qemu",
    "wide_affinity": "multi_cpu",
}

_swept: Swept | None = None
_collected: collections.Counter[str] = collections.Counter()
_outcomes: dict[str, collections.Counter[str]] = {m: collections.Counter() for m in MARKERS}


def pytest_sessionstart(session: pytest.Session) -> None:
    global _swept
    _swept = sweep()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        for fixture, marker in FIXTURE_MARKERS.items():
            used = fixture in getattr(item, "fixturenames", ())
            if used and item.get_closest_marker(marker) is None:
                item.add_marker(marker)
        if any(item.get_closest_marker(m) is not None for m in capabilities.TOUCHES_HOST):
            item.add_marker("host")


def pytest_collection_finish(session: pytest.Session) -> None:
    for item in session.items:  # after -m/-k deselection: what will run
        _collected.update(_integration_markers(item))


def _integration_markers(item: pytest.Item) -> list[str]:
    return [m for m in MARKERS if item.get_closest_marker(m) is not None]


def pytest_runtest_setup(item: pytest.Item) -> None:
    for marker in _integration_markers(item):
        why = capabilities.missing(marker)
        if why is None:
            continue
        if STRICT and not why.startswith(capabilities.HOST_LACKS):
            pytest.fail(f"VMPIN_TEST_STRICT: [{marker}] cannot run here: {why}", pytrace=False)
        pytest.skip(f"[{marker}] {why}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    markers = _integration_markers(item)
    if STRICT and report.skipped and markers and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if capabilities.HOST_LACKS not in reason:
            report.outcome = "failed"
            report.longrepr = f"VMPIN_TEST_STRICT: integration test {markers} skipped: {reason}"
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        for marker in markers:
            _outcomes[marker][report.outcome] += 1


@pytest.fixture(autouse=True)
def _multi_cpu_affinity(request: pytest.FixtureRequest) -> Iterator[None]:
    """A ``multi_cpu`` test runs on every online CPU, then gets its old affinity back."""
    if request.node.get_closest_marker("multi_cpu") is None:
        yield
        return
    with capabilities.widen_affinity():
        yield


@pytest.fixture
def wide_affinity() -> Iterator[set[int]]:
    """The online CPUs, with this process's affinity widened to them for the test."""
    with capabilities.widen_affinity() as cpus:
        yield cpus


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    tr = terminalreporter
    if _swept:
        tr.write_line(
            f"swept leftovers of dead test sessions: {len(_swept.processes)} processes "
            f"{_swept.processes}, {len(_swept.cgroups)} cgroups {_swept.cgroups}"
            + (f"; errors: {_swept.errors}" if _swept.errors else "")
        )
    counts = []
    for m, c in _outcomes.items():
        # collected, then any outcome other than passed: "qemu=49", "runc=19 (skipped 2)"
        others = ", ".join(f"{k} {v}" for k, v in sorted(c.items()) if k != "passed")
        counts.append(f"{m}={_collected[m]}" + (f" ({others})" if others else ""))
    tr.write_line("tests per marker: " + ", ".join(counts) + (" (strict)" if STRICT else ""))
