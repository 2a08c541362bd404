"""The hook's code cache, written: the file :mod:`vmpin.lean.codecache` reads, made again by a
process that missed (:func:`vmpin.lean.codecache.save`, after its work).

Apart from the reader because a process that found every module in the cache -- every hook
and command but the first after an install or a change -- never writes it: this code was
~0.07 M of the ~44 M instructions of every runc hook (a bare interpreter ~39 M).  Stdlib
only, no ``typing`` at run time.
"""

from __future__ import annotations

import marshal
import os
import sys

from vmpin.lean.codecache import _LEN, FORMAT, _magic, cache_path

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.lean.records)
if TYPE_CHECKING:
    from typing import Any

    from vmpin.lean.codecache import CodeCache, Entries


def write(cache: CodeCache) -> bool:
    """Write the cache file of ``cache`` (vmpin.lean.codecache.save, after a miss)."""
    path = cache_path(cache.root)
    tmp = f"{path}.{os.getpid()}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(tmp, flags, 0o644)
    except OSError:
        # no __pycache__, a read-only install, another user's: ordinary imports it is, and
        # the code is not gathered for nothing (a read command run by a user, every time)
        return False
    try:
        try:
            for chunk in _layout(cache.root, _codes(cache)):
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        os.replace(tmp, path)  # readers see the old file or the new one
    except Exception:
        try:  # noqa: SIM105 (contextlib stays off the hook path)
            os.unlink(tmp)
        except OSError:
            pass
        return False
    return True


def _codes(cache: CodeCache) -> dict[str, tuple[str, int, int, bool, bytes]]:
    """What the file is to hold: the entries that still check out, and every vmpin module
    this process imported from its source (unchanged while read)."""
    codes: dict[str, tuple[str, int, int, bool, bytes]] = {}
    for name, entry in cache.entries.items():
        try:
            codes[name] = (*entry[:4], cache.code(name))
        except (OSError, ImportError):
            continue
    prefix = cache.root + os.sep
    for name, module in list(sys.modules.items()):
        if not name.startswith("vmpin.") or name in codes:
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
        codes[name] = (origin, after.st_mtime_ns, after.st_size, is_package, marshal.dumps(code))
    return codes


def _layout(root: str, codes: dict[str, tuple[str, int, int, bool, bytes]]) -> list[bytes]:
    """The file's chunks: the index's length, the index (with the code's total length and
    each module's offset after it), the code objects in name order."""
    names = sorted(codes)
    index: Entries = {}
    offset = 0
    for name in names:
        index[name] = (*codes[name][:4], offset, len(codes[name][4]))
        offset += len(codes[name][4])
    head = marshal.dumps((FORMAT, _magic(), root, offset, index))
    return [len(head).to_bytes(_LEN, "little"), head, *(codes[name][4] for name in names)]
