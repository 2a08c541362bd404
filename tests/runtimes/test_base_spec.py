"""The shipped hook configs are ``hooks/containerd/generate.py``'s output (made by
:mod:`vmpin.runtimes.hookconfig`, which ``vmpin install`` uses too), and the containerd base
specs differ from ``ctr oci spec`` (containerd's own default) only where containerd's CRI
plugin would.

The ``ctr`` tests need containerd (``apt-get install containerd``; .ci/run installs it).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from vmpin.runtimes import hookconfig

HOOKS = Path(__file__).resolve().parents[2] / "hooks" / "containerd"
HOOKS_D = HOOKS.parent / "oci-hooks.d"
CTR = shutil.which("ctr")
needs_ctr = pytest.mark.skipif(CTR is None, reason="ctr (containerd) is not installed")


def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("vmpin_gen_base_spec", HOOKS / "generate.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def flatten(doc: Any, prefix: str = "") -> dict[str, Any]:
    """JSON paths -> leaf values (lists of scalars kept whole, lists of objects by index)."""
    if isinstance(doc, dict):
        out: dict[str, Any] = {}
        for k, v in doc.items():
            out.update(flatten(v, f"{prefix}/{k}"))
        return out
    if isinstance(doc, list) and any(isinstance(x, (dict, list)) for x in doc):
        out = {}
        for i, v in enumerate(doc):
            out.update(flatten(v, f"{prefix}/{i}"))
        return out
    return {prefix: doc}


@needs_ctr
@pytest.mark.parametrize("runtime", ["runc", "kata"])
def test_shipped_spec_is_generated(runtime: str) -> None:
    gen = generator()
    want = gen.dump(gen.base_spec(gen.ctr_default_spec(CTR), runtime))
    shipped = (HOOKS / f"base-runtime-spec-{runtime}.json").read_text()
    assert shipped == want, "regenerate: python3 hooks/containerd/generate.py"


@pytest.mark.parametrize("runtime", ["runc", "kata"])
def test_shipped_spec_is_made_from_the_packaged_default(runtime: str) -> None:
    """What `vmpin install` writes where it cannot run the node's ctr is the shipped file."""
    want = hookconfig.dump(hookconfig.base_spec(hookconfig.packaged_default(), runtime))
    assert (HOOKS / f"base-runtime-spec-{runtime}.json").read_text() == want


@needs_ctr
def test_packaged_default_is_ctr_oci_spec() -> None:
    """vmpin/runtimes/containerd-default-spec.json is what it says (with this containerd)."""
    version = subprocess.run([CTR or "ctr", "--version"], capture_output=True, text=True).stdout
    if "1.6.20" not in version:
        pytest.skip(f"the packaged default is {hookconfig.PACKAGED_DEFAULT_FROM}'s: {version}")
    assert hookconfig.packaged_default() == generator().ctr_default_spec(CTR)


def test_shipped_hooks_d_is_generated() -> None:
    shipped = {p.name: p.read_text() for p in HOOKS_D.glob("*.json")}
    want = {name: hookconfig.dump(doc) for name, doc in hookconfig.hooks_d().items()}
    assert shipped == want, "regenerate: python3 hooks/containerd/generate.py"


@needs_ctr
@pytest.mark.parametrize("runtime", ["runc", "kata"])
def test_nothing_but_hooks_and_cri_security_defaults_differ(runtime: str) -> None:
    default = flatten(generator().ctr_default_spec(CTR))
    shipped = flatten(json.loads((HOOKS / f"base-runtime-spec-{runtime}.json").read_text()))
    added = {k for k in shipped.keys() - default.keys()}
    removed = default.keys() - shipped.keys()
    changed = {k for k in shipped.keys() & default.keys() if shipped[k] != default[k]}
    assert changed == set()
    assert all(k.startswith("/hooks/") for k in added) and added
    # what CRI's WithoutDefaultSecuritySettings strips when there is no base spec
    assert all(
        k.startswith(("/process/rlimits/", "/process/apparmorProfile", "/linux/seccomp"))
        for k in removed
    ), removed
    # ctr 1.6 has RLIMIT_NOFILE 1024/1024 in its default; the base spec must not impose it
    assert any(k.startswith("/process/rlimits/") for k in removed)


def test_generated_hooks_have_explicit_env() -> None:
    gen = generator()
    default = {"ociVersion": "1.0.2-dev", "process": {"rlimits": [{"type": "RLIMIT_NOFILE"}]}}
    spec = gen.base_spec(default, "runc", "/x/vmpin", ["PATH=/bin", "VMPIN_STATE_DIR=/s"])
    assert set(spec["hooks"]) == {"createRuntime", "poststart", "poststop"}
    for stage, (hook,) in spec["hooks"].items():
        assert hook == {
            "path": "/x/vmpin",
            "args": ["vmpin", "hook", stage],
            "env": ["PATH=/bin", "VMPIN_STATE_DIR=/s"],
            "timeout": 10,
        }
    assert "rlimits" not in spec["process"]
    assert default["process"]["rlimits"], "the input is left alone"
