"""Applied: each thread's outcome counted where it belongs, one call per sandbox."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from vmpin.core.cpuset import CpuSet
from vmpin.reconcile.apply import Applied, Outcome


def test_a_sandboxs_outcomes_are_counted_as_they_come() -> None:
    cpus = CpuSet([1])
    out = Applied()
    out.extend("a", [(1, Outcome("ok", cpus)), (2, Outcome("pinned", cpus))])
    out.extend("b", [(3, Outcome("gone", None))])
    out.extend("c", [])
    out.add("d", 4, Outcome("error", cpus, "EPERM"))
    assert set(out.threads) == {"a", "b", "d"}  # (none added: no entry, as add() left it)
    assert out.pinned == {"a": {2: cpus}} and out.unclean == {"b", "d"}

    def applying() -> Iterator[tuple[int, Outcome]]:
        yield 5, Outcome("pinned", cpus)
        raise RuntimeError("a bug while applying thread 6")

    with pytest.raises(RuntimeError):
        out.extend("e", applying())
    assert out.threads["e"] == {5: Outcome("pinned", cpus)} and out.pinned["e"] == {5: cpus}
