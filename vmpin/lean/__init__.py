"""The speed layer: what the container-start paths use to stay within a bare interpreter's
reach, in one room (issue 27; ../shared/STYLE.md, last section).

Two programs run on every container start -- ``vmpin hook`` on the host and the guest program
inside a Kata VM -- and ``vmpin update`` and the read commands are measured figures too.  Their
modules (:data:`vmpin.service.hookfile.HOOK_MODULES`, :data:`vmpin.guest.bundle.GUEST_MODULES`,
and the fast route's dispatcher) are *the closure*; only they may use what is here, and only
they follow its rules.  ``tests/test_speed_closure.py`` checks both from the sources: a lean
idiom outside the closure fails, and so does a speed module that nothing in it needs.

The rules, inside the closure:

- ``typing`` is not imported at run time: ``TYPE_CHECKING = False`` (mypy takes any name
  ``TYPE_CHECKING`` as true) and annotations under ``from __future__ import annotations``.
  ``typing`` is ~5 ms of a ~10 ms interpreter start here.
- Records are :mod:`vmpin.lean.records`' ``NamedTuple`` and ``dataclass``: the same classes
  ``typing.NamedTuple`` and ``dataclasses.dataclass`` build, without importing ``typing``,
  ``collections``, ``inspect`` (``dataclasses`` alone is ~10 ms) and with their generated
  ``__new__``/``__init__`` precompiled per shape in :mod:`vmpin.lean.shapes` and
  :mod:`vmpin.lean.initshapes` (compiling them was ~2.8 ms of a Kata hook; each is loaded by
  the first record of its kind).
- A module imports at the top what every path through it needs, and inside a function what
  only one path needs (a plain container's hook never opens the store).

And one trick outside any module's own code: :mod:`vmpin.lean.codecache`, the hook's code
cache (the closure's code objects served from one file, bypassing importlib's per-module
steps): runc hook 1.32 -> 1.26 of a bare interpreter, Kata without an agent 2.10 -> 1.97
(docs/benchmarks.md).  Everything outside the closure is plain Python.

Stdlib only; the lowest layer (vmpin.core imports it).
"""
