"""The agent's dirty set: per-sandbox coalescing of events, with a hold-off while they keep coming.

It owns only queueing: the planner ``take_batch()``-es every ready :class:`Work` and calls
``done()`` for each; what it does with them (one node-wide pass for the whole batch) is the
agent's business (kopf's queueing/processing split).
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable, Iterable
from typing import NamedTuple

#: events for a sandbox planned less than this ago wait for the rest of it (seconds) ...
DEFAULT_HOLDOFF = 0.1
#: ... backing off, while they keep coming, up to once per second.
DEFAULT_MAX_HOLDOFF = 1.0
#: causes, strongest first: an event beats the start-up pass beats a periodic pass.
CAUSES = ("event", "startup", "periodic")


class Work(NamedTuple):
    """One sandbox taken by a worker: why, and since when an event has been waiting."""

    sandbox_id: str
    cause: str
    first_event: float | None  # monotonic time of the oldest notification folded in
    taken_at: float


class _Entry:
    __slots__ = ("cause", "first_event", "seq", "urgent")

    def __init__(
        self, cause: str, first_event: float | None, seq: int, urgent: bool = False
    ) -> None:
        self.cause, self.first_event, self.seq = cause, first_event, seq
        #: a caller blocks on the pass (``{"op":"dirty","wait":...}``): no hold-off for it
        self.urgent = urgent

    def merge(self, cause: str, event_time: float | None, urgent: bool = False) -> None:
        if CAUSES.index(cause) < CAUSES.index(self.cause):
            self.cause = cause
        if event_time is not None and (self.first_event is None or event_time < self.first_event):
            self.first_event = event_time
        self.urgent = self.urgent or urgent


class DirtyQueue:
    """Sandboxes waiting for a pass, each at most once, each in at most one pass at a time.

    Two heaps of (ready time, seq, sandbox): events, listed first, and background work
    (periodic and start-up passes).  A heap item is stale when its seq is no longer the
    entry's (the entry was promoted to the event heap, re-pushed earlier, or taken); stale
    items are skipped.  :meth:`take_batch` hands out every entry that is ready at once: one
    node-wide pass covers them all (a pass re-plans the whole node whatever asked for it).

    Rate limit, per sandbox and for event-driven passes only: an event for a sandbox whose
    last event-driven pass ended less than its backoff ago waits for the rest of it; the
    backoff starts at ``holdoff`` and doubles (up to ``max_holdoff``) each time events keep
    arriving within it, and falls back to nothing after a quiet backoff.  An isolated update
    is planned at once; a storm costs about log2(duration/holdoff) + duration/max_holdoff
    plans, and its last update lands at most ``max_holdoff`` after the storm.  An *urgent*
    event (a caller blocks on its pass) is never held off: its caller is waiting, and callers
    that wait are self-limiting (each waits for a pass before it can send the next).
    """

    def __init__(
        self,
        holdoff: float = DEFAULT_HOLDOFF,
        max_holdoff: float = DEFAULT_MAX_HOLDOFF,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.holdoff = holdoff
        self.max_holdoff = max(holdoff, max_holdoff)
        self._clock = clock
        #: guards everything below; taken as itself (C code), not through the condition made
        #: on it, whose ``with`` is two Python calls (issue 28: three per request's round,
        #: add_all, take_batch and done_all, two of them on the connection thread's and the
        #: woken planner's way to the pass)
        self._lock = threading.RLock()
        #: signalled when work is queued or done (under ``_lock``)
        self._cond = threading.Condition(self._lock)
        self._events: list[tuple[float, int, str]] = []
        self._background: list[tuple[float, int, str]] = []
        self._queued: dict[str, _Entry] = {}
        #: sandbox being planned -> (its cause, the entry to run once more afterwards)
        self._running: dict[str, tuple[str, _Entry | None]] = {}
        #: sandbox -> (end of its last event-driven pass, backoff streak)
        self._recent: dict[str, tuple[float, int]] = {}
        self._seq = itertools.count()
        self._closed = False
        #: a node pass is wanted even if no entry is ready (a blocking request for no sandbox)
        self._kicked = False

    def _backoff(self, streak: int) -> float:
        return min(self.max_holdoff, self.holdoff * float(2 ** min(streak, 30)))

    def add(
        self,
        sandbox_id: str,
        cause: str,
        event_time: float | None = None,
        *,
        urgent: bool = False,
    ) -> bool:
        """Queue a pass; False when it was folded into one already queued (coalesced).

        ``urgent`` (an event whose caller blocks on it) skips the hold-off, and pulls an entry
        already held off forward to now.
        """
        with self._lock:
            added = self._add(sandbox_id, cause, event_time, urgent)
            self._cond.notify_all()
            return added

    def _add(self, sandbox_id: str, cause: str, event_time: float | None, urgent: bool) -> bool:
        """:meth:`add` under the lock, the planner not woken yet."""
        running = self._running.get(sandbox_id)
        if running is not None:
            run_cause, again = running
            if again is None:
                self._running[sandbox_id] = (run_cause, _Entry(cause, event_time, -1, urgent))
                return True
            again.merge(cause, event_time, urgent)
            return False
        entry = self._queued.get(sandbox_id)
        if entry is not None:
            was_event, was_urgent = entry.cause == "event", entry.urgent
            entry.merge(cause, event_time, urgent)
            if entry.cause == "event" and (not was_event or (urgent and not was_urgent)):
                # promote to the event heap / pull forward (the old heap item goes stale)
                self._push(sandbox_id, entry, self._ready_at(sandbox_id, "event", urgent))
            return False
        entry = _Entry(cause, event_time, -1, urgent)
        self._queued[sandbox_id] = entry
        self._push(sandbox_id, entry, self._ready_at(sandbox_id, cause, urgent))
        return True

    def add_all(
        self,
        sandbox_ids: Iterable[str],
        cause: str,
        event_time: float | None = None,
        *,
        urgent: bool = False,
    ) -> list[bool]:
        """:meth:`add` each, as one step: the planner takes all of them or none.

        Added one by one, a full pass's 2,000 entries woke the planner after the first few,
        which then ran a node pass for those and a second one for the rest: two node passes'
        CPU for one full pass, in about half of the idle passes measured (issue 14).
        """
        with self._lock:
            added = [self._add(sid, cause, event_time, urgent) for sid in sandbox_ids]
            self._cond.notify_all()  # once, not per entry (2,000 notify_all calls: ~5 ms)
            return added

    def kick(self) -> None:
        """Ask for a node pass now even when nothing is queued (``take_batch`` returns [])."""
        with self._lock:
            self._kicked = True
            self._cond.notify_all()

    def _ready_at(self, sandbox_id: str, cause: str, urgent: bool = False) -> float:
        now = self._clock()
        recent = self._recent.get(sandbox_id)
        if cause != "event" or recent is None or urgent:
            return now
        last, streak = recent
        until = last + self._backoff(streak)
        if now >= until:  # quiet for a whole backoff: start afresh
            del self._recent[sandbox_id]
            return now
        self._recent[sandbox_id] = (last, streak + 1)
        return until

    def _push(self, sandbox_id: str, entry: _Entry, ready: float) -> None:
        entry.seq = next(self._seq)
        heap = self._events if entry.cause == "event" else self._background
        heapq.heappush(heap, (ready, entry.seq, sandbox_id))

    def _top(self, heap: list[tuple[float, int, str]]) -> tuple[float, int, str] | None:
        while heap:
            _ready, seq, sid = heap[0]
            entry = self._queued.get(sid)
            if entry is not None and entry.seq == seq:
                return heap[0]
            heapq.heappop(heap)  # stale
        return None

    def take_batch(self, timeout: float | None = None) -> list[Work] | None:
        """Every ready sandbox, events first, all marked running; None once closed.

        Waits until one is ready (or :meth:`kick` asks for a pass: then the batch may be
        empty); ``timeout`` gives up with ``[]``.  Entries still held off stay queued.
        """
        deadline = None if timeout is None else self._clock() + timeout
        with self._lock:
            while not self._closed:
                now = self._clock()
                batch: list[Work] = []
                wait: float | None = None
                for heap in (self._events, self._background):
                    while (top := self._top(heap)) is not None:
                        if top[0] > now:
                            wait = top[0] - now if wait is None else min(wait, top[0] - now)
                            break
                        heapq.heappop(heap)
                        sid = top[2]
                        entry = self._queued.pop(sid)
                        self._running[sid] = (entry.cause, None)
                        batch.append(Work(sid, entry.cause, entry.first_event, now))
                if batch or self._kicked:
                    self._kicked = False
                    return batch
                if deadline is not None:
                    left = deadline - now
                    if left <= 0:
                        return []
                    wait = left if wait is None else min(wait, left)
                self._cond.wait(wait)
            return None

    def done(self, sandbox_id: str) -> None:
        self.done_all([sandbox_id])

    def done_all(self, sandbox_ids: Iterable[str]) -> None:
        """The pass over these sandboxes has ended: re-queue those notified meanwhile."""
        with self._lock:
            now = self._clock()
            for sid in sandbox_ids:
                self._done(sid, now)
            if len(self._recent) > 4096:
                for s, (last, streak) in list(self._recent.items()):
                    if now >= last + self._backoff(streak):
                        del self._recent[s]
            self._cond.notify_all()

    def _done(self, sandbox_id: str, now: float) -> None:
        if sandbox_id not in self._running:
            return
        cause, again = self._running.pop(sandbox_id)
        if cause == "event":
            _, streak = self._recent.get(sandbox_id, (now, 0))
            if again is not None and again.cause == "event":
                # events kept coming while this one was planned: back off (unless a caller
                # blocks on it)
                self._queued[sandbox_id] = again
                ready = now if again.urgent else now + self._backoff(streak)
                self._push(sandbox_id, again, ready)
                again = None
                streak += 1
            self._recent[sandbox_id] = (now, streak)
        if again is not None:
            self._queued[sandbox_id] = again
            self._push(sandbox_id, again, now)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._cond.notify_all()

    def drop_background(self) -> int:
        """Forget queued periodic and start-up work (not events); how many were dropped."""
        with self._lock:
            gone = [sid for sid, e in self._queued.items() if e.cause != "event"]
            for sid in gone:
                del self._queued[sid]  # its heap items are stale now
            self._background.clear()
            self._cond.notify_all()
            return len(gone)

    def depth(self) -> int:
        with self._lock:
            return len(self._queued)

    def running(self) -> int:
        with self._lock:
            return len(self._running)

    def idle(self) -> bool:
        with self._lock:
            return not self._queued and not self._running

    def wait_idle(self, timeout: float) -> bool:
        deadline = self._clock() + timeout
        with self._lock:
            while self._queued or self._running:
                left = deadline - self._clock()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.1))
            return True
