"""The hook's code cache: the vmpin modules a hook imports, served from one file (issue 14).

A Kata hook that pins in-process imports ~42 vmpin modules, and the import system's own work
for each (the path finder's directory checks, the ``.pyc`` opened, read and validated, a
dozen Python-level steps) was ~0.35 M instructions: ~15 M of the hook's 77 M, on every
container start.  Here their code objects are kept in one marshal file in the package's own
``__pycache__`` (where CPython keeps their ``.pyc`` files: the same trust), read with one
``open`` and served by a :data:`sys.meta_path` finder.

Nothing stale is ever run: each entry carries its source's path, mtime (ns) and size
(CPython's own ``.pyc`` check uses the mtime in seconds), checked with one ``stat`` when the
module is imported; the file names the interpreter's bytecode magic and the package
directory it was made for; a file that is not ours (another owner, writable by group or
others, not a regular file) or not whole is not read.  Whatever does not check out is
imported the ordinary way, and the hook that saw a miss writes the file again after its work
(once per install and hook path: ~5 ms), unless Python is told not to write bytecode
(``-B``, ``PYTHONDONTWRITEBYTECODE``).  A file that cannot be written (a read-only install)
only means ordinary imports.

Stdlib only, no ``typing`` at run time (the hook path).
"""

from __future__ import annotations

import marshal
import os
import stat
import sys

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.core._lean)
if TYPE_CHECKING:
    from types import ModuleType
    from typing import Any

    #: module name -> (source path, its st_mtime_ns, its st_size, is a package, marshalled code)
    Entries = dict[str, tuple[str, int, int, bool, bytes]]

#: the file's layout; another one is not read
FORMAT = 1


def cache_path(package_dir: str) -> str:
    """Where the cache of the package at ``package_dir`` lives (its ``__pycache__``)."""
    tag = sys.implementation.cache_tag or "none"
    return os.path.join(package_dir, "__pycache__", f"vmpin-hook.{tag}.marshal")


def _magic() -> bytes:
    external: Any = sys.modules["_frozen_importlib_external"]
    return bytes(external.MAGIC_NUMBER)


class CodeCache:
    """A finder and loader for the ``vmpin.*`` modules in the cache (the ``sys.meta_path``
    protocol: ``find_spec``, ``create_module``, ``exec_module``)."""

    def __init__(self, root: str, entries: Entries) -> None:
        self.root = root
        self.entries = entries
        #: a vmpin module was imported the ordinary way (absent, or its source changed)
        self.missed = False

    def find_spec(self, name: str, path: object = None, target: object = None) -> Any:
        if not name.startswith("vmpin."):
            return None
        entry = self.entries.get(name)
        if entry is None:
            self.missed = True
            return None
        origin, mtime, size, is_package, _ = entry
        try:
            st = os.stat(origin)
        except (OSError, ValueError):
            st = None
        if st is None or st.st_mtime_ns != mtime or st.st_size != size:
            del self.entries[name]  # (the save after the hook puts the new code in)
            self.missed = True
            return None
        spec_type: Any = sys.modules["_frozen_importlib"].ModuleSpec
        spec = spec_type(name, self, origin=origin, is_package=is_package)
        spec.has_location = True  # __file__, as the ordinary import sets it
        if is_package:
            spec.submodule_search_locations = [os.path.dirname(origin)]
        return spec

    def create_module(self, spec: object) -> None:
        return None  # the default module object

    def exec_module(self, module: ModuleType) -> None:
        exec(marshal.loads(self.entries[module.__name__][4]), module.__dict__)


def _read(path: str) -> bytes | None:
    """The file's bytes when it is ours to trust (see the module docstring), else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if (
            not stat.S_ISREG(st.st_mode)
            or st.st_uid != os.geteuid()
            or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        ):
            return None
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(fd)


def install() -> CodeCache | None:
    """Put the cache first on :data:`sys.meta_path` (empty when there is none to read);
    None when vmpin is not an ordinary package on disk (nothing to cache)."""
    package: Any = sys.modules.get("vmpin")
    paths = list(getattr(package, "__path__", ()) or ())
    if len(paths) != 1:
        return None
    root = paths[0]
    entries: Entries = {}
    raw = _read(cache_path(root))
    if raw is not None:
        try:
            doc = marshal.loads(raw)
        except (EOFError, ValueError, TypeError):
            doc = None
        if (
            isinstance(doc, tuple)
            and len(doc) == 4
            and doc[:3] == (FORMAT, _magic(), root)
            and isinstance(doc[3], dict)
        ):
            entries = doc[3]
    cache = CodeCache(root, entries)
    sys.meta_path.insert(0, cache)
    return cache


def save(cache: CodeCache) -> bool:
    """Write the cache again after a miss: what it held that still checks out, and every
    vmpin module this process imported from its source; True when written.  Never raises:
    a cache must not fail the container start whose hook writes it."""
    if not cache.missed or sys.dont_write_bytecode:
        return False
    try:
        return _save(cache)
    except Exception:
        return False


def _save(cache: CodeCache) -> bool:
    entries: Entries = dict(cache.entries)
    prefix = cache.root + os.sep
    for name, module in list(sys.modules.items()):
        if not name.startswith("vmpin.") or name in entries:
            continue
        spec: Any = getattr(module, "__spec__", None)
        origin = getattr(spec, "origin", None)
        get_code = getattr(getattr(spec, "loader", None), "get_code", None)
        if not (isinstance(origin, str) and origin.startswith(prefix) and get_code):
            continue
        try:
            before = os.stat(origin)
            code = get_code(name)
            after = os.stat(origin)
        except (OSError, ImportError, SyntaxError, ValueError):
            continue
        if code is None or (before.st_mtime_ns, before.st_size) != (
            after.st_mtime_ns,
            after.st_size,
        ):
            continue  # changed while read: left to the next hook
        is_package = spec.submodule_search_locations is not None
        entries[name] = (origin, after.st_mtime_ns, after.st_size, is_package, marshal.dumps(code))
    path = cache_path(cache.root)
    tmp = f"{path}.{os.getpid()}.tmp"
    data = marshal.dumps((FORMAT, _magic(), cache.root, entries))
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(tmp, flags, 0o644)
    except OSError:
        return False  # no __pycache__, a read-only install: ordinary imports it is
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        os.replace(tmp, path)  # readers see the old file or the new one
    except OSError:
        try:  # noqa: SIM105 (contextlib stays off the hook path)
            os.unlink(tmp)
        except OSError:
            pass
        return False
    return True
