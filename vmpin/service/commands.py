"""The hot commands' bodies -- ``update``, ``containers``, ``sandboxes``, ``show``, ``audit``,
``serve`` --
and the one place a command's error becomes a message and an exit code.

Free of typer and pydantic, so that two routes run the same code (issue 14): the typer app
(:mod:`vmpin.cli`, whose commands call these and whose ``--help`` explains them), and the
fast route :func:`fast`, which :mod:`vmpin.entry` takes when argv is plainly one of these
commands (parsed with :mod:`vmpin.service.clispec`, the table the typer app is declared
from).  Each body prints and returns its exit code; output, error lines and exit codes are
therefore the same whichever route ran it (``tests/service/test_cli.py`` compares them).

``--json`` views are checked against their pydantic models (:mod:`vmpin.reconcile.views`)
only when ``VMPIN_CHECK_VIEWS`` is set -- the tests set it for every vmpin they start --
because importing pydantic would cost a read command four bare interpreters.
"""

from __future__ import annotations

import os
import sys
import time

from vmpin.core.cpuset import CpuSet
from vmpin.core.cpuset import listed as cpus
from vmpin.core.errors import SpecError, StateError, VmpinError
from vmpin.service.settings import Settings
from vmpin.state.reader import Reader
from vmpin.state.records import ContainerRec
from vmpin.state.sqlite import sqlite3  # (without the package's imports, nor functools')
from vmpin.state.store import Store
from vmpin.wire import jsonio

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.core._lean)

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from typing import Any

    from vmpin.reconcile.domains import LibvirtDomains
    from vmpin.reconcile.observe import Scope
    from vmpin.reconcile.plan import NodePlan, SandboxPlan
    from vmpin.reconcile.reconciler import Reconciler, SandboxReport

#: set (to anything but "" or "0") to validate every --json view against its model first
CHECK_VIEWS = "VMPIN_CHECK_VIEWS"


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
        return Store(self.paths.state_dir)

    def reader(self) -> Reader:
        """The store for read-only commands: never written.

        The node's state dir (the default one, or any that exists) holding nothing yet is a
        fresh node: the views show the host with nothing tracked, and one line on stderr says
        why.  A state dir named by hand that does not exist is an error (a typo must not read
        as an empty node)."""
        from vmpin.linux.paths import DEFAULTS

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


def emit(data: Any, view: str) -> None:
    """Print a ``--json`` view (checked against its schema first under VMPIN_CHECK_VIEWS)."""
    if os.environ.get(CHECK_VIEWS, "") not in ("", "0"):
        from vmpin.reconcile.views import check

        check(view, data)
    echo(jsonio.dumps(data, indent=2))


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [[("-" if v is None or v == "" else str(v)) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    echo("  ".join(h.upper().ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip())
    for r in cells:
        echo("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip())


def container_json(c: ContainerRec, runtime: str | None) -> dict[str, Any]:
    return {
        "id": c.id,
        "sandbox": c.sandbox_id,
        "name": c.name,
        "cpus": cpus(c.cpus),
        "runtime": runtime,
        "is_sandbox": c.is_sandbox,
        "pod_uid": c.pod_uid,
        "pod_name": c.pod_name,
        "pod_namespace": c.pod_namespace,
        "cpus_source": c.cpus_source,
        "pid": c.pid,
    }


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
            emit(domain, "update")
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
        emit(result, "update")
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
    return {"id": d.name, "sandbox": d.uuid, "cpus": cpus(new), "applied_by": "libvirt"}


# -- read commands: observe and plan, nothing written ---------------------------------------
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
            row = container_json(rec, sp.runtime)
            row["stored_cpus"] = cpus(c.rec.cpus)
            # (a pod's allocation is the plan's, not news from the host: issue 30)
            differs = rec.cpus != c.rec.cpus and rec.cpus_source != "vmpin-alloc"
            row["host_differs"] = differs or c.rec.id in gone
            row["gone"] = c.rec.id in gone
            rows.append(row)
    return rows


def reconcile(c: Ctx, once: bool, as_json: bool) -> int:
    """One repair pass: re-pin whatever differs from the plan, touch nothing already right."""
    if not once:
        raise SpecError("reconcile needs --once (the continuous loop is `vmpin serve`)")
    with c.store() as store:
        reports = c.reconciler(store).reconcile(apply=True)
    out: list[dict[str, Any]] = [
        {
            "id": r.id,
            "runtime": r.runtime,
            "mode": r.mode,
            "mask": r.mask.to_list(),
            "repaired": r.changed + sum(1 for d in r.cgroup_drift if d.get("repaired")),
            "vanished": r.vanished,
            "errors": r.errors,
            "threads": [t.to_json() for t in r.threads if t.action != "ok"],
        }
        for r in reports
    ]
    if as_json:
        emit(out, "reconcile")
    else:
        for o in out:
            state = "vanished" if o["vanished"] else f"{o['repaired']} repaired"
            echo(f"{o['id']}: {o['runtime']} {o['mode']} mask {o['mask'] or '-'}: {state}")
            for e in o["errors"]:
                echo(f"  error: {e}")
    return 1 if any(o["errors"] for o in out) else 0


def containers(c: Ctx, as_json: bool) -> int:
    with c.reader() as store:
        rows = fresh_containers(node_plan(c, store, view_scope("containers")))
    if as_json:
        emit(rows, "containers")
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
            {
                "id": s.id,
                "runtime": sp.runtime,
                "vmm_pid": vmm.pid if vmm is not None else None,
                "mask": sp.mask.to_list() if sp.runtime == "kata" and sp.plan else mask,
                "containers": [
                    {
                        "id": k.rec.id,
                        "name": k.rec.name,
                        "cpus": cpus(k.rec.cpus),
                        "is_sandbox": k.rec.is_sandbox,
                    }
                    for k in sp.containers
                ],
                "pod_uid": s.pod_uid,
                "pod_name": s.pod_name,
                "pod_namespace": s.pod_namespace,
                "dirty": s.dirty,
                "mode": sp.mode,
                "stored_mask": stored.to_list(),
                "host_differs": mask != stored.to_list()
                or sp.vanished
                or (vmm.pid if vmm else None) != (s.vmm_pid if s.vmm_start is not None else None),
                "vanished": sp.vanished,
            }
        )
    return out


def sandboxes(c: Ctx, as_json: bool) -> int:
    with c.reader() as store:
        out = sandbox_rows(node_plan(c, store, view_scope("sandboxes")))
    if as_json:
        emit(out, "sandboxes")
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
    return {
        "id": r.id,
        "runtime": r.runtime,
        "vmm_pid": r.vmm_pid,
        "mask": r.mask.to_list(),
        "mode": r.mode,
        "reason": r.reason,
        "layers": r.layers,
        "threads": [t.to_json() for t in r.threads],
        "guest_map": r.guest_map,
        "policy": r.policy_json(),
        "containers": [{"id": k.id, "name": k.name, "cpus": cpus(k.cpus)} for k in r.containers],
        "notes": r.notes,
        "errors": r.errors,
    }


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
    r = _one(c, sandbox)
    if as_json:
        emit(show_json(r), "show")
        return 0
    echo(
        f"sandbox {r.id}  runtime {r.runtime}  vmm {r.vmm_pid or '-'}  "
        f"mask {r.mask.to_list() or '-'}"
    )
    echo(f"plan    {r.mode}: {r.reason}")
    pol = r.policy_json()
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
    if r.layers:
        echo(f"threads classified by: {', '.join(r.layers)}")
    table(
        ["tid", "role", "index", "name", "desired", "actual", "state"],
        [
            [t.tid, t.role, t.index, t.name, cpus(t.desired), cpus(t.actual), t.action]
            for t in r.threads
        ],
    )
    if r.guest_map:
        for cid, m in r.guest_map["containers"].items():
            echo(
                f"guest   {cid}: host {m['host_cpus'] or '-'} -> vCPUs {m['guest_cpus']}"
                f"{'' if m['exact'] else ' (not exact: ' + m['reason'] + ')'}"
            )
    for n in r.notes + r.errors:
        echo(f"note    {n}")
    return 0


def audit(c: Ctx, as_json: bool) -> int:
    with c.reader() as store:
        result = c.reconciler(store).audit(view_scope("audit"))
    if as_json:
        emit(result, "audit")
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
    """Run the node agent (:func:`vmpin.service.agent.serve`) until SIGTERM / SIGINT.

    On the fast route too (issue 14): typer and pydantic are ~7 MB of the agent's RSS, kept
    for its whole life, for parsing five options once."""
    from vmpin.service.agent import serve as serve_agent
    from vmpin.service.clispec import KUBECONFIG, METRICS_ADDRESS, NODE_NAME

    c.one_shot = False  # a libvirt daemon that starts later is the agent's to handle
    env = os.environ
    # what typer reads from the environment for an option not given (an empty one is none)
    kubeconfig = kubeconfig or env.get(KUBECONFIG.envvar or "") or None
    node_name = node_name or env.get(NODE_NAME.envvar or "") or None
    address = metrics_address or env.get(METRICS_ADDRESS.envvar or "") or "127.0.0.1"
    code: int = serve_agent(c, interval=interval, workers=workers, metrics_port=metrics_port,
                            metrics_address=address, kubeconfig=kubeconfig,
                            node_name=node_name)  # fmt: skip
    return code


# -- the two routes -------------------------------------------------------------------------
def guard(args: list[str], call: Callable[[], int]) -> int:
    """Run a command; the one place its errors become a message and an exit code.

    A VmpinError -- bad input or state -- becomes one line on stderr and the error's code
    (2); a database failure under a command, one line naming the store, and 2.
    """
    try:
        return call()
    except VmpinError as e:
        print(f"vmpin: error: {e}", file=sys.stderr)
        return e.exit_code
    except sqlite3.Error as e:  # the database failed under a command: one line, no traceback
        from vmpin.service.clispec import split_globals
        from vmpin.state.schema import state_error

        # the store the command used: the global option when given, else as Settings says
        split = split_globals(args)
        given = {"state_dir": split[0].get("state_dir")} if split is not None else {}
        state_dir = Settings.from_env(given).paths.state_dir
        print(f"vmpin: error: {state_error(os.path.join(state_dir, 'state.db'), e)}",
              file=sys.stderr)
        return 2


def dispatch(c: Ctx, name: str, values: dict[str, Any]) -> int:
    """Run the body of command ``name`` (a key of clispec.FAST) with its parsed values."""
    return BODIES[name](c, **values)


#: the body of each command of clispec.FAST (the typer app's commands call the same)
BODIES: dict[str, Callable[..., int]] = {
    "update": update, "reconcile": reconcile, "containers": containers,
    "sandboxes": sandboxes, "show": show, "audit": audit, "serve": serve,
}


def fast(args: list[str], given: dict[str, str], name: str, values: dict[str, Any]) -> int:
    """The fast route: argv already parsed by clispec.parse; what typer's standalone mode
    would do with an interrupt (exit 130) or a closed stdout (exit 1), done here too."""
    try:
        return guard(args, lambda: dispatch(Ctx.from_options(dict(given)), name, values))
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # as click does: nothing more to say, and no second error when Python flushes stdout
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
