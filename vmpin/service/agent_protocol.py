"""The agent's side of the control protocol: what it does for each request, and the blocking
replies.

The requests and replies themselves (their JSON, checks and limits) are
:mod:`vmpin.wire.control`'s, which the client side (:mod:`vmpin.service.control`) uses too;
the socket is :mod:`vmpin.service.server`'s.  :class:`ControlProtocol` reads a request and
queues its work; :class:`Waiters` numbers the
node passes and answers each blocking ``dirty`` once a pass that started after it arrived has
ended (with its guest maps published first, unless the caller said ``after``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from vmpin.core.errors import WireError
from vmpin.service.agent_accounting import Accounting
from vmpin.service.logs import Throttle, log_event
from vmpin.service.metrics import Metrics
from vmpin.service.queue import DirtyQueue
from vmpin.service.server import Reply
from vmpin.wire.control import OK, Dirty, DirtyReply, refused
from vmpin.wire.control_commands import Reconcile, Status, View
from vmpin.wire.control_commands import request_from_json as read_request
from vmpin.wire.control_update import Update

#: the least time between two log lines about bad requests
BAD_LOG_EVERY = 60.0


class _Waiter:
    """A blocking ``dirty`` request: the pass it waits for, and how to answer it."""

    __slots__ = ("answer", "done", "maps_first", "queued", "reply", "target")

    def __init__(
        self, answer: Reply | None, maps_first: bool = True, done: dict[str, Any] | None = None
    ) -> None:
        self.answer = answer
        #: the reply when the pass ended well (an update's: vmpin.service.agent_updates),
        #: and the waiter's own thread answers otherwise (it puts the old set back first);
        #: None, a ``dirty``'s
        self.done = done
        #: answered only once the pass's guest maps are published (a Kata hook: the guest
        #: hook of the container about to start reads its entry); False for ``vmpin
        #: update``, whose map the guest's follower picks up whenever it comes
        self.maps_first = maps_first
        self.target = 0
        self.queued = 0
        self.reply: dict[str, Any] | None = None


class Waiters:
    """The node passes, numbered from 1 in the order they start (one runs at a time), and
    the blocking ``dirty`` requests waiting for one of them.

    The planner says when a pass begins (:meth:`pass_begins`) and ends (:meth:`pass_ends`,
    then :meth:`publish_late`); a request's connection thread waits in :meth:`wait`.  No
    polling: the planner answers every waiter its pass satisfies at the end of that pass,
    itself, on the waiter's connection, and only then wakes the waiting threads; a waiter
    past its deadline (or the agent stopping) answers ``done: false`` itself.
    """

    def __init__(self, fault: Callable[[str, BaseException], None]) -> None:
        #: told of a publishing failure the planner outlives
        self._fault = fault
        #: guards everything below; taken as itself (C code), not through the condition
        #: made on it, whose ``with`` is two Python calls (issue 28)
        self._lock = threading.RLock()
        #: the condition blocking requests sleep on (signalled at each pass's end)
        self._cond = threading.Condition(self._lock)
        #: node passes started / finished / finished without raising
        self._started = 0
        self._finished = 0
        self._ok = 0
        #: the last pass whose guest maps are published, and the waiters that do not need
        #: them first but are not registered yet
        self._maps_done = 0
        self._maps_after_coming = 0
        self._stopping = False
        #: blocking ``dirty`` requests not answered yet
        self._waiters: list[_Waiter] = []

    def wait(
        self,
        queue_work: Callable[[], int],
        wait: float,
        answer: Reply | None = None,
        *,
        maps_first: bool = True,
        done: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Queue the request's work (``queue_work``: how many entries it queued), then reply
        once a node pass that started after now has ended, or after ``wait`` seconds.
        ``done``: the reply when that pass ended well, which only then goes out on
        ``answer`` (an update's; else the reply is returned, not sent).

        Runs on the request's own connection thread (:class:`ControlServer` serves each
        connection on one), so the accept loop and other clients go on meanwhile.  A pass
        that raised does not count (the caller then does the work itself), a later one does.
        The reply is returned too (for callers without a connection).  ``maps_first``: the
        pass publishes its guest maps before answering (else after).
        """
        deadline = time.monotonic() + wait
        waiter = _Waiter(answer, maps_first, done)
        with self._lock:
            # passes are numbered in the order they start, and one runs at a time: the first
            # to start from now on is number started + 1 (it ingests and reads the store
            # after this point, so it sees whatever the caller wrote before asking)
            waiter.target = self._started + 1
            if not maps_first:
                self._maps_after_coming += 1  # (a pass that starts now defers its maps)
        try:
            waiter.queued = queue_work()
        except BaseException:
            with self._lock:
                if not maps_first:
                    self._maps_after_coming -= 1
            raise
        with self._lock:
            # registered once complete, so the planner answers it whole; a pass that ended
            # meanwhile is caught by the loop's first test
            self._waiters.append(waiter)
            if not maps_first:
                self._maps_after_coming -= 1
            while waiter.reply is None:
                if self._stopping or (
                    self._finished >= waiter.target
                    and (self._maps_done >= waiter.target or not maps_first)
                ):
                    self._answer(waiter)
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    self._answer(waiter)
                    break
                self._cond.wait(left)
        assert waiter.reply is not None
        return waiter.reply

    def _answer(self, waiter: _Waiter) -> None:
        """Reply to one waiter (under ``_lock``): done when its pass ended well."""
        if waiter in self._waiters:
            self._waiters.remove(waiter)
        # (done: its pass ended well, and published its maps when the waiter needs them first)
        ok = self._ok >= waiter.target and (
            not waiter.maps_first or self._maps_done >= waiter.target
        )
        if waiter.done is None:
            waiter.reply = DirtyReply(waiter.queued, ok).to_obj()
        elif ok and waiter.done.get("done"):
            waiter.reply = waiter.done
        else:
            waiter.reply = DirtyReply(waiter.queued, False).to_obj()
            return  # (the waiter's thread answers, once it has put the old set back)
        if waiter.answer is not None:
            waiter.answer.send(waiter.reply)

    def release(self) -> None:
        """No pass is coming for whoever still waits: each answers ``done: false``."""
        with self._lock:
            self._stopping = True
            self._cond.notify_all()

    def pass_begins(self) -> tuple[int, bool]:
        """A node pass starts: its number, and whether its guest maps are to wait for the
        answers (a waiter does not need them first: ``vmpin update``).  Else they are
        written in the pass, as they are made (a full pass's 2,000 maps kept to its end
        were ~1 MB of the agent's RSS)."""
        with self._lock:
            self._started += 1
            later = self._maps_after_coming > 0 or any(not w.maps_first for w in self._waiters)
            return self._started, later

    def pass_ends(self, number: int, ok: bool, publish: Callable[[], object]) -> bool:
        """Pass ``number`` ended (``ok``: without raising): the waiters it satisfies are
        answered -- those that do not need its guest maps first (``vmpin update``) at once,
        the others once ``publish`` has published them (a Kata hook: its container's guest
        hook reads the map once it returns).  The maps are written outside the condition, so
        a request arriving meanwhile registers without waiting for them.  Whether the maps
        were published."""
        with self._lock:
            self._finished = number
            if ok:
                self._ok = number
            due = [w for w in self._waiters if w.target <= number]
            # answered from here, before their threads wake (Reply)
            for waiter in due:
                if not waiter.maps_first:
                    self._answer(waiter)
            rest = [w for w in due if w.maps_first]
            if len(rest) < len(due):
                # only the threads answered here are woken: one that waits for the maps
                # would find its test still false and sleep again, and its wake-up was
                # ~0.5 ms of a Kata hook's wait (a context switch and the GIL taken from
                # this thread, right before the maps it waits for; issue 28)
                self._cond.notify_all()
        if not rest:
            return False
        self._publish(number, publish)
        with self._lock:
            for waiter in rest:
                if waiter.reply is None:  # (not answered by its own thread meanwhile)
                    self._answer(waiter)
            self._cond.notify_all()
        return True

    def publish_late(self, number: int, publish: Callable[[], object]) -> None:
        """After the answers: the maps no waiter needed first (an update's: the guest's
        follower polls for it); a waiter that registered late waits for them."""
        self._publish(number, publish)
        with self._lock:
            if self._waiters:
                self._cond.notify_all()

    def _publish(self, number: int, publish: Callable[[], object]) -> None:
        """The guest maps of pass ``number`` (and those before it) published."""
        try:
            publish()
        except Exception as err:  # the planner must survive any one pass (said once a minute)
            self._fault("publishing guest maps", err)
        self._maps_done = number


class ControlProtocol:
    """The requests of the control socket (:meth:`handle`), and the notifications the
    agent's watchers send it (:meth:`notify`)."""

    def __init__(
        self,
        queue: DirtyQueue,
        waiters: Waiters,
        metrics: Metrics,
        accounting: Accounting,
        status: Callable[[str | None], dict[str, Any]],
        request_pass: Callable[[], None],
        views: Callable[[View], dict[str, Any] | bytes] | None = None,
        updates: Callable[[Update, Reply | None], dict[str, Any] | None] | None = None,
    ) -> None:
        self.queue = queue
        self.waiters = waiters
        self.metrics = metrics
        #: where the events received are counted
        self.accounting = accounting
        #: the ``status`` reply (the agent's), and how to start a full pass now
        self.status = status
        self.request_pass = request_pass
        #: a read command's view (vmpin.service.agent_views: AgentViews.answer)
        self.views = views
        #: ``vmpin update`` done here (vmpin.service.agent_updates: AgentUpdates.answer)
        self.updates = updates
        #: bad requests, said once a minute: whoever sends a flood of them must not fill
        #: the log too
        self._bad_said = Throttle(BAD_LOG_EVERY)

    def handle(self, line: bytes, answer: Reply | None = None) -> dict[str, Any] | bytes | None:
        """One request line -> one reply (a dict; ``ok`` says whether it was understood; a
        view's line as bytes, written once for every reader of a plan).

        None when the reply went out on ``answer`` already (a blocking ``dirty``, answered by
        the planner: :meth:`notify_and_wait`)."""
        try:
            msg = read_request(line)
        except WireError as err:
            return self._bad(str(err))
        if isinstance(msg, Dirty):
            if msg.wait is None:
                return DirtyReply(self.notify(msg.sandboxes)).to_obj()
            if answer is None:
                return self.notify_and_wait(msg.sandboxes, msg.wait, maps_first=msg.maps_first)
            self.notify_and_wait(msg.sandboxes, msg.wait, answer, maps_first=msg.maps_first)
            return None
        if isinstance(msg, Status):
            return self.status(msg.sandbox)
        if isinstance(msg, View):
            # (on this connection's thread: the planner only hands its plan over)
            return refused("view: not served") if self.views is None else self.views(msg)
        if isinstance(msg, Update):
            # (on this connection's thread, which waits for the planner's pass as a
            # blocking ``dirty``'s does)
            return refused("update: not served") if self.updates is None else self.updates(
                msg, answer
            )
        assert isinstance(msg, Reconcile)
        self.request_pass()
        return dict(OK)

    def _bad(self, error: str) -> dict[str, Any]:
        self.metrics.errors.labels("control").inc()
        unsaid = self._bad_said.due(("control", "bad request"))
        if unsaid is not None:
            log_event(logging.WARNING, "bad control request", error=error, unsaid=unsaid)
        return refused(error)

    def notify(self, sandbox_ids: list[str], *, urgent: bool = False) -> int:
        """Mark sandboxes dirty (their new level is already in the store); how many queued.

        ``urgent``: a caller blocks on the pass, so no hold-off (:class:`DirtyQueue`).
        """
        added = self.queue.add_all(sandbox_ids, "event", time.monotonic(), urgent=urgent)
        return self._count(added)

    def _count(self, added: list[bool]) -> int:
        """Events queued (:meth:`DirtyQueue.add_all`'s answer) counted; how many queued."""
        queued = sum(added)
        self.metrics.events.inc(len(added))
        if len(added) > queued:
            self.metrics.coalesced.inc(len(added) - queued)
        self.accounting.count_events(len(added))
        return queued

    def notify_and_wait(
        self,
        sandbox_ids: list[str],
        wait: float,
        answer: Reply | None = None,
        *,
        maps_first: bool = True,
        done: dict[str, Any] | None = None,
        meanwhile: Callable[[], object] | None = None,
    ) -> dict[str, Any]:
        """The blocking ``dirty``: reply once a node pass that started after now has ended
        (:meth:`Waiters.wait`; ``done``: see there).  ``meanwhile`` runs once the work is
        queued, before the wait (an update's sync, while the pass runs).

        The planner is woken once (the queue's ``notify_all``: a kick as well was a second
        one under the queue's lock), and the next thing this thread does is ``meanwhile``'s
        (its syncs let go of the GIL) or the wait: the woken planner runs Python only while
        this thread does not, so the events are counted after ``meanwhile`` (still before
        the wait: ``status`` counts a request waiting for its pass; issue 28)."""

        def queue_work() -> int:
            if sandbox_ids:
                # (an id always makes a pass: it is queued, folded into a queued entry, or
                # due again after the running pass: DirtyQueue.add)
                added = self.queue.add_all(sandbox_ids, "event", time.monotonic(), urgent=True)
            else:
                added = []
                self.queue.kick()  # a pass even with no id
            try:
                if meanwhile is not None:
                    meanwhile()
            finally:
                queued = self._count(added)
            return queued

        return self.waiters.wait(queue_work, wait, answer, maps_first=maps_first, done=done)

    def update_and_wait(
        self,
        sandbox_id: str,
        wait: float,
        answer: Reply | None,
        done: dict[str, Any],
        meanwhile: Callable[[], object],
    ) -> dict[str, Any]:
        """An update's re-pin (vmpin.service.agent_updates): its sandbox's blocking
        ``dirty``, whose guest map may come after the answer (the guest's follower polls)."""
        return self.notify_and_wait(
            [sandbox_id], wait, answer, maps_first=False, done=done, meanwhile=meanwhile
        )
