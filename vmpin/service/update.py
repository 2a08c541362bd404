"""``vmpin update``: CRI UpdateContainerResources, as vmpin hears it.

Validation happens before anything is written: an unknown container, a malformed list or
JSON, or CPUs that are not online leave the state exactly as it was (:func:`record_update`,
the checks and the write, whoever makes them).  With an agent, the agent does it all: the
command sends the set (:func:`vmpin.service.control.update`), the agent writes it and
answers once a pass planned from it has pinned (vmpin.service.agent_updates), and the
command imports no store (issue 28: its cost is its start-up and one round trip).  Without
one (or an older agent, or one that did not answer in time) this process writes and
re-pins, asking an older agent to re-pin (:func:`vmpin.service.control.notify` with
``wait``) before doing it itself; a failure puts the old set back.

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
from vmpin.core.errors import CpuSetError, SpecError, StateError, VmpinError
from vmpin.linux.paths import HostPaths
from vmpin.service.budget import AGENT_WAIT, BUDGET
from vmpin.service.settings import Settings

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.lean.records)

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    from vmpin.reconcile.reconciler import Reconciler
    from vmpin.state.records import ContainerRec
    from vmpin.state.store import Store


class UnknownContainer(StateError):
    """No container of that id (tracked, or journaled by its hook): the command then looks
    for a libvirt domain of that name (vmpin.service.commands.update)."""


def _read_resources(source: str) -> bytes:
    """The ``-r`` document: a regular file (vmpin.linux.files: no FIFO, device or symlink)."""
    from vmpin.linux.files import read_bytes
    from vmpin.runtimes.oci import MAX_DOC

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
    # (the OCI document's reader for -r alone: --cpuset-cpus, what CRI runtimes' wrappers
    # send, does not load it)
    from vmpin.runtimes.oci import parse_resources_json

    where = "stdin" if resources == "-" else resources
    return parse_resources_json(_read_resources(resources), where).cpus


class Late(StateError):
    """The agent had an update's request past its ``until``: the caller does it itself."""


def _known(store: Store, container_id: str) -> ContainerRec:
    """The container's record, its hook's journal applied first; UnknownContainer when there
    is none (the command then looks for a libvirt domain of that name)."""
    # (raised, not printed and gone past: a write after it would meet the same lock)
    store.ingest()
    return _record(store, container_id)


def _record(store: Store, container_id: str) -> ContainerRec:
    rec = store.container(container_id)
    if rec is None:
        raise UnknownContainer(f"unknown container {container_id!r} (see `vmpin containers`)")
    return rec


def record_update(
    store: Store, paths: HostPaths, container_id: str, cpus: CpuSet, until: float | None = None
) -> tuple[ContainerRec, ContainerRec]:
    """An update's checks and its write, the container's record (before, after): the one
    home of both, for the command's own path and the agent's (vmpin.service.agent_updates).

    Checked before anything is written: the container (its hook's journal applied first:
    an event not yet in the store would otherwise land after this write and undo it), a set
    not empty, every CPU online.  ``until`` (``time.monotonic()``): the write happens only
    before it, checked under SQLite's write lock (:class:`Late`): the agent's, whose caller
    writes the set itself once ``until`` has passed (vmpin.wire.control_update.Update).

    The checks are made in the write's transaction (the online list read just before
    it), a failed one rolling it back: the record read there is the one the write
    replaces, so the write's own record is made from it rather than read back
    (:meth:`vmpin.state.writer.Writer.set_container_cpus`'s ``old``; issue 28: one
    statement fewer, and one read of the store after the planner's commits rather than
    two)."""
    # (the online list alone: the rest of the topology is the pass's, which reads it anyway;
    # read before the transaction, so that no writer waits for sysfs, and said in the
    # checks' order: a container unknown first)
    from vmpin.core.topology import check_online
    from vmpin.linux.sysfs import online_cpus

    store.ingest()
    try:
        online: CpuSet | VmpinError = online_cpus(paths.sys)
    except VmpinError as err:
        online = err
    with store.transaction():
        old = _record(store, container_id)
        if not cpus:
            raise SpecError("--cpuset-cpus: the empty set would leave the container no CPU")
        if isinstance(online, VmpinError):
            raise online
        check_online(cpus, online, f"container {container_id}")
        if until is not None and time.monotonic() >= until:
            raise Late(f"update of {container_id}: the caller's deadline has passed")
        new = store.set_container_cpus(container_id, cpus, "update", old)
    return old, new


def _output_layer() -> None:
    """What the command's answer needs and its request does not -- the view's module --
    loaded while the agent works on the request rather than before it is sent (issue 28:
    ~0.7 M instructions of the command's ~46 M, off its path to the request)."""
    import vmpin.wire.views  # noqa: F401


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
    """Record the new set, then re-pin: by the agent when one answers (it writes the set
    and answers once a pass planned from it has pinned: the command returning means the
    threads moved; ``wait`` bounds that), else in this process (a node-wide pass: another
    sandbox's plan may depend on this set).

    ``deadline`` (``time.monotonic()``): no wait on another process goes past it but the
    agent's (``wait``); by default the budget's rest after ``wait`` from now."""
    if deadline is None:
        deadline = time.monotonic() + wait + (BUDGET - AGENT_WAIT)
    cpus = parse_update(cpuset_cpus, resources)
    ask = True  # whether this process's pass asks the agent first (the old protocol's)
    if cpus:  # (None, nothing to do, and the empty set's error: this process says them)
        wait = min(wait, max(0.05, deadline - time.monotonic()))
        from vmpin.service.control import update as agent_update

        by_agent, answered = agent_update(
            paths, container_id, cpus.to_list(), wait, meanwhile=_output_layer
        )
        from vmpin.wire import views

        if by_agent is not None and by_agent.done:
            return views.update(
                id=by_agent.id,
                sandbox=by_agent.sandbox,
                cpus=by_agent.cpus,
                applied_by="re-pinned by the agent",
            )
        # An agent that refused the request (an older one) is asked the old way (this
        # process writes, the agent re-pins); one that answered not done is alive but could
        # not (the error is this process's to say), and one that did not answer by
        # ``until`` is not waited for twice: this process re-pins.
        ask = answered and by_agent is None
    from vmpin.state.store import Store
    from vmpin.wire import views

    with Store(paths.state_dir, ingest=False, deadline=deadline) as store:
        if cpus is None:
            rec = _known(store, container_id)
            return views.update(
                id=rec.id,
                sandbox=rec.sandbox_id,
                cpus=None if rec.cpus is None else rec.cpus.to_list(),
                applied_by="nothing to do: no cpu.cpus given",
            )
        # Committed without waiting for the disk, and synced while the agent's pass runs
        # (vmpin.state.store.Store.sync): durable before the command answers all the same,
        # and the agent starts ~1 ms sooner on a disk (issue 14).
        store.defer_durability()
        old, rec = record_update(store, paths, container_id, cpus)
        try:
            return _repin(
                paths, store, rec, old.cpus, reconciler_factory, settings, wait if ask else None,
                deadline,
            )  # fmt: skip
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
    wait: float | None,
    deadline: float,
) -> dict[str, Any]:
    """The re-pin of a write this process made: the agent's (asked with ``wait``: an agent
    that takes only the old request), else this process's."""
    from vmpin.service.control import notify

    if wait is not None:
        wait = min(wait, max(0.05, deadline - time.monotonic()))  # (what the store left)
    # (the guest's follower polls for its map: the agent answers once the threads are pinned)
    if wait is not None and notify(
        paths, [rec.sandbox_id], wait=wait, meanwhile=store.sync, maps_first=False
    ):
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
            from vmpin.reconcile.reconciler import reconcile_plain

            reports = reconcile_plain(rec_, rec.sandbox_id, old, rec.cpus, infra)
        if reports is None:
            reports = rec_.reconcile([rec.sandbox_id])
        errors = [e for r in reports for e in r.errors]
        applied = "re-pinned" if not errors else "errors: " + "; ".join(errors)
    from vmpin.wire import views

    return views.update(
        id=rec.id,
        sandbox=rec.sandbox_id,
        cpus=None if rec.cpus is None else rec.cpus.to_list(),
        applied_by=applied,
    )
