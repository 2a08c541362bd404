"""JSON read the way Go's ``encoding/json`` reads it into a struct.

Why: kubelet's checkpoint and ``runc update -r`` are decoded by Go into structs, and a file one
of them accepts must not be refused or misread by vmpin.  Go's decoder differs from reading a
Python dict by the exact key:

- an object key selects the struct field whose JSON name equals it exactly, else the one whose
  name equals it under Unicode simple case folding ("defaultCPUSet" fills ``defaultCpuSet``,
  "CPUS" fills ``cpus``); map keys are never folded;
- a key given twice (or twice under different case) is decoded twice, in order: the last
  scalar wins, objects decoded into the same map are merged;
- ``null`` leaves a string or number untouched and sets a map to nil;
- a value of the wrong JSON type is an error (``UnmarshalTypeError``) that fails the decode.

This module holds only the key matching and the per-field fold of repeated keys; each caller
checks types against its own struct.
"""

from __future__ import annotations

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.lean.records)
if TYPE_CHECKING:
    from typing import Any


class Obj(dict):  # type: ignore[type-arg]
    """A decoded JSON object that remembers every (key, value) pair in file order."""

    pairs: list[tuple[str, Any]]

    def __init__(self, pairs: list[tuple[str, Any]]) -> None:
        super().__init__(pairs)
        self.pairs = pairs


def fold(name: str) -> str:
    """Go's ``foldName``: ASCII upper-cased, other runes ``ToUpper(ToLower(r))`` (simple)."""
    if name.isascii():
        return name.upper()  # (every JSON name vmpin reads: one C call, not a loop)
    out = []
    for ch in name:
        if ch.isascii():
            out.append(ch.upper())
            continue
        low = ch.lower()
        up = low.upper() if len(low) == 1 else ch
        out.append(up if len(up) == 1 else (low if len(low) == 1 else ch))
    return "".join(out)


def field_values(obj: Any, name: str, fields: tuple[str, ...]) -> list[Any]:
    """Every value, in file order, that Go decodes into the struct field JSON-named ``name``.

    ``fields`` are all the struct's JSON field names: a key that exactly names another field
    goes to that field even when it also folds to ``name``.
    """
    pairs = obj.pairs if isinstance(obj, Obj) else list(obj.items())
    folded = fold(name)
    return [value for key, value in pairs if matches(key, name, fields, folded)]


def matches(key: str, name: str, fields: tuple[str, ...], folded: str | None = None) -> bool:
    """Whether Go decodes the object key ``key`` into the struct field JSON-named ``name``
    (``fields``: as for :func:`field_values`; ``folded``: ``fold(name)``, when known)."""
    if key == name:
        return True
    return key not in fields and fold(key) == (folded or fold(name))


def has_field(obj: Any, name: str, fields: tuple[str, ...]) -> bool:
    return bool(field_values(obj, name, fields))


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
