"""runc's roots are found without configuration: runc's own and one per containerd namespace."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from tests.support import runc_util
from tests.support.runc_util import RuncSession
from vmpin.linux.paths import DEFAULTS, HostPaths
from vmpin.runtimes.runcstate import runc_cpus, runc_roots, state_path


def test_default_covers_runc_and_containerd() -> None:
    assert DEFAULTS["runc_root"].split(":") == ["/run/runc", "/run/containerd/runc/*"]


def test_namespaces_expand_in_order(tmp_path: Path) -> None:
    plain = tmp_path / "runc"
    ctd = tmp_path / "containerd-runc"
    for ns in ("k8s.io", "default"):
        (ctd / ns).mkdir(parents=True)
    (ctd / "not-a-dir").write_text("")
    paths = HostPaths(runc_root=f"{plain}:{ctd}/*:{tmp_path}/absent/*")
    assert runc_roots(paths) == [str(plain), str(ctd / "default"), str(ctd / "k8s.io")]


def test_state_found_in_a_namespace(tmp_path: Path) -> None:
    ctd = tmp_path / "ctd"
    cid = uuid.uuid4().hex
    (ctd / "k8s.io" / cid).mkdir(parents=True)
    (ctd / "k8s.io" / cid / "state.json").write_text(
        '{"config": {"cgroups": {"cpuset_cpus": "1"}}}'
    )
    paths = HostPaths(runc_root=f"{tmp_path}/runc:{ctd}/*")
    assert state_path(paths, cid) == str(ctd / "k8s.io" / cid / "state.json")
    assert runc_cpus(paths, cid) == "1"
    # unknown container: a path under the first root, and "no state"
    assert state_path(paths, "other") == f"{tmp_path}/runc/other/state.json"
    assert runc_cpus(paths, "other") is None


@pytest.mark.runc
@pytest.mark.skipif(runc_util.missing() is not None, reason=str(runc_util.missing()))
def test_real_runc_under_a_namespace_root(paths: HostPaths, tmp_path: Path) -> None:
    """A real container run the way containerd's shim runs runc (--root ROOT/NAMESPACE)."""
    ns_parent = tmp_path / "containerd-runc"
    ns_root = ns_parent / "k8s.io"
    runc_paths = paths._replace(runc_root=str(ns_root))
    with RuncSession(runc_paths, tmp_path / "work") as runc:
        cid = runc_util.new_id()
        runc.run(cid, cpus="0", hooks=None)
        want = "0-1" if (os.cpu_count() or 1) > 1 else "0"
        runc.update(cid, want)
        search = paths._replace(runc_root=f"{tmp_path}/runc:{ns_parent}/*")
        assert state_path(search, cid) == str(ns_root / cid / "state.json")
        assert runc_cpus(search, cid) == want
