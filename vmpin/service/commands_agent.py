"""The agent's commands' bodies: ``serve`` (the node agent), ``reconcile --once`` (one of its
repair passes, in this process), ``status`` (its health) and ``hook`` behind an option that
is no host root.

Each imports what only it needs: the agent's modules are ``serve``'s alone.
"""

from __future__ import annotations

from vmpin.core.errors import SpecError
from vmpin.service.commands import Ctx, echo, emit
from vmpin.wire import views

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.lean.records)
if TYPE_CHECKING:
    from typing import Any


def serve(
    c: Ctx,
    interval: float,
    workers: int,
    metrics_port: int,
    kubeconfig: str | None,
    node_name: str | None,
    metrics_address: str | None = None,
) -> int:
    """Run the node agent (:func:`vmpin.service.agent.serve`) until SIGTERM / SIGINT."""
    from vmpin.service.agent import serve as serve_agent

    c.one_shot = False  # a libvirt daemon that starts later is the agent's to handle
    code: int = serve_agent(c, interval=interval, workers=workers, metrics_port=metrics_port,
                            metrics_address=metrics_address or "127.0.0.1",
                            kubeconfig=kubeconfig, node_name=node_name)  # fmt: skip
    return code


def reconcile(c: Ctx, once: bool, as_json: bool) -> int:
    """One repair pass: re-pin whatever differs from the plan, touch nothing already right."""
    if not once:
        raise SpecError("reconcile needs --once (the continuous loop is `vmpin serve`)")
    with c.store() as store:
        reports = c.reconciler(store).reconcile(apply=True)
    out: list[dict[str, Any]] = [
        views.reconcile_item(
            id=r.id,
            runtime=r.runtime,
            mode=r.mode,
            mask=r.mask.to_list(),
            repaired=r.changed + sum(1 for d in r.cgroup_drift if d.get("repaired")),
            vanished=r.vanished,
            errors=r.errors,
            threads=[t.to_json() for t in r.threads if t.action != "ok"],
        )
        for r in reports
    ]
    if as_json:
        emit(c, out, "reconcile")
    else:
        for o in out:
            state = "vanished" if o["vanished"] else f"{o['repaired']} repaired"
            echo(f"{o['id']}: {o['runtime']} {o['mode']} mask {o['mask'] or '-'}: {state}")
            for e in o["errors"]:
                echo(f"  error: {e}")
    return 1 if any(o["errors"] for o in out) else 0


def status(c: Ctx, as_json: bool) -> int:
    from vmpin.service.control import request
    from vmpin.state import journal

    reply = request(c.paths, {"op": "status"}, timeout=2.0)
    out = reply or views.status(
        ok=False,
        error=f"no agent answering on {c.paths.control_socket}",
        journal_pending=journal.backlog(c.paths.state_dir),
        journal_bad=journal.quarantined(c.paths.state_dir),
    )
    if as_json:
        emit(c, out, "status")
    elif reply:
        echo(" ".join(f"{k}={v}" for k, v in reply.items()))
    else:
        echo(out["error"])
        echo(f"journal_pending={out['journal_pending']} journal_bad={out['journal_bad']}")
    return 0 if reply and reply.get("ok") else 1


def hook(c: Ctx, stage: str, strict: bool) -> int:
    """``vmpin hook`` behind a global option that is no host root (``vmpin.entry`` runs the
    usual hook itself, leaner): the policy given here goes to the hook as an option."""
    from vmpin.service.hook import main as hook_main

    code: int = hook_main(c.hook_options(), [stage] + (["--strict"] if strict else []))
    return code
