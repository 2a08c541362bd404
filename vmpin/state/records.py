"""The store's records and how a table row becomes one.

Its own room so that modules that hold records without opening the database (the planner's
inputs, reports, the Kubernetes API's view of a pod's policy) name them without importing
the store and SQLite with it.  The row decoders live beside the records they build: both
follow the column order, which is the records' field order (vmpin.state.schema's tables).
"""

from __future__ import annotations

from sys import intern as _intern

from vmpin.core.cpuset import CpuSet, parse_cpus
from vmpin.core.errors import StateError
from vmpin.wire import jsonio as json  # json without re: the hook reaches this module

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.lean.records)
if TYPE_CHECKING:
    import sqlite3
    from collections.abc import Mapping
    from typing import Any, NamedTuple
else:
    from vmpin.lean.records import NamedTuple

#: meta key prefix of a sandbox's per-pod policy annotations (from its OCI specs)
POLICY_META = "podpolicy:"
#: meta key prefix of a pod's policy annotations as the Kubernetes API showed them (by pod uid)
API_POLICY_META = "podpolicy-api:"


class ContainerRec(NamedTuple):
    id: str
    sandbox_id: str
    is_sandbox: bool
    name: str | None = None
    pod_uid: str | None = None
    pod_name: str | None = None
    pod_namespace: str | None = None
    cpus: CpuSet | None = None
    cpus_source: str | None = None
    mems: str | None = None
    bundle: str | None = None
    pid: int | None = None
    pid_start: int | None = None
    cgroup: str | None = None
    runtime_seen: str | None = None
    kubelet_seen: str | None = None
    created_at: float = 0.0
    updated_at: float = 0.0


class PolicyRecord(NamedTuple):
    """A pod's policy annotations as one source gave them, and when vmpin recorded them."""

    annotations: Mapping[str, str]
    source: str  # oci (the hooks, from the specs) | api (the agent, from the Kubernetes API)
    at: float | None = None


def policy_json(annotations: Mapping[str, str], at: float) -> str:
    """The stored form of a policy record (what :func:`policy_record` reads back)."""
    return json.dumps({"annotations": dict(annotations), "at": round(at, 3)}, sort_keys=True)


def policy_record(raw: str, source: str) -> PolicyRecord:
    """A recorded policy input; the bare annotation map older vmpins wrote reads with no time.

    A value that is not what vmpin writes (a hand edit) reads as no annotations: the node's
    policy applies to that pod, and the store stays readable.
    """
    try:
        doc = json.loads(raw)
    except ValueError:
        return PolicyRecord({}, source)
    if not isinstance(doc, dict):
        return PolicyRecord({}, source)
    inner = doc.get("annotations")
    if isinstance(inner, dict):
        at = doc.get("at")
        ann, when = inner, float(at) if isinstance(at, (int, float)) else None
    else:
        ann, when = doc, None
    return PolicyRecord({k: v for k, v in ann.items() if isinstance(v, str)}, source, when)


class SandboxRec(NamedTuple):
    id: str
    runtime: str
    vmm_pid: int | None = None
    vmm_start: int | None = None
    pod_uid: str | None = None
    pod_name: str | None = None
    pod_namespace: str | None = None
    gen: int = 1
    done_gen: int = 0
    created_at: float = 0.0
    updated_at: float = 0.0

    @property
    def dirty(self) -> bool:
        return self.gen > self.done_gen


class ThreadRec(NamedTuple):
    tid: int
    role: str
    idx: int | None
    label: str | None
    layer: str


#: the tables' columns, in the records' field order
CONTAINER_COLS = list(ContainerRec._fields)
SANDBOX_COLS = list(SandboxRec._fields)

_CPUS_AT = CONTAINER_COLS.index("cpus")
_SANDBOX_AT = CONTAINER_COLS.index("is_sandbox")
#: text columns whose values repeat across rows (a sandbox's id and pod in each of its
#: containers, a namespace in every pod): read as one shared string each, see shared()
_SHARED_CONTAINER = tuple(
    CONTAINER_COLS.index(c)
    for c in ("sandbox_id", "name", "pod_uid", "pod_name", "pod_namespace", "cpus_source",
              "mems", "runtime_seen", "kubelet_seen")
)  # fmt: skip
SHARED_THREAD = tuple(ThreadRec._fields.index(c) for c in ("role", "label", "layer"))
_SHARED_SANDBOX = tuple(
    SANDBOX_COLS.index(c) for c in ("id", "runtime", "pod_uid", "pod_name", "pod_namespace")
)
def _cpus(text: str | None) -> CpuSet | None:
    return None if text is None else parse_cpus(text)


def shared(values: list[Any], at: tuple[int, ...]) -> list[Any]:
    """``values`` with the strings at ``at`` made the one interned copy of their text.

    Why: the agent keeps the store's rows between passes (an idle pass reads no table), and
    SQLite hands out a new string per row and column.  At 2,000 sandboxes the same sandbox
    ids, pod names, namespaces, thread roles and labels were tens of thousands of copies,
    ~1.8 MiB of the agent's 50 MB budget (issue 14).  ``sys.intern``: one copy across tables
    and passes, and freed once no row holds it.
    """
    for i in at:
        v = values[i]
        if type(v) is str:
            values[i] = _intern(v)
    return values


def container_row(row: sqlite3.Row) -> ContainerRec:
    if len(row) != len(CONTAINER_COLS):
        raise StateError(f"containers row has {len(row)} columns, not {len(CONTAINER_COLS)}")
    values = shared(list(row), _SHARED_CONTAINER)
    values[_SANDBOX_AT] = bool(values[_SANDBOX_AT])
    values[_CPUS_AT] = _cpus(values[_CPUS_AT])
    return ContainerRec._make(values)


def sandbox_row(row: sqlite3.Row) -> SandboxRec:
    if len(row) != len(SANDBOX_COLS):
        raise StateError(f"sandboxes row has {len(row)} columns, not {len(SANDBOX_COLS)}")
    return SandboxRec._make(shared(list(row), _SHARED_SANDBOX))
