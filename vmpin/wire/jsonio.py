"""JSON text in and out without importing :mod:`json`: the one reader/writer of the hook path.

Why not :mod:`json`: ``json/__init__`` imports ``json.decoder``, which imports ``re`` (with
``enum``, ``functools`` and the regex compiler: ~3 ms, a third of a bare interpreter's start),
and the OCI hook runs on every container start.  The work is done by the same C accelerator
:mod:`json` uses (``_json``), driven directly:

- :func:`loads` builds ``_json.make_scanner`` over a context object carrying what
  ``json.JSONDecoder`` would (``strict``, the hooks, ``parse_float``/``parse_int``/
  ``parse_constant`` as json's defaults, ``memo``), skips JSON whitespace by hand and refuses
  trailing data, so it accepts exactly what ``json.loads`` accepts and returns the same value;
- :func:`dumps` drives ``_json.make_encoder`` with json's defaults and the same separators,
  so its text is byte for byte ``json.dumps``'s.

Errors keep json's wording: whenever the fast path fails (malformed input, a BOM or a UTF-16
document, an ``indent``, no ``_json``), the call is redone by :mod:`json` itself, which then
raises its own ``JSONDecodeError``/``TypeError``/``ValueError`` (or returns, for what the fast
path does not handle).  Only ``RecursionError`` passes straight through (the caller's depth
limit handles it).  Hostile input costs an import of :mod:`json`; well-formed input never does.
"""

from __future__ import annotations

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.lean.records)
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable
    from typing import Any

    PairsHook = Callable[[list[tuple[str, Any]]], Any] | None

try:
    import _json as _c
except ImportError:  # pragma: no cover - CPython always has it; other interpreters use json
    _c = None  # type: ignore[assignment]

#: JSON's whitespace (RFC 8259): what json.decoder.WHITESPACE matches.
_WS = " \t\n\r"
_CONSTANTS = {"-Infinity": float("-inf"), "Infinity": float("inf"), "NaN": float("nan")}


class _Context:
    """What ``_json.make_scanner`` reads off a ``json.JSONDecoder``: json's defaults."""

    __slots__ = (
        "memo",
        "object_hook",
        "object_pairs_hook",
        "parse_constant",
        "parse_float",
        "parse_int",
        "strict",
    )

    def __init__(self, object_pairs_hook: PairsHook) -> None:
        self.strict = True
        self.object_hook = None
        self.object_pairs_hook = object_pairs_hook
        self.parse_float = float
        self.parse_int = int
        self.parse_constant = _CONSTANTS.__getitem__
        self.memo: dict[str, str] = {}


_scanners: dict[object, Callable[[str, int], tuple[Any, int]]] = {}


def _scanner(object_pairs_hook: PairsHook) -> Callable[[str, int], tuple[Any, int]]:
    scan = _scanners.get(object_pairs_hook)
    if scan is None:
        # typeshed wants a JSONDecoder: any object with its attributes is what _json reads
        context = _Context(object_pairs_hook)
        scan = _scanners[object_pairs_hook] = _c.make_scanner(context)  # type: ignore[arg-type]
    return scan


def _fast_loads(data: str | bytes, object_pairs_hook: PairsHook) -> Any:
    if isinstance(data, (bytes, bytearray)):
        # json.detect_encoding: anything but plain UTF-8 (a BOM, UTF-16/32) goes to json
        if not data or data[0] in (0, 0xEF, 0xFE, 0xFF) or (len(data) > 1 and data[1] == 0):
            raise ValueError("not plain UTF-8")
        text = data.decode("utf-8", "surrogatepass")
    elif isinstance(data, str):
        text = data
    else:
        raise TypeError(type(data).__name__)
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
        except _Unusual:
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


class _Unusual(Exception):
    """A value the indented writer leaves to json (its text would differ otherwise)."""


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
    looks at their keys: with str keys only, which is all this writes, that is by key.)"""
    t = type(o)
    if t is list or t is tuple or t is dict:
        if id(o) in seen:
            raise _Unusual
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
        out.append("[")
        for i, v in enumerate(seq):
            out.append(inner if i == 0 else "," + inner)
            _indented(v, quote, step, inner, out, seen, sort_keys)
        out.append(nl + "]")
        seen.discard(id(o))
    elif t is dict:
        d: dict[object, object] = o  # type: ignore[assignment]
        if not d:
            out.append("{}")
            return
        inner = nl + step
        comma = "," + inner
        append = out.append
        append("{")
        first = True
        items: Iterable[tuple[object, object]] = d.items()
        if sort_keys:
            if any(type(k) is not str for k in d):
                raise _Unusual
            items = sorted(d.items())  # (by key: keys are unique, values never compared)
        for k, v in items:
            if type(k) is not str:
                raise _Unusual
            append(inner if first else comma)
            first = False
            append(quote(k))
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
            else:
                append(": ")
                _indented(v, quote, step, inner, out, seen, sort_keys)
        append(nl + "}")
        seen.discard(id(o))
    else:
        raise _Unusual
