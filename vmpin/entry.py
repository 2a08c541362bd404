"""The ``vmpin`` console script: a thin dispatcher that keeps ``vmpin hook`` lean.

A typer app costs ~70 ms to import on a small node, and the OCI hook runs on every container
start; so ``hook`` (and the in-guest ``guest hook`` and ``guest follow``, which run in a small
guest image) are recognised here, by hand, and never import typer, pydantic, psutil or
kubernetes.

``vmpin update`` and the read commands (``containers``, ``sandboxes``, ``show``, ``audit``)
take the same kind of fast route (issue 14): typer 0.29 imports pydantic and builds a
TypeAdapter per option on every run (~80 ms together, against ~8 ms for a bare interpreter),
which is most of what ``update`` costs.  ``serve`` takes it too: typer and pydantic would stay
in the agent's memory for its whole life (~7 MB of RSS) for parsing five options once.  Their
argv is parsed with the option table the typer app itself is declared from
(:mod:`vmpin.service.clispec`), and they run the very bodies the typer commands run
(:mod:`vmpin.service.commands`); anything not plainly one of them (--help, a typo, a missing
argument) goes to typer, which explains.  Everything else goes to
:mod:`vmpin.cli`.
"""

from __future__ import annotations

import os
import sys

#: global options that take a value, as in DESIGN.md (plus vmpin's own path extras).
#: The hook's and the guest's own copy of the host-root entries of vmpin.service.clispec.GLOBALS
#: (the guest path may load nothing the guest program does not ship, tests/guest/test_guest.py);
#: tests/service/test_cli.py checks the two agree.
GLOBAL_OPTIONS = {
    "--state-dir": "state_dir",
    "--vm-dir": "vm_dir",
    "--proc-root": "proc",
    "--sysfs-root": "sys",
    "--cgroup-root": "cgroup",
    "--runc-root": "runc_root",
    "--kubelet-state": "kubelet_state",
    "--publish-dir": "publish_dir",
    "--kata-config": "kata_config",
    "--kubelet-config": "kubelet_config",
}


def split_globals(argv: list[str]) -> tuple[dict[str, str], list[str]] | None:
    """Take leading global options off ``argv``; None when something else leads."""
    opts: dict[str, str] = {}
    i = 0
    while i < len(argv) and argv[i].startswith("--"):
        name, eq, value = argv[i].partition("=")
        if name not in GLOBAL_OPTIONS:
            return None
        if not eq:
            if i + 1 >= len(argv):
                return None
            value = argv[i + 1]
            i += 1
        opts[GLOBAL_OPTIONS[name]] = value
        i += 1
    return opts, argv[i:]


def console() -> None:
    """The console script: :func:`main`, then a fast exit for the hooks.

    A hook has flushed what it had to say and committed what it had to write; skipping the
    interpreter's teardown (and SQLite's checkpoint on close, see vmpin.service.hook.run) is several
    milliseconds off every container start.

    A command of the fast route (update, the read commands) has closed its store too, and
    started no thread: its teardown (~3-4 ms at 500 sandboxes, a third of a bare interpreter:
    issue 14) is skipped the same way once its output is out.  Where stdout cannot take it (a
    reader that went away), the interpreter's own teardown reports that, as it always did.
    """
    global _console
    _console = True
    code = main()
    if _hook_ran:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if _fast_ran and _single_threaded():
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except OSError:
            sys.exit(code)
        os._exit(code)
    sys.exit(code)


def _single_threaded() -> bool:
    """No thread but this one (the threading module is not even loaded on the fast route)."""
    threading = sys.modules.get("threading")
    return threading is None or threading.active_count() == 1


#: the installed hook file runs the OCI hook and nothing else
HOOK_FILE_USAGE = (
    "usage: vmpin-hook [GLOBAL OPTIONS] hook [--strict] STAGE  (the installed hook file;"
    " the vmpin command line is not installed with it)"
)


def hook_file() -> None:
    """The installed hook file's entry point (:mod:`vmpin.service.hookfile`, ``vmpin
    install``): ``[GLOBAL OPTIONS] hook [--strict] STAGE`` and nothing else, since the file
    carries only the hook's modules.  Fail-open like the hook itself: anything else is one
    line on stderr and exit 0 (1 with ``--strict``).  Leaves with a fast exit, as
    :func:`console` does after a hook (never returns)."""
    args = sys.argv[1:]
    split = split_globals(args)
    if split is None or split[1][:1] != ["hook"] or "--help" in split[1]:
        print(HOOK_FILE_USAGE, file=sys.stderr)
        code = 1 if "--strict" in args else 0
    else:
        code = main(args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


_hook_ran = False
_fast_ran = False
#: main() runs as the process's command (console), not called by a test or a bench
_console = False


def main(argv: list[str] | None = None) -> int:
    global _hook_ran, _fast_ran
    args = sys.argv[1:] if argv is None else argv
    split = split_globals(args)
    if split is not None:
        opts, rest = split
        if rest[:1] == ["hook"] and "--help" not in rest:
            # the hook's modules from one file (vmpin.service.codecache), only as the command
            cache = None
            if _console:
                import gc

                # off for good (the process leaves with os._exit): a collection after the
                # hook would close its store, whose checkpoint the hook leaves undone on
                # purpose (vmpin.service.hook.reconcile_here)
                gc.disable()
                from vmpin.service.codecache import install, save

                cache = install()
            from vmpin.service.hook import main as hook_main

            _hook_ran = True

            code: int = hook_main(opts, rest[1:])
            if cache is not None:
                save(cache)  # (after a miss only; never raises: not a container start's end)
            return code
        if rest[:2] == ["guest", "hook"] and "--help" not in rest:
            from vmpin.guest.hook import main as guest_main

            _hook_ran = True

            guest_code: int = guest_main(rest[2:])
            return guest_code
        if rest[:2] == ["guest", "follow"] and "--help" not in rest:
            # The in-guest follower: as lean as the guest hook (a small guest image).
            from vmpin.guest.follower import follow_main

            _hook_ran = True

            follow_code: int = follow_main(rest[2:])
            return follow_code
    import gc

    # A fast-route command is one short process that frees what it drops by reference
    # counting: the cyclic collector (1-3 ms of collections finding nothing in a read command
    # at 500 sandboxes: imports, the store's rows, the view) stays off for its life, as in
    # the hooks.  Anything else (typer, serve) gets it back.
    paused = _console and gc.isenabled()
    if paused:
        gc.disable()
    from vmpin.service import clispec

    parsed = clispec.parse(args)
    if parsed is not None:
        # update and the read commands: the typer app's own bodies, without typer or pydantic
        from vmpin.service.commands import fast

        _fast_ran = True
        return fast(args, *parsed)
    if paused:
        gc.enable()
    from vmpin.cli import run

    return run(args)


if __name__ == "__main__":
    console()
