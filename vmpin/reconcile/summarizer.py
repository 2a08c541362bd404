"""The node summary as passes keep it: written after a pass, withdrawn, and judged by.

:mod:`vmpin.state.summary` owns the file (what it says, its format, what a hook checks);
:func:`summarize` (:class:`SummaryCounts`) makes its value from a node plan.  This module owns
that, and what a pass does with it (docs/design.md, "What does not grow with the node"):

- read what it is made with *before* the node is observed (:meth:`Summarizer.inputs`: the
  VM dir's entries, kubelet's checkpoint file, the online list), so that a change meanwhile
  makes it stale rather than wrong;
- write it after the pass's last write, then look for journal events the pass did not plan
  with that it would refuse (:meth:`Summarizer.write`: a hook may have judged one by the
  summary this one replaces, and the pass must plan again, with it);
- remove it when a pass cannot vouch for it (:meth:`Summarizer.forget`: it went on without
  the node lock, or failed), so that hooks re-plan until a pass writes one again;
- judge a plain container's change by it (:meth:`Summarizer.lets_through`,
  ``reconciler.reconcile_plain``).

Every method is called under the node's plan lock by the :class:`.reconciler.Reconciler`
that owns this one.
"""

from __future__ import annotations

import os

from vmpin.core.cpuset import EMPTY, CpuSet
from vmpin.core.errors import StateError, VmpinError
from vmpin.linux.files import identity, listing, settled, version
from vmpin.linux.sysfs import online_text
from vmpin.state import journal, summary
from vmpin.state.summary import Summary

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.lean.records)
if TYPE_CHECKING:
    from collections.abc import Iterable

    from vmpin.linux.paths import HostPaths
    from vmpin.reconcile.plan import NodePlan, SandboxPlan
    from vmpin.state.store import Store

    #: what a summary is made with: the VM dir's entries, the checkpoint's identity, the
    #: online list
    Inputs = tuple[list[str], str, str]


class Summarizer:
    """One reconciler's node summary; remembers what it last wrote (an idle pass does not
    write it again)."""

    __slots__ = ("_counts", "_listed", "_memo", "paths", "store")

    def __init__(self, paths: HostPaths, store: Store) -> None:
        self.paths = paths
        self.store = store
        #: the summary last written here (its text and file identity)
        self._memo: tuple[str, tuple[int, int, int, int, int]] | None = None
        #: the counts of the last summary made here (SummaryCounts)
        self._counts: SummaryCounts | None = None
        #: the VM dir's names with the identity of the directory they were listed from
        self._listed: tuple[tuple[int, int, int, int, int], list[str]] | None = None

    def inputs(self) -> Inputs:
        """What a summary is made with, read before the node is observed: the VM dir's
        entries, kubelet's checkpoint file and the online CPUs (a hook compares them)."""
        return (
            self._vm_dir(),
            summary.checkpoint_id(self.paths.kubelet_state),
            online_text(self.paths.sys) or "",
        )

    def _vm_dir(self) -> list[str]:
        """The VM dir's names (vmpin.linux.files.listing; not to be changed by the caller),
        listed again only when the directory is not the version last listed here: an entry
        made or removed moves its mtime and ctime, and a version is kept only once
        :func:`~vmpin.linux.files.settled` (any later change gets a later time).  One stat
        where listing and sorting 500 sandbox dirs was ~0.3 ms of an event's pass (issue
        28)."""
        vm_dir = self.paths.vm_dir
        try:
            st = os.stat(vm_dir)
        except OSError:
            self._listed = None
            return listing(vm_dir)
        # (taken before the listing: a change during it shows as another version next time)
        ident = version(st)
        memo = self._listed
        if memo is not None and memo[0] == ident:
            return memo[1]
        names = listing(vm_dir)
        self._listed = (ident, names) if settled(ident) else None
        return names

    def write(
        self,
        plan: NodePlan | None,
        vms: list[str],
        checkpoint: str,
        online: str,
        hold: list[int] | None = None,
    ) -> bool:
        """Write the node summary of ``plan``; False when an event this pass did not plan
        with is one the summary would refuse (its hook may have judged by the summary this
        one replaces: the pass then plans again, with it).  ``hold``: the replaced file is
        freed when the caller closes what is appended there (the agent: after the answers,
        with the guest maps it replaced; Reconciler.held_maps)."""
        state_dir = self.store.state_dir
        if plan is None or self.store.readonly:
            return False
        s = self._summary(plan, (vms, checkpoint, online))
        text = summary.to_text(s)
        memo = self._memo
        if memo is None or memo[0] != text or not summary.current(state_dir, memo[1]):
            summary.write(state_dir, s, hold, text)
            # (the file this pass just wrote: its identity is all the memo needs -- read back
            # and parsed, it was ~5% of an event's pass, issue 28)
            ident = identity(summary.path(state_dir))
            self._memo = None if ident is None or ident[2] > summary.MAX_BYTES else (text, ident)
        try:
            names = self.store.unapplied(journal.pending(state_dir))
        except StateError:
            return False
        for name in names:
            try:
                ev = journal.read_event(state_dir, name)
            except (OSError, VmpinError):
                continue  # never applied (ingest quarantines it): nothing to plan with
            if ev.runtime != "kata" and summary.event_needs_pass(s, ev):
                return False  # (a Kata sandbox's hook re-plans the node itself)
        return True

    def _summary(self, plan: NodePlan, inputs: Inputs) -> Summary:
        """:func:`summarize` of ``plan``, its counts moved by the sandbox plans that are not
        the very ones of the last summary made here (an event's pass: a few; issue 28)."""
        if self._counts is None:
            self._counts = SummaryCounts()
        self._counts.update(plan)
        return self._counts.summary(plan, *inputs)

    def forget(self) -> None:
        """Remove the summary: every plain hook beside a VM re-plans until a pass writes one."""
        summary.remove(self.store.state_dir)
        self._memo = None

    def lets_through(self, old: CpuSet | None, new: CpuSet | None, infra: bool) -> bool:
        """Whether the summary on disk is current and says no VM's plan depends on a plain
        container going from ``old`` to ``new`` (no summary: it does not)."""
        got = summary.read(self.store.state_dir)
        if got is None:
            return False
        s = got[1]
        if summary.stale(s, *self.inputs()) is not None:
            return False
        return not summary.change_needs_pass(s, old, new, infra)


# -- a summary's value, from a node plan (pure) ----------------------------------------------
def summarize(plan: NodePlan, vms: list[str], checkpoint: str, online: str) -> Summary:
    """What the VMs' plans in ``plan`` depend on, for a plain container's hook to check
    against (vmpin.state.summary); ``vms``, ``checkpoint``, ``online``: the VM dir's entries,
    kubelet's checkpoint identity and the online list as the pass found them before it
    observed the node."""
    counts = SummaryCounts()
    counts.update(plan)
    return counts.summary(plan, vms, checkpoint, online)


class SummaryCounts:
    """The per-CPU counts a node summary is made of, each sandbox plan's share kept, so that
    a long-lived caller (:class:`Summarizer`) moves them by the plans that moved
    rather than counting the node again (issue 28).

    Per CPU: the footprints holding it, the VM plans' footprints holding it, the masks, the
    VMs' masks, and the isolating VMs' housekeeping and helper CPUs.  ``private`` is then a
    CPU one footprint holds and that one a VM's; ``contended``, two, one of them a VM's."""

    __slots__ = ("_counted", "_parts", "claimed", "holders", "isolate", "masks", "vms")

    def __init__(self) -> None:
        self._parts: dict[str, tuple[SandboxPlan, CpuSet | None, tuple[CpuSet, ...]]] = {}
        #: the sandboxes of the plan these counts are (each in _parts), when counted so
        self._counted: tuple[SandboxPlan, ...] | None = None
        self.holders: dict[int, int] = {}
        self.vms: dict[int, int] = {}
        self.masks: dict[int, int] = {}
        self.claimed: dict[int, int] = {}
        self.isolate: dict[int, int] = {}

    def _clear(self) -> None:
        self._parts.clear()
        for counts in (self.holders, self.vms, self.masks, self.claimed, self.isolate):
            counts.clear()
        self._counted = None

    def update(self, plan: NodePlan) -> None:
        """The counts of ``plan``: each sandbox plan (and mask) that is not the very one of
        the last update moves them.  Those of a plan made from the last one counted
        (``NodePlan.moved_from``) are asked of the sandboxes it may have moved alone, and
        those gone taken from its list of them: at 500 sandboxes the walk over the others was
        ~1 M instructions of an event's pass."""
        parts, masks, sandboxes = self._parts, plan.masks, plan.sandboxes
        walk: Iterable[SandboxPlan] = sandboxes
        base = plan.moved_from
        gone: Iterable[str] | None = None  # (the ids gone since the last update, if known)
        if base is not None and base[0] is self._counted:
            walk = [sandboxes[i] for i in base[1]]
            gone = base[2]
        for sp in walk:
            mask = masks.get(sp.id)
            old = parts.get(sp.id)
            if old is not None and old[0] is sp and old[1] is mask:
                continue
            if old is not None:
                self._move(old[2], -1)
            share = self._share(sp, mask)
            self._move(share, 1)
            parts[sp.id] = (sp, mask, share)
        if len(parts) != len(plan.sandboxes):
            if gone is None:  # (gone from the node: found among every id)
                ids = {sp.id for sp in plan.sandboxes}
                gone = [sid for sid in parts if sid not in ids]
            for sid in gone:
                if sid in parts:
                    self._move(parts.pop(sid)[2], -1)
            if len(parts) != len(plan.sandboxes):  # (an id twice: counted as a list)
                self._clear()
                for sp in plan.sandboxes:
                    self._move(self._share(sp, masks.get(sp.id)), 1)
        self._counted = sandboxes if len(parts) == len(sandboxes) else None

    @staticmethod
    def _share(sp: SandboxPlan, mask: CpuSet | None) -> tuple[CpuSet, ...]:
        """One sandbox plan's share: its footprint, as a VM's, its mask, as a VM's, and its
        housekeeping and helper CPUs when it isolates its helpers."""
        vm = sp.runtime != "runc" and sp.plan is not None
        isolates = vm and sp.obs.policy.helpers == "isolate"
        return (
            sp.footprint,
            sp.footprint if vm else EMPTY,
            mask if mask is not None else EMPTY,
            (mask if mask is not None else sp.mask) if sp.runtime != "runc" else EMPTY,
            # (the configured set, and where helpers went: kubelet's reserved CPUs under its
            # strict-cpu-reservation)
            sp.obs.policy.housekeeping | _helper_cpus(sp) if isolates else EMPTY,
        )

    def _move(self, share: tuple[CpuSet, ...], by: int) -> None:
        for counts, cpus in zip(
            (self.holders, self.vms, self.masks, self.claimed, self.isolate), share, strict=True
        ):
            for cpu in cpus:
                n = counts.get(cpu, 0) + by
                if n:
                    counts[cpu] = n
                else:
                    del counts[cpu]

    def summary(self, plan: NodePlan, vms: list[str], checkpoint: str, online: str) -> Summary:
        holders = self.holders
        return Summary(
            tuple(vms),
            checkpoint,
            online.strip(),
            plan.shared_pool,
            _cpus([cpu for cpu in self.vms if holders[cpu] == 1]),
            _cpus([cpu for cpu in self.vms if holders[cpu] == 2]),
            _cpus(self.claimed),
            _cpus(self.isolate),
            _cpus([cpu for cpu, n in self.masks.items() if n > 1]),
        )


def _cpus(cpus: list[int] | dict[int, int]) -> CpuSet:
    """The set of ``cpus``; none is :data:`EMPTY` (most of a summary's sets on most nodes),
    whose text is made once, not by every pass that writes a summary."""
    return CpuSet(cpus) if cpus else EMPTY


def _helper_cpus(sp: SandboxPlan) -> CpuSet:
    """Where a sandbox's plan puts its helper threads (emulator, iothreads, vhost)."""
    if sp.plan is None:
        return EMPTY
    return CpuSet.union_all(
        p.desired for p in sp.plan.placements if p.role != "vcpu" and p.desired is not None
    )


__all__ = ["Summarizer", "SummaryCounts", "summarize"]
