"""Go's encoding/json key matching (vmpin.core.gojson), checked against Go's documented rules."""

from __future__ import annotations

import pytest

from vmpin.core import gojson
from vmpin.linux.files import load_json

FIELDS = ("cpus", "mems", "cpuSet")


@pytest.mark.parametrize(
    ("doc", "name", "want"),
    [
        ('{"cpus": "1"}', "cpus", ["1"]),
        ('{"CPUS": "1"}', "cpus", ["1"]),
        ('{"Cpus": "1", "cpus": "2"}', "cpus", ["1", "2"]),  # both decoded, in order
        ('{"cpuset": "1"}', "cpuSet", ["1"]),
        # U+017F LATIN SMALL LETTER LONG S folds to S under Unicode simple folding
        ('{"cpu\u017fet": "1"}', "cpuSet", ["1"]),
        ('{"mems": "0"}', "cpus", []),
        ('{"cpu s": "0"}', "cpus", []),
    ],
)
def test_field_values(doc: str, name: str, want: list[str]) -> None:
    obj = load_json(doc, "test", object_pairs_hook=gojson.Obj)
    assert gojson.field_values(obj, name, FIELDS) == want


def test_exact_name_of_another_field_is_not_folded() -> None:
    fields = ("a", "A")
    obj = load_json('{"A": 1, "a": 2}', "test", object_pairs_hook=gojson.Obj)
    assert gojson.field_values(obj, "a", fields) == [2]
    assert gojson.field_values(obj, "A", fields) == [1]


def test_fold_keeps_multi_rune_mappings_out() -> None:
    # Go's simple folding never maps one rune to two: ß stays ß
    assert gojson.fold("ß") == "ß"
    assert gojson.fold("aB") == "AB"
