"""The command lines of ``vmpin guest hook`` and ``vmpin guest follow``, and their defaults.

Hand-rolled, not argparse: argparse costs the hook's start time (it runs at every container
start), and its errors exit 2 where the hook must stay fail-open.  Both commands take the
same path options from the same environment variables, so a hook and a follower configured
alike agree on where the map and the records are.
"""

from __future__ import annotations

import os
from typing import Mapping, NamedTuple

from vmpin.guest.common import GuestError
from vmpin.wire.guestmap import DEFAULT_GUEST_MAP

ENV_MAP = "VMPIN_GUEST_MAP"
ENV_PROC_ROOT = "VMPIN_GUEST_PROC_ROOT"
ENV_CGROUP_ROOT = "VMPIN_GUEST_CGROUP_ROOT"
ENV_WAIT = "VMPIN_GUEST_WAIT"
ENV_STATE = "VMPIN_GUEST_STATE"

#: where the hook records what it pinned, for ``vmpin guest follow``: runtime state, on the
#: guest's tmpfs, gone with the VM like the containers it describes.
DEFAULT_GUEST_STATE = "/run/vmpin-guest"
#: ``vmpin guest follow``: seconds between looks at the map, by default.
DEFAULT_INTERVAL = 2.0

#: every OCI stage; all but poststop pin (pinning twice is harmless, and a later stage
#: catches a map that was published after the first one ran).
STAGES = ("prestart", "createRuntime", "createContainer", "startContainer", "poststart", "poststop")

USAGE = (
    "usage: vmpin guest hook [--strict] [--verbose] [--widen-parents] [--wait SECONDS]\n"
    "                        [--map FILE] [--state DIR] [--proc-root DIR] [--cgroup-root DIR]\n"
    "                        STAGE\n"
    "  STAGE: " + ", ".join(STAGES) + ";\n"
    "  the container's OCI state (id, pid) on stdin.\n"
    f"  --map FILE        the published map (${ENV_MAP};\n"
    f"                    default {DEFAULT_GUEST_MAP})\n"
    f"  --wait SECONDS    wait up to this long for the map to name the container (${ENV_WAIT})\n"
    "  --widen-parents   cgroup v1: add the CPUs to ancestors that lack them (never silently)\n"
    f"  --state DIR       where to record what was pinned, for `vmpin guest follow`\n"
    f"                    (${ENV_STATE}; default {DEFAULT_GUEST_STATE}); poststop removes it\n"
    f"  --proc-root DIR, --cgroup-root DIR   other roots, for tests (${ENV_PROC_ROOT},\n"
    f"                    ${ENV_CGROUP_ROOT}; default /proc, /sys/fs/cgroup)\n"
    "  --strict          exit 1 on failure (default: one line on stderr, exit 0)\n"
    "  --verbose         also report what was done, and non-exact maps"
)

FOLLOW_USAGE = (
    "usage: vmpin guest follow [--once] [--interval SECONDS] [--strict] [--verbose]\n"
    "                          [--widen-parents] [--map FILE] [--state DIR]\n"
    "                          [--proc-root DIR] [--cgroup-root DIR]\n"
    "  Re-pin the containers the guest hook recorded (in --state) whenever the host\n"
    "  republishes their entry with another generation or other vCPUs; forget records\n"
    "  whose process is gone.\n"
    "  --once            one pass, then exit (0; 1 with --strict when something failed)\n"
    f"  --interval SECONDS  how often to look at the map (default {DEFAULT_INTERVAL:g}); SIGTERM\n"
    "                    or SIGINT exits 0\n"
    f"  --map FILE, --state DIR   as for `vmpin guest hook` (${ENV_MAP}, ${ENV_STATE})\n"
    "  --widen-parents, --proc-root, --cgroup-root   as for `vmpin guest hook`\n"
    "  --verbose         also report each re-pin and each forgotten record"
)


class Options(NamedTuple):
    stage: str
    strict: bool
    verbose: bool
    widen_parents: bool
    wait: float
    map_path: str
    proc: str
    cgroup_root: str
    state_dir: str = DEFAULT_GUEST_STATE


def _parse(
    args: list[str], flags: dict[str, bool], values: dict[str, str]
) -> tuple[dict[str, bool], dict[str, str], list[str]]:
    """Options in any order, ``--name value`` or ``--name=value``; the rest positional.

    Hand-rolled (argparse costs the hook's start time, and its errors exit 2 where the hook
    must stay fail-open); shared by ``guest hook`` and ``guest follow``.
    """
    flags, values = dict(flags), dict(values)
    positional: list[str] = []
    i = 0
    while i < len(args):
        name, eq, value = args[i].partition("=")
        if name in flags and not eq:
            flags[name] = True
        elif name in values:
            if not eq:
                if i + 1 >= len(args):
                    raise GuestError(f"{name} needs a value")
                i += 1
                value = args[i]
            values[name] = value
        elif args[i].startswith("-"):
            raise GuestError(f"unknown option {args[i]}")
        else:
            positional.append(args[i])
        i += 1
    return flags, values, positional


def _seconds(name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise GuestError(f"{name} {text!r} is not a number of seconds") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise GuestError(f"{name} {text!r} is not a number of seconds")
    return value


def _path_values(env: Mapping[str, str]) -> dict[str, str]:
    """The path options both commands take, each defaulting to its environment variable."""
    return {
        "--map": env.get(ENV_MAP) or DEFAULT_GUEST_MAP,
        "--state": env.get(ENV_STATE) or DEFAULT_GUEST_STATE,
        "--proc-root": env.get(ENV_PROC_ROOT) or "/proc",
        "--cgroup-root": env.get(ENV_CGROUP_ROOT) or "/sys/fs/cgroup",
    }


def parse_args(args: list[str], env: Mapping[str, str] | None = None) -> Options:
    """Options in any order around STAGE; each path also from its environment variable."""
    env = os.environ if env is None else env
    flags, values, stages = _parse(
        args,
        {"--strict": False, "--verbose": False, "-v": False, "--widen-parents": False},
        {**_path_values(env), "--wait": env.get(ENV_WAIT) or "0"},
    )
    if len(stages) != 1 or stages[0] not in STAGES:
        raise GuestError(f"expected one STAGE of {', '.join(STAGES)}, got {stages or 'none'}")
    wait = _seconds("--wait", values["--wait"])
    return Options(
        stages[0],
        flags["--strict"],
        flags["--verbose"] or flags["-v"],
        flags["--widen-parents"],
        max(0.0, wait),
        values["--map"],
        values["--proc-root"],
        values["--cgroup-root"],
        values["--state"],
    )


class FollowOptions(NamedTuple):
    once: bool
    interval: float
    strict: bool
    verbose: bool
    widen_parents: bool
    map_path: str
    state_dir: str
    proc: str
    cgroup_root: str


def parse_follow_args(args: list[str], env: Mapping[str, str] | None = None) -> FollowOptions:
    """``vmpin guest follow`` options; the paths as for the hook, from the same variables."""
    env = os.environ if env is None else env
    flags, values, extra = _parse(
        args,
        {
            "--once": False,
            "--strict": False,
            "--verbose": False,
            "-v": False,
            "--widen-parents": False,
        },
        {**_path_values(env), "--interval": str(DEFAULT_INTERVAL)},
    )
    if extra:
        raise GuestError(f"unexpected argument {extra[0]!r}")
    interval = _seconds("--interval", values["--interval"])
    if interval <= 0:
        raise GuestError(f"--interval {values['--interval']!r} must be more than 0 seconds")
    return FollowOptions(
        flags["--once"],
        interval,
        flags["--strict"],
        flags["--verbose"] or flags["-v"],
        flags["--widen-parents"],
        values["--map"],
        values["--state"],
        values["--proc-root"],
        values["--cgroup-root"],
    )
