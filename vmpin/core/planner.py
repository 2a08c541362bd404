"""Placement planning: a pure function from (topology, sandbox, threads, policy) to a plan.


The rules, and the failure each one prevents:

- **The mask** is the union of the sandbox's containers' CPU sets.  When no container has one,
  the sandbox floats over kubelet's shared pool when that is known, and is otherwise left
  exactly as the runtime made it (mode ``none``): vmpin does not invent a placement.
- **vCPUs 1:1** (guest vCPU pairs (2k, 2k+1) on host SMT pairs whenever the mask allows, lone
  threads last: :meth:`Topology.place_vcpus`) only when every CPU they would own belongs to
  this sandbox alone.  A CPU that is also in another sandbox's mask (the shared pool) is
  never pinned 1:1: two sandboxes' vCPUs pinned 1:1 on one CPU halve both (Kata's NUMA
  pinning did that, 0.53x each).
- **Counts.**  #vCPUs == |mask|: full 1:1.  #vCPUs > |mask| (Kata adds a vCPU per container
  CPU on top of its boot vCPUs): ``partial`` -- the *last* |mask| vCPUs, the ones hot-plugged
  for the containers, are pinned 1:1 and the boot vCPUs float over the mask, so every
  container CPU still has exactly one guest vCPU and the guest map stays exact.
  #vCPUs < |mask|: float (a 1:1 subset would leave container CPUs with no vCPU behind them).
- **Kata's own pinning** (``enable_vcpus_pinning``, vmpin.runtimes.kataconfig): Kata pins
  vCPU i to the i-th CPU of the sandbox's cpuset in ascending order whenever #vCPUs ==
  |cpuset|, at each of its container events.  A 1:1 plan there takes Kata's layout
  (:func:`runtime_layout`) instead of topology order, so both pinners write the same thing and
  neither undoes the other; ``Plan.runtime_map`` says where Kata puts each vCPU, for the node
  plan to leave Kata's pins alone where vmpin would not pin 1:1 itself (vmpin.reconcile.plan).
- **An incomplete classification pins no vCPU 1:1.**  When a vCPU index is known to exist but
  no thread was identified for it (``missing_vcpus``: a vCPU busy in the guest, seen by
  neither QMP, names nor debugfs), the counts above would be made from whichever vCPUs this
  pass happened to see: 1:1 of a subset, ``partial`` pinning the wrong "last" vCPUs, or a
  float, differently in the hook, the agent and ``audit``.  Instead the vCPUs float over the
  mask (a note names the missing indexes), and so does every thread whose role no layer
  decided (``unidentified``: one of them is the missing vCPU), so the plan is the same
  whichever vCPUs were seen, until every one is known.
- **isolcpus**: CPUs the kernel keeps free of general work are for vCPUs only; helper threads
  stay on the non-isolated part of their set whenever there is one.
- **One L3 group** (kubelet's ``prefer-align-cpus-by-uncorecache``, ``uncore``): vCPUs that
  float because they are fewer than the sandbox's CPUs float over the largest part of the mask
  that one L3 group holds, when all of them fit there (a tie: the first in topology order):
  the guest's threads then share one last-level cache, as kubelet's option keeps a container's
  CPUs in one.  Not over a shared pool, nor on a mask others share (those float as they are).
- **Emulator, iothreads, vhost**: policy ``share`` = the mask; ``isolate`` = the configured
  housekeeping CPUs (kubelet's reserved CPUs under its ``strict-cpu-reservation``: the node
  plan passes them as the policy's) minus every other sandbox's exclusive CPUs (falling back to
  the mask, with a note, when nothing is left); ``none`` = unmanaged.
"""

from __future__ import annotations

from vmpin.core.cpuset import EMPTY, CpuSet, checked
from vmpin.core.errors import PlanError
from vmpin.core.topology import Topology

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.lean.records)
if TYPE_CHECKING:
    from collections.abc import Collection, Iterable, Mapping, Sequence
    from typing import NamedTuple, Protocol

    class ThreadLike(Protocol):
        """What the planner reads of a thread: a :class:`Thread`, or the node plan's
        observed thread (vmpin.reconcile.observation.ThreadObs) as it is."""

        @property
        def tid(self) -> int: ...
        @property
        def role(self) -> str: ...
        @property
        def index(self) -> int | None: ...
        @property
        def label(self) -> str | None: ...
else:
    from vmpin.lean.records import NamedTuple

ROLES = ("vcpu", "iothread", "vhost", "emulator", "container")
HELPER_POLICIES = ("share", "isolate", "none")
VCPU_POLICIES = ("auto", "1to1", "float", "none")
#: Crane's cpu-manager modes (vmpin.core.podpolicy); "" = the node's usual rules
CPUSET_MODES = ("", "exclusive", "share", "none")
GUEST_POLICIES = ("on", "off")


class Policy(NamedTuple):
    """How to place one sandbox: the node default, or a pod's own (vmpin.core.podpolicy).

    ``vcpus``: auto (1:1 when safe), 1to1 (the same, noted when impossible), float, none (left
    alone).  ``guest``: whether the guest map is published for in-guest pinning.  ``cpuset``:
    Crane's mode -- share: others may float on the mask, so vCPUs float; none: float over the
    shared pool; exclusive: the node plan keeps others off the mask.
    """

    helpers: str = "share"
    housekeeping: CpuSet = EMPTY
    vcpus: str = "auto"
    guest: str = "on"
    cpuset: str = ""

    def check(self) -> Policy:
        """Validate; returns self so that ``Policy(...).check()`` reads as a constructor."""
        if self.helpers not in HELPER_POLICIES:
            raise PlanError(f"helper thread policy {self.helpers!r}: expected {HELPER_POLICIES}")
        if self.vcpus not in VCPU_POLICIES:
            raise PlanError(f"vCPU policy {self.vcpus!r}: expected {VCPU_POLICIES}")
        if self.guest not in GUEST_POLICIES:
            raise PlanError(f"guest pinning {self.guest!r}: expected {GUEST_POLICIES}")
        if self.cpuset not in CPUSET_MODES:
            raise PlanError(f"cpu-manager mode {self.cpuset!r}: expected {CPUSET_MODES[1:]}")
        if self.helpers == "isolate" and not self.housekeeping:
            raise PlanError("helper policy 'isolate' needs housekeeping CPUs")
        return self


class Thread(NamedTuple):
    """A thread to place.  Its fields are named as ThreadObs's: the node plan gives the
    planner its observed threads as they are, no record made per thread (issue 28)."""

    tid: int
    role: str
    #: its vCPU index (shadows tuple.index, which nothing asks of a Thread)
    index: int | None = None  # type: ignore[assignment]
    label: str | None = None


class Placement(NamedTuple):
    tid: int
    role: str
    idx: int | None
    label: str | None
    #: None = vmpin leaves this thread alone.
    desired: CpuSet | None


class Plan(NamedTuple):
    sandbox_id: str
    mask: CpuSet
    mode: str  # "1:1" | "partial" | "float" | "none"
    reason: str
    nvcpus: int
    #: one per thread planned, in the order they were given (the node plan pairs them so)
    placements: tuple[Placement, ...] = ()
    #: vCPU index -> host CPU, for the vCPUs pinned 1:1.
    vcpu_map: Mapping[int, int] = {}
    notes: tuple[str, ...] = ()
    #: vCPU index -> host CPU where the runtime pins the vCPUs itself (Kata's
    #: enable_vcpus_pinning, when it applies and every vCPU's index is known); {} otherwise
    runtime_map: Mapping[int, int] = {}

    def desired(self, tid: int) -> CpuSet | None:
        for p in self.placements:
            if p.tid == tid:
                return p.desired
        return None


def sandbox_mask(container_cpus: Mapping[str, CpuSet | None]) -> CpuSet:
    """The union of the containers' CPU sets (containers without one contribute nothing)."""
    return CpuSet.union_all(c for c in container_cpus.values() if c is not None)


def runtime_layout(indices: Iterable[int | None], cpus: CpuSet) -> dict[int, int]:
    """Where Kata's own vCPU pinning (``enable_vcpus_pinning``) puts each vCPU: vCPU ``i`` on
    the ``i``-th CPU of the sandbox's CPU set in ascending order (virtcontainers
    ``checkVCPUsPinning``: ``cpuset.ToSlice()[i]``, ``i`` being QMP's cpu-index), and only
    when there are as many vCPUs as CPUs.  {} when it does not apply, or when a vCPU's index
    is unknown (then where Kata puts it cannot be told)."""
    given = list(indices)
    if not given or None in given or len(given) != len(cpus):
        return {}
    known = sorted(i for i in given if i is not None)
    if len(set(known)) != len(known):
        return {}
    return dict(zip(known, cpus, strict=True))  # (a CpuSet iterates in ascending order)


def plan_sandbox(
    topology: Topology,
    sandbox_id: str,
    mask: CpuSet,
    threads: Sequence[ThreadLike],
    policy: Policy = Policy(),
    *,
    others: CpuSet = EMPTY,
    others_exclusive: CpuSet = EMPTY,
    shared_pool: CpuSet | None = None,
    runtime_pins: CpuSet | None = None,
    missing_vcpus: Sequence[int] = (),
    unidentified: Collection[int] = (),
    uncore: bool = False,
) -> Plan:
    """Plan one VM sandbox.

    ``others`` is the union of every other sandbox's mask, ``others_exclusive`` the part of it
    that no one else (and no shared pool) may use.  ``runtime_pins``: the CPU set over which
    the runtime pins the vCPUs itself (Kata's ``enable_vcpus_pinning``: the sandbox's cpuset
    as Kata computes it, the union of its containers' CPU sets); None when it does not.
    ``missing_vcpus``: vCPU indexes that exist but have no thread in ``threads``;
    ``unidentified``: tids of ``threads`` whose role is a default, not evidence (the
    classification's layer ``none``).  ``uncore``: floating vCPUs stay in one L3 group where
    they fit (the module docstring).
    """
    policy.check()
    notes: list[str] = []
    vcpus = sorted((t for t in threads if t.role == "vcpu"), key=lambda t: (t.index or 0, t.tid))
    n = len(vcpus)
    runtime_map = (
        runtime_layout((v.index for v in vcpus), runtime_pins) if runtime_pins is not None else {}
    )
    effective = mask
    floating_reason = ""
    if policy.cpuset == "none" and shared_pool:
        # Crane's "none": the pod gives up its cpuset and runs in the shared pool
        effective = shared_pool
        floating_reason = "cpu-manager none: floating over the shared pool"
    elif not mask:
        if shared_pool:
            effective = shared_pool
            floating_reason = "no container has a CPU set: floating over the shared pool"
        else:
            return Plan(
                sandbox_id,
                EMPTY,
                "none",
                "no container has a CPU set and no shared pool is known:"
                " left as the runtime made it",
                n,
                tuple(Placement(t.tid, t.role, t.index, t.label, None) for t in threads),
            )
    offline = effective - topology.online
    if offline:
        notes.append(f"CPUs {offline} of the mask are not online: left out")
        effective = effective & topology.online
        if not effective:
            return Plan(
                sandbox_id,
                mask,
                "none",
                f"every CPU of the mask ({mask}) is offline",
                n,
                tuple(Placement(t.tid, t.role, t.index, t.label, None) for t in threads),
                notes=tuple(notes),
            )

    # (every online CPU has a place in topology order, and effective holds online CPUs only:
    # its size is the count; place_vcpus orders it when a 1:1 plan needs the order)
    m = len(effective)
    shared_with_others = effective & others
    vcpu_map: dict[int, int] = {}
    vcpu_home = effective  # where vCPUs not pinned 1:1 float
    if floating_reason:
        mode, reason = "float", floating_reason
    elif policy.vcpus == "float":
        mode, reason = "float", "vCPU policy is float"
    elif policy.vcpus == "none":
        mode, reason = "none", "vCPU policy is none: vCPUs left as the runtime made them"
    elif policy.cpuset == "share":
        mode, reason = "float", "cpu-manager share: others may float on the mask, so vCPUs float"
    elif missing_vcpus:
        mode = "float"
        reason = (
            f"vCPU {_fmt(missing_vcpus)} not identified: no vCPU is pinned 1:1 until every"
            " vCPU thread is known"
        )
    elif n == 0:
        mode, reason = "float", "no vCPU thread identified"
    elif shared_with_others:
        mode = "float"
        reason = f"CPUs {shared_with_others} are shared with other sandboxes: no 1:1 pin there"
    elif n == m and runtime_map and effective == runtime_pins:
        # Kata pins these vCPUs itself at each of its container events: the same layout, or
        # the two pinners would move them back and forth
        mode = "1:1"
        reason = f"{n} vCPUs on {m} CPUs, in Kata's order (enable_vcpus_pinning)"
        vcpu_map = dict(runtime_map)
    elif n == m:
        mode, reason = "1:1", f"{n} vCPUs on {m} CPUs"
        vcpu_map = topology.place_vcpus(
            (v.index if v.index is not None else i for i, v in enumerate(vcpus)), effective
        )
    elif n > m:
        mode = "partial"
        reason = f"{n} vCPUs on {m} CPUs: the last {m} pinned 1:1, {n - m} float over the mask"
        pinned = vcpus[n - m :]
        vcpu_map = topology.place_vcpus(
            (v.index if v.index is not None else n - m + i for i, v in enumerate(pinned)), effective
        )
    else:
        mode = "float"
        reason = f"{n} vCPUs on {m} CPUs: fewer vCPUs than CPUs, floating over the mask"
        home = _l3_home(topology, effective, n) if uncore else None
        if home is not None:
            vcpu_home = home
            notes.append(
                f"prefer-align-cpus-by-uncorecache: the {n} vCPUs float over CPUs {home},"
                " one L3 group's part of the mask"
            )

    helper_set: CpuSet | None
    if policy.helpers == "none":
        helper_set = None
    elif policy.helpers == "isolate":
        helper_set = policy.housekeeping & topology.online
        helper_set = helper_set - others_exclusive
        if not helper_set:
            notes.append("housekeeping CPUs are all taken: helper threads share the mask")
            helper_set = effective
    else:
        helper_set = effective
    if helper_set is not None and helper_set & topology.isolated:
        housekeeping_part = helper_set - topology.isolated
        if housekeeping_part:
            helper_set = housekeeping_part
        else:
            notes.append(f"helper threads on isolated CPUs {helper_set}: no other CPU is allowed")

    placements: list[Placement] = []
    pinned_by_tid = {}
    for i, v in enumerate(vcpus):
        idx = v.index if v.index is not None else i
        if idx in vcpu_map:
            pinned_by_tid[v.tid] = checked((vcpu_map[idx],))
    if policy.vcpus == "1to1" and mode != "1:1":
        notes.append(f"vCPU policy 1to1 not possible ({reason})")
    isolated = effective & topology.isolated
    if len(isolated) > 1 and policy.vcpus != "none" and not missing_vcpus:
        # The scheduler does not balance load across isolated CPUs (isolcpus): a vCPU let
        # float over several stays wherever it first ran, and the others go idle.  So each
        # vCPU not pinned 1:1 gets one CPU of the mask of its own, in topology order (issue
        # 30, item 4); not 1:1 (others may share them, or vCPUs outnumber CPUs): why, above.
        free = [v for v in vcpus if v.tid not in pinned_by_tid]
        order = [c for c in topology.ordered(effective) if c not in vcpu_map.values()]
        order = order or topology.ordered(effective)
        for i, v in enumerate(free):
            pinned_by_tid[v.tid] = checked((order[i % len(order)],))
        if free:
            notes.append(
                f"CPUs {isolated} are isolated (isolcpus): no vCPU floats over several of"
                f" them; {len(free)} vCPU(s) not pinned 1:1 ({reason}) each run on one CPU"
                " of the mask"
            )
    vcpu_float = None if policy.vcpus == "none" else effective
    maybe_vcpu = frozenset(unidentified) if missing_vcpus else frozenset()
    if missing_vcpus:
        notes.append(
            f"vCPU {_fmt(missing_vcpus)} has no identified thread: threads of unknown role"
            " are placed as vCPUs until it has"
        )
    for t in threads:
        if t.role == "vcpu":
            desired: CpuSet | None = (
                None if policy.vcpus == "none" else pinned_by_tid.get(t.tid, vcpu_home)
            )
        elif t.role == "container":
            raise PlanError(f"thread {t.tid}: role 'container' is planned per container, not here")
        elif t.tid in maybe_vcpu:
            desired = vcpu_float  # (the missing vCPU is one of these)
        else:
            desired = helper_set
        placements.append(Placement(t.tid, t.role, t.index, t.label, desired))
    _check_no_double_pin(vcpu_map)
    return Plan(
        sandbox_id, effective, mode, reason, n, tuple(placements), vcpu_map, tuple(notes),
        runtime_map,
    )  # fmt: skip


def _l3_home(topology: Topology, mask: CpuSet, n: int) -> CpuSet | None:
    """The largest part of ``mask`` one L3 group holds, when it holds ``n`` CPUs or more and
    the mask spans several groups (else None: nothing to narrow)."""
    parts: dict[int, list[int]] = {}
    for cpu in topology.ordered(mask):
        parts.setdefault(topology.cpus[cpu].l3, []).append(cpu)
    if len(parts) < 2:
        return None
    best = max(parts.values(), key=len)  # (max keeps the first of equals: topology order)
    return CpuSet(best) if len(best) >= n else None


def _fmt(indexes: Sequence[int]) -> str:
    return ",".join(str(i) for i in sorted(indexes))


def _check_no_double_pin(vcpu_map: Mapping[int, int]) -> None:
    cpus = list(vcpu_map.values())
    if len(cpus) != len(set(cpus)):
        raise PlanError(f"internal: two vCPUs pinned 1:1 on one CPU: {vcpu_map}")


def check_global(plans: Sequence[Plan]) -> list[str]:
    """Cross-sandbox invariant: no CPU carries two 1:1 vCPUs.  Returns the violations."""
    owner: dict[int, tuple[str, int]] = {}
    problems = []
    for plan in plans:
        sid = plan.sandbox_id
        for idx, cpu in plan.vcpu_map.items():
            # (named in text only for a violation: two strings made per vCPU were half of
            # this check, 74 k of a 32-vCPU sandbox's every pass)
            was = owner.get(cpu)
            if was is not None and was != (sid, idx):
                problems.append(f"CPU {cpu}: vCPU {idx} of {sid} and {was[0]}/{was[1]}")
            owner[cpu] = (sid, idx)
    return problems


def exclusive_cpus(
    masks: Mapping[str, CpuSet], shared_pool: CpuSet | None = None
) -> dict[str, CpuSet]:
    """Each sandbox's CPUs that no other sandbox's mask (nor the shared pool) contains.

    Linear in the masks' sizes (a CPU is a sandbox's alone when one mask holds it): the
    agent's node report asks after every pass, and a union of the others per sandbox was
    quadratic (2,000 sandboxes: 4 million set operations a pass, issue 28)."""
    holders: dict[int, int] = {}
    for mask in masks.values():
        for cpu in mask:
            holders[cpu] = holders.get(cpu, 0) + 1
    pool = shared_pool or EMPTY
    return {
        sid: checked([cpu for cpu in mask if holders[cpu] == 1 and cpu not in pool])
        for sid, mask in masks.items()
    }
