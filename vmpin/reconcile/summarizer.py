"""The node summary as passes keep it: written after a pass, withdrawn, and judged by.

:mod:`vmpin.state.summary` owns the file (what it says, its format, what a hook checks);
:func:`vmpin.reconcile.plan.summarize` makes its value from a node plan.  This module owns
what a pass does with it (docs/design.md, "What does not grow with the node"):

- read what it is made with *before* the node is observed (:meth:`Summarizer.inputs`: the
  VM dir's entries, kubelet's checkpoint file, the online list), so that a change meanwhile
  makes it stale rather than wrong;
- write it after the pass's last write, then look for journal events the pass did not plan
  with that it would refuse (:meth:`Summarizer.write`: a hook may have judged one by the
  summary this one replaces, and the pass must plan again, with it);
- remove it when a pass cannot vouch for it (:meth:`Summarizer.forget`: it went on without
  the node lock, or failed), so that hooks re-plan until a pass writes one again;
- judge a plain container's change by it (:meth:`Summarizer.lets_through`,
  ``Reconciler.reconcile_plain``).

Every method is called under the node's plan lock by the :class:`.reconciler.Reconciler`
that owns this one.
"""

from __future__ import annotations

from vmpin.core.errors import StateError, VmpinError

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.lean.records)
if TYPE_CHECKING:
    from vmpin.core.cpuset import CpuSet
    from vmpin.linux.paths import HostPaths
    from vmpin.reconcile.plan import NodePlan, SummaryCounts
    from vmpin.state.store import Store
    from vmpin.state.summary import Summary

    #: what a summary is made with: the VM dir's entries, the checkpoint's identity, the
    #: online list
    Inputs = tuple[list[str], str, str]


class Summarizer:
    """One reconciler's node summary; remembers what it last wrote (an idle pass does not
    write it again)."""

    __slots__ = ("_counts", "_memo", "paths", "store")

    def __init__(self, paths: HostPaths, store: Store) -> None:
        self.paths = paths
        self.store = store
        #: the summary last written here (its text and file identity)
        self._memo: tuple[str, tuple[int, int, int, int, int]] | None = None
        #: the counts of the last summary made here (SummaryCounts)
        self._counts: SummaryCounts | None = None

    def inputs(self) -> Inputs:
        """What a summary is made with, read before the node is observed: the VM dir's
        entries, kubelet's checkpoint file and the online CPUs (a hook compares them)."""
        from vmpin.linux.files import listing
        from vmpin.linux.sysfs import online_text
        from vmpin.state.summary import checkpoint_id

        return (
            listing(self.paths.vm_dir),
            checkpoint_id(self.paths.kubelet_state),
            online_text(self.paths.sys) or "",
        )

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
        from vmpin.state import journal, summary

        state_dir = self.store.state_dir
        if plan is None or self.store.readonly:
            return False
        s = self._summary(plan, (vms, checkpoint, online))
        text = summary.to_text(s)
        memo = self._memo
        if memo is None or memo[0] != text or not summary.current(state_dir, memo[1]):
            summary.write(state_dir, s, hold)
            got = summary.read(state_dir)
            self._memo = None if got is None else (text, got[0])
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
        """:func:`~vmpin.reconcile.plan.summarize` of ``plan``, its counts moved by the
        sandbox plans that are not the very ones of the last summary made here (an event's
        pass: a few; issue 28)."""
        from vmpin.reconcile.plan import SummaryCounts

        if self._counts is None:
            self._counts = SummaryCounts()
        self._counts.update(plan)
        return self._counts.summary(plan, *inputs)

    def forget(self) -> None:
        """Remove the summary: every plain hook beside a VM re-plans until a pass writes one."""
        from vmpin.state.summary import remove

        remove(self.store.state_dir)
        self._memo = None

    def lets_through(self, old: CpuSet | None, new: CpuSet | None, infra: bool) -> bool:
        """Whether the summary on disk is current and says no VM's plan depends on a plain
        container going from ``old`` to ``new`` (no summary: it does not)."""
        from vmpin.state import summary

        got = summary.read(self.store.state_dir)
        if got is None:
            return False
        s = got[1]
        if summary.stale(s, *self.inputs()) is not None:
            return False
        return not summary.change_needs_pass(s, old, new, infra)


__all__ = ["Summarizer"]
