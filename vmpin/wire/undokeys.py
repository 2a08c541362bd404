"""The store's undo records' keys: which VMM (and thread) a recorded value belongs to.

Before vmpin first pins a VMM's threads it records each thread's affinity (invariant 4: what
the sandbox gets back when vmpin lets go of it), and after classifying its threads the vCPUs
QMP did not name; both go in the store's ``meta`` table, keyed by the VMM process they were
read from -- (sandbox id, pid, start time), so a reused pid never inherits another process's
records::

    orig-affinity:<sandbox>:<pid>:<start>:<tid>   -> the thread's affinity before (a CPU list)
    missing-vcpus:<sandbox>:<pid>:<start>         -> vCPU indexes QMP did not name ("0,3")

:class:`VmmKey` makes these keys (vmpin.reconcile.apply writes them, vmpin.reconcile.observe
looks them up) and :func:`stale_originals` reads them back, so the format has one home.
Sandbox ids never hold ``:`` (vmpin.core.ids), so a key's last ``:`` ends its VMM's part.

Lean (a Kata hook that pins in-process observes): stdlib and vmpin.core only.
"""

from __future__ import annotations

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.core._lean)
if TYPE_CHECKING:
    from collections.abc import Iterable
    from typing import NamedTuple
else:
    from vmpin.core._lean import NamedTuple

ORIG_PREFIX = "orig-affinity:"
MISSING_PREFIX = "missing-vcpus:"


class VmmKey(NamedTuple):
    """One VMM process as undo records name it."""

    sandbox: str
    pid: int
    start: int

    def orig_prefix(self) -> str:
        """The keys of this VMM's threads' original affinities, less the tid (a pass builds
        it once per VMM and adds each tid)."""
        return f"{ORIG_PREFIX}{self.sandbox}:{self.pid}:{self.start}:"

    def orig(self, tid: int) -> str:
        """The key of thread ``tid``'s affinity before vmpin first pinned it."""
        return f"{self.orig_prefix()}{tid}"

    def missing(self) -> str:
        """The key of the vCPUs QMP did not name for this VMM."""
        return f"{MISSING_PREFIX}{self.sandbox}:{self.pid}:{self.start}"


def stale_originals(keys: Iterable[str], live: Iterable[VmmKey]) -> list[str]:
    """The original-affinity keys among ``keys`` that belong to no VMM in ``live`` (what was
    recorded for VMMs that no longer run).

    A key is its VMM's prefix plus the tid, so each costs one cut at its last ``:`` and one
    set lookup, not a decode: a pass over 2,000 sandboxes holds ~20,000 of them (decoding
    each into a record was ~15x dearer).  A key that is not one of ours is stale too.
    """
    prefixes = {vmm.orig_prefix() for vmm in live}
    return [k for k in keys if k[: k.rfind(":") + 1] not in prefixes]
