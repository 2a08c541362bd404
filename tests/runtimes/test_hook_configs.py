"""The ready-made hook configs under hooks/: well-formed, and runnable where this machine can tell.

The containerd base spec is run for real under runc (its hooks pointed at a recorder, its
rootfs at busybox), and the Kata guest hook script is run with a stand-in ``vmpin``.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import runc_util
from tests.support.runc_util import HOST_STAGES, RuncSession, new_id
from vmpin.linux.paths import HostPaths
from vmpin.wire.hookevent import STAGES

HOOKS = Path(__file__).resolve().parents[2] / "hooks"
GUEST = HOOKS / "kata-guest" / "usr" / "share" / "oci" / "hooks"


def check_hook(hook: dict[str, object], stage: str) -> None:
    assert hook["path"] == "/usr/local/bin/vmpin"
    assert hook["args"] == ["vmpin", "hook", stage]
    timeout = hook.get("timeout")
    assert timeout is None or (isinstance(timeout, int) and timeout > 0)


def test_oci_hooks_d() -> None:
    files = sorted((HOOKS / "oci-hooks.d").glob("*.json"))
    stages = []
    for f in files:
        doc = json.loads(f.read_text())
        assert doc["version"] == "1.0.0"
        assert doc["when"] == {"always": True}
        assert len(doc["stages"]) == 1, f"{f.name}: the stage is in args, so one per file"
        stage = doc["stages"][0]
        check_hook(doc["hook"], stage)
        stages.append(stage)
    assert sorted(stages) == ["poststart", "poststop", "prestart"]


@pytest.mark.parametrize(
    ("runtime", "create_stage"), [("runc", "createRuntime"), ("kata", "prestart")]
)
def test_containerd_base_specs(runtime: str, create_stage: str) -> None:
    spec = json.loads((HOOKS / "containerd" / f"base-runtime-spec-{runtime}.json").read_text())
    assert set(spec["hooks"]) == {create_stage, "poststart", "poststop"}
    for stage, hooks in spec["hooks"].items():
        assert stage in STAGES and stage != "startContainer"
        assert len(hooks) == 1
        check_hook(hooks[0], stage)
    # a whole spec, not a patch: containerd starts every container from it
    assert {m["destination"] for m in spec["mounts"]} >= {"/proc", "/dev", "/sys"}
    assert spec["linux"]["namespaces"]


def test_containerd_snippet_names_the_files() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    doc = tomllib.loads((HOOKS / "containerd" / "config.toml.snippet").read_text())
    runtimes = doc["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]
    for runtime in ("runc", "kata"):
        name = Path(runtimes[runtime]["base_runtime_spec"]).name
        assert name == f"base-runtime-spec-{runtime}.json"
        assert (HOOKS / "containerd" / name).exists()


def test_kata_guest_layout() -> None:
    for stage in ("prestart", "poststart", "poststop"):
        script = GUEST / stage / "vmpin-guest"
        mode = os.lstat(script).st_mode
        # the agent skips symlinks and files without an execute bit
        assert stat.S_ISREG(mode) and mode & 0o111
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    toml = (HOOKS / "kata-guest" / "configuration.toml.snippet").read_text()
    assert tomllib.loads(toml)["hypervisor"]["qemu"]["guest_hook_path"] == "/usr/share/oci/hooks"


@pytest.mark.parametrize("stage", ["prestart", "poststart", "poststop"])
@pytest.mark.parametrize("pass_stage", [True, False])
def test_kata_guest_script_execs_vmpin(tmp_path: Path, stage: str, pass_stage: bool) -> None:
    fake = tmp_path / "vmpin"
    fake.write_text('#!/bin/sh\necho "$@"; cat\n')
    fake.chmod(0o755)
    script = GUEST / stage / "vmpin-guest"
    # as the Kata agent runs it: argv [file name, stage], state on stdin, no PATH
    argv = [str(script), stage] if pass_stage else [str(script)]
    out = subprocess.run(
        argv, input=b'{"id":"c1"}', capture_output=True, env={"VMPIN": str(fake)}, check=True
    )
    assert out.stdout.decode().splitlines() == [f"guest hook {stage}", '{"id":"c1"}']


@pytest.fixture
def runc(
    paths: HostPaths, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RuncSession]:
    rootfs = runc_util.shared_rootfs(tmp_path_factory.getbasetemp())
    with RuncSession(paths, tmp_path, rootfs) as session:
        yield session


@pytest.mark.runc
def test_containerd_runc_base_spec_runs_under_runc(runc: RuncSession, tmp_path: Path) -> None:
    """The runc base spec is a runnable spec, and its hook stages all fire on the host."""
    spec = json.loads((HOOKS / "containerd" / "base-runtime-spec-runc.json").read_text())
    rec = tmp_path / "rec"
    rec.mkdir()
    cid = new_id()
    bundle = runc.bundle(cid, hooks=None)
    # what containerd's CRI would fill in, then the recorder instead of vmpin
    spec["root"] = {"path": str(runc.rootfs), "readonly": True}
    spec["process"]["args"] = ["sleep", "3600"]
    spec["process"]["env"] = ["PATH=/bin"]
    for stage, hooks in spec["hooks"].items():
        assert stage in HOST_STAGES
        hooks[0] = {
            "path": "/bin/sh",
            "args": ["sh", "-c", f'cat > "{rec}/$0.json"', stage],
            "timeout": hooks[0]["timeout"],
        }
    (bundle / "config.json").write_text(json.dumps(spec))
    pid = runc.run(cid, bundle=bundle)
    assert runc.state(cid)["status"] == "running"
    runc.delete(cid)
    seen = {p.stem: json.loads(p.read_text()) for p in rec.glob("*.json")}
    assert set(seen) == set(spec["hooks"])
    assert seen["createRuntime"]["pid"] == pid


def test_annotation_passthrough_snippet_covers_the_vocabulary() -> None:
    """containerd's pod_annotations globs let every key that vmpin.core.podpolicy reads
    through (and parse as TOML).  CRI-O needs no snippet: it copies pod annotations into every
    container's spec (test_no_crio_allowed_annotations_beyond_crio_own)."""
    import fnmatch

    from vmpin.core.podpolicy import VOCABULARY

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    ctd = tomllib.loads((HOOKS / "containerd" / "pod-annotations.toml.snippet").read_text())
    runtimes = ctd["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]
    for name in ("kata", "runc"):
        globs = runtimes[name]["pod_annotations"]
        for key in VOCABULARY:
            assert any(fnmatch.fnmatchcase(key, g) for g in globs), (name, key)


#: what CRI-O's allowed_annotations accepts: its own experimental annotations
#: (pkg/annotations AllAllowedAnnotations: io.kubernetes.cri-o.*, *.crio.io,
#: seccomp-profile.kubernetes.cri-o.io) and the few runtime keys it lists beside them; any other
#: name stops CRI-O at start-up with "invalid allowed_annotation: NAME" (1.28 to main)
CRIO_OWN_PREFIXES = ("io.kubernetes.cri-o.", "io.kubernetes.cri.", "io.containers.",
                     "org.systemd.property.", "run.oci.", "rdt.resources.beta.kubernetes.io/")
CRIO_OWN_SUFFIXES = (".crio.io", ".kubernetes.cri-o.io")
CRIO_OWN_NAMES = ("bundle", "org.criu.config", "module.wasm.image/variant")


def _crio_own(name: str) -> bool:
    return (name.startswith(CRIO_OWN_PREFIXES) or name.endswith(CRIO_OWN_SUFFIXES)
            or name in CRIO_OWN_NAMES)  # fmt: skip


def test_crio_own_names_rule() -> None:
    assert _crio_own("io.kubernetes.cri-o.Devices") and _crio_own("cpu-quota.crio.io")
    assert not _crio_own("vmpin.io/vcpus") and not _crio_own("qos.gocrane.io/cpu-manager")


def test_no_crio_allowed_annotations_beyond_crio_own() -> None:
    """No shipped file sets CRI-O's allowed_annotations to a name CRI-O refuses.

    vmpin once shipped hooks/crio/vmpin-annotations.conf listing its vocabulary there: CRI-O
    validates the list at start-up against its own annotations and refused to start.  Pod
    annotations need no such list (docs/hooks.md, "Per-pod policy annotations in the specs").
    """
    from vmpin.core.podpolicy import VOCABULARY

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    root = HOOKS.parent
    for top in (HOOKS, root / "deploy"):
        for f in sorted(p for p in top.rglob("*") if p.is_file()):
            try:
                text = f.read_text()
            except UnicodeDecodeError:
                continue
            lines = [ln.split("=")[0].strip() for ln in text.splitlines() if "=" in ln]
            if "allowed_annotations" not in lines:
                continue
            doc = tomllib.loads(text)  # a file that sets it is a CRI-O drop-in: TOML
            handlers = doc.get("crio", {}).get("runtime", {}).get("runtimes", {})
            names = [n for h in handlers.values() for n in h.get("allowed_annotations", [])]
            refused = [n for n in names if not _crio_own(n)]
            assert not refused, f"{f.relative_to(root)}: CRI-O refuses {refused} at start-up"
            assert not set(names) & set(VOCABULARY), f.relative_to(root)
    assert not (HOOKS / "crio" / "vmpin-annotations.conf").exists()


def test_hooks_run_the_lean_launcher() -> None:
    """The `vmpin` the configs name is bin/vmpin (pip writes its `#!python` line), the program
    bench/bench_hook.py times: not a [project.scripts] wrapper, which imports re first."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    root = HOOKS.parent
    project = tomllib.loads((root / "pyproject.toml").read_text())
    assert project["tool"]["setuptools"]["script-files"] == ["bin/vmpin"]
    assert "vmpin" not in project["project"].get("scripts", {})
    launcher = (root / "bin" / "vmpin").read_text()
    assert launcher.startswith("#!python\n") and "import re" not in launcher
    assert os.stat(root / "bin" / "vmpin").st_mode & 0o111
