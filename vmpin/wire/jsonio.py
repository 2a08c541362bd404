"""JSON text in and out without importing :mod:`json`: the one reader/writer of the hook path.

Why not :mod:`json`: ``json/__init__`` imports ``json.decoder``, which imports ``re`` (with
``enum``, ``functools`` and the regex compiler: ~3 ms, a third of a bare interpreter's start),
and the OCI hook runs on every container start.  The work is done by the same C accelerator
:mod:`json` uses (``_json``), driven directly:

- :func:`loads` builds ``_json.make_scanner`` over a context object carrying what
  ``json.JSONDecoder`` would (``strict``, the hooks, ``parse_float``/``parse_int``/
  ``parse_constant`` as json's defaults, ``memo``), skips JSON whitespace by hand and refuses
  trailing data, so it accepts exactly what ``json.loads`` accepts and returns the same value;
  :func:`loads_members` accepts the same texts and keeps only the members a reader selects
  (the hook's config.json: its annotations and ``linux.resources``);
- :func:`dumps` drives ``_json.make_encoder`` with json's defaults and the same separators,
  so its text is byte for byte ``json.dumps``'s.

Errors keep json's wording: whenever the fast path fails (malformed input, a BOM or a UTF-16
document, an ``indent``, no ``_json``), the call is redone by :mod:`json` itself, which then
raises its own ``JSONDecodeError``/``TypeError``/``ValueError`` (or returns, for what the fast
path does not handle).  Only ``RecursionError`` passes straight through (the caller's depth
limit handles it).  Hostile input costs an import of :mod:`json`; well-formed input never does.
"""

from __future__ import annotations

import sys

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.lean.records)
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable
    from typing import Any

    PairsHook = Callable[[list[tuple[str, Any]]], Any] | None
    #: what loads_members keeps of an object's member, by its key (see there)
    Selector = Callable[[str], "Selector | bool | None"]

try:
    import _json as _c
except ImportError:  # pragma: no cover - CPython always has it; other interpreters use json
    _c = None  # type: ignore[assignment]

#: JSON's whitespace (RFC 8259): what json.decoder.WHITESPACE matches.
_WS = " \t\n\r"
_CONSTANTS = {"-Infinity": float("-inf"), "Infinity": float("inf"), "NaN": float("nan")}


#: types.SimpleNamespace, without importing types: the object _json.make_scanner reads its
#: settings off (a class of our own for it was ~0.1 M instructions of every hook)
_Namespace: Any = type(sys.implementation)


_scanners: dict[object, Callable[[str, int], tuple[Any, int]]] = {}


def _scanner(object_pairs_hook: PairsHook) -> Callable[[str, int], tuple[Any, int]]:
    scan = _scanners.get(object_pairs_hook)
    if scan is None:
        # what _json reads off a json.JSONDecoder (typeshed wants one: any object with its
        # attributes will do), with json's defaults
        context = _Namespace(
            strict=True, object_hook=None, object_pairs_hook=object_pairs_hook,
            parse_float=float, parse_int=int, parse_constant=_CONSTANTS.__getitem__, memo={},
        )  # fmt: skip
        scan = _scanners[object_pairs_hook] = _c.make_scanner(context)
    return scan


def _text(data: str | bytes) -> str:
    if isinstance(data, (bytes, bytearray)):
        # json.detect_encoding: anything but plain UTF-8 (a BOM, UTF-16/32) goes to json
        if not data or data[0] in (0, 0xEF, 0xFE, 0xFF) or (len(data) > 1 and data[1] == 0):
            raise ValueError("not plain UTF-8")
        return data.decode("utf-8", "surrogatepass")
    if isinstance(data, str):
        return data
    raise TypeError(type(data).__name__)


def _fast_loads(data: str | bytes, object_pairs_hook: PairsHook) -> Any:
    text = _text(data)
    start = len(text) - len(text.lstrip(_WS))
    value, end = _scanner(object_pairs_hook)(text, start)
    # a JSON value never ends in whitespace: anything but whitespace after it is extra data
    if end != len(text.rstrip(_WS)):
        raise ValueError("extra data")
    return value


def loads(data: str | bytes, *, object_pairs_hook: PairsHook = None) -> Any:
    """``json.loads(data, object_pairs_hook=...)``, without importing json unless it fails."""
    if _c is not None:
        try:
            return _fast_loads(data, object_pairs_hook)
        except RecursionError:
            raise
        except Exception:
            pass  # json redoes it and raises its own, exact error
    import json

    return json.loads(data, object_pairs_hook=object_pairs_hook)


def loads_members(
    data: str | bytes, keep: Selector, *, object_pairs_hook: PairsHook = None
) -> Any:
    """``loads(data, object_pairs_hook=...)`` of a JSON object, keeping only the members
    ``keep`` selects: ``keep(key)`` is None (or False) to leave the member out, True to keep
    it whole, or another selector to keep only some of the members of its value (when that
    is an object; any other value is kept whole).

    For a reader that needs a few members of a large document (the hook reads a
    config.json's annotations and ``linux.resources``: containerd's is ~15-40 KiB, most of
    it the seccomp profile, and building every object of it through a Python hook, then
    walking it for its depth, was ~3 M instructions of a 45 M hook at 14 KiB).  A member
    left out is still scanned by the C scanner (without the hook, its value dropped), so
    the text is accepted or refused exactly as :func:`loads` would, with json's errors."""
    if _c is not None:
        try:
            text = _text(data)
            scan, skim = _scanner(object_pairs_hook), _scanner(None)
            value, end = _members(text, _skip(text, 0), keep, scan, skim, object_pairs_hook)
            if _skip(text, end) != len(text):
                raise ValueError("extra data")
            return value
        except RecursionError:
            raise
        except Exception:
            pass  # loads redoes it: json's own error (or the whole document)
    return loads(data, object_pairs_hook=object_pairs_hook)


def _skip(text: str, pos: int) -> int:
    """The first position from ``pos`` on that is not JSON whitespace."""
    n = len(text)
    while pos < n and text[pos] in _WS:
        pos += 1
    return pos


def _members(
    text: str,
    pos: int,
    keep: Selector,
    scan: Callable[[str, int], tuple[Any, int]],
    skim: Callable[[str, int], tuple[Any, int]],
    hook: PairsHook,
) -> tuple[Any, int]:
    """The value at ``pos`` with only the members ``keep`` selects, and where it ends
    (json.decoder.JSONObject's grammar: ValueError, IndexError or StopIteration where it
    fails; whitespace skipped in place, no call each)."""
    if text[pos : pos + 1] != "{":
        return scan(text, pos)
    pairs: list[tuple[str, Any]] = []
    pos += 1
    while text[pos] in _WS:
        pos += 1
    if text[pos] == "}":
        return (hook(pairs) if hook is not None else {}), pos + 1
    while True:
        if text[pos] != '"':
            raise ValueError("expecting a property name")
        key, pos = _c.scanstring(text, pos + 1, True)
        while text[pos] in _WS:
            pos += 1
        if text[pos] != ":":
            raise ValueError("expecting ':'")
        pos += 1
        while text[pos] in _WS:
            pos += 1
        want = keep(key)
        if not want:
            pos = skim(text, pos)[1]
        else:
            value, pos = scan(text, pos) if want is True else _members(
                text, pos, want, scan, skim, hook
            )  # fmt: skip
            pairs.append((key, value))
        while text[pos] in _WS:
            pos += 1
        if text[pos] == "}":
            return (hook(pairs) if hook is not None else dict(pairs)), pos + 1
        if text[pos] != ",":
            raise ValueError("expecting ',' or '}'")
        pos += 1
        while text[pos] in _WS:
            pos += 1


#: the key types json's sort and the indented writer agree on (see _indented)
_STR_ONLY = frozenset({str})
#: the values _json's encoder writes as json's indented writer does (see _flat)
_LEAVES = frozenset({str, int, float, bool, type(None)})
#: a list of these is written in one join (see _indented)
_INT_ONLY = frozenset({int})


def _default(o: object) -> Any:
    raise TypeError(f"Object of type {o.__class__.__name__} is not JSON serializable")


def dumps(
    obj: Any,
    *,
    ensure_ascii: bool = True,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
    indent: int | None = None,
) -> str:
    """``json.dumps`` with these arguments (and json's defaults for the others), same text."""
    if _c is not None and indent is not None and separators is None:
        # json has no C encoder for indented output; its Python one imports re.  The read
        # commands print their --json views indented, and the guest map is written indented
        # with sorted keys (by the Kata hook that pins in-process), so that shape is here.
        try:
            quote_ = _c.encode_basestring_ascii if ensure_ascii else _c.encode_basestring
            out: list[str] = []
            _indented(obj, quote_, " " * indent, "\n", out, set(), sort_keys)
            return "".join(out)
        except NotImplementedError:  # (a value the indented writer leaves to json)
            pass  # json does it (keys that are not strings, subclasses, ...)
    if _c is None or indent is not None:
        import json

        return json.dumps(
            obj, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys,
            indent=indent,
        )  # fmt: skip
    item_sep, key_sep = separators or (", ", ": ")
    quote = _c.encode_basestring_ascii if ensure_ascii else _c.encode_basestring
    if isinstance(obj, str):
        return str(quote(obj))
    encode = _c.make_encoder({}, _default, quote, None, key_sep, item_sep, sort_keys, False, True)
    return "".join(encode(obj, 0))


def _indented(
    o: object,
    quote: Callable[[str], str],
    step: str,
    nl: str,
    out: list[str],
    seen: set[int],
    sort_keys: bool = False,
) -> None:
    """json.dumps(o, indent=..., sort_keys=...)'s text, for the plain types json's own writer
    takes; a cycle is left to json (its ValueError).  (json sorts a dict's items before it
    looks at their keys: with str keys only, which is all this writes, that is by key.)
    NotImplementedError for a value it leaves to json (its text would differ otherwise):
    a builtin's, not a class of ours, which every hook would build for nothing."""
    t = type(o)
    if t is dict and o and _flat(o, quote, nl, nl + step, out, sort_keys):  # type: ignore[arg-type]
        return
    if t is list or t is tuple or t is dict:
        if id(o) in seen:
            raise NotImplementedError
        seen.add(id(o))
    if t is str:
        out.append(quote(o))  # type: ignore[arg-type]
    elif o is None:
        out.append("null")
    elif o is True:
        out.append("true")
    elif o is False:
        out.append("false")
    elif t is int:
        out.append(int.__repr__(o))
    elif t is float:
        f: float = o  # type: ignore[assignment]
        if f != f:
            out.append("NaN")
        elif f in (float("inf"), float("-inf")):
            out.append("Infinity" if f > 0 else "-Infinity")
        else:
            out.append(float.__repr__(f))
    elif t is list or t is tuple:
        seq: list[object] = o  # type: ignore[assignment]
        if not seq:
            out.append("[]")
            return
        inner = nl + step
        comma = "," + inner
        append = out.append
        append("[")
        first = True
        opened = ""  # (a list of numbers' opening and separator, one level down: made once)
        for v in seq:
            append(inner if first else comma)
            first = False
            # numbers and lists of them here, the rest by a call each (a guest map's
            # siblings: a call per vCPU and per number was most of writing a map)
            tv = type(v)
            if tv is int:
                append(int.__repr__(v))
            elif tv is list and v and _INT_ONLY.issuperset(map(type, v)):  # type: ignore[call-overload]
                if not opened:
                    opened = "[" + inner + step
                    numbers = "," + opened[1:]
                    closed = inner + "]"
                append(opened)
                append(numbers.join(map(int.__repr__, v)))  # type: ignore[call-overload]
                append(closed)
            else:
                _indented(v, quote, step, inner, out, seen, sort_keys)
        append(nl + "]")
        seen.discard(id(o))
    elif t is dict:
        d: dict[object, object] = o  # type: ignore[assignment]
        if not d:
            out.append("{}")
            return
        if not _STR_ONLY.issuperset(map(type, d)):  # (in C: a generator was ~5% of a map)
            raise NotImplementedError
        inner = nl + step
        comma = "," + inner
        append = out.append
        append("{")
        sep = inner
        items: Iterable[tuple[object, object]] = d.items()
        if sort_keys:
            items = sorted(d.items())  # (by key: keys are unique, values never compared)
        for k, v in items:
            append(sep)
            sep = comma
            append(quote(k))  # type: ignore[arg-type]
            # the common leaves written here, not by a call each (a view is mostly leaves)
            tv = type(v)
            if tv is str:
                append(": ")
                append(quote(v))  # type: ignore[arg-type]
            elif v is None:
                append(": null")
            elif tv is int:
                append(": ")
                append(int.__repr__(v))
            elif v is True:
                append(": true")
            elif v is False:
                append(": false")
            else:
                append(": ")
                _indented(v, quote, step, inner, out, seen, sort_keys)
        append(nl + "}")
        seen.discard(id(o))
    else:
        raise NotImplementedError


def _flat(
    d: dict[object, object],
    quote: Callable[[str], str],
    nl: str,
    inner: str,
    out: list[str],
    sort_keys: bool,
) -> bool:
    """Write the non-empty ``d`` as :func:`_indented` would when it holds only leaves (str
    keys, scalar values), in one call to _json's encoder; False (nothing written) when not.

    Its items are json's indented text, each on its own line: the encoder writes a leaf
    as json's indented writer does (the same repr, quoting and constants), and the line
    break and indent of ``d``'s level is its item separator.  (A guest map's vCPU table and
    its containers' entries are such dicts: a call per leaf was most of writing them.)"""
    if not _LEAVES.issuperset(map(type, d.values())) or not _STR_ONLY.issuperset(map(type, d)):
        return False  # (other keys: json's conversions and its order of those, by _indented)
    encode = _c.make_encoder(None, _default, quote, None, ": ", "," + inner, sort_keys, False, True)
    text = "".join(encode(d, 0))
    out.append("{" + inner + text[1:-1] + nl + "}")
    return True
