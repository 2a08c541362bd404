"""A real Linux guest for tests: Debian's kernel, busybox and the host's python3, under QEMU.

The recipe (checked on this machine, ../shared/FACTS.md): ``apt-get download`` Debian's
``linux-image-6.1.0-*-amd64`` (the one ``linux-image-amd64`` depends on), extract only
``boot/vmlinuz-*`` and the modules a 9p share needs (drivers/virtio, net/9p, fs/9p,
fs/netfs, fs/fscache; ~9 MB); an initramfs of busybox-static, the host's ``python3.11`` with
the libraries it and its stdlib's extension modules link, its stdlib, and ``runc`` with
libseccomp.  Everything a test wants to run is passed in through 9p shares (``cache=none``:
host and guest see each other's writes at once), so the image does not change when tests do.

The image is cached under ``$VMPIN_TEST_CACHE`` (default ``/var/cache/vmpin-tests``) in a
directory named by a hash of its inputs (the recipe: init script, module list, builder code;
the kernel package's name and version; the copied binaries' sizes and mtimes): CI builds it
once per machine, in about 10 s.

The guest boots the way Kata boots its VM (``-name sandbox-<id>``, pidfile and ``qmp.sock``
in ``<vm dir>/<id>/``, through :func:`tests.support.qemu_util.launch`), under KVM only where
the host offers vmx/svm: on these machines ``/dev/kvm`` is a PVM device on which Debian's
kernel hangs early, so it runs under TCG (one host thread per vCPU, which
``query-cpus-fast`` reports, as under KVM).

:class:`Guest` runs commands inside through a small file-queue agent on a shared directory
(the guest has no network here): the host writes ``q/N.cmd``, the guest answers ``q/N.out``.
"""

from __future__ import annotations

import contextlib
import fcntl
import gzip
import hashlib
import inspect
import io
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import pytest

from tests.support import capabilities
from tests.support.qemu_util import QemuHandle, launch, wait_until

CACHE_ROOT = Path(os.environ.get("VMPIN_TEST_CACHE", "/var/cache/vmpin-tests"))
#: modules for virtio-pci and 9p, in load order (busybox insmod resolves no dependencies).
MODULES = (
    "drivers/virtio/virtio_ring",
    "drivers/virtio/virtio",
    "drivers/virtio/virtio_pci_modern_dev",
    "drivers/virtio/virtio_pci_legacy_dev",
    "drivers/virtio/virtio_pci",
    "fs/netfs/netfs",
    "fs/fscache/fscache",
    "net/9p/9pnet",
    "net/9p/9pnet_virtio",
    "fs/9p/9p",
)
PYTHON = "/usr/bin/python3.11"
STDLIB = "/usr/lib/python3.11"
#: stdlib parts no test needs (tests, GUI, packaging): a smaller initramfs boots faster.
STDLIB_SKIP = {"test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "pydoc_data",
               "config-3.11-x86_64-linux-gnu", "__pycache__-skip"}
BINARIES = ("/bin/busybox", "/usr/sbin/runc")
#: libraries that manylinux wheels shared in from the host's venv load (pydantic_core, psutil:
#: ``ldd`` on their .so files), beyond what python3 itself links.
EXTRA_LIBS = tuple(f"/lib/x86_64-linux-gnu/{lib}" for lib in (
    "libgcc_s.so.1", "librt.so.1", "libdl.so.2", "libpthread.so.0"))
#: where Kata shows the sandbox's shared directory inside the guest (vmpin.wire.guestmap).
KATA_SHARED = "/run/kata-containers/shared/containers"

INIT = r"""#!/bin/sh
export PATH=/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs dev /dev
mkdir -p /dev/pts /dev/shm && mount -t devpts devpts /dev/pts
mount -t tmpfs tmpfs /run
mount -t tmpfs tmpfs /tmp
for m in __MODULES__; do insmod /lib/modules/$m.ko || echo "init: insmod $m failed"; done
# Shares named on the kernel command line: vmpin.share=TAG:GUEST_PATH
for arg in $(cat /proc/cmdline); do
  case "$arg" in
    vmpin.share=*)
      v="${arg#vmpin.share=}"; tag="${v%%:*}"; dir="${v#*:}"
      mkdir -p "$dir"
      mount -t 9p -o trans=virtio,version=9p2000.L,cache=none,msize=262144 "$tag" "$dir" \
        || echo "init: mount $tag at $dir failed"
      ;;
  esac
done
echo "init: up"
[ -x /mnt/ctl/run ] && /mnt/ctl/run
poweroff -f
"""

#: the guest half of :class:`Guest`: runs queued commands, answers each in a file.
AGENT = r'''
import json, os, subprocess, sys, tempfile, time
Q = "/mnt/ctl/q"
done = set()
open("/mnt/ctl/ready", "w").close()
while not os.path.exists("/mnt/ctl/stop"):
    names = sorted(n for n in os.listdir(Q) if n.endswith(".cmd") and n not in done)
    if not names:
        time.sleep(0.1)  # what an idle guest costs its vCPU threads (measured by the proof)
        continue
    for name in names:
        done.add(name)
        with open(os.path.join(Q, name)) as f:
            cmd = json.load(f)
        env = dict(os.environ, **cmd.get("env", {}))
        try:
            if cmd.get("background"):
                p = subprocess.Popen(cmd["argv"], env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                out = {"rc": 0, "pid": p.pid, "stdout": "", "stderr": ""}
            else:
                # Output through files, not pipes: a detached child (runc's container init)
                # inherits them and would hold a pipe open forever.
                with tempfile.TemporaryFile() as o, tempfile.TemporaryFile() as e:
                    p = subprocess.run(cmd["argv"], env=env, input=cmd.get("stdin", "").encode(),
                                       stdout=o, stderr=e, timeout=cmd.get("timeout", 60))
                    o.seek(0)
                    e.seek(0)
                    out = {"rc": p.returncode, "stdout": o.read().decode(errors="replace"),
                           "stderr": e.read().decode(errors="replace")}
        except Exception as err:
            out = {"rc": 127, "stdout": "", "stderr": f"agent: {type(err).__name__}: {err}"}
        tmp = os.path.join(Q, name[:-4] + ".tmp")
        with open(tmp, "w") as f:
            json.dump(out, f)
        os.rename(tmp, os.path.join(Q, name[:-4] + ".out"))
'''


@dataclass(frozen=True)
class Image:
    kernel: Path
    initrd: Path
    key: str


def missing() -> str | None:
    """Why a guest cannot be built here, None when it can."""
    for tool in ("qemu-system-x86_64", "apt-get", "apt-cache", "dpkg-deb"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    for path in (PYTHON, STDLIB, *BINARIES):
        if not os.path.exists(path):
            return f"{path} is missing (python3.11, busybox-static, runc)"
    return None


def kernel_package() -> tuple[str, str]:
    """(name, version) of the kernel Debian's ``linux-image-amd64`` depends on."""
    out = subprocess.run(["apt-cache", "show", "--no-all-versions", "linux-image-amd64"],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    for line in out.splitlines():
        if line.startswith("Depends:"):
            dep = line.split(":", 1)[1].split(",")[0].strip()  # "linux-image-X (= V)"
            name, _, ver = dep.partition(" ")
            return name, ver.strip("(= )")
    raise RuntimeError("linux-image-amd64 has no Depends line in apt-cache")


def _ldd(path: str) -> list[str]:
    """The shared libraries ``path`` loads, as absolute paths (ldd's ``=>`` column)."""
    out = subprocess.run(["ldd", path], capture_output=True, text=True, check=False).stdout
    libs = []
    for line in out.splitlines():
        parts = line.split()
        if "=>" in parts and len(parts) >= 3 and parts[2].startswith("/"):
            libs.append(parts[2])
        elif parts and parts[0].startswith("/"):
            libs.append(parts[0])  # the dynamic loader itself
    return libs


def _inputs() -> list[str]:
    """Everything the image is made of, for its cache key."""
    recipe = [INIT, repr(MODULES), repr(sorted(STDLIB_SKIP)), repr(EXTRA_LIBS),
              inspect.getsource(_build), inspect.getsource(_Cpio)]
    items = [*recipe, "|".join(kernel_package())]
    for path in (PYTHON, *BINARIES):
        st = os.stat(path)
        items.append(f"{path}:{st.st_size}:{st.st_mtime_ns}")
    items.append(f"{STDLIB}:{os.stat(STDLIB).st_mtime_ns}")
    return items


def cache_key() -> str:
    return hashlib.sha256("\n".join(_inputs()).encode()).hexdigest()[:16]


class _Cpio:
    """A ``newc`` cpio archive, the format the kernel unpacks as an initramfs."""

    def __init__(self) -> None:
        self.buf = io.BytesIO()
        self.ino = 1

    def add(self, name: str, mode: int, data: bytes = b"") -> None:
        fields = [self.ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(name) + 1, 0]
        head = b"070701" + b"".join(b"%08x" % v for v in fields)
        self.ino += 1
        self.buf.write(head + name.encode() + b"\0")
        self.buf.write(b"\0" * (-(len(head) + len(name) + 1) % 4))
        self.buf.write(data)
        self.buf.write(b"\0" * (-len(data) % 4))

    def tree(self, src: Path, dest: str) -> None:
        """``src`` (a file, link or directory) at ``dest`` in the archive, recursively."""
        st = src.lstat()
        if stat.S_ISLNK(st.st_mode):
            self.add(dest, stat.S_IFLNK | 0o777, os.readlink(src).encode())
        elif stat.S_ISDIR(st.st_mode):
            self.add(dest, stat.S_IFDIR | 0o755)
            for child in sorted(src.iterdir()):
                if child.name not in STDLIB_SKIP:
                    self.tree(child, f"{dest}/{child.name}")
        elif stat.S_ISREG(st.st_mode):
            self.add(dest, stat.S_IFREG | (st.st_mode & 0o777), src.read_bytes())

    def close(self) -> bytes:
        self.add("TRAILER!!!", 0)
        return self.buf.getvalue()


def _build(dest: Path) -> None:
    name, _ = kernel_package()
    with tempfile.TemporaryDirectory(prefix="vmpin-guest-build-") as tmp:
        subprocess.run(["apt-get", "download", "-q", name], cwd=tmp, check=True,
                       capture_output=True, timeout=600)
        deb = next(Path(tmp).glob("*.deb"))
        x = Path(tmp) / "x"
        x.mkdir()
        tar = subprocess.run(["dpkg-deb", "--fsys-tarfile", str(deb)], check=True,
                             capture_output=True, timeout=300).stdout
        wanted = ["./boot/vmlinuz-*"] + [f"./lib/modules/*/kernel/{m}.ko" for m in MODULES]
        subprocess.run(["tar", "-x", "-C", str(x), "--wildcards", *wanted], input=tar,
                       check=True, capture_output=True, timeout=300)
        shutil.copy(next((x / "boot").glob("vmlinuz-*")), dest / "vmlinuz")

        cpio = _Cpio()
        for d in ("bin", "sbin", "usr", "usr/bin", "usr/sbin", "usr/lib", "lib", "lib64",
                  "lib/modules", "etc", "proc", "sys", "dev", "run", "tmp", "mnt", "root",
                  "var", "lib/x86_64-linux-gnu", "usr/lib/x86_64-linux-gnu"):
            cpio.add(d, stat.S_IFDIR | 0o755)
        cpio.add("init", stat.S_IFREG | 0o755,
                 INIT.replace("__MODULES__", " ".join(m.rsplit("/", 1)[1] for m in MODULES))
                 .encode())
        cpio.add("etc/passwd", stat.S_IFREG | 0o644, b"root:x:0:0:root:/root:/bin/sh\n")
        cpio.add("etc/group", stat.S_IFREG | 0o644, b"root:x:0:\n")
        for m in MODULES:
            ko = next((x / "lib/modules").glob(f"*/kernel/{m}.ko"))
            cpio.add(f"lib/modules/{ko.name}", stat.S_IFREG | 0o644, ko.read_bytes())
        cpio.add("bin/busybox", stat.S_IFREG | 0o755, Path("/bin/busybox").read_bytes())
        applets = subprocess.run(["/bin/busybox", "--list-full"], capture_output=True,
                                 text=True, check=True).stdout.split()
        for applet in applets:
            if applet != "bin/busybox" and "/" in applet:
                cpio.add(applet, stat.S_IFLNK | 0o777, b"/bin/busybox")
        libs: set[str] = set()
        for exe in (PYTHON, "/usr/sbin/runc"):
            libs.update(_ldd(exe))
        for so in Path(STDLIB, "lib-dynload").glob("*.so"):
            libs.update(_ldd(str(so)))
        libs.update(lib for lib in EXTRA_LIBS if os.path.exists(lib))
        for lib in sorted(libs):
            cpio.add(lib.lstrip("/"), stat.S_IFREG | 0o755, Path(lib).read_bytes())
        cpio.add(PYTHON.lstrip("/"), stat.S_IFREG | 0o755, Path(PYTHON).read_bytes())
        cpio.add("usr/bin/python3", stat.S_IFLNK | 0o777, b"python3.11")
        cpio.add("usr/sbin/runc", stat.S_IFREG | 0o755, Path("/usr/sbin/runc").read_bytes())
        cpio.tree(Path(STDLIB), STDLIB.lstrip("/"))
        (dest / "initrd.gz").write_bytes(gzip.compress(cpio.close(), compresslevel=1))


def image() -> Image:
    """The cached image, built first when missing (one builder at a time: flock)."""
    why = missing()
    if why:
        pytest.skip(f"no guest image: {why}")
    key = cache_key()
    final = CACHE_ROOT / key
    if not (final / "initrd.gz").exists():
        CACHE_ROOT.mkdir(parents=True, exist_ok=True)
        with open(CACHE_ROOT / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (final / "initrd.gz").exists():
                part = Path(tempfile.mkdtemp(prefix=f"{key}.", dir=CACHE_ROOT))
                try:
                    _build(part)
                    os.replace(part, final)
                finally:
                    shutil.rmtree(part, ignore_errors=True)
    return Image(final / "vmlinuz", final / "initrd.gz", key)


def _requirements(dist: str) -> set[str]:
    """``dist`` and every distribution it needs here (markers evaluated, extras left out)."""
    from packaging.requirements import Requirement

    seen: set[str] = set()
    todo = [dist]
    while todo:
        name = todo.pop()
        key = name.lower().replace("_", "-")
        if key in seen:
            continue
        seen.add(key)
        try:
            reqs = metadata.distribution(name).requires or []
        except metadata.PackageNotFoundError:
            continue
        for text in reqs:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def python_libs(dest: Path, repo: Path) -> Path:
    """A tar of vmpin (from ``repo``) and the installed distributions its CLI needs.

    The guest unpacks it onto its tmpfs: importing typer and pydantic file by file over a
    ``cache=none`` 9p share costs seconds per command under TCG.
    """
    import tarfile

    with tarfile.open(dest, "w") as tar:
        tar.add(repo / "vmpin", "vmpin",
                filter=lambda t: None if t.name.endswith((".tmp", ".swp")) else t)
        # pygments (700 files) only colours tracebacks: vmpin's commands never import it, and
        # every file costs time to unpack under TCG.
        for name in sorted(_requirements("vmpin") - {"vmpin", "pygments"}):
            try:
                dist = metadata.distribution(name)
            except metadata.PackageNotFoundError:
                continue
            for f in dist.files or []:
                src = Path(str(dist.locate_file(f)))
                if src.is_file() and not str(f).startswith(".."):
                    tar.add(src, str(f), recursive=False)
    return dest


class GuestError(AssertionError):
    pass


@dataclass
class Guest:
    """A booted guest: its QEMU (a Kata-like sandbox VMM) and the agent's queue."""

    qemu: QemuHandle
    ctl: Path
    console: Path
    seq: int = 0
    #: (seconds, command) of every run, for a test's report.
    log: list[tuple[float, str]] = field(default_factory=list)

    def _send(self, cmd: Mapping[str, object], timeout: float) -> dict[str, object]:
        self.seq += 1
        q = self.ctl / "q"
        tmp = q / f"{self.seq:05d}.new"
        tmp.write_text(json.dumps(cmd))
        tmp.rename(q / f"{self.seq:05d}.cmd")
        out = q / f"{self.seq:05d}.out"
        if not wait_until(out.exists, timeout, 0.05):
            raise GuestError(f"guest did not answer {cmd.get('argv')} in {timeout} s\n"
                             f"console:\n{self.console_tail()}")
        result: dict[str, object] = json.loads(out.read_text())
        return result

    def run(self, argv: Sequence[str], *, stdin: str = "", env: Mapping[str, str] | None = None,
            timeout: float = 90, check: bool = True) -> dict[str, object]:
        """Run ``argv`` in the guest; {rc, stdout, stderr}."""
        t0 = time.monotonic()
        res = self._send({"argv": list(argv), "stdin": stdin, "env": dict(env or {}),
                          "timeout": timeout}, timeout + 10)
        self.log.append((round(time.monotonic() - t0, 2), " ".join(argv)[:100]))
        if check and res["rc"] != 0:
            raise GuestError(f"guest: {' '.join(argv)} -> {res['rc']}\n"
                             f"{res['stdout']}\n{res['stderr']}")
        return res

    def spawn(self, argv: Sequence[str]) -> int:
        """Start ``argv`` in the guest in the background; its pid there."""
        res = self._send({"argv": list(argv), "background": True}, 30)
        pid = res.get("pid")
        assert isinstance(pid, int), res
        return pid

    def console_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.console.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no console log)"


@contextlib.contextmanager
def boot(vm_dir: Path, sandbox_id: str, workdir: Path, shares: Mapping[str, Path],
         smp: int = 2, memory: int = 512, ready_timeout: float = 120) -> Iterator[Guest]:
    """Boot the image as sandbox ``sandbox_id``; ``shares`` maps guest paths to host dirs.

    The QEMU is killed by the pid it wrote (and its start time) on the way out.
    """
    img = image()
    ctl = workdir / "ctl"
    (ctl / "q").mkdir(parents=True)
    (ctl / "agent.py").write_text(AGENT)
    run = ctl / "run"
    run.write_text("#!/bin/sh\nexec python3 /mnt/ctl/agent.py\n")
    run.chmod(0o755)
    all_shares = {"/mnt/ctl": ctl, **shares}
    extra: list[str] = ["-kernel", str(img.kernel), "-initrd", str(img.initrd)]
    cmdline = ["console=ttyS0", "panic=-1", "quiet"]
    for n, (guest_path, host_dir) in enumerate(all_shares.items()):
        tag = f"share{n}"
        extra += ["-virtfs", f"local,path={host_dir},mount_tag={tag},security_model=none"]
        cmdline.append(f"vmpin.share={tag}:{guest_path}")
    console = workdir / "console.log"
    extra += ["-append", " ".join(cmdline), "-serial", f"file:{console}", "-no-reboot"]
    accel = capabilities.linux_guest_accel()
    q = launch(vm_dir, sandbox_id, smp=smp, accel=accel, iothreads=("io0",), memory=memory,
               extra=extra)
    guest = Guest(q, ctl, console)
    try:
        start = time.monotonic()
        if not wait_until((ctl / "ready").exists, ready_timeout, 0.1):
            raise GuestError(f"guest not ready after {ready_timeout} s "
                             f"({accel}); console:\n{guest.console_tail()}")
        guest.boot_seconds = time.monotonic() - start  # type: ignore[attr-defined]
        yield guest
    finally:
        with contextlib.suppress(OSError):
            (ctl / "stop").touch()
        q.kill()


if __name__ == "__main__":
    # python -m tests.support.guest_image: build (or find) the cached image, print its paths.
    i = image()
    print(i.kernel, i.initrd, file=sys.stdout)
