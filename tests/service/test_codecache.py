"""The hook's code cache (vmpin.lean.codecache): served when it checks out, never stale.

Each test runs the real launcher's hook (a plain container's prestart, no agent: it journals)
or a command in a fresh interpreter on a private copy of the package, so the cache it writes
and the sources it changes are its own.  The probe reports, for every vmpin module the hook loaded,
which loader loaded it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from vmpin.linux.paths import HostPaths

CRI = "io.kubernetes.cri."

PROBE = """
import json, os, sys
pkg, state, argv = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
sys.path.insert(0, pkg)
sys.argv = ["vmpin", *argv]
r, w = os.pipe()
os.write(w, state.encode())
os.close(w)
os.dup2(r, 0)
sys.stdin = open(0, "r", closefd=False)
real_exit = os._exit
def report(code):
    loaders = {n: type(m.__spec__.loader).__name__ for n, m in list(sys.modules.items())
               if n.startswith("vmpin.") and getattr(m, "__spec__", None) is not None}
    marker = getattr(sys.modules.get("vmpin.state.journal"), "CACHE_TEST_MARKER", None)
    # what the import statement calls for a module not yet loaded
    fast = getattr(sys.modules["_frozen_importlib"]._find_and_load, "__name__", "")
    # each vmpin module as the ordinary import leaves it: where it came from, its package,
    # an attribute of its parent package
    wrong = []
    for n, m in list(sys.modules.items()):
        if not n.startswith("vmpin."):
            continue
        parent, _, child = n.rpartition(".")
        package = n if hasattr(m, "__path__") else parent
        if (m.__file__ != m.__spec__.origin or m.__loader__ is not m.__spec__.loader
                or m.__package__ != package or getattr(sys.modules[parent], child) is not m
                or (hasattr(m, "__path__") and m.__path__ != [os.path.dirname(m.__file__)])):
            wrong.append(n)
    sys.stdout.write("LOADERS " + json.dumps({"code": code, "loaders": loaders,
                                              "marker": marker, "fast": fast,
                                              "wrong": wrong}) + "\\n")
    sys.stdout.flush()
    real_exit(code)
os._exit = report
from vmpin.entry import console
console()
"""


@pytest.fixture
def pkg(tmp_path: Path) -> Path:
    """A private copy of the vmpin package (sources only: no .pyc, no cache)."""
    dest = tmp_path / "pkg"
    shutil.copytree(ROOT / "vmpin", dest / "vmpin", ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def cache_file(pkg: Path) -> Path:
    return pkg / "vmpin" / "__pycache__" / f"vmpin-hook.{sys.implementation.cache_tag}.marshal"


def run_hook(
    pkg: Path, env: dict[str, str], tmp_path: Path, n: int, *, write: bool = True
) -> dict[str, object]:
    """One plain-container prestart (it journals); what the probe saw."""
    bundle = tmp_path / f"bundle{n}"
    bundle.mkdir()
    ann = {CRI + "container-type": "sandbox", CRI + "sandbox-id": f"cc{n}"}
    (bundle / "config.json").write_text(json.dumps({"annotations": ann}))
    state = {"id": f"cc{n}", "bundle": str(bundle), "annotations": ann, "pid": os.getpid()}
    return probe(pkg, env, ["hook", "--strict", "prestart"], json.dumps(state), write=write)


def probe(
    pkg: Path, env: dict[str, str], argv: list[str], stdin: str = "", *, write: bool = True
) -> dict[str, object]:
    """The launcher run on ``pkg`` with ``argv`` (``stdin`` its input); what the probe saw."""
    run_env = {k: v for k, v in env.items() if k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPATH")}
    if not write:
        run_env["PYTHONDONTWRITEBYTECODE"] = "1"
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, str(pkg), stdin, json.dumps(argv)],
        capture_output=True, text=True, timeout=60, env=run_env,
    )  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("LOADERS ")]
    assert lines, (proc.returncode, proc.stdout, proc.stderr)
    out: dict[str, object] = json.loads(lines[-1][len("LOADERS ") :])
    assert out["code"] == 0, proc.stderr
    return out


def served(out: dict[str, object]) -> set[str]:
    loaders = out["loaders"]
    assert isinstance(loaders, dict)
    return {n for n, kind in loaders.items() if kind == "CodeCache"}


def test_cache_is_written_once_then_serves_the_hook(
    pkg: Path, env: dict[str, str], tmp_path: Path, paths: HostPaths
) -> None:
    first = run_hook(pkg, env, tmp_path, 1)
    assert served(first) == set()  # nothing to serve yet; the hook wrote it after its work
    assert cache_file(pkg).is_file()
    before = cache_file(pkg).stat()
    second = run_hook(pkg, env, tmp_path, 2)
    loaders = second["loaders"]
    assert isinstance(loaders, dict)
    # every vmpin module after the launcher's own two (imported before the cache is put in)
    assert served(second) == set(loaders) - {"vmpin.entry", "vmpin.lean.codecache",
                                             "vmpin.lean"}, loaders  # fmt: skip
    assert "vmpin.state.journal" in served(second)
    # served around importlib's machinery (the module docstring), each module as importlib
    # would have left it; the first hook, with nothing to serve, left importlib alone
    assert (first["fast"], second["fast"]) == ("_find_and_load", "find_and_load")
    assert first["wrong"] == second["wrong"] == []
    # a hit writes nothing
    after = cache_file(pkg).stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    # both hooks did their work
    assert len(os.listdir(os.path.join(paths.state_dir, "journal"))) == 2


def test_a_changed_source_is_imported_from_source_and_cached_again(
    pkg: Path, env: dict[str, str], tmp_path: Path
) -> None:
    run_hook(pkg, env, tmp_path, 1)
    journal = pkg / "vmpin" / "state" / "journal.py"
    journal.write_text(journal.read_text() + "\nCACHE_TEST_MARKER = 1\n")
    out = run_hook(pkg, env, tmp_path, 2)
    assert out["marker"] == 1  # the new source ran, not the cached code
    assert "vmpin.state.journal" not in served(out)
    assert "vmpin.linux.files" in served(out)  # the others still come from the cache
    again = run_hook(pkg, env, tmp_path, 3)
    assert again["marker"] == 1 and "vmpin.state.journal" in served(again)


@pytest.mark.parametrize("spoil", ["group-writable", "garbage", "cut-short", "other-package"])
def test_a_cache_that_does_not_check_out_is_not_read(
    pkg: Path, env: dict[str, str], tmp_path: Path, spoil: str
) -> None:
    run_hook(pkg, env, tmp_path, 1)
    f = cache_file(pkg)
    if spoil == "group-writable":
        f.chmod(0o664)
    elif spoil == "garbage":
        f.write_bytes(b"\x00not marshal" * 10)
    elif spoil == "cut-short":  # (a full disk while it was written, a copy cut off)
        with open(f, "r+b") as cut:
            cut.truncate(f.stat().st_size - 100)
    else:  # made for the same package at another path (another venv, a moved install)
        other = tmp_path / "other"
        shutil.copytree(pkg, other)
        run_hook(other, env, tmp_path, 2)  # builds other's cache
        shutil.copyfile(cache_file(other), f)
    out = run_hook(pkg, env, tmp_path, 3)
    assert served(out) == set()
    # and it is put right by that hook (mode 0644, whole, for this package)
    assert f.stat().st_mode & 0o777 == 0o644
    assert served(run_hook(pkg, env, tmp_path, 4))


def test_no_cache_written_when_python_is_told_not_to_write_bytecode(
    pkg: Path, env: dict[str, str], tmp_path: Path
) -> None:
    run_hook(pkg, env, tmp_path, 1, write=False)
    assert not cache_file(pkg).exists()
    # nowhere to write it is no error either (a read-only install: here __pycache__ is a
    # file, which even root cannot write into): the hook imports the ordinary way
    (pkg / "vmpin" / "__pycache__").write_text("")
    out = run_hook(pkg, env, tmp_path, 2)
    assert served(out) == set() and (pkg / "vmpin" / "__pycache__").is_file()


SERVE = """
import json, marshal, os, sys, threading
sys.path.insert(0, sys.argv[1])
import vmpin
from vmpin.lean import codecache as cc
from vmpin.lean import codewriter
root = vmpin.__path__[0]
texts = {
    "vmpin.zz_ok": "import vmpin.zz_dep\\nY = vmpin.zz_dep.Z\\n",
    "vmpin.zz_dep": "Z = 2\\n",
    "vmpin.zz_boom": "import vmpin.zz_dep2\\nraise RuntimeError('boom')\\n",
    "vmpin.zz_dep2": "",
    "vmpin.zz_stale": "S = 'cached'\\n",
    "vmpin.zz_thread": "T = 1\\n",
    "vmpin.zzz_cut": "C = 1\\n",
}
codes = {}
for name, text in texts.items():
    path = os.path.join(root, name.split(".")[1] + ".py")
    with open(path, "w") as f:
        f.write(text)
    st = os.stat(path)
    codes[name] = (path, st.st_mtime_ns, st.st_size, False,
                   marshal.dumps(compile(text, path, "exec")))
os.makedirs(os.path.dirname(cc.cache_path(root)), exist_ok=True)
with open(cc.cache_path(root), "wb") as f:
    for chunk in codewriter._layout(root, codes):
        f.write(chunk)
cache = cc.install()
assert cache is not None and cache.slow is not None
slow, by_importlib = cache.slow, []
cache.slow = lambda name, import_: (by_importlib.append(name), slow(name, import_))[1]
out = {}
import vmpin.zz_ok
out["ok"] = [vmpin.zz_ok.Y, vmpin.zz_ok.__loader__ is cache, vmpin.zz_ok.__package__]
try:
    import vmpin.zz_boom
except RuntimeError as err:
    out["boom"] = [str(err), "vmpin.zz_boom" in sys.modules, hasattr(vmpin, "zz_boom"),
                   "vmpin.zz_dep2" in sys.modules]
with open(os.path.join(root, "zz_stale.py"), "w") as f:
    f.write("S = 'source!'\\n")  # changed after the cache was made
import vmpin.zz_stale
out["stale"] = [vmpin.zz_stale.S, cache.missed]
cache.missed = False
with open(cc.cache_path(root), "r+b") as f:  # cut short after the hook opened it
    f.truncate(os.fstat(f.fileno()).st_size - 2)
import vmpin.zzz_cut
out["cut"] = [vmpin.zzz_cut.C, cache.missed, "vmpin.zzz_cut" in cache.entries]
go = threading.Event()
t = threading.Thread(target=go.wait)
t.start()
import vmpin.zz_thread  # another thread runs: importlib, with its module locks
go.set()
t.join()
out["thread"] = [vmpin.zz_thread.T, type(vmpin.zz_thread.__loader__).__name__]
out["importlib"] = sorted(set(by_importlib) & set(texts))
print(json.dumps(out))
"""


def test_the_cache_serves_imports_as_importlib_would_and_hands_it_what_it_cannot(
    pkg: Path,
) -> None:
    """The cache's own import path: a module that raises is not left behind; a changed
    source, a file cut short since it was opened, or a second thread go to importlib."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run([sys.executable, "-c", SERVE, str(pkg)], capture_output=True,
                          text=True, timeout=60, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["ok"] == [2, True, "vmpin"]
    # raised while it ran: gone from sys.modules and from its package; what it imported stays
    assert out["boom"] == ["boom", False, False, True]
    assert out["stale"] == ["source!", True]  # the new source ran
    assert out["cut"] == [1, True, False]  # from source; the save after puts it back
    assert out["thread"] == [1, "CodeCache"]  # importlib, through the cache's find_spec
    assert out["importlib"] == ["vmpin.zz_stale", "vmpin.zz_thread", "vmpin.zzz_cut"]


def run_command(pkg: Path, env: dict[str, str], *argv: str) -> dict[str, object]:
    """``vmpin ARGV`` run as the console script; what the probe saw."""
    return probe(pkg, env, list(argv))


def test_a_command_is_served_from_the_cache_too(
    pkg: Path, env: dict[str, str], tmp_path: Path
) -> None:
    """``update`` and the read commands pay the import system's work as the hook did (~10%
    of ``vmpin update``'s instructions): the first run writes what it imported, the next one
    is served, and the hook's entries stay."""
    run_hook(pkg, env, tmp_path, 1)
    first = run_command(pkg, env, "containers", "--json")
    assert "vmpin.state.journal" in served(first)  # (the hook's entry, still good)
    assert "vmpin.service.commands" not in served(first)  # not cached yet: written after
    second = run_command(pkg, env, "containers", "--json")
    assert {"vmpin.service.commands", "vmpin.service.clispec", "vmpin.wire.views"} <= served(
        second
    )
    assert second["fast"] == "find_and_load" and second["wrong"] == []
    # and the hook still is (the file is the union of what each path imported)
    assert "vmpin.service.hook" in served(run_hook(pkg, env, tmp_path, 2))


def test_the_agent_imports_as_any_program_does(pkg: Path) -> None:
    """``serve`` lives on and imports late, from threads: the cache is taken out again."""
    probe = (
        "import sys; sys.path.insert(0, sys.argv[1]); import vmpin\n"
        "from vmpin.lean import codecache as cc\n"
        "import importlib._bootstrap as b\n"
        "before = b._find_and_load\n"
        "cache = cc.install(); cache.serve_imports(); cc.uninstall(cache)\n"
        "print(b._find_and_load is before, cache not in sys.meta_path, cache.fd)\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe, str(pkg)], capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert proc.stdout.split() == ["True", "True", "None"], proc.stderr
