"""The ``dataclass`` stand-in of the hook's closure: :mod:`dataclasses` without its import.

``dataclasses`` imports ``inspect`` (with ``dis``, ``ast``, ``tokenize``, ``re``, ``copy``):
~4 ms, and ~1 ms more to process the reconcile pass's records, on a Kata hook that pins
in-process.  Modules on that path write::

    if TYPE_CHECKING:
        from dataclasses import dataclass, field, replace
    else:
        from vmpin.lean.records import dataclass, field, replace

(:mod:`vmpin.lean.records` hands these names over from here when first asked: a plain
container's hook, which makes NamedTuples only, does not load this module.)  mypy checks
against the real dataclasses.  What is supported is what vmpin uses:
``@dataclass(frozen=..., slots=True)`` with plain defaults, ``field(default_factory=)`` and
``field(default=, compare=False)``; the class gets the same ``__init__``, ``__repr__``,
``__eq__``, ``__hash__`` (frozen: of the compared fields; else unhashable),
``__match_args__``, ``__slots__`` and frozen-ness as from dataclasses, and pickles/copies
like it.  ``__init__`` is compiled on first use, from the templates vmpin.lean.records
keeps (see there).

Stdlib only, no ``typing`` at run time (the hook's closure).
"""

from __future__ import annotations

from vmpin.lean.records import _function, _template

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, TypeVar

    _T = TypeVar("_T")


class FrozenInstanceError(AttributeError):
    """Assigning to a field of a frozen record (as ``dataclasses.FrozenInstanceError``)."""


class _Factory:
    __slots__ = ("factory",)

    def __init__(self, factory: Callable[[], object]) -> None:
        self.factory = factory


class _Uncompared:
    """``field(default=..., compare=False)``: a field ``__eq__`` and ``__hash__`` leave out."""

    __slots__ = ("default",)

    def __init__(self, default: object) -> None:
        self.default = default


_MISSING = object()


def field(
    *,
    default: Any = _MISSING,
    default_factory: Callable[[], Any] | None = None,
    compare: bool = True,
) -> Any:
    """What vmpin uses of ``dataclasses.field``: ``default_factory=``, or ``default=`` with
    ``compare=False``."""
    if default_factory is not None and default is _MISSING and compare:
        return _Factory(default_factory)
    if default_factory is None and default is not _MISSING and not compare:
        return _Uncompared(default)
    raise TypeError("vmpin.lean.dataclass.field: default_factory=, or default= with compare=False")


class _LazyFields:
    """``cls.__dataclass_fields__``, made of real ``dataclasses.Field`` s when first asked for."""

    def __get__(self, obj: object, cls: type) -> dict[str, Any]:
        import dataclasses

        fields: dict[str, Any] = {}
        for n, default in cls.__dict__["_lean_defaults"].items():
            f: Any
            if isinstance(default, _Factory):
                f = dataclasses.field(default_factory=default.factory)
            else:
                f = dataclasses.field(default=default) if default is not _MISSING else (
                    dataclasses.field())  # fmt: skip
            f.name, f.type = n, cls.__annotations__[n]
            f.compare = n in cls.__dict__["_lean_compared"]
            f._field_type = dataclasses._FIELD  # type: ignore[attr-defined]
            fields[n] = f
        return fields


def dataclass(*, frozen: bool = False, slots: bool = True) -> Callable[[type], type]:
    if not slots:
        raise TypeError("vmpin.lean.dataclass makes slotted classes only")
    return lambda cls: _record(cls, frozen)


# The records' methods, written once for every class (they read the field names from
# ``__match_args__``), as vmpin.lean.records writes its NamedTuples' once.
def _dc_values(self: Any) -> tuple[Any, ...]:
    return tuple([getattr(self, n) for n in self.__match_args__])


def _dc_repr(self: Any) -> str:
    inner = ", ".join([f"{n}={getattr(self, n)!r}" for n in self.__match_args__])
    return f"{type(self).__qualname__}({inner})"


def _dc_compared(self: Any) -> tuple[Any, ...]:
    return tuple([getattr(self, n) for n in self._lean_compared])


def _dc_eq(self: Any, other: object) -> Any:
    if other.__class__ is not self.__class__:
        return NotImplemented
    return _dc_compared(self) == _dc_compared(other)


def _dc_hash(self: Any) -> int:
    return hash(_dc_compared(self))


def _dc_setstate(self: Any, state: tuple[Any, ...]) -> None:
    for n, v in zip(self.__match_args__, state, strict=True):
        object.__setattr__(self, n, v)


def _frozen_setattr(self: Any, name: str, value: object) -> None:
    raise FrozenInstanceError(f"cannot assign to field {name!r}")


def _frozen_delattr(self: Any, name: str) -> None:
    raise FrozenInstanceError(f"cannot delete field {name!r}")


_dc_repr.__name__, _dc_eq.__name__, _dc_hash.__name__ = "__repr__", "__eq__", "__hash__"
_dc_values.__name__, _dc_setstate.__name__ = "__getstate__", "__setstate__"
_frozen_setattr.__name__, _frozen_delattr.__name__ = "__setattr__", "__delattr__"


def _record(cls: type, frozen: bool) -> type:
    names = tuple(cls.__dict__.get("__annotations__", {}))  # noqa: RUF063 (inspect is slow)
    ns = {k: v for k, v in cls.__dict__.items() if k not in ("__dict__", "__weakref__")}
    scope: dict[str, object] = {"_MISSING": _MISSING, "_set": object.__setattr__}
    kinds: list[str] = []
    argdefs: list[object] = []
    defaults = {n: ns.get(n, _MISSING) for n in names}
    compared = list(names)
    for i, n in enumerate(names):
        if n not in ns:
            if argdefs:
                raise TypeError(f"non-default argument {n!r} follows default argument")
            kinds.append("=")
        elif isinstance(ns[n], _Factory):
            scope[f"_f{i}"] = ns.pop(n).factory
            kinds.append("f")
            argdefs.append(_MISSING)
        elif isinstance(ns[n], _Uncompared):
            kinds.append("=")
            defaults[n] = ns.pop(n).default  # (a plain default as the class has it)
            argdefs.append(defaults[n])
            compared.remove(n)
        else:
            # (a default lives on the function, __defaults__, not in its code: such a field
            # compiles as a required one does)
            kinds.append("=")
            argdefs.append(ns.pop(n))

    def __init__(self: Any, *values: Any, **named: Any) -> None:
        # The first instance compiles the real __init__ (module docstring: compiled on first use).
        init: Any = _function(_init_code(frozen, tuple(kinds), names), scope, "__init__",
                              tuple(argdefs) or None)  # fmt: skip
        init.__qualname__ = f"{cls.__qualname__}.__init__"
        record.__init__ = init  # type: ignore[misc]
        init(self, *values, **named)

    ns.update(__slots__=names, __match_args__=names, __init__=__init__, _lean_defaults=defaults,
              _lean_compared=tuple(compared), __dataclass_fields__=_LazyFields(),
              __repr__=_dc_repr, __eq__=_dc_eq, __getstate__=_dc_values,
              __setstate__=_dc_setstate)  # fmt: skip
    if "__hash__" not in cls.__dict__ or cls.__dict__["__hash__"] is None:
        ns["__hash__"] = _dc_hash if frozen else None
    if frozen:
        ns.update(__setattr__=_frozen_setattr, __delattr__=_frozen_delattr)
    ns["__qualname__"] = cls.__qualname__
    record = type(cls.__name__, cls.__bases__, ns)
    return record


def _init_code(frozen: bool, kinds: tuple[str, ...], names: tuple[str, ...]) -> Any:
    """The code of ``__init__(self, <names>)`` setting each field: a parameter (kind ``=``,
    required or with its default in ``__defaults__``) or a factory's (``f``: ``_f<i>()``,
    called when the parameter is left at ``_MISSING``); through ``object.__setattr__`` when
    ``frozen``.  Only parameter (local) and attribute names differ between classes of one
    shape: they are placeholders ``_p<i>``/``_a<i>`` in the template."""
    template = _template(("init", frozen, kinds))
    rename = {f"_a{i}": n for i, n in enumerate(names)}
    if frozen:
        consts = tuple(rename.get(c, c) if isinstance(c, str) else c for c in template.co_consts)
        return template.replace(co_varnames=("self", *names), co_consts=consts)
    return template.replace(
        co_varnames=("self", *names), co_names=tuple(rename.get(n, n) for n in template.co_names)
    )


def replace(obj: _T, /, **changes: Any) -> _T:
    """``dataclasses.replace`` for records made by :func:`dataclass`."""
    kw = {n: getattr(obj, n) for n in obj.__match_args__}  # type: ignore[attr-defined]
    kw.update(changes)
    return obj.__class__(**kw)
