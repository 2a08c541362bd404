"""``vmpin install --root DIR`` / ``vmpin uninstall`` against a scratch host root.

The scratch root looks like a node's: a containerd config.toml (kata-deploy's ``kata-qemu``
handler beside runc, ``base_runtime_spec = ""`` as ``containerd config default`` writes it), a
hooks.d directory holding another vendor's hook and a ``vmpin-prestart.json`` left from a
manual install (docs/hooks.md).  Every test compares whole trees (types, modes, bytes, link
targets): an install writes what it says, a second install changes nothing, an uninstall
leaves the root as it was.  Real daemons run the installed files in
tests/e2e/test_install_e2e.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from vmpin.runtimes import containerdconf, hookconfig
from vmpin.service import install as inst

tomllib = pytest.importorskip("tomllib")  # Python 3.11+ (so is the config editor)

HOST_PYTHON = "/usr/bin/python3"
HOOK = "/opt/vmpin/bin/vmpin-hook"
CRI = 'plugins."io.containerd.grpc.v1.cri"'
CONFIG = f"""version = 2
root = "/var/lib/containerd"

[{CRI}]
  sandbox_image = "registry.k8s.io/pause:3.6"
  [{CRI}.containerd]
    default_runtime_name = "runc"
    snapshotter = "overlayfs"
    [{CRI}.containerd.runtimes.runc]
      base_runtime_spec = ""
      runtime_type = "io.containerd.runc.v2"
      [{CRI}.containerd.runtimes.runc.options]
        SystemdCgroup = true
    [{CRI}.containerd.runtimes.kata-qemu]
      runtime_type = "io.containerd.kata-qemu.v2"
      privileged_without_host_devices = true
      pod_annotations = ["io.katacontainers.*"]
      [{CRI}.containerd.runtimes.kata-qemu.options]
        ConfigPath = "/opt/kata/share/defaults/kata-containers/configuration-qemu.toml"
    [{CRI}.containerd.runtimes.runsc]
      runtime_type = "io.containerd.runsc.v1"
"""
OTHER_HOOK = '{"version": "1.0.0", "hook": {"path": "/usr/bin/nvidia-hook"}, "when": {"always": true}, "stages": ["prestart"]}\n'  # noqa: E501
MANUAL = hookconfig.dump(hookconfig.hooks_d()["vmpin-prestart.json"])
ENV = ("VMPIN_STATE_DIR=/run/vmpin", "VMPIN_HELPER_POLICY=isolate")

needs_host_python = pytest.mark.skipif(
    not os.access(HOST_PYTHON, os.X_OK), reason=f"{HOST_PYTHON} is not installed"
)
pytestmark = needs_host_python


def snapshot(root: Path) -> dict[str, tuple[str, int, bytes]]:
    """Every entry under ``root``: (type, mode, content or link target)."""
    out: dict[str, tuple[str, int, bytes]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = ("link", 0, os.readlink(p).encode())
            elif p.is_dir():
                out[rel] = ("dir", st.st_mode & 0o7777, b"")
            else:
                out[rel] = ("file", st.st_mode & 0o7777, p.read_bytes())
    return out


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "host"
    (r / "etc" / "containerd").mkdir(parents=True)
    (r / "etc" / "containerd" / "config.toml").write_text(CONFIG)
    (r / "etc" / "containerd" / "config.toml").chmod(0o600)
    hooks = r / "usr" / "share" / "containers" / "oci" / "hooks.d"
    hooks.mkdir(parents=True)
    (hooks / "oci-nvidia-hook.json").write_text(OTHER_HOOK)
    (hooks / "vmpin-prestart.json").write_text(MANUAL)
    (r / "opt").mkdir()
    (r / "usr" / "bin").mkdir()
    (r / "bin").symlink_to("usr/bin")  # as on merged-/usr distributions
    return r


def opts(**kw: Any) -> inst.Options:
    return inst.Options(**{"env": ENV, "python": [HOST_PYTHON], "ctr": [], **kw})


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vmpin", *args], capture_output=True,
                          text=True, timeout=120)  # fmt: skip


def test_install_writes_the_node_tree(root: Path) -> None:
    before = snapshot(root)
    proc = cli("install", "--root", str(root), "--python", HOST_PYTHON, "--ctr", "none",
               *(a for e in ENV for a in ("--env", e)))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    after = snapshot(root)
    added = {k for k in after if k not in before}
    changed = {k for k in before if after.get(k) != before[k]}
    hooks_d = "usr/share/containers/oci/hooks.d"
    assert added == {
        "opt/vmpin", "opt/vmpin/bin", "opt/vmpin/bin/vmpin-hook", "opt/vmpin/containerd",
        "opt/vmpin/containerd/base-runtime-spec-runc.json",
        "opt/vmpin/containerd/base-runtime-spec-kata.json",
        "opt/vmpin/install-manifest.json",
        f"{hooks_d}/vmpin-poststart.json", f"{hooks_d}/vmpin-poststop.json",
    }  # fmt: skip
    assert changed == {"etc/containerd/config.toml", f"{hooks_d}/vmpin-prestart.json"}
    assert after["opt/vmpin/bin/vmpin-hook"][1] == 0o755
    assert after["etc/containerd/config.toml"][1] == 0o600  # its mode kept
    # the manifest holds config.toml's old content (registry credentials, maybe): root's only
    assert after["opt/vmpin/install-manifest.json"][1] == 0o600
    for rel in added - {"opt/vmpin/bin/vmpin-hook", "opt/vmpin/install-manifest.json"}:
        assert after[rel][1] == (0o755 if after[rel][0] == "dir" else 0o644), rel
    # every document names host paths, never the installer's view of them
    for rel, (_, _, data) in after.items():
        assert str(root).encode() not in data, rel
    env = ["PATH=" + inst.HOOK_PATH, *ENV]
    for name, doc in hookconfig.hooks_d(HOOK, env).items():
        assert json.loads(after[f"{hooks_d}/{name}"][2]) == doc
    for kind, stage in hookconfig.CREATE_STAGE.items():
        spec = json.loads(after[f"opt/vmpin/containerd/base-runtime-spec-{kind}.json"][2])
        assert spec == hookconfig.base_spec(hookconfig.packaged_default(), kind, HOOK, env)
        assert spec["hooks"][stage][0]["path"] == HOOK
    conf = tomllib.loads(after["etc/containerd/config.toml"][2].decode())
    runtimes = conf["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]
    assert runtimes["runc"]["base_runtime_spec"] == (
        "/opt/vmpin/containerd/base-runtime-spec-runc.json")
    assert runtimes["kata-qemu"]["base_runtime_spec"] == (
        "/opt/vmpin/containerd/base-runtime-spec-kata.json")
    assert "base_runtime_spec" not in runtimes["runsc"]  # gVisor: left alone
    assert "handler runsc (io.containerd.runsc.v1): left alone" in proc.stdout
    assert "restart containerd" in proc.stdout
    # the manifest: every file written, what each replaced
    manifest = json.loads(after["opt/vmpin/install-manifest.json"][2])
    assert set(manifest["files"]) == {"/" + r for r in added | changed
                                      if after[r][0] == "file"} - {"/opt/vmpin/install-manifest.json"}  # noqa: E501
    assert manifest["files"]["/etc/containerd/config.toml"]["previous"] == {
        "text": CONFIG, "mode": "0600", "uid": os.getuid(), "gid": os.getgid()}
    assert manifest["files"][f"/{hooks_d}/vmpin-prestart.json"]["previous"]["text"] == MANUAL
    assert manifest["dirs"] == ["/opt/vmpin", "/opt/vmpin/bin", "/opt/vmpin/containerd"]


def test_install_again_changes_nothing_and_uninstall_restores_the_root(root: Path) -> None:
    before = snapshot(root)
    inst.install(str(root), opts())
    first = snapshot(root)
    report = inst.install(str(root), opts())
    assert snapshot(root) == first
    assert not [ln for ln in report.lines if ln.endswith((": written", ": replaced"))]
    proc = cli("uninstall", "--root", str(root))
    assert proc.returncode == 0, proc.stderr
    assert snapshot(root) == before
    assert "/etc/containerd/config.toml: put back as it was" in proc.stdout


def test_the_installed_hook_runs(root: Path, tmp_path: Path) -> None:
    """(tests/service/test_hookfile.py runs the file in depth.)"""
    inst.install(str(root), opts(env=(f"VMPIN_STATE_DIR={tmp_path / 'state'}",)))
    bundle = tmp_path / "b"
    bundle.mkdir()
    (bundle / "config.json").write_text("{}")
    state = json.dumps({"id": "c1", "pid": os.getpid(), "bundle": str(bundle)})
    hook = root / HOOK.lstrip("/")
    proc = subprocess.run([str(hook), "hook", "--strict", "prestart"], input=state, text=True,
                          env={"PATH": inst.HOOK_PATH, "VMPIN_STATE_DIR": str(tmp_path / "state"),
                               "VMPIN_VM_DIR": str(tmp_path / "vm")},
                          capture_output=True, timeout=60)  # fmt: skip
    assert (proc.returncode, proc.stderr) == (0, "")
    assert os.listdir(tmp_path / "state" / "journal")


def test_uninstall_without_a_manifest_is_an_error(root: Path) -> None:
    before = snapshot(root)
    proc = cli("uninstall", "--root", str(root))
    assert proc.returncode == 2
    assert proc.stderr == (f"vmpin: error: no vmpin install under {root}:"
                           f" {root}/opt/vmpin/install-manifest.json does not exist"
                           " (nothing was changed)\n")  # fmt: skip
    assert snapshot(root) == before


def test_fewer_runtimes_undo_the_rest(root: Path) -> None:
    before = snapshot(root)
    inst.install(str(root), opts())
    inst.install(str(root), opts(runtimes=("crio",)))
    now = snapshot(root)
    assert now["etc/containerd/config.toml"] == before["etc/containerd/config.toml"]
    assert "opt/vmpin/containerd/base-runtime-spec-runc.json" not in now
    assert "usr/share/containers/oci/hooks.d/vmpin-poststop.json" in now
    inst.install(str(root), opts(runtimes=("containerd",)))
    now = snapshot(root)
    assert "usr/share/containers/oci/hooks.d/vmpin-poststop.json" not in now
    assert now["usr/share/containers/oci/hooks.d/vmpin-prestart.json"][2] == MANUAL.encode()
    inst.uninstall(str(root))
    assert snapshot(root) == before


def test_config_edited_after_install_keeps_the_edit(root: Path) -> None:
    """Someone changed config.toml after vmpin's edit: uninstall takes out vmpin's lines only;
    an install over it starts from the changed file."""
    conf = root / "etc" / "containerd" / "config.toml"
    inst.install(str(root), opts())
    edited = conf.read_text().replace('snapshotter = "overlayfs"', 'snapshotter = "native"')
    conf.write_text(edited)
    inst.install(str(root), opts())
    assert 'snapshotter = "native"' in conf.read_text()
    conf.write_text(conf.read_text() + "# a comment of the admin's\n")
    report = inst.uninstall(str(root))
    want = CONFIG.replace('snapshotter = "overlayfs"', 'snapshotter = "native"')
    assert conf.read_text() == want + "# a comment of the admin's\n"
    assert any("only vmpin's lines taken out" in ln for ln in report.lines)


def test_no_containerd_config_is_written_then_removed(root: Path) -> None:
    shutil.rmtree(root / "etc")
    before = snapshot(root)
    inst.install(str(root), opts(runtimes=("containerd",)))
    text = (root / "etc" / "containerd" / "config.toml").read_text()
    doc = tomllib.loads(text)
    runc = doc["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]["runc"]
    assert runc == {"runtime_type": "io.containerd.runc.v2",
                    "base_runtime_spec": "/opt/vmpin/containerd/base-runtime-spec-runc.json"}
    inst.uninstall(str(root))
    assert snapshot(root) == before


def test_a_foreign_base_spec_is_refused_before_anything_is_written(root: Path) -> None:
    conf = root / "etc" / "containerd" / "config.toml"
    conf.write_text(CONFIG.replace('base_runtime_spec = ""',
                                   'base_runtime_spec = "/etc/containerd/gpu-spec.json"'))
    before = snapshot(root)
    proc = cli("install", "--root", str(root), "--python", HOST_PYTHON, "--ctr", "none")
    assert proc.returncode == 2
    assert "handler runc already has base_runtime_spec '/etc/containerd/gpu-spec.json'" in (
        proc.stderr)
    assert proc.stderr.count("\n") == 1
    assert snapshot(root) == before


def test_symlinks_are_followed_inside_the_root(root: Path, tmp_path: Path) -> None:
    """An absolute symlink under ROOT means the host's path, as under chroot: never this
    machine's."""
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.rmtree(root / "opt")
    (root / "opt").symlink_to(outside)  # absolute: the host's <outside>, i.e. ROOT/<outside>
    inside = root / str(outside).lstrip("/")
    inside.mkdir(parents=True)
    before = snapshot(root)
    inst.install(str(root), opts(runtimes=("crio",)))
    assert os.listdir(outside) == []
    assert (inside / "vmpin" / "bin" / "vmpin-hook").is_file()
    inst.uninstall(str(root))
    assert snapshot(root) == before


def test_a_symlinked_config_is_refused(root: Path) -> None:
    conf = root / "etc" / "containerd" / "config.toml"
    (root / "etc" / "containerd" / "real.toml").write_text(CONFIG)
    conf.unlink()
    conf.symlink_to("real.toml")
    with pytest.raises(inst.InstallError, match="is a symlink"):
        inst.install(str(root), opts())


def test_the_hosts_python3_is_required(root: Path, tmp_path: Path) -> None:
    """By default the installer asks ROOT's python3 (under chroot): none there is an error,
    and so is one older than the hook needs (here: --python naming a fake 3.8)."""
    before = snapshot(root)
    proc = cli("install", "--root", str(root), "--ctr", "none")
    assert proc.returncode == 2
    assert "no python3 on the hooks' PATH under" in proc.stderr
    fake = tmp_path / "python3"
    fake.write_text(f'#!/bin/sh\nexec {HOST_PYTHON} -E -s -S -c "import sys\n'
                    'sys.version_info = (3, 8, 10)\n$5"\n')  # fmt: skip
    fake.chmod(0o755)
    proc = cli("install", "--root", str(root), "--ctr", "none", "--python", str(fake))
    assert proc.returncode == 2
    assert "is Python 3.8.10: the vmpin hook needs Python >= 3.10" in proc.stderr
    assert snapshot(root) == before


@pytest.mark.skipif(shutil.which("ctr") is None, reason="ctr (containerd) is not installed")
def test_base_specs_from_the_nodes_ctr(root: Path) -> None:
    out = subprocess.run(["ctr", "oci", "spec"], capture_output=True, text=True, check=True)
    inst.install(str(root), opts(ctr=["ctr"], env=()))
    spec = json.loads((root / "opt/vmpin/containerd/base-runtime-spec-runc.json").read_text())
    assert spec == hookconfig.base_spec(json.loads(out.stdout), "runc", HOOK,
                                        ["PATH=" + inst.HOOK_PATH])  # fmt: skip


def test_cli_defaults_are_the_installers() -> None:
    from vmpin.service.clispec import COMMANDS

    def default(command: str, key: str) -> Any:
        return next(o.default for o in COMMANDS[command].options if o.key == key)

    assert default("install", "prefix") == default("uninstall", "prefix") == inst.DEFAULT_PREFIX
    assert default("install", "runtime") == ",".join(inst.RUNTIMES)
    assert default("install", "hooks_dir") == inst.DEFAULT_HOOKS_DIR
    assert default("install", "containerd_config") == inst.DEFAULT_CONTAINERD_CONFIG


def test_strip_undoes_every_kind_of_edit() -> None:
    specs = {"runc": "/p/r.json", "kata": "/p/k.json"}
    text, _ = containerdconf.edit(CONFIG, specs, "c")
    assert containerdconf.strip(text) == CONFIG
