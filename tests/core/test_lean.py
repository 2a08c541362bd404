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
