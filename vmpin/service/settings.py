"""Placement settings shared by every entry point, from CLI options or the environment.

The hook, ``vmpin update``, ``reconcile`` and the agent must plan alike, so the policy lives in
environment variables that the systemd unit / DaemonSet sets once for all of them
(``VMPIN_HELPER_POLICY``, ``VMPIN_HOUSEKEEPING``, ``VMPIN_VCPU_POLICY``, ``VMPIN_GUEST_FLOAT``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from vmpin.core.cpuset import EMPTY, CpuSet

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.core._lean)

if TYPE_CHECKING:
    from vmpin.core.planner import Policy

ENV = {
    "helpers": "VMPIN_HELPER_POLICY",
    "housekeeping": "VMPIN_HOUSEKEEPING",
    "vcpus": "VMPIN_VCPU_POLICY",
    "guest_float": "VMPIN_GUEST_FLOAT",
}


def policy_from(
    env: Mapping[str, str] | None = None,
    helpers: str | None = None,
    housekeeping: str | None = None,
    vcpus: str | None = None,
) -> Policy:
    from vmpin.core.planner import Policy

    env = os.environ if env is None else env
    hk = housekeeping if housekeeping is not None else env.get(ENV["housekeeping"], "")
    return Policy(
        helpers=helpers or env.get(ENV["helpers"]) or "share",
        housekeeping=CpuSet.parse(hk) if hk else EMPTY,
        vcpus=vcpus or env.get(ENV["vcpus"]) or "auto",
    ).check()


def guest_float(env: Mapping[str, str] | None = None, value: str | None = None) -> str:
    env = os.environ if env is None else env
    out = value or env.get(ENV["guest_float"]) or "all"
    if out not in ("all", "proportional"):
        from vmpin.core.errors import PlanError

        raise PlanError(f"guest float policy {out!r}: expected all or proportional")
    return out
