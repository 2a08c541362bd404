"""What observe and apply need from sandboxes that live outside the store (libvirt domains).

A protocol of its own, so observe/apply/the reconciler (which the hook imports) name it
without importing :mod:`vmpin.reconcile.domains` and, through it, libvirt.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from vmpin.core.planner import Policy
    from vmpin.reconcile.apply import Outcome
    from vmpin.reconcile.observation import SandboxObs
    from vmpin.reconcile.plan import SandboxPlan


class DomainSource(Protocol):
    def sandboxes(self, policy_for: Callable[[str], Policy]) -> list[SandboxObs]:
        """Observe: one SandboxObs (runtime "libvirt") per running domain; no writes."""

    def apply(self, sp: SandboxPlan, publish: bool) -> Mapping[int, Outcome]:
        """Make the domain match its plan (through libvirt), read back; outcome per tid."""
