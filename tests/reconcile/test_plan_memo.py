"""plan_node with a long-lived caller's memo (PlanMemo) plans what it plans without one.

The agent keeps each sandbox's plan, what its records came to, its footprint, and the node's
per-CPU counts between passes, and an event's pass moves them by what moved (issue 28).  Here
a node of Kata and runc sandboxes on a fixture machine goes through a random walk of the
changes passes see -- a container's CPUs moved, a VMM's threads repinned, a sandbox come or
gone, kubelet's pool changed, a record's bookkeeping moved -- every other sandbox given as the
very observation of the step before, as Observer.observe gives it; at each step the memo's
plan must equal the plan made from nothing.
"""

from __future__ import annotations

import random

import pytest

from tests.reconcile.test_plan import cs, kata, runc, static, topo, vmm_threads
from vmpin.core.cpuset import CpuSet
from vmpin.core.planner import Policy
from vmpin.reconcile.apply import Applied
from vmpin.reconcile.observation import replace
from vmpin.reconcile.observe import Observation, SandboxObs
from vmpin.reconcile.plan import PlanMemo, plan_node
from vmpin.reconcile.settled import Settled
from vmpin.reconcile.summarizer import SummaryCounts, summarize

CPUS = ["2", "3", "2-3", "4-5", "4-7", "6", "8-11", "2,4"]
POLICIES = [Policy(), Policy(helpers="isolate", housekeeping=cs("3,6,8-9"))]


def _kata(rng: random.Random, i: int) -> SandboxObs:
    cpus = rng.choice(CPUS)
    s = kata(f"k{i:02d}", cpus, vmm_threads(1000 + 10 * i, rng.choice((1, 2)), "0-15"))
    # (helpers kept off the others' own CPUs: their plan depends on every other mask)
    return replace(s, policy=rng.choice(POLICIES))


@pytest.mark.parametrize("seed", range(6))
def test_a_memo_plans_what_a_fresh_plan_plans(seed: int) -> None:
    rng = random.Random(seed)
    machine = topo("amd-epyc-7313-2s")
    node: dict[str, SandboxObs] = {f"k{i:02d}": _kata(rng, i) for i in range(16)}
    node.update({f"r{i}": runc(f"r{i}", rng.choice(CPUS), "0-15", 5000 + i) for i in range(4)})
    checkpoint = None
    memo = PlanMemo()
    counts = SummaryCounts()  # (the node summary's, as the agent's Summarizer keeps them)
    for step in range(60):
        sid = rng.choice(sorted(node))
        s = node[sid]
        what = rng.random()
        if what < 0.4 and s.runtime == "kata":  # a container's CPUs moved (an update)
            app = s.containers[1]
            rec = app.rec._replace(cpus=cs(rng.choice(CPUS)))
            node[sid] = replace(s, containers=(s.containers[0], replace(app, rec=rec)))
        elif what < 0.55 and s.vmm is not None:  # the last pass pinned its threads
            pin = cs(rng.choice(CPUS))
            threads = tuple(replace(t, actual=pin) for t in s.vmm.threads)
            node[sid] = replace(s, vmm=replace(s.vmm, threads=threads))
        elif what < 0.65 and s.record is not None:  # marked done: bookkeeping alone
            rec = s.record
            node[sid] = replace(s, record=rec._replace(done_gen=rec.gen + step))
        elif what < 0.75:  # gone, or come
            if len(node) > 4:
                del node[sid]
            node[f"k{20 + step:02d}"] = _kata(rng, 20 + step)
        elif what < 0.8:  # kubelet's pool
            checkpoint = rng.choice((None, static("0-15"), static("0-3,8-15")))
        obs = Observation(tuple(node[k] for k in sorted(node)), checkpoint)
        fresh = plan_node(obs, machine)
        planned = plan_node(obs, machine, memo=memo)
        assert planned == fresh, (seed, step)
        counts.update(planned)
        assert counts.summary(planned, [], "", "") == summarize(fresh, [], "", ""), (seed, step)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("size", [4, 24])
def test_a_node_moved_by_what_moved_plans_what_a_fresh_plan_plans(
    seed: int, size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node with nothing node-wide (no kubelet pool, no allocation, no Crane pod): the memo
    walks only the sandboxes that moved (plan._plan_moved), and still plans what a plan made
    from nothing plans, whatever moved -- a container's CPUs, a VMM's pins, bookkeeping, a
    sandbox come or gone."""
    from vmpin.reconcile import plan as plan_module

    moved: list[bool] = []
    real = plan_module._plan_moved

    def spy(*args: object, **kw: object) -> object:
        got = real(*args, **kw)  # type: ignore[arg-type]
        moved.append(got is not None)
        return got

    monkeypatch.setattr(plan_module, "_plan_moved", spy)
    rng = random.Random(seed)
    # what the agent keeps per sandbox plan between passes, fed as its passes feed them:
    # each looks at the sandboxes a plan moved alone (NodePlan.moved_from), and answers what
    # the same fed the same plans without that says (``whole``: each plan with none)
    counts, settled, whole = SummaryCounts(), Settled(), Settled()
    asked_moved = 0
    machine = topo("amd-epyc-7313-2s")
    node: dict[str, SandboxObs] = {f"k{i:02d}": _kata(rng, i) for i in range(size)}
    for i in range(size // 6 + 1):  # (runc's cpuset as last seen there: nothing to adopt)
        s = runc(f"r{i}", rng.choice(CPUS), "0-15", 5000 + i)
        c = s.containers[0]
        seen = c.rec._replace(runtime_seen=c.runc_cpus)
        node[s.id] = replace(s, containers=(replace(c, rec=seen),))
    memo = PlanMemo()
    came_or_went: list[int] = []
    for step in range(80):
        if step % 5 == 1:  # a Kata sandbox come or gone (most of churn's passes)
            came_or_went.append(len(moved))
            ks = sorted(sid for sid in node if sid.startswith("k"))
            if step % 10 == 1 and len(ks) > 2:
                del node[rng.choice(ks)]
            else:
                node[f"k{50 + step:02d}"] = _kata(rng, 50 + step)
        for sid in rng.sample(sorted(node), rng.choice((1, 1, 2))):
            s = node[sid]
            what = rng.random()
            if what < 0.5 and s.runtime == "kata":
                app = s.containers[1]
                rec = app.rec._replace(cpus=cs(rng.choice(CPUS)))
                node[sid] = replace(s, containers=(s.containers[0], replace(app, rec=rec)))
            elif what < 0.8 and s.vmm is not None:
                pin = cs(rng.choice(CPUS))
                threads = tuple(replace(t, actual=pin) for t in s.vmm.threads)
                node[sid] = replace(s, vmm=replace(s.vmm, threads=threads))
            elif s.record is not None:
                rec = s.record
                node[sid] = replace(s, record=rec._replace(done_gen=rec.gen + step))
        obs = Observation(tuple(node[k] for k in sorted(node)), None)
        planned = plan_node(obs, machine, memo=memo)
        fresh = plan_node(obs, machine)
        assert planned == fresh and fresh.moved_from is None, (seed, step)
        counts.update(planned)
        assert counts.summary(planned, [], "", "") == summarize(fresh, [], "", ""), (seed, step)
        named = rng.sample([s.id for s in obs.sandboxes], 1)
        base = planned.moved_from
        known = settled._open  # (whether to_apply may ask of the moved sandboxes alone)
        asked_moved += base is not None and known is not None and base[0] is known[0]
        full = step % 20 == 0  # (the periodic pass applies every sandbox)
        only = None if full else settled.to_apply(planned, named)
        assert only == (None if full else whole.to_apply(replace(planned, moved_from=None), named))
        applied = Applied()
        applied.sandboxes = [sp for sp in planned.sandboxes if only is None or sp.id in only]
        for sp in applied.sandboxes:
            if rng.random() < 0.1:  # (an error: applied again by the next pass)
                applied.errors[sp.id] = ["EPERM"]
        settled.note(planned, applied, only)
        whole.note(planned, applied, None if only is None else set(only))
    assert sum(moved) > 10, moved  # (the walk took the short way, many times)
    # (a sandbox come or gone too: the walk over every sandbox was most of churn's passes)
    # a sandbox come or gone too (most of churn's passes): on a node of 24 most move no
    # CPU's count across one (at 4, most do: the full walk then, rightly)
    if size > 4:
        assert sum(moved[i] for i in came_or_went) >= len(came_or_went) // 2, moved
    assert asked_moved == sum(moved)  # (and the settled plans each time, as the counts)


def _planned_ids(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The ids of the sandboxes plan_node plans from now on, in order (its per-sandbox
    planner counted)."""
    from vmpin.reconcile import plan as plan_module

    planned: list[str] = []
    real = plan_module._plan_sandbox

    def counting(s: SandboxObs, *args: object, **kw: object) -> object:
        planned.append(s.id)
        return real(s, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(plan_module, "_plan_sandbox", counting)
    return planned


def test_a_sandbox_come_or_gone_is_all_that_is_planned(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pass for a sandbox come to the node plans it alone, and one for a sandbox gone plans
    none, the others' plans standing as they were (issue 28: either walked every sandbox of
    the node, most of churn's passes); each the plan made from nothing."""
    from vmpin.reconcile import plan as plan_module

    machine = topo("amd-epyc-7313-2s")
    node = {f"k{i:02d}": kata(f"k{i:02d}", "2-3", vmm_threads(1000 + 10 * i, 2, "0-15"))
            for i in range(8)}  # fmt: skip
    memo = PlanMemo()
    last = plan_node(Observation(tuple(node[k] for k in sorted(node)), None), machine, memo=memo)
    planned = _planned_ids(monkeypatch)
    looked: list[int] = []
    real_records = plan_module._records

    def records(*args: object, **kw: object) -> object:
        looked.append(1)
        return real_records(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(plan_module, "_records", records)
    for change, sid in (("come", "k04a"), ("gone", "k02"), ("come", "k99"), ("gone", "k04a")):
        if change == "come":
            node[sid] = kata(sid, "2-3", vmm_threads(3000 + len(planned), 2, "0-15"))
        else:
            del node[sid]
        obs = Observation(tuple(node[k] for k in sorted(node)), None)
        now = plan_node(obs, machine, memo=memo)
        assert planned == ([sid] if change == "come" else []), change
        assert len(looked) == (change == "come")  # (the others' records not looked at)
        assert now.moved_from is not None and now.moved_from[0] is last.sandboxes
        assert now.moved_from[2] == ((sid,) if change == "gone" else ())
        planned.clear()
        looked.clear()
        assert now == plan_node(obs, machine)
        planned.clear()
        looked.clear()
        assert all(p is q for p in now.sandboxes for q in last.sandboxes if p.id == q.id)
        last = now


@pytest.mark.parametrize("others", ["2-3", "2-3,2-3", "2-3,2-3,2-3"])
def test_a_sandbox_come_or_gone_where_the_short_walk_gives_up_is_walked_once(
    others: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sandbox come onto, or gone from, CPUs one other sandbox holds or none moves the
    others' inputs: the node is walked once, in full (not a walk over the sandboxes moved
    given up first) -- a node of one or two sandboxes, always.  Each the plan made from
    nothing."""
    from vmpin.reconcile import plan as plan_module

    machine = topo("amd-epyc-7313-2s")
    node = {f"k{i:02d}": kata(f"k{i:02d}", cpus, vmm_threads(1000 + 10 * i, 2, "0-15"))
            for i, cpus in enumerate(others.split(","))}  # fmt: skip
    memo = PlanMemo()
    plan_node(Observation(tuple(node[k] for k in sorted(node)), None), machine, memo=memo)
    walks: list[bool] = []
    real = plan_module._walk

    def walk(*args: object) -> object:
        walks.append(len(args) > 4)  # (given what moved: the short walk)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(plan_module, "_walk", walk)
    for change, sid in (("come", "k50"), ("gone", "k50")):
        if change == "come":
            node[sid] = kata(sid, "2-3", vmm_threads(3000, 2, "0-15"))
        else:
            del node[sid]
        obs = Observation(tuple(node[k] for k in sorted(node)), None)
        now = plan_node(obs, machine, memo=memo)
        # (come: CPUs 2-3 held by 1, 2, 3 others; gone: by 2, 3, 4 before it went)
        short = len(node) >= 3 if change == "come" else len(node) >= 2
        assert walks == ([True] if short else [False]), (change, len(node))
        walks.clear()
        assert now == plan_node(obs, machine)
        walks.clear()


def test_a_sandbox_moved_in_its_pins_and_books_alone_is_not_planned_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The sandbox of the last event's pass comes to the next one with its threads where
    that pass pinned them and its record marked done (issue 28: planned again from scratch
    for another sandbox's event): its plan is the last one with those affinities, which is
    what a plan made from nothing says."""

    machine = topo("amd-epyc-7313-2s")
    rng = random.Random(7)
    node = {f"k{i:02d}": _kata(rng, i) for i in range(6)}
    memo = PlanMemo()
    last = plan_node(Observation(tuple(node[k] for k in sorted(node)), None), machine, memo=memo)
    planned = _planned_ids(monkeypatch)
    for step, sid in enumerate(("k01", "k03", "k01")):
        s, sp = node[sid], last.sandbox(sid)
        assert s.vmm is not None and s.record is not None and sp is not None
        # its threads where the pass pinned them (read back), its record marked done
        desired = {t.tid: t.desired for t in sp.threads}
        threads = tuple(t.pinned(desired[t.tid] or cs("0-15")) for t in s.vmm.threads)
        rec = s.record._replace(done_gen=s.record.gen + step)
        node[sid] = replace(s, vmm=replace(s.vmm, threads=threads), record=rec)
        obs = Observation(tuple(node[k] for k in sorted(node)), None)
        last = plan_node(obs, machine, memo=memo)
        assert planned == []
        assert last == plan_node(obs, machine)
        planned.clear()  # (the plan from nothing's)
        sp = last.sandbox(sid)
        assert sp is not None and sp.obs is node[sid]
        assert [t.actual for t in sp.threads] == [t.actual for t in threads]


def test_a_sandbox_pinned_as_its_plan_says_is_not_applied_again() -> None:
    """The sandbox of the last event's pass, its threads read back where that pass pinned
    them and its record marked done, has nothing to apply at the next event's pass (for
    another sandbox); one whose thread is elsewhere than its plan says (drift) is applied."""
    machine = topo("amd-epyc-7313-2s")
    rng = random.Random(7)
    node = {f"k{i:02d}": _kata(rng, i) for i in range(6)}
    memo, settled = PlanMemo(), Settled()
    plan = plan_node(Observation(tuple(node[k] for k in sorted(node)), None), machine, memo=memo)
    applied = Applied()
    applied.sandboxes = list(plan.sandboxes)
    settled.note(plan, applied, None)  # (a full pass applied every plan cleanly)

    def moved(sid: str, where: dict[int, CpuSet]) -> set[str]:
        nonlocal plan
        s = node[sid]
        assert s.vmm is not None and s.record is not None
        threads = tuple(t.pinned(where[t.tid]) for t in s.vmm.threads)
        rec = s.record._replace(done_gen=s.record.gen)
        node[sid] = replace(s, vmm=replace(s.vmm, threads=threads), record=rec)
        plan = plan_node(Observation(tuple(node[k] for k in sorted(node)), None), machine,
                         memo=memo)  # fmt: skip
        return settled.to_apply(plan, ["k00"])

    sp = plan.sandbox("k02")
    assert sp is not None
    pinned = {t.tid: t.desired or cs("0-15") for t in sp.threads}
    assert moved("k02", pinned) == {"k00"}
    drifted = dict(pinned)
    drifted[next(iter(drifted))] = cs("14")
    assert moved("k02", drifted) == {"k00", "k02"}
