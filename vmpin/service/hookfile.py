"""The installed hook: ``vmpin hook`` as one file that the host's own ``python3`` runs.

``vmpin install`` puts it on a node (:mod:`vmpin.service.install`), the way kata-deploy puts
Kata there: no virtualenv, no pip, nothing but the host's ``python3`` (stdlib only) and this
file.  It carries exactly the modules ``vmpin hook`` can import (:data:`HOOK_MODULES`, a
closed list: ``tests/service/test_hookfile.py`` computes the closure of
:mod:`vmpin.service.hook` from the sources and compares), as a zip behind a short POSIX sh
prologue -- one file that is both a shell script and a zip archive:

- ``#!/bin/sh`` rather than ``#!/usr/bin/env python3``: when a node has no ``python3`` at all,
  ``env`` fails with exit 127, and a create-stage hook that fails fails **every container
  start** on the node.  The prologue instead says so in one line and exits 0 (1 with
  ``--strict``), as the hook itself does for any problem (fail-open, docs/hooks.md).  It costs
  what ``env`` costs: one small exec before the interpreter's.
- The prologue starts ``python3 -E -s -S -c BOOT FILE ARGS``: the interpreter's first lines
  refuse a Python older than :data:`REQUIRES_PYTHON` with one line (fail-open again), put this
  file first on ``sys.path`` (zipimport reads a zip behind any prefix) and run
  :func:`vmpin.entry.hook_file`.  ``-S`` skips ``site`` (the hook needs no site-packages;
  several ms on a distribution's python3, which may also load apport or distutils hooks),
  ``-E -s`` keep the host's ``PYTHON*`` variables and user site out.  Not run as a zipapp
  (``python3 FILE``, which also works: the zip has a ``__main__.py``) because that goes
  through :mod:`runpy`, whose imports (importlib.util, contextlib, collections, ...) were
  ~7 ms of every hook here.
- Bytecode: each module is in the zip as source and as an unchecked hash-based ``.pyc``
  compiled by the host's own interpreter when the installer can run it (else by the
  installer's).  zipimport takes the ``.pyc`` when its magic number is the running
  interpreter's and compiles the source otherwise: correct on any Python >= 3.10, but a
  mismatch compiles ~50 modules on every container start (~70 ms here), hence the host's
  interpreter, and re-installing after the host's python3 changes.
- The zip's comment is a digest of everything the file is made from (sources, boot code,
  the bytecode's interpreter, the file's path): an install that finds the same digest keeps
  the file as it is, so a re-install leaves the tree byte for byte as it was.  An install
  that does change it replaces it by rename: a hook that is importing at that very moment
  reads the old file's offsets in the new one and fails to load -- fail-open, one line, and
  the next pass pins what it missed.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass

from vmpin.core.errors import VmpinError

#: the project's requires-python (pyproject.toml; a test keeps the two equal)
REQUIRES_PYTHON = (3, 10)

#: what ``vmpin hook`` can import: the entry point's dispatcher and the closure of
#: vmpin.service.hook over every import statement it can run (tests/service/test_hookfile.py
#: computes it from the sources and fails when this list is not it).  Stdlib only.
HOOK_MODULES = (
    "vmpin/__init__.py",
    "vmpin/entry.py",
    "vmpin/core/__init__.py",
    "vmpin/lean/__init__.py",
    "vmpin/lean/dataclass.py",
    "vmpin/lean/initshapes.py",
    "vmpin/lean/records.py",
    "vmpin/lean/shapes.py",
    "vmpin/core/allocate.py",
    "vmpin/core/cpuset.py",
    "vmpin/core/errors.py",
    "vmpin/core/gojson.py",
    "vmpin/core/guestmap.py",
    "vmpin/core/ids.py",
    "vmpin/core/planner.py",
    "vmpin/core/podpolicy.py",
    "vmpin/core/topology.py",
    "vmpin/linux/__init__.py",
    "vmpin/linux/affinity.py",
    "vmpin/linux/cgroups.py",
    "vmpin/linux/debugfs.py",
    "vmpin/linux/files.py",
    "vmpin/linux/paths.py",
    "vmpin/linux/procfs.py",
    "vmpin/linux/sysfs.py",
    "vmpin/reconcile/__init__.py",
    "vmpin/reconcile/allocations.py",
    "vmpin/reconcile/apply.py",
    "vmpin/reconcile/audit.py",
    "vmpin/reconcile/observation.py",
    "vmpin/reconcile/observe.py",
    "vmpin/reconcile/observe_sandbox.py",
    "vmpin/reconcile/observe_vmm.py",
    "vmpin/reconcile/plan.py",
    "vmpin/reconcile/podpolicies.py",
    "vmpin/reconcile/reconciler.py",
    "vmpin/reconcile/report.py",
    "vmpin/reconcile/settled.py",
    "vmpin/reconcile/summarizer.py",
    "vmpin/reconcile/tables.py",
    "vmpin/runtimes/__init__.py",
    "vmpin/runtimes/kataconfig.py",
    "vmpin/runtimes/kubeletconfig.py",
    "vmpin/runtimes/kubelet.py",
    "vmpin/runtimes/oci.py",
    "vmpin/runtimes/publish.py",
    "vmpin/runtimes/qmp.py",
    "vmpin/runtimes/runcstate.py",
    "vmpin/runtimes/threads.py",
    "vmpin/runtimes/vmm.py",
    "vmpin/service/__init__.py",
    "vmpin/service/control.py",
    "vmpin/service/budget.py",
    "vmpin/service/hook.py",
    "vmpin/service/settings.py",
    "vmpin/state/__init__.py",
    "vmpin/state/allocating.py",
    "vmpin/state/allocations.py",
    "vmpin/state/changes.py",
    "vmpin/state/ingest.py",
    "vmpin/state/journal.py",
    "vmpin/state/locks.py",
    "vmpin/state/reader.py",
    "vmpin/state/records.py",
    "vmpin/state/schema.py",
    "vmpin/state/sqlite.py",
    "vmpin/state/store.py",
    "vmpin/state/summary.py",
    "vmpin/state/writer.py",
    "vmpin/wire/__init__.py",
    "vmpin/wire/argv.py",
    "vmpin/wire/control.py",
    "vmpin/wire/control_commands.py",
    "vmpin/wire/control_update.py",
    "vmpin/wire/guestmap.py",
    "vmpin/wire/hookevent.py",
    "vmpin/wire/jsonio.py",
    "vmpin/wire/views.py",
)

_MIN = ", ".join(str(n) for n in REQUIRES_PYTHON)
_MIN_TEXT = ".".join(str(n) for n in REQUIRES_PYTHON)
# The interpreter's first lines, in whatever Python runs them: no f-strings, no annotations,
# nothing newer than Python 3.0 before the version is known; no single quote (the prologue
# passes BOOT to python3 inside one).  One line on stderr and exit 0 (1 with --strict) for
# anything that keeps the hook from running: the hook is fail-open (docs/hooks.md).
_GUARD = (
    "import sys\n"
    'strict = "--strict" in sys.argv\n'
    f"if sys.version_info < ({_MIN}):\n"
    '    sys.stderr.write("vmpin hook: %s is Python %s: the vmpin hook needs Python'
    f' >= {_MIN_TEXT}; nothing done\\n"'
    ' % (sys.executable or "python3", sys.version.split()[0]))\n'
    "    sys.exit(1 if strict else 0)\n"
)
_LOAD = (
    "try:\n"
    "    from vmpin.entry import hook_file\n"
    "except Exception as err:\n"
    '    sys.stderr.write("vmpin hook: %s: cannot load vmpin: %s: %s\\n"'
    " % (sys.path[0], type(err).__name__, err))\n"
    "    sys.exit(1 if strict else 0)\n"
    "hook_file()\n"
)
#: ``python3 -c BOOT FILE ARGS...``: sys.argv is ["-c", FILE, ARGS...]; FILE goes first on
#: sys.path in place of "" (the working directory: runc runs hooks in the bundle)
BOOT = _GUARD + "sys.argv[0] = sys.path[0] = sys.argv.pop(1)\n" + _LOAD
#: ``python3 FILE ARGS...`` (a zipapp: runpy puts FILE on sys.path)
MAIN = _GUARD + _LOAD

PROLOGUE = f"""#!/bin/sh
# vmpin's OCI hook as one file: this sh prologue, then a zip of the vmpin modules that
# `vmpin hook` imports (stdlib only), run by the host's python3 (>= {_MIN_TEXT}).  Written by
# `vmpin install`, removed by `vmpin uninstall` (docs/hooks.md, "Installing on a node").
command -v python3 >/dev/null 2>&1 || {{
  echo "vmpin hook: no python3 on PATH ($PATH): the vmpin hook needs Python >= {_MIN_TEXT}; nothing done" >&2
  case " $* " in *" --strict "*) exit 1 ;; esac
  exit 0
}}
exec python3 -E -s -S -c '{BOOT}' "$0" "$@"
"""  # noqa: E501 (the echo is one line of sh)

# Runs in the interpreter that will run the hook (the host's python3), reading
# {rel: [filename, source]} as JSON on stdin; writes its version and, when it is new enough,
# an unchecked hash-based .pyc per module (PEP 552: flags 0b01, never compared with the
# source: the zip is written once and never changes).  Old Pythons must get as far as
# printing their version.
COMPILER = """
import base64, json, marshal, sys
out = {"version": list(sys.version_info[:3]), "executable": sys.executable, "pycs": {}}
if sys.version_info >= (MINIMUM):
    import importlib.util
    magic = importlib.util.MAGIC_NUMBER
    out["magic"] = base64.b64encode(magic).decode()
    for rel, (filename, source) in sorted(json.load(sys.stdin).items()):
        data = source.encode("utf-8")
        code = compile(data, filename, "exec", dont_inherit=True)
        pyc = magic + (1).to_bytes(4, "little") + importlib.util.source_hash(data)
        out["pycs"][rel] = base64.b64encode(pyc + marshal.dumps(code)).decode()
json.dump(out, sys.stdout)
""".replace("MINIMUM", _MIN)


class HookFileError(VmpinError):
    """The hook file cannot be made (a python3 that cannot compile it, a source missing)."""


@dataclass(frozen=True)
class Bytecode:
    """``.pyc`` files for one interpreter: the host's when the installer could run it."""

    python: str  # the interpreter that compiled them, e.g. /usr/bin/python3
    version: tuple[int, int, int]
    magic: bytes
    pycs: dict[str, bytes]  # module source path (vmpin/x.py) -> .pyc bytes

    @property
    def version_text(self) -> str:
        return ".".join(map(str, self.version))


def package_root() -> str:
    """The directory that holds the ``vmpin`` package this process runs."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def sources(root: str | None = None) -> dict[str, bytes]:
    """:data:`HOOK_MODULES`' sources, from the package this process runs."""
    root = root or package_root()
    out = {}
    for rel in HOOK_MODULES:
        try:
            with open(os.path.join(root, rel), "rb") as f:
                out[rel] = f.read()
        except OSError as err:
            raise HookFileError(f"{rel}: {err.strerror or err} (under {root})") from err
    return out


def compile_with(python: list[str], srcs: dict[str, bytes], path: str) -> Bytecode:
    """Compile ``srcs`` in the interpreter ``python`` (an argv prefix: ``["chroot", "/host",
    "python3"]``, ``["/usr/bin/python3"]``), for a hook file that will live at ``path``.

    Raises HookFileError when it does not run or answer, or is older than REQUIRES_PYTHON
    (the message says which version it is).
    """
    request = {rel: [f"{path}/{rel}", data.decode("utf-8")] for rel, data in srcs.items()}
    try:
        proc = subprocess.run([*python, "-E", "-s", "-S", "-c", COMPILER],
                              input=json.dumps(request), capture_output=True, text=True,
                              timeout=300)  # fmt: skip
    except (OSError, subprocess.SubprocessError) as err:
        raise HookFileError(f"{' '.join(python)}: {err}") from err
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no message"])[-1]
        raise HookFileError(f"{' '.join(python)}: exit {proc.returncode}: {last}")
    try:
        doc = json.loads(proc.stdout)
        version = tuple(int(x) for x in doc["version"])
        name = str(doc.get("executable") or python[-1])
    except (ValueError, KeyError, TypeError) as err:
        raise HookFileError(f"{' '.join(python)}: no answer the installer understands") from err
    if version < REQUIRES_PYTHON:
        raise HookFileError(f"{name} is Python {'.'.join(map(str, version))}: the vmpin hook "
                            f"needs Python >= {_MIN_TEXT}")  # fmt: skip
    major, minor, micro = version[:3]
    return Bytecode(
        python=name,
        version=(major, minor, micro),
        magic=base64.b64decode(doc["magic"]),
        pycs={rel: base64.b64decode(data) for rel, data in doc["pycs"].items()},
    )


def digest(srcs: dict[str, bytes], bytecode: Bytecode | None, path: str) -> str:
    """What a hook file is made of, as one value (its zip comment)."""
    h = hashlib.sha256()
    for part in (PROLOGUE, MAIN, path, bytecode.magic.hex() if bytecode else "source only"):
        h.update(part.encode() + b"\0")
    for rel in sorted(srcs):
        h.update(rel.encode() + b"\0" + hashlib.sha256(srcs[rel]).digest())
    return "vmpin-hook sha256:" + h.hexdigest()


def file_digest(path: str) -> str | None:
    """The digest a hook file at ``path`` was made with, or None (none there, not one)."""
    try:
        with zipfile.ZipFile(path) as z:
            return z.comment.decode("ascii", "replace")
    except (OSError, zipfile.BadZipFile):
        return None


def _add(z: zipfile.ZipFile, name: str, data: bytes, compress: int) -> None:
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))  # reproducible
    info.external_attr = 0o644 << 16
    info.compress_type = compress
    z.writestr(info, data)


def build(srcs: dict[str, bytes], bytecode: Bytecode | None, path: str) -> bytes:
    """The hook file's bytes: :data:`PROLOGUE`, then the zip (``__main__.py``, every module's
    source, deflated, and its ``.pyc`` from ``bytecode``, stored: read on every hook)."""
    missing = set(HOOK_MODULES) - set(srcs)
    if missing:
        raise HookFileError(f"sources missing: {', '.join(sorted(missing))}")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.comment = digest(srcs, bytecode, path).encode()
        _add(z, "__main__.py", MAIN.encode(), zipfile.ZIP_STORED)
        for rel in sorted(srcs):
            _add(z, rel, srcs[rel], zipfile.ZIP_DEFLATED)
            if bytecode is not None:
                _add(z, rel[: -len(".py")] + ".pyc", bytecode.pycs[rel], zipfile.ZIP_STORED)
    # zipimport and zipfile find the archive from its end, behind any prefix
    return PROLOGUE.encode() + buf.getvalue()


def write(dest: str, python: list[str] | None = None, path: str | None = None) -> Bytecode:
    """Build a hook file at ``dest`` (mode 0755), compiled by ``python`` (default: this
    interpreter), for a file that will live at ``path`` (default: ``dest``).  For tests and
    benchmarks; the installer goes through :mod:`vmpin.service.install`."""
    srcs = sources()
    where = path or dest
    bytecode = compile_with(python or [sys.executable], srcs, where)
    data = build(srcs, bytecode, where)
    tmp = f"{dest}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.chmod(tmp, 0o755)
    os.replace(tmp, dest)
    return bytecode
