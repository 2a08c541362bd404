"""What the reconciler needs from sandboxes that live outside the store (libvirt domains).

A protocol of its own, so the reconciler (which the hook imports) names it without importing
:mod:`vmpin.reconcile.domains` and, through it, libvirt.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from vmpin.core.cpuset import CpuSet

if TYPE_CHECKING:
    from vmpin.reconcile.reconciler import Reconciler, SandboxReport


class DomainSource(Protocol):
    def begin_pass(self) -> None:
        """Forget the last pass's observation (a new pass observes afresh)."""

    def masks(self, rc: Reconciler) -> Mapping[str, CpuSet]:
        """Sandbox id -> mask of each sandbox this source holds (for the node-wide invariant)."""

    def reconcile(
        self, rc: Reconciler, ids: Sequence[str] | None, apply: bool
    ) -> list[SandboxReport]:
        """Plan, apply (when ``apply``) and report each of its sandboxes (``ids``: only those)."""
