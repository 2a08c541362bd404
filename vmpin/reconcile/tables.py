"""The store's tables as a long-lived observer keeps them between passes (the agent's).

A pass reads, from the store, every sandbox's record, its containers, its VMM's thread roles,
the vCPUs no layer found, the original affinities and the pods' policy records
(:class:`.observation.Recorded`).  Read whole, that was 26,000 rows at 2,000 sandboxes, on
every pass after the store moved -- and an event's pass always follows a write (issue 28).
So the first pass reads them whole, and each later one asks the store's change log
(:mod:`vmpin.state.changes`) which sandboxes' tables and which meta keys moved since, and
reads what moved again through the indexes: rows in proportion to what changed, whoever
wrote it (an update's pass reads its sandbox's row and containers, not its threads).
A log that no longer reaches back that far (:func:`~vmpin.state.changes.since` says None)
means a whole read again.

What :meth:`Tables.current` returns is only read by the pass; the tables themselves are
changed here, between passes, and only after the store moved (when the last observation's
plan is dropped: :meth:`vmpin.reconcile.reconciler.Reconciler.plan`).
"""

from __future__ import annotations

from vmpin.reconcile.observation import (
    MISSING_PREFIX,
    ORIG_PREFIX,
    Recorded,
    key_sandbox,
    sandbox_prefixes,
)
from vmpin.state import changes
from vmpin.state.records import API_POLICY_META, POLICY_META, policy_record

TYPE_CHECKING = False
if TYPE_CHECKING:
    from vmpin.reconcile.observation import Scope
    from vmpin.state.reader import Reader
    from vmpin.state.records import ContainerRec, PolicyRecord, SandboxRec, ThreadRec


#: the tables are read whole again once more than one sandbox in this many moved (a start-up
#: pass's records), and more than :data:`FEW`
WHOLE = 4
#: sandboxes that moved which are read one by one on any node (a whole read is eight
#: statements and every thread row: a one-sandbox node's event read them all each pass)
FEW = 1


class Tables:
    """One store's tables as of its :attr:`version` and its change log's :attr:`seq`."""

    __slots__ = (
        "_at", "_keys", "_recs", "_threads", "api", "containers", "missing", "moved", "oci",
        "originals", "records", "scope_key", "seq", "store", "threads", "version",
    )  # fmt: skip

    def __init__(self, store: Reader, scope: Scope) -> None:
        """Read them whole."""
        self.store = store
        self.scope_key = (scope.vmms, scope.affinity)
        self.version = store.version()
        # (before the tables: whatever commits while they are read is in the next delta)
        self.seq = changes.top(store.db)
        #: the sandboxes whose records the last :meth:`follow` read again (None: the tables
        #: were read whole, or the pods' API policies moved: any sandbox's may have)
        self.moved: set[str] | None = None
        rec = Recorded.read(store, scope)
        self.containers: dict[str, list[ContainerRec]] = dict(rec.containers)
        self.threads: dict[tuple[str, int, int], dict[int, ThreadRec]] = dict(rec.threads)
        self.missing: dict[str, str] = dict(rec.missing)
        self.originals: dict[str, str] = dict(rec.originals)
        self.records: list[SandboxRec] = store.sandboxes()
        self.oci, self.api = store.policy_records()
        self._recs = {r.id: r for r in self.records}
        self._at = {r.id: i for i, r in enumerate(self.records)}
        #: each sandbox's thread keys, and its missing and original meta keys
        self._threads: dict[str, list[tuple[str, int, int]]] = {}
        for vmm in self.threads:
            self._threads.setdefault(vmm[0], []).append(vmm)
        self._keys: dict[str, list[str]] = {}
        for name in (*self.missing, *self.originals):
            self._keys.setdefault(key_sandbox(name), []).append(name)

    def matches(self, store: Reader, scope: Scope) -> bool:
        return self.store is store and self.scope_key == (scope.vmms, scope.affinity)

    def follow(self, version: tuple[int, int]) -> bool:
        """Bring the tables to the store as it is now (``version`` read just before); False
        when the change log cannot say what moved (read them whole then)."""
        store = self.store
        delta = store.changes_since(self.seq)
        if delta is None:
            return False
        # what to read again: each sandbox's tables written, and its meta keys (the VMM's
        # missing vCPUs and original affinities, its pod's policy record: "meta", "policy")
        # (a copy: the delta is the store's, shared with the pass's other readers)
        what = {sid: set(tables) for sid, tables in delta.tables.items()}
        api = False
        for key in delta.keys:
            if key.startswith(API_POLICY_META):
                api = True
            elif key.startswith(POLICY_META):
                what.setdefault(key[len(POLICY_META) :], set()).add("policy")
            elif key.startswith((ORIG_PREFIX, MISSING_PREFIX)):
                what.setdefault(key_sandbox(key), set()).add("meta")
        sids = set(what)
        if len(sids) > max(FEW, len(self.records) // WHOLE):
            return False  # (up to six statements a sandbox: past a few, each table once)
        moved = False
        for sid, tables in what.items():
            moved = self._read_sandbox(sid, tables, delta.done.get(sid)) or moved
        if moved:  # a sandbox came or went: in id order, as store.sandboxes() gives them
            self.records[:] = sorted(self._recs.values(), key=lambda r: r.id)
            self._at = {r.id: i for i, r in enumerate(self.records)}
        if api:
            self.api = {
                key.removeprefix(API_POLICY_META): policy_record(raw, "api")
                for key, raw in store.meta_under(API_POLICY_META)
                if raw
            }
        self.seq, self.version = delta.top, version
        self.moved = None if api else sids
        return True

    def _read_sandbox(self, sid: str, tables: set[str], done: int | None = None) -> bool:
        """What moved of one sandbox's records (``tables``: of changes.TABLES, "meta" and
        "policy"), read again; whether it came or went.  ``changes.DONE`` alone of its row:
        its ``done_gen`` written, to ``done`` (the record held here takes it, unread)."""
        store, (vmms, affinity) = self.store, self.scope_key
        if "containers" in tables:
            containers = store.containers(sid)
            if containers:
                self.containers[sid] = containers
            else:
                self.containers.pop(sid, None)
        if vmms and "threads" in tables:
            for vmm in self._threads.pop(sid, ()):
                self.threads.pop(vmm, None)
            mine = store.threads_of(sid)
            if mine:
                self.threads.update(mine)
                self._threads[sid] = list(mine)
        if vmms and "meta" in tables:
            for name in self._keys.pop(sid, ()):
                self.missing.pop(name, None)
                self.originals.pop(name, None)
            keys: list[str] = []
            missing, originals = sandbox_prefixes(sid)
            for name, value in store.meta_under(missing):
                self.missing[name] = value
                keys.append(name)
            if affinity:
                for name, value in store.meta_under(originals):
                    self.originals[name] = value
                    keys.append(name)
            if keys:
                self._keys[sid] = keys
        if "policy" in tables:
            raw = store.meta(POLICY_META + sid)
            if raw:
                self.oci[sid] = policy_record(raw, "oci")
            else:
                self.oci.pop(sid, None)
        if "sandboxes" not in tables:
            held = self._recs.get(sid)
            if changes.DONE not in tables or done is None:
                return False
            if held is not None:
                self._recs[sid] = self.records[self._at[sid]] = held._replace(done_gen=done)
                return False
            # (not held here: its row is read whole)
        rec = store.sandbox(sid)
        if rec is None:
            return self._recs.pop(sid, None) is not None
        if sid in self._recs:
            self._recs[sid] = self.records[self._at[sid]] = rec
            return False
        self._recs[sid] = rec
        return True

    def current(
        self,
    ) -> tuple[Recorded, list[SandboxRec], tuple[dict[str, PolicyRecord], dict[str, PolicyRecord]]]:
        """What a pass reads (a fresh :class:`Recorded`: its vhost scan is the pass's own)."""
        rec = Recorded(self.containers, self.threads, self.missing, self.originals)
        return rec, self.records, (self.oci, self.api)


__all__ = ["Tables"]
