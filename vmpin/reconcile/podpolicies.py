"""Which policy each sandbox is planned with: its pod's, else the node's.

A pod's policy annotations (the vocabulary: :mod:`vmpin.core.podpolicy`) come from two places:
live from the Kubernetes API when the agent watches its pods (``api_annotations``, by pod
uid), and from the OCI specs the hooks saw at create (kept per sandbox in the store).  The
live view wins: it is what the operator set last.  A sandbox whose pod set nothing is
planned with the node's policy.  Reading only: the store is not written here.
"""

from __future__ import annotations

from vmpin.core.planner import Policy
from vmpin.core.podpolicy import policy_for
from vmpin.state.store import Store

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.core._lean)
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping


class Resolved:
    __slots__ = ("policy", "problems", "source")

    def __init__(self, policy: Policy, source: str, problems: list[str]) -> None:
        #: source: node | oci | api
        self.policy, self.source, self.problems = policy, source, problems


class PodPolicies:
    """sandbox id -> :class:`Policy`; ``get`` makes it usable where a mapping is expected."""

    def __init__(
        self,
        store: Store,
        default: Policy,
        api_annotations: Callable[[str], Mapping[str, str] | None] | None = None,
        *,
        recorded: Mapping[str, Mapping[str, str]] | None = None,
    ) -> None:
        self.store = store
        self.default = default
        self.api_annotations = api_annotations
        #: every sandbox's recorded OCI annotations, read once (a node pass resolves every
        #: sandbox: one store query each made it grow with the node); None = ask the store
        self.recorded = recorded

    def resolve(
        self, sandbox_id: str, pod_uid: str | None = None, *, lookup: bool = True
    ) -> Resolved:
        """The sandbox's policy; ``lookup=False``: ``pod_uid`` is already the recorded one."""
        if pod_uid is None and lookup and self.api_annotations is not None:
            rec = self.store.sandbox(sandbox_id)
            pod_uid = rec.pod_uid if rec is not None else None
        ann = self.api_annotations(pod_uid) if self.api_annotations and pod_uid else None
        source = "api"
        if ann is None:
            source = "oci"
            if self.recorded is not None:
                ann = self.recorded.get(sandbox_id) or {}
            else:
                ann = self.store.policy_annotations(sandbox_id)
        if not ann:
            return Resolved(self.default, "node", [])
        policy, problems = policy_for(ann, self.default)
        return Resolved(policy, source, [str(p) for p in problems])

    def get(self, sandbox_id: str, default: Policy | None = None) -> Policy:
        return self.resolve(sandbox_id).policy
