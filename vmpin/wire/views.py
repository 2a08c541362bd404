"""The ``--json`` views as pydantic models: one home for each output's shape and its schema.

DESIGN.md fixes the keys scripts rely on; these models write them down once.  ``vmpin schema
[COMMAND]`` prints the JSON Schema of each.  Models allow extra keys: outputs may grow, never
lose a key.

Every ``--json`` output is validated against its model before it is printed when
``VMPIN_CHECK_VIEWS`` is set (vmpin.service.commands.emit): the tests set it for every vmpin
they run, so a view that drifts from its schema fails loudly in the tests, not silently in
someone's script.  An operator's command does not pay for pydantic (~30 ms to import, and
typer's route another ~50 ms): ``update`` and the read commands never import this module
unless asked to check.  Models build their validators on first use (``defer_build``).
"""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, RootModel

CpuList = Optional[str]  # Linux list format, "0-3,8"; None when there is no set


class View(BaseModel):
    model_config = ConfigDict(extra="allow", defer_build=True)


class ContainerView(View):
    id: str
    sandbox: str
    name: Optional[str]
    cpus: CpuList = Field(description="CPU set, fresh from runc/kubelet where they moved it")
    runtime: Optional[str]
    is_sandbox: bool
    pod_uid: Optional[str] = None
    pod_name: Optional[str] = None
    pod_namespace: Optional[str] = None
    cpus_source: Optional[str] = None
    pid: Optional[int] = None
    stored_cpus: CpuList = Field(None, description="what vmpin's store holds")
    host_differs: bool = Field(False, description="the host says otherwise than the store")
    gone: bool = False


class SandboxContainerView(View):
    id: str
    name: Optional[str]
    cpus: CpuList


class SandboxView(View):
    id: str
    runtime: str
    vmm_pid: Optional[int]
    mask: str
    containers: list[SandboxContainerView]
    mode: Optional[str] = None
    host_differs: bool = False
    vanished: bool = False


class ThreadView(View):
    tid: Optional[int]
    role: Literal["vcpu", "iothread", "vhost", "emulator", "container"]
    index: Optional[int]
    name: Optional[str]
    desired: CpuList
    actual: CpuList
    layer: str = ""
    container: Optional[str] = None
    action: str = "ok"
    error: Optional[str] = None


class PolicyView(View):
    vcpus: str
    helpers: str
    housekeeping: CpuList
    guest: str
    cpuset: Optional[str]
    source: Literal["node", "oci", "api"] = Field(
        description="node: the node's settings; oci: the pod's annotations as its specs carry"
        " them; api: the pod's annotations in the Kubernetes API (recorded by the agent)"
    )
    recorded_at: Optional[float] = Field(description="when the source was recorded (epoch s)")
    problems: list[str]


class ShowView(View):
    id: str
    runtime: str
    vmm_pid: Optional[int]
    mask: str
    mode: str
    reason: str
    threads: list[ThreadView]
    guest_map: Optional[dict[str, Any]]
    policy: Optional[PolicyView] = None


class GuestMapView(View):
    container: str
    sandbox: str
    host_cpus: CpuList
    guest_cpus: CpuList


class TopologyCpuView(View):
    cpu: int
    core: int
    socket: int
    numa: int
    siblings: str


class TopologyView(View):
    online: str
    isolated: str
    sockets: int
    numa_nodes: int
    cores: int
    threads_per_core: int
    cpus: list[TopologyCpuView]


class ClaimView(View):
    sandbox: Optional[str]
    pod: str
    container: Optional[str]
    source: Literal["vmpin", "kubelet"]


class ViolationView(View):
    kind: Literal["drift", "double-pin", "foreign-on-exclusive", "conflict", "stale-pin", "error"]
    sandbox: Optional[str]
    tid: Optional[int]
    role: Optional[str]
    desired: CpuList
    actual: CpuList
    reason: str
    claimants: Optional[list[ClaimView]] = Field(
        None, description="conflict: both pods claiming the CPUs"
    )


class AuditView(View):
    ok: bool
    violations: list[ViolationView]
    sandboxes: int
    threads: int
    errors: list[str]
    notes: list[str] = Field(
        [],
        description="what to know to read the result, never a violation (ok does not depend"
        " on it): e.g. Kata pins vCPUs itself (enable_vcpus_pinning) and how vmpin keeps out"
        " of its way",
    )


class ReconcileItemView(View):
    id: str
    runtime: str
    mode: str
    mask: str
    repaired: int
    vanished: bool
    errors: list[str]
    threads: list[ThreadView]


class UpdateView(View):
    id: str
    sandbox: str
    cpus: CpuList
    applied_by: str


class StatusView(View):
    ok: bool


class ClusterNodeView(View):
    node: str
    state: Literal["clean", "violations", "conflicts", "stale"]
    sandboxes: int
    violations: int
    conflicts: int
    exclusive_cpus: CpuList
    heartbeat_age: Optional[float] = Field(description="seconds since the agent last wrote")
    conflict_list: list[str]


class ExplainView(View):
    """``vmpin explain``: exactly one of cpu, container, pod (vmpin.reconcile.explain)."""

    cpu: Optional[dict[str, Any]] = Field(
        None, description="cpu, online, isolated, socket, core, siblings, kubelet {pool,"
        " exclusive, rule}, claimants [{kind: sandbox|thread, sandbox, rule, ...}]"
    )
    container: Optional[dict[str, Any]] = Field(
        None, description="container, name, sandbox, runtime, pod, cpus, source, rule,"
        " kubelet, runc, cgroup, guest_cpus"
    )
    pod: Optional[dict[str, Any]] = Field(
        None, description="sandbox, runtime, pod, mask, mode, reason, policy, containers,"
        " threads"
    )


VIEWS: dict[str, Any] = {
    "containers": RootModel[list[ContainerView]],
    "sandboxes": RootModel[list[SandboxView]],
    "show": ShowView,
    "guest-map": GuestMapView,
    "topology": TopologyView,
    "audit": AuditView,
    "reconcile": RootModel[list[ReconcileItemView]],
    "update": UpdateView,
    "status": StatusView,
    "cluster": RootModel[list[ClusterNodeView]],
    "explain": ExplainView,
}


def check(command: str, data: Any) -> None:
    """Validate ``data`` against the view of ``command`` (raises pydantic's ValidationError)."""
    VIEWS[command].model_validate(data)


def schema(command: str) -> dict[str, Any]:
    out: dict[str, Any] = VIEWS[command].model_json_schema()
    out["title"] = f"vmpin {command} --json"
    return out
