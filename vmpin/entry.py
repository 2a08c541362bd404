"""The ``vmpin`` console script: find the command in argv and run it.

Every command runs one way: :func:`vmpin.service.clispec.parse` reads argv with the one table
of commands and options, and :func:`vmpin.service.commands.run` runs the command's body.  What
that parser does not accept (``--help``, a typo, a missing argument) goes to the typer app
(:mod:`vmpin.cli`), built from the same table, which explains it; typer is imported for that
alone (with pydantic, ~80 ms: most of what ``vmpin update`` or a read command would cost).

What is here besides is kept for docs/benchmarks.md's figures, and each part says so:

- The hooks -- ``vmpin [HOST ROOTS] hook STAGE`` at every container start, ``guest hook``
  and ``guest follow`` in a small guest image -- are picked out before anything else is
  imported, and import their own modules only: never the table, typer, pydantic, psutil or
  kubernetes.  The global options (:mod:`vmpin.wire.argv`) are read only when argv starts
  with one (the runtimes run ``vmpin hook STAGE``); the guest's commands parse their own
  options, and the hook with a global option that is no host root runs as a command
  (:func:`vmpin.service.commands_agent.hook`).
- A command runs with the cyclic collector off: it is one short process that frees what it
  drops by reference counting, and collections finding nothing were 1-3 ms of a read command
  at 500 sandboxes (imports, the store's rows, the view).  ``serve`` lives on, and keeps it.
- :func:`console` leaves with ``os._exit`` once the output is out and no thread runs: the
  interpreter's teardown is several ms of every hook (and SQLite's checkpoint on close, which
  the hook leaves undone on purpose: vmpin.service.hook.run), ~3-4 ms of a read command at
  500 sandboxes (issue 14), for nothing.
"""

from __future__ import annotations

import os
import sys


def console() -> None:
    """The console script: :func:`main`, then the fast exit (see the module docstring).
    Where stdout cannot take the output (a reader that went away), the interpreter's own
    teardown reports that, as it always did."""
    global _console
    _console = True
    code = main()
    if _ran == "hook":
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if _ran and _single_threaded():
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except OSError:
            sys.exit(code)
        os._exit(code)
    sys.exit(code)


def _single_threaded() -> bool:
    """No thread but this one (the threading module is not even loaded by most commands)."""
    threading = sys.modules.get("threading")
    return threading is None or threading.active_count() == 1


#: the installed hook file runs the OCI hook and nothing else
HOOK_FILE_USAGE = (
    "usage: vmpin-hook [GLOBAL OPTIONS] hook [--strict] STAGE  (the installed hook file;"
    " the vmpin command line is not installed with it)"
)


def hook_file() -> None:
    """The installed hook file's entry point (:mod:`vmpin.service.hookfile`, ``vmpin
    install``): ``[HOST ROOTS] hook [--strict] STAGE`` and nothing else, since the file
    carries only the hook's modules.  Fail-open like the hook itself: anything else is one
    line on stderr and exit 0 (1 with ``--strict``).  Leaves with a fast exit, as
    :func:`console` does after a hook (never returns)."""
    args = sys.argv[1:]
    split = _leading(args)
    if split is None or split[1][:1] != ["hook"] or "--help" in split[1] or not split[2]:
        print(HOOK_FILE_USAGE, file=sys.stderr)
        code = 1 if "--strict" in args else 0
    else:
        code = main(args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


#: what main() ran: "" nothing yet, "hook" a hook, "command" a command
_ran = ""
#: main() runs as the process's command (console), not called by a test or a bench
_console = False


def _leading(args: list[str]) -> tuple[dict[str, str], list[str], bool] | None:
    """The leading global options of ``args`` by key, the rest, and whether those options
    are all host roots (what a hook run this way takes); None when another option leads.
    The table is read only when an option leads."""
    if args[:1] == [] or args[0][:1] != "-":
        return {}, args, True
    from vmpin.wire.argv import GLOBALS, HOST_ROOTS, split_globals

    split = split_globals(args, dict.fromkeys(GLOBALS, True))
    if split is None:
        return None
    given, rest = split
    roots = all(flag in HOST_ROOTS for flag in given)
    return {GLOBALS[flag][0]: str(value) for flag, value in given.items()}, rest, roots


def main(argv: list[str] | None = None) -> int:
    """Run ``argv`` (default: the process's); its exit code."""
    global _ran
    args = sys.argv[1:] if argv is None else argv
    split = _leading(args)
    if split is not None and "--help" not in split[1]:
        opts, rest, roots = split
        if rest[:1] == ["hook"] and roots:
            cache = None
            if _console:
                import gc

                # off for good (the process leaves with os._exit): a collection after the
                # hook would close its store, whose checkpoint the hook leaves undone on
                # purpose (vmpin.service.hook.reconcile_here)
                gc.disable()
                # the hook's modules from one file (vmpin.lean.codecache), only as the
                # process's command
                from vmpin.lean.codecache import install, save

                cache = install()
            from vmpin.service.hook import main as hook_main

            _ran = "hook"
            code: int = hook_main(opts, rest[1:])
            if cache is not None:
                save(cache)  # (after a miss only; never raises: not a container start's end)
            return code
        # the guest's own commands parse their own options, and take nothing of the host's
        if rest[:2] == ["guest", "hook"]:
            from vmpin.guest.hook import main as guest_main

            _ran = "hook"
            guest_code: int = guest_main(rest[2:])
            return guest_code
        if rest[:2] == ["guest", "follow"]:
            from vmpin.guest.follower import follow_main

            _ran = "hook"
            follow_code: int = follow_main(rest[2:])
            return follow_code
    import gc

    collecting = _console and gc.isenabled()
    cache = None
    if _console:
        if collecting:
            gc.disable()
        # a command's modules from the hooks' code cache too: ~12 M of ``vmpin update``'s
        # ~120 M instructions were the import system's (docs/benchmarks.md)
        from vmpin.lean.codecache import install, save, uninstall

        cache = install()
    from vmpin.service.clispec import parse

    parsed = parse(args)
    if parsed is None or parsed[1] == "serve":
        # typer's explanation, or the agent: a long life that imports as any program does
        if cache is not None:
            uninstall(cache)
            cache = None
        if collecting:
            gc.enable()
    if parsed is None:
        from vmpin.cli import explain

        return explain(args)
    from vmpin.service.commands import run

    _ran = "command"
    code = run(*parsed)
    if cache is not None:
        save(cache)  # (after a miss only; never raises)
    return code


if __name__ == "__main__":
    console()
