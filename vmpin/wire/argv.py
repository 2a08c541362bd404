"""vmpin's global options, and how one option is read: the part of its command line that
other programs write.

Runtimes run ``vmpin [GLOBAL OPTIONS] hook STAGE`` from the configs ``vmpin install`` writes
(hooks.d files, containerd's base specs), the installed hook file takes the same argv, and a
guest runs ``vmpin guest hook STAGE``: every path, the hooks' too, finds its command behind
these options, so they are declared once, here.  The rest of the command line (each
command's arguments and options, and all the help) is :mod:`vmpin.service.clispec`'s, which
takes :data:`GLOBALS` as its global options and :func:`take` as its grammar.

Lean, no imports: :mod:`vmpin.entry` reads it on the hook and guest paths too (the guest
program ships it, so the guest path loads nothing the guest image lacks).
"""

from __future__ import annotations

#: DESIGN.md's global options (each also an environment variable, read by Settings.from_env):
#: flag -> (key of Settings.from_env's overrides, help).  Each takes a value.
GLOBALS = {
    "--state-dir": ("state_dir", "Where vmpin keeps its SQLite state. [env: VMPIN_STATE_DIR]"),
    "--vm-dir": ("vm_dir", "Kata's VM dir: <vm-dir>/<sandbox>/{pid,qmp.sock}. [env: VMPIN_VM_DIR]"),
    "--proc-root": ("proc", "procfs root. [env: VMPIN_PROC_ROOT]"),
    "--sysfs-root": ("sys", "sysfs root. [env: VMPIN_SYSFS_ROOT]"),
    "--cgroup-root": ("cgroup", "cgroup filesystem root. [env: VMPIN_CGROUP_ROOT]"),
    "--runc-root": (
        "runc_root",
        "runc's state roots (runc --root), ':'-separated; DIR/* = every directory in"
        " DIR. Default /run/runc:/run/containerd/runc/* (containerd: one root per"
        " namespace). [env: VMPIN_RUNC_ROOT]",
    ),
    "--kubelet-state": (
        "kubelet_state",
        "kubelet's cpu_manager_state (read only). [env: VMPIN_KUBELET_STATE]",
    ),
    "--publish-dir": (
        "publish_dir",
        "[env: VMPIN_PUBLISH_DIR] Host dir shared with each guest, where guest maps are"
        " published (<dir>/<sandbox>/mounts/vmpin/guest-map.json; may hold a {sandbox}"
        " template).",
    ),
    "--kata-config": (
        "kata_config",
        "[env: VMPIN_KATA_CONFIG] Kata's configuration files, read for its own vCPU pinning"
        " ([runtime] enable_vcpus_pinning): ':'-separated, 'A|B' = the first of A and B that"
        " exists, '*' in a file name; 'none' (default: Kata's and kata-deploy's paths).",
    ),
    "--kubelet-config": (
        "kubelet_config",
        "kubelet's configuration file (read only): its reserved CPUs and CPU manager policy"
        " options, which vmpin's own allocation follows (docs/allocation.md). Default"
        " /var/lib/kubelet/config.yaml. [env: VMPIN_KUBELET_CONFIG]",
    ),
    "--helper-policy": (
        "helpers",
        "[env: VMPIN_HELPER_POLICY] Emulator/iothread/vhost placement: share (the sandbox"
        " mask), isolate, none.",
    ),
    "--housekeeping": (
        "housekeeping",
        "CPU list for helper threads under 'isolate'. [env: VMPIN_HOUSEKEEPING]",
    ),
    "--vcpu-policy": ("vcpus", "auto (1:1 where correct) or float. [env: VMPIN_VCPU_POLICY]"),
    "--guest-float": (
        "guest_float",
        "[env: VMPIN_GUEST_FLOAT] Guest map under a floating plan: all vCPUs, or a"
        " proportional share.",
    ),
    "--libvirt": (
        "libvirt",
        "[env: VMPIN_LIBVIRT] libvirt connections whose domains are sandboxes:"
        " comma-separated URIs, 'kubevirt' for every virt-launcher's daemon, 'none'"
        " (default qemu:///system when its daemon runs; docs/libvirt.md).",
    ),
}
#: the host roots among them (HostPaths' fields): all a hook run as ``vmpin [ROOTS] hook``
#: (or the installed hook file) takes; with any other global option first, a hook goes the
#: way of every command (vmpin.entry)
HOST_ROOTS = ("--state-dir", "--vm-dir", "--proc-root", "--sysfs-root", "--cgroup-root",
              "--runc-root", "--kubelet-state", "--kubelet-config", "--publish-dir",
              "--kata-config")  # fmt: skip


def take(argv: list[str], i: int, flags: dict[str, bool]) -> tuple[str, str | None, int] | None:
    """The option at ``argv[i]`` as click reads it: (its flag, its value -- None for a flag --,
    the next index); None when ``argv[i]`` is no option of ``flags`` (flag -> takes a value)
    or is misused, which click then explains.

    click's grammar: ``--opt VALUE`` takes the next word whatever it is, ``--opt=VALUE``;
    a flag takes no ``=``; a one-letter option also reads ``-rVALUE`` (and ``-r=VALUE`` is
    ``VALUE``, as vmpin has always read it).
    """
    arg = argv[i]
    name, eq, value = arg.partition("=")
    takes = flags.get(name)
    if takes is None:
        if arg[1:2] != "-" and len(arg) > 2 and flags.get(arg[:2]):  # -rVALUE
            return arg[:2], arg[2:], i + 1
        return None
    if not takes:
        return None if eq else (name, None, i + 1)
    if eq:
        return name, value, i + 1
    return (name, argv[i + 1], i + 2) if i + 1 < len(argv) else None


def split_globals(
    argv: list[str], flags: dict[str, bool]
) -> tuple[dict[str, str | None], list[str]] | None:
    """The leading options of ``argv`` that are ``flags`` (a table as for :func:`take`),
    as {flag: value} (the last of a repeated one, as click keeps), and the rest; None when
    a leading option is not one of them."""
    given: dict[str, str | None] = {}
    i = 0
    while i < len(argv) and argv[i][:1] == "-" and argv[i] != "-":
        took = take(argv, i, flags)
        if took is None:
            return None
        flag, value, i = took
        given[flag] = value
    return given, argv[i:]
