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

The ``dataclass`` stand-in is :mod:`vmpin.lean.dataclass`, whose names this module hands
over when first asked for (its ``__getattr__``): modules import both from here, and the
plain containers' hook, which makes NamedTuples only, never loads that half.
"""

from __future__ import annotations

from _collections import _tuplegetter  # type: ignore[import-not-found]  # (C, built in)

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

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


# -- templates -------------------------------------------------------------------------------
#: A template is the code of a record method for one shape, with placeholder names:
#: ``("new", n)`` a NamedTuple's ``__new__`` with n fields; ``("init", frozen, kinds)`` a
#: dataclass's ``__init__`` (kinds: ``=`` a parameter, ``f`` a factory's).  Those of the
#: shapes vmpin's records have (SHAPES) come compiled, with the .pyc of a generated module
#: per kind (:data:`GENERATED`; from :func:`_source`, by ``python -m vmpin.lean.records``),
#: loaded when a process first needs a template of that kind: a plain container's hook
#: makes NamedTuples only, and unmarshalling the dataclass templates too was 0.3 M of its
#: ~46 M instructions (bench/bench_hook_ir.py).  Any other shape is compiled here, once per
#: process.  The guest program's zipapp ships neither module: zipimport compiles a module's
#: source on every run, which would cost more than the few shapes the guest program
#: instantiates.
_TEMPLATES: dict[tuple[Any, ...], Any] = {}
#: the kinds whose generated module was looked for (found or not: once per process)
_LOADED: set[str] = set()
#: the generated module of each kind of template, in vmpin/lean/
GENERATED = {"new": "shapes", "init": "initshapes"}
#: the shapes of vmpin's records, those _shapes holds (tests/core/test_lean.py checks every
#: record of vmpin finds its shape here: a new one is added here, then the file regenerated).
#: Only these: unmarshalling a template costs about what compiling one does at first use.
SHAPES: tuple[tuple[Any, ...], ...] = (
    *(("new", n) for n in (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 18)),
    *(("init", True, ("=",) * n) for n in (3, 4, 6, 8, 9, 12, 13, 14, 15)),
    *(("init", False, ("=",) * n) for n in (3, 6)),
    ("init", True, ("=", "=", "=", "f", "=", "=")),
    ("init", True, ("=", "=", "=", "f", "=", "=", "=")),  # Observation, with allocations
    ("init", True, ("=", "=", "=", "=", "=", "f", "=", "=", "=", "f", "=")),  # NodePlan
    ("init", False, ("f", "f", "f")),
)


def _template(key: tuple[Any, ...]) -> Any:
    code = _TEMPLATES.get(key)
    if code is None:
        kind = key[0]
        if kind not in _LOADED:
            _LOADED.add(kind)
            _TEMPLATES.update(_precompiled(kind))
            code = _TEMPLATES.get(key)
        if code is None:
            scope: dict[str, Any] = {}
            exec(_source(key), scope)
            code = _TEMPLATES[key] = scope[_name(key)].__code__
    return code


def _precompiled(kind: str) -> dict[tuple[Any, ...], Any]:
    """The generated templates of one kind (GENERATED), none when its module is not there."""
    try:
        if kind == "new":
            from vmpin.lean.shapes import CODE as new

            return dict(new)
        from vmpin.lean.initshapes import CODE as init

        return dict(init)
    except ImportError:  # the guest's zipapp ships none (its modules compile anyway)
        return {}


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


def shapes_source(kind: str = "new") -> str:
    """The text of the generated module of one kind of template (:data:`GENERATED`): the
    template of every shape of that kind in SHAPES."""
    what = "NamedTuple ``__new__``" if kind == "new" else "dataclass ``__init__``"
    parts = [
        f'"""{what} templates of vmpin.lean.records, compiled with this .pyc (issue 14).\n\n'
        "Generated by ``python -m vmpin.lean.records``: do not edit; tests/core/test_lean.py\n"
        "checks that it is what vmpin.lean.records.shapes_source() writes.  Each function is\n"
        "never called as such: its code, renamed per class, becomes a record's ``__new__`` or\n"
        "``__init__`` (free names ``_tuple_new``, ``_set``: that class's globals).\n"
        '"""\n\n# ruff: noqa\n# mypy: ignore-errors\n\nCODE = {}\n'
    ]
    for key in SHAPES:
        if key[0] == kind:
            parts.append(f"\n\n{_source(key)}\n\nCODE[{key!r}] = {_name(key)}.__code__\n")
    return "".join(parts)


# -- the dataclass half, in vmpin.lean.dataclass -------------------------------------------------
#: what modules import from here by their old name and vmpin.lean.dataclass has: the plain
#: containers' hook makes NamedTuples only, and the dataclass half (three classes, ~30 code
#: objects) was ~0.5 M of its ~46 M instructions (bench/bench_hook_ir.py), so it is loaded
#: when a module first asks for one of these (PEP 562), by the paths that plan
_DATACLASS_NAMES = frozenset({"FrozenInstanceError", "dataclass", "field", "replace"})


def __getattr__(name: str) -> Any:
    if name not in _DATACLASS_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import vmpin.lean.dataclass

    # here from now on: the next module's import finds them without this call
    half = vmpin.lean.dataclass.__dict__
    names = globals()
    for each in _DATACLASS_NAMES:
        names[each] = half[each]
    return names[name]


if __name__ == "__main__":
    import os

    for kind, module in GENERATED.items():
        here = os.path.dirname(os.path.abspath(__file__))
        with open(os.path.join(here, f"{module}.py"), "w") as f:
            f.write(shapes_source(kind))
