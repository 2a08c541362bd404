"""Find a sandbox's VMM (QEMU) process, and tell later whether it is still the same one.

Kata starts QEMU with ``-name sandbox-<sandbox id>`` and ``-pidfile <vm dir>/<id>/pid``.  Three
sources name a candidate, cheapest first:

1. the pidfile, which may be missing (not written yet, or Kata configured elsewhere), empty
   (QEMU truncates it before writing), garbage, or stale (QEMU died, its pid was reused);
2. a hint pid: an OCI hook's state ``pid`` is the VMM's pid when Kata knows it (otherwise the
   shim's, which fails the check below);
3. a scan of every process, for a QEMU whose ``-name`` names the sandbox.

No source is trusted on its own: a candidate counts only if its command line really is that
sandbox's QEMU (``-name`` whose name is ``sandbox-<id>``, argv[0] a qemu/kvm binary).  So a
pidfile pointing at a reused pid, or an operator's ``find / -name sandbox-<id>``, never passes.

A process is identified by (pid, start time); :func:`is_same` re-checks both plus the name,
so a pass that stored a VMM notices when the pid now belongs to someone else, or to a zombie.
"""

from __future__ import annotations

import os

from vmpin.core.errors import HostError, VmpinError
from vmpin.core.ids import check_id
from vmpin.linux import procfs
from vmpin.linux.files import identity, read_bytes, remember
from vmpin.linux.paths import HostPaths

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.lean.records)
if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import NamedTuple
else:
    from vmpin.lean.records import NamedTuple


#: QEMU's boolean spellings (qapi's parse_type_bool).
_TRUE = {"on", "yes", "true", "y"}
_FALSE = {"off", "no", "false", "n"}


class Vmm(NamedTuple):
    """A VMM process as seen once: pid + start time (stat field 22) identify it.

    A NamedTuple rather than a dataclass: the hook may import this module, and ``dataclasses``
    drags in ``inspect`` (~10 ms here).
    """

    pid: int
    start: int
    cmdline: tuple[str, ...]
    debug_threads: bool

    @property
    def name(self) -> str | None:
        """The guest name from ``-name`` (``sandbox-<id>`` for Kata)."""
        return parse_name_option(self.cmdline)[0]


def sandbox_name(sandbox_id: str) -> str:
    """The ``-name`` Kata gives the QEMU of ``sandbox_id``."""
    return f"sandbox-{sandbox_id}"


def _split_qemu_opts(value: str) -> list[str]:
    """Split a QemuOpts string on ``,``; ``,,`` is an escaped comma inside a value."""
    parts: list[str] = []
    cur: list[str] = []
    i = 0
    while i < len(value):
        ch = value[i]
        if ch == ",":
            if value.startswith(",,", i):
                cur.append(",")
                i += 2
                continue
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
        i += 1
    parts.append("".join(cur))
    return parts


def _option_values(cmdline: Sequence[str], option: str) -> list[str]:
    """Every value of ``-option VALUE`` / ``--option VALUE`` (QEMU accepts both spellings)."""
    values: list[str] = []
    for i, arg in enumerate(cmdline[1:], start=1):
        if arg in (f"-{option}", f"--{option}") and i + 1 < len(cmdline):
            values.append(cmdline[i + 1])
    return values


def parse_name_option(cmdline: Sequence[str]) -> tuple[str | None, bool]:
    """(name, debug_threads) from QEMU's ``-name [guest=]name[,debug-threads=on|off][,...]``.

    The first field without ``=`` is the implied ``guest`` key; ``-name`` lists merge and the
    last value of a key wins (QEMU's ``qemu_name_opts`` has ``merge_lists``).  A bare
    ``debug-threads`` means on, QemuOpts' shorthand.
    """
    name: str | None = None
    debug = False
    for value in _option_values(cmdline, "name"):
        for i, field in enumerate(_split_qemu_opts(value)):
            key, eq, val = field.partition("=")
            if not eq:
                if i == 0:
                    name = field
                elif field == "debug-threads":
                    debug = True
                elif field == "nodebug-threads":
                    debug = False
                continue
            if key == "guest":
                name = val
            elif key == "debug-threads":
                if val in _TRUE:
                    debug = True
                elif val in _FALSE:
                    debug = False
    return name, debug


def iothread_ids(cmdline: Sequence[str]) -> list[str]:
    """Ids of ``-object iothread,id=X`` (and the JSON ``-object {"qom-type":"iothread"}``)."""
    ids: list[str] = []
    for value in _option_values(cmdline, "object"):
        if value.lstrip().startswith("{"):
            import json  # only for the rare JSON form; keeps the hook's imports lean

            try:
                obj = json.loads(value)
            except ValueError:
                continue
            if isinstance(obj, dict) and obj.get("qom-type") == "iothread" and "id" in obj:
                ids.append(str(obj["id"]))
            continue
        fields = _split_qemu_opts(value)
        kv: dict[str, str] = {}
        for f in fields[1:]:
            key, _, val = f.partition("=")
            kv[key] = val
        # the first field is the implied qom-type, unless spelled out
        qom_type = fields[0].removeprefix("qom-type=")
        if qom_type == "iothread" and kv.get("id"):
            ids.append(kv["id"])
    return ids


def _looks_like_qemu(argv0: str) -> bool:
    """qemu-system-x86_64, qemu-kvm (RHEL), kata's qemu builds, Debian's ``kvm`` wrapper."""
    base = os.path.basename(argv0).lower()
    return "qemu" in base or "kvm" in base


def runner_uid(paths: HostPaths, sandbox_id: str) -> int:
    """The user a sandbox's QEMU runs as: the owner of its VM dir (Kata makes it, and QEMU
    writes its pidfile there: root, or the rootless runtime's user), else vmpin's own."""
    try:
        return os.lstat(os.path.join(paths.vm_dir, sandbox_id)).st_uid
    except OSError:
        return os.geteuid()


def _read_vmm(
    paths: HostPaths, pid: int, sandbox_id: str, known: tuple[int, list[str]] | None = None
) -> Vmm | None:
    """The Vmm at ``pid`` if it is ``sandbox_id``'s QEMU, else None (gone, other process).
    ``known``: its start time and then its command line, as the caller read them (in that
    order: the start time read here after them tells a reuse of the pid between).

    A command line is anyone's to write: a process counts as the sandbox's QEMU only when it
    also runs as the sandbox's runner (:func:`runner_uid`).  Before (issue 26), once a QEMU
    died leaving its pidfile, a user's process with argv ``qemu-system-x86_64 ... -name
    sandbox-<id>`` was adopted as the VMM: its threads pinned, the dead sandbox kept alive.
    """
    if pid <= 0:
        return None
    try:
        if known is None:
            start = procfs.start_time(paths.proc, pid)
            args = tuple(procfs.cmdline(paths.proc, pid))
        else:
            start, args = known[0], tuple(known[1])
        # /proc/PID is owned by the process's effective uid
        uid = os.stat(os.path.join(paths.proc, str(pid))).st_uid
        # the pid could have been reused between the reads: the start time tells.
        if procfs.start_time(paths.proc, pid) != start:
            return None
    except (OSError, HostError, ValueError, IndexError):
        return None
    if uid != runner_uid(paths, sandbox_id):
        return None
    if not args or not _looks_like_qemu(args[0]):
        return None
    name, debug = parse_name_option(args)
    if name != sandbox_name(sandbox_id):
        return None
    return Vmm(pid=pid, start=start, cmdline=args, debug_threads=debug)


#: pidfile path -> (its identity when read, the pid in it): QEMU writes its pidfile once, and
#: every pass reads each sandbox's (an idle pass at 2,000 sandboxes, issue 14)
_PIDFILES: dict[str, tuple[tuple[int, int, int, int, int], int | None]] = {}


def read_pidfile(path: str) -> int | None:
    """The pid in a QEMU pidfile, or None when missing, empty, unreadable or not a pid.

    A pidfile read before and unchanged since (:func:`vmpin.linux.files.identity`: one
    ``lstat``) is not read again."""
    ident = identity(path)
    if ident is None:
        _PIDFILES.pop(path, None)
        return None  # (a FIFO or device planted as the pidfile is refused, not waited on)
    known = _PIDFILES.get(path)
    if known is not None and known[0] == ident:
        return known[1]
    try:
        raw = read_bytes(path, limit=64, what="pidfile")
    except (OSError, VmpinError):
        return None
    try:
        pid: int | None = int(raw.decode("ascii", errors="strict").strip())
    except (UnicodeDecodeError, ValueError):
        pid = None
    if pid is not None and pid <= 0:
        pid = None
    remember(_PIDFILES, path, ident, pid)
    return pid


def find_vmm(
    paths: HostPaths, sandbox_id: str, hint_pid: int | None = None, scan: bool = True
) -> Vmm | None:
    """The QEMU of ``sandbox_id``: pidfile, then ``hint_pid``, then (if ``scan``) all of /proc.

    Each candidate must pass the command-line check; None when none does.  When the scan finds
    several (an old QEMU still dying next to its replacement), the newest one wins.
    """
    check_id(sandbox_id, "sandbox id")
    pid = read_pidfile(os.path.join(paths.vm_dir, sandbox_id, "pid"))
    if pid is not None:
        vmm = _read_vmm(paths, pid, sandbox_id)
        if vmm is not None:
            return vmm
    if hint_pid is not None and hint_pid != pid:
        vmm = _read_vmm(paths, hint_pid, sandbox_id)
        if vmm is not None:
            return vmm
    if not scan:
        return None
    return _scan(paths, sandbox_id)


def _scan(paths: HostPaths, sandbox_id: str) -> Vmm | None:
    needle = sandbox_name(sandbox_id)
    found: list[Vmm] = []
    try:
        candidates = procfs.pids(paths.proc)
    except OSError:
        return None
    for pid in candidates:
        try:
            raw = procfs.read_text(paths.proc, pid, "cmdline")
        except HostError:
            continue
        # cheap filter before parsing: kernel threads and most processes stop here
        if needle not in raw:
            continue
        vmm = _read_vmm(paths, pid, sandbox_id)
        if vmm is not None:
            found.append(vmm)
    return max(found, key=lambda v: v.start) if found else None


def still_running(paths: HostPaths, sandbox_id: str, pid: int, start: int) -> bool:
    """True while the pidfile of ``sandbox_id`` names ``pid`` and ``pid`` runs (not a zombie)
    with the start time ``start``.

    For a VMM found before by :func:`find_vmm` (its command line checked then): (pid, start
    time) is a process's identity, so two small reads re-find it, where find_vmm reads four.
    """
    if read_pidfile(f"{paths.vm_dir}/{sandbox_id}/pid") != pid:  # (an id has no "/")
        return False
    try:
        fields = procfs.stat_fields(paths.proc, pid)
        return fields[2] not in ("Z", "X") and int(fields[21]) == start
    except (HostError, ValueError, IndexError):
        return False


def is_vmm_of(
    paths: HostPaths, pid: int, sandbox_id: str, known: tuple[int, list[str]] | None = None
) -> bool:
    """True when ``pid`` is, right now, the QEMU of ``sandbox_id`` (e.g. an OCI state pid).
    ``known``: its start time and command line, read in that order (the hook has both)."""
    return _read_vmm(paths, pid, sandbox_id, known) is not None


def is_same(paths: HostPaths, vmm: Vmm, sandbox_id: str | None = None) -> bool:
    """True while ``vmm.pid`` is still that process: same start time, same ``-name``.

    The name checked is ``sandbox-<sandbox_id>`` when given (a Vmm rebuilt from stored
    pid and start time has no cmdline), else the one in ``vmm.cmdline``.  False once the
    process exited, became a zombie (its cmdline reads empty) or the pid was reused.
    """
    want = sandbox_name(sandbox_id) if sandbox_id is not None else vmm.name
    if want is None:
        return False
    try:
        if procfs.start_time(paths.proc, vmm.pid) != vmm.start:
            return False
        args = procfs.cmdline(paths.proc, vmm.pid)
    except (HostError, ValueError, IndexError):
        return False
    return parse_name_option(args)[0] == want
