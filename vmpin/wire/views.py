"""The ``--json`` views: each output's keys, in the order printed, with their types -- one
function each, the one home of its shape.

DESIGN.md fixes the keys scripts rely on.  A view is a function whose keyword parameters are
its keys in print order, typed, and which returns them as the dict printed (``locals()``: a
dict of the parameters, in their order, and as cheap as a dict literal -- rows are built by
the thousand at 500 sandboxes -- with every builder's keys and types checked by mypy).
Keys in :data:`EXTRA` are printed but not in the schema: scripts may not rely on them
(outputs may grow, never lose a key); :data:`NOTES` describes keys of the schema.

``vmpin schema [COMMAND]`` prints each view's JSON Schema, and under ``VMPIN_CHECK_VIEWS``
(the tests set it for every vmpin they run: vmpin.service.commands.emit) each ``--json``
output is validated before it is printed, so a view that drifts from its schema fails in the
tests, not in someone's script.  Both go through a pydantic model derived from the view
(:mod:`vmpin.wire.viewschema`): importing pydantic would cost a read command four bare
interpreters, so only those two do.

Every producer builds its rows with these functions (the topology's from vmpin.core's
Topology, with :func:`topology_of`: the core sits below this layer), so a key is named once.
A parameter defaulting to :data:`ABSENT` is a key printed only when given.  Functions not
in :data:`VIEWS` build parts that a view's schema takes as a plain dict (explain's).
Pure, stdlib only: the hooks load vmpin.reconcile.report, whose rows are built here.
"""

from __future__ import annotations

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.lean.records)
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, Literal, Optional

    from vmpin.core.topology import Topology

    CpuList = Optional[str]  # Linux list format, "0-3,8"; None when there is no set
    Json = dict[str, Any]

class _Absent:
    def __repr__(self) -> str:
        return "ABSENT"


#: the default of a key printed only when given (its schema says null: vmpin.wire.viewschema)
ABSENT: Any = _Absent()


def _given(row: Json) -> Json:
    """``row`` (a view's ``locals()``) without the keys left :data:`ABSENT`."""
    return {k: v for k, v in row.items() if v is not ABSENT}


# Each view's body is ``return locals()`` and nothing else: a local would be printed.
def container(
    *, id: str, sandbox: str, name: Optional[str], cpus: CpuList, runtime: Optional[str],
    is_sandbox: bool, pod_uid: Optional[str] = None, pod_name: Optional[str] = None,
    pod_namespace: Optional[str] = None, cpus_source: Optional[str] = None,
    pid: Optional[int] = None, stored_cpus: CpuList = None, host_differs: bool = False,
    gone: bool = False,
) -> Json:  # fmt: skip
    return locals()


def sandbox_container(*, id: str, name: Optional[str], cpus: CpuList, is_sandbox: bool) -> Json:
    return locals()


def sandbox(
    *, id: str, runtime: str, vmm_pid: Optional[int], mask: str, containers: list[Json],
    pod_uid: Optional[str], pod_name: Optional[str], pod_namespace: Optional[str], dirty: bool,
    mode: Optional[str] = None, stored_mask: str, host_differs: bool = False,
    vanished: bool = False,
) -> Json:  # fmt: skip
    return locals()


def thread(
    *, tid: Optional[int], role: Literal["vcpu", "iothread", "vhost", "emulator", "container"],
    index: Optional[int], name: Optional[str], desired: CpuList, actual: CpuList,
    layer: str = "", container: Optional[str] = None, action: str = "ok",
    error: Optional[str] = None,
) -> Json:  # fmt: skip
    return locals()


def policy(
    *, vcpus: str, helpers: str, housekeeping: CpuList, guest: str, cpuset: Optional[str],
    source: Literal["node", "oci", "api"], recorded_at: Optional[float], problems: list[str],
) -> Json:  # fmt: skip
    return locals()


def show(
    *, id: str, runtime: str, vmm_pid: Optional[int], mask: str, mode: str, reason: str,
    layers: list[str], threads: list[Json], guest_map: Optional[Json],
    policy: Optional[Json] = None, containers: list[Json], notes: list[str], errors: list[str],
) -> Json:  # fmt: skip
    return locals()


def show_container(*, id: str, name: Optional[str], cpus: CpuList) -> Json:
    return locals()


def guest_map(
    *, container: str, sandbox: str, host_cpus: CpuList, guest_cpus: CpuList, exact: bool,
    mode: str, reason: str,
) -> Json:  # fmt: skip
    return locals()


def topology_cpu(
    *, cpu: int, core: int, core_id: int, socket: int, die: int, numa: int, l3: int,
    siblings: str,
) -> Json:  # fmt: skip
    return locals()


def topology(
    *, online: str, offline: str, isolated: str, sockets: int, numa_nodes: int, cores: int,
    l3_groups: int, threads_per_core: int, order: list[int], cpus: list[Json],
) -> Json:  # fmt: skip
    return locals()


def topology_of(t: Topology) -> Json:
    """The ``topology`` view of the host's topology (vmpin.core.topology, read from sysfs)."""
    return topology(
        online=t.online.to_list(), offline=t.offline.to_list(), isolated=t.isolated.to_list(),
        sockets=t.sockets, numa_nodes=t.numa_nodes, cores=t.cores, l3_groups=t.l3_groups,
        threads_per_core=t.threads_per_core, order=list(t.order),
        cpus=[
            topology_cpu(cpu=c.cpu, core=c.core, core_id=c.core_id, socket=c.socket, die=c.die,
                         numa=c.numa, l3=c.l3, siblings=c.siblings.to_list())
            for c in sorted(t.cpus.values(), key=lambda c: c.cpu)
        ],
    )  # fmt: skip


def claim(
    *, sandbox: Optional[str], pod: str, container: Optional[str],
    source: Literal["vmpin", "kubelet", "vmpin-alloc"],
) -> Json:  # fmt: skip
    return locals()


# (the keys from ``cgroup`` on are a kind's own: a container's cgroup (drift); the thread that
# may run on a vCPU's CPU (double-pin); the pod the CPU is exclusive to (foreign-on-exclusive);
# both pods (conflict).  A docstring here would be the schema's description.)
def violation(
    *, kind: Literal["drift", "double-pin", "foreign-on-exclusive", "conflict", "stale-pin",
                     "error"],
    sandbox: Optional[str], tid: Optional[int], role: Optional[str], index: Optional[int],
    desired: CpuList, actual: CpuList, container: Optional[str], reason: str,
    cgroup: str = ABSENT, other_sandbox: str = ABSENT, other_tid: Optional[int] = ABSENT,
    other_role: str = ABSENT, claimant: Json = ABSENT, claimants: Optional[list[Json]] = ABSENT,
) -> Json:  # fmt: skip
    return _given(locals())


def audit(
    *, ok: bool, violations: list[Json], sandboxes: int, threads: int, errors: list[str],
    notes: list[str] = [],  # noqa: B006 (a schema's default: never mutated)
) -> Json:  # fmt: skip
    return locals()


def reconcile_item(
    *, id: str, runtime: str, mode: str, mask: str, repaired: int, vanished: bool,
    errors: list[str], threads: list[Json],
) -> Json:  # fmt: skip
    return locals()


def update(*, id: str, sandbox: str, cpus: CpuList, applied_by: str) -> Json:
    return locals()


# (the answer when no agent answers; the agent's own reply has more keys)
def status(*, ok: bool, error: str, journal_pending: int, journal_bad: int) -> Json:
    return locals()


def cluster_node(
    *, node: str, state: Literal["clean", "violations", "conflicts", "stale"], sandboxes: int,
    violations: int, conflicts: int, exclusive_cpus: CpuList, heartbeat_age: Optional[float],
    conflict_list: list[str],
) -> Json:  # fmt: skip
    return locals()


def explain(
    *, cpu: Optional[Json] = ABSENT, container: Optional[Json] = ABSENT,
    pod: Optional[Json] = ABSENT,
) -> Json:  # fmt: skip
    """``vmpin explain``: exactly one of cpu, container, pod (vmpin.reconcile.explain)."""
    return _given(locals())


# -- explain's parts (its schema takes them as plain dicts: views.NOTES describes them) ---------
def explain_cpu(
    *, cpu: int, online: bool, isolated: bool, socket: int, core: int, siblings: str,
    kubelet: Json, claimants: list[Json],
) -> Json:  # fmt: skip
    return locals()


def explain_kubelet(*, pool: Optional[bool], exclusive: Optional[Json], rule: str) -> Json:
    """What kubelet's checkpoint makes of a CPU: in the shared pool, exclusive to a claim."""
    return locals()


def explain_pod_of(*, uid: Optional[str], name: Optional[str], namespace: Optional[str]) -> Json:
    return locals()


def explain_sandbox(
    *, kind: Literal["sandbox"], sandbox: str, runtime: str, pod: Json, mode: str, rule: str
) -> Json:
    """A sandbox whose mask holds the CPU."""
    return locals()


def explain_thread(
    *, kind: Literal["thread"], sandbox: str, runtime: str, pod: Json, tid: Optional[int],
    role: str, index: Optional[int], container: Optional[str], desired: CpuList,
    actual: CpuList, rule: str,
) -> Json:  # fmt: skip
    return locals()


def explain_container(
    *, container: str, name: Optional[str], sandbox: str, runtime: str, pod: Json,
    cpus: CpuList, source: Optional[str], rule: str, kubelet: CpuList, runc: Optional[str],
    cgroup: CpuList, guest_cpus: CpuList, sandbox_mode: str,
) -> Json:  # fmt: skip
    return locals()


def explain_pod(
    *, sandbox: str, runtime: str, pod: Json, mask: str, mode: str, reason: str, policy: Json,
    containers: list[Json], threads: list[Json], notes: list[str],
) -> Json:  # fmt: skip
    return locals()


def explain_policy(*, vcpus: str, helpers: str, source: str, problems: list[str]) -> Json:
    return locals()


def explain_pod_container(*, id: str, name: Optional[str], cpus: CpuList, rule: str) -> Json:
    return locals()


#: keys printed but not in the schema, per view
EXTRA = {
    "sandbox_container": ("is_sandbox",),
    "sandbox": ("pod_uid", "pod_name", "pod_namespace", "dirty", "stored_mask"),
    "show": ("layers", "containers", "notes", "errors"),
    "guest_map": ("exact", "mode", "reason"),
    "status": ("error", "journal_pending", "journal_bad"),
    "topology": ("offline", "l3_groups", "order"),
    "topology_cpu": ("core_id", "die", "l3"),
    "violation": (
        "index", "container", "cgroup", "other_sandbox", "other_tid", "other_role", "claimant"
    ),
}
#: the schema's descriptions of keys, per view
NOTES = {
    "container": {
        "cpus": "CPU set, fresh from runc/kubelet where they moved it",
        "stored_cpus": "what vmpin's store holds",
        "host_differs": "the host says otherwise than the store",
    },
    "policy": {
        "source": "node: the node's settings; oci: the pod's annotations as its specs carry"
        " them; api: the pod's annotations in the Kubernetes API (recorded by the agent)",
        "recorded_at": "when the source was recorded (epoch s)",
    },
    "violation": {"claimants": "conflict: both pods claiming the CPUs"},
    "audit": {
        "notes": "what to know to read the result, never a violation (ok does not depend"
        " on it): e.g. Kata pins vCPUs itself (enable_vcpus_pinning) and how vmpin keeps out"
        " of its way",
    },
    "cluster_node": {"heartbeat_age": "seconds since the agent last wrote"},
    "explain": {
        "cpu": "cpu, online, isolated, socket, core, siblings, kubelet {pool, exclusive, rule},"
        " claimants [{kind: sandbox|thread, sandbox, rule, ...}]",
        "container": "container, name, sandbox, runtime, pod, cpus, source, rule, kubelet, runc,"
        " cgroup, guest_cpus",
        "pod": "sandbox, runtime, pod, mask, mode, reason, policy, containers, threads",
    },
}
#: a key's schema type where it holds other views (its parameter says Json)
NESTED = {
    ("sandbox", "containers"): "list[sandbox_container]",
    ("show", "threads"): "list[thread]",
    ("show", "guest_map"): "Optional[dict[str, Any]]",
    ("show", "policy"): "Optional[policy]",
    ("topology", "cpus"): "list[topology_cpu]",
    ("violation", "claimants"): "Optional[list[claim]]",
    ("audit", "violations"): "list[violation]",
    ("reconcile_item", "threads"): "list[thread]",
    ("explain", "cpu"): "Optional[dict[str, Any]]",
    ("explain", "container"): "Optional[dict[str, Any]]",
    ("explain", "pod"): "Optional[dict[str, Any]]",
}

#: each command's --json output: its view, and whether it prints a list of them
VIEWS: dict[str, tuple[Callable[..., Json], bool]] = {
    "containers": (container, True),
    "sandboxes": (sandbox, True),
    "show": (show, False),
    "guest-map": (guest_map, False),
    "topology": (topology, False),
    "audit": (audit, False),
    "reconcile": (reconcile_item, True),
    "update": (update, False),
    "status": (status, False),
    "cluster": (cluster_node, True),
    "explain": (explain, False),
}
