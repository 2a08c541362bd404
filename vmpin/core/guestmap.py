"""Host CPUs -> guest vCPUs: what a container's cpuset means inside its VM.

Kata drops a container's cpuset in the guest because guest vCPU numbers are not host CPU
numbers.  Under a 1:1 (or partial) plan they are related exactly: vCPU i runs only on host
CPU ``vcpu_map[i]``, so a container given host CPUs H runs on guest vCPUs
``{i : vcpu_map[i] in H}``.  Under a floating plan no vCPU belongs to any host CPU; the honest
answer is "all vCPUs" (``exact: false``), or, when the operator asks for it, a proportional
share: the container's fraction of the mask, as a contiguous block of vCPUs in mask order.
"""

from __future__ import annotations

from vmpin.core.cpuset import EMPTY, CpuSet
from vmpin.core.planner import Plan
from vmpin.core.topology import Topology

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.lean.records)
if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import NamedTuple
else:
    from vmpin.lean.records import NamedTuple

FLOAT_POLICIES = ("all", "proportional")


class ContainerMap(NamedTuple):
    """One container's guest vCPUs under a plan, and why: one entry of a sandbox's guest map
    as computed here (the published file, its envelope and readers, is
    :class:`vmpin.wire.guestmap.GuestMap`; :meth:`to_json` is an entry of its ``containers``)."""

    container: str
    sandbox: str
    host_cpus: CpuSet | None
    guest_cpus: CpuSet
    exact: bool
    mode: str
    reason: str

    def to_json(self) -> dict[str, object]:
        return {
            "container": self.container,
            "sandbox": self.sandbox,
            "host_cpus": None if self.host_cpus is None else self.host_cpus.to_list(),
            "guest_cpus": self.guest_cpus.to_list(),
            "exact": self.exact,
            "mode": self.mode,
            "reason": self.reason,
        }


def map_container(
    plan: Plan,
    container_id: str,
    host_cpus: CpuSet | None,
    *,
    float_policy: str = "all",
    order: list[int] | None = None,
) -> ContainerMap:
    """Translate one container's host CPU set into guest vCPUs under ``plan``."""

    def mapped(guest: CpuSet, exact: bool, reason: str) -> ContainerMap:
        return ContainerMap(
            container_id, plan.sandbox_id, host_cpus, guest, exact, plan.mode, reason
        )

    if plan.nvcpus == 0:
        return mapped(EMPTY, False, "no vCPU known")
    if host_cpus is None:
        return mapped(_every(plan), False, "container has no CPU set: all vCPUs")
    if plan.vcpu_map:
        guest = CpuSet(i for i, h in plan.vcpu_map.items() if h in host_cpus)
        covered = CpuSet(h for h in plan.vcpu_map.values())
        missing = host_cpus - covered
        if guest and not missing:
            return mapped(guest, True, f"1:1: host CPUs {host_cpus} are guest vCPUs {guest}")
        if guest:
            return mapped(guest, False, f"host CPUs {missing} have no vCPU pinned 1:1")
    if float_policy == "proportional" and plan.mask and order:
        share = max(1, round(plan.nvcpus * len(host_cpus & plan.mask) / len(plan.mask)))
        first = min((order.index(c) for c in host_cpus if c in order), default=0)
        start = min(round(first * plan.nvcpus / len(plan.mask)), plan.nvcpus - share)
        guest = CpuSet(range(start, start + share))
        return mapped(
            guest, False, f"floating plan: proportional share {share}/{plan.nvcpus} vCPUs"
        )
    return mapped(
        _every(plan), False, f"{plan.mode} plan: vCPUs are not tied to host CPUs, all vCPUs"
    )


def _every(plan: Plan) -> CpuSet:
    """All the guest's vCPUs (made when a map needs them: not for a 1:1 container's)."""
    return CpuSet(range(plan.nvcpus))


def guest_siblings(plan: Plan, topology: Topology) -> list[list[int]]:
    """Groups of guest vCPUs whose host CPUs are SMT siblings (for -smp threads=...)."""
    by_core: dict[int, list[int]] = {}
    for idx, host in sorted(plan.vcpu_map.items()):
        if host in topology.cpus:
            by_core.setdefault(topology.cpus[host].core, []).append(idx)
    return [sorted(g) for g in by_core.values()]


def map_sandbox(
    plan: Plan,
    containers: Mapping[str, CpuSet | None],
    topology: Topology,
    float_policy: str = "all",
) -> dict[str, object]:
    """The whole sandbox's map, as published to the guest and shown by ``vmpin show``."""
    # (only a proportional share reads the order: a walk over the node's CPUs otherwise
    # made for nothing, in every pass that publishes a map)
    order = topology.ordered(plan.mask) if float_policy == "proportional" else None
    maps = [
        map_container(plan, cid, cpus, float_policy=float_policy, order=order)
        for cid, cpus in sorted(containers.items())
    ]
    return {
        "sandbox": plan.sandbox_id,
        "mode": plan.mode,
        "nvcpus": plan.nvcpus,
        "vcpu_to_host": {str(i): h for i, h in sorted(plan.vcpu_map.items())},
        "siblings": guest_siblings(plan, topology),
        "containers": {m.container: m.to_json() for m in maps},
    }
