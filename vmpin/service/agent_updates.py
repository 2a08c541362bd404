"""``vmpin update`` done by the agent: the ``update`` request of the control socket.

The command sends the container and its new set; the agent writes it on a connection of its
own (the checks and the write are :func:`vmpin.service.update.record_update`'s, the command's
own path's), hands the sandbox to the planner as a blocking ``dirty`` does, and answers once
a pass planned from the write has pinned.  The command then imports no store and opens no
database: its process is its start-up and one exchange (issue 28: ``vmpin update`` was a
store write, two syncs and a wait for the pass, ~1.6x a bare interpreter of its own).

Never a lost update (issue 26): the request carries the caller's ``until`` and the write
happens only before it, checked inside the write transaction.  A caller gives up at
``until`` and writes the set itself; SQLite's write lock orders the two, so an agent stopped
with the request in hand either wrote before the caller's own write (which then repeats
it) or finds itself late and writes nothing -- it never overwrites a later update.  A write
whose pass did not end well in time is put back (only if the store still holds it:
:meth:`vmpin.state.writer.Writer.restore_container_cpus`) before the agent says not done,
so the caller starts from the set as it was.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable
from typing import Any

from vmpin.core.cpuset import CpuSet
from vmpin.core.errors import VmpinError
from vmpin.linux.paths import HostPaths
from vmpin.service.budget import AGENT_WAIT, BUDGET
from vmpin.service.server import Reply
from vmpin.service.update import record_update
from vmpin.state.store import Store
from vmpin.wire.control import refused
from vmpin.wire.control_update import Update, UpdateReply

#: how far past the caller's wait its ``until`` may seem to lie by the agent's clock before
#: the agent takes the two clocks for different ones (another time namespace) and refuses
CLOCK_SLACK = 0.05

#: what waits for the planner: (sandbox, wait, answer, the reply once done, the work to do
#: while the pass runs) -> the reply (vmpin.service.agent_protocol.ControlProtocol.
#: notify_and_wait)
WaitFor = Callable[[str, float, Reply | None, dict[str, Any], Callable[[], object]],
                   dict[str, Any]]  # fmt: skip


class AgentUpdates:
    """The agent's side of ``update``: one store connection for every request (opened at the
    first), used by one request at a time."""

    def __init__(
        self, paths: HostPaths, wait_for: WaitFor, write_lock: threading.Lock | None = None
    ) -> None:
        self.paths = paths
        self.wait_for = wait_for
        #: the agent's writers' lock (vmpin.state.writer.Writer.local_lock)
        self.write_lock = write_lock
        self._roots = dict(paths._asdict())
        self._lock = threading.Lock()
        self._store: Store | None = None

    def answer(self, msg: Update, answer: Reply | None = None) -> dict[str, Any] | None:
        """One request: its reply, or None when the planner sent it on ``answer`` already."""
        if msg.roots != self._roots:
            differ = sorted(k for k in self._roots.keys() | msg.roots.keys()
                            if msg.roots.get(k) != self._roots.get(k))  # fmt: skip
            return refused(f"update: host roots differ from the agent's ({', '.join(differ)})")
        left = msg.until - time.monotonic()
        if left <= 0:
            return UpdateReply(False, error="the request came past its deadline").to_obj()
        if left > msg.wait + CLOCK_SLACK:
            return refused("update: 'until' lies past 'wait': not the agent's clock")
        try:
            cpus = CpuSet.parse(msg.cpus)
        except VmpinError as err:
            return UpdateReply(False, error=f"cpus: {err}").to_obj()
        with self._lock:
            try:
                store = self._open()
                store.deadline = msg.until  # (no wait for SQLite's lock past the caller's)
                old, new = record_update(store, self.paths, msg.container, cpus, msg.until)
            except (VmpinError, sqlite3.Error) as err:
                return UpdateReply(False, error=str(err)).to_obj()
        written = None if new.cpus is None else new.cpus.to_list()
        done = UpdateReply(True, new.id, new.sandbox_id, written).to_obj()

        def sync() -> None:
            # the write made durable while the planner's pass runs (the answer waits for
            # both); a disk that fails it makes the answer that failure, whoever sends it.
            # Outside the lock: a sync is of the files (the next update's write need not
            # wait for this one's fsyncs), and it syncs whatever was written before it.
            try:
                store.sync()
            except (VmpinError, sqlite3.Error) as err:
                done.clear()
                done.update(UpdateReply(False, error=str(err)).to_obj())

        reply = self.wait_for(new.sandbox_id, left, answer, done, sync)
        if reply.get("done"):
            return None if answer is not None else reply
        # not done (no pass ended well in time, or the sync failed): the set as it was,
        # unless a later write replaced ours -- before the answer, which the caller takes
        # as leave to write the set itself
        error = done.get("error") or "no pass planned from it ended well in time"
        with self._lock:
            try:
                # (the caller's deadline may be past: the locks' share of its budget more)
                store.deadline = time.monotonic() + (BUDGET - AGENT_WAIT)
                store.restore_container_cpus(new, old.cpus, old.cpus_source or "spec")
                store.sync()
            except (VmpinError, sqlite3.Error) as err:
                error = f"{error}; putting the old set back: {err}"
        return UpdateReply(False, error=error).to_obj()

    def _open(self) -> Store:
        if self._store is None:
            store = Store(self.paths.state_dir, ingest=False, shared=True)
            store.local_lock = self.write_lock
            # commits do not wait for the disk: each update is synced while its pass runs
            store.defer_durability()
            self._store = store
        return self._store

    def close(self) -> None:
        with self._lock:
            if self._store is not None:
                self._store.close()
                self._store = None
