"""vmpin's own allocations (issue 30): who asks, who gets what, and how the plan follows.

- :func:`decide` table: release, first come first served, growth, counts from CPU limits,
  kubelet's static policy, the node row;
- the CLI on 16+ CPU fixture machines (``vmpin --sysfs-root``): plain pods through real
  ``vmpin hook`` processes, the pool shrinking and growing in the (test) cgroup tree;
- 200 concurrent create/delete hooks: no CPU handed out twice, none leaked (store vs the
  cgroup files the passes wrote).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import FIXTURES
from tests.support.plainpods import PlainPods
from vmpin.core.allocate import Options
from vmpin.core.cpuset import CpuSet
from vmpin.linux.sysfs import read_topology
from vmpin.reconcile.allocations import NODE_ROW, decide, plan_options
from vmpin.state.allocations import Allocation
from vmpin.state.records import ContainerRec, PolicyRecord

SYSFS = FIXTURES / "sysfs"
XEON = read_topology(str(SYSFS / "xeon-gold-6258r-2s"))
P = CpuSet.parse


def pod(sid: str, limit_app: bool = True) -> list[ContainerRec]:
    uid = f"uid-{sid}"
    return [
        ContainerRec(f"{sid}-pause", sid, True, None, uid),
        ContainerRec(f"{sid}-app", sid, False, "app", uid),
    ]


def asks(**by_sandbox: str) -> dict[str, PolicyRecord]:
    return {s: PolicyRecord({"vmpin.io/exclusive-cpus": v}, "oci") for s, v in by_sandbox.items()}


def granted(rows: list[Allocation]) -> dict[str, str | None]:
    return {a.sandbox_id: (a.cpus.to_list() if a.cpus else None) for a in rows if a.sandbox_id}


def test_first_come_first_served_and_release() -> None:
    ctrs = pod("a") + pod("b") + pod("c")
    rows, gone = decide([], ctrs, asks(a="2", b="4", c="1"), {}, {}, XEON, now=1.0)
    assert granted(rows) == {"a": "1,57", "b": "2-3,58-59", "c": "56"}  # (0's lone sibling)
    assert gone == [] and rows[0].sandbox_id == NODE_ROW  # vmpin allocates on this node now
    # a's containers go: its CPUs are released; the others keep theirs
    rows2, gone = decide(rows, pod("b") + pod("c"), asks(a="2", b="4", c="1"), {}, {}, XEON)
    assert gone == ["a"] and granted(rows2) == {"b": "2-3,58-59", "c": "56"}
    # the node row stays when nothing is allocated any more (the pool is every CPU again)
    rows3, gone = decide(rows2, [], {}, {}, {}, XEON)
    assert sorted(gone) == ["b", "c"] and [a.sandbox_id for a in rows3] == [NODE_ROW]


def test_refused_waits_then_granted_in_order() -> None:
    # 0-5 online; 2 reserved (kubelet's pick: the lone thread of a core whose sibling is off)
    small = read_topology(str(SYSFS / "offline-isolated"))
    ctrs = pod("a") + pod("b") + pod("c")
    rows, _ = decide([], ctrs, asks(a="4", b="2", c="1"), {}, {}, small, now=1.0)
    assert granted(rows) == {"a": "0-1,4-5", "b": None, "c": "3"}
    b = next(a for a in rows if a.sandbox_id == "b")
    assert b.reason is not None and "needs 2 exclusive CPUs, 1 free (3)" in b.reason
    # a goes: b, first in line, is granted before anyone who asked later
    ctrs = pod("b") + pod("c") + pod("d")
    rows, gone = decide(rows, ctrs, asks(b="2", c="1", d="2"), {}, {}, small, now=2.0)
    assert gone == ["a"] and granted(rows) == {"b": "0,4", "c": "3", "d": "1,5"}


def test_count_from_cpu_limits_and_growth() -> None:
    ctrs = pod("a")
    crane = {"a": PolicyRecord({"qos.gocrane.io/cpu-manager": "exclusive"}, "oci")}
    rows, _ = decide([], ctrs, crane, {}, {}, XEON)
    assert granted(rows) == {"a": None}
    assert "no container of the pod has an integer CPU limit" in (rows[-1].reason or "")
    rows, _ = decide(rows, ctrs, crane, {}, {"a-app": 2}, XEON)
    assert granted(rows) == {"a": "1,57"}
    # a second app container with a limit of 2: the pod's allocation grows, it never moves
    ctrs = [*ctrs, ContainerRec("a-side", "a", False, "side", "uid-a")]
    rows, _ = decide(rows, ctrs, crane, {}, {"a-app": 2, "a-side": 2}, XEON)
    assert granted(rows) == {"a": "1-2,57-58"}
    # the API's annotations win over the specs': removed there, the pod asks for nothing
    rows, gone = decide(rows, ctrs, crane, {"uid-a": PolicyRecord({}, "api")}, {}, XEON)
    assert gone == ["a"]


def test_static_policy_grants_nothing() -> None:
    rows, _ = decide([], pod("a"), asks(a="1"), {}, {}, XEON, static=True)
    assert granted(rows) == {"a": None}
    assert "kubelet allocates" in (rows[-1].reason or "")


def test_none_and_bad_values_ask_nothing() -> None:
    ctrs = pod("a") + pod("b") + pod("c")
    recs = {**asks(a="none", b="0", c="lots"),
            "d": PolicyRecord({"vmpin.io/exclusive-cpus": "none",
                               "qos.gocrane.io/cpu-manager": "exclusive"}, "oci")}  # fmt: skip
    rows, _ = decide([], [*ctrs, *pod("d")], recs, {}, {"d-app": 1}, XEON)
    assert granted(rows) == {}


def test_full_pcpus_only_option() -> None:
    rows, _ = decide([], pod("a"), asks(a="3"), {}, {}, XEON,
                     options=Options(full_pcpus_only=True))  # fmt: skip
    assert granted(rows) == {"a": None} and "whole number of cores" in (rows[-1].reason or "")


def test_node_row_carries_what_the_plan_follows() -> None:
    """strict-cpu-reservation: the node row holds the reserved CPUs (the plan keeps them out of
    the pool); its via names the options the plan follows; both follow the file's changes."""
    opts = Options(reserved=P("0,56"), strict_reservation=True, prefer_uncore=True)
    rows, _ = decide([], pod("a"), asks(a="2"), {}, {}, XEON, options=opts, now=1.0)
    node = rows[0]
    assert node.sandbox_id == NODE_ROW and node.cpus == P("0,56")
    assert plan_options(node.via) == {"strict-cpu-reservation", "prefer-align-cpus-by-uncorecache"}
    assert granted(rows) == {"a": "1,57"}
    # not strict: kubelet's reserved CPUs stay in the pool, the row holds none
    rows2, _ = decide(rows, pod("a"), asks(a="2"), {}, {}, XEON, now=2.0)
    assert (rows2[0].cpus, plan_options(rows2[0].via), rows2[0].updated_at) == (None, set(), 2.0)
    assert granted(rows2) == {"a": "1,57"}  # (an allocation never moves)


# -- the CLI on fixture machines ------------------------------------------------------------------
@pytest.fixture
def pods(
    tmp_path: Path, env: dict[str, str], request: pytest.FixtureRequest
) -> Iterator[PlainPods]:
    machine = getattr(request, "param", "xeon-gold-6258r-2s")
    topo = read_topology(str(SYSFS / machine))
    p = PlainPods(tmp_path, env, SYSFS / machine, topo.online)
    try:
        yield p
    finally:
        p.close()


CLI_CASES = {
    # machine: (A's 4 CPUs, C's 2 CPUs from its limit, the pool while both hold theirs)
    "xeon-gold-6258r-2s": ("1-2,57-58", "3,59", "0,4-56,60-111"),
    "amd-epyc-7313-2s": ("1-2,33-34", "3,35", "0,4-32,36-63"),
    "no-smt-server": ("1-4", "5-6", "0,7-15"),
}


@pytest.mark.parametrize("pods", sorted(CLI_CASES), indirect=True)
def test_cli_on_fixture_machine(pods: PlainPods, request: pytest.FixtureRequest) -> None:
    want_a, want_c, pool = CLI_CASES[request.node.callspec.params["pods"]]
    pods.create("a", {"vmpin.io/exclusive-cpus": "4"})
    pods.create("b", {})
    pods.create("c", {"qos.gocrane.io/cpu-manager": "exclusive"}, limit=2)
    cg = pods.cgroups()
    assert (cg["a-app"], cg["c-app"]) == (P(want_a), P(want_c))
    assert {cg[c] for c in ("a-pause", "b-pause", "b-app", "c-pause")} == {P(pool)}
    out = pods.vmpin("--sysfs-root", pods.env["VMPIN_SYSFS_ROOT"], "containers", "--json")
    rows = {r["id"]: r for r in json.loads(out.stdout)}
    assert (rows["a-app"]["cpus"], rows["a-app"]["cpus_source"]) == (want_a, "vmpin-alloc")
    assert not rows["a-app"]["host_differs"] and rows["b-app"]["cpus"] is None
    audit = json.loads(pods.vmpin("audit", "--json").stdout)
    assert audit["ok"], audit["violations"]
    # a pod asking for more than is free is refused, loudly, and runs on the pool
    pods.create("d", {"vmpin.io/exclusive-cpus": "200"})
    assert pods.cgroups()["d-app"] == P(pool)
    audit = json.loads(pods.vmpin("audit", "--json").stdout)
    assert audit["ok"] and any("refused for pod uid-d" in n and "needs 200" in n
                               for n in audit["notes"]), audit["notes"]  # fmt: skip
    # a hand edit of a pool container onto an allocated CPU is caught and repaired
    (pods.cgroot / "cpuset" / "b-app" / "cpuset.cpus").write_text(want_a + "\n")
    audit = json.loads(pods.vmpin("audit", "--json").stdout)
    assert {v["kind"] for v in audit["violations"]} >= {"drift", "foreign-on-exclusive"}
    assert pods.vmpin("reconcile", "--once").returncode == 0
    assert pods.cgroups()["b-app"] == P(pool)
    # a goes: the pool grows by its CPUs (d still asks for more than the machine has)
    pods.delete("a")
    grown = P(pool) | P(want_a)
    assert {pods.cgroups()[c] for c in ("b-app", "c-pause", "d-app")} == {grown}
    assert set(pods.allocations()) == {"c-pause", "d-pause"}
    pods.delete("c")
    pods.delete("d")
    assert pods.allocations() == {}
    assert pods.cgroups()["b-app"] == pods.online
    assert not (Path(pods.env["VMPIN_STATE_DIR"]) / "allocations").exists()


def test_kubelet_config_reserved_cpus_and_full_cores(pods: PlainPods) -> None:
    """kubelet's configuration file (--kubelet-config / VMPIN_KUBELET_CONFIG): its reserved
    CPUs are never allocated, full-pcpus-only refuses a pod that would split a core, and
    what vmpin does not follow is said in audit's notes."""
    config = pods.tmp / "kubelet-config.yaml"
    config.write_text(
        "kind: KubeletConfiguration\nreservedSystemCPUs: 0-1,56-57\n"
        "cpuManagerPolicyOptions:\n  full-pcpus-only: 'true'\n"
        "  distribute-cpus-across-cores: 'true'\n"
    )
    pods.env["VMPIN_KUBELET_CONFIG"] = str(config)
    pods.create("a", {"vmpin.io/exclusive-cpus": "4"})
    pods.create("b", {"vmpin.io/exclusive-cpus": "3"})
    cg = pods.cgroups()
    assert cg["a-app"] == P("2-3,58-59")
    audit = json.loads(pods.vmpin("audit", "--json").stdout)
    notes = audit["notes"]
    assert any("refused for pod uid-b" in n and "not a whole number of cores" in n
               for n in notes), notes  # fmt: skip
    assert any("distribute-cpus-across-cores: not followed" in n for n in notes), notes
    assert cg["b-app"] == pods.online - P("2-3,58-59")  # the pool, reserved CPUs and all


#: kubelet's static-policy options through the CLI: machine, options, the pod's count, its
#: CPUs, the pool then (kubelet's reserved CPU 0 in it, unless strict-cpu-reservation)
OPTION_CLI_CASES = {
    "epyc, kubelet's order": ("amd-epyc-7313-2s", "", 8, "1-4,33-36", "0,5-32,37-63"),
    # one whole L3 group (4 cores) rather than a core of group 0 and three of group 4
    "epyc, prefer-align-cpus-by-uncorecache": (
        "amd-epyc-7313-2s", "prefer-align-cpus-by-uncorecache", 8, "4-7,36-39",
        "0-3,8-35,40-63"),
    # NUMA node 1 (8-15): it leaves the free CPUs of the two nodes most balanced
    "no-smt, distribute-cpus-across-numa": (
        "no-smt-server", "distribute-cpus-across-numa", 4, "8-11", "0-7,12-15"),
    # the reserved CPU 0 leaves the pool
    "no-smt, strict-cpu-reservation": (
        "no-smt-server", "strict-cpu-reservation", 4, "1-4", "5-15"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(OPTION_CLI_CASES))
def test_kubelet_options_through_the_cli(
    case: str, tmp_path: Path, env: dict[str, str]
) -> None:
    """``vmpin --sysfs-root <fixture> --kubelet-config <file> hook ...``: an option of kubelet's
    configuration file changes which CPUs a pod gets, and the pool the others run on."""
    machine, option, count, want, pool = OPTION_CLI_CASES[case]
    config = tmp_path / "kubelet-config.yaml"
    text = "kind: KubeletConfiguration\n"
    if option:
        text += f"cpuManagerPolicyOptions:\n  {option}: 'true'\n"
    config.write_text(text)
    pods = PlainPods(tmp_path, env, SYSFS / machine, read_topology(str(SYSFS / machine)).online)
    try:
        pods.env.pop("VMPIN_KUBELET_CONFIG", None)
        pods.flags = ["--sysfs-root", str(SYSFS / machine), "--kubelet-config", str(config)]
        pods.create("a", {"vmpin.io/exclusive-cpus": str(count)})
        pods.create("b", {})
        cg = pods.cgroups()
        assert (cg["a-app"], cg["b-app"]) == (P(want), P(pool))
        audit = json.loads(pods.vmpin("audit", "--json").stdout)
        assert audit["ok"], audit["violations"]
        assert not any("not followed" in n for n in audit["notes"]), audit["notes"]
    finally:
        pods.close()


# -- many hooks at once ---------------------------------------------------------------------------
def test_200_concurrent_hooks_never_hand_out_a_cpu_twice(pods: PlainPods) -> None:
    """50 pods, each created (pause, app) and 30 of them deleted again by concurrent hook
    processes: 170 hooks at once, then 30 more deletions while the rest are created -- 200
    in all.  Every pass settles under the node lock or, past a hook's budget, without it
    but inside one SQLite write transaction: no CPU is ever held by two pods, the store
    agrees with the cpusets the passes wrote, and nothing of a deleted pod is left."""
    rng = random.Random(30)
    sizes = {f"p{i}": rng.randint(1, 6) for i in range(50)}
    doomed = set(rng.sample(sorted(sizes), 30))

    def life(name: str) -> None:
        pods.create(name, {"vmpin.io/exclusive-cpus": str(sizes[name])})
        if name in doomed:
            pods.delete(name)

    with ThreadPoolExecutor(max_workers=50) as pool:
        list(pool.map(life, sorted(sizes)))
    # whatever a hook left in the journal past its budget is settled by the next pass
    once = pods.vmpin("reconcile", "--once")
    assert once.returncode == 0, once.stdout + once.stderr
    rows = pods.allocations()
    live = set(sizes) - doomed
    assert set(rows) == {f"{p}-pause" for p in live}, "a deleted pod's allocation is left"
    held = {sid: P(r["cpus"]) for sid, r in rows.items() if r["cpus"]}  # type: ignore[arg-type]
    seen: dict[int, str] = {}
    for sid, cpus in held.items():
        assert len(cpus) == sizes[sid.removesuffix("-pause")]
        for cpu in cpus:
            assert cpu not in seen, f"CPU {cpu} held by {seen[cpu]} and {sid}"
            seen[cpu] = sid
    assert 0 not in seen  # kubelet's reserved pick stays in the pool
    # refusals only while the machine really is full
    waiting = [sid for sid, r in rows.items() if not r["cpus"]]
    free = len(pods.online) - 1 - len(seen)
    for sid in waiting:
        assert sizes[sid.removesuffix("-pause")] > free, (sid, rows[sid], free)
    # the "kernel" (the cgroup files the passes wrote) agrees with the store
    cg = pods.cgroups()
    shared = pods.online - CpuSet(seen)
    for name in live:
        sid, app = pods.ids(name)
        assert cg[app] == held.get(sid, shared), (app, cg[app])
        assert cg[sid] == shared
    assert len(cg) == 2 * len(live)
    audit = json.loads(pods.vmpin("audit", "--json").stdout)
    assert audit["ok"], audit["violations"]
    # and every pod going leaves nothing behind
    with ThreadPoolExecutor(max_workers=20) as pool:
        list(pool.map(pods.delete, sorted(live)))
    assert pods.vmpin("reconcile", "--once").returncode == 0
    assert pods.allocations() == {}


def test_a_pass_reads_the_table_again_only_when_the_log_names_a_write_of_it(
    tmp_path: Path,
) -> None:
    """The allocations table is in the store's change log (schema 6): a pass that finds no
    write of it since its last read takes that read (issue 28: read on every event's pass),
    and one written by another process since is read again -- a read-only view, whose
    store may be older than the log's triggers, reads it at each version as before."""
    from vmpin.reconcile.allocations import recorded, settle
    from vmpin.state import allocations as table
    from vmpin.state.store import Store

    def reads(store: Store, do: object) -> int:
        sql: list[str] = []
        store.db.set_trace_callback(sql.append)
        try:
            do()  # type: ignore[operator]
        finally:
            store.db.set_trace_callback(None)
        return sum("FROM allocations" in s for s in sql)

    with Store(str(tmp_path)) as store, Store(str(tmp_path)) as other:
        other.put_container(ContainerRec("c1", "s1", False, "app", cpus=P("0")))
        assert reads(store, lambda: settle(store, XEON)) == 1  # (the first: read)
        assert recorded(store) == ()
        other.set_container_cpus("c1", P("1"), "update")  # (the store moved: not the table)
        assert reads(store, lambda: settle(store, XEON)) == 0
        assert reads(store, lambda: recorded(store)) == 0
        row = Allocation("s1", None, P("3"), 1, "vmpin.io/exclusive-cpus=1", None, 1.0, 1.0)
        with other.transaction() as db:
            table.write(db, [row], [])
        assert reads(store, lambda: recorded(store)) == 1
        assert recorded(store) == (row,)
        with other.transaction() as db:
            table.write(db, [], ["s1"])
        assert reads(store, lambda: recorded(store)) == 1 and recorded(store) == ()
    view = Store.open_readonly(str(tmp_path))
    try:
        assert recorded(view) == ()
        with Store(str(tmp_path)) as other, other.transaction() as db:
            table.write(db, [row], [])
        assert recorded(view) == (row,)
    finally:
        view.close()
