"""``vmpin update``: CRI UpdateContainerResources, as vmpin hears it.

Validation happens before anything is written: an unknown container, a malformed list or
JSON, or CPUs that are not online leave the state exactly as it was.  Then the re-pin: the
agent's blocking reply (:func:`vmpin.service.control.notify` with ``wait``: it answers once a
pass that saw this write has finished), else a pass in this process; a failure puts the old
set back.  The reconciler is only imported on that second path: with an agent, the command
costs a store write and one round trip on top of its start-up (issue 14).

Never stalled by another process (issue 26): the agent's answer is waited for ``wait``
seconds (1 s by default), SQLite's write lock and the node's plan lock for what is left of
the budget (vmpin.service.budget); an agent that does not answer in time is done without
(this process's own pass), and a write lock held past the budget (an agent stopped inside
a transaction) fails the command with one line, having changed nothing.
"""

from __future__ import annotations

import sys
import time

from vmpin.core.cpuset import CpuSet
from vmpin.core.errors import CpuSetError, SpecError, StateError
from vmpin.linux.files import read_bytes
from vmpin.linux.paths import HostPaths
from vmpin.runtimes.oci import MAX_DOC, parse_resources_json
from vmpin.service.budget import AGENT_WAIT, BUDGET
from vmpin.service.settings import Settings
from vmpin.state.records import ContainerRec
from vmpin.state.store import Store
from vmpin.wire import views

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.lean.records)

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    from vmpin.reconcile.reconciler import Reconciler


class UnknownContainer(StateError):
    """No container of that id (tracked, or journaled by its hook): the command then looks
    for a libvirt domain of that name (vmpin.service.commands.update)."""


def _read_resources(source: str) -> bytes:
    """The ``-r`` document: a regular file (vmpin.linux.files: no FIFO, device or symlink)."""
    if source == "-":
        data = sys.stdin.buffer.read(MAX_DOC + 1)
        if len(data) > MAX_DOC:
            raise SpecError(f"stdin: over the limit of {MAX_DOC} bytes")
        return data
    try:
        return read_bytes(source, limit=MAX_DOC, what="resources file")
    except OSError as err:
        raise SpecError(f"{source}: {err.strerror}") from None


def parse_update(cpuset_cpus: str | None, resources: str | None) -> CpuSet | None:
    """The new CPU set; None when the resources carry no cpu.cpus (nothing for vmpin)."""
    if cpuset_cpus is not None:
        try:
            return CpuSet.parse(cpuset_cpus)
        except CpuSetError as err:
            raise SpecError(f"--cpuset-cpus: {err}") from None
    assert resources is not None
    where = "stdin" if resources == "-" else resources
    return parse_resources_json(_read_resources(resources), where).cpus


def update_container(
    paths: HostPaths,
    container_id: str,
    *,
    cpuset_cpus: str | None = None,
    resources: str | None = None,
    reconciler_factory: Callable[..., Reconciler] | None = None,
    settings: Settings | None = None,
    wait: float = AGENT_WAIT,
    deadline: float | None = None,
) -> dict[str, Any]:
    """Record the new set, then re-pin: through the agent when one answers (its reply comes
    once a pass that saw this write has finished, so that the command returning means the
    threads moved; ``wait`` bounds that), else in this process (a node-wide pass: another
    sandbox's plan may depend on this set).

    ``deadline`` (``time.monotonic()``): no wait on another process goes past it but the
    agent's (``wait``); by default the budget's rest after ``wait`` from now."""
    if deadline is None:
        deadline = time.monotonic() + wait + (BUDGET - AGENT_WAIT)
    cpus = parse_update(cpuset_cpus, resources)
    with Store(paths.state_dir, ingest=False, deadline=deadline) as store:
        # (raised, not printed and gone past: the write below would meet the same lock)
        store.ingest()
        rec = store.container(container_id)
        if rec is None:
            raise UnknownContainer(f"unknown container {container_id!r} (see `vmpin containers`)")
        if cpus is None:
            return views.update(
                id=rec.id,
                sandbox=rec.sandbox_id,
                cpus=None if rec.cpus is None else rec.cpus.to_list(),
                applied_by="nothing to do: no cpu.cpus given",
            )
        if not cpus:
            raise SpecError("--cpuset-cpus: the empty set would leave the container no CPU")
        from vmpin.linux.sysfs import read_topology

        topo = read_topology(paths.sys, cache=paths.topology_cache, proc_root=paths.proc)
        topo.check_online(cpus, f"container {container_id}")
        old = rec
        # Committed without waiting for the disk, and synced while the agent's pass runs
        # (vmpin.state.store.Store.sync): durable before the command answers all the same,
        # and the agent starts ~1 ms sooner on a disk (issue 14).
        store.defer_durability()
        rec = store.set_container_cpus(container_id, cpus, "update")
        try:
            return _repin(paths, store, rec, old.cpus, reconciler_factory, settings, wait, deadline)
        except BaseException:
            # Failing means changing nothing: put the old set back before saying so -- if
            # the store still holds this write.  Another update may have been written and
            # acknowledged meanwhile (this one interrupted, or slow to fail): the set is then
            # that one's, and putting ours back would erase it (issue 26).
            store.restore_container_cpus(rec, old.cpus, old.cpus_source or "spec")
            raise
        finally:
            # unless the agent's wait synced it and nothing was written since (two fsyncs
            # of the WAL and the state dir, and their opens, after the agent's answer)
            if store.db.total_changes != store.synced_at:
                store.sync()


def _repin(
    paths: HostPaths,
    store: Store,
    rec: ContainerRec,
    old: CpuSet | None,
    reconciler_factory: Callable[..., Reconciler] | None,
    settings: Settings | None,
    wait: float,
    deadline: float,
) -> dict[str, Any]:
    from vmpin.service.control import notify

    # (the guest's follower polls for its map: the agent answers once the threads are pinned)
    wait = min(wait, max(0.05, deadline - time.monotonic()))  # (what the store left of it)
    if notify(paths, [rec.sandbox_id], wait=wait, meanwhile=store.sync, maps_first=False):
        applied = "re-pinned by the agent"
    else:
        # no agent, or none that finished a pass in ``wait``: this process does it (again)
        # the node's plan lock: waited for until the deadline, then done without (a holder
        # may be stopped; vmpin.state.locks)
        if reconciler_factory is not None:
            rec_ = reconciler_factory(store, deadline=deadline)
        else:
            from vmpin.service.settings import build_reconciler

            # the configured policy, as every other entry point (the one factory)
            settings = (settings or Settings.from_env())._replace(paths=paths)
            rec_ = build_reconciler(settings, store, deadline=deadline)
        # A plain container's sandbox alone when no VM's plan depends on the change (the
        # node summary says so): the cost of a container's, not the node's; else the node.
        sandbox = store.sandbox(rec.sandbox_id)
        reports = None
        if sandbox is not None and sandbox.runtime == "runc":
            from vmpin.runtimes.kubelet import is_infra

            infra = is_infra(rec.is_sandbox, rec.pod_uid, rec.name)
            reports = rec_.reconcile_plain(rec.sandbox_id, old, rec.cpus, infra)
        if reports is None:
            reports = rec_.reconcile([rec.sandbox_id])
        errors = [e for r in reports for e in r.errors]
        applied = "re-pinned" if not errors else "errors: " + "; ".join(errors)
    return views.update(
        id=rec.id,
        sandbox=rec.sandbox_id,
        cpus=None if rec.cpus is None else rec.cpus.to_list(),
        applied_by=applied,
    )
