"""Which policy each sandbox is planned with: its pod's, else the node's -- from the store only.

A pod's policy annotations (the vocabulary: :mod:`vmpin.core.podpolicy`) come from two places,
both recorded in the store with their source and time (:class:`vmpin.state.records.PolicyRecord`):
the OCI specs the hooks saw at create (per sandbox, source ``oci``), and the pod as the
Kubernetes API shows it (per pod uid, source ``api``), which the agent records before each
pass.  The API's wins: it is what the operator set last (an API record with no policy key
means the operator removed them: the node's policy, whatever the specs said).  A sandbox whose
pod set nothing is planned with the node's policy.

Every process -- a hook, ``audit``, ``reconcile --once``, the agent -- resolves from these
records alone, so all of them plan with the same facts (issue 25: policy set through the API
lived only in the agent, ``audit`` called the agent's choice drift and ``reconcile --once``
reverted it).  Reading only: the store is not written here.
"""

from __future__ import annotations

from vmpin.core.planner import Policy
from vmpin.core.podpolicy import policy_for
from vmpin.state.records import PolicyRecord

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.lean.records)
if TYPE_CHECKING:
    from collections.abc import Mapping


class Resolved:
    __slots__ = ("at", "policy", "problems", "source")

    def __init__(
        self, policy: Policy, source: str, problems: list[str], at: float | None = None
    ) -> None:
        #: source: node | oci | api; at: when that source's annotations were recorded
        self.policy, self.source, self.problems, self.at = policy, source, problems, at


class PodPolicies:
    """sandbox id (and its pod uid) -> :class:`Resolved`, from the records of one store read."""

    def __init__(
        self,
        default: Policy,
        oci: Mapping[str, PolicyRecord],
        api: Mapping[str, PolicyRecord],
    ) -> None:
        self.default = default
        #: by sandbox id, from the specs
        self.oci = oci
        #: by pod uid, from the Kubernetes API
        self.api = api

    def resolve(self, sandbox_id: str, pod_uid: str | None) -> Resolved:
        rec = self.api.get(pod_uid) if pod_uid else None
        if rec is None:
            rec = self.oci.get(sandbox_id)
        if rec is None or not rec.annotations:
            return Resolved(self.default, "node", [], rec.at if rec else None)
        policy, problems = policy_for(rec.annotations, self.default)
        return Resolved(policy, rec.source, [str(p) for p in problems], rec.at)
