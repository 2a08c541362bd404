"""Runtime stand-ins that keep :mod:`typing` off the hook path.

Importing ``typing`` costs ~6 ms here, and ``typing.NamedTuple`` type-checks every field of
every class at import (~3 ms more for vmpin's records): together a fifth of what the hook may
cost on top of a bare interpreter.  Modules on the hook path therefore write::

    TYPE_CHECKING = False
    if TYPE_CHECKING:
        from typing import Any, NamedTuple
    else:
        from vmpin.lean.records import NamedTuple

mypy takes any name ``TYPE_CHECKING`` as true and checks against the real ``typing``; at run
time the class below builds the same ``collections.namedtuple`` that ``typing.NamedTuple``
builds (fields from the annotations, in order; defaults from the class body; methods,
properties and the docstring copied over), without importing ``typing`` -- nor
``collections``, which :func:`_namedtuple` replaces (~1 ms of a hook).

Compiled on first use: a record's ``__new__`` (NamedTuple) or ``__init__`` (dataclass) is
generated code, and compiling it cost 0.1-0.15 ms per class, ~2.8 ms for the 23 classes a Kata
hook's modules define (issue 14), most of which that process never instantiates.  So a class
starts with a stand-in that compiles the real method on the first instance and puts it on the
class; every later instance runs the compiled one, exactly as before.  Compiled code is shared
by shape (number of fields; for ``__init__``, frozen-ness and which fields have factories).
"""

from __future__ import annotations

from _collections import _tuplegetter  # type: ignore[import-not-found]  # (C, built in)

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, TypeVar

    _T = TypeVar("_T")

_function: Any = type(lambda: None)  # types.FunctionType, without importing types

_NOT_COPIED = frozenset(
    {"__annotations__", "__module__", "__qualname__", "__dict__", "__weakref__", "__doc__"}
)


# collections.namedtuple's methods, written once for every class (they read ``_fields``):
# closures per class made a record's class ~0.1 ms dearer to create, on every hook.
def _make(cls: type, iterable: Any) -> Any:
    result: Any = tuple.__new__(cls, iterable)
    n = len(cls._fields)  # type: ignore[attr-defined]
    if len(result) != n:
        raise TypeError(f"Expected {n} arguments, got {len(result)}")
    return result


def _replace(self: Any, /, **kwds: Any) -> Any:
    result = self._make(map(kwds.pop, self._fields, self))
    if kwds:
        raise ValueError(f"Got unexpected field names: {list(kwds)!r}")
    return result


def _repr(self: Any) -> str:
    inner = ", ".join([f"{f}={v!r}" for f, v in zip(self._fields, self, strict=True)])
    return f"{self.__class__.__name__}({inner})"


def _asdict(self: Any) -> dict[str, Any]:
    return dict(zip(self._fields, self, strict=True))


def _getnewargs(self: Any) -> tuple[Any, ...]:
    return tuple(self)


_repr.__name__, _getnewargs.__name__ = "__repr__", "__getnewargs__"
_MAKE: Any = classmethod(_make)


def _namedtuple(
    name: str,
    fields: tuple[str, ...],
    defaults: tuple[Any, ...],
    module: str,
    body: dict[str, Any] | None = None,
) -> type:
    """``collections.namedtuple(name, fields, defaults=, module=)``, the same class, without
    importing ``collections`` (~1 ms of a hook: Counter, OrderedDict, ChainMap, UserDict...);
    ``body``: the class body's own entries (methods, properties, ``__qualname__``, docstring),
    in the class from its creation (setting them after cost a slot update each)."""
    args = ", ".join(fields)
    scope: dict[str, Any] = {"_tuple_new": tuple.__new__, "__builtins__": {},
                             "__name__": f"namedtuple_{name}"}  # fmt: skip
    n = len(fields)

    def compiled() -> Any:
        # collections.namedtuple's __new__: one template per arity, renamed per class (its
        # parameters are locals: only their names differ)
        code = _template(("new", n))
        new = _function(code.replace(co_varnames=("_cls", *fields)), scope)
        new.__name__, new.__defaults__, new.__qualname__ = "__new__", defaults or None, (
            f"{cls.__qualname__}.__new__")  # fmt: skip
        new.__doc__ = f"Create new instance of {name}({args})"
        return new

    def __new__(_cls: type, *values: Any, **named: Any) -> Any:
        # The first instance compiles the real __new__ (module docstring: compiled on first use).
        new = compiled()
        cls.__new__ = staticmethod(new)  # type: ignore[method-assign]
        return new(_cls, *values, **named)

    ns: dict[str, Any] = {
        "__doc__": f"{name}({args})", "__slots__": (), "_fields": fields,
        "_field_defaults": dict(zip(fields[n - len(defaults):], defaults, strict=True)),
        "__new__": __new__, "_make": _MAKE, "_replace": _replace,
        "__repr__": _repr, "_asdict": _asdict, "__getnewargs__": _getnewargs,
        "__match_args__": fields, "__module__": module,
    }  # fmt: skip
    for index, field_name in enumerate(fields):
        ns[field_name] = _tuplegetter(index, f"Alias for field number {index}")
    if body:
        ns.update(body)
    cls = type(name, (tuple,), ns)
    return cls


class _NamedTupleMeta(type):
    def __new__(mcls, name: str, bases: tuple[type, ...], ns: dict[str, object]) -> type:
        if not bases:
            return super().__new__(mcls, name, bases, ns)
        if "__classcell__" in ns:
            raise TypeError(f"{name}: super() is not supported in NamedTuple methods")
        fields = list(ns.get("__annotations__", {}))  # type: ignore[call-overload]
        defaults = [ns[f] for f in fields if f in ns]
        body = {k: v for k, v in ns.items() if k not in _NOT_COPIED and k not in fields}
        body["__qualname__"] = str(ns.get("__qualname__", name))
        if ns.get("__doc__"):
            body["__doc__"] = str(ns["__doc__"])
        return _namedtuple(name, tuple(fields), tuple(defaults), str(ns.get("__module__")), body)


class NamedTuple(metaclass=_NamedTupleMeta):
    """Subclass like ``typing.NamedTuple``; the subclass *is* a ``collections.namedtuple``."""


# -- dataclass ---------------------------------------------------------------------------------
# ``dataclasses`` imports ``inspect`` (with ``dis``, ``ast``, ``tokenize``, ``re``, ``copy``):
# ~4 ms, and ~1 ms more to process the reconcile pass's records, on a Kata hook that pins
# in-process.  Modules on that path write::
#
#     if TYPE_CHECKING:
#         from dataclasses import dataclass, field, replace
#     else:
#         from vmpin.lean.records import dataclass, field, replace
#
# mypy checks against the real dataclasses.  What is supported is what vmpin uses:
# ``@dataclass(frozen=..., slots=True)`` with plain defaults and ``field(default_factory=)``;
# the class gets the same ``__init__``, ``__repr__``, ``__eq__``, ``__hash__`` (frozen: of the
# fields; else unhashable), ``__match_args__``, ``__slots__`` and frozen-ness as from
# dataclasses, and pickles/copies like it.


class FrozenInstanceError(AttributeError):
    """Assigning to a field of a frozen record (as ``dataclasses.FrozenInstanceError``)."""


class _Factory:
    __slots__ = ("factory",)

    def __init__(self, factory: Callable[[], object]) -> None:
        self.factory = factory


_MISSING = object()


def field(*, default_factory: Callable[[], Any]) -> Any:
    return _Factory(default_factory)


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
            f._field_type = dataclasses._FIELD  # type: ignore[attr-defined]
            fields[n] = f
        return fields


def dataclass(*, frozen: bool = False, slots: bool = True) -> Callable[[type], type]:
    if not slots:
        raise TypeError("vmpin.lean.records.dataclass makes slotted classes only")
    return lambda cls: _record(cls, frozen)


# The records' methods, written once for every class (they read the field names from
# ``__match_args__``): see _make above.
def _dc_values(self: Any) -> tuple[Any, ...]:
    return tuple([getattr(self, n) for n in self.__match_args__])


def _dc_repr(self: Any) -> str:
    inner = ", ".join([f"{n}={getattr(self, n)!r}" for n in self.__match_args__])
    return f"{type(self).__qualname__}({inner})"


def _dc_eq(self: Any, other: object) -> Any:
    if other.__class__ is not self.__class__:
        return NotImplemented
    return _dc_values(self) == _dc_values(other)


def _dc_hash(self: Any) -> int:
    return hash(_dc_values(self))


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
    for i, n in enumerate(names):
        if n not in ns:
            if argdefs:
                raise TypeError(f"non-default argument {n!r} follows default argument")
            kinds.append("=")
        elif isinstance(ns[n], _Factory):
            scope[f"_f{i}"] = ns.pop(n).factory
            kinds.append("f")
            argdefs.append(_MISSING)
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
              __dataclass_fields__=_LazyFields(),
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


# -- templates -------------------------------------------------------------------------------
#: A template is the code of a record method for one shape, with placeholder names:
#: ``("new", n)`` a NamedTuple's ``__new__`` with n fields; ``("init", frozen, kinds)`` a
#: dataclass's ``__init__`` (kinds: ``=`` a parameter, ``f`` a factory's).  Those of the
#: shapes vmpin's records have (SHAPES) come compiled, with the .pyc of
#: :mod:`vmpin.lean.shapes` (generated from :func:`_source` by ``python -m vmpin.lean.records``);
#: any other is compiled here, once per process.  The guest program's zipapp does not ship
#: _shapes: zipimport compiles a module's source on every run, which would cost more than the
#: few shapes the guest program instantiates.
_TEMPLATES: dict[tuple[Any, ...], Any] = {}
#: the shapes of vmpin's records, those _shapes holds (tests/core/test_lean.py checks every
#: record of vmpin finds its shape here: a new one is added here, then the file regenerated).
#: Only these: unmarshalling a template costs about what compiling one does at first use.
SHAPES: tuple[tuple[Any, ...], ...] = (
    *(("new", n) for n in (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 18)),
    *(("init", True, ("=",) * n) for n in (3, 4, 6, 8, 9, 11, 12, 13, 14, 15)),
    *(("init", False, ("=",) * n) for n in (3, 5)),
    ("init", True, ("=", "=", "=", "f", "=", "=")),
    ("init", True, ("=", "=", "=", "f", "=", "=", "=")),  # Observation, with allocations
    ("init", True, ("=", "=", "=", "=", "=", "f", "=", "=", "=", "f")),
    ("init", False, ("f", "f", "f")),
)


def _template(key: tuple[Any, ...]) -> Any:
    code = _TEMPLATES.get(key)
    if code is None:
        if not _TEMPLATES:
            _TEMPLATES.update(_precompiled())
            code = _TEMPLATES.get(key)
        if code is None:
            scope: dict[str, Any] = {}
            exec(_source(key), scope)
            code = _TEMPLATES[key] = scope[_name(key)].__code__
    return code


def _precompiled() -> dict[tuple[Any, ...], Any]:
    try:
        from vmpin.lean.shapes import CODE
    except ImportError:  # the guest's zipapp ships none (its modules compile anyway)
        return {("none",): None}  # (not empty: looked for once)
    return dict(CODE)


def _name(key: tuple[Any, ...]) -> str:
    return "__new__" if key[0] == "new" else "__init__"


def _source(key: tuple[Any, ...]) -> str:
    """The Python source of one template (see _TEMPLATES)."""
    if key[0] == "new":
        n = key[1]
        params = "".join(f", _{i}" for i in range(n))
        packed = ", ".join(f"_{i}" for i in range(n)) + ("," if n == 1 else "")
        return f"def __new__(_cls{params}):\n    return _tuple_new(_cls, ({packed}))\n"
    _, frozen, kinds = key
    body = []
    for i, kind in enumerate(kinds):
        value = f"_f{i}() if _p{i} is _MISSING else _p{i}" if kind == "f" else f"_p{i}"
        body.append(f'_set(self, "_a{i}", {value})' if frozen else f"self._a{i} = {value}")
    params = "".join(f", _p{i}" for i in range(len(kinds)))
    return f"def __init__(self{params}):\n    " + "\n    ".join(body or ["pass"]) + "\n"


def shapes_source() -> str:
    """The text of :mod:`vmpin.lean.shapes`: the template of every shape in SHAPES."""
    parts = [
        '"""Record templates of vmpin.lean.records, compiled with this .pyc (issue 14).\n\n'
        "Generated by ``python -m vmpin.lean.records``: do not edit; tests/core/test_lean.py\n"
        "checks that it is what vmpin.lean.records.shapes_source() writes.  Each function is\n"
        "never called as such: its code, renamed per class, becomes a record's ``__new__`` or\n"
        "``__init__`` (free names ``_tuple_new``, ``_set``: that class's globals).\n"
        '"""\n\n# ruff: noqa\n# mypy: ignore-errors\n\nCODE = {}\n'
    ]
    for key in SHAPES:
        parts.append(f"\n\n{_source(key)}\n\nCODE[{key!r}] = {_name(key)}.__code__\n")
    return "".join(parts)



def replace(obj: _T, /, **changes: Any) -> _T:
    """``dataclasses.replace`` for records made by :func:`dataclass`."""
    kw = {n: getattr(obj, n) for n in obj.__match_args__}  # type: ignore[attr-defined]
    kw.update(changes)
    return obj.__class__(**kw)


if __name__ == "__main__":
    import os

    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "shapes.py"), "w") as f:
        f.write(shapes_source())
