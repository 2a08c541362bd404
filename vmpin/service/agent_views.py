"""The agent's read views: ``containers``, ``sandboxes``, ``show`` and ``audit`` answered from
the planner's plan, so that a read command does not observe and plan the node again (issue
28: at 500 sandboxes ``sandboxes`` spent 44 of its 78 ms observing and 25 ms planning).

A read command asks with ``{"op":"view",...}`` (:class:`vmpin.wire.control_commands.View`) and
prints the data it gets exactly as it would print its own; without an answer it observes in-process
as before.  What answers:

- **the current plan**, when nothing can have changed since the pass that made it: that pass
  read every value from the host (a periodic, start-up or view pass, not an event's pass that
  reuses what it did not read) and changed nothing (no thread or cgroup written, the store's
  version where it was before the observation), and since then no one committed to the store
  (``PRAGMA data_version`` on a connection of this module's own), the journal is empty, no
  work is queued or running, and the plan is no older than the request's ``max_age``;
- else **a pass that starts after the request** (a work item of its own,
  :data:`VIEW_WORK`, queued as periodic work: any batch holding it reads the whole node); when
  that pass changed something, the next, which sees the node as it was left
  (:data:`MAX_PASSES`: the last one answers whatever it did);
- ``audit`` (``fresh``) must see the node as it is after the request: a thread moved by hand
  since the last pass must be reported.  The current plan answers when the conditions above
  hold for it and the host still shows what its pass observed: every value a pass reads
  from the host and the store does not record (kubelet's checkpoint, Kata's configuration,
  the VM dir, each VMM and thread, each thread's affinity, each runc cgroup's cpuset and
  tasks, the online CPUs) read again after the request and compared in place
  (:meth:`vmpin.reconcile.observe.Observer.still`, on an observer of the views' own); a
  pass would then observe the same node, plan it alike and find the same violations.  Else
  (something moved, or cannot be checked so: libvirt's domains, a sandbox observed with an
  error) it takes a pass that starts after the request, and gets that pass's audit, drift
  and all, whatever the pass then repaired.  At 500 sandboxes the check costs the agent a
  sixth of the pass it replaces (~17 against ~90-120 ms of CPU under the same load): less
  than a pass's reads, nothing applied, accounted or settled, no observation built, and the
  audit's text built once per plan (issue 28: ``audit --json`` had cost a whole pass, ~7x a
  bare interpreter).

Nothing here blocks the planner: it hands over the plan it made (:meth:`AgentViews.pass_ends`,
a reference: plans and observations are immutable) and a reader builds its view on its own
connection thread with the command's own builders (:mod:`vmpin.service.commands_read`,
:func:`vmpin.reconcile.audit.node_audit`) and its own writer (``commands.json_text``: the
``--json`` text, which the command prints as it comes), once per plan and view (later readers
get the same text).  The reply goes out as every reply does
(:class:`vmpin.service.server.Reply`: one ``sendall`` bounded by the write timeout), so a
reader that stops reading holds only its own connection thread.  The plan is dropped when the
next pass begins, as the reconciler drops its own (the agent's RSS peak is a pass building a
node's observation while the last is kept).

The command's settings come with the request (:meth:`Settings.view_key`): an agent whose host
roots, policy or libvirt connections differ refuses, and the command observes with its own.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from typing import TYPE_CHECKING, Any

from vmpin.linux.sysfs import online_text
from vmpin.reconcile.audit import node_audit
from vmpin.reconcile.observe import Observer
from vmpin.reconcile.report import node_reports
from vmpin.service import commands, commands_read
from vmpin.service.logs import log_event
from vmpin.state import journal
from vmpin.state.schema import uri_path
from vmpin.wire import jsonio
from vmpin.wire.control import refused
from vmpin.wire.control_commands import View, view_reply_to_json

if TYPE_CHECKING:
    from vmpin.reconcile.observation import Observation
    from vmpin.reconcile.plan import NodePlan
    from vmpin.reconcile.reconciler import Reconciler
    from vmpin.service.queue import DirtyQueue
    from vmpin.service.settings import Settings
    from vmpin.state.store import Store

#: the passes a view asks for at most before it answers from what the last one saw
MAX_PASSES = 2
#: the work item a view queues for a pass of its own (no sandbox: every pass is node-wide,
#: and a batch holding work that is not an event's reads the whole node)
VIEW_WORK = "vmpin-read-view"


class _Plan:
    """The plan of a pass that read the whole node, as the views see it, and the views built
    from it (text, once each).  An event's pass leaves none (:meth:`AgentViews.pass_ends`)."""

    __slots__ = ("at", "built", "clean", "data_version", "lock", "number", "obs", "online",
                 "plan")  # fmt: skip

    def __init__(
        self, number: int, obs: Observation, plan: NodePlan, clean: bool,
        data_version: int | None, online: str | None = None,
    ) -> None:  # fmt: skip
        self.number, self.obs, self.plan = number, obs, plan
        self.clean, self.data_version = clean, data_version
        #: the online CPU list the plan's topology was read after (the agent follows hotplug)
        self.online = online
        self.at = time.monotonic()
        self.lock = threading.Lock()
        #: (view, sandbox) -> the view's --json text, as a JSON string (None: the sandbox
        #: is not tracked)
        self.built: dict[tuple[str, str | None], str | None] = {}


def _data(p: _Plan, view: str, sandbox: str | None) -> Any:
    """The view's data, as the command builds it in-process (None: ``sandbox`` is not one
    the plan reports: the command says so itself, or finds a libvirt domain of that name)."""
    if view == "containers":
        return commands_read.fresh_containers(p.plan)
    if view == "sandboxes":
        return commands_read.sandbox_rows(p.plan)
    if view == "show":
        assert sandbox is not None
        found = node_reports(p.plan, None, [sandbox])
        return commands_read.show_json(found[0]) if found else None
    return node_audit(p.obs, p.plan)


class AgentViews:
    """The planner's last plan, and the read views answered from it (see the module)."""

    def __init__(self, paths_state_dir: str, settings: Settings, queue: DirtyQueue) -> None:
        self.state_dir = paths_state_dir
        #: the agent's own settings: a request whose settings differ is refused
        self.settings = settings
        self.queue = queue
        #: guards what follows; signalled when a pass ends
        self._cond = threading.Condition()
        self._plan: _Plan | None = None
        #: the last pass begun, and whether it is still running
        self._started = 0
        self._running = False
        #: the connection whose ``PRAGMA data_version`` says whether anyone committed since
        #: a plan was made (its own lock: the planner and the readers both ask)
        self._db: sqlite3.Connection | None = None
        self._db_lock = threading.Lock()
        self._closed = False
        #: the observer ``audit``'s check reads the host with (Observer.still: its own, not
        #: the planner's; built at the first pass, None while the agent reads libvirt's
        #: domains), the sysfs root whose online CPU list it compares, and its lock (one
        #: check at a time: the observer's readers keep caches)
        self._observer: Observer | None = None
        self._sys = ""
        self._check_lock = threading.Lock()

    # -- the planner's side ------------------------------------------------------------------
    def pass_begins(self, number: int) -> None:
        """A node pass starts: the last plan goes (the reconciler drops its own now too)."""
        with self._cond:
            self._started = number
            self._running = True
            self._plan = None

    def pass_ends(self, number: int, ok: bool, store: Store, reconciler: Reconciler) -> None:
        """Pass ``number`` ended (``ok``: without raising): its plan, for the views."""
        made = None
        last = reconciler.last_observed if ok else None
        # (an event's pass read its own sandboxes alone: no view is answered from its plan,
        # so neither version is read for it -- ~6 % of the planner's time under churn)
        if last is not None and last[3]:
            obs, plan, version, _ = last
            # (read before the store's version: a commit in between makes the plan unclean,
            # one after moves this value)
            seen = self._data_version()
            try:
                clean = reconciler.last_writes == 0 and store.version() == version
            except sqlite3.Error:  # (the planner's own pass is what says so, not the views)
                clean = False
            made = _Plan(number, obs, plan, clean, seen, reconciler.online_seen)
            if self._observer is None and reconciler.domains is None:
                self._sys = reconciler.paths.sys
                self._observer = Observer(
                    reconciler.paths, reconciler.policy, qmp_timeout=reconciler.qmp_timeout
                )
        with self._cond:
            self._running = False
            self._plan = made
            self._cond.notify_all()

    def close(self) -> None:
        with self._db_lock:
            self._closed = True
            if self._db is not None:
                self._db.close()
                self._db = None

    def _data_version(self) -> int | None:
        """``PRAGMA data_version`` of this module's connection (None: it cannot be read)."""
        with self._db_lock:
            if self._closed:
                return None
            try:
                if self._db is None:
                    path = os.path.join(self.state_dir, "state.db")
                    self._db = sqlite3.connect(
                        f"file:{uri_path(path)}?mode=ro", uri=True, timeout=1.0,
                        isolation_level=None, check_same_thread=False,
                    )  # fmt: skip
                return int(self._db.execute("PRAGMA data_version").fetchone()[0])
            except sqlite3.Error:
                return None

    # -- a reader's side (its connection thread) ---------------------------------------------
    def answer(self, req: View) -> bytes | dict[str, Any]:
        """The reply to a view request: its line, or a refusal (the command then observes
        in-process)."""
        why = self.settings.differs(req.settings)
        if why is not None:
            return refused(f"view: {why}")
        deadline = time.monotonic() + req.wait
        if req.fresh and req.view == "audit":
            checked = self._checked(req, deadline)
            if checked is not None:
                return self._reply(checked, req)
        asked = self._ask() if req.fresh else 0
        tries = int(bool(asked))
        while True:
            with self._cond:
                while self._running or (asked and self._plan is None):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return refused("view: no pass ended in time")
                    self._cond.wait(left)
                p = self._plan
            verdict = self._verdict(p, asked, req, last_try=tries >= MAX_PASSES)
            if verdict == "answer":
                assert p is not None
                return self._reply(p, req)
            if verdict == "ask":
                asked = self._ask()
                tries += 1
            elif time.monotonic() >= deadline:
                return refused("view: no pass ended in time")
            else:
                with self._cond:
                    if self._plan is p and not self._running:
                        self._cond.wait(max(0.0, deadline - time.monotonic()))

    def _verdict(self, p: _Plan | None, asked: int, req: View, last_try: bool) -> str:
        """What to do with plan ``p``: answer from it, ask for a pass, or wait for one.

        A pass asked for that changed something (it repaired drift, applied an event) is
        followed by one more, which finds the node as that one left it; the last one asked
        for answers whatever it did (under a storm of events every pass changes something,
        and a command observing in-process would see the node mid-change as well)."""
        if asked:
            if p is None or p.number < asked:
                return "wait"  # (the pass holding our work has not ended yet)
            return "answer" if p.clean or req.view == "audit" or last_try else "ask"
        if p is None or not p.clean:
            return "ask"
        if req.max_age is not None and time.monotonic() - p.at > req.max_age:
            return "ask"
        if self.queue.depth() or self.queue.running():
            return "ask"
        if journal.backlog(self.state_dir):
            return "ask"
        if p.data_version is None or self._data_version() != p.data_version:
            return "ask"  # (someone committed since, or it cannot be told)
        return "answer"

    def _checked(self, req: View, deadline: float) -> _Plan | None:
        """The current plan, once any running pass ended, when the host still shows what it
        was planned from (see the module); None: a pass of its own."""
        with self._cond:
            while self._running:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            p = self._plan
        if p is None or self._verdict(p, 0, req, last_try=False) != "answer":
            return None
        with self._check_lock:
            observer = self._observer
            if observer is None:
                return None
            try:
                if p.online is not None and online_text(self._sys) != p.online:
                    return None  # (a CPU came or went: the pass plans with a new topology)
                if not observer.still(p.obs):
                    return None
            except Exception as err:  # (a read the pass would report as an error on its object)
                log_event(logging.DEBUG, "audit check failed", error=str(err))
                return None
        with self._cond:
            current = self._plan is p and not self._running
        if not current or self._data_version() != p.data_version:
            return None  # (a pass began, or someone committed, while the host was read)
        return p

    def _ask(self) -> int:
        """Queue a pass of the views' own; the number the first pass it may be has."""
        with self._cond:
            first = self._started + 1
        self.queue.add_all([VIEW_WORK], "periodic")
        return first

    def _reply(self, p: _Plan, req: View) -> bytes | dict[str, Any]:
        key = (req.view, req.sandbox)
        with p.lock:  # (one reader builds a plan's view; the others wait for its text)
            if key not in p.built:
                data = _data(p, req.view, req.sandbox)
                # (the text the command prints, as one JSON string: the reply is one line)
                p.built[key] = None if data is None else jsonio.dumps(commands.json_text(data))
            text = p.built[key]
        if text is None:
            return refused(f"view: no sandbox {req.sandbox!r} in the agent's plan")
        age = time.monotonic() - p.at
        log_event(logging.DEBUG, "view answered", view=req.view, number=p.number,
                  age_s=round(age, 3))  # fmt: skip
        return view_reply_to_json(req.view, text, age, p.number)
