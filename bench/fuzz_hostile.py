"""Fuzz every door hostile input comes through; count tracebacks and poisoned stores.

Targets (hypothesis, ``--examples`` each, default 10,000), all on real files in a temp dir:

- ``hook-stdin``: the OCI state a hook reads (structured, with out-of-range pids, lone
  surrogates, wrong types, deep nesting, raw byte mutations) through
  :func:`vmpin.service.hook.run`, on a real bundle;
- ``bundle``: the bundle's config.json (annotations, cpus, mems, junk) through the same hook;
- ``resources``: ``vmpin update -r`` documents (:func:`vmpin.service.update.parse_update`);
- ``kubelet``: cpu_manager_state checkpoints (:func:`vmpin.runtimes.kubelet.read_checkpoint`);
- ``runc-state``: runc's state.json (read_state, runc_cpus, runc_init_pid, cgroup paths);
- ``guest-map``: the published map as the guest reads it (``read_map``) and as the host
  re-reads it before publishing (``read_published``).

A *traceback* is any exception other than the target's documented one-line error
(VmpinError, or GuestError in the guest).  A *poisoned store* is a store that cannot be opened
or listed after a hook example (every hook example is followed by a store open that
ingests the journal).  Not run in CI (minutes, not seconds)::

    .venv/bin/python bench/fuzz_hostile.py [--examples 10000] [--only hook-stdin,...] [--json]

Exits 1 when anything was counted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vmpin.core.errors import VmpinError
from vmpin.guest.common import GuestError
from vmpin.guest.inputs import read_map
from vmpin.linux.paths import HostPaths
from vmpin.runtimes import publish, runcstate
from vmpin.runtimes.kubelet import read_checkpoint
from vmpin.service.hook import run as hook_run
from vmpin.service.update import parse_update
from vmpin.state.store import Store

# Any code point, surrogates included: json.dumps writes a lone one as "\udXXX", which
# json.loads turns back into a str that no UTF-8 encoder (nor SQLite) accepts.
TEXT = st.text(st.characters(min_codepoint=0, max_codepoint=0x10FFFF, categories=None), max_size=40)
INTS = st.one_of(
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, 1, -1, 2**22, 2**22 + 1, 2**31, 2**63 - 1, 2**63, 2**64]),
)
SCALARS = st.one_of(st.none(), st.booleans(), INTS, st.floats(allow_nan=True), TEXT)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(TEXT, inner, max_size=4)
    ),
    max_leaves=20,
)
IDS = st.one_of(st.sampled_from(["c1", "c2", "pod", "sb-1", "x" * 1025, ".", "../etc", ""]), TEXT)
CPUS = st.one_of(
    st.sampled_from(["0", "0-1", "0,1", "", " ", "1-0", "0-", "9999", "0-8191", "a", "0--1"]),
    TEXT,
    INTS,
)
ANN_KEYS = st.sampled_from([
    "io.kubernetes.cri.container-type", "io.kubernetes.cri.sandbox-id",
    "io.kubernetes.cri.sandbox-name", "io.kubernetes.cri.container-name",
    "io.kubernetes.cri-o.ContainerType", "io.katacontainers.pkg.oci.container_type",
])
ANN_VALUES = st.one_of(st.sampled_from(["sandbox", "container", "pod", "c1"]), TEXT, INTS)
ANNOTATIONS = st.one_of(st.dictionaries(st.one_of(ANN_KEYS, TEXT), ANN_VALUES, max_size=5), JSON)


def _deep(n: int) -> str:
    return "[" * n + "]" * n


def mutate(doc: str, data: st.DataObject) -> bytes:
    raw = doc.encode("utf-8", "surrogatepass")
    how = data.draw(st.sampled_from(["keep", "keep", "truncate", "byte", "deep", "bom"]))
    if how == "truncate" and raw:
        return raw[: data.draw(st.integers(0, len(raw) - 1))]
    if how == "byte" and raw:
        i = data.draw(st.integers(0, len(raw) - 1))
        return raw[:i] + bytes([data.draw(st.integers(0, 255))]) + raw[i + 1 :]
    if how == "deep":
        return _deep(data.draw(st.integers(60, 5000))).encode()
    if how == "bom":
        return b"\xef\xbb\xbf" + raw
    return raw


class Tally:
    def __init__(self) -> None:
        self.examples = 0
        self.expected = 0
        self.tracebacks: list[str] = []
        self.poisoned: list[str] = []

    def call(self, fn: Callable[[], Any], ok: tuple[type[BaseException], ...]) -> None:
        self.examples += 1
        try:
            fn()
        except ok:
            self.expected += 1
        except Exception:  # the thing counted
            self.tracebacks.append(traceback.format_exc(limit=4))


def check_store(state_dir: str, tally: Tally) -> None:
    try:
        with Store(state_dir) as store:
            store.containers()
            store.sandboxes()
            store.policy_records()
    except Exception as err:  # a store that will not open is what the issue calls poisoned
        tally.poisoned.append(f"{type(err).__name__}: {err}")


def fuzz_hook_stdin(root: Path, n: int) -> Tally:
    tally = Tally()
    paths = _paths(root, "hook")
    bundle = root / "bundle-ok"
    bundle.mkdir(exist_ok=True)
    (bundle / "config.json").write_text(json.dumps(
        {"linux": {"resources": {"cpu": {"cpus": "0"}}}}))
    stage = st.sampled_from(["prestart", "createRuntime", "createContainer", "poststart",
                             "poststop", "startContainer"])
    state = st.fixed_dictionaries(
        {},
        optional={
            "id": IDS, "pid": st.one_of(INTS, SCALARS), "status": SCALARS,
            "ociVersion": SCALARS, "annotations": ANNOTATIONS,
            "bundle": st.one_of(st.just(str(bundle)), TEXT, st.just(str(bundle) + "/\ud800"),
                                SCALARS),
        },
    )

    @settings(max_examples=n, deadline=None, database=None, derandomize=False,
              suppress_health_check=list(HealthCheck))
    @given(stage, state, st.data())
    def one(stage_: str, doc: dict[str, Any], data: st.DataObject) -> None:
        raw = mutate(json.dumps(doc), data)
        tally.call(lambda: hook_run(paths, stage_, raw), (VmpinError,))
        check_store(paths.state_dir, tally)

    one()
    return tally


def fuzz_bundle(root: Path, n: int) -> Tally:
    tally = Tally()
    paths = _paths(root, "bundle")
    bundle = root / "bundle-fuzz"
    bundle.mkdir(exist_ok=True)
    config = st.fixed_dictionaries(
        {},
        optional={
            "annotations": ANNOTATIONS,
            "linux": st.one_of(
                JSON,
                st.fixed_dictionaries({"resources": st.one_of(JSON, st.fixed_dictionaries(
                    {"cpu": st.one_of(JSON, st.fixed_dictionaries(
                        {}, optional={"cpus": CPUS, "mems": CPUS}))})),
                }),
            ),
        },
    )

    @settings(max_examples=n, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(config, st.data(), st.integers(0, 10**6))
    def one(doc: dict[str, Any], data: st.DataObject, k: int) -> None:
        (bundle / "config.json").write_bytes(mutate(json.dumps(doc), data))
        state = json.dumps({"id": f"b{k}", "pid": os.getpid(), "bundle": str(bundle)})
        tally.call(lambda: hook_run(paths, "createRuntime", state.encode()), (VmpinError,))
        check_store(paths.state_dir, tally)

    one()
    return tally


def fuzz_resources(root: Path, n: int) -> Tally:
    tally = Tally()
    f = root / "resources.json"
    doc = st.one_of(JSON, st.fixed_dictionaries({"cpu": st.one_of(JSON, st.fixed_dictionaries(
        {}, optional={"cpus": CPUS, "mems": CPUS, "shares": INTS}))}))

    @settings(max_examples=n, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(doc, st.data())
    def one(d: Any, data: st.DataObject) -> None:
        f.write_bytes(mutate(json.dumps(d), data))
        tally.call(lambda: parse_update(None, str(f)), (VmpinError,))

    one()
    return tally


def fuzz_kubelet(root: Path, n: int) -> Tally:
    tally = Tally()
    f = root / "cpu_manager_state"
    entries = st.dictionaries(TEXT, st.one_of(JSON, st.dictionaries(TEXT, CPUS, max_size=3)),
                              max_size=3)
    doc = st.one_of(JSON, st.fixed_dictionaries({}, optional={
        "policyName": st.one_of(st.sampled_from(["static", "none"]), TEXT, SCALARS),
        "defaultCpuSet": CPUS, "entries": st.one_of(entries, JSON), "checksum": INTS}))

    @settings(max_examples=n, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(doc, st.data())
    def one(d: Any, data: st.DataObject) -> None:
        f.write_bytes(mutate(json.dumps(d), data))
        tally.call(lambda: read_checkpoint(str(f)), (VmpinError,))

    one()
    return tally


def fuzz_runc_state(root: Path, n: int) -> Tally:
    tally = Tally()
    paths = _paths(root, "runc")
    d = Path(paths.runc_root, "ctr")
    d.mkdir(parents=True, exist_ok=True)
    doc = st.one_of(JSON, st.fixed_dictionaries({}, optional={
        "init_process_pid": st.one_of(INTS, SCALARS),
        "init_process_start": st.one_of(INTS, SCALARS),
        "cgroup_paths": st.one_of(st.dictionaries(TEXT, st.one_of(TEXT, SCALARS), max_size=3),
                                  JSON),
        "config": st.one_of(JSON, st.fixed_dictionaries({}, optional={
            "cgroups": st.one_of(JSON, st.fixed_dictionaries({}, optional={
                "cpuset_cpus": CPUS, "path": TEXT})),
            "labels": st.one_of(st.lists(st.one_of(TEXT, SCALARS), max_size=3), JSON)})),
    }))

    def read_all() -> None:
        runcstate.read_state(paths, "ctr")
        runcstate.runc_cpus(paths, "ctr")
        runcstate.runc_init_pid(paths, "ctr")
        runcstate.runc_cgroup_paths(paths, "ctr")

    @settings(max_examples=n, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(doc, st.data())
    def one(dd: Any, data: st.DataObject) -> None:
        (d / "state.json").write_bytes(mutate(json.dumps(dd), data))
        tally.call(read_all, (VmpinError,))

    one()
    return tally


def fuzz_guest_map(root: Path, n: int) -> Tally:
    tally = Tally()
    f = root / "guest-map.json"
    doc = st.one_of(JSON, st.fixed_dictionaries({}, optional={
        "version": st.one_of(st.just(1), INTS, SCALARS), "sandbox": IDS,
        "generation": st.one_of(INTS, SCALARS), "mode": st.one_of(TEXT, SCALARS),
        "nvcpus": st.one_of(INTS, SCALARS),
        "vcpu_to_host": st.one_of(st.dictionaries(TEXT, st.one_of(INTS, SCALARS), max_size=3),
                                  JSON),
        "containers": st.one_of(JSON, st.dictionaries(IDS, st.one_of(JSON, st.fixed_dictionaries(
            {}, optional={"guest_cpus": CPUS, "host_cpus": CPUS,
                          "generation": INTS})), max_size=3)),
    }))

    def read_both() -> None:
        publish.read_published(str(f))
        read_map(str(f))

    @settings(max_examples=n, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(doc, st.data())
    def one(d: Any, data: st.DataObject) -> None:
        f.write_bytes(mutate(json.dumps(d), data))
        tally.call(read_both, (GuestError, VmpinError))

    one()
    return tally


def _paths(root: Path, name: str) -> HostPaths:
    base = root / name
    for sub in ("state", "vm", "runc", "publish"):
        (base / sub).mkdir(parents=True, exist_ok=True)
    return HostPaths(state_dir=str(base / "state"), vm_dir=str(base / "vm"),
                     runc_root=str(base / "runc"), publish_dir=str(base / "publish"),
                     kubelet_state=str(base / "cpu_manager_state"))


TARGETS: dict[str, Callable[[Path, int], Tally]] = {
    "hook-stdin": fuzz_hook_stdin,
    "bundle": fuzz_bundle,
    "resources": fuzz_resources,
    "kubelet": fuzz_kubelet,
    "runc-state": fuzz_runc_state,
    "guest-map": fuzz_guest_map,
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=10_000)
    ap.add_argument("--only", default=",".join(TARGETS))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    results: dict[str, dict[str, Any]] = {}
    sys.stderr = open(os.devnull, "w")  # noqa: SIM115 -- the hook's one-liners, by the thousand
    with tempfile.TemporaryDirectory(prefix="vmpin-fuzz-") as tmp:
        for name in args.only.split(","):
            t0 = time.monotonic()
            tally = TARGETS[name](Path(tmp), args.examples)
            results[name] = {
                "examples": tally.examples,
                "refused_one_line": tally.expected,
                "tracebacks": len(tally.tracebacks),
                "poisoned_stores": len(tally.poisoned),
                "seconds": round(time.monotonic() - t0, 1),
                "first_traceback": tally.tracebacks[0] if tally.tracebacks else None,
                "first_poisoned": tally.poisoned[0] if tally.poisoned else None,
            }
            if not args.json:
                r = results[name]
                print(f"{name:11} {r['examples']:6} examples  {r['refused_one_line']:6} refused"
                      f"  {r['tracebacks']} tracebacks  {r['poisoned_stores']} poisoned"
                      f"  ({r['seconds']} s)", flush=True)
                if r["first_traceback"]:
                    print(r["first_traceback"])
                if r["first_poisoned"]:
                    print(r["first_poisoned"])
    if args.json:
        print(json.dumps(results, indent=1))
    bad = sum(r["tracebacks"] + r["poisoned_stores"] for r in results.values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
