"""Every command's body, and :func:`run`: the one way a command runs, and the one place its
errors become a message and an exit code.

Argv is read by :func:`vmpin.service.clispec.parse` (or, for what it refuses, by the typer
app, which explains it), and ``run`` hands the values to the command's body under the
option's key: each body prints and returns its exit code.  Free of typer and pydantic at
import (issue 14: a read command or ``update`` would pay ~80 ms for them); a body imports
what only it needs.

``--json`` views are checked against their pydantic models (:mod:`vmpin.wire.viewschema`) only
when ``VMPIN_CHECK_VIEWS`` is set -- the tests set it for every vmpin they start -- because
importing pydantic would cost a read command four bare interpreters.
"""

from __future__ import annotations

import os
import sys
import time

from vmpin.core.cpuset import CpuSet
from vmpin.core.cpuset import listed as cpus
from vmpin.core.errors import SpecError, StateError, VmpinError
from vmpin.service.settings import Settings
from vmpin.wire import jsonio, views

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.lean.records)

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from typing import Any

    from vmpin.reconcile.domains import LibvirtDomains
    from vmpin.reconcile.observe import Scope
    from vmpin.reconcile.plan import NodePlan, SandboxPlan
    from vmpin.reconcile.reconciler import Reconciler, SandboxReport
    from vmpin.state.reader import Reader
    from vmpin.state.store import Store

#: set (to anything but "" or "0") to validate every --json view against its model first


class Ctx:
    """What every command gets: the one Settings value, and the one factory built from it."""

    def __init__(self, settings: Settings, given: dict[str, str | None] | None = None) -> None:
        self.settings = settings
        self.paths = settings.paths
        self._given = given or {}
        self._domains: LibvirtDomains | None = None
        #: a command that runs once (every one but ``serve``, which sets this False: a
        #: libvirt daemon may start after the agent, and the agent then handles its domains)
        self.one_shot = True

    @classmethod
    def from_options(cls, given: dict[str, str | None]) -> Ctx:
        """From the global options as given (keys of vmpin.service.clispec.GLOBALS)."""
        return cls(Settings.from_env(given), given)

    def hook_options(self) -> dict[str, str]:
        """The options a hook run from this command line is given: the host roots, and the
        policy keys given here (the hook builds its Settings from them: nothing goes through
        the environment)."""
        from vmpin.service.settings import POLICY_KEYS

        given = {k: v for k, v in self._given.items() if k in POLICY_KEYS and v is not None}
        return {**self.paths._asdict(), **given}

    def store(self) -> Store:
        """The store for commands that write (update, reconcile, serve): created if missing."""
        from vmpin.state.store import Store

        return Store(self.paths.state_dir)

    def reader(self) -> Reader:
        """The store for read-only commands: never written.

        The node's state dir (the default one, or any that exists) holding nothing yet is a
        fresh node: the views show the host with nothing tracked, and one line on stderr says
        why.  A state dir named by hand that does not exist is an error (a typo must not read
        as an empty node)."""
        from vmpin.linux.paths import DEFAULTS
        from vmpin.state.store import Store

        where = self.paths.state_dir
        fresh = where == DEFAULTS["state_dir"] or os.path.isdir(where)
        store = Store.open_readonly(where, fresh=fresh)
        if store.fresh:
            print(
                f"vmpin: nothing recorded at {where} yet (no hook, update or pass has run on"
                " this node): showing the host alone; install the hooks (docs/hooks.md) or"
                " start the agent",
                file=sys.stderr,
            )
        return store

    def domains(self) -> LibvirtDomains | None:
        """The libvirt domains on the configured connections (None: libvirt is off, or, for a
        one-shot command, only the default connection is configured and no daemon serves it
        on this node).

        A one-shot command settles the daemon's absence here, before libvirt-python is
        imported (~17 ms, and its adapter ~20 ms more, for a read command that would find no
        domain anyway)."""
        uris = self.settings.libvirt_uris()
        if self._domains is None and uris:
            from vmpin.runtimes.libvirtd import wanted_uris

            if self.one_shot and not wanted_uris(uris):
                return None  # (before importing vmpin.reconcile.domains: threading, apply)
            from vmpin.reconcile.domains import LibvirtDomains

            self._domains = LibvirtDomains(self.paths, uris)
        return self._domains

    def reconciler(
        self,
        store: Reader | None = None,
        *,
        ingest_first: bool = True,
        hold_maps: bool = False,
        follow_hotplug: bool = False,
        deadline: float | None = None,
    ) -> Reconciler:
        """:func:`vmpin.service.settings.build_reconciler` for this command's settings (the
        options are the agent's: :class:`vmpin.service.agent_passes.ReconcilerFactory`)."""
        from vmpin.service.settings import build_reconciler

        return build_reconciler(
            self.settings,
            store or self.store(),
            domains=self.domains(),
            ingest_first=ingest_first,
            hold_maps=hold_maps,
            follow_hotplug=follow_hotplug,
            deadline=deadline,
        )


# -- printing -------------------------------------------------------------------------------
def echo(line: str = "") -> None:
    print(line)


def json_text(data: Any) -> str:
    """A ``--json`` view's text, as printed (the agent writes the views it answers with it)."""
    return jsonio.dumps(data, indent=2)


def emit(c: Ctx, data: Any, view: str, text: str | None = None) -> None:
    """Print a ``--json`` view (checked against its schema first under VMPIN_CHECK_VIEWS);
    ``text``: its text, written already (by the agent)."""
    if c.settings.check_views:
        from vmpin.wire.viewschema import check

        check(view, jsonio.loads(text) if data is None and text is not None else data)
    echo(json_text(data) if text is None else text)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [[("-" if v is None or v == "" else str(v)) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    echo("  ".join(h.upper().ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip())
    for r in cells:
        echo("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip())


# -- update ---------------------------------------------------------------------------------
def update(
    c: Ctx, container: str, cpuset_cpus: str | None, resources: str | None, as_json: bool
) -> int:
    from vmpin.service.budget import BUDGET
    from vmpin.service.update import update_container

    if (cpuset_cpus is None) == (resources is None):
        raise SpecError("give exactly one of --cpuset-cpus LIST or -r FILE|-")
    # no wait on another process past the budget (a stopped agent: vmpin.service.budget)
    deadline = time.monotonic() + BUDGET
    domain = _update_domain(c, container, cpuset_cpus, resources, deadline)
    if domain is not None:
        if as_json:
            emit(c, domain, "update")
        else:
            echo(f"{domain['id']}: cpus {domain['cpus'] or '-'} (libvirt domain metadata)")
        return 0
    result = update_container(
        c.paths,
        container,
        cpuset_cpus=cpuset_cpus,
        resources=resources,
        reconciler_factory=c.reconciler,
        deadline=deadline,
    )
    if as_json:
        emit(c, result, "update")
    else:
        echo(
            f"{result['id']}: cpus {result['cpus'] or '-'} "
            f"(sandbox {result['sandbox']}: {result['applied_by']})"
        )
    return 0


def _update_domain(
    c: Ctx, key: str, cpuset_cpus: str | None, resources: str | None, deadline: float
) -> dict[str, Any] | None:
    """`vmpin update DOMAIN`: the mask goes into the domain's metadata (its one home), then
    the node is re-planned.  None when ``key`` is a tracked container or no domain."""
    # (no journal applied here: a container only journaled is no domain either, and
    # update_container applies it)
    from vmpin.state.store import Store

    with Store(c.paths.state_dir, ingest=False, deadline=deadline) as store:
        if store.container(key) is not None:
            return None
        domains = c.domains()
        found = domains.find(key) if domains is not None else None
        if found is None:
            return None
        from vmpin.service.update import parse_update

        conn, d = found
        new = parse_update(cpuset_cpus, resources)
        if new is not None:  # resources without cpu.cpus: nothing for vmpin
            conn.set_mask(d.uuid, new)
        reports = c.reconciler(store, deadline=deadline).reconcile([d.uuid])
    errors = [e for r in reports for e in r.errors]
    if errors:
        raise StateError(f"domain {d.name}: {errors[0]}")
    return views.update(id=d.name, sandbox=d.uuid, cpus=cpus(new), applied_by="libvirt")


# -- read commands: observe and plan, nothing written ---------------------------------------
#: how long a read command waits for the agent's view before it observes the node itself (s):
#: a pass of its own at 2,000 sandboxes takes ~0.3-0.8 s, and one that repaired something is
#: followed by another
AGENT_VIEW_WAIT = 2.0
#: the oldest plan a read command takes from the agent (s): older, the agent runs a pass
AGENT_VIEW_AGE = 30.0


def agent_view(c: Ctx, view: str, sandbox: str | None = None) -> str | None:
    """The view's ``--json`` text as the running agent's plan shows it
    (vmpin.service.agent_views), the same bytes the command would print; None: no agent, an
    old one that does not know the request, a refusal (settings other than the agent's), a
    timeout -- the command observes itself.

    ``audit`` asks for a pass that starts after the request (drift since the last pass must be
    seen); the others for the current plan when nothing changed since it was made."""
    from vmpin.service.control import view as ask
    from vmpin.wire.control import View

    fresh = view == "audit"
    request = View(
        view,
        c.settings.view_key(),
        AGENT_VIEW_WAIT - 0.25,  # (the agent's refusal comes before the command gives up)
        sandbox,
        fresh,
        None if fresh else AGENT_VIEW_AGE,
    )
    got = ask(c.paths, request, AGENT_VIEW_WAIT)
    return None if got is None else got.text


def node_plan(c: Ctx, store: Reader, scope: Scope | None = None) -> NodePlan:
    """The node as the host shows it now (pure: observe and plan, nothing written), within
    ``scope``: what the view prints, read fresh, and nothing it does not (observe.Scope)."""
    plan: NodePlan = c.reconciler(store).plan(scope=scope)
    return plan


def view_scope(view: str, sandbox: str | None = None) -> Scope:
    """What each read view observes of the node (observe.Scope): what it prints, read fresh
    from the host, and not what it does not print (``tests/service/test_view_scopes.py``
    checks each view against the same view of a full observation).

    ``containers``: containers and their CPU sets' sources; no VMM, thread or guest map.
    ``sandboxes``: each VMM and its plan's mode, mask and vanishing, which need thread roles
    but not affinities or guest maps.  ``show``: only ``sandbox``'s threads, since the others'
    share in its plan is their masks and whether their VMMs run.  ``audit``: everything
    but guest maps (the invariant is on host threads).
    """
    from vmpin.reconcile.observe import FULL, Scope

    if view == "containers":
        return Scope(vmms=False, guest_maps=False)
    if view == "sandboxes":
        return Scope(affinity=False, guest_maps=False)
    if view == "show" and sandbox is not None:
        return Scope(threads=frozenset((sandbox,)))
    if view == "audit":
        return Scope(guest_maps=False)
    return FULL


def fresh_containers(plan: NodePlan) -> list[dict[str, Any]]:
    """Each tracked container with the CPU set its sources give it now; where that is not
    what the store holds, ``stored_cpus`` shows the store's and ``host_differs`` is true."""
    rows = []
    gone = set(plan.forget_containers)
    for sp in plan.sandboxes:
        if not sp.obs.tracked:
            continue
        fresh = {c.rec.id: c.rec for c in sp.containers}
        for c in sp.obs.containers:
            rec = fresh.get(c.rec.id, c.rec)
            # (a pod's allocation is the plan's, not news from the host: issue 30)
            differs = rec.cpus != c.rec.cpus and rec.cpus_source != "vmpin-alloc"
            rows.append(views.container(
                id=rec.id, sandbox=rec.sandbox_id, name=rec.name, cpus=cpus(rec.cpus),
                runtime=sp.runtime, is_sandbox=rec.is_sandbox, pod_uid=rec.pod_uid,
                pod_name=rec.pod_name, pod_namespace=rec.pod_namespace,
                cpus_source=rec.cpus_source, pid=rec.pid, stored_cpus=cpus(c.rec.cpus),
                host_differs=differs or c.rec.id in gone, gone=c.rec.id in gone,
            ))  # fmt: skip
    return rows


def reconcile(c: Ctx, once: bool, as_json: bool) -> int:
    """One repair pass: re-pin whatever differs from the plan, touch nothing already right."""
    if not once:
        raise SpecError("reconcile needs --once (the continuous loop is `vmpin serve`)")
    with c.store() as store:
        reports = c.reconciler(store).reconcile(apply=True)
    out: list[dict[str, Any]] = [
        views.reconcile_item(
            id=r.id,
            runtime=r.runtime,
            mode=r.mode,
            mask=r.mask.to_list(),
            repaired=r.changed + sum(1 for d in r.cgroup_drift if d.get("repaired")),
            vanished=r.vanished,
            errors=r.errors,
            threads=[t.to_json() for t in r.threads if t.action != "ok"],
        )
        for r in reports
    ]
    if as_json:
        emit(c, out, "reconcile")
    else:
        for o in out:
            state = "vanished" if o["vanished"] else f"{o['repaired']} repaired"
            echo(f"{o['id']}: {o['runtime']} {o['mode']} mask {o['mask'] or '-'}: {state}")
            for e in o["errors"]:
                echo(f"  error: {e}")
    return 1 if any(o["errors"] for o in out) else 0


def containers(c: Ctx, as_json: bool) -> int:
    text = agent_view(c, "containers")
    if text is not None and as_json:
        emit(c, None, "containers", text)
        return 0
    if text is not None:
        rows = jsonio.loads(text)
    else:
        with c.reader() as store:
            rows = fresh_containers(node_plan(c, store, view_scope("containers")))
    if as_json:
        emit(c, rows, "containers")
        return 0
    table(
        ["id", "sandbox", "name", "cpus", "runtime", "source"],
        [
            [
                r["id"],
                r["sandbox"],
                r["name"],
                (r["cpus"] or "-") + (" *" if r["host_differs"] else ""),
                r["runtime"],
                r["cpus_source"],
            ]
            for r in rows
        ],
    )
    if any(r["host_differs"] for r in rows):
        echo("* the host says otherwise than vmpin's store: the next pass adopts it")
    return 0


def _mask(sp: SandboxPlan) -> str:
    return CpuSet.union_all(c.rec.cpus for c in sp.containers if c.rec.cpus is not None).to_list()


def sandbox_rows(plan: NodePlan) -> list[dict[str, Any]]:
    """The ``sandboxes`` view of a plan: each tracked sandbox, its VMM, mask and mode."""
    out: list[dict[str, Any]] = []
    for sp in plan.sandboxes:
        s = sp.obs.record
        if s is None:
            continue
        stored = CpuSet.union_all(k.rec.cpus for k in sp.obs.containers if k.rec.cpus is not None)
        vmm = sp.obs.vmm
        mask = _mask(sp)
        out.append(
            views.sandbox(
                id=s.id,
                runtime=sp.runtime,
                vmm_pid=vmm.pid if vmm is not None else None,
                mask=sp.mask.to_list() if sp.runtime == "kata" and sp.plan else mask,
                containers=[
                    views.sandbox_container(
                        id=k.rec.id,
                        name=k.rec.name,
                        cpus=cpus(k.rec.cpus),
                        is_sandbox=k.rec.is_sandbox,
                    )
                    for k in sp.containers
                ],
                pod_uid=s.pod_uid,
                pod_name=s.pod_name,
                pod_namespace=s.pod_namespace,
                dirty=s.dirty,
                mode=sp.mode,
                stored_mask=stored.to_list(),
                host_differs=mask != stored.to_list()
                or sp.vanished
                or (vmm.pid if vmm else None) != (s.vmm_pid if s.vmm_start is not None else None),
                vanished=sp.vanished,
            )
        )
    return out


def sandboxes(c: Ctx, as_json: bool) -> int:
    text = agent_view(c, "sandboxes")
    if text is not None and as_json:
        emit(c, None, "sandboxes", text)
        return 0
    if text is not None:
        out = jsonio.loads(text)
    else:
        with c.reader() as store:
            out = sandbox_rows(node_plan(c, store, view_scope("sandboxes")))
    if as_json:
        emit(c, out, "sandboxes")
        return 0
    table(
        ["id", "runtime", "vmm_pid", "mask", "containers"],
        [
            [
                s["id"],
                s["runtime"] + (" *" if s["host_differs"] else ""),
                s["vmm_pid"],
                s["mask"],
                len(s["containers"]),
            ]
            for s in out
        ],
    )
    if any(s["host_differs"] for s in out):
        echo("* the host says otherwise than vmpin's store: the next pass adopts it")
    return 0


def show_json(r: SandboxReport) -> dict[str, Any]:
    return views.show(
        id=r.id,
        runtime=r.runtime,
        vmm_pid=r.vmm_pid,
        mask=r.mask.to_list(),
        mode=r.mode,
        reason=r.reason,
        layers=r.layers,
        threads=[t.to_json() for t in r.threads],
        guest_map=r.guest_map,
        policy=r.policy_json(),
        containers=[views.show_container(id=k.id, name=k.name, cpus=cpus(k.cpus))
                    for k in r.containers],
        notes=r.notes,
        errors=r.errors,
    )


def domain_report(c: Ctx, store: Reader, key: str) -> SandboxReport | None:
    """The report of the libvirt domain named or identified by ``key`` (nothing applied)."""
    domains = c.domains()
    found = domains.find(key) if domains is not None else None
    if found is None:
        return None
    reports: list[SandboxReport] = c.reconciler(store).reconcile([found[1].uuid], apply=False)
    return reports[0] if reports else None


def _one(c: Ctx, sandbox: str) -> SandboxReport:
    with c.reader() as store:
        rec = store.sandbox(sandbox)
        if rec is None:
            domain = domain_report(c, store, sandbox)
            if domain is not None:
                return domain
            raise StateError(f"unknown sandbox {sandbox!r} (see `vmpin sandboxes`)")
        report: SandboxReport = c.reconciler(store).reconcile_sandbox(
            rec, apply=False, scope=view_scope("show", rec.id)
        )
        return report


_POLICY_SOURCES = {
    "node": "the node's settings",
    "oci": "the pod's annotations in its containers' specs",
    "api": "the pod's annotations in the Kubernetes API",
}


def show(c: Ctx, sandbox: str, as_json: bool) -> int:
    text = agent_view(c, "show", sandbox)
    if text is not None and as_json:
        emit(c, None, "show", text)
        return 0
    r = jsonio.loads(text) if text is not None else show_json(_one(c, sandbox))
    if as_json:
        emit(c, r, "show")
        return 0
    echo(f"sandbox {r['id']}  runtime {r['runtime']}  vmm {r['vmm_pid'] or '-'}  "
         f"mask {r['mask'] or '-'}")  # fmt: skip
    echo(f"plan    {r['mode']}: {r['reason']}")
    pol = r["policy"]
    if pol is not None:
        settings = ", ".join(
            f"{k} {pol[k]}" for k in ("vcpus", "helpers", "guest", "cpuset") if pol[k]
        )
        since = ""
        if pol["recorded_at"] is not None:
            since = time.strftime(" %Y-%m-%dT%H:%M:%SZ", time.gmtime(pol["recorded_at"]))
        echo(f"policy  {settings} (from {_POLICY_SOURCES[pol['source']]}{since})")
        for problem in pol["problems"]:
            echo(f"        {problem}")
    if r["layers"]:
        echo(f"threads classified by: {', '.join(r['layers'])}")
    table(
        ["tid", "role", "index", "name", "desired", "actual", "state"],
        [
            [t["tid"], t["role"], t["index"], t["name"], t["desired"], t["actual"], t["action"]]
            for t in r["threads"]
        ],
    )
    if r["guest_map"]:
        for cid, m in r["guest_map"]["containers"].items():
            echo(
                f"guest   {cid}: host {m['host_cpus'] or '-'} -> vCPUs {m['guest_cpus']}"
                f"{'' if m['exact'] else ' (not exact: ' + m['reason'] + ')'}"
            )
    for n in r["notes"] + r["errors"]:
        echo(f"note    {n}")
    return 0


def audit(c: Ctx, as_json: bool) -> int:
    text = agent_view(c, "audit")
    if text is not None:
        result = jsonio.loads(text)  # (its exit code is its "ok")
    else:
        with c.reader() as store:
            result = c.reconciler(store).audit(view_scope("audit"))
    if as_json:
        emit(c, result, "audit", text)
    else:
        for v in result["violations"]:
            echo(
                f"VIOLATION {v['kind']} sandbox {v['sandbox'] or '-'} tid {v['tid'] or '-'}"
                f" {v['role'] or '-'}: desired {v['desired']} actual {v['actual']} ({v['reason']})"
            )
        for e in result["errors"]:
            echo(f"error     {e}")
        for n in result["notes"]:
            echo(f"note      {n}")
        echo(
            f"{'ok' if result['ok'] else 'FAIL'}: {result['sandboxes']} sandboxes, "
            f"{result['threads']} threads, {len(result['violations'])} violations"
        )
    return 0 if result["ok"] else 1


# -- the agent --------------------------------------------------------------------------------
def serve(
    c: Ctx,
    interval: float,
    workers: int,
    metrics_port: int,
    kubeconfig: str | None,
    node_name: str | None,
    metrics_address: str | None = None,
) -> int:
    """Run the node agent (:func:`vmpin.service.agent.serve`) until SIGTERM / SIGINT."""
    from vmpin.service.agent import serve as serve_agent

    c.one_shot = False  # a libvirt daemon that starts later is the agent's to handle
    code: int = serve_agent(c, interval=interval, workers=workers, metrics_port=metrics_port,
                            metrics_address=metrics_address or "127.0.0.1",
                            kubeconfig=kubeconfig, node_name=node_name)  # fmt: skip
    return code


# -- the other commands -----------------------------------------------------------------------
def hook(c: Ctx, stage: str, strict: bool) -> int:
    """``vmpin hook`` behind a global option that is no host root (``vmpin.entry`` runs the
    usual hook itself, leaner): the policy given here goes to the hook as an option."""
    from vmpin.service.hook import main as hook_main

    code: int = hook_main(c.hook_options(), [stage] + (["--strict"] if strict else []))
    return code


def guest_map(c: Ctx, container: str, as_json: bool) -> int:
    with c.reader() as store:
        k = store.container(container)
        if k is None:
            domain = domain_report(c, store, container)
            if domain is not None and domain.guest_map is not None:
                (entry,) = domain.guest_map["containers"].values()
                _print_guest_map(c, entry, as_json)
                return 0
            raise StateError(f"unknown container {container!r} (see `vmpin containers`)")
        sb = store.sandbox(k.sandbox_id)
        if sb is None:
            raise StateError(f"container {container!r}: sandbox {k.sandbox_id!r} is not tracked")
        r = c.reconciler(store).reconcile_sandbox(sb, apply=False)
    entry = (r.guest_map or {}).get("containers", {}).get(container)
    if entry is None:
        entry = views.guest_map(
            container=container,
            sandbox=k.sandbox_id,
            host_cpus=cpus(k.cpus),
            guest_cpus=None,
            exact=False,
            mode=r.mode,
            reason="no guest map: "
            + ("a plain container runs in no VM" if r.runtime != "kata" else "no VMM/plan yet"),
        )
    _print_guest_map(c, entry, as_json)
    return 0


def _print_guest_map(c: Ctx, out: dict[str, Any], as_json: bool) -> None:
    if as_json:
        emit(c, out, "guest-map")
    else:
        echo(
            f"{out['container']} (sandbox {out['sandbox']}): host CPUs "
            f"{out['host_cpus'] or '-'} -> guest vCPUs {out['guest_cpus'] or '-'}"
            f"{'' if out['exact'] else '  [' + out['reason'] + ']'}"
        )


def topology(c: Ctx, as_json: bool) -> int:
    from vmpin.linux.sysfs import read_topology

    data = views.topology_of(read_topology(c.paths.sys))
    if as_json:
        emit(c, data, "topology")
        return 0
    echo(
        f"online {data['online']}  offline {data['offline'] or '-'}  "
        f"isolated {data['isolated'] or '-'}"
    )
    echo(
        f"sockets {data['sockets']}  numa nodes {data['numa_nodes']}  cores "
        f"{data['cores']}  threads/core {data['threads_per_core']}  "
        f"L3 groups {data['l3_groups']}"
    )
    echo(f"order  {','.join(map(str, data['order']))}")
    table(
        ["cpu", "core", "socket", "numa", "l3", "siblings"],
        [
            [k["cpu"], k["core"], k["socket"], k["numa"], k["l3"], k["siblings"]]
            for k in data["cpus"]
        ],
    )
    return 0


def demo(c: Ctx) -> int:
    from vmpin.service.demo import main as run_demo

    code: int = run_demo()
    return code


def explain(c: Ctx, what: str, as_json: bool) -> int:
    from vmpin.reconcile.explain import explain as explain_what

    with c.reader() as store:
        reconciler = c.reconciler(store)
        out = explain_what(reconciler.plan(), reconciler.topology, what)
    if as_json:
        emit(c, out, "explain")
    else:
        _print_explained(out)
    return 0


def _print_explained(out: dict[str, Any]) -> None:
    if "cpu" in out:
        c = out["cpu"]
        flags = [] if c["online"] else ["offline"]
        flags += ["isolated"] if c["isolated"] else []
        echo(f"CPU {c['cpu']}  socket {c['socket']}  core {c['core']}  siblings {c['siblings']}"
             + (f"  ({', '.join(flags)})" if flags else ""))  # fmt: skip
        echo(f"kubelet: {c['kubelet']['rule']}")
        if not c["claimants"]:
            echo("no sandbox, container or thread vmpin knows of is on it")
        for x in c["claimants"]:
            who = x["sandbox"] if x["kind"] == "sandbox" else f"{x['sandbox']} tid {x['tid']}"
            echo(f"  {x['kind']:<8} {who}: {x['rule']}")
        return
    if "container" in out:
        c = out["container"]
        echo(f"container {c['container']} ({c['name'] or '-'}) in sandbox {c['sandbox']}"
             f" [{c['runtime']}]: CPUs {c['cpus'] or '-'}")  # fmt: skip
        echo(f"  why: {c['rule']}")
        echo(f"  kubelet says {c['kubelet'] or '-'}, runc {c['runc'] or '-'},"
             f" cgroup {c['cgroup'] or '-'}, guest vCPUs {c['guest_cpus'] or '-'}")  # fmt: skip
        return
    p = out["pod"]
    pod = p["pod"]
    echo(f"pod {pod['namespace'] or '-'}/{pod['name'] or '-'} (uid {pod['uid'] or '-'}):"
         f" sandbox {p['sandbox']} [{p['runtime']}], mask {p['mask'] or '-'}")  # fmt: skip
    echo(f"  plan {p['mode']}: {p['reason']}")
    pol = p["policy"]
    echo(f"  policy vcpus {pol['vcpus']}, helpers {pol['helpers']} (from {pol['source']})")
    for c in p["containers"]:
        echo(f"  container {c['name'] or c['id']}: {c['cpus'] or '-'}  ({c['rule']})")
    for t in p["threads"]:
        echo(f"  tid {t['tid']} {t['role']}: {t['desired'] or '-'} (now {t['actual'] or '-'})"
             f"  {t['rule']}")  # fmt: skip


def schema(c: Ctx, command: str | None) -> int:
    import json

    from vmpin.wire.views import VIEWS
    from vmpin.wire.viewschema import schema as view_schema

    if command is None:
        data: Any = {name: view_schema(name) for name in VIEWS}
    elif command not in VIEWS:
        raise SpecError(f"no --json view for {command!r} (one of: {', '.join(VIEWS)})")
    else:
        data = view_schema(command)
    echo(json.dumps(data, indent=2, sort_keys=False))
    return 0


def cluster(c: Ctx, kubeconfig: str | None, as_json: bool) -> int:
    from vmpin.core.errors import KubeError
    from vmpin.reconcile.clusterview import cluster_rows
    from vmpin.runtimes import kubeapi

    api = kubeapi.connect(kubeconfig)
    if api is None:
        raise KubeError("no Kubernetes API credentials (in-cluster, --kubeconfig or $KUBECONFIG)")
    rows = cluster_rows(kubeapi.list_reports(api), time.time())
    if as_json:
        emit(c, rows, "cluster")
    else:
        table(
            ["NODE", "STATE", "SANDBOXES", "VIOLATIONS", "CONFLICTS", "EXCLUSIVE", "HEARTBEAT"],
            [[r["node"], r["state"], r["sandboxes"], r["violations"], r["conflicts"],
              r["exclusive_cpus"],
              None if r["heartbeat_age"] is None else f"{r['heartbeat_age']:.0f}s ago"]
             for r in rows],
        )  # fmt: skip
        for r in rows:
            for conflict in r["conflict_list"]:
                echo(f"{r['node']}: conflict: {conflict}")
    return 0 if all(r["state"] == "clean" for r in rows) else 1


def status(c: Ctx, as_json: bool) -> int:
    from vmpin.service.control import request
    from vmpin.state import journal

    reply = request(c.paths, {"op": "status"}, timeout=2.0)
    out = reply or views.status(
        ok=False,
        error=f"no agent answering on {c.paths.control_socket}",
        journal_pending=journal.backlog(c.paths.state_dir),
        journal_bad=journal.quarantined(c.paths.state_dir),
    )
    if as_json:
        emit(c, out, "status")
    elif reply:
        echo(" ".join(f"{k}={v}" for k, v in reply.items()))
    else:
        echo(out["error"])
        echo(f"journal_pending={out['journal_pending']} journal_bad={out['journal_bad']}")
    return 0 if reply and reply.get("ok") else 1


def doctor(c: Ctx, dry_run: bool) -> int:
    from vmpin.service.doctor import doctor as run_doctor

    ok, lines = run_doctor(c.paths, repair=not dry_run)
    for line in lines:
        echo(line)
    return 0 if ok else 1


def _command(value: str | None) -> list[str] | None:
    """A command line option: None = the default, "none" = [] (do not run one)."""
    import shlex

    if value is None:
        return None
    return [] if value.strip() == "none" else shlex.split(value)


def _print_report(report: Any) -> int:
    for line in report.lines:
        echo(line)
    sys.stdout.flush()  # (before the warnings, as the lines came first)
    for line in report.warnings:
        print(f"warning: {line}", file=sys.stderr)
    return 0


def install(
    c: Ctx, root: str, prefix: str, runtime: str, env: list[str] | None, hooks_dir: str,
    containerd_config: str, python: str | None, ctr: str | None,
) -> int:  # fmt: skip
    from vmpin.service.install import Options
    from vmpin.service.install import install as run_install

    opts = Options(
        prefix=prefix,
        runtimes=tuple(r.strip() for r in runtime.split(",") if r.strip()),
        env=tuple(env or ()),
        hooks_dir=hooks_dir,
        containerd_config=containerd_config,
        python=_command(python),
        ctr=_command(ctr),
    )
    return _print_report(run_install(root, opts))


def uninstall(c: Ctx, root: str, prefix: str) -> int:
    from vmpin.service.install import uninstall as run_uninstall

    return _print_report(run_uninstall(root, prefix))


#: each command's body, by its name in vmpin.service.clispec.COMMANDS (the guest's own
#: commands but: vmpin.entry runs them, vmpin.guest's)
BODIES: dict[str, Callable[..., int]] = {
    "hook": hook, "update": update, "containers": containers, "sandboxes": sandboxes,
    "show": show, "guest-map": guest_map, "topology": topology, "audit": audit, "demo": demo,
    "explain": explain, "reconcile": reconcile, "schema": schema, "serve": serve,
    "cluster": cluster, "status": status, "doctor": doctor, "install": install,
    "uninstall": uninstall,
}  # fmt: skip


# -- running one ------------------------------------------------------------------------------
def run(given: dict[str, str], name: str, values: dict[str, Any]) -> int:
    """Run command ``name`` (a key of :data:`BODIES`, or ``--version``) with the global
    options ``given`` and its values, as parsed; its exit code.

    The one place a command's errors become a message and a code: a VmpinError -- bad input
    or state -- is one line on stderr and the error's code (2); a database failure under a
    command, one line naming the store, and 2; an interrupt, 130; a reader that went away
    (a closed pipe), 1 and nothing more said.
    """
    if name == "--version":
        from vmpin import __version__

        echo(f"vmpin {__version__}")
        return 0
    try:
        try:
            return BODIES[name](Ctx.from_options(dict(given)), **values)
        except VmpinError as e:
            print(f"vmpin: error: {e}", file=sys.stderr)
            return e.exit_code
        except Exception as e:
            # (SQLite is loaded by whoever opened the store: a read answered by the agent,
            # or --version, does not load it for this clause)
            from vmpin.state.sqlite import sqlite3  # (without the package's, nor functools')

            if not isinstance(e, sqlite3.Error):
                raise
            # the database failed under a command: one line
            from vmpin.state.schema import state_error

            # the store the command used: the global option when given, else as Settings says
            state_dir = Settings.from_env({"state_dir": given.get("state_dir")}).paths.state_dir
            print(f"vmpin: error: {state_error(os.path.join(state_dir, 'state.db'), e)}",
                  file=sys.stderr)  # fmt: skip
            return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # nothing more to say, and no second error when Python flushes stdout at exit
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
