"""The ``vmpin`` command line: the typer app -- every command, its options and its --help.

Each command is a few lines; tables are for people, ``--json`` for scripts (keys as in
DESIGN.md, CPU lists always in Linux list format).  The hot commands (``update`` and the read
commands) are thin here: their bodies live in :mod:`vmpin.service.commands`, their option
names and help in :mod:`vmpin.service.clispec`, because :mod:`vmpin.entry` runs them without
importing typer (which imports pydantic and builds a TypeAdapter per option: ~80 ms a run).
:func:`vmpin.service.commands.guard` is the one place a ``VmpinError`` becomes a one-line
message and an exit code (2 for bad input or state, 1 for "audit found violations" / "agent
not answering").
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Optional

import typer

from vmpin import __version__
from vmpin.core.cpuset import listed as cpus
from vmpin.core.errors import SpecError, StateError
from vmpin.service import commands
from vmpin.service.clispec import (
    CONTAINER,
    CPUSET_CPUS,
    INTERVAL,
    JSON,
    KUBECONFIG,
    METRICS_ADDRESS,
    METRICS_PORT,
    NODE_NAME,
    ONCE,
    RESOURCES,
    SANDBOX,
    WORKERS,
    G,
)
from vmpin.service.commands import Ctx, emit, table

__all__ = ["Ctx", "app", "run"]

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

JsonOpt = Annotated[bool, typer.Option(*JSON.flags, help=JSON.help)]
KubeconfigOpt = Annotated[
    Optional[str],
    typer.Option(*KUBECONFIG.flags, envvar=KUBECONFIG.envvar, help=KUBECONFIG.help),
]



def _version(value: bool) -> None:
    if value:
        typer.echo(f"vmpin {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    ctx: typer.Context,
    state_dir: Annotated[
        Optional[str], typer.Option(*G["state_dir"].flags, help=G["state_dir"].help)
    ] = None,
    vm_dir: Annotated[
        Optional[str], typer.Option(*G["vm_dir"].flags, help=G["vm_dir"].help)
    ] = None,
    proc_root: Annotated[
        Optional[str], typer.Option(*G["proc"].flags, help=G["proc"].help)
    ] = None,
    sysfs_root: Annotated[
        Optional[str], typer.Option(*G["sys"].flags, help=G["sys"].help)
    ] = None,
    cgroup_root: Annotated[
        Optional[str], typer.Option(*G["cgroup"].flags, help=G["cgroup"].help)
    ] = None,
    runc_root: Annotated[
        Optional[str], typer.Option(*G["runc_root"].flags, help=G["runc_root"].help)
    ] = None,
    kubelet_state: Annotated[
        Optional[str], typer.Option(*G["kubelet_state"].flags, help=G["kubelet_state"].help)
    ] = None,
    publish_dir: Annotated[
        Optional[str], typer.Option(*G["publish_dir"].flags, help=G["publish_dir"].help)
    ] = None,
    kata_config: Annotated[
        Optional[str], typer.Option(*G["kata_config"].flags, help=G["kata_config"].help)
    ] = None,
    kubelet_config: Annotated[
        Optional[str], typer.Option(*G["kubelet_config"].flags, help=G["kubelet_config"].help)
    ] = None,
    helper_policy: Annotated[
        Optional[str], typer.Option(*G["helpers"].flags, help=G["helpers"].help)
    ] = None,
    housekeeping: Annotated[
        Optional[str], typer.Option(*G["housekeeping"].flags, help=G["housekeeping"].help)
    ] = None,
    vcpu_policy: Annotated[
        Optional[str], typer.Option(*G["vcpus"].flags, help=G["vcpus"].help)
    ] = None,
    guest_float: Annotated[
        Optional[str], typer.Option(*G["guest_float"].flags, help=G["guest_float"].help)
    ] = None,
    libvirt: Annotated[
        Optional[str], typer.Option(*G["libvirt"].flags, help=G["libvirt"].help)
    ] = None,
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    """Pin Kata sandboxes' QEMU threads and plain containers to the CPUs kubelet gave them."""
    given = {
        "state_dir": state_dir,
        "vm_dir": vm_dir,
        "proc": proc_root,
        "sys": sysfs_root,
        "cgroup": cgroup_root,
        "runc_root": runc_root,
        "kubelet_state": kubelet_state,
        "publish_dir": publish_dir,
        "kata_config": kata_config,
        "kubelet_config": kubelet_config,
        "helpers": helper_policy,
        "housekeeping": housekeeping,
        "vcpus": vcpu_policy,
        "guest_float": guest_float,
        "libvirt": libvirt,
    }
    ctx.obj = Ctx.from_options(given)


def _done(code: int) -> None:
    """A body's exit code, as typer wants it."""
    if code:
        raise typer.Exit(code)


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
    raise typer.Exit(hook_main(root.hook_options(), [stage] + (["--strict"] if strict else [])))



@app.command()
def update(
    ctx: typer.Context,
    container: Annotated[str, typer.Argument(metavar=CONTAINER.metavar, help=CONTAINER.help)],
    cpuset_cpus: Annotated[
        Optional[str], typer.Option(*CPUSET_CPUS.flags, help=CPUSET_CPUS.help)
    ] = None,
    resources: Annotated[Optional[str], typer.Option(*RESOURCES.flags, help=RESOURCES.help)] = None,
    as_json: JsonOpt = False,
) -> None:
    """Record a container's new CPU set (CRI UpdateContainerResources) and re-pin its sandbox."""
    _done(commands.update(ctx.obj, container, cpuset_cpus, resources, as_json))


@app.command()
def containers(ctx: typer.Context, as_json: JsonOpt = False) -> None:
    """List tracked containers with their CPU sets (fresh from runc and kubelet)."""
    _done(commands.containers(ctx.obj, as_json))


@app.command()
def sandboxes(ctx: typer.Context, as_json: JsonOpt = False) -> None:
    """List tracked sandboxes: runtime, VMM pid, mask (union of container CPU sets)."""
    _done(commands.sandboxes(ctx.obj, as_json))


@app.command()
def show(
    ctx: typer.Context,
    sandbox: Annotated[str, typer.Argument(metavar=SANDBOX.metavar, help=SANDBOX.help)],
    as_json: JsonOpt = False,
) -> None:
    """One sandbox: its threads with role, desired and actual affinity, and its guest map."""
    _done(commands.show(ctx.obj, sandbox, as_json))


@app.command("guest-map")
def guest_map(
    ctx: typer.Context,
    container: Annotated[str, typer.Argument(metavar=CONTAINER.metavar, help=CONTAINER.help)],
    as_json: JsonOpt = False,
) -> None:
    """A container's host CPUs and the guest vCPUs they are under the current plan."""
    with ctx.obj.reader() as store:
        c = store.container(container)
        if c is None:
            domain = commands.domain_report(ctx.obj, store, container)
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
            "host_cpus": cpus(c.cpus),
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
        emit(out, "guest-map")
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
        emit(data, "topology")
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
    table(
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
    _done(commands.audit(ctx.obj, as_json))


@app.command()
def demo(ctx: typer.Context) -> None:
    """Show what vmpin does, on this machine, in under a minute: start a throwaway VM the way
    Kata starts QEMU and a runc container, run vmpin's hooks for them, print each thread's
    affinity before and after, move the container's CPUs as kubelet would and show the
    re-pin, run the audit, then remove everything it made (also on Ctrl-C).  Needs root,
    qemu-system-x86, runc and busybox-static.  The node's own state is never touched."""
    from vmpin.service.demo import main as run_demo

    _done(run_demo())


@app.command()
def explain(
    ctx: typer.Context,
    what: Annotated[
        str,
        typer.Argument(
            metavar="CPU|CONTAINER|POD",
            help="A CPU number; else a container id; else a pod (uid, name, namespace/name)"
            " or sandbox id.",
        ),
    ],
    as_json: JsonOpt = False,
) -> None:
    """Who is on a CPU and why (kubelet's claim, each sandbox's mask and the containers that
    made it, every thread planned or running there and the rule that put it there); or what a
    pod or container gets, and why.  Nothing is written."""
    from vmpin.reconcile.explain import explain as explain_what

    with ctx.obj.reader() as store:
        reconciler = ctx.obj.reconciler(store)
        out = explain_what(reconciler.plan(), reconciler.topology, what)
    if as_json:
        emit(out, "explain")
        return
    _print_explained(out)


def _print_explained(out: dict[str, Any]) -> None:
    echo = typer.echo
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


@app.command()
def reconcile(
    ctx: typer.Context,
    once: Annotated[bool, typer.Option(*ONCE.flags, help=ONCE.help)] = False,
    as_json: JsonOpt = False,
) -> None:
    """Repair drift: re-pin whatever differs from the plan, touch nothing already right."""
    _done(commands.reconcile(ctx.obj, once, as_json))


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
    interval: Annotated[float, typer.Option(*INTERVAL.flags, help=INTERVAL.help)] = 5.0,
    workers: Annotated[int, typer.Option(*WORKERS.flags, help=WORKERS.help)] = 2,
    metrics_port: Annotated[
        int, typer.Option(*METRICS_PORT.flags, help=METRICS_PORT.help)
    ] = 9464,
    metrics_address: Annotated[
        Optional[str],
        typer.Option(*METRICS_ADDRESS.flags, envvar=METRICS_ADDRESS.envvar,
                     help=METRICS_ADDRESS.help),
    ] = None,
    kubeconfig: KubeconfigOpt = None,
    node_name: Annotated[
        Optional[str],
        typer.Option(*NODE_NAME.flags, envvar=NODE_NAME.envvar, help=NODE_NAME.help),
    ] = None,
) -> None:
    """Run the node agent: control socket, coalesced event handling, periodic repair.

    With Kubernetes API credentials (in-cluster, --kubeconfig or $KUBECONFIG) it also watches
    this node's pods for per-pod policy, records Events and writes the NodePinning report.
    """
    _done(commands.serve(ctx.obj, interval, workers, metrics_port, kubeconfig, node_name,
                         metrics_address))


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
        emit(rows, "cluster")
    else:
        table(
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
        emit(out, "status")
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


def _command(value: Optional[str]) -> Optional[list[str]]:
    """A command line option: None = the default, "none" = [] (do not run one)."""
    import shlex

    if value is None:
        return None
    return [] if value.strip() == "none" else shlex.split(value)


def _print_report(report: Any) -> None:
    for line in report.lines:
        typer.echo(line)
    for line in report.warnings:
        typer.echo(f"warning: {line}", err=True)


@app.command()
def install(
    root: Annotated[
        str,
        typer.Option(
            "--root",
            help="The node's root as this process sees it: / on the node, /host in an init"
            " container that has the node's / mounted there.",
        ),
    ],
    prefix: Annotated[
        str, typer.Option("--prefix", help="Where vmpin's own files go (a host path).")
    ] = "/opt/vmpin",
    runtime: Annotated[
        str,
        typer.Option(
            "--runtime",
            help="Comma-separated engines to hook: containerd (base specs, config.toml), crio"
            " and podman (hooks.d).",
        ),
    ] = "containerd,crio,podman",
    env: Annotated[
        Optional[list[str]],
        typer.Option(
            "--env",
            metavar="NAME=VALUE",
            help="The hook's environment beyond PATH, e.g. VMPIN_HELPER_POLICY=isolate (the"
            " agent's values: both plan). Repeat for more.",
        ),
    ] = None,
    hooks_dir: Annotated[
        str,
        typer.Option(
            "--hooks-dir",
            help="hooks.d directory for CRI-O and podman (a host path; CRI-O's default"
            " hooks_dir, which podman reads too).",
        ),
    ] = "/usr/share/containers/oci/hooks.d",
    containerd_config: Annotated[
        str, typer.Option("--containerd-config", help="containerd's config (a host path).")
    ] = "/etc/containerd/config.toml",
    python: Annotated[
        Optional[str],
        typer.Option(
            "--python",
            help="How to run the host's python3, which compiles the hook's bytecode (default:"
            " python3 on the hooks' PATH, under chroot ROOT unless ROOT is /); 'none': this"
            " Python's bytecode only.",
        ),
    ] = None,
    ctr: Annotated[
        Optional[str],
        typer.Option(
            "--ctr",
            help="How to run the host's ctr, whose `ctr oci spec` starts the base specs"
            " (default: ctr on the hooks' PATH, under chroot ROOT unless ROOT is /); 'none':"
            " the packaged default spec.",
        ),
    ] = None,
) -> None:
    """Put vmpin's hook on a node (kata-deploy style): one self-contained hook file for the
    host's python3, hooks.d files for CRI-O/podman, base specs and config.toml lines for
    containerd, and a manifest of all of it (docs/hooks.md, "Installing on a node")."""
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
    _print_report(run_install(root, opts))


@app.command()
def uninstall(
    root: Annotated[str, typer.Option("--root", help="The node's root, as for install.")],
    prefix: Annotated[
        str, typer.Option("--prefix", help="The prefix install was given.")
    ] = "/opt/vmpin",
) -> None:
    """Remove what `vmpin install` wrote under ROOT and put back every file it replaced, as
    its manifest records (an error when there is none)."""
    from vmpin.service.install import uninstall as run_uninstall

    _print_report(run_uninstall(root, prefix))


@guest_app.command("hook")
def guest_hook(
    stage: Annotated[str, typer.Argument(metavar="STAGE", help="prestart, poststart or poststop.")],
) -> None:
    """Inside the guest: pin the starting container to its mapped vCPUs (fail-open).

    Options (--strict, --verbose, --widen-parents, --wait, --map): `vmpin guest hook -h`;
    the channel is described in docs/guest.md.
    """
    from vmpin.guest.hook import main as guest_main

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
    from vmpin.guest.follower import follow_main

    raise typer.Exit(follow_main([*(["--once"] if once else []), "--interval", str(interval)]))


def run(args: list[str]) -> int:
    """Run the CLI through typer; errors become a message and an exit code in
    :func:`vmpin.service.commands.guard`, as on the fast route.

    typer handles its own usage errors (unknown option, missing argument: exit 2, with the
    usage); a VmpinError -- bad input or state -- becomes one line on stderr.
    """

    def call() -> int:
        try:
            app(args=args, prog_name="vmpin", standalone_mode=True)
        except SystemExit as e:
            return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        return 0

    return commands.guard(args, call)
