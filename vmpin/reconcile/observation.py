"""What an observation of the node is made of: the values :mod:`.observe` reads and every later
step (:mod:`.plan`, :mod:`.apply`, :mod:`.audit`, the views) takes.

Frozen values, no I/O: a thread (:class:`ThreadObs`), a VMM with its threads
(:class:`VmmObs`), a container with its cgroup (:class:`ContainerObs`), a sandbox
(:class:`SandboxObs`), the node (:class:`Observation`), and how much of it a read view looks
at (:class:`Scope`).  Beside them, what an observation is read *from* in the store: the meta
keys of what vmpin recorded about a VMM's threads (:class:`VmmKey`: written by :mod:`.apply`,
read here), and the store's tables as one pass reads them (:class:`Recorded`).

Extension point: a :class:`SandboxObs` carries its ``runtime`` ("kata", "runc"; a libvirt
backend adds "libvirt" with its own VMM finder) and its own ``policy`` (the node's today;
per-pod policy from the Kubernetes API replaces it per sandbox), so :mod:`.plan` needs no
change to learn either.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence
    from dataclasses import dataclass, field
    from dataclasses import replace as _made
    from typing import NamedTuple, TypeVar

    from vmpin.core.cpuset import CpuSet
    from vmpin.core.planner import Policy
    from vmpin.linux.cgroups import CgroupRef
    from vmpin.runtimes.kataconfig import KataConfigs
    from vmpin.runtimes.kubelet import Checkpoint
    from vmpin.state.allocations import Allocation
    from vmpin.state.reader import Reader
    from vmpin.state.records import ContainerRec, SandboxRec, ThreadRec

    _T = TypeVar("_T")
else:  # dataclasses imports inspect and re: a stand-in on the hook's path
    from vmpin.lean.records import NamedTuple, dataclass, field

    # (imported once here, not at each call: an event's pass replaces every thread of its
    # VM in the observation it keeps, Observer.note_applied, issue 28)
    from vmpin.lean.records import replace as _made

# -- the store's undo records' keys ------------------------------------------------------------
# Before vmpin first pins a VMM's threads, apply records each thread's affinity (invariant 4:
# what the sandbox gets back when vmpin lets go of it), and after classifying its threads the
# vCPUs no layer found; both go in the store's ``meta`` table, keyed by the VMM process they
# were read from -- (sandbox id, pid, start time), so a reused pid never inherits another
# process's records:
#
#     orig-affinity:<sandbox>:<pid>:<start>:<tid>   -> the thread's affinity before (CPU list)
#     missing-vcpus:<sandbox>:<pid>:<start>         -> vCPU indexes no layer named ("0,3")
#
# VmmKey makes them (apply writes, observe_vmm looks up) and stale_originals reads them back:
# one home.  Sandbox ids never hold ":" (vmpin.core.ids): a key's last ":" ends its VMM's part.
ORIG_PREFIX = "orig-affinity:"
MISSING_PREFIX = "missing-vcpus:"


class VmmKey(NamedTuple):
    """One VMM process as the store's undo records name it."""

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
        """The key of the vCPUs no layer named for this VMM."""
        return f"{MISSING_PREFIX}{self.sandbox}:{self.pid}:{self.start}"


def key_sandbox(key: str) -> str:
    """The sandbox an ``orig-affinity:`` or ``missing-vcpus:`` key belongs to."""
    return key.split(":", 2)[1]


def sandbox_prefixes(sandbox_id: str) -> tuple[str, str]:
    """The ``missing-vcpus:`` and ``orig-affinity:`` keys of every VMM of a sandbox, less
    the VMM's part (a long-lived observer reads one sandbox's again: vmpin.reconcile.tables)."""
    return f"{MISSING_PREFIX}{sandbox_id}:", f"{ORIG_PREFIX}{sandbox_id}:"


def stale_originals(keys: Iterable[str], live: Iterable[VmmKey]) -> list[str]:
    """The original-affinity keys among ``keys`` that belong to no VMM in ``live`` (what was
    recorded for VMMs that no longer run).

    A key is its VMM's prefix plus the tid, so each costs one cut at its last ``:`` and one
    set lookup, not a decode: a pass over 2,000 sandboxes holds ~20,000 of them (decoding
    each into a record was ~15x dearer).  A key that is not one of ours is stale too.
    """
    prefixes = {vmm.orig_prefix() for vmm in live}
    return [k for k in keys if k[: k.rfind(":") + 1] not in prefixes]


class ThreadObs(NamedTuple):
    """One host thread as seen now: a VMM thread or a task of a container's cgroup.

    A NamedTuple, not a frozen dataclass (as ThreadPlan, vmpin.reconcile.plan): a pass makes
    one per thread of each VMM it reads afresh, and a frozen dataclass set its nine fields
    through ``object.__setattr__`` one by one, about three times the cost (issue 28)."""

    tid: int
    role: str  # vcpu | iothread | vhost | emulator | container
    #: its vCPU index (shadows tuple.index, which nothing asks of a ThreadObs)
    index: int | None = None  # type: ignore[assignment]
    label: str | None = None
    layer: str = ""
    name: str | None = None
    #: None when the thread was gone by the time its affinity was read
    actual: CpuSet | None = None
    #: the affinity vmpin recorded before its first pin of this thread, if it ever pinned it
    original: CpuSet | None = None
    error: str | None = None

    @property
    def gone(self) -> bool:
        return self.actual is None and self.error is None

    def pinned(self, actual: CpuSet) -> ThreadObs:
        """This thread with the affinity a pass wrote and read back (Observer.note_applied,
        every thread of an event's VM: :func:`replace` gathers every field by name first)."""
        return ThreadObs(
            self.tid, self.role, self.index, self.label, self.layer, self.name, actual,
            self.original, self.error,
        )  # fmt: skip


class VmmObs(NamedTuple):
    """A sandbox's VMM as observed (a NamedTuple, as :class:`ThreadObs`: made per VMM read)."""

    pid: int
    start: int
    threads: tuple[ThreadObs, ...] = ()
    #: True when the roles were classified afresh in this observation (apply records them)
    classified: bool = False
    missing_vcpus: tuple[int, ...] = ()
    layers: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    #: classified afresh, and found as the store has it already (apply then writes nothing)
    as_recorded: bool = False


class ContainerObs(NamedTuple):
    """A container as observed (a NamedTuple, as :class:`ThreadObs`: made per container
    read)."""

    rec: ContainerRec
    #: True/False when the init's (pid, start) could be checked, None when there was nothing
    alive: bool | None = None
    #: runc's state.json value of cpuset_cpus ("" = none, None = no state file)
    runc_cpus: str | None = None
    #: kubelet's value for (pod uid, container name): exclusive set or shared pool
    kubelet_cpus: CpuSet | None = None
    cgroup: CgroupRef | None = None
    cgroup_cpus: CpuSet | None = None
    tasks: tuple[ThreadObs, ...] = ()
    notes: tuple[str, ...] = ()
    error: str | None = None


@dataclass(frozen=True, slots=True)
class SandboxObs:
    """One sandbox: tracked (``record`` set) or merely present in the VM dir (``record`` None)."""

    id: str
    runtime: str  # kata | runc (| libvirt, later)
    policy: Policy
    record: SandboxRec | None
    containers: tuple[ContainerObs, ...] = ()
    vmm: VmmObs | None = None
    #: the recorded VMM (pid, start) no longer runs: the sandbox went away without a poststop
    vmm_gone: bool = False
    #: the sandbox was recorded as plain runc but has a VM dir: it is Kata's
    became_kata: bool = False
    notes: tuple[str, ...] = ()
    errors: tuple[str, ...] = ()
    #: where ``policy`` came from: node | oci | api (vmpin.reconcile.podpolicies), and the
    #: pod's annotations that could not be used
    policy_source: str = "node"
    policy_problems: tuple[str, ...] = ()
    #: when that source's annotations were recorded in the store (None: node, or not known)
    policy_at: float | None = None

    @property
    def tracked(self) -> bool:
        return self.record is not None


@dataclass(frozen=True, slots=True)
class Scope:
    """How much of the node a read-only view observes and plans: less than a pass does, but
    each value it does read is read fresh from the host (issue 14: read commands at 500
    sandboxes spent ~55 ms reading and planning threads most of them never print).

    ``FULL`` (the default everywhere) is what a pass, ``audit`` and apply need.  A narrower
    scope leaves values *out* (a VMM without threads, a thread without its actual affinity,
    a sandbox without a plan), never puts other values in; so only a view that prints none
    of what is left out may use one, and apply refuses its plan.
    """

    #: find each sandbox's VMM (pid, start time): a VM's footprint, which other sandboxes'
    #: plans depend on, is its mask only while it runs
    vmms: bool = True
    #: the sandboxes whose VMM threads are read and planned (None: every one)
    threads: frozenset[str] | None = None
    #: each thread's actual affinity and name (roles and vCPU indexes are read regardless)
    affinity: bool = True
    #: each planned sandbox's guest map
    guest_maps: bool = True

    def reads_threads(self, sandbox_id: str) -> bool:
        return self.vmms and (self.threads is None or sandbox_id in self.threads)


#: everything: what a pass, ``audit`` and apply need
FULL = Scope()


def leaves_alone(tracked: bool, policy: Policy) -> bool:
    """Whether vmpin leaves some of a VMM's threads where they are (they then hold the CPUs
    they run on, so every scope reads their affinity: see ``plan._left_alone``)."""
    return not tracked or policy.vcpus == "none" or policy.helpers == "none"


def claiming(scope: Scope) -> Scope:
    """``scope`` widened to read every thread's affinity of a sandbox whose threads are left
    alone: other sandboxes' plans depend on where those threads run."""
    if not scope.vmms or (scope.threads is None and scope.affinity):
        return scope
    return Scope(True, None, True, scope.guest_maps)


@dataclass(frozen=True, slots=True)
class Observation:
    sandboxes: tuple[SandboxObs, ...]
    checkpoint: Checkpoint | None = None
    checkpoint_error: str | None = None
    #: what vmpin recorded before its first pins, by (sandbox, vmm pid, vmm start, tid)
    originals: Mapping[str, str] = field(default_factory=dict)
    #: what was observed (a view's narrower scope, or everything)
    scope: Scope = FULL
    #: Kata's configuration files and whether one turns on Kata's own vCPU pinning
    #: (vmpin.runtimes.kataconfig); None when not read (a view that looks at no VMM)
    kata: KataConfigs | None = None
    #: vmpin's own allocations, granted and waiting (vmpin.reconcile.allocations)
    allocations: tuple[Allocation, ...] = ()

    @property
    def kata_pinning(self) -> bool:
        """Kata pins vCPUs itself where #vCPUs == |cpuset| (``enable_vcpus_pinning``)."""
        return self.kata is not None and self.kata.pinning

    @property
    def shared_pool(self) -> CpuSet | None:
        cp = self.checkpoint
        if cp is None or cp.policy != "static" or not cp.default:
            return None
        pool: CpuSet = cp.default
        return pool

    def sandbox(self, sandbox_id: str) -> SandboxObs | None:
        return next((s for s in self.sandboxes if s.id == sandbox_id), None)


@dataclass(slots=True)
class Recorded:
    """What a pass reads from the store, each table read once for the whole node.

    (One query per sandbox per table made the store's share of a pass grow with the node,
    and kept the pass's queries proportional to it; see tests/reconcile/test_scaling.py.)
    """

    containers: Mapping[str, list[ContainerRec]]
    threads: Mapping[tuple[str, int, int], dict[int, ThreadRec]]
    missing: Mapping[str, str]
    originals: Mapping[str, str]
    #: kernel vhost threads by owner, scanned at the pass's first classification only (or,
    #: with ``kthreads``, at its first VMM)
    vhost: Mapping[int, Sequence[tuple[int, str]]] | None = None
    #: the pass reads everything (no ``fresh``): a VMM classified before is looked at for
    #: vhost workers that came since as kernel threads (before Linux 6.4, a device set up
    #: after the VM started: a hotplugged network device), which its ``task/`` does not show
    kthreads: bool = False

    @classmethod
    def read(cls, store: Reader, scope: Scope = FULL) -> Recorded:
        """The store's tables, those ``scope`` needs: no VMM looked at, only the containers;
        no affinity read, no original affinities (a thread's is read beside its actual)."""
        containers: dict[str, list[ContainerRec]] = {}
        for c in store.containers():
            containers.setdefault(c.sandbox_id, []).append(c)
        if not scope.vmms:
            return cls(containers, {}, {}, {})
        return cls(
            containers,
            store.all_threads(),
            dict(store.meta_prefix(MISSING_PREFIX)),
            dict(store.meta_prefix(ORIG_PREFIX)) if scope.affinity else {},
        )


def replace(t: _T, **kw: object) -> _T:
    """``dataclasses.replace`` for these values (made by vmpin.lean.records off mypy's view)."""
    return _made(t, **kw)  # type: ignore[type-var]


__all__ = [
    "FULL",
    "MISSING_PREFIX",
    "ORIG_PREFIX",
    "ContainerObs",
    "Observation",
    "Recorded",
    "SandboxObs",
    "Scope",
    "ThreadObs",
    "VmmKey",
    "VmmObs",
    "claiming",
    "key_sandbox",
    "leaves_alone",
    "replace",
    "sandbox_prefixes",
    "stale_originals",
]
