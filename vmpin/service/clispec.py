"""The command line, declared once: every command, its arguments, options and help; and the
one parser that reads argv with it.

Two readers, one table.  :func:`parse` reads argv for every command that runs
(:mod:`vmpin.entry` hands the result to :func:`vmpin.service.commands.run`), without
importing typer: typer imports pydantic and builds a TypeAdapter per option on every run
(~80 ms, against ~8 ms for a bare interpreter), most of what ``vmpin update`` or a read
command would cost.  :mod:`vmpin.cli` builds the typer app from the same entries, for what
:func:`parse` does not accept -- ``--help``, a typo, a missing argument -- which typer
explains (its help and usage texts, exit 2), so help and parser cannot disagree about a name,
a default or whether an option takes a value.

The global options (and click's grammar of one option) are :mod:`vmpin.wire.argv`'s: the
hooks read them there without loading this table.
"""

from __future__ import annotations

import os

from vmpin.wire.argv import GLOBALS, split_globals, take

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.lean.records)
if TYPE_CHECKING:
    from typing import Any


class Opt:
    """One option: its flags, the key its value is handed over under, and its help."""

    __slots__ = ("convert", "default", "envvar", "flags", "help", "key", "metavar", "multiple",
                 "required", "value")  # fmt: skip

    def __init__(
        self,
        flags: tuple[str, ...],
        key: str,
        help: str,
        value: bool = True,
        *,
        convert: type[float] | type[int] | None = None,
        default: float | str | None = None,
        envvar: str | None = None,
        metavar: str | None = None,
        multiple: bool = False,
        required: bool = False,
    ) -> None:
        self.flags, self.key, self.help = flags, key, help
        #: takes a value (``--opt V`` / ``--opt=V``); False: a flag
        self.value = value
        #: ``float`` or ``int``: the value's type (typer converts with the same builtin; a
        #: value it refuses goes to typer, which explains)
        self.convert = convert
        #: the value when the option is not given (None for a flag: False)
        self.default = default
        #: the environment variable read when the option is not given (an empty one is none)
        self.envvar = envvar
        self.metavar = metavar
        #: may be given several times: the values as a list (None when never given)
        self.multiple = multiple
        self.required = required


class Arg:
    """One positional argument: its metavar, the key it is handed over under, and its help."""

    __slots__ = ("help", "key", "metavar", "required")

    def __init__(self, metavar: str, key: str, help: str, required: bool = True) -> None:
        self.metavar, self.key, self.help, self.required = metavar, key, help, required


class Command:
    """A command: the module of vmpin.service that holds its body (the function named as the
    command, ``-`` read as ``_``: vmpin.service.commands.run imports that module alone), its
    help (typer's, as a docstring would give it), positional arguments and options;
    ``loose``: unknown options are taken as arguments (the OCI hook's); ``own``: it reads its
    own argv (the guest's commands, which vmpin.entry hands theirs: their options here are
    what ``--help`` shows; no module)."""

    __slots__ = ("args", "help", "loose", "module", "options", "own")

    def __init__(
        self, module: str, help: str, args: tuple[Arg, ...] = (), options: tuple[Opt, ...] = (),
        loose: bool = False, own: bool = False,
    ) -> None:  # fmt: skip
        self.module, self.help, self.args, self.options = module, help, args, options
        self.loose, self.own = loose, own


APP_HELP = (
    "Pin Kata sandboxes' QEMU threads and plain containers to the CPUs kubelet gave them.\n\n"
    "Global options must come before the command, e.g. `vmpin --state-dir /tmp/s containers`."
)
VERSION_HELP = "Print the version and exit."
GUEST_HELP = "Guest side: run inside the VM from Kata's guest_hook_path."

JSON = Opt(("--json",), "as_json", "Print JSON for scripts instead of a table.", value=False)
KUBECONFIG = Opt(("--kubeconfig",), "kubeconfig",
                 "kubeconfig for the Kubernetes API (default: in-cluster, $KUBECONFIG).",
                 envvar="VMPIN_KUBECONFIG")
CONTAINER = Arg("CONTAINER", "container", "Container id.")
SANDBOX = Arg("SANDBOX", "sandbox", "Sandbox id.")

#: the modules of vmpin.service that hold the commands' bodies (Command.module)
UPDATE, READ, AGENT, ADMIN = "commands_update", "commands_read", "commands_agent", "commands_admin"

#: every command, in the order ``vmpin --help`` lists them; ``guest X`` is X of the guest group
COMMANDS = {
    "hook": Command(
        AGENT,
        "OCI hook: read the OCI state on stdin, record/forget the container, re-pin its"
        " sandbox.\n\nFail-open by default: a problem prints one line on stderr and exits 0.",
        (Arg("STAGE", "stage", "prestart, createRuntime, createContainer, startContainer,"
             " poststart or poststop."),),
        (Opt(("--strict",), "strict",
             "Fail the container start on any problem (default: fail open).", value=False),),
        loose=True,
    ),
    "update": Command(
        UPDATE,
        "Record a container's new CPU set (CRI UpdateContainerResources) and re-pin its"
        " sandbox.",
        (CONTAINER,),
        (Opt(("--cpuset-cpus",), "cpuset_cpus", "New CPU list, e.g. 0-3,8 (as runc update)."),
         Opt(("-r", "--resources"), "resources",
             "OCI LinuxResources JSON file, or - for stdin (as runc update -r)."),
         JSON),
    ),
    "containers": Command(
        READ,
        "List tracked containers with their CPU sets (fresh from runc and kubelet).",
        (),
        (JSON,),
    ),
    "sandboxes": Command(
        READ,
        "List tracked sandboxes: runtime, VMM pid, mask (union of container CPU sets).", (),
        (JSON,),
    ),
    "show": Command(
        READ,
        "One sandbox: its threads with role, desired and actual affinity, and its guest map.",
        (SANDBOX,), (JSON,),
    ),
    "guest-map": Command(
        READ,
        "A container's host CPUs and the guest vCPUs they are under the current plan.",
        (CONTAINER,), (JSON,),
    ),
    "topology": Command(
        READ, "The host's CPU topology and the order 1:1 plans follow.", (), (JSON,)
    ),
    "audit": Command(
        READ,
        "The node-wide invariant: every VMM thread and runc container against the node plan\n"
        "(drift, double-pin, foreign-on-exclusive, conflict, stale-pin, error); exit 1 on any.",
        (), (JSON,),
    ),
    "demo": Command(
        ADMIN,
        "Show what vmpin does, on this machine, in under a minute: start a throwaway VM the"
        " way\nKata starts QEMU and a runc container, run vmpin's hooks for them, print each"
        " thread's\naffinity before and after, move the container's CPUs as kubelet would and"
        " show the\nre-pin, run the audit, then remove everything it made (also on Ctrl-C). "
        " Needs root,\nqemu-system-x86, runc and busybox-static.  The node's own state is never"
        " touched."
    ),
    "explain": Command(
        READ,
        "Who is on a CPU and why (kubelet's claim, each sandbox's mask and the containers that\n"
        "made it, every thread planned or running there and the rule that put it there); or"
        " what a\npod or container gets, and why.  Nothing is written.",
        (Arg("CPU|CONTAINER|POD", "what", "A CPU number; else a container id; else a pod (uid,"
             " name, namespace/name) or sandbox id."),),
        (JSON,),
    ),
    "reconcile": Command(
        AGENT,
        "Repair drift: re-pin whatever differs from the plan, touch nothing already right.", (),
        (Opt(("--once",), "once", "Run one repair pass and exit.", value=False), JSON),
    ),
    "schema": Command(
        ADMIN,
        "The JSON Schema of each --json output (keys scripts may rely on; extra keys may come).",
        (Arg("COMMAND", "command", "A command with --json output (default: all).",
             required=False),),
    ),
    "serve": Command(
        AGENT,
        "Run the node agent: control socket, coalesced event handling, periodic repair.\n\n"
        "With Kubernetes API credentials (in-cluster, --kubeconfig or $KUBECONFIG) it also"
        " watches\nthis node's pods for per-pod policy, records Events and writes the"
        " NodePinning report.",
        (),
        (Opt(("--interval",), "interval", "Seconds between full repair passes.", convert=float,
             default=5.0),
         Opt(("--workers",), "workers",
             "Kept for compatibility (1-64): passes are node-wide, one planner.", convert=int,
             default=2),
         Opt(("--metrics-port",), "metrics_port", "Prometheus metrics port (0 = off).",
             convert=int, default=9464),
         Opt(("--metrics-address",), "metrics_address",
             "Address the metrics port binds: 127.0.0.1 (the default) keeps it on the node; the"
             " node's IP (or 0.0.0.0) lets a cluster Prometheus scrape it.",
             envvar="VMPIN_METRICS_ADDRESS"),
         KUBECONFIG,
         Opt(("--node-name",), "node_name", "This node's name in the API (default: hostname).",
             envvar="NODE_NAME")),
    ),
    "cluster": Command(
        ADMIN,
        "Every node's pinning report through the Kubernetes API; exit 1 unless all are clean.",
        (), (KUBECONFIG, JSON),
    ),
    "status": Command(
        AGENT,
        "The agent's health; exit 0 when it answers on its control socket, 1 when not.", (),
        (JSON,),
    ),
    "doctor": Command(
        ADMIN,
        "Check the state dir; move a corrupt store aside and rebuild it from the host.", (),
        (Opt(("--dry-run",), "dry_run", "Only check; move and rebuild nothing.", value=False),),
    ),
    "install": Command(
        ADMIN,
        "Put vmpin's hook on a node (kata-deploy style): one self-contained hook file for the\n"
        "host's python3, hooks.d files for CRI-O/podman, base specs and config.toml lines for\n"
        "containerd, and a manifest of all of it (docs/hooks.md, \"Installing on a node\").",
        (),
        (Opt(("--root",), "root",
             "The node's root as this process sees it: / on the node, /host in an init"
             " container that has the node's / mounted there.", required=True),
         Opt(("--prefix",), "prefix", "Where vmpin's own files go (a host path).",
             default="/opt/vmpin"),
         Opt(("--runtime",), "runtime",
             "Comma-separated engines to hook: containerd (base specs, config.toml), crio and"
             " podman (hooks.d).", default="containerd,crio,podman"),
         Opt(("--env",), "env",
             "The hook's environment beyond PATH, e.g. VMPIN_HELPER_POLICY=isolate (the"
             " agent's values: both plan). Repeat for more.", metavar="NAME=VALUE",
             multiple=True),
         Opt(("--hooks-dir",), "hooks_dir",
             "hooks.d directory for CRI-O and podman (a host path; CRI-O's default hooks_dir,"
             " which podman reads too).", default="/usr/share/containers/oci/hooks.d"),
         Opt(("--containerd-config",), "containerd_config", "containerd's config (a host path).",
             default="/etc/containerd/config.toml"),
         Opt(("--python",), "python",
             "How to run the host's python3, which compiles the hook's bytecode (default:"
             " python3 on the hooks' PATH, under chroot ROOT unless ROOT is /); 'none': this"
             " Python's bytecode only."),
         Opt(("--ctr",), "ctr",
             "How to run the host's ctr, whose `ctr oci spec` starts the base specs (default:"
             " ctr on the hooks' PATH, under chroot ROOT unless ROOT is /); 'none': the"
             " packaged default spec.")),
    ),
    "uninstall": Command(
        ADMIN,
        "Remove what `vmpin install` wrote under ROOT and put back every file it replaced, as\n"
        "its manifest records (an error when there is none).",
        (),
        (Opt(("--root",), "root", "The node's root, as for install.", required=True),
         Opt(("--prefix",), "prefix", "The prefix install was given.", default="/opt/vmpin")),
    ),
    "guest hook": Command(
        "",  # (vmpin.entry runs vmpin.guest.hook)
        "Inside the guest: pin the starting container to its mapped vCPUs (fail-open).\n\n"
        "Options (--strict, --verbose, --widen-parents, --wait, --map): `vmpin guest hook -h`;\n"
        "the channel is described in docs/guest.md.",
        (Arg("STAGE", "stage", "prestart, poststart or poststop."),),
        own=True,
    ),
    "guest follow": Command(
        "",  # (vmpin.entry runs vmpin.guest.follower)
        "Inside the guest: re-pin recorded containers when the host republishes their vCPUs.\n\n"
        "Reached here only for --help (vmpin.entry runs it without typer); all options\n"
        "(--strict, --verbose, --map, --state, ...): `vmpin guest follow -h`; docs/guest.md.",
        (),
        (Opt(("--once",), "once", "One pass, then exit.", value=False),
         Opt(("--interval",), "interval", "Seconds between looks at the map.", convert=float,
             default=2.0)),
        own=True,
    ),
}

#: the options before the command: the global ones, and ``--version``
GROUP_FLAGS = {**dict.fromkeys(GLOBALS, True), "--version": False}


def parse(argv: list[str]) -> tuple[dict[str, str], str, dict[str, Any]] | None:
    """``argv`` as it runs: (the global options given, by key; the command, a key of
    :data:`COMMANDS` or ``--version``; its values, by key, defaults filled in); None when
    typer must explain it -- ``--help``, no command, an unknown or misused option, a missing
    or extra argument, a value its type refuses -- and for the guest's commands, which read
    their own argv."""
    split = split_globals(argv, GROUP_FLAGS)
    if split is None:
        return None
    given, rest = split
    if "--version" in given:  # (eager, as typer's: whatever follows)
        return {}, "--version", {}
    name = " ".join(rest[:2]) if rest[:1] == ["guest"] else " ".join(rest[:1])
    spec = COMMANDS.get(name)
    values = None if spec is None or spec.own else _values(spec, rest[name.count(" ") + 1:])
    if values is None:
        return None
    return {GLOBALS[flag][0]: str(value) for flag, value in given.items()}, name, values


def _values(spec: Command, words: list[str]) -> dict[str, Any] | None:
    """A command's words as click reads them (options anywhere, ``--`` ends them, the last
    of a repeated option wins), by key; None as for :func:`parse`."""
    flags = {flag: o.value for o in spec.options for flag in o.flags}
    options = {flag: o for o in spec.options for flag in o.flags}
    values: dict[str, Any] = {}
    positional: list[str] = []
    i = 0
    while i < len(words):
        word = words[i]
        if word == "--":
            positional += words[i + 1:]
            break
        if word[:1] != "-" or word == "-":
            positional.append(word)
            i += 1
            continue
        if word in ("-h", "--help"):
            return None
        took = take(words, i, flags)
        if took is None:
            if not spec.loose:
                return None
            positional.append(word)
            i += 1
            continue
        flag, value, i = took
        o = options[flag]
        if o.multiple:
            values.setdefault(o.key, []).append(value)
        else:
            values[o.key] = True if value is None else value
    if not sum(a.required for a in spec.args) <= len(positional) <= len(spec.args):
        return None
    for n, a in enumerate(spec.args):
        values[a.key] = positional[n] if n < len(positional) else None
    for o in spec.options:
        if o.key not in values:
            if o.required:
                return None
            from_env = os.environ.get(o.envvar) if o.envvar else None
            values[o.key] = from_env or (o.default if o.value else False)
        if o.convert is not None:
            try:
                values[o.key] = o.convert(values[o.key])
            except ValueError:
                return None
    return values
