"""The node summary: what a plain container's hook must know to leave the VMs' plans alone.

A VM sandbox's plan depends on every other sandbox (vmpin.reconcile.plan): a vCPU is pinned
1:1 only on CPUs no one else uses, helper threads under ``isolate`` keep off CPUs another
pod holds alone, and two pods claiming one CPU is a conflict.  So a plain container started
while VMs run used to re-plan the whole node, and its hook's cost grew with the node: 1.9 s
at 10,000 containers (issue 26).  Yet almost every plain container lands where no VM's plan
can notice it: on the shared pool, on CPUs other pods already use.

Every pass that applies under the node's lock writes, after its last write, what the VMs'
plans were made from, reduced to CPU sets (:func:`vmpin.reconcile.summarizer.summarize`):

- ``private``: CPUs inside a VM's footprint that no other sandbox's footprint holds (a 1:1
  vCPU can sit only there);
- ``claimed``: CPUs in a VM's mask (a container claiming one of them outside kubelet's shared
  pool is in conflict with that pod);
- ``contended``: CPUs inside a VM's footprint that exactly one other sandbox holds too (when
  that one goes, the VM may have them to itself: a 1:1 pin it could not have before);
- ``isolate``: the housekeeping CPUs of VMs that isolate their helper threads, and
  ``shared``: CPUs in two or more sandboxes' masks (a new claim there makes no CPU exclusive
  and takes exclusivity from none);
- what it was made with: the VM dir's entries (vmpin.linux.files.listing), kubelet's
  checkpoint file (its identity), the online CPU list, and the shared pool.

A hook whose container adds nothing a VM's plan depends on (:func:`needs_pass` says None)
only journals its event, as on a node without VMs: size-independent work (one listing of the
VM dir, one small file).  Anything else -- no summary, one that does not match the VM dir,
the checkpoint or the online list, a container on a VM's private CPUs -- takes the pass as
before.

Why that is enough: the kernel's pins are a plan made from the summary's inputs, and adding
a container that changes none of them leaves that plan what a new pass would make.  A
container that goes away can only free CPUs: its hook re-plans when that may give a VM a CPU
of its own (its spec's CPUs are ``contended``), or make a CPU another pod's own while a VM
isolates its helper threads; else the pass that follows (the agent's, the next command's)
finds nothing to change.  The race with a pass that
runs meanwhile is closed from both sides: the hook appends its event *then* checks that the
summary it judged by is still the current one (:func:`read` and its identity), and a pass
writes the summary *then* looks for events it did not plan with that the summary would refuse
(:meth:`vmpin.reconcile.reconciler.Reconciler`): one of the two sees the other.

Lean: read by the hook (os and vmpin.core.cpuset only).  The file is derived data: it is
written without a sync (a crash loses it, and the next hook takes a pass), and any doubt about
it (unreadable, another version, a line missing) is the same as no file.
"""

from __future__ import annotations

import os

from vmpin.core.cpuset import EMPTY, CpuSet
from vmpin.core.errors import CpuSetError
from vmpin.linux.files import identity, save_cache
from vmpin.runtimes.kubelet import is_infra

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.lean.records)
if TYPE_CHECKING:
    from typing import NamedTuple

    from vmpin.wire.hookevent import HookEvent
else:
    from vmpin.lean.records import NamedTuple

FILE = "node-summary"
HEADER = "vmpin node summary 1"
#: the file is a few lines of CPU lists and sandbox ids: anything bigger is not ours
MAX_BYTES = 1 << 20

#: file identity as vmpin.linux.files.identity gives it
Ident = tuple[int, int, int, int, int]


class Summary(NamedTuple):
    """What the VMs' plans were made from (see the module's docstring)."""

    vms: tuple[str, ...]
    checkpoint: str
    online: str
    pool: CpuSet | None
    private: CpuSet
    contended: CpuSet
    claimed: CpuSet
    isolate: CpuSet
    shared: CpuSet


def path(state_dir: str) -> str:
    return os.path.join(state_dir, FILE)


def checkpoint_id(kubelet_state: str) -> str:
    """kubelet's checkpoint file as the summary records it: its identity, or ``-``."""
    ident = identity(kubelet_state)
    return "-" if ident is None else ":".join(map(str, ident))


def to_text(s: Summary) -> str:
    return "\n".join(
        (
            HEADER,
            "vms " + ",".join(s.vms),
            "checkpoint " + s.checkpoint,
            "online " + s.online,
            "pool " + ("none" if s.pool is None else s.pool.to_list()),
            "private " + s.private.to_list(),
            "contended " + s.contended.to_list(),
            "claimed " + s.claimed.to_list(),
            "isolate " + s.isolate.to_list(),
            "shared " + s.shared.to_list(),
            "",
        )
    )


def parse(text: str) -> Summary | None:
    """The summary in ``text``; None when it is not one this version wrote."""
    lines = text.split("\n")
    if not lines or lines[0] != HEADER:
        return None
    fields: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            key, _, value = line.partition(" ")
            fields[key] = value
    try:
        pool = fields["pool"]
        return Summary(
            tuple(v for v in fields["vms"].split(",") if v),
            fields["checkpoint"],
            fields["online"],
            None if pool == "none" else CpuSet.parse(pool),
            CpuSet.parse(fields["private"]),
            CpuSet.parse(fields["contended"]),
            CpuSet.parse(fields["claimed"]),
            CpuSet.parse(fields["isolate"]),
            CpuSet.parse(fields["shared"]),
        )
    except (KeyError, CpuSetError):
        return None


def read(state_dir: str) -> tuple[Ident, Summary] | None:
    """The current summary with the identity of its file (taken before the read: a summary
    replaced meanwhile shows as a new identity next time); None when there is none usable."""
    p = path(state_dir)
    ident = identity(p)
    if ident is None or ident[2] > MAX_BYTES:
        return None
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        data = os.read(fd, MAX_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        s = parse(data.decode("utf-8"))
    except UnicodeDecodeError:
        return None
    return None if s is None else (ident, s)


def current(state_dir: str, ident: Ident) -> bool:
    """Whether the summary read with ``ident`` is still the current one."""
    return identity(path(state_dir)) == ident


def write(
    state_dir: str, s: Summary, hold: list[int] | None = None, text: str | None = None
) -> None:
    """Replace the summary (a reader sees the old file or the new one; best effort); with
    ``hold``, the old one is freed when the caller closes what it appends there
    (:func:`vmpin.linux.files.save_cache`).  ``text``: ``to_text(s)``, when the caller has
    it already (a pass compares it with the last one written)."""
    data = (to_text(s) if text is None else text).encode("utf-8")
    save_cache(path(state_dir), data, hold)


def remove(state_dir: str) -> None:
    """No summary: every plain hook beside a VM takes a pass until the next one is written."""
    try:  # noqa: SIM105 (contextlib stays off the hook's path)
        os.unlink(path(state_dir))
    except OSError:
        pass


def stale(s: Summary, vms: list[str], checkpoint: str, online: str | None) -> str | None:
    """Why ``s`` no longer describes the node (None: it does): the VM dir's entries,
    kubelet's checkpoint or the online CPUs are not what its pass planned with."""
    if tuple(vms) != s.vms:
        return "the VM dir changed"
    if checkpoint != s.checkpoint:
        return "kubelet's checkpoint changed"
    if (online or "").strip() != s.online:
        return "the online CPUs changed"
    return None


def needs_pass(s: Summary, cpus: CpuSet | None, infra: bool) -> str | None:
    """Why a plain container with ``cpus`` (None: its spec gives none) could change a VM's
    plan, or None when it cannot (see the module's docstring).

    Without a CPU set of its own the container's cgroup holds what its parent's does, which
    may be any online CPU until a pass narrows it to the pool.  An infra (pause) container's
    set is housekeeping, never a claim (vmpin.runtimes.kubelet.is_infra).
    """
    try:
        online = CpuSet.parse(s.online)
    except CpuSetError:
        return "the online CPU list is unreadable"
    where = cpus if cpus is not None else online
    if where & s.private:
        return f"CPUs {where & s.private} are a VM's own"
    if infra or cpus is None:
        return None
    own = cpus - s.pool if s.pool is not None else cpus
    if s.pool is not None and own & s.claimed:  # (no pool: nothing is claimed, plan._claims)
        return f"CPUs {own & s.claimed} are claimed by a VM's pod"
    lone = (own & s.isolate) - s.shared
    if lone:
        return f"CPUs {lone} would become a pod's own where helper threads are kept"
    return None


def change_needs_pass(
    s: Summary, old: CpuSet | None, new: CpuSet | None, infra: bool
) -> str | None:
    """Why a plain container's CPU set going from ``old`` to ``new`` (``vmpin update``) could
    change a VM's plan, or None when it cannot: what it takes on is judged as a new
    container's (:func:`needs_pass`); what it gives up can only free CPUs, but a CPU it
    shared may become another pod's own, which VMs that isolate their helper threads
    must leave."""
    why = needs_pass(s, new, infra)
    if why or old is None:
        return why
    return _gives_up(s, (old - new) if new is not None else old)


def _gives_up(s: Summary, cpus: CpuSet) -> str | None:
    """Why a container giving up ``cpus`` could change a VM's plan (None: it cannot)."""
    if cpus & s.contended:
        return f"CPUs {cpus & s.contended} may become a VM's own"
    own = cpus - s.pool if s.pool is not None else cpus
    if own & s.isolate:
        return f"CPUs {own & s.isolate} given up where helper threads are kept"
    return None


def event_needs_pass(s: Summary, ev: HookEvent) -> str | None:
    """Why the plain container's journaled event ``ev`` (vmpin.state.journal) could change a
    VM's plan, or None when it cannot.  A Kata sandbox's event always could: its own hook
    re-plans the node, whatever this says."""
    if ev.runtime == "kata":
        return "a Kata sandbox's event"
    ident = ev.ident
    if not ident:
        return "a container the hook could not name"
    parsed = ev.cpus
    if ev.stage == "poststop":
        # (its spec's CPUs, when its bundle was still there: else any CPU it may have held)
        if parsed is None:
            try:
                parsed = CpuSet.parse(s.online)
            except CpuSetError:
                return "the online CPU list is unreadable"
        return _gives_up(s, parsed)
    infra = is_infra(ident.is_sandbox, ident.pod_uid, ident.name)
    return needs_pass(s, parsed, infra)


__all__ = [
    "EMPTY",
    "FILE",
    "Summary",
    "change_needs_pass",
    "checkpoint_id",
    "current",
    "event_needs_pass",
    "needs_pass",
    "parse",
    "path",
    "read",
    "remove",
    "stale",
    "to_text",
    "write",
]
