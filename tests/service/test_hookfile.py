"""The installed hook file (vmpin.service.hookfile): closed over what `vmpin hook` imports, run
by the host's own python3 with nothing else, and one clear line where it cannot run.

"The host's python3" is Debian's /usr/bin/python3 here (3.11, no venv, no vmpin in its
site-packages); other interpreters come from pyenv when this machine has them (skipped when
not).  Every run goes through the file itself, as a runtime runs a hook: ``execve`` of the
path with the hook's own environment (``PATH`` only, and the test's ``VMPIN_*`` paths).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support import runc_util
from tests.support.qemu_util import QemuHandle, qemu_factory
from tests.support.runc_util import RuncSession, new_id
from vmpin.linux.paths import ENVVARS, HostPaths
from vmpin.service import hookfile

ROOT = Path(__file__).resolve().parents[2]
HOST_PYTHON = "/usr/bin/python3"
HOOK_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
PYENV = Path("/root/.pyenv/versions")
CRI = "io.kubernetes.cri."

needs_host_python = pytest.mark.skipif(
    not os.access(HOST_PYTHON, os.X_OK), reason=f"{HOST_PYTHON} is not installed"
)


# -- the list is closed -----------------------------------------------------------------------
def _module_file(name: str) -> Path | None:
    base = ROOT.joinpath(*name.split("."))
    if (base / "__init__.py").exists():
        return base / "__init__.py"
    return base.with_suffix(".py") if base.with_suffix(".py").exists() else None


def _runtime_imports(name: str) -> set[str]:
    """Every module an import statement of ``name`` can load, at any depth of its code
    (imports in functions count: the hook imports lazily), but not under ``if
    TYPE_CHECKING:`` (never run)."""
    path = _module_file(name)
    assert path is not None, name
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if (isinstance(child, ast.If) and isinstance(child.test, ast.Name)
                    and child.test.id == "TYPE_CHECKING"):  # fmt: skip
                for stmt in child.orelse:
                    visit_stmt(stmt)
                continue
            visit_stmt(child)

    def visit_stmt(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package
                for _ in range(node.level - 1):
                    parent = parent.rpartition(".")[0]
                base = f"{parent}.{base}" if base else parent
            out.add(base)
            # `from vmpin.x import y` may load the submodule vmpin.x.y
            out.update(f"{base}.{a.name}" for a in node.names if _module_file(f"{base}.{a.name}"))
        visit(node)

    visit(ast.parse(path.read_text()))
    return out


def closure(roots: list[str]) -> tuple[set[str], set[str]]:
    """(vmpin modules, other top-level modules) reachable from ``roots``."""
    ours: set[str] = set()
    others: set[str] = set()
    todo = list(roots)
    while todo:
        name = todo.pop()
        if not name.startswith("vmpin"):
            others.add(name.split(".")[0])
            continue
        if name in ours:
            continue
        ours.add(name)
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # its packages run first
        todo += _runtime_imports(name)
    return ours, others


def shipped() -> set[str]:
    return {rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
            for rel in hookfile.HOOK_MODULES}  # fmt: skip


def test_hook_modules_are_exactly_the_hooks_closure() -> None:
    """HOOK_MODULES is the closure of vmpin.service.hook plus the dispatcher (vmpin.entry,
    whose module level imports only the stdlib; its hook route imports vmpin.service.hook,
    and the global options' table, vmpin.wire.argv, when an option leads)."""
    ours, others = closure(["vmpin.service.hook", "vmpin.wire.argv"])
    want = ours | {"vmpin", "vmpin.entry"}
    assert shipped() == want, (
        f"missing: {sorted(want - shipped())}, not imported: {sorted(shipped() - want)}"
    )
    # the hook is stdlib only: every other module is the interpreter's own
    assert others <= set(sys.stdlib_module_names), sorted(others - set(sys.stdlib_module_names))
    entry = ast.parse((ROOT / "vmpin" / "entry.py").read_text())
    top = {a.name for n in entry.body if isinstance(n, ast.Import) for a in n.names}
    top |= {n.module or "" for n in entry.body if isinstance(n, ast.ImportFrom)}
    assert top <= set(sys.stdlib_module_names), top
    assert len(hookfile.HOOK_MODULES) == len(set(hookfile.HOOK_MODULES))


def test_requires_python_is_the_projects() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    doc = tomllib.loads((ROOT / "pyproject.toml").read_text())
    text = ".".join(str(n) for n in hookfile.REQUIRES_PYTHON)
    assert doc["project"]["requires-python"] == f">={text}"


def test_boot_code_fits_in_the_prologue() -> None:
    """BOOT goes to python3 inside sh single quotes, and old Pythons must parse the guard."""
    assert "'" not in hookfile.BOOT
    assert hookfile.PROLOGUE.startswith("#!/bin/sh\n")
    assert "{" not in hookfile.BOOT and "f\"" not in hookfile.BOOT  # no f-strings, no dicts
    compile(hookfile.BOOT, "<boot>", "exec")
    compile(hookfile.MAIN, "<main>", "exec")


# -- running it -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hook_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The hook file, its bytecode compiled by the host's python3."""
    if not os.access(HOST_PYTHON, os.X_OK):
        pytest.skip(f"{HOST_PYTHON} is not installed")
    dest = tmp_path_factory.mktemp("hookfile") / "vmpin-hook"
    bytecode = hookfile.write(str(dest), [HOST_PYTHON])
    assert bytecode.python.startswith("/usr/bin/python3")
    return dest


def hook_env(paths: HostPaths, path: str = HOOK_PATH) -> dict[str, str]:
    """What a runtime gives the hook: PATH and vmpin's paths, nothing else."""
    env = {"PATH": path}
    env.update({var: getattr(paths, name) for name, var in ENVVARS.items()})
    return env


def run_hook(hook: Path, env: dict[str, str], *args: str, state: bytes = b"{}"
             ) -> subprocess.CompletedProcess[str]:  # fmt: skip
    return subprocess.run([str(hook), *args], input=state.decode(), env=env, cwd="/",
                          capture_output=True, text=True, timeout=60)  # fmt: skip


def containers(env: dict[str, str]) -> dict[str, dict[str, object]]:
    out = subprocess.run([sys.executable, "-m", "vmpin", "containers", "--json"],
                         capture_output=True, text=True, timeout=60, check=True,
                         env={**os.environ, **env})  # fmt: skip
    return {c["id"]: c for c in json.loads(out.stdout)}


def test_file_is_a_sh_script_and_a_zip(hook_file: Path) -> None:
    assert os.stat(hook_file).st_mode & 0o777 == 0o755
    assert hook_file.read_bytes().startswith(hookfile.PROLOGUE.encode())
    with zipfile.ZipFile(hook_file) as z:
        names = set(z.namelist())
        assert z.comment.decode() == hookfile.file_digest(str(hook_file))
    mods = set(hookfile.HOOK_MODULES)
    assert names == {"__main__.py"} | mods | {m[:-3] + ".pyc" for m in mods}


@needs_host_python
def test_host_python_has_no_vmpin_of_its_own() -> None:
    """(So the tests below prove the file is self-contained.)"""
    proc = subprocess.run([HOST_PYTHON, "-E", "-s", "-S", "-c", "import vmpin"], cwd="/",
                          env={"PATH": HOOK_PATH}, capture_output=True)  # fmt: skip
    assert proc.returncode != 0


def test_prestart_records_the_container(hook_file: Path, paths: HostPaths, tmp_path: Path
                                        ) -> None:  # fmt: skip
    """A plain container's prestart state, as runc writes it, through the file alone."""
    cid = new_id("hf")
    bundle = tmp_path / "bundles" / cid
    bundle.mkdir(parents=True)
    ann = {CRI + "container-type": "container", CRI + "sandbox-id": new_id("hf-pod"),
           CRI + "container-name": "app"}  # fmt: skip
    (bundle / "config.json").write_text(json.dumps(
        {"annotations": ann, "linux": {"resources": {"cpu": {"cpus": "0"}}}}))
    state = {"ociVersion": "1.0.2", "id": cid, "status": "creating", "pid": os.getpid(),
             "bundle": str(bundle), "annotations": ann}  # fmt: skip
    env = hook_env(paths)
    proc = run_hook(hook_file, env, "hook", "--strict", "prestart",
                    state=json.dumps(state).encode())  # fmt: skip
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    seen = containers(env)[cid]
    assert (seen["cpus"], seen["runtime"]) == ("0", "runc")


@pytest.mark.parametrize("strict", [False, True])
def test_no_python3_on_path_is_one_line(hook_file: Path, paths: HostPaths, tmp_path: Path,
                                        strict: bool) -> None:  # fmt: skip
    empty = tmp_path / "bin"
    empty.mkdir()
    args = ["hook", *(["--strict"] if strict else []), "prestart"]
    proc = run_hook(hook_file, hook_env(paths, str(empty)), *args)
    assert proc.returncode == (1 if strict else 0)
    assert proc.stderr.count("\n") == 1 and "no python3 on PATH" in proc.stderr
    assert ">= 3.10" in proc.stderr
    assert not os.path.exists(os.path.join(paths.state_dir, "journal"))


def _fake_old_python(bindir: Path) -> Path:
    """A python3 that is the host's with an old version: the guard (and the installer's
    compiler) read ``sys.version_info``, so it says 3.8.10 before their code runs."""
    bindir.mkdir()
    fake = bindir / "python3"
    fake.write_text(
        "#!/bin/sh\n"
        "# python3 -E -s -S -c CODE ARGS...: run CODE after making this look like 3.8\n"
        'boot=$5; shift 5\n'
        f'exec {HOST_PYTHON} -E -s -S -c "import sys\n'
        'sys.version_info = (3, 8, 10, \\"final\\", 0)\n'
        'sys.version = \\"3.8.10 (fake)\\"\n'
        f'sys.executable = \\"{fake}\\"\n'
        '$boot" "$@"\n'
    )
    fake.chmod(0o755)
    return fake


def _old_pythons(tmp: Path) -> Iterator[tuple[str, Path]]:
    yield "3.8.10", _fake_old_python(tmp / "fake")
    for v in ("3.9", "3.6", "2.7"):
        found = sorted(PYENV.glob(f"{v}.*/bin/python{v}"))
        if found:
            d = tmp / f"py{v}"
            d.mkdir()
            (d / "python3").symlink_to(found[-1])
            yield found[-1].parts[-3], d / "python3"


@needs_host_python
@pytest.mark.parametrize("strict", [False, True])
def test_old_python3_is_one_line(hook_file: Path, paths: HostPaths, tmp_path: Path,
                                 strict: bool) -> None:  # fmt: skip
    """A fake 3.8 always; real 3.9, 3.6 and 2.7 where pyenv has them: one line naming the
    interpreter and its version, nothing journaled, exit 0 (1 with --strict)."""
    seen = []
    for version, python in _old_pythons(tmp_path):
        args = ["hook", *(["--strict"] if strict else []), "prestart"]
        proc = run_hook(hook_file, hook_env(paths, f"{python.parent}:{HOOK_PATH}"), *args)
        assert proc.returncode == (1 if strict else 0), proc.stderr
        assert proc.stderr == (f"vmpin hook: {python} is Python {version}: the vmpin hook"
                               " needs Python >= 3.10; nothing done\n")  # fmt: skip
        seen.append(version)
    assert not os.path.exists(os.path.join(paths.state_dir, "journal"))
    print("old interpreters refused:", seen)


@pytest.mark.parametrize("version", ["3.10", "3.12", "3.13"])
def test_other_pythons_run_it(tmp_path: Path, paths: HostPaths, version: str) -> None:
    """Every Python >= 3.10 runs the file: with bytecode of its own when it compiled it,
    from the sources when the bytecode is another interpreter's (slower, still correct)."""
    found = sorted(PYENV.glob(f"{version}.*/bin/python{version}"))
    if not found:
        pytest.skip(f"no Python {version} here (pyenv)")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "python3").symlink_to(found[-1])
    own = tmp_path / "own"
    bytecode = hookfile.write(str(own), [str(found[-1])])
    assert bytecode.version[:2] == tuple(int(x) for x in version.split("."))
    with zipfile.ZipFile(own) as z:
        assert z.read("vmpin/service/hook.pyc")[:4] == bytecode.magic
    foreign = tmp_path / "foreign"
    hookfile.write(str(foreign))  # this interpreter's bytecode
    for hook in (own, foreign):
        b = tmp_path / f"bundle-{hook.name}"
        b.mkdir()
        (b / "config.json").write_text("{}")
        state = {"id": f"c-{hook.name}", "pid": os.getpid(), "bundle": str(b)}
        proc = run_hook(hook, hook_env(paths, f"{bindir}:{HOOK_PATH}"), "hook", "--strict",
                        "prestart", state=json.dumps(state).encode())  # fmt: skip
        assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert set(containers(hook_env(paths))) == {"c-own", "c-foreign"}


@needs_host_python
def test_compile_with_refuses_an_old_python(tmp_path: Path) -> None:
    """The installer asks the host's python3 first: one too old is an error naming it."""
    for version, python in _old_pythons(tmp_path):
        if version.startswith("2."):
            continue  # (json and base64 are there, but the answer is all the installer reads)
        with pytest.raises(hookfile.HookFileError) as err:
            hookfile.compile_with([str(python)], hookfile.sources(), "/x")
        assert str(err.value).endswith(f"is Python {version}: the vmpin hook needs Python"
                                       " >= 3.10")  # fmt: skip


@pytest.mark.parametrize("args", [["containers"], ["--strict", "audit"], ["hook", "--help"]])
def test_anything_but_the_hook_is_one_usage_line(hook_file: Path, paths: HostPaths,
                                                 args: list[str]) -> None:  # fmt: skip
    proc = run_hook(hook_file, hook_env(paths), *args)
    assert proc.returncode == (1 if "--strict" in args else 0)
    assert proc.stderr == hookfile_usage() + "\n"


def hookfile_usage() -> str:
    from vmpin.entry import HOOK_FILE_USAGE

    return HOOK_FILE_USAGE


def test_a_broken_file_is_one_line_and_fails_open(tmp_path: Path, paths: HostPaths) -> None:
    """A zip that lost its modules (a half-copied file): the hook cannot load, says so in one
    line, and the container starts (exit 0; 1 with --strict)."""
    if not os.access(HOST_PYTHON, os.X_OK):
        pytest.skip(f"{HOST_PYTHON} is not installed")
    srcs = hookfile.sources()
    srcs["vmpin/entry.py"] = b"raise ImportError('half an install')\n"
    broken = tmp_path / "vmpin-hook"
    broken.write_bytes(hookfile.build(srcs, None, str(broken)))
    broken.chmod(0o755)
    for strict in (False, True):
        args = ["hook", *(["--strict"] if strict else []), "prestart"]
        proc = run_hook(broken, hook_env(paths), *args)
        assert proc.returncode == (1 if strict else 0)
        assert proc.stderr == (f"vmpin hook: {broken}: cannot load vmpin: ImportError: half an"
                               " install\n")  # fmt: skip


def test_digest_names_what_it_is_made_of(tmp_path: Path) -> None:
    srcs = hookfile.sources()
    a = hookfile.digest(srcs, None, "/opt/vmpin/bin/vmpin-hook")
    assert a == hookfile.digest(dict(srcs), None, "/opt/vmpin/bin/vmpin-hook")
    assert a != hookfile.digest(srcs, None, "/usr/local/bin/vmpin-hook")
    changed = {**srcs, "vmpin/service/hook.py": srcs["vmpin/service/hook.py"] + b"\n"}
    assert a != hookfile.digest(changed, None, "/opt/vmpin/bin/vmpin-hook")


# -- under a real runtime ---------------------------------------------------------------------
@pytest.fixture
def runc(paths: HostPaths, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[RuncSession]:  # fmt: skip
    why = runc_util.missing()
    if why:
        pytest.skip(why)
    rootfs = runc_util.shared_rootfs(tmp_path_factory.getbasetemp())
    with RuncSession(paths, tmp_path, rootfs) as session:
        yield session


@pytest.mark.runc
@pytest.mark.cgroup_v1
def test_runc_runs_the_hook_file(runc: RuncSession, hook_file: Path, paths: HostPaths) -> None:
    """runc's own states (prestart with the container's pid, poststart, poststop at delete),
    runc's clean environment, the bundle as cwd: the container is recorded and forgotten."""
    cid = new_id("hf")
    env = hook_env(paths)
    pid = runc.run(cid, cpus="0", hooks=lambda stage: [str(hook_file), "hook", "--strict",
                                                       stage])  # fmt: skip
    seen = containers(env)[cid]
    assert (seen["cpus"], seen["runtime"], int(str(seen["pid"]))) == ("0", "runc", pid)
    runc.delete(cid)
    assert cid not in containers(env)


@pytest.fixture
def qemu(vm_dir: Path) -> Iterator[Callable[..., QemuHandle]]:
    with qemu_factory(vm_dir) as start:
        yield start


@pytest.mark.qemu
@pytest.mark.multi_cpu
def test_kata_pins_in_process_from_the_file(hook_file: Path, paths: HostPaths, tmp_path: Path,
                                            qemu: Callable[..., QemuHandle]) -> None:  # fmt: skip
    """The path that imports the most (no agent: the store, the reconciler, the planner,
    QMP, the guest map's publisher), all of it from the file: every QEMU thread on CPU 1."""
    q = qemu(new_id("hfk"), smp=2, debug_threads=True)
    shared = Path(paths.publish_dir) / q.sandbox_id / "mounts"
    shared.mkdir(parents=True)
    bundle = tmp_path / "c1"
    bundle.mkdir()
    ann = {CRI + "container-type": "container", CRI + "sandbox-id": q.sandbox_id,
           CRI + "container-name": "app"}  # fmt: skip
    (bundle / "config.json").write_text(json.dumps(
        {"annotations": ann, "linux": {"resources": {"cpu": {"cpus": "1"}}}}))
    state = {"id": "c1", "pid": q.pid, "bundle": str(bundle), "annotations": ann}
    proc = run_hook(hook_file, hook_env(paths), "hook", "--strict", "prestart",
                    state=json.dumps(state).encode())  # fmt: skip
    assert (proc.returncode, proc.stderr) == (0, "")
    assert "c1" in json.loads((shared / "vmpin" / "guest-map.json").read_text())["containers"]
    for tid in os.listdir(f"/proc/{q.pid}/task"):
        assert os.sched_getaffinity(int(tid)) == {1}, tid
