"""Runtime stand-ins that keep :mod:`typing` off the hook path.

Importing ``typing`` costs ~6 ms here, and ``typing.NamedTuple`` type-checks every field of
every class at import (~3 ms more for vmpin's records): together a fifth of what the hook may
cost on top of a bare interpreter.  Modules on the hook path therefore write::

    TYPE_CHECKING = False
    if TYPE_CHECKING:
        from typing import Any, NamedTuple
    else:
        from vmpin.core._lean import NamedTuple

mypy takes any name ``TYPE_CHECKING`` as true and checks against the real ``typing``; at run
time the class below builds the same ``collections.namedtuple`` that ``typing.NamedTuple``
builds (fields from the annotations, in order; defaults from the class body; methods,
properties and the docstring copied over), without importing ``typing``.  ``collections`` is
already loaded by then (``re`` imports it, and the console script imports ``re``).
"""

from __future__ import annotations

import collections
from collections.abc import Callable

_NOT_COPIED = frozenset(
    {"__annotations__", "__module__", "__qualname__", "__dict__", "__weakref__", "__doc__"}
)


class _NamedTupleMeta(type):
    def __new__(mcls, name: str, bases: tuple[type, ...], ns: dict[str, object]) -> type:
        if not bases:
            return super().__new__(mcls, name, bases, ns)
        if "__classcell__" in ns:
            raise TypeError(f"{name}: super() is not supported in NamedTuple methods")
        fields = list(ns.get("__annotations__", {}))  # type: ignore[call-overload]
        defaults = [ns[f] for f in fields if f in ns]
        # called through a name: mypy special-cases literal namedtuple() calls
        make: Callable[..., type] = collections.namedtuple
        cls = make(name, fields, defaults=defaults or None, module=str(ns.get("__module__")))
        cls.__qualname__ = str(ns.get("__qualname__", name))
        if ns.get("__doc__"):
            cls.__doc__ = str(ns["__doc__"])
        for key, value in ns.items():
            if key not in _NOT_COPIED and key not in fields:
                setattr(cls, key, value)
        return cls


class NamedTuple(metaclass=_NamedTupleMeta):
    """Subclass like ``typing.NamedTuple``; the subclass *is* a ``collections.namedtuple``."""
