"""``vmpin install`` / ``vmpin uninstall``: vmpin's hook onto a node's root, and off it again.

The way kata-deploy puts Kata on a node: from the node itself (``--root /``) or from an init
container that has the node's root mounted (``--root /host``).  What it writes, as the host
sees it (``PREFIX`` is ``/opt/vmpin`` unless told otherwise)::

    PREFIX/bin/vmpin-hook                       the hook, one file (vmpin.service.hookfile)
    PREFIX/containerd/base-runtime-spec-*.json  containerd: runc's and Kata's base specs
    /etc/containerd/config.toml                 containerd: base_runtime_spec per handler,
                                                edited in place (vmpin.runtimes.containerdconf)
    /usr/share/containers/oci/hooks.d/vmpin-*.json   CRI-O and podman (both read it: CRI-O's
                                                default hooks_dir, podman's default for root)
    PREFIX/install-manifest.json                every path above, the content it replaced

Every path and every document names host paths (``/opt/vmpin/bin/vmpin-hook``), never the
installer's view of them (``/host/opt/...``); paths under ROOT are resolved as the host would
resolve them (a symlink's absolute target is taken inside ROOT, as chroot would).

The manifest is the whole truth of an install: ``uninstall`` removes exactly the files it
lists and puts back the bytes, mode and owner each replaced one had (a file changed since
vmpin wrote it is left alone and named, except containerd's config, whose lines vmpin added
are taken out again); directories vmpin made go when empty.  A root without a manifest is an
error, never a guess.  Installing again over a manifest starts from what the manifest says was
there before, so a re-install leaves the tree byte for byte as the first one did, and one
with fewer ``--runtime`` s undoes what is no longer wanted.

The host's own programs are asked where they know better than the packaged defaults: its
``python3`` compiles the hook's bytecode (and is refused when older than the hook needs), its
``ctr oci spec`` is the base specs' starting point; each is run under ``chroot ROOT`` unless
ROOT is ``/``.  Not on any hook path (it imports json, subprocess, typing...).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

from vmpin.core.errors import VmpinError
from vmpin.runtimes import containerdconf, hookconfig
from vmpin.service import hookfile

RUNTIMES = ("containerd", "crio", "podman")
DEFAULT_PREFIX = "/opt/vmpin"
#: CRI-O's default hooks_dir (crio.conf) and the first of podman's two defaults for root
#: (/etc/containers/oci/hooks.d, its other one, masks same-named files here)
DEFAULT_HOOKS_DIR = "/usr/share/containers/oci/hooks.d"
DEFAULT_CONTAINERD_CONFIG = "/etc/containerd/config.toml"
MANIFEST = "install-manifest.json"
MANIFEST_VERSION = 1
#: the manifest keeps what config.toml held, which may be secret (registry credentials; a
#: config.toml of mode 0600): root's eyes only
MANIFEST_MODE = 0o600
HOOK = "bin/vmpin-hook"
#: the PATH every hook runs with (and where the installer looks for the host's python3)
HOOK_PATH = hookconfig.DEFAULT_ENV[0].split("=", 1)[1]


class InstallError(VmpinError):
    """An install or uninstall that cannot go on; nothing more is written."""


@dataclass
class Report:
    """What an install or uninstall did, line by line, for the CLI to print."""

    lines: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def say(self, line: str) -> None:
        self.lines.append(line)

    def warn(self, line: str) -> None:
        self.warnings.append(line)


# -- paths under ROOT -------------------------------------------------------------------------
class HostRoot:
    """The host's file tree, seen at ``root`` by this process."""

    def __init__(self, root: str) -> None:
        if not os.path.isdir(root):
            raise InstallError(f"--root {root}: not a directory")
        self.root = os.path.abspath(root)
        self.is_slash = os.path.realpath(self.root) == "/"

    def path(self, host_path: str, follow: bool = False) -> str:
        """Where this process finds ``host_path`` (absolute, as the host names it): every
        directory symlink on the way is followed inside ROOT; the last component only with
        ``follow``."""
        if not os.path.isabs(host_path):
            raise InstallError(f"{host_path}: not an absolute path")
        parts = [p for p in host_path.split("/") if p not in ("", ".")]
        resolved: list[str] = []
        hops = 0
        while parts:
            part = parts.pop(0)
            if part == "..":
                if resolved:
                    resolved.pop()
                continue
            here = os.path.join(self.root, *resolved, part)
            if (parts or follow) and os.path.islink(here):
                hops += 1
                if hops > 40:
                    raise InstallError(f"{host_path}: too many symlinks under {self.root}")
                target = os.readlink(here)
                if os.path.isabs(target):
                    resolved = []
                parts = [p for p in target.split("/") if p not in ("", ".")] + parts
                continue
            resolved.append(part)
        return os.path.join(self.root, *resolved)

    def argv(self, argv: list[str]) -> list[str]:
        """``argv`` as run on the host: under chroot unless ROOT is this process's /."""
        if self.is_slash:
            return argv
        return [shutil.which("chroot") or "/usr/sbin/chroot", self.root, *argv]

    def find_program(self, name: str) -> str | None:
        """``name`` on the hooks' PATH on the host (a host path), if there is one."""
        for d in HOOK_PATH.split(":"):
            if os.path.lexists(self.path(f"{d}/{name}")):
                return f"{d}/{name}"
        return None


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None
    except IsADirectoryError as err:
        raise InstallError(f"{path}: is a directory") from err


def _write(path: str, data: bytes, mode: int, owner: tuple[int, int] | None = None) -> None:
    """Replace ``path`` whole (a reader sees the old file or the new one, never half)."""
    tmp = f"{path}.vmpin-{os.getpid()}.tmp"
    # created for root's eyes only, opened up (chmod) once whole: never briefly readable
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, mode)
    if owner is not None and os.geteuid() == 0:
        os.chown(tmp, *owner)
    os.replace(tmp, path)


def _previous(path: str) -> dict[str, Any] | None:
    """What a file we are about to replace was (content, mode, owner), or None."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        raise InstallError(f"{path}: is a symlink; vmpin writes no file through one")
    if not stat.S_ISREG(st.st_mode):
        raise InstallError(f"{path}: not a regular file")
    data = _read(path) or b""
    prev: dict[str, Any] = {"mode": f"{stat.S_IMODE(st.st_mode):04o}", "uid": st.st_uid,
                            "gid": st.st_gid}  # fmt: skip
    try:
        prev["text"] = data.decode("utf-8")
    except UnicodeDecodeError:
        prev["base64"] = base64.b64encode(data).decode()
    return prev


def _previous_bytes(prev: dict[str, Any]) -> bytes:
    if "text" in prev:
        return str(prev["text"]).encode("utf-8")
    return base64.b64decode(prev["base64"])


# -- the manifest -----------------------------------------------------------------------------
def manifest_path(host: HostRoot, prefix: str) -> str:
    return host.path(f"{prefix}/{MANIFEST}")


def read_manifest(host: HostRoot, prefix: str) -> dict[str, Any] | None:
    path = manifest_path(host, prefix)
    data = _read(path)
    if data is None:
        return None
    try:
        doc = json.loads(data)
        if doc.get("version") != MANIFEST_VERSION or not isinstance(doc.get("files"), dict):
            raise ValueError("not a vmpin install manifest of version 1")
    except (ValueError, AttributeError) as err:
        raise InstallError(f"{path}: unreadable ({err}); nothing was changed") from err
    manifest: dict[str, Any] = doc
    return manifest


def _dump_manifest(doc: dict[str, Any]) -> bytes:
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()


# -- what to write ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Options:
    prefix: str = DEFAULT_PREFIX
    runtimes: tuple[str, ...] = RUNTIMES
    #: hook environment beyond PATH (K=V), e.g. VMPIN_STATE_DIR=/run/vmpin
    env: tuple[str, ...] = ()
    hooks_dir: str = DEFAULT_HOOKS_DIR
    containerd_config: str = DEFAULT_CONTAINERD_CONFIG
    #: how to run the host's python3 / ctr: None = find it on ROOT (chroot), [] = do not
    python: list[str] | None = None
    ctr: list[str] | None = None

    def check(self) -> Options:
        for p in (self.prefix, self.hooks_dir, self.containerd_config):
            if not os.path.isabs(p) or p.rstrip("/") == "":
                raise InstallError(f"{p!r}: expected an absolute path other than /")
        unknown = set(self.runtimes) - set(RUNTIMES)
        if unknown or not self.runtimes:
            raise InstallError(f"--runtime {','.join(self.runtimes)}: choose from"
                               f" {','.join(RUNTIMES)}")  # fmt: skip
        for e in self.env:
            key, eq, _ = e.partition("=")
            if not eq or not key or not (key.replace("_", "a").isalnum() and key.isascii()):
                raise InstallError(f"--env {e!r}: expected NAME=VALUE")
        return self

    def hook_env(self) -> list[str]:
        given = dict(e.split("=", 1) for e in self.env)
        env = [f"PATH={given.pop('PATH', HOOK_PATH)}"]
        return env + [f"{k}={v}" for k, v in given.items()]

    @property
    def hook(self) -> str:
        return f"{self.prefix.rstrip('/')}/{HOOK}"

    def spec(self, kind: str) -> str:
        return f"{self.prefix.rstrip('/')}/containerd/base-runtime-spec-{kind}.json"


def _bytecode(host: HostRoot, opts: Options, srcs: dict[str, bytes], report: Report
              ) -> hookfile.Bytecode:  # fmt: skip
    """The hook's bytecode, compiled by the host's python3 where the installer can run it."""
    here = [sys.executable]
    if opts.python == []:
        report.warn("--python none: the hook's bytecode is this installer's Python's; a host"
                    " python3 of another version compiles every module at every hook")
        return hookfile.compile_with(here, srcs, opts.hook)
    if opts.python is not None:
        try:
            return hookfile.compile_with(opts.python, srcs, opts.hook)
        except hookfile.HookFileError as err:
            raise InstallError(f"--python: {err}") from err
    found = host.find_program("python3")
    if found is None:
        raise InstallError(
            f"no python3 on the hooks' PATH under {host.root} ({HOOK_PATH}): the vmpin hook"
            f" needs Python >= {'.'.join(map(str, hookfile.REQUIRES_PYTHON))} on the host"
            " (--python none installs anyway; the hook then only says so at every start)"
        )
    try:
        return hookfile.compile_with(host.argv([found]), srcs, opts.hook)
    except hookfile.HookFileError as err:
        if "needs Python" in str(err):
            raise InstallError(f"the host's {err}") from err
        report.warn(f"could not run the host's {found} ({err}): the hook's bytecode is this"
                    " installer's Python's")  # fmt: skip
        return hookfile.compile_with(here, srcs, opts.hook)


def _default_spec(host: HostRoot, opts: Options, report: Report) -> dict[str, Any]:
    """containerd's default spec: the node's ``ctr oci spec`` when it answers, else packaged."""
    argv = opts.ctr
    if argv is None:
        found = host.find_program("ctr")
        argv = host.argv([found]) if found else []
    if argv:
        try:
            out = subprocess.run([*argv, "oci", "spec"], capture_output=True, text=True,
                                 timeout=60, check=True, stdin=subprocess.DEVNULL)  # fmt: skip
            spec: dict[str, Any] = json.loads(out.stdout)
            report.say(f"containerd's default spec: {' '.join(argv)} oci spec")
            return spec
        except (OSError, ValueError, subprocess.SubprocessError) as err:
            if opts.ctr is not None:
                raise InstallError(f"--ctr: {' '.join(argv)} oci spec: {err}") from err
            report.warn(f"{' '.join(argv)} oci spec: {err}")
    report.say(f"containerd's default spec: the packaged one ({hookconfig.PACKAGED_DEFAULT_FROM})")
    return hookconfig.packaged_default()


@dataclass(frozen=True)
class Planned:
    """One file of the install: its content and mode, and what was there before vmpin."""

    role: str  # hook, hooks.d, base-spec, containerd-config
    data: bytes
    mode: int
    previous: dict[str, Any] | None


def _plan(host: HostRoot, opts: Options, old_files: dict[str, Any], report: Report
          ) -> dict[str, Planned]:  # fmt: skip
    """Every file the install consists of, by host path."""

    def before(hpath: str) -> dict[str, Any] | None:
        rec = old_files.get(hpath)
        return _previous(host.path(hpath)) if rec is None else rec.get("previous")

    plan: dict[str, Planned] = {}
    srcs = hookfile.sources()
    bytecode = _bytecode(host, opts, srcs, report)
    hook_at = host.path(opts.hook)
    if hookfile.file_digest(hook_at) == hookfile.digest(srcs, bytecode, opts.hook):
        data = _read(hook_at) or b""  # made of the same: kept byte for byte
    else:
        data = hookfile.build(srcs, bytecode, opts.hook)
    report.say(f"{opts.hook}: bytecode for {bytecode.python} (Python {bytecode.version_text})")
    plan[opts.hook] = Planned("hook", data, 0o755, before(opts.hook))
    env = opts.hook_env()
    if {"crio", "podman"} & set(opts.runtimes):
        for name, doc in hookconfig.hooks_d(opts.hook, env).items():
            hpath = f"{opts.hooks_dir.rstrip('/')}/{name}"
            plan[hpath] = Planned("hooks.d", hookconfig.dump(doc).encode(), 0o644, before(hpath))
    if "containerd" in opts.runtimes:
        default = _default_spec(host, opts, report)
        for kind in hookconfig.CREATE_STAGE:
            spec = hookconfig.base_spec(default, kind, opts.hook, env)
            hpath = opts.spec(kind)
            plan[hpath] = Planned("base-spec", hookconfig.dump(spec).encode(), 0o644,
                                  before(hpath))  # fmt: skip
        conf = opts.containerd_config
        prev = _config_before(host, conf, old_files.get(conf), report)
        text, notes = containerdconf.edit(
            None if prev is None else _previous_bytes(prev).decode("utf-8"),
            {kind: opts.spec(kind) for kind in hookconfig.CREATE_STAGE},
            conf,
        )
        for note in notes:
            report.say(note)
        mode = int(prev["mode"], 8) if prev else 0o644
        plan[conf] = Planned("containerd-config", text.encode("utf-8"), mode, prev)
    return plan


def _config_before(host: HostRoot, conf: str, record: dict[str, Any] | None, report: Report
                   ) -> dict[str, Any] | None:  # fmt: skip
    """containerd's config as it was before vmpin: what the manifest kept, while vmpin's edit
    is still what is there; else what is there, without the lines vmpin added."""
    real = host.path(conf)
    current = _read(real)
    if record is not None and current is not None and _sha(current) == record.get("sha256"):
        prev: dict[str, Any] | None = record.get("previous")
        return prev
    prev = _previous(real)
    if record is not None and prev is not None:
        report.say(f"{conf}: changed since vmpin install wrote it: starting from it, without"
                   " vmpin's lines")  # fmt: skip
        prev.pop("base64", None)
        prev["text"] = containerdconf.strip((current or b"").decode("utf-8"))
    return prev


def _stat(path: str) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


# -- install / uninstall ----------------------------------------------------------------------
def install(root: str, opts: Options | None = None) -> Report:
    """Install (or install again) vmpin's hook under ``root``; see the module's docstring."""
    opts = (opts or Options()).check()
    host = HostRoot(root)
    report = Report()
    old = read_manifest(host, opts.prefix) or {}
    old_files: dict[str, Any] = old.get("files", {})
    plan = _plan(host, opts, old_files, report)  # (writes nothing: errors stop here)
    made_dirs = [d for d in old.get("dirs", []) if os.path.isdir(host.path(d, follow=True))]
    files: dict[str, Any] = {}
    for hpath, p in sorted(plan.items()):
        real = host.path(hpath)
        for d in _missing_dirs(host, os.path.dirname(hpath)):
            os.mkdir(host.path(d), 0o755)
            made_dirs.append(d)
        st = _stat(real)
        if _read(real) != p.data or st is None or stat.S_IMODE(st.st_mode) != p.mode:
            owner = (p.previous["uid"], p.previous["gid"]) if p.previous else None
            _write(real, p.data, p.mode, owner)
            report.say(f"{hpath}: {'written' if p.previous is None else 'replaced'}")
        files[hpath] = {"role": p.role, "sha256": _sha(p.data), "mode": f"{p.mode:04o}",
                        "previous": p.previous}  # fmt: skip
    # what the last install wrote and this one does not want: undone
    for hpath in sorted(set(old_files) - set(plan)):
        _undo(host, hpath, old_files[hpath], report)
    manifest = {
        "version": MANIFEST_VERSION,
        "prefix": opts.prefix,
        "runtimes": sorted(opts.runtimes),
        "dirs": sorted(set(made_dirs)),
        "files": files,
    }
    mpath = manifest_path(host, opts.prefix)
    data = _dump_manifest(manifest)
    if _read(mpath) != data or stat.S_IMODE(os.lstat(mpath).st_mode) != MANIFEST_MODE:
        _write(mpath, data, MANIFEST_MODE)
    if "containerd" in opts.runtimes:
        report.say("restart containerd to load its new config (running containers keep running)")
    return report


def _missing_dirs(host: HostRoot, hdir: str) -> list[str]:
    """The directories of ``hdir`` (a host path) that do not exist yet, outermost first."""
    out: list[str] = []
    while hdir not in ("/", "") and not os.path.isdir(host.path(hdir, follow=True)):
        out.append(hdir)
        hdir = os.path.dirname(hdir)
    return out[::-1]


def _undo(host: HostRoot, hpath: str, rec: dict[str, Any], report: Report) -> None:
    """Put back what was at ``hpath`` before vmpin wrote it (or take it away)."""
    real = host.path(hpath)
    current = _read(real)
    prev = rec.get("previous")
    if current is not None and _sha(current) != rec.get("sha256"):
        if rec.get("role") == "containerd-config":
            text = containerdconf.strip(current.decode("utf-8"))
            st = os.lstat(real)
            _write(real, text.encode("utf-8"), stat.S_IMODE(st.st_mode), (st.st_uid, st.st_gid))
            report.say(f"{hpath}: changed since vmpin install: only vmpin's lines taken out")
        else:
            report.warn(f"{hpath}: changed since vmpin install wrote it: left as it is")
        return
    if prev is None:
        if current is not None:
            os.unlink(real)
            report.say(f"{hpath}: removed")
        return
    _write(real, _previous_bytes(prev), int(prev["mode"], 8), (prev["uid"], prev["gid"]))
    report.say(f"{hpath}: put back as it was")


def uninstall(root: str, prefix: str = DEFAULT_PREFIX) -> Report:
    """Undo the install recorded under ``root``/``prefix``; an error when there is none."""
    host = HostRoot(root)
    report = Report()
    manifest = read_manifest(host, prefix)
    if manifest is None:
        raise InstallError(f"no vmpin install under {host.root}: {manifest_path(host, prefix)}"
                           " does not exist (nothing was changed)")  # fmt: skip
    for hpath, rec in sorted(manifest["files"].items()):
        _undo(host, hpath, rec, report)
    os.unlink(manifest_path(host, prefix))
    for d in sorted(manifest.get("dirs", []), key=lambda p: p.count("/"), reverse=True):
        try:
            os.rmdir(host.path(d))
        except FileNotFoundError:
            pass
        except OSError:
            report.warn(f"{d}: not empty, left")
    if "containerd" in manifest.get("runtimes", []):
        report.say("restart containerd to load its config again")
    return report
