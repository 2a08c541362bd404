"""Whether a container's start concerns vmpin's CPU allocations: the plain container hook's two
cheap tests (issue 30).

The allocations themselves -- their tables, rows and the marker's upkeep -- are
:mod:`vmpin.state.allocations`'s; what a plain container's hook asks of them is here alone,
so that the hook, which only journals its event on most starts, does not load that module and
create its record class (0.4 M of the runc hook's ~45 M instructions, a bare interpreter
~39 M: bench/bench_hook_ir.py).  Stdlib only, no ``typing`` at run time (the hook path).
"""

from __future__ import annotations

import os

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.lean.records)
if TYPE_CHECKING:
    from collections.abc import Mapping

#: in the state dir while any allocation (granted or waiting) is recorded; holds the CPUs
#: allocated, for people (vmpin.state.allocations.mark keeps it in step with the table)
MARKER = "allocations"


def asks_exclusive(annotations: Mapping[str, str]) -> bool:
    """Whether an OCI spec's annotations may ask for exclusive CPUs (the hook's cheap test:
    vmpin.core.podpolicy.exclusive_request decides, in the pass)."""
    own = annotations.get("vmpin.io/exclusive-cpus")
    if own is not None:
        return own.strip().lower() != "none"
    return annotations.get("qos.gocrane.io/cpu-manager", "").strip().lower() == "exclusive"


def present(state_dir: str) -> bool:
    """Whether vmpin holds allocations (:data:`MARKER` is there): one ``stat``."""
    return os.path.exists(os.path.join(state_dir, MARKER))
