"""The one error tree: vmpin.core.errors draws it in its docstring, and the drawing is the truth
(STYLE.md: one tree in one module).  A module note in the drawing, ``(vmpin.x)``, would name
another home; none has one."""

from __future__ import annotations

import importlib
import re

import vmpin.core.errors as errors

#: ``+-- Name   text (vmpin.module)``: a class of the tree, and its module when not this one
_NODE = re.compile(r"^(?P<indent>[ |]*)\+-- (?P<name>\w+)(?P<rest>.*)$")
_HOME = re.compile(r"\((vmpin(?:\.\w+)+)\)\s*$")


def tree() -> list[tuple[str, str, str]]:
    """(class, its parent, its module) for every class the docstring draws."""
    doc = errors.__doc__ or ""
    rows: list[tuple[str, str, str]] = []
    stack: list[tuple[int, str]] = [(-1, "VmpinError")]
    lines = doc.splitlines()
    for i, line in enumerate(lines):
        m = _NODE.match(line[4:])  # (the docstring's drawing is indented by four)
        if m is None:
            continue
        depth = len(m["indent"])
        while stack[-1][0] >= depth:
            stack.pop()
        # a module note may be on the class's line or the next one (a continuation)
        tail = m["rest"]
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        if "+--" not in nxt and "(" in nxt and nxt.strip().endswith(")"):
            tail += " " + nxt.strip()
        home = _HOME.search(tail.strip())
        rows.append((m["name"], stack[-1][1], home.group(1) if home else "vmpin.core.errors"))
        stack.append((depth, m["name"]))
    return rows


def test_every_class_is_where_the_tree_says() -> None:
    rows = tree()
    assert len(rows) == 16  # VmpinError's whole tree, the root aside
    for name, parent, module in rows:
        cls = getattr(importlib.import_module(module), name)
        base = next(getattr(importlib.import_module(m), n) for n, _, m in
                    [("VmpinError", "", "vmpin.core.errors"), *rows] if n == parent)  # fmt: skip
        assert cls.__bases__[0] is base, (name, parent)
        assert cls.__module__ == module, name


def test_core_errors_holds_the_whole_tree() -> None:
    """Every error class is core.errors' own, and every one of them is drawn."""
    own = {n for n, v in vars(errors).items()
           if isinstance(v, type) and v.__module__ == errors.__name__}  # fmt: skip
    assert own == {"VmpinError", *(n for n, _, m in tree())}
    assert {m for _, _, m in tree()} == {"vmpin.core.errors"}
