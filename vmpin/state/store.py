"""Durable state: containers, sandboxes and remembered thread roles, in SQLite under the state dir.

Why SQLite, and how it is used:

- Dozens of hook processes start at once on a busy node, each its own short-lived process.
  WAL mode lets readers run beside the one writer; every write is a ``BEGIN IMMEDIATE``
  transaction, so writers queue on the database lock (``busy_timeout``) instead of failing,
  and a hook killed mid-way leaves either its whole change or none of it.
- The schema is versioned with ``PRAGMA user_version``; a database from a newer vmpin is
  refused rather than misread.
- Events never carry state: every change writes the *level* (a container's CPU set) and bumps
  its sandbox's generation ``gen``.  Whoever reconciles records the generation it planned
  from in ``done_gen``; a sandbox with ``gen > done_gen`` is dirty.  A thousand updates to one
  sandbox therefore cost one plan, and a crash between a write and its reconcile loses
  nothing: the next pass sees the sandbox still dirty.
"""

from __future__ import annotations

import os
import sys
import time
from stat import S_ISREG
from sys import intern as _intern

from vmpin.core.cpuset import CpuSet
from vmpin.core.errors import SpecError, StateError, UnsafeFile
from vmpin.core.ids import check_id
from vmpin.linux.files import fsync_path
from vmpin.runtimes.oci import Identity, identify
from vmpin.state import allocations, changes, journal
from vmpin.wire import jsonio as json  # json without re: the hook reaches this module

#: meta key prefix of a sandbox's per-pod policy annotations (from its OCI specs)
POLICY_META = "podpolicy:"
#: meta key prefix of a pod's policy annotations as the Kubernetes API showed them (by pod uid)
API_POLICY_META = "podpolicy-api:"


TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.core._lean)
if TYPE_CHECKING:
    import sqlite3
    from collections.abc import Iterable, Mapping
    from types import TracebackType
    from typing import Any, NamedTuple
else:
    # the C module _sqlite3, without the sqlite3 package's imports nor functools' (see there)
    from vmpin.core._lean import NamedTuple
    from vmpin.state.sqlite import sqlite3


SCHEMA_VERSION = 4  # 3: vmpin's own allocations (vmpin.state.allocations); 4: vmpin.state.changes
#: journal events applied per transaction (one fsync each): 10,000 pending events cost
#: 20 commits, and a hook's time budget is checked between them.
INGEST_BATCH = 500
#: applied journal files a non-durable ingest leaves before it settles them itself
SETTLE_AFTER = 64
#: WAL pages past which a hook's connection checkpoints (:meth:`Store.keep_wal_short`)
SHORT_WAL = 64
#: the least step between two writes' ``updated_at`` on one container row (seconds; a
#: float64 near today's epoch resolves ~0.24 us)
_TICK = 1e-6
#: the shortest busy wait a store with a deadline is given, even once the deadline passed
#: (seconds): a live writer holds the lock for about a millisecond, a stopped one for ever
MIN_BUSY = 0.05
#: each connection's page cache, KiB (SQLite's default is 2,000).  The agent holds three
#: connections for its life, and at 2,000 sandboxes their caches filled to ~3.3 MiB of its
#: 50 MB budget (issue 14) for pages the OS page cache holds anyway: a pass that reads the
#: tables again reads each page once (an idle pass reads none), so a miss is one pread.
CACHE_KIB = 512


def state_error(path: str, err: BaseException) -> StateError:
    """One line for a database that cannot be used, naming the file and what to do."""
    text = str(err)
    if "readonly" in text or "read-only" in text:
        hint = "the state dir is read-only: make it writable (the agent pins meanwhile)"
    elif "full" in text:
        hint = "the state dir's filesystem is full: free space (nothing was recorded)"
    elif "locked" in text or "busy" in text:
        hint = "another vmpin holds the database: retry"
    else:
        hint = "run `vmpin doctor` to move it aside and rebuild it from the host"
    return StateError(f"{path}: {text}: {hint}")


_SCHEMA = """
CREATE TABLE IF NOT EXISTS sandboxes (
    id            TEXT PRIMARY KEY,
    runtime       TEXT NOT NULL,
    vmm_pid       INTEGER,
    vmm_start     INTEGER,
    pod_uid       TEXT,
    pod_name      TEXT,
    pod_namespace TEXT,
    gen           INTEGER NOT NULL DEFAULT 1,
    done_gen      INTEGER NOT NULL DEFAULT 0,
    created_at    REAL NOT NULL,
    updated_at    REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS containers (
    id            TEXT PRIMARY KEY,
    sandbox_id    TEXT NOT NULL,
    is_sandbox    INTEGER NOT NULL,
    name          TEXT,
    pod_uid       TEXT,
    pod_name      TEXT,
    pod_namespace TEXT,
    cpus          TEXT,
    cpus_source   TEXT,
    mems          TEXT,
    bundle        TEXT,
    pid           INTEGER,
    pid_start     INTEGER,
    cgroup        TEXT,
    runtime_seen  TEXT,
    kubelet_seen  TEXT,
    created_at    REAL NOT NULL,
    updated_at    REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS containers_sandbox ON containers(sandbox_id);
CREATE INDEX IF NOT EXISTS containers_bundle ON containers(bundle);
CREATE TABLE IF NOT EXISTS threads (
    sandbox_id TEXT NOT NULL,
    vmm_pid    INTEGER NOT NULL,
    vmm_start  INTEGER NOT NULL,
    tid        INTEGER NOT NULL,
    role       TEXT NOT NULL,
    idx        INTEGER,
    label      TEXT,
    layer      TEXT NOT NULL,
    PRIMARY KEY (sandbox_id, tid)
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT);
CREATE TABLE IF NOT EXISTS journal (name TEXT PRIMARY KEY);
""" + allocations.SCHEMA + changes.SCHEMA


class ContainerRec(NamedTuple):
    id: str
    sandbox_id: str
    is_sandbox: bool
    name: str | None = None
    pod_uid: str | None = None
    pod_name: str | None = None
    pod_namespace: str | None = None
    cpus: CpuSet | None = None
    cpus_source: str | None = None
    mems: str | None = None
    bundle: str | None = None
    pid: int | None = None
    pid_start: int | None = None
    cgroup: str | None = None
    runtime_seen: str | None = None
    kubelet_seen: str | None = None
    created_at: float = 0.0
    updated_at: float = 0.0


class PolicyRecord(NamedTuple):
    """A pod's policy annotations as one source gave them, and when vmpin recorded them."""

    annotations: Mapping[str, str]
    source: str  # oci (the hooks, from the specs) | api (the agent, from the Kubernetes API)
    at: float | None = None


def _policy_json(annotations: Mapping[str, str], at: float) -> str:
    return json.dumps({"annotations": dict(annotations), "at": round(at, 3)}, sort_keys=True)


def policy_record(raw: str, source: str) -> PolicyRecord:
    """A recorded policy input; the bare annotation map older vmpins wrote reads with no time.

    A value that is not what vmpin writes (a hand edit) reads as no annotations: the node's
    policy applies to that pod, and the store stays readable.
    """
    try:
        doc = json.loads(raw)
    except ValueError:
        return PolicyRecord({}, source)
    if not isinstance(doc, dict):
        return PolicyRecord({}, source)
    inner = doc.get("annotations")
    if isinstance(inner, dict):
        at = doc.get("at")
        ann, when = inner, float(at) if isinstance(at, (int, float)) else None
    else:
        ann, when = doc, None
    return PolicyRecord({k: v for k, v in ann.items() if isinstance(v, str)}, source, when)


class SandboxRec(NamedTuple):
    id: str
    runtime: str
    vmm_pid: int | None = None
    vmm_start: int | None = None
    pod_uid: str | None = None
    pod_name: str | None = None
    pod_namespace: str | None = None
    gen: int = 1
    done_gen: int = 0
    created_at: float = 0.0
    updated_at: float = 0.0

    @property
    def dirty(self) -> bool:
        return self.gen > self.done_gen


class ThreadRec(NamedTuple):
    tid: int
    role: str
    idx: int | None
    label: str | None
    layer: str


_CONTAINER_COLS = list(ContainerRec._fields)
_SANDBOX_COLS = list(SandboxRec._fields)


_CPUS_AT = _CONTAINER_COLS.index("cpus")
_SANDBOX_AT = _CONTAINER_COLS.index("is_sandbox")
#: text columns whose values repeat across rows (a sandbox's id and pod in each of its
#: containers, a namespace in every pod): read as one shared string each, see _shared()
_SHARED_CONTAINER = tuple(
    _CONTAINER_COLS.index(c)
    for c in ("sandbox_id", "name", "pod_uid", "pod_name", "pod_namespace", "cpus_source",
              "mems", "runtime_seen", "kubelet_seen")
)  # fmt: skip
_SHARED_THREAD = tuple(ThreadRec._fields.index(c) for c in ("role", "label", "layer"))
_SHARED_SANDBOX = tuple(
    _SANDBOX_COLS.index(c) for c in ("id", "runtime", "pod_uid", "pod_name", "pod_namespace")
)
_PARSED: dict[str, CpuSet] = {}


def _cpus(text: str | None) -> CpuSet | None:
    """A stored CPU list, parsed once per distinct text (a node pass reads every container,
    and a node's containers hold few distinct sets)."""
    if text is None:
        return None
    cpus = _PARSED.get(text)
    if cpus is None:
        if len(_PARSED) > 4096:
            _PARSED.clear()
        cpus = _PARSED[text] = CpuSet.parse(text)
    return cpus


def _shared(values: list[Any], at: tuple[int, ...]) -> list[Any]:
    """``values`` with the strings at ``at`` made the one interned copy of their text.

    Why: the agent keeps the store's rows between passes (an idle pass reads no table), and
    SQLite hands out a new string per row and column.  At 2,000 sandboxes the same sandbox
    ids, pod names, namespaces, thread roles and labels were tens of thousands of copies,
    ~1.8 MiB of the agent's 50 MB budget (issue 14).  ``sys.intern``: one copy across tables
    and passes, and freed once no row holds it.
    """
    for i in at:
        v = values[i]
        if type(v) is str:
            values[i] = _intern(v)
    return values


def _container(row: sqlite3.Row) -> ContainerRec:
    if len(row) != len(_CONTAINER_COLS):
        raise StateError(f"containers row has {len(row)} columns, not {len(_CONTAINER_COLS)}")
    values = _shared(list(row), _SHARED_CONTAINER)
    values[_SANDBOX_AT] = bool(values[_SANDBOX_AT])
    values[_CPUS_AT] = _cpus(values[_CPUS_AT])
    return ContainerRec._make(values)


def _sandbox(row: sqlite3.Row) -> SandboxRec:
    if len(row) != len(_SANDBOX_COLS):
        raise StateError(f"sandboxes row has {len(row)} columns, not {len(_SANDBOX_COLS)}")
    return SandboxRec._make(_shared(list(row), _SHARED_SANDBOX))


class Store:
    """One connection to the state database; cheap to open, so each process opens its own."""

    #: commits do not sync (defer_durability)
    deferred = False
    #: total_changes at the last settle_journal
    _settled_at = 0

    #: no wait for SQLite's locks goes past this (``time.monotonic()``), bar MIN_BUSY
    deadline: float | None = None

    def __init__(
        self,
        state_dir: str,
        *,
        timeout: float = 30.0,
        ingest: bool = True,
        deadline: float | None = None,
    ) -> None:
        """Open (creating if needed) the state in ``state_dir``; with ``ingest``, first apply
        whatever the hooks journaled since, so every reader sees every recorded event.

        ``timeout``: how long a write waits for another connection's write lock.  With
        ``deadline`` (``time.monotonic()``) instead, no such wait goes past it (each gets
        what is left, and at least :data:`MIN_BUSY`): a hook's or ``vmpin update``'s budget,
        where a stopped holder must not stall a container start (vmpin.service.budget).
        """
        self.state_dir = state_dir
        if deadline is not None:
            self.deadline = deadline
            timeout = _left(deadline)
        self._depth = 0
        self.path = os.path.join(state_dir, "state.db")
        try:
            os.makedirs(state_dir, mode=0o700, exist_ok=True)
        except OSError as err:
            raise StateError(f"{state_dir}: cannot create state dir: {err.strerror}") from None
        try:
            # Create the file 0600 before SQLite does: it would use 0644, and the -wal and -shm
            # files it creates next copy the database file's mode.  Only when it is missing
            # (O_EXCL): closing any fd of an open database drops every POSIX lock this process
            # holds on it, so another process would take over the WAL under the feet of this
            # process's other connections (the agent's workers) -- they then read a stale WAL.
            os.close(os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
        except FileExistsError:
            pass
        except OSError as err:
            raise StateError(f"{self.path}: {err.strerror}") from None
        try:
            st = os.lstat(self.path)
        except OSError as err:
            raise StateError(f"{self.path}: {err.strerror}") from None
        if not S_ISREG(st.st_mode):
            # SQLite would follow a symlink planted here and write wherever it points
            raise StateError(f"{self.path}: not a regular file (a symlink?): refused")
        #: opened by :meth:`open_readonly`: nothing in the state dir is to be written
        self.readonly = False
        #: a read-only view of a node where vmpin has recorded nothing yet (empty, in memory)
        self.fresh = False
        try:
            self.db = sqlite3.connect(self.path, timeout=timeout, isolation_level=None)
            self.db.execute(f"PRAGMA busy_timeout={int(timeout * 1000)}")
            self.db.execute(f"PRAGMA cache_size=-{CACHE_KIB}")
            self._ensure_schema()
        except sqlite3.Error as err:
            try:  # noqa: SIM105 (contextlib stays off the hook's path)
                self.db.close()
            except (AttributeError, sqlite3.Error):
                pass
            raise state_error(self.path, err) from None
        #: why the last ingest could not write (read-only or full state dir), else None
        self.write_error: str | None = None

        if ingest:
            try:
                self.ingest()
            except StateError as err:
                # Readers still read what is stored; a writer will meet the error itself.
                self.write_error = str(err)
                print(f"vmpin: {err}", file=sys.stderr)

    def _ensure_schema(self) -> None:
        version = self.db.execute("PRAGMA user_version").fetchone()[0]
        if version == SCHEMA_VERSION:
            self.db.execute("PRAGMA synchronous=FULL")  # durable by default: see ingest()
            return
        if version > SCHEMA_VERSION:
            raise StateError(
                f"{self.path}: schema version {version} is newer than this vmpin ({SCHEMA_VERSION})"
            )
        # WAL must be switched on outside a transaction; it is persistent once set.  Processes
        # opening a fresh database at once race here, and SQLite answers the losers "database
        # is locked" at once (a lock upgrade: busy_timeout would deadlock), so retry.
        for attempt in range(1000):
            try:
                self.db.execute("PRAGMA journal_mode=WAL")
                break
            except sqlite3.OperationalError as err:
                if attempt == 999:
                    raise StateError(f"{self.path}: cannot switch to WAL: {err}") from err
                time.sleep(0.01)
        self.db.execute("PRAGMA synchronous=FULL")
        with self.transaction():
            if self.db.execute("PRAGMA user_version").fetchone()[0] < SCHEMA_VERSION:
                # executescript() would COMMIT the open transaction: run statements one by one.
                for statement in _SCHEMA.split(";"):
                    if statement.strip():
                        self.db.execute(statement)
                changes.create(self.db)  # (triggers: not split on ";")
                self.db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        try:  # noqa: SIM105 (contextlib stays off the hook's path)
            os.chmod(self.path, 0o600)
        except OSError:
            pass

    @classmethod
    def open_readonly(
        cls,
        state_dir: str,
        *,
        timeout: float = 30.0,
        fresh: bool = False,
        copy: bool = False,
    ) -> Store:
        """Open existing state for reading only: no directory, file, schema or journal write.

        Read-only commands use this, so that ``state.db`` stays byte-identical.  A state dir
        holding neither a database nor a journal is a fresh node when ``fresh`` (the caller
        knows it is the node's own state dir, not a mistyped one): an empty store in memory,
        with :attr:`fresh` set so the command can say so; otherwise a :class:`StateError`
        that says what is missing and what would create it.
        SQLite's ``mode=ro`` connection never checkpoints the WAL into the database file.
        Events the hooks journaled and no writer applied yet are applied to an in-memory
        copy (SQLite's backup API), leaving the journal files for the next writer.

        ``copy``: always that in-memory copy, which may then be written (a hook's own pass
        when another process holds the write lock past its budget: its records go nowhere,
        its pins are made all the same).  Reading needs no lock in WAL mode: the copy is
        the store as last committed, whoever holds the write lock.
        """
        path = os.path.join(state_dir, "state.db")
        pending = journal.pending(state_dir) if os.path.isdir(state_dir) else []
        empty = not os.path.isfile(path) and not pending
        if empty and not fresh:
            raise StateError(
                f"no vmpin state at {state_dir}: no hook, update, reconcile or agent has"
                " written there (check --state-dir / VMPIN_STATE_DIR; on a new node, install"
                " the hooks or run `vmpin reconcile --once`)"
            )
        self = cls.__new__(cls)
        self.state_dir, self.path, self._depth = state_dir, path, 0
        self.readonly = True
        self.fresh = empty
        try:
            if os.path.isfile(path):
                uri = f"file:{_uri_path(path)}?mode=ro"
                self.db = sqlite3.connect(uri, uri=True, timeout=timeout, isolation_level=None)
                self.db.execute(f"PRAGMA busy_timeout={int(timeout * 1000)}")
                self.db.execute(f"PRAGMA cache_size=-{CACHE_KIB}")
                version = self.db.execute("PRAGMA user_version").fetchone()[0]
                if version not in (0, 2, SCHEMA_VERSION):  # (2 lacks only new tables)
                    raise StateError(
                        f"{path}: schema version {version}, this vmpin reads {SCHEMA_VERSION}"
                    )
            if pending or copy or not os.path.isfile(path):
                memory = sqlite3.connect(":memory:", isolation_level=None)
                if os.path.isfile(path):
                    self.db.backup(memory)
                    self.db.close()
                self.db = memory
                self._ensure_schema()
                self.ingest(consume=False)
        except sqlite3.Error as err:
            raise state_error(path, err) from None
        return self

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def transaction(self) -> _Transaction:
        """A write transaction: the database lock is taken at the start, not at first write.

        Nested uses join the outer transaction (applying journaled events calls the same
        methods as everyone else, all inside one transaction)."""
        return _Transaction(self)

    # -- applying journaled hook events ----------------------------------------------------
    def _resolve(self, ev: dict[str, Any]) -> ContainerRec | None:
        """The recorded container an event is about, keyed by container id, never by bundle
        alone: two containers may share a bundle path, and Kata's poststart/poststop carry the
        *sandbox* id (the container's id then comes from the bundle: recorded at create, or
        the bundle dir's name as containerd and CRI-O make it).

        By bundle only when exactly one record has that bundle and that record *is* the
        event's container (same id) or belongs to the sandbox the event names (Kata); a bundle
        shared by containers of different ids is ambiguous and resolves to nothing rather than
        clobbering one of them."""
        ident = ev["ident"]
        bundle = ev["bundle"]
        # A record found by id is this container only if its bundle agrees: a container's
        # bundle never changes, so another bundle means another container (Kata's sandbox id
        # with a container's bundle) or a new one reusing the id.
        by_ident = ident["container_id"] if ident else None
        # (a create's state id is its container id: looked up once)
        for cid in (by_ident, ev["id"] if ev["id"] != by_ident else None):
            rec = self.container(cid) if cid else None
            if rec is not None and (not bundle or rec.bundle in (None, bundle)):
                return rec
        if not bundle:
            return None
        cols = ",".join(_CONTAINER_COLS)
        rows = self.db.execute(
            f"SELECT {cols} FROM containers WHERE bundle=? AND (id=? OR sandbox_id=?)",
            (bundle, ev["id"], ev["id"]),
        ).fetchall()
        exact = [r for r in rows if r[0] == ev["id"]]
        if len(exact) == 1:
            return _container(exact[0])
        if len(rows) == 1:
            return _container(rows[0])
        return None

    def _apply(self, ev: dict[str, Any]) -> str | None:
        """Apply one event; the sandbox it touched (None when nothing is left to re-pin)."""
        if ev["stage"] == "poststop":
            return self._forget(ev)
        bundle = ev["bundle"]
        existing = self._resolve(ev)
        if existing is not None:
            sandbox = self.sandbox(existing.sandbox_id)
            if (
                ev["host_pid"]
                and ev["pid_start"] is not None
                and existing.pid is None
                and sandbox
                and sandbox.runtime == "runc"
            ):
                # (pid, start time) read by the hook at this very stage: the identity to follow
                self.put_container(existing._replace(pid=ev["host_pid"], pid_start=ev["pid_start"]))
            return existing.sandbox_id
        if ev["ident"] is None or not ev.get("has_config"):
            raise SpecError(f"hook {ev['stage']} for {ev['id']!r}: container unknown and no spec")
        ident = Identity(**ev["ident"])
        sandbox = self.sandbox(ident.sandbox_id)
        runtime = sandbox.runtime if sandbox else ev["runtime"]
        if sandbox is None:
            # For Kata the state pid may be the VMM: kept as an unverified hint (no start time).
            hint = ev["host_pid"] if runtime == "kata" else None
            self.put_sandbox(
                SandboxRec(
                    ident.sandbox_id,
                    runtime,
                    hint,
                    None,
                    ident.pod_uid,
                    ident.pod_name,
                    ident.pod_namespace,
                )
            )
        self._keep_policy_annotations(ident.sandbox_id, ev.get("annotations") or {})
        # A pid is kept only with the start time the hook read with it: without one nothing
        # can prove later that the pid still names this container's process.
        pid = ev["host_pid"] if runtime == "runc" and ev["pid_start"] is not None else None
        self.put_container(
            ContainerRec(
                id=ident.container_id,
                sandbox_id=ident.sandbox_id,
                is_sandbox=ident.is_sandbox,
                name=ident.name,
                pod_uid=ident.pod_uid,
                pod_name=ident.pod_name,
                pod_namespace=ident.pod_namespace,
                cpus=None if ev["cpus"] is None else CpuSet.parse(ev["cpus"]),
                cpus_source="spec",
                mems=ev["mems"],
                bundle=bundle,
                pid=pid,
                pid_start=ev["pid_start"] if pid else None,
            )
        )
        allocations.record_limit(self.db, ident.container_id, ev.get("cpu_limit"))
        return ident.sandbox_id

    def _keep_policy_annotations(self, sandbox_id: str, annotations: Mapping[str, str]) -> None:
        """Record a sandbox's per-pod policy annotations as its containers' specs carry them.

        containerd's ``pod_annotations`` (hooks/containerd/) and CRI-O, by itself, pass the
        pod's annotations into the OCI spec; vmpin.core.podpolicy reads them.  Later
        containers' annotations add to the sandbox's, they never remove: a pod's annotations
        are the same in every one of its containers' specs.
        """
        from vmpin.core.podpolicy import is_policy_key

        ours = {k: v for k, v in annotations.items() if is_policy_key(k)}
        if not ours:
            return
        key = POLICY_META + sandbox_id
        old = self.meta(key)
        before = policy_record(old, "oci").annotations if old else {}
        merged = {**before, **ours}
        if merged != before or old is None:
            self.set_meta(key, _policy_json(merged, time.time()))

    def policy_annotations(self, sandbox_id: str) -> dict[str, str]:
        """The per-pod policy annotations recorded from the sandbox's OCI specs (may be {})."""
        raw = self.meta(POLICY_META + sandbox_id)
        return dict(policy_record(raw, "oci").annotations) if raw else {}

    def policy_records(self) -> tuple[dict[str, PolicyRecord], dict[str, PolicyRecord]]:
        """Every recorded policy input, in two queries: the OCI specs' by sandbox id, and the
        Kubernetes API's by pod uid (what every process plans from: issue 25)."""
        oci = {
            key.removeprefix(POLICY_META): policy_record(raw, "oci")
            for key, raw in self.meta_prefix(POLICY_META)
            if raw
        }
        api = {
            key.removeprefix(API_POLICY_META): policy_record(raw, "api")
            for key, raw in self.meta_prefix(API_POLICY_META)
            if raw
        }
        return oci, api

    def record_api_policies(self, changes: Mapping[str, Mapping[str, str] | None]) -> None:
        """Record pods' policy annotations as the Kubernetes API shows them now (pod uid ->
        annotations; None: the API no longer has the pod), in one transaction.

        The agent writes them, so that ``audit``, ``reconcile --once`` and the hooks plan with
        the policy the operator set through the API, not only the agent (issue 25: the
        agent's choice read as drift, and ``reconcile --once`` reverted it).
        """
        now = time.time()
        rows = []
        gone = []
        for uid, shown in changes.items():
            check_id(uid, "pod uid")
            if shown is None:
                gone.append((API_POLICY_META + uid,))
            else:
                rows.append((API_POLICY_META + uid, _policy_json(shown, now)))
        with self.transaction() as db:
            db.executemany("DELETE FROM meta WHERE key=?", gone)
            db.executemany("INSERT OR REPLACE INTO meta VALUES (?,?)", rows)

    def _forget(self, ev: dict[str, Any]) -> str | None:
        """poststop: forget the container the event is about (see :meth:`_resolve`)."""
        rec = self._resolve(ev)
        # A Kata poststop of a non-sandbox container carries the sandbox id: when its
        # annotations say it is not the sandbox, it must not tear the whole sandbox down.
        if (
            rec is not None
            and rec.id == ev["id"]
            and rec.is_sandbox
            and ev["annotations"]
            and not identify(ev["id"], ev["annotations"]).is_sandbox
        ):
            rec = None
        if rec is None:
            return None
        self.delete_container(rec.id)
        return None if rec.is_sandbox else rec.sandbox_id

    def ingest(
        self,
        *,
        budget: float | None = None,
        batch: int = INGEST_BATCH,
        consume: bool = True,
        durable: bool = True,
    ) -> list[str]:
        """Apply pending events once each, in order, in transactions of ``batch`` events; the
        sandboxes they touched.

        ``budget`` (seconds) stops between batches once spent (a hook's share of its
        runtime's timeout); what is left waits for the next ingest.  An entry that cannot be
        read or applied is quarantined (:meth:`_quarantine`), never raised: one bad file must
        not stop every later store open.  A journal file is unlinked only once its effect is
        durable: committed with ``synchronous=FULL`` *and* checkpointed from the WAL into the
        database file (so even a lost or truncated WAL cannot lose an event whose file is
        gone; until then a file stays, recorded as applied, and is removed by the next ingest).

        ``consume=False`` (an in-memory copy for a read-only command) moves and removes no
        journal file: they stay for the next writer.

        ``durable=False`` does not wait for the disk: the events are committed without a sync
        and their files stay (recorded as applied) until :meth:`settle_journal`, which the
        agent runs after answering the hook that waits for its pass, and which this does
        itself past :data:`SETTLE_AFTER` such files.  Nothing can be lost that way: a file goes
        only once a checkpoint has its event in the database file, and an event whose commit
        did not reach the disk is applied again from its file.
        """
        if consume:
            journal.sweep_tmp(self.state_dir)
        names = journal.pending(self.state_dir)
        if not names:
            return []
        deadline = None if budget is None else time.monotonic() + budget
        touched: list[str] = []
        relaxed = not durable and not self.db.in_transaction and not self.deferred
        try:
            if relaxed:
                self.db.execute("PRAGMA synchronous=NORMAL")  # (WAL: no sync at commit)
            try:
                for start in range(0, len(names), max(1, batch)):
                    chunk = names[start : start + batch]
                    self._ingest_batch(chunk, touched, consume, settle=durable)
                    if deadline is not None and time.monotonic() >= deadline:
                        break
            finally:
                if relaxed:
                    self.db.execute("PRAGMA synchronous=FULL")
        except sqlite3.Error as err:
            raise state_error(self.path, err) from None
        if consume and not durable and len(names) > SETTLE_AFTER:
            self.settle_journal()
        return touched

    def defer_durability(self) -> None:
        """Commit without syncing from now on (WAL with ``synchronous=NORMAL``); a crash of
        the process loses nothing (the OS has the WAL), only a power loss could.  For writers
        someone waits for, whose writes are one of:

        - journal events and bookkeeping the next pass redoes from the host (the agent's
          planner, a Kata hook's own pass): the journal files stay until a checkpoint has
          their events in the database file (:meth:`settle_journal`);
        - a write the caller acknowledges (``vmpin update``): it calls :meth:`sync` before
          it answers, while the agent's pass runs rather than before it starts.
        """
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.deferred = True

    def keep_wal_short(self) -> None:
        """For a connection that ends with its process, unclosed (a hook leaves by
        ``os._exit``: closing would checkpoint on a container's start): checkpoint once the
        WAL holds :data:`SHORT_WAL` pages, not SQLite's default 1,000.

        Why: the next process to open the database alone (no agent holds it) finds no one
        else on the shared memory, resets it and rebuilds the WAL's index by reading every
        frame since the last checkpoint, ~2 us a frame: with the default, ~1 ms of every
        Kata start on a node without an agent, ~2 ms before each checkpoint.  A checkpoint
        of this small WAL is a few pages and a sync, once every few starts.
        """
        self.db.execute(f"PRAGMA wal_autocheckpoint={SHORT_WAL}")

    def sync(self) -> None:
        """Make every commit so far durable: fsync the WAL and the state dir, as
        ``synchronous=FULL`` does at each commit (with the directory on the WAL's first
        sync).  A commit no longer in the WAL is in the database file, which a checkpoint
        syncs before the WAL is reused."""
        for path in (self.path + "-wal", self.state_dir):
            try:
                fsync_path(path)
            except FileNotFoundError:
                continue  # no WAL: the last connection's close checkpointed it all
            except OSError as err:
                raise StateError(f"{path}: cannot sync: {err.strerror}") from None

    def settle_journal(self) -> int:
        """Remove the journal files whose events are applied, once a checkpoint has them in
        the database file (see :meth:`ingest`); how many were removed.  On a connection that
        defers durability, a checkpoint also follows any write of its own since the last."""
        names = journal.pending(self.state_dir)
        # (a deferred connection's own writes since the last settle want the checkpoint too)
        wrote = self.deferred and self.db.total_changes != self._settled_at
        if not names and not wrote:
            return 0
        try:
            applied = self._applied(self.db, names) if names else set()
            if not (applied or wrote) or not self._checkpointed():
                return 0
        except sqlite3.Error as err:
            raise state_error(self.path, err) from None
        self._settled_at = self.db.total_changes
        return self._remove_files([n for n in names if n in applied])

    def unapplied(self, names: list[str]) -> list[str]:
        """Those of ``names`` (journal file names, sorted) no ingest has applied yet."""
        if not names:
            return []
        try:
            done = self._applied(self.db, names)
        except sqlite3.Error as err:
            raise state_error(self.path, err) from None
        return [n for n in names if n not in done]

    @staticmethod
    def _applied(db: sqlite3.Connection, names: list[str]) -> set[str]:
        """Those of ``names`` (sorted, not empty) the journal table records as applied."""
        return {
            r[0]
            for r in db.execute(
                "SELECT name FROM journal WHERE name BETWEEN ? AND ?", (names[0], names[-1])
            )
        }

    def _remove_files(self, names: list[str]) -> int:
        """Unlink these journal files (their events are in the database file); how many."""
        d = journal.journal_dir(self.state_dir)
        removed = 0
        for name in names:
            try:
                os.unlink(os.path.join(d, name))
                removed += 1
            except FileNotFoundError:
                pass  # another process removed it
        return removed

    def _ingest_batch(
        self, names: list[str], touched: list[str], consume: bool, settle: bool = True
    ) -> None:
        bad: list[tuple[str, str]] = []
        with self.transaction() as db:
            done = self._applied(db, names)
            for name in names:
                if name in done:
                    continue
                try:
                    ev = journal.read_event(self.state_dir, name)
                except FileNotFoundError:
                    continue  # another process applied and removed it
                except (OSError, UnsafeFile) as err:
                    bad.append((name, f"unreadable: {getattr(err, 'strerror', None) or err}"))
                    db.execute("INSERT OR IGNORE INTO journal VALUES (?)", (name,))
                    continue
                except Exception as err:  # whatever it is, it is this entry's
                    bad.append((name, f"{type(err).__name__}: {err}"))
                    db.execute("INSERT OR IGNORE INTO journal VALUES (?)", (name,))
                    continue
                # A savepoint per event: a failure half-way through one event undoes exactly
                # that event, and the batch goes on.
                db.execute("SAVEPOINT ev")
                try:
                    sid = self._apply(ev)
                except sqlite3.OperationalError:
                    raise  # the database itself (locked, full, read-only): not this entry's fault
                except Exception as err:  # whatever it is, it is this entry's
                    db.execute("ROLLBACK TO ev")
                    bad.append((name, f"{type(err).__name__}: {err}"))
                    sid = None
                db.execute("RELEASE ev")
                if sid and sid not in touched:
                    touched.append(sid)
                db.execute("INSERT OR IGNORE INTO journal VALUES (?)", (name,))
            # names sort by time: a recorded name older than every file still pending was
            # unlinked, and no process can come across it again
            pending = journal.pending(self.state_dir)
            if pending:
                db.execute("DELETE FROM journal WHERE name < ?", (pending[0],))
        if not consume:
            return
        for name, reason in bad:
            self._quarantine(name, reason)
        if not settle or not self._checkpointed():
            return  # files stay until a checkpoint has them in the database file
        quarantined = {n for n, _ in bad}
        self._remove_files([n for n in names if n not in quarantined])

    def _checkpointed(self) -> bool:
        """Copy the WAL into the database file; True when all of it got there (PASSIVE: a
        reader elsewhere may hold older frames; then the journal files wait a little)."""
        busy, log_frames, done = self.db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        return bool(busy == 0 and log_frames == done)

    def _quarantine(self, name: str, reason: str) -> None:
        """Move an entry that cannot be applied to ``journal/bad/`` with a ``.reason`` file."""
        d = journal.journal_dir(self.state_dir)
        bad = journal.bad_dir(self.state_dir)
        print(
            f"vmpin: journal entry {os.path.join(d, name)}: {reason}; moved to {bad}/",
            file=sys.stderr,
        )
        try:
            os.makedirs(bad, mode=0o700, exist_ok=True)
            with open(
                os.path.join(bad, name + ".reason"),
                "w",
                encoding="utf-8",
                errors="backslashreplace",
            ) as f:
                f.write(reason + "\n")
            os.rename(os.path.join(d, name), os.path.join(bad, name))
        except FileNotFoundError:
            pass  # moved by another process
        except OSError as err:
            print(f"vmpin: cannot quarantine {name}: {err.strerror}", file=sys.stderr)

    def put_container(self, rec: ContainerRec) -> None:
        """Insert or replace a container and mark its sandbox dirty, in one transaction."""
        check_id(rec.id, "container id")
        check_id(rec.sandbox_id, "sandbox id")
        now = time.time()
        with self.transaction() as db:
            old = db.execute(
                "SELECT created_at, updated_at FROM containers WHERE id=?", (rec.id,)
            ).fetchone()
            values = {k: getattr(rec, k) for k in _CONTAINER_COLS}
            values["cpus"] = None if rec.cpus is None else rec.cpus.to_list()
            values["is_sandbox"] = int(rec.is_sandbox)
            values["created_at"] = old[0] if old else now
            # (each write of a row leaves a later updated_at: see restore_container_cpus)
            values["updated_at"] = max(now, old[1] + _TICK) if old else now
            cols = ",".join(_CONTAINER_COLS)
            marks = ",".join("?" for _ in _CONTAINER_COLS)
            db.execute(
                f"INSERT OR REPLACE INTO containers ({cols}) VALUES ({marks})",
                [values[k] for k in _CONTAINER_COLS],
            )
            self._bump(db, rec.sandbox_id, now)

    def set_container_cpus(
        self, container_id: str, cpus: CpuSet | None, source: str, **seen: str | None
    ) -> ContainerRec:
        """Record a container's new CPU set (an update) and mark its sandbox dirty; the
        record as this write left it (read in its transaction: its ``updated_at`` names this
        write, see :meth:`restore_container_cpus`)."""
        allowed = {"runtime_seen", "kubelet_seen"}
        if set(seen) - allowed:
            raise ValueError(f"unknown columns {set(seen) - allowed}")
        now = time.time()
        with self.transaction() as db:
            row = db.execute("SELECT sandbox_id FROM containers WHERE id=?", (container_id,))
            found = row.fetchone()
            if found is None:
                raise StateError(f"unknown container {container_id!r}")
            # updated_at=MAX(now, the last write's + a tick): every write of the row leaves a
            # later stamp than the one before it, even within one clock tick or after the
            # clock stepped back
            sets = ["cpus=?", "cpus_source=?", "updated_at=MAX(?, updated_at + ?)"]
            sets += [f"{k}=?" for k in seen]
            db.execute(
                f"UPDATE containers SET {','.join(sets)} WHERE id=?",
                [
                    None if cpus is None else cpus.to_list(),
                    source,
                    now,
                    _TICK,
                    *seen.values(),
                    container_id,
                ],
            )
            self._bump(db, found[0], now)
            rec = self.container(container_id)
        assert rec is not None
        return rec

    def restore_container_cpus(
        self, written: ContainerRec, cpus: CpuSet | None, source: str
    ) -> bool:
        """Put a container's CPU set back to ``cpus`` (from ``source``) -- only if the store
        still holds the write ``written`` (what :meth:`set_container_cpus` returned): a
        compare-and-swap, True when it swapped.

        For a write that is to be undone (``vmpin update`` whose re-pin failed or was
        interrupted).  Unconditional, the undo erased whatever was written since: another
        update, acknowledged meanwhile, was lost from the store while the kernel held it (3
        of 3, issue 26).  The write is known by its stamp (``updated_at``: each write of a
        row leaves a later one), not by its value, which a later write may repeat.
        """
        now = time.time()
        with self.transaction() as db:
            cur = db.execute(
                "UPDATE containers SET cpus=?, cpus_source=?, updated_at=MAX(?, updated_at + ?)"
                " WHERE id=? AND cpus IS ? AND cpus_source IS ? AND updated_at=?",
                (
                    None if cpus is None else cpus.to_list(),
                    source,
                    now,
                    _TICK,
                    written.id,
                    None if written.cpus is None else written.cpus.to_list(),
                    written.cpus_source,
                    written.updated_at,
                ),
            )
            if cur.rowcount != 1:
                return False
            self._bump(db, written.sandbox_id, now)
        return True

    def note_seen(self, container_id: str, **seen: str | None) -> None:
        """Remember what a runtime or kubelet last said, without changing the desired set."""
        allowed = {"runtime_seen", "kubelet_seen", "cgroup"}
        if not seen or set(seen) - allowed:
            raise ValueError(f"bad columns {set(seen)}")
        sets = ",".join(f"{k}=?" for k in seen)
        with self.transaction() as db:
            db.execute(f"UPDATE containers SET {sets} WHERE id=?", [*seen.values(), container_id])

    def container(self, container_id: str) -> ContainerRec | None:
        cols = ",".join(_CONTAINER_COLS)
        row = self.db.execute(f"SELECT {cols} FROM containers WHERE id=?", (container_id,))
        found = row.fetchone()
        return _container(found) if found else None

    def container_by_bundle(self, bundle: str) -> ContainerRec | None:
        cols = ",".join(_CONTAINER_COLS)
        row = self.db.execute(f"SELECT {cols} FROM containers WHERE bundle=?", (bundle,))
        found = row.fetchone()
        return _container(found) if found else None

    def containers(self, sandbox_id: str | None = None) -> list[ContainerRec]:
        cols = ",".join(_CONTAINER_COLS)
        if sandbox_id is None:
            rows = self.db.execute(f"SELECT {cols} FROM containers ORDER BY sandbox_id, id")
        else:
            rows = self.db.execute(
                f"SELECT {cols} FROM containers WHERE sandbox_id=? ORDER BY id", (sandbox_id,)
            )
        return [_container(r) for r in rows.fetchall()]

    def delete_container(self, container_id: str) -> ContainerRec | None:
        """Forget a container; forgetting a sandbox container forgets its whole sandbox."""
        rec = self.container(container_id)
        if rec is None:
            return None
        now = time.time()
        with self.transaction() as db:
            db.execute("DELETE FROM containers WHERE id=?", (container_id,))
            if rec.is_sandbox:
                db.execute("DELETE FROM containers WHERE sandbox_id=?", (rec.sandbox_id,))
                db.execute("DELETE FROM sandboxes WHERE id=?", (rec.sandbox_id,))
                self._forget_threads(db, rec.sandbox_id)
            else:
                left = db.execute(
                    "SELECT COUNT(*) FROM containers WHERE sandbox_id=?", (rec.sandbox_id,)
                ).fetchone()[0]
                if left == 0:
                    db.execute("DELETE FROM sandboxes WHERE id=?", (rec.sandbox_id,))
                    self._forget_threads(db, rec.sandbox_id)
                else:
                    self._bump(db, rec.sandbox_id, now)
        return rec

    # -- sandboxes -----------------------------------------------------------------------
    def put_sandbox(self, rec: SandboxRec) -> None:
        """Insert a sandbox, or update its runtime/VMM/pod fields, and mark it dirty."""
        check_id(rec.id, "sandbox id")
        now = time.time()
        with self.transaction() as db:
            db.execute(
                "INSERT INTO sandboxes (id, runtime, vmm_pid, vmm_start, pod_uid, pod_name,"
                " pod_namespace, gen, done_gen, created_at, updated_at)"
                " VALUES (?,?,?,?,?,?,?,1,0,?,?)"
                " ON CONFLICT(id) DO UPDATE SET runtime=excluded.runtime,"
                " vmm_pid=COALESCE(excluded.vmm_pid, vmm_pid),"
                " vmm_start=COALESCE(excluded.vmm_start, vmm_start),"
                " pod_uid=COALESCE(excluded.pod_uid, pod_uid),"
                " pod_name=COALESCE(excluded.pod_name, pod_name),"
                " pod_namespace=COALESCE(excluded.pod_namespace, pod_namespace),"
                " gen=gen+1, updated_at=excluded.updated_at",
                (
                    rec.id,
                    rec.runtime,
                    rec.vmm_pid,
                    rec.vmm_start,
                    rec.pod_uid,
                    rec.pod_name,
                    rec.pod_namespace,
                    now,
                    now,
                ),
            )

    def set_vmm(self, sandbox_id: str, vmm_pid: int | None, vmm_start: int | None) -> None:
        with self.transaction() as db:
            db.execute(
                "UPDATE sandboxes SET vmm_pid=?, vmm_start=?, updated_at=? WHERE id=?",
                (vmm_pid, vmm_start, time.time(), sandbox_id),
            )

    def sandbox(self, sandbox_id: str) -> SandboxRec | None:
        cols = ",".join(_SANDBOX_COLS)
        row = self.db.execute(f"SELECT {cols} FROM sandboxes WHERE id=?", (sandbox_id,))
        found = row.fetchone()
        return _sandbox(found) if found else None

    def sandboxes(self) -> list[SandboxRec]:
        cols = ",".join(_SANDBOX_COLS)
        rows = self.db.execute(f"SELECT {cols} FROM sandboxes ORDER BY id").fetchall()
        return [_sandbox(r) for r in rows]

    def tracked(self) -> dict[str, tuple[str, int]]:
        """Sandbox id -> (runtime, how many of its containers are stored): what the agent's
        gauges and status count, read as two aggregates (the agent asks up to once a second;
        whole records of 2,000 sandboxes and their containers took ~20 ms)."""
        runtimes = self.db.execute("SELECT id, runtime FROM sandboxes").fetchall()
        counts = dict(
            self.db.execute("SELECT sandbox_id, count(*) FROM containers GROUP BY sandbox_id")
        )
        return {sid: (runtime, counts.get(sid, 0)) for sid, runtime in runtimes}

    def delete_sandbox(self, sandbox_id: str) -> None:
        with self.transaction() as db:
            db.execute("DELETE FROM containers WHERE sandbox_id=?", (sandbox_id,))
            db.execute("DELETE FROM sandboxes WHERE id=?", (sandbox_id,))
            self._forget_threads(db, sandbox_id)

    def mark_dirty(self, sandbox_ids: Iterable[str] | None = None) -> None:
        """Bump generations: of the given sandboxes, or of all (after an agent restart)."""
        now = time.time()
        with self.transaction() as db:
            if sandbox_ids is None:
                db.execute("UPDATE sandboxes SET gen=gen+1, updated_at=?", (now,))
            else:
                for sid in sandbox_ids:
                    self._bump(db, sid, now)

    def version(self) -> tuple[int, int]:
        """A value that moves whenever the database may have changed: ``PRAGMA
        data_version`` moves when another connection commits, ``total_changes`` when this
        one writes.  Equal versions mean equal tables, so what was read or derived from
        them under the first may be used again (one small query, where re-reading every
        table of a 2,000-sandbox node is ~25 ms of each pass)."""
        return (self.db.execute("PRAGMA data_version").fetchone()[0], self.db.total_changes)

    def data_version(self) -> int:
        """A value that moves when *another* connection commits (``PRAGMA data_version``):
        whether anyone wrote the store while this connection was planning from it."""
        return int(self.db.execute("PRAGMA data_version").fetchone()[0])

    def dirty(self) -> list[tuple[str, int]]:
        rows = self.db.execute("SELECT id, gen FROM sandboxes WHERE gen > done_gen ORDER BY id")
        return [(r[0], r[1]) for r in rows.fetchall()]

    def mark_done(self, sandbox_id: str, gen: int) -> None:
        """Record that the sandbox was planned from generation ``gen`` (never moves back)."""
        with self.transaction() as db:
            db.execute(
                "UPDATE sandboxes SET done_gen=MAX(done_gen, ?) WHERE id=?", (gen, sandbox_id)
            )

    @staticmethod
    def _forget_threads(db: sqlite3.Connection, sandbox_id: str) -> None:
        db.execute("DELETE FROM threads WHERE sandbox_id=?", (sandbox_id,))
        db.execute("DELETE FROM meta WHERE key LIKE ?", (f"missing-vcpus:{sandbox_id}:%",))
        db.execute("DELETE FROM meta WHERE key=?", (POLICY_META + sandbox_id,))

    @staticmethod
    def _bump(db: sqlite3.Connection, sandbox_id: str, now: float) -> None:
        db.execute("UPDATE sandboxes SET gen=gen+1, updated_at=? WHERE id=?", (now, sandbox_id))

    # -- remembered thread roles -----------------------------------------------------------
    def threads(self, sandbox_id: str, vmm_pid: int, vmm_start: int) -> dict[int, ThreadRec]:
        rows = self.db.execute(
            "SELECT tid, role, idx, label, layer FROM threads"
            " WHERE sandbox_id=? AND vmm_pid=? AND vmm_start=? ORDER BY tid",
            (sandbox_id, vmm_pid, vmm_start),
        ).fetchall()
        return {r[0]: ThreadRec(*r) for r in rows}

    def all_threads(self) -> dict[tuple[str, int, int], dict[int, ThreadRec]]:
        """:meth:`threads` of every (sandbox, VMM pid, VMM start), in one query (a node pass
        reads them all: one query per sandbox made the pass's store time grow with them)."""
        out: dict[tuple[str, int, int], dict[int, ThreadRec]] = {}
        rows = self.db.execute(
            "SELECT sandbox_id, vmm_pid, vmm_start, tid, role, idx, label, layer FROM threads"
            " ORDER BY sandbox_id, tid"
        )
        make = ThreadRec._make
        for row in rows.fetchall():
            key = row[:3]  # (sandbox, pid, start)
            found = out.get(key)
            if found is None:
                found = out[tuple(_shared(list(key), (0,)))] = {}
            found[row[3]] = make(_shared(list(row[3:]), _SHARED_THREAD))
        return out

    def save_threads(
        self, sandbox_id: str, vmm_pid: int, vmm_start: int, threads: Iterable[ThreadRec]
    ) -> None:
        with self.transaction() as db:
            db.execute("DELETE FROM threads WHERE sandbox_id=?", (sandbox_id,))
            db.executemany(
                "INSERT INTO threads VALUES (?,?,?,?,?,?,?,?)",
                [
                    (sandbox_id, vmm_pid, vmm_start, t.tid, t.role, t.idx, t.label, t.layer)
                    for t in threads
                ],
            )

    # -- meta ----------------------------------------------------------------------------
    def meta(self, key: str) -> str | None:
        row = self.db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def meta_prefix(self, prefix: str) -> list[tuple[str, str]]:
        """Every (key, value) whose key starts with ``prefix`` (no LIKE wildcards in it)."""
        rows = self.db.execute(
            "SELECT key, value FROM meta WHERE substr(key, 1, ?) = ?", (len(prefix), prefix)
        ).fetchall()
        # (the values repeat: an original affinity per thread, mostly the same few sets)
        return [(str(r[0]), _intern(str(r[1]))) for r in rows]

    def delete_meta(self, keys: Iterable[str]) -> None:
        with self.transaction() as db:
            db.executemany("DELETE FROM meta WHERE key=?", [(k,) for k in keys])

    def set_meta(self, key: str, value: str) -> None:
        with self.transaction() as db:
            db.execute("INSERT OR REPLACE INTO meta VALUES (?,?)", (key, value))

    # -- one sandbox's records through the indexes (an event's pass: issue 28) ----------------
    def threads_of(self, sandbox_id: str) -> dict[tuple[str, int, int], dict[int, ThreadRec]]:
        """:meth:`all_threads` of one sandbox (the primary key's range)."""
        out: dict[tuple[str, int, int], dict[int, ThreadRec]] = {}
        rows = self.db.execute(
            "SELECT vmm_pid, vmm_start, tid, role, idx, label, layer FROM threads"
            " WHERE sandbox_id=? ORDER BY tid",
            (sandbox_id,),
        )
        for row in rows.fetchall():
            out.setdefault((sandbox_id, row[0], row[1]), {})[row[2]] = ThreadRec(*row[2:])
        return out

    def meta_under(self, prefix: str) -> list[tuple[str, str]]:
        """:meth:`meta_prefix` through the key's index (a range, not a scan): for a prefix
        that names one sandbox."""
        rows = self.db.execute(
            "SELECT key, value FROM meta WHERE key >= ? AND key < ?",
            (prefix, prefix[:-1] + chr(ord(prefix[-1]) + 1)),
        ).fetchall()
        return [(str(r[0]), _intern(str(r[1]))) for r in rows]


def _left(deadline: float) -> float:
    """Seconds to wait for a lock before ``deadline``, and never less than MIN_BUSY."""
    return max(MIN_BUSY, deadline - time.monotonic())


_URI_SAFE = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789/_.-~")


def _uri_path(path: str) -> str:
    """``path`` as an SQLite URI filename: every byte but the unreserved ones as %HH (what
    urllib.parse.quote does, without its import of re on every read command)."""
    raw = os.fsencode(path)
    return "".join(chr(b) if b in _URI_SAFE else f"%{b:02X}" for b in raw)


class _Transaction:
    """:meth:`Store.transaction`'s context manager; ``with`` yields the connection.

    A class rather than ``contextlib.contextmanager``: contextlib is not imported on the
    hook's path (it is ~0.5 ms, with its own imports, of a Kata hook that pins in-process).
    The outermost one begins (``BEGIN IMMEDIATE``) and commits, or rolls back on any
    exception, which then propagates; nested ones only join."""

    __slots__ = ("_outer", "_store")

    def __init__(self, store: Store) -> None:
        self._store = store
        self._outer = False

    def __enter__(self) -> sqlite3.Connection:
        store = self._store
        if store._depth:
            store._depth += 1
        else:
            if store.deadline is not None:
                # what is left of the caller's budget (vmpin.service.budget), not 30 s
                store.db.execute(f"PRAGMA busy_timeout={int(_left(store.deadline) * 1000)}")
            store.db.execute("BEGIN IMMEDIATE")
            store._depth = 1
            self._outer = True
        return store.db

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        store = self._store
        if not self._outer:
            store._depth -= 1
            return
        try:
            store.db.execute("COMMIT" if kind is None else "ROLLBACK")
        finally:
            store._depth = 0
