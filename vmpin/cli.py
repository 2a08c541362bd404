"""The ``vmpin`` command line: parse options, call the reconciler or the store, print.

Each command is a few lines; tables are for people, ``--json`` for scripts (keys as in
DESIGN.md, CPU lists always in Linux list format).  :func:`run` is the one place a
``VmpinError`` becomes a one-line message and an exit code (2 for bad input or state, 1 for
"audit found violations" / "agent not answering").
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from vmpin import __version__
from vmpin.core.cpuset import CpuSet
from vmpin.core.errors import SpecError, StateError, VmpinError
from vmpin.reconcile.plan import NodePlan, SandboxPlan
from vmpin.reconcile.reconciler import Reconciler, SandboxReport
from vmpin.service.settings import Settings
from vmpin.state.store import ContainerRec, Store

if TYPE_CHECKING:
    from vmpin.reconcile.domains import LibvirtDomains

app = typer.Typer(
    name="vmpin",
    help="Pin Kata sandboxes' QEMU threads and plain containers to the CPUs kubelet gave them.\n\n"
    "Global options must come before the command, e.g. `vmpin --state-dir /tmp/s containers`.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
guest_app = typer.Typer(help="Guest side: run inside the VM from Kata's guest_hook_path.")
app.add_typer(guest_app, name="guest")

JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON for scripts instead of a table.")]
KubeconfigOpt = Annotated[
    Optional[str],
    typer.Option(envvar="VMPIN_KUBECONFIG",
                 help="kubeconfig for the Kubernetes API (default: in-cluster, $KUBECONFIG)."),
]


class Ctx:
    """What every command gets: the one Settings value, and the one factory built from it."""

    def __init__(self, settings: Settings, given: dict[str, str | None] | None = None) -> None:
        self.settings = settings
        self.paths = settings.paths
        self._given = given or {}
        self._domains: LibvirtDomains | None = None

    def export_policy(self) -> None:
        """Put policy options given on the command line where in-process hooks read them."""
        from vmpin.service.settings import ENV

        for key in ("helpers", "housekeeping", "vcpus", "guest_float"):
            value = self._given.get(key)
            if value is not None:
                os.environ[ENV[key]] = value

    def store(self) -> Store:
        """The store for commands that write (update, reconcile, serve): created if missing."""
        return Store(self.paths.state_dir)

    def reader(self) -> Store:
        """The store for read-only commands: never written; missing state is an error."""
        return Store.open_readonly(self.paths.state_dir)

    def domains(self) -> LibvirtDomains | None:
        """The libvirt domains on the configured connections (None: libvirt is off)."""
        uris = self.settings.libvirt_uris()
        if self._domains is None and uris:
            from vmpin.reconcile.domains import LibvirtDomains

            self._domains = LibvirtDomains(self.paths, uris)
        return self._domains

    def reconciler(self, store: Store | None = None) -> Reconciler:
        from vmpin.service.settings import build_reconciler

        return build_reconciler(self.settings, store or self.store(), domains=self.domains())


def _version(value: bool) -> None:
    if value:
        typer.echo(f"vmpin {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    ctx: typer.Context,
    state_dir: Annotated[
        Optional[str],
        typer.Option(help="Where vmpin keeps its SQLite state. [env: VMPIN_STATE_DIR]"),
    ] = None,
    vm_dir: Annotated[
        Optional[str],
        typer.Option(help="Kata's VM dir: <vm-dir>/<sandbox>/{pid,qmp.sock}. [env: VMPIN_VM_DIR]"),
    ] = None,
    proc_root: Annotated[
        Optional[str], typer.Option(help="procfs root. [env: VMPIN_PROC_ROOT]")
    ] = None,
    sysfs_root: Annotated[
        Optional[str], typer.Option(help="sysfs root. [env: VMPIN_SYSFS_ROOT]")
    ] = None,
    cgroup_root: Annotated[
        Optional[str], typer.Option(help="cgroup filesystem root. [env: VMPIN_CGROUP_ROOT]")
    ] = None,
    runc_root: Annotated[
        Optional[str],
        typer.Option(
            help="runc's state roots (runc --root), ':'-separated; DIR/* = every directory in"
            " DIR. Default /run/runc:/run/containerd/runc/* (containerd: one root per"
            " namespace). [env: VMPIN_RUNC_ROOT]"
        ),
    ] = None,
    kubelet_state: Annotated[
        Optional[str],
        typer.Option(help="kubelet's cpu_manager_state (read only). [env: VMPIN_KUBELET_STATE]"),
    ] = None,
    publish_dir: Annotated[
        Optional[str],
        typer.Option(
            help="[env: VMPIN_PUBLISH_DIR] "
            "Host dir shared with each guest, where guest maps are published"
            " (<dir>/<sandbox>/mounts/vmpin/guest-map.json; may hold a {sandbox} template).",
        ),
    ] = None,
    helper_policy: Annotated[
        Optional[str],
        typer.Option(
            help="[env: VMPIN_HELPER_POLICY] "
            "Emulator/iothread/vhost placement: share (the sandbox mask), isolate, none.",
        ),
    ] = None,
    housekeeping: Annotated[
        Optional[str],
        typer.Option(help="CPU list for helper threads under 'isolate'. [env: VMPIN_HOUSEKEEPING]"),
    ] = None,
    vcpu_policy: Annotated[
        Optional[str],
        typer.Option(help="auto (1:1 where correct) or float. [env: VMPIN_VCPU_POLICY]"),
    ] = None,
    guest_float: Annotated[
        Optional[str],
        typer.Option(
            help="[env: VMPIN_GUEST_FLOAT] "
            "Guest map under a floating plan: all vCPUs, or a proportional share.",
        ),
    ] = None,
    libvirt: Annotated[
        Optional[str],
        typer.Option(
            help="[env: VMPIN_LIBVIRT] libvirt connections whose domains are sandboxes:"
            " comma-separated URIs, 'kubevirt' for every virt-launcher's daemon, 'none'"
            " (default qemu:///system when its daemon runs; docs/libvirt.md).",
        ),
    ] = None,
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    """Pin Kata sandboxes' QEMU threads and plain containers to the CPUs kubelet gave them."""
    from vmpin.service.settings import Settings

    given = {
        "state_dir": state_dir,
        "vm_dir": vm_dir,
        "proc": proc_root,
        "sys": sysfs_root,
        "cgroup": cgroup_root,
        "runc_root": runc_root,
        "kubelet_state": kubelet_state,
        "publish_dir": publish_dir,
        "helpers": helper_policy,
        "housekeeping": housekeeping,
        "vcpus": vcpu_policy,
        "guest_float": guest_float,
        "libvirt": libvirt,
    }
    ctx.obj = Ctx(Settings.from_env(given), given)


def _emit(data: Any, view: str) -> None:
    """Print a ``--json`` view, checked against its schema first (vmpin.reconcile.views)."""
    from vmpin.reconcile.views import check

    check(view, data)
    typer.echo(json.dumps(data, indent=2, sort_keys=False))


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [[("-" if v is None or v == "" else str(v)) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    typer.echo("  ".join(h.upper().ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip())
    for r in cells:
        typer.echo("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip())


def _cpus(c: CpuSet | None) -> str | None:
    return None if c is None else c.to_list()


def _runtimes(store: Store) -> dict[str, str]:
    return {s.id: s.runtime for s in store.sandboxes()}


def container_json(c: ContainerRec, runtime: str | None) -> dict[str, Any]:
    return {
        "id": c.id,
        "sandbox": c.sandbox_id,
        "name": c.name,
        "cpus": _cpus(c.cpus),
        "runtime": runtime,
        "is_sandbox": c.is_sandbox,
        "pod_uid": c.pod_uid,
        "pod_name": c.pod_name,
        "pod_namespace": c.pod_namespace,
        "cpus_source": c.cpus_source,
        "pid": c.pid,
    }


# -- hook (dispatched by vmpin.entry without importing this module; here for --help) --------
@app.command(context_settings={"ignore_unknown_options": True})
def hook(
    ctx: typer.Context,
    stage: Annotated[
        str,
        typer.Argument(
            metavar="STAGE",
            help="prestart, createRuntime, createContainer, startContainer, poststart or poststop.",
        ),
    ],
    strict: Annotated[
        bool,
        typer.Option(
            "--strict", help="Fail the container start on any problem (default: fail open)."
        ),
    ] = False,
) -> None:
    """OCI hook: read the OCI state on stdin, record/forget the container, re-pin its sandbox.

    Fail-open by default: a problem prints one line on stderr and exits 0.
    """
    from vmpin.service.hook import main as hook_main

    root: Ctx = ctx.obj
    # The hook reads its placement policy from the environment, as every hook process does.
    root.export_policy()
    opts = dict(root.paths._asdict())
    raise typer.Exit(hook_main(opts, [stage] + (["--strict"] if strict else [])))


@app.command()
def update(
    ctx: typer.Context,
    container: Annotated[str, typer.Argument(metavar="CONTAINER", help="Container id.")],
    cpuset_cpus: Annotated[
        Optional[str],
        typer.Option("--cpuset-cpus", help="New CPU list, e.g. 0-3,8 (as runc update)."),
    ] = None,
    resources: Annotated[
        Optional[str],
        typer.Option(
            "-r",
            "--resources",
            help="OCI LinuxResources JSON file, or - for stdin (as runc update -r).",
        ),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Record a container's new CPU set (CRI UpdateContainerResources) and re-pin its sandbox."""
    from vmpin.service.update import update_container

    c: Ctx = ctx.obj
    if (cpuset_cpus is None) == (resources is None):
        raise SpecError("give exactly one of --cpuset-cpus LIST or -r FILE|-")
    domain = _update_domain(c, container, cpuset_cpus, resources)
    if domain is not None:
        if as_json:
            _emit(domain, "update")
        else:
            typer.echo(f"{domain['id']}: cpus {domain['cpus'] or '-'} (libvirt domain metadata)")
        return
    result = update_container(
        c.paths,
        container,
        cpuset_cpus=cpuset_cpus,
        resources=resources,
        reconciler_factory=c.reconciler,
    )
    if as_json:
        _emit(result, "update")
    else:
        typer.echo(
            f"{result['id']}: cpus {result['cpus'] or '-'} "
            f"(sandbox {result['sandbox']}: {result['applied_by']})"
        )


def _update_domain(
    c: Ctx, key: str, cpuset_cpus: str | None, resources: str | None
) -> dict[str, Any] | None:
    """`vmpin update DOMAIN`: the mask goes into the domain's metadata (its one home), then
    the node is re-planned.  None when ``key`` is a tracked container or no domain."""
    with c.store() as store:
        if store.container(key) is not None:
            return None
        domains = c.domains()
        found = domains.find(key) if domains is not None else None
        if found is None:
            return None
        from vmpin.service.update import parse_update

        conn, d = found
        cpus = parse_update(cpuset_cpus, resources)
        if cpus is not None:  # resources without cpu.cpus: nothing for vmpin
            conn.set_mask(d.uuid, cpus)
        reports = c.reconciler(store).reconcile([d.uuid])
    errors = [e for r in reports for e in r.errors]
    if errors:
        raise StateError(f"domain {d.name}: {errors[0]}")
    return {"id": d.name, "sandbox": d.uuid, "cpus": _cpus(cpus), "applied_by": "libvirt"}


def _node_plan(ctx: typer.Context, store: Store) -> NodePlan:
    """The node as the host shows it now (pure: observe and plan, nothing written)."""
    plan: NodePlan = ctx.obj.reconciler(store).plan()
    return plan


def _fresh_containers(plan: NodePlan) -> list[dict[str, Any]]:
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
            row["stored_cpus"] = _cpus(c.rec.cpus)
            row["host_differs"] = rec.cpus != c.rec.cpus or c.rec.id in gone
            row["gone"] = c.rec.id in gone
            rows.append(row)
    return rows


@app.command()
def containers(ctx: typer.Context, as_json: JsonOpt = False) -> None:
    """List tracked containers with their CPU sets (fresh from runc and kubelet)."""
    with ctx.obj.reader() as store:
        rows = _fresh_containers(_node_plan(ctx, store))
    if as_json:
        _emit(rows, "containers")
        return
    _table(
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
        typer.echo("* the host says otherwise than vmpin's store: the next pass adopts it")


@app.command()
def sandboxes(ctx: typer.Context, as_json: JsonOpt = False) -> None:
    """List tracked sandboxes: runtime, VMM pid, mask (union of container CPU sets)."""
    with ctx.obj.reader() as store:
        plan = _node_plan(ctx, store)
    out: list[dict[str, Any]] = []
    for sp in plan.sandboxes:
        s = sp.obs.record
        if s is None:
            continue
        stored = CpuSet.union_all(c.rec.cpus for c in sp.obs.containers if c.rec.cpus is not None)
        vmm = sp.obs.vmm
        out.append(
            {
                "id": s.id,
                "runtime": sp.runtime,
                "vmm_pid": vmm.pid if vmm is not None else None,
                "mask": sp.mask.to_list() if sp.runtime == "kata" and sp.plan else _mask(sp),
                "containers": [
                    {
                        "id": c.rec.id,
                        "name": c.rec.name,
                        "cpus": _cpus(c.rec.cpus),
                        "is_sandbox": c.rec.is_sandbox,
                    }
                    for c in sp.containers
                ],
                "pod_uid": s.pod_uid,
                "pod_name": s.pod_name,
                "pod_namespace": s.pod_namespace,
                "dirty": s.dirty,
                "mode": sp.mode,
                "stored_mask": stored.to_list(),
                "host_differs": _mask(sp) != stored.to_list()
                or sp.vanished
                or (vmm.pid if vmm else None) != (s.vmm_pid if s.vmm_start is not None else None),
                "vanished": sp.vanished,
            }
        )
    if as_json:
        _emit(out, "sandboxes")
        return
    _table(
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
        typer.echo("* the host says otherwise than vmpin's store: the next pass adopts it")


def _mask(sp: SandboxPlan) -> str:
    return CpuSet.union_all(c.rec.cpus for c in sp.containers if c.rec.cpus is not None).to_list()


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
        "containers": [{"id": c.id, "name": c.name, "cpus": _cpus(c.cpus)} for c in r.containers],
        "notes": r.notes,
        "errors": r.errors,
    }


def _domain_report(c: Ctx, store: Store, key: str) -> SandboxReport | None:
    """The report of the libvirt domain named or identified by ``key`` (nothing applied)."""
    domains = c.domains()
    found = domains.find(key) if domains is not None else None
    if found is None:
        return None
    reports: list[SandboxReport] = c.reconciler(store).reconcile([found[1].uuid], apply=False)
    return reports[0] if reports else None


def _one(ctx: typer.Context, sandbox: str) -> SandboxReport:
    with ctx.obj.reader() as store:
        rec = store.sandbox(sandbox)
        if rec is None:
            domain = _domain_report(ctx.obj, store, sandbox)
            if domain is not None:
                return domain
            raise StateError(f"unknown sandbox {sandbox!r} (see `vmpin sandboxes`)")
        report: SandboxReport = ctx.obj.reconciler(store).reconcile_sandbox(rec, apply=False)
        return report


@app.command()
def show(
    ctx: typer.Context,
    sandbox: Annotated[str, typer.Argument(metavar="SANDBOX", help="Sandbox id.")],
    as_json: JsonOpt = False,
) -> None:
    """One sandbox: its threads with role, desired and actual affinity, and its guest map."""
    r = _one(ctx, sandbox)
    if as_json:
        _emit(show_json(r), "show")
        return
    typer.echo(
        f"sandbox {r.id}  runtime {r.runtime}  vmm {r.vmm_pid or '-'}  "
        f"mask {r.mask.to_list() or '-'}"
    )
    typer.echo(f"plan    {r.mode}: {r.reason}")
    if r.layers:
        typer.echo(f"threads classified by: {', '.join(r.layers)}")
    _table(
        ["tid", "role", "index", "name", "desired", "actual", "state"],
        [
            [t.tid, t.role, t.index, t.name, _cpus(t.desired), _cpus(t.actual), t.action]
            for t in r.threads
        ],
    )
    if r.guest_map:
        for cid, m in r.guest_map["containers"].items():
            typer.echo(
                f"guest   {cid}: host {m['host_cpus'] or '-'} -> vCPUs {m['guest_cpus']}"
                f"{'' if m['exact'] else ' (not exact: ' + m['reason'] + ')'}"
            )
    for n in r.notes + r.errors:
        typer.echo(f"note    {n}")


@app.command("guest-map")
def guest_map(
    ctx: typer.Context,
    container: Annotated[str, typer.Argument(metavar="CONTAINER", help="Container id.")],
    as_json: JsonOpt = False,
) -> None:
    """A container's host CPUs and the guest vCPUs they are under the current plan."""
    with ctx.obj.reader() as store:
        c = store.container(container)
        if c is None:
            domain = _domain_report(ctx.obj, store, container)
            if domain is not None and domain.guest_map is not None:
                (entry,) = domain.guest_map["containers"].values()
                _print_guest_map(entry, as_json)
                return
            raise StateError(f"unknown container {container!r} (see `vmpin containers`)")
        sb = store.sandbox(c.sandbox_id)
        if sb is None:
            raise StateError(f"container {container!r}: sandbox {c.sandbox_id!r} is not tracked")
        r = ctx.obj.reconciler(store).reconcile_sandbox(sb, apply=False)
    entry = (r.guest_map or {}).get("containers", {}).get(container)
    if entry is None:
        out = {
            "container": container,
            "sandbox": c.sandbox_id,
            "host_cpus": _cpus(c.cpus),
            "guest_cpus": None,
            "exact": False,
            "mode": r.mode,
            "reason": "no guest map: "
            + ("a plain container runs in no VM" if r.runtime != "kata" else "no VMM/plan yet"),
        }
    else:
        out = entry
    _print_guest_map(out, as_json)


def _print_guest_map(out: dict[str, Any], as_json: bool) -> None:
    if as_json:
        _emit(out, "guest-map")
    else:
        typer.echo(
            f"{out['container']} (sandbox {out['sandbox']}): host CPUs "
            f"{out['host_cpus'] or '-'} -> guest vCPUs {out['guest_cpus'] or '-'}"
            f"{'' if out['exact'] else '  [' + out['reason'] + ']'}"
        )


@app.command()
def topology(ctx: typer.Context, as_json: JsonOpt = False) -> None:
    """The host's CPU topology and the order 1:1 plans follow."""
    from vmpin.linux.sysfs import read_topology

    t = read_topology(ctx.obj.paths.sys)
    data = t.to_json()
    if as_json:
        _emit(data, "topology")
        return
    typer.echo(
        f"online {data['online']}  offline {data['offline'] or '-'}  "
        f"isolated {data['isolated'] or '-'}"
    )
    typer.echo(
        f"sockets {data['sockets']}  numa nodes {data['numa_nodes']}  cores "
        f"{data['cores']}  threads/core {data['threads_per_core']}  "
        f"L3 groups {data['l3_groups']}"
    )
    typer.echo(f"order  {','.join(map(str, data['order']))}")
    _table(
        ["cpu", "core", "socket", "numa", "l3", "siblings"],
        [
            [c["cpu"], c["core"], c["socket"], c["numa"], c["l3"], c["siblings"]]
            for c in data["cpus"]
        ],
    )


@app.command()
def audit(ctx: typer.Context, as_json: JsonOpt = False) -> None:
    """The node-wide invariant: every VMM thread and runc container against the node plan
    (drift, double-pin, foreign-on-exclusive, conflict, stale-pin, error); exit 1 on any."""
    with ctx.obj.reader() as store:
        result = ctx.obj.reconciler(store).audit()
    if as_json:
        _emit(result, "audit")
    else:
        for v in result["violations"]:
            typer.echo(
                f"VIOLATION {v['kind']} sandbox {v['sandbox'] or '-'} tid {v['tid'] or '-'}"
                f" {v['role'] or '-'}: desired {v['desired']} actual {v['actual']} ({v['reason']})"
            )
        for e in result["errors"]:
            typer.echo(f"error     {e}")
        typer.echo(
            f"{'ok' if result['ok'] else 'FAIL'}: {result['sandboxes']} sandboxes, "
            f"{result['threads']} threads, {len(result['violations'])} violations"
        )
    if not result["ok"]:
        raise typer.Exit(1)


@app.command()
def reconcile(
    ctx: typer.Context,
    once: Annotated[bool, typer.Option("--once", help="Run one repair pass and exit.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Repair drift: re-pin whatever differs from the plan, touch nothing already right."""
    if not once:
        raise SpecError("reconcile needs --once (the continuous loop is `vmpin serve`)")
    with ctx.obj.store() as store:
        reports = ctx.obj.reconciler(store).reconcile(apply=True)
    out = [
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
        _emit(out, "reconcile")
    else:
        for o in out:
            state = "vanished" if o["vanished"] else f"{o['repaired']} repaired"
            typer.echo(f"{o['id']}: {o['runtime']} {o['mode']} mask {o['mask'] or '-'}: {state}")
            for e in o["errors"]:
                typer.echo(f"  error: {e}")
    if any(o["errors"] for o in out):
        raise typer.Exit(1)


@app.command()
def schema(
    command: Annotated[
        Optional[str],
        typer.Argument(metavar="COMMAND", help="A command with --json output (default: all)."),
    ] = None,
) -> None:
    """The JSON Schema of each --json output (keys scripts may rely on; extra keys may come)."""
    from vmpin.reconcile.views import VIEWS
    from vmpin.reconcile.views import schema as view_schema

    if command is None:
        _print({name: view_schema(name) for name in VIEWS})
        return
    if command not in VIEWS:
        raise SpecError(f"no --json view for {command!r} (one of: {', '.join(VIEWS)})")
    _print(view_schema(command))


def _print(data: Any) -> None:
    typer.echo(json.dumps(data, indent=2, sort_keys=False))


@app.command()
def serve(
    ctx: typer.Context,
    interval: Annotated[float, typer.Option(help="Seconds between full repair passes.")] = 5.0,
    workers: Annotated[
        int, typer.Option(help="Kept for compatibility (1-64): passes are node-wide, one planner.")
    ] = 2,
    metrics_port: Annotated[
        int, typer.Option(help="Prometheus metrics port on 127.0.0.1 (0 = off).")
    ] = 9464,
    kubeconfig: KubeconfigOpt = None,
    node_name: Annotated[
        Optional[str],
        typer.Option(envvar="NODE_NAME", help="This node's name in the API (default: hostname)."),
    ] = None,
) -> None:
    """Run the node agent: control socket, coalesced event handling, periodic repair.

    With Kubernetes API credentials (in-cluster, --kubeconfig or $KUBECONFIG) it also watches
    this node's pods for per-pod policy, records Events and writes the NodePinning report.
    """
    from vmpin.service.agent import serve as serve_agent

    raise typer.Exit(
        serve_agent(ctx.obj, interval=interval, workers=workers, metrics_port=metrics_port,
                    kubeconfig=kubeconfig, node_name=node_name)
    )


@app.command()
def cluster(ctx: typer.Context, kubeconfig: KubeconfigOpt = None, as_json: JsonOpt = False) -> None:
    """Every node's pinning report through the Kubernetes API; exit 1 unless all are clean."""
    import time

    from vmpin.core.clusterview import cluster_rows
    from vmpin.core.errors import KubeError
    from vmpin.runtimes import kubeapi

    api = kubeapi.connect(kubeconfig)
    if api is None:
        raise KubeError("no Kubernetes API credentials (in-cluster, --kubeconfig or $KUBECONFIG)")
    rows = cluster_rows(kubeapi.list_reports(api), time.time())
    if as_json:
        _emit(rows, "cluster")
    else:
        _table(
            ["NODE", "STATE", "SANDBOXES", "VIOLATIONS", "CONFLICTS", "EXCLUSIVE", "HEARTBEAT"],
            [[r["node"], r["state"], r["sandboxes"], r["violations"], r["conflicts"],
              r["exclusive_cpus"],
              None if r["heartbeat_age"] is None else f"{r['heartbeat_age']:.0f}s ago"]
             for r in rows],
        )
        for r in rows:
            for c in r["conflict_list"]:
                typer.echo(f"{r['node']}: conflict: {c}")
    if any(r["state"] != "clean" for r in rows):
        raise typer.Exit(1)


@app.command()
def status(ctx: typer.Context, as_json: JsonOpt = False) -> None:
    """The agent's health; exit 0 when it answers on its control socket, 1 when not."""
    from vmpin.service.control import request
    from vmpin.state import journal

    reply = request(ctx.obj.paths, {"op": "status"}, timeout=2.0)
    state_dir = ctx.obj.paths.state_dir
    out = reply or {
        "ok": False,
        "error": f"no agent answering on {ctx.obj.paths.control_socket}",
        "journal_pending": journal.backlog(state_dir),
        "journal_bad": journal.quarantined(state_dir),
    }
    if as_json:
        _emit(out, "status")
    elif reply:
        typer.echo(" ".join(f"{k}={v}" for k, v in reply.items()))
    else:
        typer.echo(out["error"])
        typer.echo(f"journal_pending={out['journal_pending']} journal_bad={out['journal_bad']}")
    if not reply or not reply.get("ok"):
        raise typer.Exit(1)


@app.command()
def doctor(
    ctx: typer.Context,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Only check; move and rebuild nothing.")
    ] = False,
) -> None:
    """Check the state dir; move a corrupt store aside and rebuild it from the host."""
    from vmpin.service.doctor import doctor as run_doctor

    ok, lines = run_doctor(ctx.obj.paths, repair=not dry_run)
    for line in lines:
        typer.echo(line)
    if not ok:
        raise typer.Exit(1)


@guest_app.command("hook")
def guest_hook(
    stage: Annotated[str, typer.Argument(metavar="STAGE", help="prestart, poststart or poststop.")],
) -> None:
    """Inside the guest: pin the starting container to its mapped vCPUs (fail-open).

    Options (--strict, --verbose, --widen-parents, --wait, --map): `vmpin guest hook -h`;
    the channel is described in docs/guest.md.
    """
    from vmpin.guest.program import main as guest_main

    raise typer.Exit(guest_main([stage]))


@guest_app.command("follow")
def guest_follow(
    once: Annotated[bool, typer.Option("--once", help="One pass, then exit.")] = False,
    interval: Annotated[
        float, typer.Option("--interval", help="Seconds between looks at the map.")
    ] = 2.0,
) -> None:
    """Inside the guest: re-pin recorded containers when the host republishes their vCPUs.

    Reached here only for --help (vmpin.entry runs it without typer); all options
    (--strict, --verbose, --map, --state, ...): `vmpin guest follow -h`; docs/guest.md.
    """
    from vmpin.guest.program import follow_main

    raise typer.Exit(follow_main([*(["--once"] if once else []), "--interval", str(interval)]))


def run(args: list[str]) -> int:
    """Run the CLI; the one place errors become a message and an exit code.

    typer handles its own usage errors (unknown option, missing argument: exit 2, with the
    usage); a VmpinError -- bad input or state -- becomes one line on stderr.
    """
    try:
        app(args=args, prog_name="vmpin", standalone_mode=True)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except VmpinError as e:
        print(f"vmpin: error: {e}", file=sys.stderr)
        return e.exit_code
    except sqlite3.Error as e:  # the database failed under a command: one line, no traceback
        from vmpin.linux.paths import ENVVARS
        from vmpin.state.store import state_error

        state_dir = os.environ.get(ENVVARS["state_dir"]) or "/run/vmpin"
        for i, arg in enumerate(args):  # the global option, when given, wins
            if arg == "--state-dir" and i + 1 < len(args):
                state_dir = args[i + 1]
            elif arg.startswith("--state-dir="):
                state_dir = arg.split("=", 1)[1]
        print(f"vmpin: error: {state_error(os.path.join(state_dir, 'state.db'), e)}",
              file=sys.stderr)
        return 2
    return 0
