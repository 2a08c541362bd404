"""SQLite for vmpin: the C module ``_sqlite3``, loaded without ``functools`` (issue 14).

Every vmpin process that opens the store imports SQLite, and one of them is the Kata hook
that finds no agent and pins in-process, on the start of a container.  Two costs come with
the ``sqlite3`` package and are not SQLite's:

- ``sqlite3.dbapi2`` imports ``datetime`` and ``collections.abc`` (for the default date
  adapters, which vmpin never uses): the store takes the C module ``_sqlite3`` instead, the
  same ``connect()``, ``Connection``, ``Row`` and exception classes (``sqlite3.Error`` *is*
  ``_sqlite3.Error``).
- ``_sqlite3`` itself (CPython 3.11 on) imports ``functools`` when it loads, for one name:
  ``lru_cache``, each connection's statement cache.  ``functools`` imports ``collections``,
  ``operator``, ``reprlib``, ``keyword`` and ``types``: 2.6-3.2 ms here, a quarter of a bare
  interpreter's start, for a decorator that is a thin wrapper over a C type.

So :func:`_load` lets ``_sqlite3`` find, for the moment it loads, a ``functools`` holding only
``lru_cache`` built on that very C type (``_functools._lru_cache_wrapper``, which is what
``functools.lru_cache`` returns): the statement cache is the same object it would have been.
The stand-in is removed at once, so a later ``import functools`` gets the real module.
Wherever this does not apply -- ``functools`` already loaded, ``_functools`` without the
wrapper, a Python whose ``_sqlite3`` wants more of ``functools`` (its import fails with the
stand-in) -- ``_sqlite3`` is imported the ordinary way; the store works the same either way.
"""

from __future__ import annotations

import sys

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.lean.records)
if TYPE_CHECKING:
    import sqlite3
    from collections.abc import Callable
    from types import ModuleType
    from typing import Any


def _load() -> ModuleType:
    if "functools" in sys.modules or "_sqlite3" in sys.modules:
        import _sqlite3

        return _sqlite3
    try:
        from _functools import _lru_cache_wrapper  # type: ignore[import-not-found]
    except ImportError:
        import _sqlite3

        return _sqlite3

    def cache_info(*counts: int) -> tuple[int, ...]:
        return counts  # (functools' is a namedtuple of the same four numbers)

    def lru_cache(maxsize: int | None = 128, typed: bool = False) -> Callable[[Any], Any]:
        # functools.lru_cache(maxsize) for an int or None, as the statement cache asks for it
        if isinstance(maxsize, int) and maxsize < 0:
            maxsize = 0
        return lambda func: _lru_cache_wrapper(func, maxsize, typed, cache_info)

    stand_in = type(sys)("functools", "lru_cache only, while _sqlite3 loads (vmpin.state.sqlite)")
    stand_in.lru_cache = lru_cache  # type: ignore[attr-defined]
    sys.modules["functools"] = stand_in
    try:
        import _sqlite3
    except Exception:  # a _sqlite3 that wants more: it gets the real functools
        if sys.modules.get("functools") is stand_in:
            del sys.modules["functools"]
        import _sqlite3
    finally:
        if sys.modules.get("functools") is stand_in:
            del sys.modules["functools"]
    return _sqlite3


if not TYPE_CHECKING:
    sqlite3 = _load()

__all__ = ["sqlite3"]
