"""Per-pod placement policy: the ``vmpin.io/`` annotation vocabulary and Crane's cpu-manager key.

This module owns the words an operator writes on a pod and what each means to the planner.  It
is pure (annotations in, a :class:`PodPolicy` and a list of problems out): the same function
serves both ways annotations arrive -- at create, from the OCI annotations the hook records
(containerd passes them with a handler's ``pod_annotations``, hooks/containerd/; CRI-O copies
a pod's annotations into every container's spec by itself: docs/hooks.md), and live, from the
pod object the agent watches through the Kubernetes API.

Vocabulary, version 1 (``vmpin.io/version: "1"``; absent means 1)::

    vmpin.io/vcpus           auto | 1to1 | float | none
    vmpin.io/helpers         share | isolate | none      (emulator, iothreads, vhost)
    vmpin.io/guest-pinning   on | off
    vmpin.io/exclusive-cpus  N | limit | none            (vmpin allocates: issue 30)
    qos.gocrane.io/cpu-manager  exclusive | share | none (Crane's advanced CPU manager)

``auto`` pins vCPUs 1:1 when the counts and exclusivity allow and floats otherwise; ``1to1``
asks for the same but the plan notes when it could not be honoured; ``float`` spreads the
vCPUs over the mask; ``none`` leaves them where the runtime put them.  Crane's values map onto
the node plan: ``exclusive`` -- other sandboxes and containers are kept off the pod's CPUs;
``share`` -- others may float there (so the pod's vCPUs float too: 1:1 on a CPU others use
would halve both); ``none`` -- the pod floats over the shared pool.

``vmpin.io/exclusive-cpus`` asks vmpin itself for exclusive CPUs where kubelet hands out none
(CPU manager policy ``none``; docs/allocation.md): ``N`` CPUs, or ``limit`` -- as many as the
pod's containers' integer CPU limits (OCI ``linux.resources.cpu.quota / period``); ``none``
asks for nothing, even with Crane's ``exclusive``, which otherwise asks as ``limit`` does
(:func:`exclusive_request`).

An unknown key under ``vmpin.io/`` or an unknown value is a *problem* (one line naming the key
and value), never an error: that one setting falls back to the node default, the rest of the
pod's policy still applies.  An unknown ``vmpin.io/version`` makes every ``vmpin.io/`` key a
problem (their meaning is unknown); Crane's key is versioned by Crane and still applies.
"""

from __future__ import annotations

from vmpin.core.planner import CPUSET_MODES, HELPER_POLICIES, VCPU_POLICIES, Policy

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.lean.records)
if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import NamedTuple
else:
    from vmpin.lean.records import NamedTuple

PREFIX = "vmpin.io/"
VERSION_KEY = PREFIX + "version"
VERSIONS = ("1",)
VCPUS_KEY = PREFIX + "vcpus"
HELPERS_KEY = PREFIX + "helpers"
GUEST_KEY = PREFIX + "guest-pinning"
EXCLUSIVE_KEY = PREFIX + "exclusive-cpus"
#: the most CPUs one pod may ask for (the kernel's NR_CPUS limit: vmpin.core.cpuset)
MAX_EXCLUSIVE = 8192
CRANE_KEY = "qos.gocrane.io/cpu-manager"
GUEST_VALUES = ("on", "off")

#: every key this module reads, with its allowed values (docs/kubernetes.md shows this table)
VOCABULARY: Mapping[str, tuple[str, ...]] = {
    VERSION_KEY: VERSIONS,
    VCPUS_KEY: VCPU_POLICIES,
    HELPERS_KEY: HELPER_POLICIES,
    GUEST_KEY: GUEST_VALUES,
    EXCLUSIVE_KEY: ("N", "limit", "none"),  # N: a whole number of CPUs, 1 or more
    CRANE_KEY: CPUSET_MODES[1:],  # "" (node default) is not something one writes
}


def is_policy_key(key: str) -> bool:
    """An annotation this module reads (what the hook keeps from an OCI spec)."""
    return key.startswith(PREFIX) or key == CRANE_KEY


class PodPolicy(NamedTuple):
    """What a pod's annotations ask for; ``None`` = not set (the node default applies)."""

    vcpus: str | None = None
    helpers: str | None = None
    guest: str | None = None
    cpuset: str | None = None
    #: vmpin.io/exclusive-cpus as written (a count, "limit" or "none")
    exclusive: str | None = None

    def over(self, default: Policy) -> Policy:
        """The planner's policy for this pod: each setting the pod made, else the node's."""
        helpers = self.helpers or default.helpers
        if helpers == "isolate" and not default.housekeeping:
            # isolate needs the node's housekeeping CPUs; without them share is what is left
            helpers = default.helpers if default.helpers != "isolate" else "share"
        return default._replace(
            vcpus=self.vcpus or default.vcpus,
            helpers=helpers,
            guest=self.guest or default.guest,
            cpuset=self.cpuset or default.cpuset,
        ).check()

    def to_json(self) -> dict[str, str]:
        return {k: v for k, v in self._asdict().items() if v is not None}


class Problem(NamedTuple):
    key: str
    value: str
    reason: str

    def __str__(self) -> str:
        return f"annotation {self.key}={self.value!r}: {self.reason}; the node default applies"


def parse(annotations: Mapping[str, str]) -> tuple[PodPolicy, list[Problem]]:
    """Read a pod's annotations (or a container's OCI annotations) into its policy."""
    problems: list[Problem] = []
    version = annotations.get(VERSION_KEY, "1")
    ours = sorted(k for k in annotations if k.startswith(PREFIX))
    if version not in VERSIONS:
        reason = f"unknown vocabulary version (known: {', '.join(VERSIONS)})"
        return (
            PodPolicy(cpuset=_one(annotations, CRANE_KEY, problems)),
            [Problem(k, annotations[k], reason) for k in ours] + problems,
        )
    for key in ours:
        if key not in VOCABULARY:
            problems.append(Problem(key, annotations[key], "unknown key"))
    policy = PodPolicy(
        vcpus=_one(annotations, VCPUS_KEY, problems),
        helpers=_one(annotations, HELPERS_KEY, problems),
        guest=_one(annotations, GUEST_KEY, problems),
        cpuset=_one(annotations, CRANE_KEY, problems),
        exclusive=_one(annotations, EXCLUSIVE_KEY, problems),
    )
    return policy, problems


def _one(annotations: Mapping[str, str], key: str, problems: list[Problem]) -> str | None:
    raw = annotations.get(key)
    if raw is None:
        return None
    value = raw.strip().lower()
    allowed = VOCABULARY[key]
    if key == EXCLUSIVE_KEY and value.isdigit() and value.isascii():
        if 1 <= int(value) <= MAX_EXCLUSIVE:
            return str(int(value))
        problems.append(Problem(key, raw, f"a count must be 1 to {MAX_EXCLUSIVE}"))
        return None
    if value not in allowed:
        problems.append(Problem(key, raw, f"expected one of {', '.join(allowed)}"))
        return None
    return value


def policy_for(annotations: Mapping[str, str], default: Policy) -> tuple[Policy, list[Problem]]:
    """The planner's policy for a sandbox with these annotations, and what was not understood."""
    pod, problems = parse(annotations)
    return pod.over(default), problems


class CpuRequest(NamedTuple):
    """A pod's ask for exclusive CPUs of vmpin's own (issue 30)."""

    #: how many; None: as many as its containers' integer CPU limits say
    size: int | None
    #: the annotation that asked, as ``key=value`` (for the reasons vmpin gives)
    via: str


def exclusive_request(annotations: Mapping[str, str]) -> CpuRequest | None:
    """Whether a pod's annotations ask vmpin for exclusive CPUs, and how many.

    ``vmpin.io/exclusive-cpus`` decides when it is set and usable (``none`` asks for
    nothing); else Crane's ``exclusive`` asks for the CPU limits' worth.  A value that could
    not be used asks for nothing (:func:`parse` names it as a problem).
    """
    pod, _ = parse(annotations)
    if pod.exclusive == "none":
        return None
    if pod.exclusive is not None:
        via = f"{EXCLUSIVE_KEY}={pod.exclusive}"
        return CpuRequest(None if pod.exclusive == "limit" else int(pod.exclusive), via)
    if pod.cpuset == "exclusive":
        return CpuRequest(None, f"{CRANE_KEY}=exclusive")
    return None

