"""The typer app, built from :mod:`vmpin.service.clispec`'s table: every command's ``--help``,
and the usage error for what the table's parser does not accept.

:mod:`vmpin.entry` comes here only when :func:`vmpin.service.clispec.parse` refused argv
(``--help``, no command, a typo, a missing argument, a value its type refuses): typer then
renders the help or the usage error (exit 2), as for any typer program.  Should click accept
what the parser refused (a corner of click's grammar the parser does not read), the command
still runs its one body, through :func:`vmpin.service.commands.run`, with click's values.
Nothing is declared here: names, types, defaults, environment variables and help are the
table's.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Annotated, Any, Optional

import typer

from vmpin import __version__
from vmpin.guest.follower import follow_main
from vmpin.guest.hook import main as guest_hook
from vmpin.service.clispec import APP_HELP, COMMANDS, GUEST_HELP, VERSION_HELP, Arg, Opt
from vmpin.service.commands import run
from vmpin.wire.argv import GLOBALS

__all__ = ["app", "explain"]

app = typer.Typer(
    name="vmpin",
    help=APP_HELP,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
guest_app = typer.Typer(help=GUEST_HELP)
app.add_typer(guest_app, name="guest")


def _param(name: str, annotation: Any, default: Any = inspect.Parameter.empty) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default,
                             annotation=annotation)  # fmt: skip


def _option(o: Opt) -> inspect.Parameter:
    info = typer.Option(*o.flags, help=o.help, envvar=o.envvar, metavar=o.metavar)
    if not o.value:
        return _param(o.key, Annotated[bool, info], False)
    if o.convert is not None:
        return _param(o.key, Annotated[o.convert, info], o.default)
    if o.multiple:
        return _param(o.key, Annotated[Optional[list[str]], info], None)
    if o.required:
        return _param(o.key, Annotated[str, info])
    if o.default is not None:
        return _param(o.key, Annotated[str, info], o.default)
    return _param(o.key, Annotated[Optional[str], info], None)


def _argument(a: Arg) -> inspect.Parameter:
    info = typer.Argument(metavar=a.metavar, help=a.help)
    if a.required:
        return _param(a.key, Annotated[str, info])
    return _param(a.key, Annotated[Optional[str], info], None)


def _declared(fn: Callable[..., None], params: list[inspect.Parameter]) -> Callable[..., None]:
    """``fn`` (which takes ``ctx`` and keywords) with ``params`` as its signature: what typer
    reads a command's parameters from."""
    params = [_param("ctx", typer.Context), *params]
    fn.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    fn.__annotations__ = {p.name: p.annotation for p in params}
    return fn


def _version(value: bool) -> None:
    if value:
        typer.echo(f"vmpin {__version__}")
        raise typer.Exit()


def _main(ctx: typer.Context, version: bool = False, **given: str | None) -> None:
    ctx.obj = {key: value for key, value in given.items() if value is not None}


_main.__doc__ = APP_HELP
app.callback()(_declared(_main, [
    *(_param(key, Annotated[Optional[str], typer.Option(flag, help=help)], None)
      for flag, (key, help) in GLOBALS.items()),
    _param("version", Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                   help=VERSION_HELP)], False),
]))  # fmt: skip


def _command(name: str) -> Callable[..., None]:
    def body(ctx: typer.Context, **values: Any) -> None:
        raise typer.Exit(run(ctx.find_root().obj, name, values))

    def guest(ctx: typer.Context, **values: Any) -> None:
        """The guest's commands read their own argv (vmpin.entry hands it over)."""
        if name == "guest hook":
            raise typer.Exit(guest_hook([values["stage"]]))
        once = ["--once"] if values["once"] else []
        raise typer.Exit(follow_main([*once, "--interval", str(values["interval"])]))

    spec = COMMANDS[name]
    return _declared(guest if spec.own else body,
                     [*map(_argument, spec.args), *map(_option, spec.options)])


for _name, _spec in COMMANDS.items():
    _group, _, _sub = _name.rpartition(" ")
    (guest_app if _group else app).command(
        _sub,
        help=_spec.help,
        context_settings={"ignore_unknown_options": True} if _spec.loose else None,
    )(_command(_name))


def explain(args: list[str]) -> int:
    """Let typer answer ``args`` (help, or a usage error); the exit code."""
    try:
        app(args=args, prog_name="vmpin", standalone_mode=True)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0
