"""The hook's code cache: the vmpin modules a hook imports, served from one file (issue 14).

The commands' too (:func:`vmpin.entry.main`; not ``serve``'s): ``vmpin update`` and the read
commands import ~65 vmpin modules, and this cache took ``update`` from ~119 M to ~107 M
instructions (callgrind, a bare interpreter being ~39 M; docs/benchmarks.md).  The file holds
the union of what each path imported.

A Kata hook that pins in-process imports ~42 vmpin modules, and the import system's own work
for each (the path finder's directory checks, the ``.pyc`` opened, read and validated, a
dozen Python-level steps) was ~0.35 M instructions: ~15 M of the hook's 77 M, on every
container start.  Here their code objects are kept in one marshal file in the package's own
``__pycache__`` (where CPython keeps their ``.pyc`` files: the same trust) and served by a
:data:`sys.meta_path` finder: one ``open`` and a read of the index at start, then one
``pread`` per module imported (only the modules a hook's path needs are read).

Nothing stale is ever run: each entry carries its source's path, mtime (ns) and size
(CPython's own ``.pyc`` check uses the mtime in seconds), checked with one ``stat`` when the
module is imported; the file names the interpreter's bytecode magic and the package
directory it was made for; a file that is not ours (another owner, writable by group or
others, not a regular file) or not whole (the index names its size) is not read. Whatever
does not check out is imported the ordinary way, and the hook that saw a miss writes the
file again after its work (once per install and hook path: ~5 ms; its writer,
:mod:`vmpin.lean.codewriter`, is loaded then only), unless Python is told not to write
bytecode (``-B``, ``PYTHONDONTWRITEBYTECODE``). A file that cannot be written (a read-only
install) only means ordinary imports.

Served without the import system's machinery, where it can be (issue 14): importlib's own
steps for one module (a module lock, the finders asked, the spec's attributes set one by one,
``__cached__`` worked out from the path) were ~20 us warm and ~40-60 us on a hook's cold
start, ~1-2 ms of a Kata hook that pins in-process, whose work is a few ms.  So while the
cache is installed the interpreter's ``_find_and_load`` (what the ``import`` statement calls
for a module not yet in :data:`sys.modules`) is :meth:`CodeCache.find_and_load`: a vmpin
module whose entry checks out gets the module object the ordinary import would make
(``__spec__``, ``__loader__``, ``__file__``, ``__package__``, a package's ``__path__``; in
:data:`sys.modules` while its code runs, removed if that raises, bound on its parent package
after), in a few steps; anything else -- another module, an entry that does not check out, a
second thread running -- goes to importlib as before.

Stdlib only, no ``typing`` at run time (the hook path).
"""

from __future__ import annotations

import _thread
import marshal
import os
import stat
import sys

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.lean.records)
if TYPE_CHECKING:
    from types import ModuleType
    from typing import Any

    #: module name -> (source path, its st_mtime_ns, its st_size, is a package, where its
    #: marshalled code is: offset after the index, length)
    Entries = dict[str, tuple[str, int, int, bool, int, int]]

#: the file's layout; another one is not read.  2: an index, then the code objects, each read
#: (``pread``) only when its module is imported -- a plain hook needs a third of the file,
#: and unmarshalling the whole of it (1: one marshalled dict) was ~0.5 ms of every hook.
FORMAT = 2
#: the file starts with the index's length, in this many bytes (little-endian)
_LEN = 8
#: the first read: the index and then some (the index is ~5 KiB for 44 modules)
_FIRST_READ = 1 << 16


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

    def __init__(self, root: str, entries: Entries, fd: int | None = None, base: int = 0) -> None:
        #: importlib's ``_find_and_load``, for whatever :meth:`find_and_load` does not serve
        self.slow: Any = None
        self.root = root
        self.entries = entries
        #: where the code objects start in the file (after the index)
        self.base = base
        #: the cache file, open for the process's life (a file written over it meanwhile is
        #: another inode: this one stays whole); None when there is none
        self.fd = fd
        #: a vmpin module was imported the ordinary way (absent, or its source changed)
        self.missed = False

    def find_spec(self, name: str, path: object = None, target: object = None) -> Any:
        entry = self._fresh(name)
        return None if entry is None else self._spec(name, entry[0], entry[3])

    def _fresh(self, name: str) -> tuple[str, int, int, bool, int, int] | None:
        """The module's entry when it is ours and its source unchanged; else None (a miss:
        the entry is dropped, and the save after the hook puts the new code in)."""
        if not name.startswith("vmpin."):
            return None
        entry = self.entries.get(name)
        if entry is None:
            self.missed = True
            return None
        try:
            st = os.stat(entry[0])
        except (OSError, ValueError):
            st = None
        if st is None or st.st_mtime_ns != entry[1] or st.st_size != entry[2]:
            del self.entries[name]
            self.missed = True
            return None
        return entry

    def _spec(self, name: str, origin: str, is_package: bool) -> Any:
        spec_type: Any = sys.modules["_frozen_importlib"].ModuleSpec
        spec = spec_type(name, self, origin=origin, is_package=is_package)
        spec.has_location = True  # __file__, as the ordinary import sets it
        if is_package:
            spec.submodule_search_locations = [os.path.dirname(origin)]
        return spec

    def serve_imports(self) -> bool:
        """Have the import statement call :meth:`find_and_load` (the module docstring);
        False where this interpreter's import system has no ``_find_and_load`` to stand in
        for (then importlib serves through :meth:`find_spec` alone)."""
        bootstrap: Any = sys.modules["_frozen_importlib"]
        slow = getattr(bootstrap, "_find_and_load", None)
        if not callable(slow):
            return False
        self.slow = slow
        bootstrap._find_and_load = self.find_and_load
        return True

    def find_and_load(self, name: str, import_: Any) -> Any:
        """Import ``name`` (absent from :data:`sys.modules`): served from the cache when it
        is a vmpin module whose entry checks out, else by importlib (see the module
        docstring).  What the import statement calls, with the same arguments."""
        modules = sys.modules
        entry = None
        if name.startswith("vmpin.") and name not in modules and not _thread._count():
            entry = self._fresh(name)
        if entry is None:
            return self.slow(name, import_)
        parent, _, child = name.rpartition(".")
        if parent not in modules:
            import_(parent)
            if name in modules:  # (the parent's code imported it)
                return modules[name]
        try:
            code = marshal.loads(self.code(name))
        except (OSError, ImportError, EOFError, ValueError, TypeError):
            del self.entries[name]  # cut short or garbled since install: read from source
            self.missed = True
            return self.slow(name, import_)
        origin, is_package = entry[0], entry[3]
        spec = self._spec(name, origin, is_package)
        module = type(sys)(name)
        attrs = module.__dict__
        attrs.update(__spec__=spec, __loader__=self, __file__=origin)
        if is_package:
            attrs.update(__path__=spec.submodule_search_locations, __package__=name)
        else:
            attrs["__package__"] = parent
        modules[name] = module
        try:
            exec(code, attrs)
        except BaseException:
            modules.pop(name, None)
            raise
        module = modules[name]  # (a module may have put another object in its place)
        setattr(modules[parent], child, module)
        return module

    def create_module(self, spec: object) -> None:
        return None  # the default module object

    def exec_module(self, module: ModuleType) -> None:
        exec(marshal.loads(self.code(module.__name__)), module.__dict__)

    def code(self, name: str) -> bytes:
        """The module's marshalled code, read from the file."""
        offset, length = self.entries[name][4:]
        data = os.pread(self.fd, length, self.base + offset) if self.fd is not None else b""
        if len(data) != length:  # (the size was checked at install: truncated in place since)
            raise ImportError(f"{cache_path(self.root)}: {name} cut short", name=name)
        return data


def _open(path: str) -> tuple[int, int] | None:
    """The file, open, and its size, when it is ours to trust (see the module docstring)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
    except OSError:
        st = None
    if (
        st is None
        or not stat.S_ISREG(st.st_mode)
        or st.st_uid != os.geteuid()
        or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    ):
        os.close(fd)
        return None
    return fd, st.st_size


def _index(fd: int, size: int, root: str) -> tuple[Entries, int] | None:
    """The file's index, and where the code after it starts, when the file is whole and
    made for this interpreter and package."""
    try:
        head = os.pread(fd, _FIRST_READ, 0)
        n = int.from_bytes(head[:_LEN], "little")
        if len(head) < _LEN or n > size - _LEN:
            return None
        if _LEN + n > len(head):
            head += os.pread(fd, _LEN + n - len(head), len(head))
        doc = marshal.loads(head[_LEN : _LEN + n])
    except (OSError, EOFError, ValueError, TypeError):
        return None
    if (
        isinstance(doc, tuple)
        and len(doc) == 5
        and doc[:3] == (FORMAT, _magic(), root)
        and doc[3] == size - _LEN - n  # whole: not cut short, nothing appended
        and isinstance(doc[4], dict)
    ):
        return doc[4], _LEN + n
    return None


def install() -> CodeCache | None:
    """Put the cache first on :data:`sys.meta_path` (empty when there is none to read);
    None when vmpin is not an ordinary package on disk (nothing to cache)."""
    package: Any = sys.modules.get("vmpin")
    paths = list(getattr(package, "__path__", ()) or ())
    if len(paths) != 1:
        return None
    root = paths[0]
    entries: Entries = {}
    fd, base = None, 0
    opened = _open(cache_path(root))
    if opened is not None:
        fd, size = opened
        found = _index(fd, size, root)
        if found is None:
            os.close(fd)
            fd = None
        else:
            entries, base = found
    cache = CodeCache(root, entries, fd, base)
    sys.meta_path.insert(0, cache)
    if entries:
        cache.serve_imports()
    return cache


def uninstall(cache: CodeCache) -> None:
    """Take the cache out again: imports go back to importlib alone (``serve``, and typer's
    explanations, import as any program does)."""
    if cache in sys.meta_path:
        sys.meta_path.remove(cache)
    if cache.slow is not None:
        bootstrap: Any = sys.modules["_frozen_importlib"]
        bootstrap._find_and_load = cache.slow
        cache.slow = None
    if cache.fd is not None:
        os.close(cache.fd)
        cache.fd = None
    cache.entries = {}


def save(cache: CodeCache) -> bool:
    """Write the cache again after a miss: what it held that still checks out, and every
    vmpin module this process imported from its source; True when written.  Never raises:
    a cache must not fail the container start whose hook writes it."""
    if not cache.missed or sys.dont_write_bytecode:
        return False
    try:
        # (the writer's code apart: a process that missed nothing never loads it, ~0.07 M
        # instructions of every hook and command)
        from vmpin.lean.codewriter import write

        return write(cache)
    except Exception:
        return False
