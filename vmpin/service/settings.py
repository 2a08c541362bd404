"""Settings: the one value every entry point builds, and the one factory of the reconcile pass.

:meth:`Settings.from_env` is the only reader of vmpin's environment variables (the host roots
of DESIGN.md, ``VMPIN_HELPER_POLICY``, ``VMPIN_HOUSEKEEPING``, ``VMPIN_VCPU_POLICY``,
``VMPIN_GUEST_FLOAT``, ``VMPIN_HOLDOFF``), but for the host roots alone, which
:meth:`vmpin.linux.paths.HostPaths.from_env` reads for it and for a hook that only journals
(vmpin.service.hook: it plans with no policy): options given explicitly (CLI, hook argv) win
over the environment, which wins over the defaults.  The hook, ``vmpin update``, ``reconcile``,
the read-only views and the agent then build their :class:`Reconciler` with
:func:`build_reconciler`, so that they all plan alike (issue 9: ``update`` without the agent
used to plan with the default policy).

Lean on purpose (the hook imports it): a NamedTuple from ``vmpin.lean.records``, and the
planner's Policy is only built when a pass needs it.
"""

from __future__ import annotations

import os

from vmpin.core.cpuset import EMPTY, CpuSet
from vmpin.linux.paths import ENVVARS as PATH_ENVVARS
from vmpin.linux.paths import HostPaths

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.lean.records)

if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import NamedTuple

    from vmpin.core.planner import Policy
    from vmpin.linux.affinity import AffinityBackend
    from vmpin.reconcile.reconciler import Reconciler
    from vmpin.reconcile.sources import DomainSource
    from vmpin.state.reader import Reader
    from vmpin.state.store import Store
else:
    from vmpin.lean.records import NamedTuple

ENV = {
    "helpers": "VMPIN_HELPER_POLICY",
    "housekeeping": "VMPIN_HOUSEKEEPING",
    "vcpus": "VMPIN_VCPU_POLICY",
    "guest_float": "VMPIN_GUEST_FLOAT",
    "holdoff": "VMPIN_HOLDOFF",
    "nice": "VMPIN_AGENT_NICE",
    "libvirt": "VMPIN_LIBVIRT",
}
#: libvirt connections whose domains are sandboxes when none are configured (docs/libvirt.md).
DEFAULT_LIBVIRT = "qemu:///system"
#: the node's placement policy: what the agent records for every other process (issue 25)
POLICY_KEYS = ("helpers", "housekeeping", "vcpus", "guest_float")
#: store meta key of the node policy the agent runs with (JSON: POLICY_KEYS, at, by)
NODE_POLICY_META = "node-policy"


class Settings(NamedTuple):
    paths: HostPaths
    helpers: str = "share"
    housekeeping: str = ""
    vcpus: str = "auto"
    guest_float: str = "all"
    #: the agent's least time between two passes over one sandbox ("" = its default)
    holdoff: str = ""
    #: the agent's scheduling priority, a nice value ("" = its default)
    nice: str = ""
    #: libvirt connections: comma-separated URIs, "kubevirt" for every virt-launcher's
    #: daemon, "none" for no libvirt at all (docs/libvirt.md)
    libvirt: str = DEFAULT_LIBVIRT
    #: the POLICY_KEYS this process was given (an option or a VMPIN_* variable): the others
    #: follow the node policy the agent recorded (:meth:`over_recorded`)
    given: tuple[str, ...] = ()
    #: the agent's log level (``VMPIN_LOG_LEVEL``; "" = INFO)
    log_level: str = ""
    #: ``--json`` output is checked against its view's schema first (``VMPIN_CHECK_VIEWS``,
    #: which the tests set for every vmpin they start)
    check_views: bool = False

    @classmethod
    def from_env(
        cls,
        overrides: Mapping[str, str | None] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> Settings:
        """Build from explicit options (path names of HostPaths, or helpers, housekeeping,
        vcpus, guest_float, holdoff), then the environment, then the defaults."""
        env = os.environ if env is None else env
        given = dict(overrides or {})
        path_opts = {k: given.pop(k) for k in list(given) if k in PATH_ENVVARS}
        unknown = set(given) - set(ENV)
        if unknown:
            raise ValueError(f"unknown settings {sorted(unknown)}")
        paths = HostPaths.from_env(path_opts, env)

        def pick(key: str, default: str) -> str:
            value = given.get(key)
            if value is not None:
                return value
            return env.get(ENV[key]) or default

        return cls(
            paths,
            helpers=pick("helpers", "share"),
            housekeeping=pick("housekeeping", ""),
            vcpus=pick("vcpus", "auto"),
            guest_float=pick("guest_float", "all"),
            holdoff=pick("holdoff", ""),
            nice=pick("nice", ""),
            libvirt=pick("libvirt", DEFAULT_LIBVIRT),
            given=tuple(k for k in POLICY_KEYS if given.get(k) is not None or env.get(ENV[k])),
            log_level=env.get("VMPIN_LOG_LEVEL", ""),
            check_views=env.get("VMPIN_CHECK_VIEWS", "") not in ("", "0"),
        )

    def over_recorded(self, store: Reader) -> Settings:
        """These settings, with each policy key this process was not given taken from the
        node policy the agent recorded (:meth:`record`).

        Why: the hooks run with the runtime's environment and ``audit`` or ``reconcile
        --once`` with an operator's shell; neither has the agent's ``VMPIN_HELPER_POLICY``.
        Planning with the defaults made them call the agent's placement drift and revert it
        (issue 25: one policy truth).  A key given here still wins: an operator's explicit
        ``--helpers`` is what that one command plans with.
        """
        missing = [k for k in POLICY_KEYS if k not in self.given]
        raw = store.meta(NODE_POLICY_META) if missing else None
        if not raw:
            return self
        from vmpin.wire import jsonio

        try:
            doc = jsonio.loads(raw)
        except ValueError:
            return self  # not what vmpin writes: the defaults, not a crash
        if not isinstance(doc, dict):
            return self
        found = {k: doc[k] for k in missing if isinstance(doc.get(k), str)}
        return self._replace(**found) if found else self

    def record(self, store: Store, by: str) -> None:
        """Record this process's policy as the node's (the agent does at start)."""
        import time

        from vmpin.wire import jsonio

        doc: dict[str, object] = {k: getattr(self, k) for k in POLICY_KEYS}
        doc.update(at=round(time.time(), 3), by=by)
        store.set_meta(NODE_POLICY_META, jsonio.dumps(doc, sort_keys=True))

    def policy(self) -> Policy:
        """The planner's policy, validated (a bad value is a PlanError naming it)."""
        from vmpin.core.planner import Policy

        hk = CpuSet.parse(self.housekeeping) if self.housekeeping else EMPTY
        return Policy(helpers=self.helpers, housekeeping=hk, vcpus=self.vcpus).check()

    def float_policy(self) -> str:
        if self.guest_float not in ("all", "proportional"):
            from vmpin.core.errors import PlanError

            raise PlanError(
                f"guest float policy {self.guest_float!r}: expected all or proportional"
            )
        return self.guest_float

    def view_key(self) -> dict[str, str]:
        """What a read view is observed with beyond the store: the host roots, the policy keys
        this process was given (the others follow the node's, as the agent's do:
        :meth:`over_recorded`) and the libvirt connections.  A read command sends it with its
        request for the agent's view, and the agent answers only when its own match
        (:meth:`differs`): an answer for another root or policy would be another node's."""
        key = dict(self.paths._asdict())
        key.update({k: getattr(self, k) for k in self.given})
        key["libvirt"] = self.libvirt
        return key

    def differs(self, key: Mapping[str, str]) -> str | None:
        """How a read command's :meth:`view_key` differs from these settings (the agent's);
        None when a view observed with these is the one it would observe."""
        mine = self.view_key()
        for k in PATH_ENVVARS:
            if key.get(k) != mine[k]:
                return f"{k} {key.get(k)!r} is not the agent's {mine[k]!r}"
        for k, v in key.items():
            if k in PATH_ENVVARS:
                continue
            if k not in POLICY_KEYS and k != "libvirt":
                return f"unknown setting {k!r}"
            if v != getattr(self, k):
                return f"{k} {v!r} is not the agent's {getattr(self, k)!r}"
        return None

    def libvirt_uris(self) -> list[str]:
        uris = [u.strip() for u in self.libvirt.split(",") if u.strip()]
        return [] if uris == ["none"] else uris



def build_reconciler(
    settings: Settings,
    store: Reader | None = None,
    *,
    affinity: AffinityBackend | None = None,
    qmp_timeout: float = 0.3,
    domains: DomainSource | None = None,
    ingest_first: bool = True,
    hold_maps: bool = False,
    follow_hotplug: bool = False,
    deadline: float | None = None,
) -> Reconciler:
    """The one factory: every entry point's observe -> plan -> apply machinery.

    ``domains``: libvirt domains (:class:`vmpin.reconcile.domains.LibvirtDomains` built from
    :meth:`Settings.libvirt_uris`), handed in by the CLI and the agent only: the hook, which
    also builds its reconciler here, never imports libvirt.

    What a process that plans for its whole life (the agent) asks for
    (:class:`vmpin.reconcile.reconciler.Reconciler`): ``ingest_first=False``, it applies the
    journal itself before each pass; ``hold_maps``, replaced guest maps are freed after its
    answers; ``follow_hotplug``, the topology is read again once a CPU comes or goes.  What
    a command on someone's clock asks (a hook, ``vmpin update``): ``deadline``
    (``time.monotonic()``), no wait for the node's plan lock past it (vmpin.service.budget).
    """
    from vmpin.reconcile.reconciler import Reconciler

    if store is not None:
        settings = settings.over_recorded(store)
    return Reconciler(
        settings.paths,
        store,
        policy=settings.policy,
        affinity=affinity,
        float_policy=settings.float_policy(),
        qmp_timeout=qmp_timeout,
        domains=domains,
        ingest_first=ingest_first,
        hold_maps=hold_maps,
        follow_hotplug=follow_hotplug,
        deadline=deadline,
    )


def kube_configured(kubeconfig: str | None, env: Mapping[str, str] | None = None) -> bool:
    """Whether any Kubernetes API credentials are in sight.

    Here, not in :mod:`vmpin.service.kube`, so that the agent can ask without importing the
    client: importing ``kubernetes`` costs 35 MB of RSS and ~0.3 s (issue 14), which an agent
    with the ``kube`` extra installed but no credentials used to pay to learn that it has none.
    """
    env = os.environ if env is None else env
    if kubeconfig:
        return True
    if env.get("KUBERNETES_SERVICE_HOST"):
        return True
    path = env.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")
    return os.path.exists(path)
