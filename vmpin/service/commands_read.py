"""The read commands' bodies: ``containers``, ``sandboxes``, ``show``, ``guest-map``,
``topology``, ``audit``, ``explain`` -- observe and plan, nothing written -- and the views'
builders the agent answers with (vmpin.service.agent_views).

Each asks the running agent for its view first (:func:`agent_view`), then observes the node
itself within the view's scope (:func:`view_scope`).
"""

from __future__ import annotations

import time

from vmpin.core.cpuset import CpuSet
from vmpin.core.cpuset import listed as cpus
from vmpin.core.errors import StateError
from vmpin.service.commands import Ctx, echo, emit, table
from vmpin.wire import jsonio, views

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.lean.records)
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    from vmpin.reconcile.observe import Scope
    from vmpin.reconcile.plan import NodePlan, SandboxPlan
    from vmpin.reconcile.reconciler import SandboxReport
    from vmpin.state.reader import Reader


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

    ``audit`` asks for a fresh answer (drift since the last pass must be seen: the agent
    checks in place what can move behind its back, and takes a pass that starts after the
    request when anything did); the others for the current plan when nothing changed since
    it was made."""
    # (here: topology and explain never ask)
    from vmpin.service.control import view as ask
    from vmpin.wire.control_commands import View

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
    # (here: a view the agent answers loads neither the observer nor the store)
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


def node_rows(c: Ctx, view: str, as_json: bool, build: Callable[[NodePlan], Any]) -> Any:
    """A node-wide view's rows: the agent's when it answers, else ``build`` over a plan of
    this process's; None once printed as ``--json`` (the agent's text as it sent it)."""
    text = agent_view(c, view)
    if text is not None and as_json:
        emit(c, None, view, text)
        return None
    if text is not None:
        return jsonio.loads(text)
    with c.reader() as store:
        rows = build(node_plan(c, store, view_scope(view)))
    if as_json:
        emit(c, rows, view)
        return None
    return rows


def containers(c: Ctx, as_json: bool) -> int:
    rows = node_rows(c, "containers", as_json, fresh_containers)
    if rows is None:
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
    out = node_rows(c, "sandboxes", as_json, sandbox_rows)
    if out is None:
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
        from vmpin.reconcile.reconciler import view_sandbox

        return view_sandbox(c.reconciler(store), rec, view_scope("show", rec.id))


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
        from vmpin.reconcile.reconciler import view_sandbox

        r = view_sandbox(c.reconciler(store), sb)
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
