"""Kata's own vCPU pinning: which Kata configuration files turn on ``enable_vcpus_pinning``.

Why: with ``[runtime] enable_vcpus_pinning = true`` in its ``configuration.toml``, Kata's
runtime pins vCPU thread ``i`` to the ``i``-th CPU (ascending) of the sandbox's cpuset itself,
at every container create, update and removal, and only when #vCPUs == |cpuset|
(virtcontainers ``Sandbox.checkVCPUsPinning``; when the counts part again it puts the vCPUs
back over the whole cpuset).  vmpin pins the same threads: two pinners on one thread undo
each other.  The planner therefore follows Kata's layout where Kata's pinning applies
(vmpin.core.planner, docs/design.md "Kata's own vCPU pinning"), and ``audit``/``doctor`` say
which file turned it on.

Where Kata reads its configuration, and so what ``--kata-config`` / ``VMPIN_KATA_CONFIG``
lists by default (:data:`vmpin.linux.paths.DEFAULTS`): the first of
``/etc/kata-containers/configuration.toml`` and
``/usr/share/defaults/kata-containers/configuration.toml`` that exists, and, for kata-deploy,
one file per runtime class under ``/opt/kata/share/defaults/kata-containers/``
(``configuration-qemu.toml``, ...), which containerd's runtime option ``ConfigPath`` or the
shim's ``KATA_CONF_FILE`` names.  Nothing on the host says which of them a running sandbox
was started with, so the node's answer is "some Kata configuration vmpin reads pins vCPUs".

The search list: entries separated by ``:``, each read; an entry of alternatives separated by
``|`` reads only the first that exists (Kata's rule for its two default paths); a ``*`` in an
entry's last component matches file names there (no other globbing).  ``none`` lists nothing.
Symlinks are followed (kata-deploy links ``configuration.toml`` to a runtime class's file),
and a file reached twice is read once.

TOML is parsed with :mod:`tomllib` (Python >= 3.11; it imports ``re`` and ``datetime``, ~10 ms),
which is not on the hook's path: the answer is kept in the state dir (``kata-config.json``,
keyed by every file's identity, size and mtime) and read back while it holds, so a hook that
pins in-process parses only after a configuration changed, and never when there is none.
Lean otherwise, like every module the hook imports.
"""

from __future__ import annotations

import os
from stat import S_ISREG

from vmpin.core.errors import VmpinError
from vmpin.linux.files import remember, version

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.lean.records)
if TYPE_CHECKING:
    from typing import Any, NamedTuple

    #: a search list taken apart: its entries, each a tuple of alternatives, each (the
    #: pattern, and the parent directory and name pattern of one with a ``*``, else None)
    _Entries = tuple[tuple[tuple[str, tuple[str, str] | None], ...], ...]
    #: pattern -> (its directory's identity when listed, the paths it matched then)
    _Listed = dict[str, tuple[tuple[int, int, int, int, int], list[str]]]
else:
    from vmpin.lean.records import NamedTuple

#: the TOML table and key Kata reads (virtcontainers ``runtime.EnableVCPUsPinning``)
TABLE = "runtime"
KEY = "enable_vcpus_pinning"
#: a Kata configuration is a few KiB (~30 KiB with all its comments)
MAX_BYTES = 1 << 20
#: the cache file's layout; another is not read
_CACHE_FORMAT = 1


class KataConfig(NamedTuple):
    """One configuration file: whether it turns Kata's vCPU pinning on."""

    path: str
    #: True/False as the file says (absent = False, Kata's default); None when unreadable
    pinning: bool | None
    error: str | None = None

    def line(self) -> str:
        """One line for people (doctor, audit's notes)."""
        if self.error is not None:
            return f"Kata configuration {self.error}"
        if self.pinning:
            return (
                f"Kata configuration {self.path}: [{TABLE}] {KEY} = true: Kata pins vCPU i to"
                " the i-th CPU of the sandbox's cpuset itself when the counts match; vmpin"
                " follows that layout and leaves vCPUs Kata placed"
            )
        return f"Kata configuration {self.path}: [{TABLE}] {KEY} is off: vmpin alone pins vCPUs"


class KataConfigs(NamedTuple):
    """Every Kata configuration file found (empty: no Kata configuration on the node)."""

    files: tuple[KataConfig, ...] = ()

    @property
    def pinning(self) -> bool:
        """Some configuration turns Kata's vCPU pinning on."""
        return any(f.pinning for f in self.files)

    def notes(self) -> list[str]:
        """What audit says: the files that pin, and those it could not read."""
        return [f.line() for f in self.files if f.pinning or f.error is not None]

    def lines(self, spec: str) -> list[str]:
        """What doctor says: every file, or that none was found."""
        if not self.files:
            return [f"Kata configuration: none found ({spec or 'none'}): vmpin alone pins vCPUs"]
        return [f.line() for f in self.files]


#: no Kata configuration
NONE = KataConfigs()


def candidates(spec: str) -> list[str]:
    """The files the search list ``spec`` names now, each once (by its resolved path)."""
    return [path for path, _ in _found(_entries(spec))]


def _entries(spec: str) -> _Entries:
    """``spec`` taken apart once (a reader holds it: the agent's observer read it at every
    pass, issue 28)."""
    out = []
    for entry in spec.split(":"):
        entry = entry.strip()
        if not entry or entry == "none":
            continue
        alternatives = []
        for alternative in entry.split("|"):
            pattern = alternative.strip()
            if pattern:
                parent, name = os.path.split(pattern)
                alternatives.append((pattern, (parent, name) if "*" in name else None))
        if alternatives:
            out.append(tuple(alternatives))
    return tuple(out)


def _found(entries: _Entries, listed: _Listed | None = None) -> list[tuple[str, os.stat_result]]:
    """The files ``entries`` name now, each with its ``stat`` (symlinks followed), each file
    once: by device and inode, which its resolved path comes to (one ``stat`` a file, where
    resolving its path took one per component).  ``listed``: a reader's pattern
    directories' names as last listed (:func:`_expand`)."""
    out: list[tuple[str, os.stat_result]] = []
    seen: set[tuple[int, int]] = set()
    for alternatives in entries:
        for pattern, glob in alternatives:
            found = _expand(pattern, glob, listed)
            if found:
                for path, st in found:
                    if (st.st_dev, st.st_ino) not in seen:
                        seen.add((st.st_dev, st.st_ino))
                        out.append((path, st))
                break  # alternatives: the first one that exists
    return out


def _expand(
    pattern: str, glob: tuple[str, str] | None, listed: _Listed | None = None
) -> list[tuple[str, os.stat_result]]:
    """Existing regular files (symlinks followed) matching ``pattern`` (``glob``: its parent
    and name pattern, when it has a ``*``), in name order, each with its ``stat``.

    ``listed``: the names a pattern's directory matched when last listed, with the
    directory's identity then: listed again only when it is another version (a name made or
    removed moves its mtime and ctime; a version is kept once settled, as the node
    summary's VM dir listing is, vmpin.reconcile.summarizer).  One ``stat`` of it, where the
    agent's observer listed it at every pass (issue 28)."""
    if glob is None:
        st = _regular(pattern)
        return [] if st is None else [(pattern, st)]
    parent, name = glob
    try:
        st = os.stat(parent or ".")
    except (OSError, ValueError):
        return []
    ident = version(st)
    known = listed.get(pattern) if listed is not None else None
    if known is not None and known[0] == ident:
        paths = known[1]
    else:
        try:
            names = sorted(os.listdir(parent or "."))
        except OSError:
            return []
        paths = [os.path.join(parent, n) for n in names if _match(n, name)]
        if listed is not None:
            listed.pop(pattern, None)
            remember(listed, pattern, ident, paths)
    out = []
    for path in paths:
        found = _regular(path)
        if found is not None:
            out.append((path, found))
    return out


def _regular(path: str) -> os.stat_result | None:
    """``path``'s ``stat`` when it is a regular file (a link followed), else None."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return st if S_ISREG(st.st_mode) else None


def _match(name: str, pattern: str) -> bool:
    """``*`` matches any run of characters (fnmatch imports re: not on the hook's path)."""
    parts = pattern.split("*")
    if not name.startswith(parts[0]) or len(name) < sum(len(p) for p in parts):
        return False
    pos = len(parts[0])
    for part in parts[1:-1]:
        found = name.find(part, pos)
        if found < 0:
            return False
        pos = found + len(part)
    return name.endswith(parts[-1]) and len(name) - len(parts[-1]) >= pos


def read_file(path: str) -> KataConfig:
    """One configuration file as Kata would read it; an error is one line naming the file."""
    try:
        import tomllib  # not on the hook's path unless a configuration changed (module doc)
    except ImportError:  # Python 3.10
        return KataConfig(path, None, f"{path}: not read: this Python has no tomllib (3.11+)")

    from vmpin.linux.files import read_bytes

    try:
        data = read_bytes(os.path.realpath(path), limit=MAX_BYTES, what="Kata configuration")
        doc = tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError as err:
        return KataConfig(path, None, f"{path}: not UTF-8 text ({err.reason} at byte {err.start})")
    except tomllib.TOMLDecodeError as err:
        return KataConfig(path, None, f"{path}: not valid TOML: {err}")
    except VmpinError as err:  # (UnsafeFile: names the path itself)
        return KataConfig(path, None, str(err).removeprefix("Kata configuration "))
    except OSError as err:
        return KataConfig(path, None, f"{path}: {err.strerror or err}")
    table = doc.get(TABLE, {})
    if not isinstance(table, dict):
        return KataConfig(path, None, f"{path}: [{TABLE}] is not a table")
    value = table.get(KEY, False)
    if not isinstance(value, bool):
        return KataConfig(path, None, f"{path}: [{TABLE}] {KEY} = {value!r}: not a boolean")
    return KataConfig(path, value)


def read(spec: str, *, cache: str | None = None, save: bool = True) -> KataConfigs:
    """Every configuration ``spec`` lists, read back from ``cache`` while it holds."""
    return KataConfigReader(spec, cache).read(save=save)


class KataConfigReader:
    """Reads the configurations again only when one of them changed (or another appeared).

    A process keeps one (the agent's observer: a stat per file per pass); a process that
    runs once (a hook, a command) finds the last answer in ``cache``, a file in the state dir.
    """

    __slots__ = ("_entries", "_key", "_last", "_listed", "cache", "spec")

    def __init__(self, spec: str, cache: str | None = None) -> None:
        self.spec, self.cache = spec, cache
        self._entries = _entries(spec)
        self._listed: _Listed = {}
        self._key: list[Any] | None = None
        self._last = NONE

    def read(self, *, save: bool = True) -> KataConfigs:
        found = _found(self._entries, self._listed)
        if not found:
            self._key, self._last = [], NONE
            return NONE
        # what an answer is valid for: each file's path and (device, inode, size, mtime)
        # after following links
        key = [[p, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns] for p, st in found]
        if key == self._key:
            return self._last
        files = [p for p, _ in found]
        configs = _load_cache(self.cache, key) if self.cache else None
        if configs is None:
            configs = KataConfigs(tuple(read_file(p) for p in files))
            if self.cache and save:
                _save_cache(self.cache, key, configs)
        self._key, self._last = key, configs
        return configs


def _load_cache(path: str, key: list[Any]) -> KataConfigs | None:
    from vmpin.linux.files import load_json, read_bytes

    try:
        doc = load_json(read_bytes(path, limit=1 << 20), path)
        if not isinstance(doc, dict) or doc.get("v") != _CACHE_FORMAT or doc.get("key") != key:
            return None
        return KataConfigs(
            tuple(KataConfig(str(p), None if v is None else bool(v), e) for p, v, e in doc["files"])
        )
    except Exception:  # a cache is never a reason to fail: the files are read instead
        return None


def _save_cache(path: str, key: list[Any], found: KataConfigs) -> None:
    """Best effort (a read-only state dir only means parsing again next time)."""
    from vmpin.linux.files import save_cache
    from vmpin.wire.jsonio import dumps

    doc = {"v": _CACHE_FORMAT, "key": key, "files": [list(f) for f in found.files]}
    save_cache(path, dumps(doc).encode())
