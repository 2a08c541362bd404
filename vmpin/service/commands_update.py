"""``vmpin update``'s body: record a container's new CPU set (or a libvirt domain's) and re-pin.

Apart from the other commands so that ``update``, a measured figure (docs/benchmarks.md),
loads no other command's code; what it runs is :mod:`vmpin.service.update`.
"""

from __future__ import annotations

import time

from vmpin.core.cpuset import listed as cpus
from vmpin.core.errors import SpecError, StateError
from vmpin.service.budget import BUDGET
from vmpin.service.commands import Ctx, echo, emit
from vmpin.service.update import UnknownContainer, parse_update, update_container

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.lean.records)
if TYPE_CHECKING:
    from typing import Any


def update(
    c: Ctx, container: str, cpuset_cpus: str | None, resources: str | None, as_json: bool
) -> int:
    if (cpuset_cpus is None) == (resources is None):
        raise SpecError("give exactly one of --cpuset-cpus LIST or -r FILE|-")
    # no wait on another process past the budget (a stopped agent: vmpin.service.budget)
    deadline = time.monotonic() + BUDGET
    try:
        result = update_container(
            c.paths,
            container,
            cpuset_cpus=cpuset_cpus,
            resources=resources,
            reconciler_factory=c.reconciler,
            deadline=deadline,
        )
    except UnknownContainer:
        # a container's name wins over a domain's: looked for only when none is (one store
        # opened for a container's update, not two; issue 28)
        domain = _update_domain(c, container, cpuset_cpus, resources, deadline)
        if domain is None:
            raise
        if as_json:
            emit(c, domain, "update")
        else:
            echo(f"{domain['id']}: cpus {domain['cpus'] or '-'} (libvirt domain metadata)")
        return 0
    if as_json:
        emit(c, result, "update")
    else:
        echo(
            f"{result['id']}: cpus {result['cpus'] or '-'} "
            f"(sandbox {result['sandbox']}: {result['applied_by']})"
        )
    return 0


def _update_domain(
    c: Ctx, key: str, cpuset_cpus: str | None, resources: str | None, deadline: float
) -> dict[str, Any] | None:
    """`vmpin update DOMAIN`: the mask goes into the domain's metadata (its one home), then
    the node is re-planned.  None when ``key`` is a tracked container or no domain."""
    # (no journal applied here: a container only journaled is no domain either, and
    # update_container applies it)
    from vmpin.state.store import Store

    with Store(c.paths.state_dir, ingest=False, deadline=deadline) as store:
        if store.container(key) is not None:
            return None
        domains = c.domains()
        found = domains.find(key) if domains is not None else None
        if found is None:
            return None
        conn, d = found
        new = parse_update(cpuset_cpus, resources)
        if new is not None:  # resources without cpu.cpus: nothing for vmpin
            conn.set_mask(d.uuid, new)
        reports = c.reconciler(store, deadline=deadline).reconcile([d.uuid])
    errors = [e for r in reports for e in r.errors]
    if errors:
        raise StateError(f"domain {d.name}: {errors[0]}")
    from vmpin.wire import views

    return views.update(id=d.name, sandbox=d.uuid, cpus=cpus(new), applied_by="libvirt")
