"""vmpin.core._lean.NamedTuple builds what typing.NamedTuple builds (a collections.namedtuple)."""

from __future__ import annotations

import pickle
from typing import NamedTuple as TypingNamedTuple

import pytest

from vmpin.core._lean import NamedTuple


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

    from vmpin.core._lean import FrozenInstanceError, dataclass, field, replace

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
