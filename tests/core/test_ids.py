"""The id rule (vmpin.core.ids) checked against runc's rule written as the regular expression
it replaced: the set test must accept and refuse exactly the same strings."""

from __future__ import annotations

import random
import re

import pytest

from vmpin.core.errors import IdError
from vmpin.core.ids import check_id

RUNC_RULE = re.compile(r"[A-Za-z0-9_+\-][A-Za-z0-9_+\-.]{0,1023}")


def _accepts(value: str) -> bool:
    try:
        check_id(value)
    except IdError:
        return False
    return True


@pytest.mark.parametrize("value", [
    "", ".", "..", ".hidden", "a/b", "../x", "a b", "a\n", "a\x00", "é", "٣", "\uff41",
    "a" * 1024, "a" * 1025, "-", "+", "_", "a.", "a..b", "0" * 64, "pod_1+x-y.z",
])
def test_edge_cases_match_runc_rule(value: str) -> None:
    assert _accepts(value) == bool(RUNC_RULE.fullmatch(value))


def test_random_strings_match_runc_rule() -> None:
    rng = random.Random(14)
    alphabet = "aZ09_+-./ \n\x00é"
    for _ in range(20_000):
        value = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 6)))
        assert _accepts(value) == bool(RUNC_RULE.fullmatch(value)), value


def test_refusal_names_what() -> None:
    with pytest.raises(IdError, match=re.escape("sandbox id: invalid id '../x'")):
        check_id("../x", "sandbox id")
