"""The commands an operator runs to set a node up, check it and look around: ``install``,
``uninstall``, ``doctor``, ``demo``, ``schema`` and ``cluster``.

Each imports what only it needs (``schema`` pydantic, ``cluster`` the Kubernetes client).
"""

from __future__ import annotations

import sys
import time

from vmpin.core.errors import KubeError, SpecError
from vmpin.service.commands import Ctx, echo, emit, table
from vmpin.wire.views import VIEWS

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.lean.records)
if TYPE_CHECKING:
    from typing import Any


def install(
    c: Ctx, root: str, prefix: str, runtime: str, env: list[str] | None, hooks_dir: str,
    containerd_config: str, python: str | None, ctr: str | None,
) -> int:  # fmt: skip
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
    return _print_report(run_install(root, opts))


def uninstall(c: Ctx, root: str, prefix: str) -> int:
    from vmpin.service.install import uninstall as run_uninstall

    return _print_report(run_uninstall(root, prefix))


def _command(value: str | None) -> list[str] | None:
    """A command line option: None = the default, "none" = [] (do not run one)."""
    import shlex

    if value is None:
        return None
    return [] if value.strip() == "none" else shlex.split(value)


def _print_report(report: Any) -> int:
    for line in report.lines:
        echo(line)
    sys.stdout.flush()  # (before the warnings, as the lines came first)
    for line in report.warnings:
        print(f"warning: {line}", file=sys.stderr)
    return 0


def doctor(c: Ctx, dry_run: bool) -> int:
    from vmpin.service.doctor import doctor as run_doctor

    ok, lines = run_doctor(c.paths, repair=not dry_run)
    for line in lines:
        echo(line)
    return 0 if ok else 1


def demo(c: Ctx) -> int:
    from vmpin.service.demo import main as run_demo

    code: int = run_demo()
    return code


def schema(c: Ctx, command: str | None) -> int:
    import json

    from vmpin.wire.viewschema import schema as view_schema

    if command is None:
        data: Any = {name: view_schema(name) for name in VIEWS}
    elif command not in VIEWS:
        raise SpecError(f"no --json view for {command!r} (one of: {', '.join(VIEWS)})")
    else:
        data = view_schema(command)
    echo(json.dumps(data, indent=2, sort_keys=False))
    return 0


def cluster(c: Ctx, kubeconfig: str | None, as_json: bool) -> int:
    from vmpin.reconcile.clusterview import cluster_rows
    from vmpin.runtimes import kubeapi

    api = kubeapi.connect(kubeconfig)
    if api is None:
        raise KubeError("no Kubernetes API credentials (in-cluster, --kubeconfig or $KUBECONFIG)")
    rows = cluster_rows(kubeapi.list_reports(api), time.time())
    if as_json:
        emit(c, rows, "cluster")
    else:
        table(
            ["NODE", "STATE", "SANDBOXES", "VIOLATIONS", "CONFLICTS", "EXCLUSIVE", "HEARTBEAT"],
            [[r["node"], r["state"], r["sandboxes"], r["violations"], r["conflicts"],
              r["exclusive_cpus"],
              None if r["heartbeat_age"] is None else f"{r['heartbeat_age']:.0f}s ago"]
             for r in rows],
        )  # fmt: skip
        for r in rows:
            for conflict in r["conflict_list"]:
                echo(f"{r['node']}: conflict: {conflict}")
    return 0 if all(r["state"] == "clean" for r in rows) else 1
