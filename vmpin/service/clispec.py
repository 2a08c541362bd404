"""The command line's names, written once: every global option, and the hot commands' options.

Two readers, one table.  The typer app (:mod:`vmpin.cli`) declares its options from these
entries (flags and help), and the fast route (:mod:`vmpin.service.commands`, reached from
:mod:`vmpin.entry` without importing typer or pydantic) parses argv with them; so the two
cannot disagree about a name, or about whether an option takes a value.
``tests/service/test_cli.py`` checks that the typer app declares exactly these, and that both
routes give the same stdout, stderr and exit code for the same argv.

No imports at all: :mod:`vmpin.entry` loads this for every command but the hooks (which
parse their few host-root options themselves: ``vmpin.entry.GLOBAL_OPTIONS``, the entries
marked ``path`` here; a test keeps the two equal).
"""

from __future__ import annotations


class Opt:
    """One option: its flags, the key its value is handed over under, and its help."""

    __slots__ = ("convert", "default", "envvar", "flags", "help", "key", "path", "value")

    def __init__(
        self,
        flags: tuple[str, ...],
        key: str,
        help: str,
        value: bool = True,
        path: bool = False,
        *,
        convert: type[float] | type[int] | None = None,
        default: float | None = None,
        envvar: str | None = None,
    ) -> None:
        self.flags, self.key, self.help = flags, key, help
        #: takes a value (``--opt V`` / ``--opt=V``); False: a flag
        self.value = value
        #: a host root of HostPaths (the hook takes these from its own argv too)
        self.path = path
        #: ``float`` or ``int``: the value's type (click converts with the same builtin; a
        #: value it refuses goes to typer, which explains)
        self.convert = convert
        #: the value when the option is not given (the typer app declares the same)
        self.default = default
        #: the environment variable typer falls back to when the option is not given
        self.envvar = envvar


class Arg:
    """One positional argument: its metavar, the key it is handed over under, and its help."""

    __slots__ = ("help", "key", "metavar")

    def __init__(self, metavar: str, key: str, help: str) -> None:
        self.metavar, self.key, self.help = metavar, key, help


class Command:
    """A command the fast route runs: its positional arguments and its options."""

    __slots__ = ("args", "options")

    def __init__(self, args: tuple[Arg, ...], options: tuple[Opt, ...]) -> None:
        self.args, self.options = args, options


#: DESIGN.md's global options (each also an environment variable, read by Settings.from_env);
#: keys are those of ``Settings.from_env``'s overrides.
GLOBALS = (
    Opt(("--state-dir",), "state_dir",
        "Where vmpin keeps its SQLite state. [env: VMPIN_STATE_DIR]", path=True),
    Opt(("--vm-dir",), "vm_dir",
        "Kata's VM dir: <vm-dir>/<sandbox>/{pid,qmp.sock}. [env: VMPIN_VM_DIR]", path=True),
    Opt(("--proc-root",), "proc", "procfs root. [env: VMPIN_PROC_ROOT]", path=True),
    Opt(("--sysfs-root",), "sys", "sysfs root. [env: VMPIN_SYSFS_ROOT]", path=True),
    Opt(("--cgroup-root",), "cgroup", "cgroup filesystem root. [env: VMPIN_CGROUP_ROOT]",
        path=True),
    Opt(("--runc-root",), "runc_root",
        "runc's state roots (runc --root), ':'-separated; DIR/* = every directory in"
        " DIR. Default /run/runc:/run/containerd/runc/* (containerd: one root per"
        " namespace). [env: VMPIN_RUNC_ROOT]", path=True),
    Opt(("--kubelet-state",), "kubelet_state",
        "kubelet's cpu_manager_state (read only). [env: VMPIN_KUBELET_STATE]", path=True),
    Opt(("--kubelet-config",), "kubelet_config",
        "kubelet's configuration file (read only): its reserved CPUs and CPU manager policy"
        " options, which vmpin's own allocation follows (docs/allocation.md). Default"
        " /var/lib/kubelet/config.yaml. [env: VMPIN_KUBELET_CONFIG]", path=True),
    Opt(("--publish-dir",), "publish_dir",
        "[env: VMPIN_PUBLISH_DIR] Host dir shared with each guest, where guest maps are"
        " published (<dir>/<sandbox>/mounts/vmpin/guest-map.json; may hold a {sandbox}"
        " template).", path=True),
    Opt(("--kata-config",), "kata_config",
        "[env: VMPIN_KATA_CONFIG] Kata's configuration files, read for its own vCPU pinning"
        " ([runtime] enable_vcpus_pinning): ':'-separated, 'A|B' = the first of A and B that"
        " exists, '*' in a file name; 'none' (default: Kata's and kata-deploy's paths).",
        path=True),
    Opt(("--helper-policy",), "helpers",
        "[env: VMPIN_HELPER_POLICY] Emulator/iothread/vhost placement: share (the sandbox"
        " mask), isolate, none."),
    Opt(("--housekeeping",), "housekeeping",
        "CPU list for helper threads under 'isolate'. [env: VMPIN_HOUSEKEEPING]"),
    Opt(("--vcpu-policy",), "vcpus", "auto (1:1 where correct) or float. [env: VMPIN_VCPU_POLICY]"),
    Opt(("--guest-float",), "guest_float",
        "[env: VMPIN_GUEST_FLOAT] Guest map under a floating plan: all vCPUs, or a"
        " proportional share."),
    Opt(("--libvirt",), "libvirt",
        "[env: VMPIN_LIBVIRT] libvirt connections whose domains are sandboxes:"
        " comma-separated URIs, 'kubevirt' for every virt-launcher's daemon, 'none'"
        " (default qemu:///system when its daemon runs; docs/libvirt.md)."),
)
G = {o.key: o for o in GLOBALS}

JSON = Opt(("--json",), "as_json", "Print JSON for scripts instead of a table.", value=False)
CPUSET_CPUS = Opt(("--cpuset-cpus",), "cpuset_cpus",
                  "New CPU list, e.g. 0-3,8 (as runc update).")
RESOURCES = Opt(("-r", "--resources"), "resources",
                "OCI LinuxResources JSON file, or - for stdin (as runc update -r).")
KUBECONFIG = Opt(("--kubeconfig",), "kubeconfig",
                 "kubeconfig for the Kubernetes API (default: in-cluster, $KUBECONFIG).",
                 envvar="VMPIN_KUBECONFIG")
#: ``serve``'s options (issue 14: typer and pydantic are ~7 MB of the agent's RSS)
INTERVAL = Opt(("--interval",), "interval", "Seconds between full repair passes.",
               convert=float, default=5.0)
WORKERS = Opt(("--workers",), "workers",
              "Kept for compatibility (1-64): passes are node-wide, one planner.",
              convert=int, default=2)
METRICS_PORT = Opt(("--metrics-port",), "metrics_port",
                   "Prometheus metrics port (0 = off).", convert=int, default=9464)
METRICS_ADDRESS = Opt(("--metrics-address",), "metrics_address",
                      "Address the metrics port binds: 127.0.0.1 (the default) keeps it on the"
                      " node; the node's IP (or 0.0.0.0) lets a cluster Prometheus scrape it.",
                      envvar="VMPIN_METRICS_ADDRESS")
NODE_NAME = Opt(("--node-name",), "node_name",
                "This node's name in the API (default: hostname).", envvar="NODE_NAME")
ONCE = Opt(("--once",), "once", "Run one repair pass and exit.", value=False)
CONTAINER = Arg("CONTAINER", "container", "Container id.")
SANDBOX = Arg("SANDBOX", "sandbox", "Sandbox id.")

#: the commands vmpin.entry runs without typer (issue 14: update and the read commands;
#: issue 28: reconcile --once, as lean as update).
FAST = {
    "update": Command((CONTAINER,), (CPUSET_CPUS, RESOURCES, JSON)),
    "reconcile": Command((), (ONCE, JSON)),
    "containers": Command((), (JSON,)),
    "sandboxes": Command((), (JSON,)),
    "show": Command((SANDBOX,), (JSON,)),
    "audit": Command((), (JSON,)),
    "serve": Command((), (INTERVAL, WORKERS, METRICS_PORT, METRICS_ADDRESS, KUBECONFIG,
                          NODE_NAME)),
}


def _take(
    argv: list[str], i: int, table: dict[str, Opt]
) -> tuple[Opt, str | bool | float, int] | None:
    """The option at ``argv[i]``, its value and the next index; None when not plainly one."""
    name, eq, value = argv[i].partition("=")
    opt = table.get(name)
    if opt is None:
        return None
    if not opt.value:
        return None if eq else (opt, True, i + 1)
    if eq:
        nxt = i + 1
    elif i + 1 >= len(argv) or (argv[i + 1].startswith("-") and argv[i + 1] != "-"):
        return None  # click would take it as the value anyway; let it say so
    else:
        value, nxt = argv[i + 1], i + 2
    if opt.convert is not None:
        try:
            return opt, opt.convert(value), nxt
        except ValueError:
            return None
    return opt, value, nxt


def _flags(opts: tuple[Opt, ...]) -> dict[str, Opt]:
    return {flag: o for o in opts for flag in o.flags}


def split_globals(argv: list[str]) -> tuple[dict[str, str], list[str]] | None:
    """Take the leading global options off ``argv``: ({key: value}, the rest); None when an
    option leads that is not one, or repeats."""
    table = _flags(GLOBALS)
    given: dict[str, str] = {}
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        took = _take(argv, i, table)
        if took is None or took[0].key in given:
            return None
        opt, value, i = took
        given[opt.key] = str(value)
    return given, argv[i:]


def parse(
    argv: list[str],
) -> tuple[dict[str, str], str, dict[str, str | bool | float | None]] | None:
    """``argv`` as the fast route runs it: (global options, command, its values); None when
    it is anything else -- another command, --help, an unknown or repeated option, a missing
    or extra argument -- which then goes to typer, the one that explains usage."""
    split = split_globals(argv)
    if split is None or not split[1] or split[1][0] not in FAST:
        return None
    given, rest = split
    name, spec = rest[0], FAST[rest[0]]
    table = _flags(spec.options)
    values: dict[str, str | bool | float | None] = {
        o.key: o.default if o.value else False for o in spec.options
    }
    seen: set[str] = set()
    positional: list[str] = []
    i = 1
    while i < len(rest):
        if rest[i].startswith("-") and rest[i] != "-":
            took = _take(rest, i, table)
            if took is None or took[0].key in seen:
                return None
            opt, value, i = took
            seen.add(opt.key)
            values[opt.key] = value
        else:
            positional.append(rest[i])
            i += 1
    if len(positional) != len(spec.args):
        return None
    values.update((a.key, v) for a, v in zip(spec.args, positional, strict=True))
    return given, name, values
