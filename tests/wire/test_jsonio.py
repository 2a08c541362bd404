"""vmpin.wire.jsonio is json, minus the import: same values, same text, same errors.

Compared with :mod:`json` itself on generated documents (hypothesis) and on the malformed,
BOM-prefixed, UTF-16, deep and trailing-garbage inputs a hostile writer would try; and a fresh
interpreter shows that reading and writing well-formed JSON imports neither json nor re.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vmpin.core.gojson import Obj
from vmpin.wire import jsonio

ROOT = Path(__file__).resolve().parents[2]

values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(), inner, max_size=5),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(values, st.booleans(), st.booleans(), st.sampled_from([None, (",", ":"), (", ", ": ")]))
def test_same_text_and_values_as_json(
    value: object, ascii_: bool, sort: bool, seps: tuple[str, str] | None
) -> None:
    text = jsonio.dumps(value, ensure_ascii=ascii_, sort_keys=sort, separators=seps)
    assert text == json.dumps(value, ensure_ascii=ascii_, sort_keys=sort, separators=seps)
    assert jsonio.loads(text) == json.loads(text)
    assert jsonio.loads(f" \n{text}\t\r ".encode("utf-8", "surrogatepass")) == json.loads(text)
    if isinstance(value, dict):
        pairs = jsonio.loads(text, object_pairs_hook=Obj)
        assert pairs.pairs == json.loads(text, object_pairs_hook=Obj).pairs


indented_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=4)
    | st.lists(inner, max_size=3).map(tuple)
    | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(indented_values, st.booleans(), st.sampled_from([0, 1, 2, 4]))
def test_indented_text_is_jsons(value: object, ascii_: bool, indent: int) -> None:
    """The read commands' --json views are printed indented without json (and its re)."""
    text = jsonio.dumps(value, ensure_ascii=ascii_, indent=indent)
    assert text == json.dumps(value, ensure_ascii=ascii_, indent=indent)


@settings(max_examples=300, deadline=None)
@given(indented_values, st.booleans(), st.sampled_from([1, 2]))
def test_indented_sorted_text_is_jsons(value: object, ascii_: bool, indent: int) -> None:
    """The guest map is written indented with sorted keys (by the Kata hook, in-process)."""
    text = jsonio.dumps(value, ensure_ascii=ascii_, indent=indent, sort_keys=True)
    assert text == json.dumps(value, ensure_ascii=ascii_, indent=indent, sort_keys=True)


def test_indented_cycle_and_odd_keys_are_jsons() -> None:
    loop: list[object] = []
    loop.append(loop)
    with pytest.raises(ValueError, match="Circular reference"):
        jsonio.dumps(loop, indent=2)
    assert jsonio.dumps({1: [2], None: 3}, indent=2) == json.dumps({1: [2], None: 3}, indent=2)
    # sorted: json sorts the items before it turns their keys into text
    for odd in ({2: 0, 10: 1}, {"b": {3: 0, 1: 1}, "a": 1}):
        assert jsonio.dumps(odd, indent=1, sort_keys=True) == json.dumps(
            odd, indent=1, sort_keys=True
        )
    with pytest.raises(TypeError):
        jsonio.dumps({1: 0, "a": 1}, indent=1, sort_keys=True)  # as json: no order for those


def test_flat_dicts_and_number_lists_are_jsons() -> None:
    """A dict of leaves (written by _json's encoder in one call) and lists of numbers (one
    join): the guest map's shapes, with every leaf json writes its own way."""
    leaves = {"x": 1, "\u00e9": "\u00fc", "t": True, "f": False, "n": None, "z": 1.5,
              "inf": float("inf"), "-inf": float("-inf"), "nan": float("nan"), "big": 10**30}
    doc = {"b": leaves, "a": [[3, 1], [2], [], [True], [1, "x"], 7, [[1]]], "c": {"0": 0},
           "d": (1, 2), "e": {}, "g": {"k": leaves, "v": 2}, "i": [leaves]}  # fmt: skip
    for ascii_ in (True, False):
        for sort in (True, False):
            for indent in (0, 1, 2):
                got = jsonio.dumps(doc, ensure_ascii=ascii_, sort_keys=sort, indent=indent)
                assert got == json.dumps(doc, ensure_ascii=ascii_, sort_keys=sort, indent=indent)
    # keys json converts (and cannot order among str keys): left to json, as before
    odd = {"a": {1: 2, None: 3, 1.5: 4}}
    assert jsonio.dumps(odd, indent=1) == json.dumps(odd, indent=1)


@given(st.text(max_size=30) | st.binary(max_size=30))
def test_same_outcome_on_any_input(data: str | bytes) -> None:
    try:
        expected: object = ("ok", json.loads(data))
    except (ValueError, TypeError) as err:
        expected = (type(err), str(err))
    try:
        got: object = ("ok", jsonio.loads(data))
    except (ValueError, TypeError) as err:
        got = (type(err), str(err))
    if expected[0] == "ok" and isinstance(expected[1], float) and math.isnan(expected[1]):
        assert got[0] == "ok" and math.isnan(got[1])  # type: ignore[index,arg-type]
    else:
        assert got == expected


@pytest.mark.parametrize(
    "data",
    [b"", b"  ", b"{", b'{"a": 1} x', b'{"a": 1}{}', b"\xef\xbb\xbf{}", "\ufeff{}",
     '{"a": 1}'.encode("utf-16"), '{"a": 1}'.encode("utf-16-le"), '{"a": 1}'.encode("utf-32"),
     b'{"a": "\xff"}', b'["\\ud800"]', b"[NaN, Infinity, -Infinity]", b'{"a":1,}', b"01",
     b'"\x01"', b"[" * 5000],
)  # fmt: skip
def test_hostile_inputs_behave_as_json(data: bytes | str) -> None:
    def outcome(f: object) -> object:
        try:
            return ("ok", repr(f(data)))  # type: ignore[operator]
        except (ValueError, TypeError, RecursionError) as err:
            return (type(err), str(err))

    assert outcome(jsonio.loads) == outcome(json.loads)


def _prune(value: object, keep: jsonio.Selector) -> object:
    """What loads_members should give: ``value`` with only the selected members."""
    if not isinstance(value, dict):
        return value
    pairs = [(k, v if want is True else _prune(v, want)) for k, v in value.pairs  # type: ignore[attr-defined]
             for want in [keep(k)] if want is not None]  # fmt: skip
    return Obj(pairs)


def _keep_a(key: str) -> jsonio.Selector | bool | None:
    return True if key == "a" else None


def _keep_top(key: str) -> jsonio.Selector | bool | None:
    """"a" whole, of "b" only its "a", nothing else (a config.json's shape)."""
    return {"a": True, "b": _keep_a}.get(key)  # type: ignore[return-value]


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["a", "b", "c", ""]), values, max_size=6),
       st.sampled_from(["", " ", "\n\t "]))  # fmt: skip
def test_members_are_the_documents(value: dict[str, object], ws: str) -> None:
    """The members kept are what loads gives for them, in order, repeated keys and all."""
    text = json.dumps(value, separators=("," + ws, ":" + ws))
    # repeated keys, as Go reads them, and a value the selector would walk into
    rest = f",{text[1:]}" if value else "}"
    text = f"{ws}{{{ws}\"b\"{ws}:{ws}{{\"a\": 1, \"c\": [{{}}]}}{ws}{rest}{ws}"
    whole = jsonio.loads(text, object_pairs_hook=Obj)
    got = jsonio.loads_members(text, _keep_top, object_pairs_hook=Obj)
    assert got.pairs == _prune(whole, _keep_top).pairs  # type: ignore[attr-defined]
    assert type(jsonio.loads_members(text, _keep_top)) is dict


@given(st.text(max_size=30) | st.binary(max_size=30))
def test_members_same_outcome_on_any_input(data: str | bytes) -> None:
    """Accepted or refused as json accepts or refuses it, with json's error."""
    try:
        expected: object = ("ok", _prune(json.loads(data, object_pairs_hook=Obj), _keep_top))
    except (ValueError, TypeError) as err:
        expected = (type(err), str(err))
    try:
        got: object = ("ok", jsonio.loads_members(data, _keep_top, object_pairs_hook=Obj))
    except (ValueError, TypeError) as err:
        got = (type(err), str(err))
    if expected[0] == "ok" and isinstance(expected[1], float) and math.isnan(expected[1]):
        assert got[0] == "ok" and math.isnan(got[1])  # type: ignore[index,arg-type]
    else:
        assert repr(got) == repr(expected)


@pytest.mark.parametrize(
    "data",
    [b"", b"{", b'{"a": 1} x', b'{"a": 1,}', b'{"c": [1,]}', b'{"c" 1}', b'{"b": {"a": }}',
     b'{"c": "\x01"}', b'{c: 1}', b'{"b": 1, "a": [1, 2]}', b'{"b": null}', b"[1]", b'"x"',
     b'{"b": [{"a": 1}]}', b" {} ", b'{"c": ' + b"[" * 5000 + b"]" * 5000 + b"}"],
)  # fmt: skip
def test_members_hostile_inputs_behave_as_json(data: bytes) -> None:
    def outcome(f: object) -> object:
        try:
            return ("ok", repr(f()))  # type: ignore[operator]
        except (ValueError, TypeError, RecursionError) as err:
            return (type(err), str(err))

    want = outcome(lambda: _prune(json.loads(data, object_pairs_hook=Obj), _keep_top))
    assert outcome(lambda: jsonio.loads_members(data, _keep_top, object_pairs_hook=Obj)) == want


def test_unserializable_is_jsons_type_error() -> None:
    with pytest.raises(TypeError, match="Object of type set is not JSON serializable"):
        jsonio.dumps({"a": {1}})
    with pytest.raises(ValueError, match="Circular reference"):
        loop: list[object] = []
        loop.append(loop)
        jsonio.dumps(loop)
    assert jsonio.dumps({"b": 1, "a": [1]}, indent=1) == json.dumps({"b": 1, "a": [1]}, indent=1)


def test_no_json_or_re_imported() -> None:
    code = (
        "import sys; from vmpin.wire import jsonio; "
        "v = jsonio.loads(b' {\"a\": [1, 2.5, null, \"\\\\u00e9\"]} '); "
        "t = jsonio.dumps(v, ensure_ascii=False); "
        "print(t, sorted(m for m in sys.modules if m in ('json', 're', 'json.decoder')))"
    )
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True,
                         check=True, env={"PYTHONPATH": str(ROOT)}).stdout  # fmt: skip
    assert out.strip() == '{"a": [1, 2.5, null, "é"]} []'
