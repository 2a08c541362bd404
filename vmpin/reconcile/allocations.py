"""vmpin allocates exclusive CPUs where kubelet does not (issue 30): who asks, who gets what.

On a node whose kubelet CPU manager policy is ``none`` there is no checkpoint to follow: every
container floats over every CPU.  A pod that asks (``vmpin.io/exclusive-cpus: N|limit``, or
Crane's ``qos.gocrane.io/cpu-manager: exclusive``: :func:`vmpin.core.podpolicy.exclusive_request`)
gets CPUs of its own here, chosen in kubelet's order (:mod:`vmpin.core.allocate`), and every
other container and sandbox runs on what is left: the node's shared pool.

Two steps, on either side of the pass's observe (vmpin.reconcile.reconciler):

- :func:`settle` -- in a pass that applies, before it observes: under the node's plan lock
  and inside one ``BEGIN IMMEDIATE`` transaction it reads the store's containers, their
  pods' policy records and CPU limits, and the allocations table; it releases the
  allocations of sandboxes whose last container is gone (or which no longer ask), grants the
  waiting ones in the order they asked (first come, first served), and writes the difference
  (vmpin.state.allocations).  Two processes settling at once queue on SQLite's write lock:
  the second reads the first's rows before it chooses, so no CPU is handed out twice even by
  a pass that went on without the node lock.  Nothing is written when nothing changes.
- :func:`overlay` -- in the pure plan (vmpin.reconcile.plan.plan_node): with no static
  checkpoint and at least one CPU allocated, the shared pool is the online CPUs less the
  allocated ones; an allocated pod's app and init containers have its allocation as their CPU
  set (``cpus_source`` ``vmpin-alloc``); every CPU allocated is an exclusive claim of its pod
  (``audit``'s foreign-on-exclusive); a container of another pod whose own CPU set reaches
  into an allocation keeps what is left of it, or the pool.

Once vmpin has granted CPUs on a node it keeps the node's pool from then on (a row
:data:`NODE_ROW` in the table says so): when the last allocation goes, the pool is every
online CPU again and the containers and sandboxes that were shrunk to it grow back, rather
than being left on the last pool when nothing is allocated any more.

The node row also carries what the plan follows of kubelet's configuration file, written by
the settle that read it (the plan reads no file): under ``strict-cpu-reservation`` its CPUs are
kubelet's reserved ones, which then leave the shared pool and are where helper threads under
``isolate`` go; its ``via`` names the options the plan follows (:func:`node_via`,
:func:`plan_options`): ``prefer-align-cpus-by-uncorecache`` keeps floating vCPUs in one L3
group (vmpin.core.planner).

A request that cannot be met (not enough free CPUs, the pool would be left empty, no integer
CPU limit to count) waits in the table with its reason: the pod runs on the shared pool,
``audit`` says why in its notes (:func:`notes`), the agent emits an ``AllocationRefused``
Event, and the next pass after CPUs free up grants it.  Under kubelet's static policy vmpin
grants nothing: kubelet allocates there, and vmpin follows its checkpoint as ever.
"""

from __future__ import annotations

import time

from vmpin.core.allocate import Options, Refusal, allocate, for_machine, reserved_cpus
from vmpin.core.cpuset import EMPTY, CpuSet
from vmpin.core.podpolicy import exclusive_request
from vmpin.runtimes.kubelet import is_infra
from vmpin.state import allocating
from vmpin.state import allocations as table
from vmpin.state.allocations import Allocation
from vmpin.state.changes import top

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping

    from vmpin.core.topology import Topology
    from vmpin.reconcile.observation import Observation
    from vmpin.runtimes.kubelet import Checkpoint
    from vmpin.state.reader import Reader
    from vmpin.state.records import ContainerRec, PolicyRecord
    from vmpin.state.store import Store

#: a container's ``cpus_source`` when its CPU set is its pod's allocation
SOURCE = "vmpin-alloc"
#: the table's row that says vmpin has allocated on this node (no sandbox has this id)
NODE_ROW = ""
#: what the node row's ``via`` says, then the kubelet options the plan follows
ALLOCATES = "vmpin allocates on this node"
_FOLLOWS = "; the plan follows kubelet's "


def node_via(options: Options) -> str:
    """The node row's ``via``: :data:`ALLOCATES`, and the kubelet options the plan follows."""
    names = [name for name, on in (
        ("prefer-align-cpus-by-uncorecache", options.prefer_uncore),
        ("strict-cpu-reservation", options.strict_reservation),
    ) if on]  # fmt: skip
    return ALLOCATES + (_FOLLOWS + ", ".join(names) if names else "")


def plan_options(via: str) -> frozenset[str]:
    """The kubelet options a node row's ``via`` names (:func:`node_via`)."""
    _, _, names = via.partition(_FOLLOWS)
    return frozenset(n for n in names.split(", ") if n)


def kubelet_allocates(checkpoint: Checkpoint | None) -> bool:
    """kubelet's static policy hands out exclusive CPUs itself: vmpin grants none."""
    return checkpoint is not None and checkpoint.policy == "static"


def settle(
    store: Store,
    topology: Topology,
    checkpoint: Checkpoint | None = None,
    kubelet_config: str | None = None,
) -> bool:
    """Release, grow and grant allocations from what the store holds now; whether a row
    changed.  A no-op (no transaction) on a node where no pod asks and none holds any.

    ``kubelet_config``: kubelet's configuration file, whose reserved CPUs and static-policy
    options the allocation follows (vmpin.runtimes.kubeletconfig); its notes are kept on the
    table's node row, for ``audit``."""
    if store.readonly:
        return False
    version = store.version()
    if getattr(store, _SETTLED, None) == version:
        return False  # nothing moved since this store's last settle: nothing to decide
    asks = _asking(store)
    found = _rows(store, version)
    held = any(a.sandbox_id != NODE_ROW for a in found)
    if not asks and not held and not allocating.present(store.state_dir):
        setattr(store, _SETTLED, version)
        return False
    options, config_notes = Options(), list[str]()
    if kubelet_config:
        from vmpin.runtimes.kubeletconfig import read_options

        options, config_notes = read_options(kubelet_config)
        options, machine_notes = for_machine(topology, options)
        config_notes += machine_notes
    with store.transaction() as db:
        before = table.read(db)
        rows, gone = decide(
            before,
            store.containers(),
            *store.policy_records(),
            table.limits(db),
            topology,
            static=kubelet_allocates(checkpoint),
            options=options,
            node_note="; ".join(config_notes) or None,
        )
        old = {a.sandbox_id: a for a in before}
        changed = [r for r in rows if old.get(r.sandbox_id) != r]
        if changed or gone:
            table.write(db, changed, gone)
    table.mark(store.state_dir, [r for r in rows if r.sandbox_id != NODE_ROW])
    setattr(store, _SETTLED, store.version())
    return bool(changed or gone)


#: the attribute a store carries its version after its last settle in (an idle agent
#: settles nothing), its allocations as last read (:func:`_rows`), and who asks
#: (:func:`_asking`): kept on the store itself, so that no other store (a later one at the
#: same address) is ever answered from them
_SETTLED = "_vmpin_allocations_settled"
_READ = "_vmpin_allocations_read"
_ASKS = "_vmpin_allocations_asks"


def _asking(store: Store) -> bool:
    """Whether any pod's policy record asks vmpin for exclusive CPUs.

    Kept per store between passes, as (the change log's seq, the sandboxes whose OCI record
    asks, the pods whose API record asks), and brought up to date from the records whose
    keys the change log names (vmpin.state.changes): an event's pass on a node where no pod
    asks reads no policy record but its own sandbox's (issue 28: every record, every pass)."""
    from vmpin.state.records import API_POLICY_META, POLICY_META, policy_record

    def asks(raw: str | None, source: str) -> bool:
        return raw is not None and raw != "" and (
            exclusive_request(policy_record(raw, source).annotations) is not None
        )

    memo: tuple[int, set[str], set[str]] | None = getattr(store, _ASKS, None)
    delta = store.changes_since(memo[0]) if memo is not None else None
    if memo is None or delta is None:
        seq = top(store.db)
        oci, api = store.policy_records()
        memo = (
            seq,
            {sid for sid, r in oci.items() if exclusive_request(r.annotations) is not None},
            {uid for uid, r in api.items() if exclusive_request(r.annotations) is not None},
        )
    else:
        _, by_sandbox, by_pod = memo
        if any(key.startswith(API_POLICY_META) for key in delta.keys):
            by_pod = {
                key.removeprefix(API_POLICY_META)
                for key, raw in store.meta_under(API_POLICY_META)
                if asks(raw, "api")
            }
        for key in delta.keys:
            if key.startswith(POLICY_META):
                sid = key.removeprefix(POLICY_META)
                if asks(store.meta(key), "oci"):
                    by_sandbox.add(sid)
                else:
                    by_sandbox.discard(sid)
        memo = (delta.top, by_sandbox, by_pod)
    setattr(store, _ASKS, memo)
    return bool(memo[1] or memo[2])


def decide(
    before: list[Allocation],
    containers: list[ContainerRec],
    oci: Mapping[str, PolicyRecord],
    api: Mapping[str, PolicyRecord],
    limits: Mapping[str, int],
    topology: Topology,
    *,
    static: bool = False,
    options: Options = Options(),
    now: float | None = None,
    node_note: str | None = None,
) -> tuple[list[Allocation], list[str]]:
    """The allocations as they are to be (every row kept, changed or new) and the sandboxes
    whose rows go.  Pure: the store's records in, rows out."""
    now = time.time() if now is None else now
    by_sandbox: dict[str, list[ContainerRec]] = {}
    for c in containers:
        by_sandbox.setdefault(c.sandbox_id, []).append(c)
    wanted: dict[str, tuple[str | None, int | None, str]] = {}
    for sid, recs in by_sandbox.items():
        uid = next((c.pod_uid for c in recs if c.pod_uid), None)
        rec = (api.get(uid) if uid else None) or oci.get(sid)
        req = exclusive_request(rec.annotations) if rec is not None else None
        if req is None:
            continue
        count = req.size
        if count is None:
            apps = [c for c in recs if not is_infra(c.is_sandbox, c.pod_uid, c.name)]
            whole = [limits[c.id] for c in apps if c.id in limits]
            count = sum(whole) if whole else None
        wanted[sid] = (uid, count, req.via)
    old = {a.sandbox_id: a for a in before}
    node = old.pop(NODE_ROW, None)
    before = [a for a in before if a.sandbox_id != NODE_ROW]
    gone = [sid for sid in old if sid not in wanted]
    held = {sid: a.cpus for sid, a in old.items() if sid in wanted and a.cpus}
    taken = CpuSet.union_all(held.values())
    rows: dict[str, Allocation] = {}
    # first come, first served: rows in the order they were first recorded, new ones last
    order = [a.sandbox_id for a in before if a.sandbox_id in wanted]
    order += sorted(sid for sid in wanted if sid not in old)
    for sid in order:
        uid, count, via = wanted[sid]
        a = old.get(sid) or Allocation(sid, uid, None, count, via, None, now, now)
        a = a._replace(pod_uid=uid, size=count, via=via)
        have = a.cpus or EMPTY
        reason: str | None = None
        if static:
            reason = "kubelet's CPU manager policy is static: kubelet allocates on this node"
        elif count is None:
            reason = f"{via}, but no container of the pod has an integer CPU limit to count"
        elif count > len(have):
            got = allocate(topology, topology.online - taken, count - len(have), options)
            if isinstance(got, Refusal):
                reason = f"{via}: {got}" + (f" (holds {have})" if have else "")
            else:
                have = have | got
                taken = taken | got
        cpus = have or None
        new = a._replace(cpus=cpus, reason=reason)
        if new != old.get(sid):
            new = new._replace(updated_at=now)
        rows[sid] = new
    said = node_via(options)
    strict = reserved_cpus(topology, options) if options.strict_reservation else None
    if node is None and any(a.cpus for a in rows.values()):
        node = Allocation(NODE_ROW, None, strict, None, said, node_note, now, now)
    elif node is not None and (node.reason, node.via, node.cpus) != (node_note, said, strict):
        node = node._replace(reason=node_note, via=said, cpus=strict, updated_at=now)
    return ([node] if node is not None else []) + list(rows.values()), gone


# -- the plan's view ------------------------------------------------------------------------------
class Overlay:
    """What the allocations mean to one plan (:func:`overlay`)."""

    __slots__ = ("by_sandbox", "notes", "owner", "pool", "reserved", "taken", "uncore")

    def __init__(
        self,
        by_sandbox: Mapping[str, CpuSet],
        online: CpuSet,
        allocating: bool = True,
        notes: Mapping[str, str] | None = None,
        reserved: CpuSet = EMPTY,
        uncore: bool = False,
    ) -> None:
        self.by_sandbox = by_sandbox
        #: sandbox -> what its allocation is, or why it waits (``show``, Events)
        self.notes = notes or {}
        self.taken = CpuSet.union_all(by_sandbox.values())
        #: kubelet's reserved CPUs under strict-cpu-reservation (else EMPTY): out of the pool,
        #: the housekeeping CPUs of helper threads under ``isolate``
        self.reserved = reserved & online
        #: prefer-align-cpus-by-uncorecache: floating vCPUs stay in one L3 group
        self.uncore = uncore
        #: the shared pool they leave (None: vmpin never allocated here, the plan is as before)
        self.pool = ((online - self.taken - self.reserved) or (online - self.taken)
                     if allocating else None)  # fmt: skip
        #: CPU -> the sandbox that holds it
        self.owner = {cpu: sid for sid, cpus in by_sandbox.items() for cpu in cpus}

    def container(self, sandbox_id: str, rec: ContainerRec) -> ContainerRec:
        """The container's record as the plan counts it: its pod's allocation, or its own
        CPU set kept off the other pods' allocations."""
        if not self.taken:
            return rec
        mine = self.by_sandbox.get(sandbox_id)
        if mine is not None and not is_infra(rec.is_sandbox, rec.pod_uid, rec.name):
            return rec._replace(cpus=mine, cpus_source=SOURCE)
        if rec.cpus is not None and rec.cpus & (self.taken - (mine or EMPTY)):
            return rec._replace(cpus=(rec.cpus - self.taken) or self.pool)
        return rec


NONE = Overlay({}, EMPTY, allocating=False)


def overlay(obs: Observation, topology: Topology) -> Overlay:
    """The allocations as the plan of ``obs`` sees them: none under a static checkpoint
    (kubelet's pool and entries rule there), else every granted one on online CPUs."""
    said = {a.sandbox_id: _note(a) for a in obs.allocations if a.sandbox_id != NODE_ROW}
    if obs.shared_pool is not None or kubelet_allocates(obs.checkpoint):
        return Overlay({}, EMPTY, False, said) if said else NONE
    granted = {
        a.sandbox_id: a.cpus & topology.online
        for a in obs.allocations
        if a.cpus is not None and a.cpus & topology.online and a.sandbox_id != NODE_ROW
    }
    node = next((a for a in obs.allocations if a.sandbox_id == NODE_ROW), None)
    if node is None:
        if not granted:
            return Overlay({}, EMPTY, False, said) if said else NONE
        return Overlay(granted, topology.online, True, said)
    follows = plan_options(node.via)
    reserved = (node.cpus or EMPTY) if "strict-cpu-reservation" in follows else EMPTY
    uncore = "prefer-align-cpus-by-uncorecache" in follows
    return Overlay(granted, topology.online, True, said, reserved, uncore)


def recorded(store: Reader) -> tuple[Allocation, ...]:
    """The allocations table as the store holds it (read again only when it moved)."""
    return _rows(store, store.version())


def _rows(store: Reader, version: tuple[int, int]) -> tuple[Allocation, ...]:
    """The allocations table at ``version`` (the store's now): as last read while the store
    has not moved, or while its change log names no write of the table since (a store this
    process writes: brought to the schema whose log names them, vmpin.state.changes); else
    read.  Every event's pass read it, on a node that allocates nothing (issue 28)."""
    memo: tuple[tuple[int, int], int | None, tuple[Allocation, ...]] | None = getattr(
        store, _READ, None
    )
    if memo is not None:
        if memo[0] == version:
            return memo[2]
        if memo[1] is not None:
            delta = store.changes_since(memo[1])
            if delta is not None and not delta.allocations:
                setattr(store, _READ, (version, delta.top, memo[2]))
                return memo[2]
    # (the log's top before the table: a write meanwhile is in the next delta; a read-only
    # view may hold an older schema, whose log says nothing of the table)
    seq = None if store.readonly else top(store.db)
    rows = tuple(table.read(store.db))
    setattr(store, _READ, (version, seq, rows))
    return rows


#: how a sandbox's note starts when its request waits (the agent's AllocationRefused Event)
REFUSED = "exclusive CPUs refused"


def _note(a: Allocation) -> str:
    if a.reason:
        return f"{REFUSED}: {a.reason}; it runs on the shared pool until CPUs free up"
    if a.cpus is not None:
        return f"holds CPUs {a.cpus} exclusively ({a.via}, allocated by vmpin)"
    return f"{a.via}: waiting"  # (not written: a row waits with its reason)


def notes(obs: Observation) -> list[str]:
    """``audit``'s notes: each pod waiting for exclusive CPUs and why; each allocation."""
    out = []
    for a in obs.allocations:
        if a.sandbox_id == NODE_ROW:
            if a.reason:  # what kubelet's configuration file said that vmpin cannot follow
                out.append(a.reason)
            continue
        pod = f"sandbox {a.sandbox_id}"
        pod = f"pod {a.pod_uid} ({pod})" if a.pod_uid else pod
        note = _note(a)
        if note.startswith(REFUSED):
            out.append(f"{REFUSED} for {pod}{note[len(REFUSED):]}")
        else:
            out.append(f"{pod} {note}")
    return out

