""":func:`run`: the one way a command runs, and the one place its errors become a message and
an exit code; and what every command's body takes (:class:`Ctx`) and prints with.

Argv is read by :func:`vmpin.service.clispec.parse` (or, for what it refuses, by the typer
app, which explains it), and ``run`` hands the values to the command's body under the
option's key: each body prints and returns its exit code.  The bodies live by group in
``commands_update`` (``update``), ``commands_read`` (the read views), ``commands_agent``
(``serve``, ``reconcile``, ``status``, ``hook``) and ``commands_admin`` (``install``,
``doctor``, ``schema``, ``cluster`` ...): the clispec table names each command's module, and
``run`` imports that one alone, so ``update`` does not load the read commands' code.  Free of
typer and pydantic at import (issue 14: a read command or ``update`` would pay ~80 ms for
them); a body imports what only it needs.

``--json`` views are checked against their pydantic models (:mod:`vmpin.wire.viewschema`) only
when ``VMPIN_CHECK_VIEWS`` is set -- the tests set it for every vmpin they start -- because
importing pydantic would cost a read command four bare interpreters.
"""

from __future__ import annotations

import os
import sys

from vmpin.core.errors import VmpinError
from vmpin.service.clispec import COMMANDS
from vmpin.service.settings import Settings
from vmpin.wire import jsonio

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.lean.records)

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from typing import Any

    from vmpin.reconcile.domains import LibvirtDomains
    from vmpin.reconcile.reconciler import Reconciler
    from vmpin.state.reader import Reader
    from vmpin.state.store import Store


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
        from vmpin.state.store import Store

        return Store(self.paths.state_dir)

    def reader(self) -> Reader:
        """The store for read-only commands: never written.

        The node's state dir (the default one, or any that exists) holding nothing yet is a
        fresh node: the views show the host with nothing tracked, and one line on stderr says
        why.  A state dir named by hand that does not exist is an error (a typo must not read
        as an empty node)."""
        from vmpin.linux.paths import DEFAULTS
        from vmpin.state.store import Store

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


def json_text(data: Any) -> str:
    """A ``--json`` view's text, as printed (the agent writes the views it answers with it)."""
    return jsonio.dumps(data, indent=2)


def emit(c: Ctx, data: Any, view: str, text: str | None = None) -> None:
    """Print a ``--json`` view (checked against its schema first under VMPIN_CHECK_VIEWS);
    ``text``: its text, written already (by the agent)."""
    if c.settings.check_views:
        from vmpin.wire.viewschema import check

        check(view, jsonio.loads(text) if data is None and text is not None else data)
    echo(json_text(data) if text is None else text)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [[("-" if v is None or v == "" else str(v)) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    echo("  ".join(h.upper().ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip())
    for r in cells:
        echo("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip())


# -- running one ------------------------------------------------------------------------------
def body(name: str) -> Callable[..., int]:
    """Command ``name``'s body: the function of that name (``-`` read as ``_``) in the module
    vmpin.service.clispec.COMMANDS names for it, imported now (the guest's commands have
    none: vmpin.entry runs vmpin.guest's)."""
    module = __import__(f"vmpin.service.{COMMANDS[name].module}", fromlist=("_",))
    found: Callable[..., int] = getattr(module, name.replace("-", "_"))
    return found


def run(given: dict[str, str], name: str, values: dict[str, Any]) -> int:
    """Run command ``name`` (a key of vmpin.service.clispec.COMMANDS, or ``--version``) with
    the global options ``given`` and its values, as parsed; its exit code.

    The one place a command's errors become a message and a code: a VmpinError -- bad input
    or state -- is one line on stderr and the error's code (2); a database failure under a
    command, one line naming the store, and 2; an interrupt, 130; a reader that went away
    (a closed pipe), 1 and nothing more said.
    """
    if name == "--version":
        from vmpin import __version__

        echo(f"vmpin {__version__}")
        return 0
    try:
        try:
            return body(name)(Ctx.from_options(dict(given)), **values)
        except VmpinError as e:
            print(f"vmpin: error: {e}", file=sys.stderr)
            return e.exit_code
        except Exception as e:
            # (SQLite is loaded by whoever opened the store: a read answered by the agent,
            # or --version, does not load it for this clause)
            from vmpin.state.sqlite import sqlite3  # (without the package's, nor functools')

            if not isinstance(e, sqlite3.Error):
                raise
            # the database failed under a command: one line
            from vmpin.state.schema import state_error

            # the store the command used: the global option when given, else as Settings says
            state_dir = Settings.from_env({"state_dir": given.get("state_dir")}).paths.state_dir
            print(f"vmpin: error: {state_error(os.path.join(state_dir, 'state.db'), e)}",
                  file=sys.stderr)  # fmt: skip
            return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # nothing more to say, and no second error when Python flushes stdout at exit
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
