"""vmpin.lean.records.NamedTuple builds what typing.NamedTuple builds (a collections.namedtuple)."""

from __future__ import annotations

import pickle
from typing import NamedTuple as TypingNamedTuple

import pytest

from vmpin.lean.records import NamedTuple


class Lean(NamedTuple):
    a: int
    b: str = "x"
    c: tuple[int, ...] = ()

    @property
    def twice(self) -> int:
        return 2 * self.a


class Same(NamedTuple):  # same arity, other names: __new__'s code is shared, not its names
    p: int
    q: str = "y"
    r: tuple[int, ...] = (1,)


class Real(TypingNamedTuple):
    a: int
    b: str = "x"
    c: tuple[int, ...] = ()


class Empty(NamedTuple):
    pass


def test_behaves_like_typing_namedtuple() -> None:
    for args, kw in [((1,), {}), ((1, "y"), {}), ((), {"a": 2, "c": (3,)}), ((1,), {"b": "z"})]:
        lean, real = Lean(*args, **kw), Real(*args, **kw)
        assert tuple(lean) == tuple(real)
        assert lean._asdict() == real._asdict()
        assert repr(lean) == repr(real).replace("Real", "Lean")
        assert lean._replace(b="w") == real._replace(b="w")
    assert Lean._fields == Real._fields == ("a", "b", "c")
    assert Lean._field_defaults == Real._field_defaults
    assert Lean.__match_args__ == ("a", "b", "c")
    assert Lean(4).twice == 8 and Lean._make([5, "q", ()]) == (5, "q", ())
    assert Same(7) == (7, "y", (1,)) and Same(q="z", p=1).q == "z"
    assert Empty() == () and Empty._fields == ()
    assert pickle.loads(pickle.dumps(Lean(1, "b"))) == Lean(1, "b")


@pytest.mark.parametrize(
    ("args", "kw"), [((), {}), ((1, "b", (), 4), {}), ((1,), {"z": 1}), ((1,), {"a": 1})]
)
def test_wrong_arguments_are_refused_like_typing(
    args: tuple[object, ...], kw: dict[str, object]
) -> None:
    with pytest.raises(TypeError):
        Real(*args, **kw)
    with pytest.raises(TypeError):
        Lean(*args, **kw)


def test_dataclass_stand_in_behaves_like_dataclasses() -> None:
    """Records of one shape share __init__'s code, renamed: each still sets its own fields."""
    import dataclasses

    from vmpin.lean.dataclass import FrozenInstanceError, dataclass, field, replace

    @dataclass(frozen=True)
    class F:
        x: int
        y: str = "a"
        z: tuple[int, ...] = field(default_factory=tuple)

    @dataclass(frozen=True)
    class G:  # the same shape as F
        p: int
        q: str = "b"
        r: tuple[int, ...] = field(default_factory=lambda: (1,))

    @dataclass()
    class M:
        x: int
        y: dict[str, int] = field(default_factory=dict)

    @dataclasses.dataclass(frozen=True)
    class RealF:
        x: int
        y: str = "a"
        z: tuple[int, ...] = ()

    for args, kw in [((1,), {}), ((2, "q", (3,)), {}), ((), {"x": 3, "z": (4,)})]:
        lean, real = F(*args, **kw), RealF(*args, **kw)
        assert (lean.x, lean.y, lean.z) == (real.x, real.y, real.z)
        assert repr(lean) == repr(real).replace("RealF", "F")
    assert G(5) == G(p=5, q="b", r=(1,)) and G(5).q == "b" and F(1) != G(1)
    assert hash(F(1)) == hash(F(1)) and replace(F(1), y="r") == F(1, "r")
    with pytest.raises(FrozenInstanceError):
        F(1).x = 2
    m = M(1)
    m.x = 7
    assert m == M(7) and M(1).y is not M(1).y and M(1, {"a": 1}).y == {"a": 1}
    assert [f.name for f in dataclasses.fields(F)] == ["x", "y", "z"]
    for bad in [(), (1, "a", (), 4)]:
        with pytest.raises(TypeError):
            F(*bad)
    with pytest.raises(TypeError):
        F(1, w=2)


def test_dataclass_stand_in_leaves_uncompared_fields_out_of_eq_and_hash() -> None:
    """``field(default=, compare=False)`` (NodePlan.moved_from: where a plan was made from,
    which two plans of one node need not share)."""
    import dataclasses

    from vmpin.lean.dataclass import dataclass, field

    @dataclass(frozen=True)
    class U:
        x: int
        note: str | None = field(default=None, compare=False)

    @dataclasses.dataclass(frozen=True)
    class RealU:
        x: int
        note: str | None = dataclasses.field(default=None, compare=False)

    a, b = U(1), U(1, "other")
    assert a == b and hash(a) == hash(b) and a != U(2, "other")
    assert RealU(1) == RealU(1, "other")  # (as dataclasses has it)
    assert b.note == "other" and a.note is None
    assert repr(b) == repr(RealU(1, "other")).replace("RealU", "U")
    assert [(f.name, f.compare) for f in dataclasses.fields(U)] == [
        (f.name, f.compare) for f in dataclasses.fields(RealU)
    ]
    with pytest.raises(TypeError):
        field(default=1)  # (what vmpin uses alone: a plain default needs no field)


@pytest.mark.parametrize("kind", ["new", "init"])
def test_shapes_module_is_generated_and_current(kind: str) -> None:
    """vmpin/lean/shapes.py and initshapes.py are what _lean writes (``python -m
    vmpin.lean.records``), each with the templates of its kind, and each template in them is
    the code _lean would compile for that shape."""
    import importlib
    from pathlib import Path

    from vmpin.lean import records as _lean

    _shapes = importlib.import_module(f"vmpin.lean.{_lean.GENERATED[kind]}")
    assert Path(_shapes.__file__).read_text() == _lean.shapes_source(kind)
    assert list(_shapes.CODE) == [key for key in _lean.SHAPES if key[0] == kind]
    assert {k for key in _lean.SHAPES for k in [key[0]]} == set(_lean.GENERATED)
    for key, code in _shapes.CODE.items():
        scope: dict[str, object] = {}
        exec(_lean._source(key), scope)
        fresh = scope[_lean._name(key)].__code__  # type: ignore[attr-defined]
        assert (fresh.co_code, fresh.co_consts, fresh.co_names, fresh.co_varnames) == (
            code.co_code, code.co_consts, code.co_names, code.co_varnames)  # fmt: skip


def test_namedtuples_alone_load_no_dataclass_half() -> None:
    """A process that makes NamedTuples only (a plain container's hook) does not load the
    dataclass half (vmpin.lean.dataclass), nor its templates (vmpin.lean.initshapes); one
    that makes a dataclass loads those, and no NamedTuple templates when it makes none."""
    import subprocess
    import sys

    probe = """
import sys
from vmpin.lean.records import NamedTuple
class P(NamedTuple):
    a: int
    b: str = "x"
assert P(1) == (1, "x")
print(sorted(m for m in sys.modules if m.startswith("vmpin.lean.")))
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['vmpin.lean.records', 'vmpin.lean.shapes']"
    probe = """
import sys
from vmpin.lean.records import dataclass
@dataclass(frozen=True)
class D:
    a: int
    b: int
    c: int
assert D(1, 2, 3).c == 3
print(sorted(m for m in sys.modules if m.startswith("vmpin.lean.")))
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == (
        "['vmpin.lean.dataclass', 'vmpin.lean.initshapes', 'vmpin.lean.records']")


def test_records_compile_nothing_for_known_shapes_and_the_rest_on_first_use() -> None:
    """In a fresh interpreter: defining records compiles nothing; the first instance of a
    shape with a factory compiles its template once, and the class then has the real
    method (later instances do not go through the stand-in)."""
    import subprocess
    import sys

    probe = """
import builtins
from vmpin.lean import records as _lean
compiles = []
real_exec = builtins.exec
def counting_exec(src, *a):
    compiles.append(src)
    return real_exec(src, *a)
_lean.exec = counting_exec
from vmpin.lean.records import NamedTuple, dataclass, field
class P(NamedTuple):
    a: int
    b: str = "x"
@dataclass(frozen=True, slots=True)
class F:
    a: int
    b: int = 2
    c: int = 3
@dataclass(slots=True)
class M:
    a: int
    b: list = field(default_factory=list)
defined = len(compiles)
p, f, m = P(1), F(a=1), M(3)
assert (p, f.b, m.b) == ((1, "x"), 2, []), (p, f, m)
stand_ins = (P.__new__.__name__, F.__init__.__code__.co_varnames, M.__init__.__code__.co_varnames)
M(4, [1]); F(5, 6); P(7, "y")
print(defined, len(compiles), stand_ins)
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.split(" ", 2)[:2] == ["0", "1"], out.stdout  # only M's factory shape
    assert "('self', 'a', 'b')" in out.stdout


def test_every_record_of_vmpin_has_a_precompiled_template() -> None:
    """A new record whose shape _shapes lacks would compile its method in every process that
    makes one (~0.1-0.3 ms): add its shape to _lean.SHAPES and run
    ``python -m vmpin.lean.records``."""
    import importlib
    import pkgutil

    import vmpin
    from vmpin.lean import initshapes, shapes
    from vmpin.lean.dataclass import _Factory

    missing = []
    for info in pkgutil.walk_packages(vmpin.__path__, "vmpin."):
        if info.name.endswith("__main__"):
            continue
        mod = importlib.import_module(info.name)
        for cls in vars(mod).values():
            if not isinstance(cls, type) or cls.__module__ != mod.__name__:
                continue
            if "_lean_defaults" in cls.__dict__:
                kinds = tuple("f" if isinstance(d, _Factory) else "="
                              for d in cls.__dict__["_lean_defaults"].values())  # fmt: skip
                key: tuple[object, ...] = ("init", "__delattr__" in cls.__dict__, kinds)
            elif issubclass(cls, tuple) and "_field_defaults" in cls.__dict__:
                key = ("new", len(cls._fields))  # type: ignore[attr-defined]
            else:
                continue
            if key not in (shapes.CODE if key[0] == "new" else initshapes.CODE):
                missing.append((info.name, cls.__name__, key))
    assert not missing
