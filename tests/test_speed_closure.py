"""The speed layer stays in the hooks' closure (issue 27; ../shared/STYLE.md, last section).

Two programs run on every container start: ``vmpin hook`` on the host (its modules are
:data:`vmpin.service.hookfile.HOOK_MODULES`, the closure tests/service/test_hookfile.py checks)
and the guest program inside a Kata guest (:data:`vmpin.guest.bundle.GUEST_MODULES`).  Only
their modules may follow the lean rules (``TYPE_CHECKING = False`` to keep ``typing`` unloaded,
records from :mod:`vmpin.lean.records`, imports deferred into functions).  Every other module is
plain Python: ``typing`` and ``dataclasses`` as anyone writes them, imports at the top.  A
function-local import outside the closure is allowed only for an optional or heavy extra that
a process may never need, each named below with its reason.

Checked from the sources (ast), so a lean idiom that leaks out of the closure fails here
whatever the benchmark says.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from vmpin.guest.bundle import GUEST_MODULES
from vmpin.service.clispec import COMMANDS
from vmpin.service.hookfile import HOOK_MODULES

ROOT = Path(__file__).resolve().parents[1]

#: the speed layer itself (vmpin/lean/, one room): only the closure may import it
SPEED_MODULES = frozenset(
    {"vmpin.lean", "vmpin.lean.records", "vmpin.lean.dataclass", "vmpin.lean.shapes",
     "vmpin.lean.initshapes", "vmpin.lean.codecache", "vmpin.lean.codewriter"}
)

#: the fast route's own modules: ``vmpin update`` and the read commands are measured figures
#: too (issue 28: update at 0.5x the peer tool, reads within 3x a bare interpreter), and
#: ``typing`` alone is ~5 ms against a bare interpreter's ~10 ms; the dispatcher loads each
#: command's modules only when that command runs
FAST_ROUTE = frozenset(
    {"vmpin/service/clispec.py", "vmpin/service/commands.py", "vmpin/service/update.py"}
    # (the commands' bodies, by group: the modules the table names)
    | {f"vmpin/service/{c.module}.py" for c in COMMANDS.values() if c.module}
)

#: what the hooks' closure holds: their modules, the console dispatcher, the speed layer
CLOSURE = (
    frozenset(HOOK_MODULES)
    | frozenset(GUEST_MODULES)
    | {"vmpin/entry.py"}
    | {str(p.relative_to(ROOT)) for p in (ROOT / "vmpin" / "lean").glob("*.py")}
    | FAST_ROUTE
)

#: imports a module outside the closure may defer into a function, and why
LAZY_EXTRAS = {
    "vmpin.service.kube": "the kubernetes client: 335 ms and 35 MB, only with credentials",
    "vmpin.runtimes.libvirt": "libvirt-python, an optional extra",
    "vmpin.reconcile.domains": "libvirt's threads and adapter, only where a daemon runs",
    "vmpin.service.domain_events": "libvirt's event loop, only with domains",
    "vmpin.service.watch": "inotify_simple, the agent's alone",
    "tomllib": "Python 3.11+ only; 3.10 is refused with one line where TOML is read",
}


def _modules() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "vmpin").rglob("*.py"))


def _outside() -> list[str]:
    return [m for m in _modules() if m not in CLOSURE]


def _imported(node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    return [base] + [f"{base}.{alias.name}" for alias in node.names]


def _function_imports(tree: ast.AST) -> list[tuple[int, list[str]]]:
    found = []
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    found.append((node.lineno, _imported(node)))
    return found


def _is_lean_guard(node: ast.stmt) -> bool:
    """``TYPE_CHECKING = False``: the hook's way of keeping typing unloaded."""
    return (
        isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "TYPE_CHECKING" for t in node.targets)
        and isinstance(node.value, ast.Constant)
        and node.value.value is False
    )


def test_the_closure_lists_only_real_modules() -> None:
    missing = sorted(m for m in CLOSURE if not (ROOT / m).is_file())
    assert missing == []


@pytest.mark.parametrize("module", _outside())
def test_outside_the_closure_is_plain_python(module: str) -> None:
    tree = ast.parse((ROOT / module).read_text(), module)
    problems = [
        f"{module}:{node.lineno}: TYPE_CHECKING = False (use typing.TYPE_CHECKING)"
        for node in tree.body
        if _is_lean_guard(node)
    ]
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            speed = sorted(set(_imported(node)) & SPEED_MODULES)
            if speed:
                problems.append(f"{module}:{node.lineno}: imports the speed layer {speed}")
    for lineno, names in _function_imports(tree):
        if not any(n in LAZY_EXTRAS or n.split(".")[0] in LAZY_EXTRAS for n in names):
            problems.append(f"{module}:{lineno}: imports {names[0]} inside a function")
    assert problems == []


def test_the_speed_layer_serves_the_closure() -> None:
    """Something in the closure still needs each speed module (else it goes: issue 27)."""
    used: set[str] = set()
    for module in CLOSURE:
        tree = ast.parse((ROOT / module).read_text(), module)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                used.update(_imported(node))
    assert SPEED_MODULES - {"vmpin.lean", "vmpin.lean.shapes"} <= used


def test_the_speed_layer_is_one_room() -> None:
    """Every speed module lives in vmpin/lean/ and nowhere else (issue 27: not three places
    in two layers)."""
    rooms = {m.rpartition(".")[0] if m.count(".") > 1 else m for m in SPEED_MODULES}
    assert rooms == {"vmpin.lean"}
    found = {p.stem for p in (ROOT / "vmpin" / "lean").glob("*.py")} - {"__init__"}
    assert {m.rpartition(".")[2] for m in SPEED_MODULES if m.count(".") > 1} == found
