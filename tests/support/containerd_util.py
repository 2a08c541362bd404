"""A private containerd 1.6 with its CRI plugin, an image without a registry, and a CRI client.

- :func:`build_image` writes an OCI image layout tar (one layer: busybox-static and its applet
  symlinks; ``io.containerd.image.name`` in index.json, which ``ctr images import`` names the
  image by).  The same image is the pod's ``sandbox_image`` (its entrypoint is ``sleep``).
- :class:`Containerd` starts ``containerd --config F`` with root, state, gRPC/ttrpc sockets, and
  the runc handler's runc ``Root`` all under one scratch dir (so its runc state is found through
  a ``DIR/*`` runc root, as ``/run/containerd/runc/*`` is on a node) and
  ``restrict_oom_score_adj`` (no CAP_SYS_RESOURCE here).  It is stopped by the pid it started.
- :func:`cri_stubs` generates the ``runtime.v1`` stubs from ``cri/api.proto`` with grpcio-tools
  into a scratch dir and imports them.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from tests.support.runc_util import APPLETS, BUSYBOX, runc_binary

PROTO_DIR = Path(__file__).resolve().parent / "cri"
IMAGE = "docker.io/library/vmpin-test:1"


def missing() -> str | None:
    """Why containerd tests cannot run here, or None."""
    for tool in ("containerd", "ctr", "containerd-shim-runc-v2"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install containerd)"
    if runc_binary() is None or not os.access(BUSYBOX, os.X_OK):
        return "runc and busybox-static are needed"
    try:
        importlib.import_module("grpc")
        importlib.import_module("grpc_tools")
    except ImportError:
        return "grpcio and grpcio-tools are needed (pip install -e '.[test]')"
    if os.geteuid() != 0:
        return "containerd needs root"
    return None


# -- the image ------------------------------------------------------------------------------
def _blob(blobs: Path, data: bytes) -> tuple[str, int]:
    digest = hashlib.sha256(data).hexdigest()
    (blobs / digest).write_bytes(data)
    return f"sha256:{digest}", len(data)


def _layer() -> bytes:
    """One uncompressed tar layer: /bin/busybox and a symlink per applet."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for d in ("bin", "dev", "proc", "sys", "etc", "tmp"):
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        tar.add(BUSYBOX, arcname="bin/busybox")
        for applet in APPLETS:
            info = tarfile.TarInfo(f"bin/{applet}")
            info.type, info.linkname = tarfile.SYMTYPE, "busybox"
            tar.addfile(info)
    return buf.getvalue()


def build_image(dest: Path, name: str = IMAGE) -> Path:
    """An OCI image layout tar at ``dest`` for ``ctr images import``."""
    layout = dest.with_suffix(".d")
    blobs = layout / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    layer = _layer()
    layer_digest, layer_size = _blob(blobs, layer)
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Entrypoint": ["/bin/sleep"], "Cmd": ["3600"], "Env": ["PATH=/bin"]},
        "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
    }
    config_digest, config_size = _blob(blobs, json.dumps(config).encode())
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": config_digest,
            "size": config_size,
        },
        "layers": [
            {
                "mediaType": "application/vnd.oci.image.layer.v1.tar",
                "digest": layer_digest,
                "size": layer_size,
            }
        ],
    }
    manifest_digest, manifest_size = _blob(blobs, json.dumps(manifest).encode())
    index = {
        "schemaVersion": 2,
        "manifests": [
            {
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": manifest_digest,
                "size": manifest_size,
                "platform": {"architecture": "amd64", "os": "linux"},
                "annotations": {
                    "io.containerd.image.name": name,
                    "org.opencontainers.image.ref.name": name.rsplit(":", 1)[1],
                },
            }
        ],
    }
    (layout / "index.json").write_text(json.dumps(index))
    (layout / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
    with tarfile.open(dest, "w") as tar:
        for entry in sorted(layout.iterdir()):
            tar.add(entry, arcname=entry.name)
    shutil.rmtree(layout)
    return dest


# -- the daemon -----------------------------------------------------------------------------
class Containerd:
    """One private containerd; :meth:`stop` ends it (by pid) and removes what it made."""

    def __init__(
        self,
        work: Path,
        base_spec: Path | None,
        config: Path | None = None,
        wrap: Sequence[str] = (),
    ) -> None:
        """``base_spec`` None: the runc handler has none (an installer adds it to ``config``,
        default ``work/config.toml``); ``wrap`` is an argv prefix containerd runs under."""
        self.work = work
        self.root = work / "root"
        self.state = work / "state"
        self.runc_root = work / "runc"  # the runc handler's Root; namespaces below it
        self.address = str(work / "containerd.sock")
        self.config = config or work / "config.toml"
        self.log = work / "containerd.log"
        self.wrap = list(wrap)
        base_line = f'base_runtime_spec = "{base_spec}"' if base_spec else ""
        self.config.write_text(
            f"""version = 2
root = "{self.root}"
state = "{self.state}"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs",
  "io.containerd.internal.v1.tracing", "io.containerd.tracing.processor.v1.otlp"]
[grpc]
  address = "{self.address}"
[ttrpc]
  address = "{self.address}.ttrpc"
[debug]
  address = ""
[metrics]
  address = ""
[plugins."io.containerd.internal.v1.opt"]
  path = "{work / "opt"}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{IMAGE}"
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{work / "cni-bin"}"
    conf_dir = "{work / "cni-conf"}"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "native"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      {base_line}
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        Root = "{self.runc_root}"
        SystemdCgroup = false
"""
        )
        self.proc: subprocess.Popen[bytes] | None = None
        #: the shim's sockets go to /run/containerd/s whatever the config says (containerd
        #: 1.6 runtime/v2/shim/util_unix.go socketRoot): removed afterwards if we made it
        self._made = [d for d in ("/run/containerd", "/run/containerd/s") if not os.path.isdir(d)]

    def start(self, timeout: float = 30.0) -> Containerd:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [*self.wrap, "containerd", "--config", str(self.config)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"containerd exited:\n{self.log.read_text()[-3000:]}")
            if os.path.exists(self.address) and self.ctr("version", check=False).returncode == 0:
                return self
            time.sleep(0.1)
        raise RuntimeError(f"containerd did not come up:\n{self.log.read_text()[-3000:]}")

    def ctr(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            ["ctr", "--address", self.address, *args],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if check and proc.returncode != 0:
            raise RuntimeError(f"ctr {' '.join(args)}: {proc.stderr.strip()}")
        return proc

    def import_image(self, tar: Path) -> None:
        self.ctr("-n", "k8s.io", "images", "import", "--no-unpack", str(tar))
        listed = self.ctr("-n", "k8s.io", "images", "ls", "-q").stdout.split()
        assert IMAGE in listed, listed

    def stop(self) -> None:
        """SIGTERM the containerd this object started (its pid), SIGKILL if it lingers; shims
        of containers still running are killed by their pids from their bundles."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        tasks = self.state / "io.containerd.runtime.v2.task"
        for pidfile in tasks.glob("*/*/shim.pid"):
            with contextlib.suppress(ValueError, OSError):
                os.kill(int(pidfile.read_text().strip()), signal.SIGKILL)
        with contextlib.suppress(OSError):
            subprocess.run(["umount", "-R", str(self.state)], capture_output=True, check=False)
        for d in (self.state, self.root):
            if d.exists():
                # snapshot mounts are gone with the containers; "native" snapshots are dirs
                subprocess.run(["rm", "-rf", "--one-file-system", str(d)], check=False)
        for made in reversed(self._made):
            with contextlib.suppress(OSError):
                os.rmdir(made)  # only when empty: never another daemon's files


# -- the CRI client -------------------------------------------------------------------------
def cri_stubs(out: Path) -> tuple[ModuleType, ModuleType]:
    """(api_pb2, api_pb2_grpc) generated from cri/api.proto by grpcio-tools."""
    from grpc_tools import protoc

    out.mkdir(parents=True, exist_ok=True)
    rc = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{PROTO_DIR}",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            str(PROTO_DIR / "api.proto"),
        ]
    )
    if rc != 0:
        raise RuntimeError(f"protoc failed ({rc})")
    sys.path.insert(0, str(out))
    try:
        for name in ("api_pb2", "api_pb2_grpc"):
            sys.modules.pop(name, None)
        pb2 = importlib.import_module("api_pb2")
        grpc_mod = importlib.import_module("api_pb2_grpc")
    finally:
        sys.path.remove(str(out))
    return pb2, grpc_mod


class Cri:
    """A RuntimeService client over containerd's gRPC socket."""

    def __init__(self, address: str, out: Path) -> None:
        import grpc

        self.pb, grpc_mod = cri_stubs(out)
        self.channel = grpc.insecure_channel(f"unix://{address}")
        self.rt: Any = grpc_mod.RuntimeServiceStub(self.channel)

    def close(self) -> None:
        self.channel.close()
