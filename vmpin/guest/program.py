#!/usr/bin/env python3
"""``vmpin guest hook STAGE``: inside a Kata VM, pin a starting container to its mapped vCPUs.

Kata drops a container's cpuset inside the guest: guest vCPU numbers are not host CPU
numbers, so the agent cannot apply ``linux.resources.cpu.cpus`` as given, and every container
of a pod runs on every vCPU.  Under vmpin's 1:1 plan the numbers *are* related (vCPU i runs
only on host CPU h), so the host publishes each container's vCPUs
(:mod:`vmpin.runtimes.publish`, the
format in ``docs/guest.md``) in the directory Kata already shares with the guest, and this
hook, run by the kata-agent from ``guest_hook_path/{prestart,poststart,poststop}/``, applies
them:

1. read the OCI state on stdin (inside the guest: the container's id, its init pid there,
   its bundle); Kata's guest container ids are the host ones, which is the map's key;
2. read the published map (``--map``, else ``$VMPIN_GUEST_MAP``, else
   :data:`DEFAULT_GUEST_MAP`), find the container;
3. pin: the container's cpuset cgroup when it has one of its own (found through
   ``/proc/PID/cgroup``; cgroup v1 cpuset, or v2 with the cpuset controller enabled), because
   a cgroup covers every process the container will ever start; else every thread's
   affinity (``sched_setaffinity`` on each ``/proc/PID/task/*``, and on its descendants'),
   then read back and verify both ways.

cgroup v1 keeps a child's CPUs within its parent's; a vCPU hot-plugged after the parent was
made is missing there.  The hook does not widen a parent on its own (that changes what every
sibling may use): it says so, and ``--widen-parents`` lets it widen each ancestor, loudly.

Fail-open, like the host hook: a container never fails to start because of vmpin, so any
problem is one line on stderr and exit 0; ``--strict`` makes it exit 1.  ``poststop`` has
nothing to undo.  A non-exact entry (a floating plan: its vCPUs are all vCPUs) is applied as
given and mentioned only with ``--verbose``.

The hook pins a container once, when it starts; the host may change the container's CPUs
later (CRI UpdateContainerResources -> ``vmpin update``) and republish the map.  So the hook
also records what it pinned -- one small JSON file per container in a guest-side state dir
(``--state``, ``$VMPIN_GUEST_STATE``, default :data:`DEFAULT_GUEST_STATE`) -- and
``vmpin guest follow`` (a small loop, or ``--once``) re-applies an entry whose generation or
vCPUs differ from what was applied, through the same code as the hook, to the same cgroup or
the same process tree; ``poststop`` removes the record.  See ``docs/guest.md``.

It shares the host's stdlib-only modules instead of copying them: CPU lists
(:mod:`vmpin.core.cpuset`, with the host's cap on CPU numbers), the map's wire format
(:mod:`vmpin.wire.guestmap`), procfs readers and sched_setaffinity with read-back
(:mod:`vmpin.linux`); no sqlite3/typer/pydantic/psutil (``tests/guest/test_guest.py`` and the
lint-imports contract check it).  A guest image gets it as one file, the zipapp of
:mod:`vmpin.guest.bundle` (``python3 -I -S vmpin-guest.pyz prestart``: kata-agent runs a hook
with argv ``[name, stage]``), or as the installed package.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import sys
import time
from types import FrameType
from typing import Callable, Mapping, NamedTuple

from vmpin.core.cpuset import CpuSet
from vmpin.core.errors import CpuSetError, HostError, ProcessGone, VmpinError, WireError
from vmpin.linux import procfs
from vmpin.linux.affinity import SchedAffinity
from vmpin.linux.files import read_bytes
from vmpin.wire import guestmap as wire
from vmpin.wire.guestmap import DEFAULT_GUEST_MAP, Entry, GuestMap

ENV_MAP = "VMPIN_GUEST_MAP"
ENV_PROC_ROOT = "VMPIN_GUEST_PROC_ROOT"
ENV_CGROUP_ROOT = "VMPIN_GUEST_CGROUP_ROOT"
ENV_WAIT = "VMPIN_GUEST_WAIT"
ENV_STATE = "VMPIN_GUEST_STATE"

#: where the hook records what it pinned, for ``vmpin guest follow``: runtime state, on the
#: guest's tmpfs, gone with the VM like the containers it describes.
DEFAULT_GUEST_STATE = "/run/vmpin-guest"
#: the records' own format version (guest-side only: the host never reads them).
RECORD_VERSION = 1
#: ``vmpin guest follow``: seconds between looks at the map, by default.
DEFAULT_INTERVAL = 2.0
#: ...and a full pass at least this often even when neither the map nor any record changed:
#: it retries what failed, forgets records of containers whose poststop never ran, and
#: catches a record written within one timestamp tick of the previous look.
FULL_PASS_EVERY = 60.0

#: every OCI stage; all but poststop pin (pinning twice is harmless, and a later stage
#: catches a map that was published after the first one ran).
STAGES = ("prestart", "createRuntime", "createContainer", "startContainer", "poststart", "poststop")

USAGE = (
    "usage: vmpin guest hook [--strict] [--verbose] [--widen-parents] [--wait SECONDS]\n"
    "                        [--map FILE] [--state DIR] [--proc-root DIR] [--cgroup-root DIR]\n"
    "                        STAGE\n"
    "  STAGE: " + ", ".join(STAGES) + ";\n"
    "  the container's OCI state (id, pid) on stdin.\n"
    f"  --map FILE        the published map (${ENV_MAP};\n"
    f"                    default {DEFAULT_GUEST_MAP})\n"
    f"  --wait SECONDS    wait up to this long for the map to name the container (${ENV_WAIT})\n"
    "  --widen-parents   cgroup v1: add the CPUs to ancestors that lack them (never silently)\n"
    f"  --state DIR       where to record what was pinned, for `vmpin guest follow`\n"
    f"                    (${ENV_STATE}; default {DEFAULT_GUEST_STATE}); poststop removes it\n"
    f"  --proc-root DIR, --cgroup-root DIR   other roots, for tests (${ENV_PROC_ROOT},\n"
    f"                    ${ENV_CGROUP_ROOT}; default /proc, /sys/fs/cgroup)\n"
    "  --strict          exit 1 on failure (default: one line on stderr, exit 0)\n"
    "  --verbose         also report what was done, and non-exact maps"
)

FOLLOW_USAGE = (
    "usage: vmpin guest follow [--once] [--interval SECONDS] [--strict] [--verbose]\n"
    "                          [--widen-parents] [--map FILE] [--state DIR]\n"
    "                          [--proc-root DIR] [--cgroup-root DIR]\n"
    "  Re-pin the containers the guest hook recorded (in --state) whenever the host\n"
    "  republishes their entry with another generation or other vCPUs; forget records\n"
    "  whose process is gone.\n"
    "  --once            one pass, then exit (0; 1 with --strict when something failed)\n"
    f"  --interval SECONDS  how often to look at the map (default {DEFAULT_INTERVAL:g}); SIGTERM\n"
    "                    or SIGINT exits 0\n"
    f"  --map FILE, --state DIR   as for `vmpin guest hook` (${ENV_MAP}, ${ENV_STATE})\n"
    "  --widen-parents, --proc-root, --cgroup-root   as for `vmpin guest hook`\n"
    "  --verbose         also report each re-pin and each forgotten record"
)


class GuestError(Exception):
    """One failure of the hook; ``str()`` is the line printed on stderr.

    ``fallback`` says whether pinning threads' affinity is still worth a try after a cgroup
    write failed (not when the cgroup's parent excludes the CPUs: affinity cannot reach
    them either, and a half-applied affinity would only mislead).
    """

    def __init__(self, message: str, fallback: bool = True) -> None:
        super().__init__(message)
        self.fallback = fallback


# -- CPU lists (the Linux list format: "0-3,8"): vmpin.core.cpuset's rules -------------------
def parse_cpus(text: str) -> frozenset[int]:
    """Parse a Linux CPU list strictly (the host's parser): "" is empty, "0,", "3-0" are errors."""
    try:
        return frozenset(CpuSet.parse(text))
    except CpuSetError as err:
        raise GuestError(str(err)) from None


def format_cpus(cpus: frozenset[int] | set[int]) -> str:
    """The Linux list format, ranges collapsed: {0, 1, 2, 5} -> "0-2,5"."""
    return CpuSet(cpus).to_list()


# -- inputs ----------------------------------------------------------------------------------
class State(NamedTuple):
    """What the hook needs from the OCI state: the container's id and its pid (0: none)."""

    id: str
    pid: int
    bundle: str


def parse_state(data: bytes) -> State:
    """The OCI state JSON (``{"id", "pid", "bundle", ...}``); pid is optional (poststop)."""
    try:
        raw = json.loads(data)
    except ValueError as err:
        raise GuestError(f"OCI state on stdin is not JSON: {err}") from None
    except RecursionError:
        raise GuestError("OCI state on stdin is JSON nested too deeply") from None
    if not isinstance(raw, dict):
        raise GuestError("OCI state on stdin is not a JSON object")
    cid = raw.get("id")
    if not isinstance(cid, str) or not cid:
        raise GuestError("OCI state on stdin has no container id")
    pid = raw.get("pid") or 0
    if not isinstance(pid, int) or isinstance(pid, bool) or pid < 0:
        raise GuestError(f"OCI state of {cid}: bad pid {pid!r}")
    bundle = raw.get("bundle")
    return State(cid, pid, bundle if isinstance(bundle, str) else "")


def read_map(path: str) -> GuestMap:
    """Read and check the published map (:func:`vmpin.wire.guestmap.from_json`)."""
    try:
        data = read_bytes(path, limit=wire.MAX_BYTES, what="guest map")
    except FileNotFoundError:
        raise GuestError(
            f"no guest map at {path} (vmpin on the host has not published one "
            "for this sandbox, or Kata shares no directory with the guest)"
        ) from None
    except OSError as err:
        raise GuestError(f"cannot read guest map {path}: {err.strerror}") from None
    except VmpinError as err:  # a symlink, FIFO, device or huge file: refused unread
        raise GuestError(str(err)) from None
    try:
        return wire.from_json(data, f"guest map {path}")
    except WireError as err:
        raise GuestError(str(err)) from None


def lookup(guest_map: GuestMap, container_id: str) -> Entry | None:
    """The container's entry, None when the map does not name it."""
    try:
        return guest_map.entry(container_id)
    except WireError as err:
        raise GuestError(str(err)) from None


# -- procfs ------------------------------------------------------------------------------------
def _read(path: str) -> str:
    with open(path, "rb") as f:
        return f.read().decode(errors="replace")


def task_ids(proc: str, pid: int) -> list[int]:
    """The thread ids of ``pid``; raises GuestError when the process is gone."""
    try:
        return procfs.tids(proc, pid)
    except HostError:
        raise GuestError(f"process {pid} is gone") from None


def children(proc: str, pid: int, tid: int) -> list[int]:
    """Children of one thread (``task/TID/children``, CONFIG_PROC_CHILDREN); [] if unknown."""
    try:
        # only under task/TID: /proc/PID has no children file, even for the main thread
        text = procfs.read_text(proc, pid, os.path.join("task", str(tid), "children"))
    except HostError:
        return []
    return [int(c) for c in text.split() if c.isdigit()]


def cpus_allowed(proc: str, tid: int) -> frozenset[int] | None:
    """``Cpus_allowed_list`` of a task (``/proc/TID`` works for any thread); None if gone."""
    try:
        return frozenset(procfs.cpus_allowed(proc, tid))
    except (HostError, CpuSetError):
        return None


# -- cgroups ---------------------------------------------------------------------------------
class Cgroup(NamedTuple):
    """A cpuset cgroup: version, its directory, its path below the hierarchy's root."""

    version: int
    path: str
    rel: str
    root: str

    @property
    def cpus_file(self) -> str:
        return os.path.join(self.path, "cpuset.cpus")

    @property
    def effective_file(self) -> str:
        name = "cpuset.effective_cpus" if self.version == 1 else "cpuset.cpus.effective"
        return os.path.join(self.path, name)

    @property
    def tasks_file(self) -> str:
        return os.path.join(self.path, "tasks" if self.version == 1 else "cgroup.threads")


def find_cgroup(proc: str, cgroup_root: str, pid: int) -> Cgroup | None:
    """The cpuset cgroup of ``pid``, None when it has none of its own.

    A v1 ``cpuset`` line wins over v2's ``0::`` line (a controller is bound to one hierarchy
    at a time).  The hierarchy's root ("/") counts as none: it is the whole VM, not the
    container, and v1 does not let anyone write it anyway.
    """
    try:
        lines = _read(os.path.join(proc, str(pid), "cgroup")).splitlines()
    except OSError:
        raise GuestError(f"process {pid} is gone") from None
    v2_rel = None
    for line in lines:
        hid, _, rest = line.partition(":")
        controllers, _, rel = rest.partition(":")
        # A cgroup removed under the process shows "/path (deleted)".
        rel = rel.removesuffix(" (deleted)")
        if hid == "0" and controllers == "":
            v2_rel = rel
        elif "cpuset" in controllers.split(","):
            if rel == "/":
                return None
            # Usually mounted at <root>/cpuset; co-mounted ones at <root>/<controller list>.
            for mount in ("cpuset", controllers):
                root = os.path.join(cgroup_root, mount)
                path = os.path.join(root, rel.lstrip("/"))
                if os.path.exists(os.path.join(path, "cpuset.cpus")):
                    return Cgroup(1, path, rel, root)
            return None
    if v2_rel is None or v2_rel == "/":
        return None
    pure = os.path.exists(os.path.join(cgroup_root, "cgroup.controllers"))
    root = cgroup_root if pure else os.path.join(cgroup_root, "unified")
    path = os.path.join(root, v2_rel.lstrip("/"))
    try:
        enabled = _read(os.path.join(path, "cgroup.controllers")).split()
    except OSError:
        return None
    return Cgroup(2, path, v2_rel, root) if "cpuset" in enabled else None


def _write_cpus(path: str, cpus: frozenset[int]) -> None:
    with open(path, "w") as f:
        f.write(format_cpus(cpus) + "\n")


def _errno_text(err: OSError) -> str:
    return f"{errno.errorcode.get(err.errno or 0, '?')} ({err.strerror})"


def ancestors(cg: Cgroup) -> list[Cgroup]:
    """The cgroup's ancestors below the hierarchy's root, outermost first."""
    out: list[Cgroup] = []
    rel = os.path.dirname(cg.rel.rstrip("/"))
    while rel not in ("/", ""):
        out.append(cg._replace(path=os.path.join(cg.root, rel.lstrip("/")), rel=rel))
        rel = os.path.dirname(rel)
    return out[::-1]


def widen_ancestors(cg: Cgroup, cpus: frozenset[int]) -> list[str]:
    """Add ``cpus`` to every ancestor that lacks them, outermost first; what was widened.

    v1 checks each write against the parent, hence the order.  A v2 ancestor with an empty
    ``cpuset.cpus`` inherits its parent's and is left as it is.
    """
    done: list[str] = []
    for up in ancestors(cg):
        try:
            have = parse_cpus(_read(up.cpus_file))
        except OSError as err:
            raise GuestError(f"reading {up.cpus_file}: {_errno_text(err)}", False) from None
        if (cg.version == 2 and not have) or cpus <= have:
            continue
        wider = have | cpus
        try:
            _write_cpus(up.cpus_file, wider)
        except OSError as err:
            raise GuestError(
                f"widening {up.cpus_file} to {format_cpus(wider)}: {_errno_text(err)}", False
            ) from None
        done.append(f"{up.cpus_file} {format_cpus(have)} -> {format_cpus(wider)}")
    return done


def _parent_lacks(cg: Cgroup, cpus: frozenset[int]) -> tuple[Cgroup, frozenset[int]] | None:
    """v1 only: the parent and its CPUs when they do not include ``cpus``, else None."""
    parents = ancestors(cg)
    if cg.version != 1 or not parents:
        return None
    try:
        have = parse_cpus(_read(parents[-1].cpus_file))
    except (OSError, GuestError):
        return None
    return None if cpus <= have else (parents[-1], have)


def pin_cgroup(cg: Cgroup, cpus: frozenset[int], widen_parents: bool) -> list[str]:
    """Set the cgroup's ``cpuset.cpus`` and check the effective set; notes for the report."""
    notes: list[str] = []
    want = format_cpus(cpus)
    try:
        _write_cpus(cg.cpus_file, cpus)
    except OSError as err:
        # cgroup v1 answers EACCES (not EINVAL) when a child would exceed its parent.
        lacks = _parent_lacks(cg, cpus) if err.errno in (errno.EACCES, errno.EPERM) else None
        if lacks is None:
            raise GuestError(f"cannot set {cg.cpus_file} to {want}: {_errno_text(err)}") from None
        parent, have = lacks
        if not widen_parents:
            raise GuestError(
                f"cannot set {cg.cpus_file} to {want}: cgroup v1 keeps a child within its "
                f"parent, and {parent.cpus_file} is {format_cpus(have) or '(empty)'}; "
                "not widened (--widen-parents would)",
                fallback=False,
            ) from None
        notes += ["widened " + w for w in widen_ancestors(cg, cpus)]
        try:
            _write_cpus(cg.cpus_file, cpus)
        except OSError as err2:
            raise GuestError(
                f"cannot set {cg.cpus_file} to {want} even after widening its "
                f"parents: {_errno_text(err2)}",
                fallback=False,
            ) from None
    effective = read_effective(cg)
    if effective != cpus:
        # v2 accepts any list and intersects it with the parent's: say who narrowed it.
        raise GuestError(
            f"{cg.cpus_file} set to {want}, but the kernel gives "
            f"{format_cpus(effective) or '(none)'} (an ancestor's cpuset lacks "
            "CPUs; not widened)",
            fallback=False,
        )
    return notes


def read_effective(cg: Cgroup) -> frozenset[int]:
    """The CPUs the cgroup's tasks may use (asked for, within every ancestor's)."""
    # v1 before Linux 3.16 has no effective_cpus: there, what was written is what holds.
    for name in (cg.effective_file, cg.cpus_file):
        try:
            return parse_cpus(_read(name))
        except FileNotFoundError:
            continue
        except OSError as err:
            raise GuestError(f"reading back {name}: {_errno_text(err)}") from None
    raise GuestError(f"{cg.path} has no cpuset files any more (container removed?)")


def cgroup_tasks(cg: Cgroup) -> list[int]:
    try:
        return sorted({int(t) for t in _read(cg.tasks_file).split()})
    except OSError as err:
        raise GuestError(f"reading {cg.tasks_file}: {_errno_text(err)}") from None


# -- affinity ---------------------------------------------------------------------------------
def set_affinity(tid: int, cpus: frozenset[int]) -> bool:
    """sched_setaffinity on one thread; False when it exited meanwhile (nothing to pin).

    The read-back is :meth:`SchedAffinity.set`'s; :func:`verify_tasks` checks the result.
    """
    try:
        _AFFINITY.set(tid, CpuSet(cpus))
    except ProcessGone:
        return False
    except HostError as err:
        raise GuestError(str(err)) from None
    return True


_AFFINITY = SchedAffinity()


def process_tree(proc: str, pid: int) -> list[int]:
    """Every thread of ``pid`` and of its descendants (best effort for the latter)."""
    seen_pids = {pid}
    todo = [pid]
    tids: list[int] = []
    while todo:
        p = todo.pop()
        try:
            threads = task_ids(proc, p)
        except GuestError:
            if p == pid:
                raise
            continue
        tids.extend(threads)
        for t in threads:
            for child in children(proc, p, t):
                if child not in seen_pids:
                    seen_pids.add(child)
                    todo.append(child)
    return tids


def pin_threads(proc: str, pid: int, cpus: frozenset[int]) -> int:
    """Pin every thread of the process tree, again until no new thread shows up; how many.

    A thread created while we work inherits its creator's mask, pinned or not; a few rounds
    catch the ones that were born from a thread before it was pinned.
    """
    done: set[int] = set()
    for _ in range(5):
        new = [t for t in process_tree(proc, pid) if t not in done]
        if not new:
            break
        for tid in new:
            if set_affinity(tid, cpus):
                done.add(tid)
    return len(done)


def verify_tasks(proc: str, tids: list[int], cpus: frozenset[int], fix: bool) -> int:
    """Every live task's ``Cpus_allowed_list`` must be ``cpus``; with ``fix`` try once more."""
    checked = 0
    for tid in tids:
        actual = cpus_allowed(proc, tid)
        if actual is None:
            continue  # exited
        if actual != cpus and fix and set_affinity(tid, cpus):
            actual = cpus_allowed(proc, tid)
            if actual is None:
                continue
        if actual != cpus:
            raise GuestError(
                f"task {tid} runs on vCPUs {format_cpus(actual)} after pinning to "
                f"{format_cpus(cpus)}"
            )
        checked += 1
    return checked


# -- the pin -----------------------------------------------------------------------------------
class Result(NamedTuple):
    method: str  # "cgroup" | "affinity"
    where: str
    tasks: int
    notes: tuple[str, ...]
    #: the cgroup whose cpuset.cpus was written (None: affinity), for the follower's record
    cgroup: Cgroup | None = None


def pin(
    proc: str, cgroup_root: str, pid: int, cpus: frozenset[int], widen_parents: bool = False
) -> Result:
    """Pin process ``pid``'s container to ``cpus``: its cgroup when it has one, else threads.

    When the cgroup cannot be written for a reason affinity does not share (a read-only
    cgroupfs, say), the threads are pinned instead and a note says why.
    """
    if not cpus:
        raise GuestError("the map gives no vCPU")
    return pin_with(proc, pid, cpus, find_cgroup(proc, cgroup_root, pid), widen_parents)


def pin_with(
    proc: str, pid: int, cpus: frozenset[int], cg: Cgroup | None, widen_parents: bool = False
) -> Result:
    """:func:`pin` once the cgroup is known (None: pin the threads of ``pid``'s tree).

    The follower calls this with what the hook recorded, so that an update lands where the
    start-time pin did -- the same cgroup, or the same process tree -- by the same code.
    """
    if not cpus:
        raise GuestError("the map gives no vCPU")
    cg_err: GuestError | None = None
    if cg is not None:
        try:
            notes = pin_cgroup(cg, cpus, widen_parents)
            n = verify_tasks(proc, cgroup_tasks(cg), cpus, fix=True)
            return Result("cgroup", cg.path, n, tuple(notes), cg)
        except GuestError as err:
            if not err.fallback:
                raise
            cg_err = err
    try:
        pin_threads(proc, pid, cpus)
        n = verify_tasks(proc, process_tree(proc, pid), cpus, fix=True)
    except GuestError as err:
        if cg_err is None:
            raise
        raise GuestError(f"{cg_err}; pinning its threads failed too: {err}") from None
    notes = [] if cg_err is None else [f"cgroup not pinned ({cg_err}), threads were"]
    return Result("affinity", f"pid {pid}", n, tuple(notes))


# -- records: what the hook pinned, for the follower -------------------------------------------
def start_time(proc: str, pid: int) -> int | None:
    """Field 22 of ``/proc/PID/stat`` (clock ticks after boot), None when the pid is gone.

    A pid alone names a process only while it lives: once it exits the kernel may hand the
    number to another process.  Pid and start time together name one process for as long as
    the system runs, so a record never leads to pinning a stranger that reused the pid.
    """
    try:
        return procfs.start_time(proc, pid)
    except (HostError, IndexError, ValueError):
        return None


class Record(NamedTuple):
    """One container the guest side pinned (or is waiting to pin), as kept in the state dir.

    ``method`` None means nothing was applied yet (the hook found no entry, or pinning
    failed): the follower pins it the way the hook would once the map names it.  ``failed``
    is the (generation, vCPUs) whose pin failed last, so that a loop pass does not retry and
    re-report the same failure every few seconds (a full pass still retries).
    """

    container: str
    pid: int
    start_time: int
    method: str | None
    cgroup: Cgroup | None
    guest_cpus: frozenset[int] | None
    generation: int | None
    failed: tuple[int, frozenset[int]] | None = None
    by: str = ""

    def applied(self, entry: Entry) -> bool:
        """Whether ``entry`` is what this record says was applied (inequality, not "newer":
        the host's generation restarts at 1 when its map file is recreated)."""
        return (
            self.method is not None
            and self.generation == entry.generation
            and self.guest_cpus == entry.guest_cpus
        )


def record_path(state_dir: str, container_id: str) -> str:
    """``<state_dir>/<id>.json``; the id must be one plain path component.

    The id comes from the OCI state, i.e. from whoever created the container: it must not
    name a file elsewhere, nor one of the hidden temporary files (``.*``).
    """
    if (
        not container_id
        or len(container_id) > 200
        or container_id.startswith(".")
        or "/" in container_id
        or "\0" in container_id
    ):
        raise GuestError(f"container id {container_id!r} cannot name a record file")
    return os.path.join(state_dir, container_id + ".json")


def record_doc(rec: Record) -> dict[str, object]:
    """The record as JSON: a flat object, ids and CPU lists as in the published map."""
    cg = rec.cgroup
    return {
        "version": RECORD_VERSION,
        "container": rec.container,
        "pid": rec.pid,
        "start_time": rec.start_time,
        "method": rec.method,
        "cgroup": cg.path if cg is not None else None,
        "cgroup_version": cg.version if cg is not None else None,
        "cgroup_root": cg.root if cg is not None else None,
        "guest_cpus": format_cpus(rec.guest_cpus) if rec.guest_cpus is not None else None,
        "generation": rec.generation,
        "failed": (
            {"generation": rec.failed[0], "guest_cpus": format_cpus(rec.failed[1])}
            if rec.failed is not None
            else None
        ),
        "by": rec.by,
    }


def write_record(state_dir: str, rec: Record) -> str:
    """Write the record atomically (a temporary file renamed over it); its path.

    A reader (the follower, while the hook writes) sees the old record or the new one.  No
    fsync: the state dir is on tmpfs in a guest, and a record describes processes that do
    not outlive the VM anyway; the hook is on the container's start path and stays cheap.
    """
    path = record_path(state_dir, rec.container)
    data = json.dumps(record_doc(rec), sort_keys=True).encode() + b"\n"
    try:
        os.makedirs(state_dir, mode=0o700, exist_ok=True)
        tmp = os.path.join(
            state_dir, f".{rec.container}.json.{os.getpid()}.{os.urandom(4).hex()}.tmp"
        )
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError as err:
        raise GuestError(f"cannot write {path}: {_errno_text(err)}") from None
    return path


def _opt_int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def read_record(path: str) -> Record:
    """Parse one record file, strictly: anything unexpected is a GuestError (and the
    follower then forgets the file rather than act on a guess)."""
    try:
        raw = json.loads(_read(path))
    except OSError as err:
        raise GuestError(f"cannot read record {path}: {_errno_text(err)}") from None
    except ValueError as err:
        raise GuestError(f"record {path} is not JSON: {err}") from None
    except RecursionError:
        raise GuestError(f"record {path} is JSON nested too deeply") from None
    if not isinstance(raw, dict) or raw.get("version") != RECORD_VERSION:
        raise GuestError(f"record {path} is not a version {RECORD_VERSION} record")
    cid, pid, born = raw.get("container"), _opt_int(raw.get("pid")), _opt_int(raw.get("start_time"))
    if not isinstance(cid, str) or os.path.basename(path) != f"{cid}.json":
        raise GuestError(f"record {path} names another container ({cid!r})")
    if pid is None or pid <= 0 or born is None:
        raise GuestError(f"record {path} has no pid and start time")
    method = raw.get("method")
    if method not in ("cgroup", "affinity", None):
        raise GuestError(f"record {path}: unknown method {method!r}")
    cg = None
    if method == "cgroup":
        where, root, version = raw.get("cgroup"), raw.get("cgroup_root"), raw.get("cgroup_version")
        if not (isinstance(where, str) and isinstance(root, str) and version in (1, 2)):
            raise GuestError(f"record {path}: method cgroup without its cgroup")
        rel = "/" + os.path.relpath(where, root).lstrip("/")
        if rel.startswith("/.."):
            raise GuestError(f"record {path}: cgroup {where} is not below {root}")
        cg = Cgroup(1 if version == 1 else 2, where, rel, root)
    cpus_text = raw.get("guest_cpus")
    cpus = parse_cpus(cpus_text) if isinstance(cpus_text, str) else None
    if method is not None and cpus is None:
        raise GuestError(f"record {path}: applied, but no guest_cpus")
    failed_raw = raw.get("failed")
    failed = None
    if isinstance(failed_raw, dict) and isinstance(failed_raw.get("guest_cpus"), str):
        gen = _opt_int(failed_raw.get("generation"))
        if gen is not None:
            failed = (gen, parse_cpus(failed_raw["guest_cpus"]))
    by = raw.get("by")
    return Record(
        cid,
        pid,
        born,
        method if isinstance(method, str) else None,
        cg,
        cpus,
        _opt_int(raw.get("generation")),
        failed,
        by if isinstance(by, str) else "",
    )


def list_records(state_dir: str) -> list[str]:
    """Paths of every record (``*.json``, not the hidden temporaries); [] without a dir."""
    try:
        names = os.listdir(state_dir)
    except FileNotFoundError:
        return []
    except OSError as err:
        raise GuestError(f"cannot list {state_dir}: {_errno_text(err)}") from None
    return sorted(
        os.path.join(state_dir, n) for n in names if n.endswith(".json") and not n.startswith(".")
    )


def forget(path: str) -> bool:
    """Remove a record file; False when it was gone already."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def remove_stale_temps(state_dir: str, older_than: float = FULL_PASS_EVERY) -> None:
    """Remove temporary files a writer left when it died between create and rename."""
    try:
        names = [n for n in os.listdir(state_dir) if n.startswith(".") and n.endswith(".tmp")]
    except OSError:
        return
    now = time.time()
    for n in names:
        path = os.path.join(state_dir, n)
        with contextlib.suppress(OSError):
            if now - os.stat(path).st_mtime > older_than:
                os.unlink(path)


# -- the hook ---------------------------------------------------------------------------------
class Options(NamedTuple):
    stage: str
    strict: bool
    verbose: bool
    widen_parents: bool
    wait: float
    map_path: str
    proc: str
    cgroup_root: str
    state_dir: str = DEFAULT_GUEST_STATE


def _parse(
    args: list[str], flags: dict[str, bool], values: dict[str, str]
) -> tuple[dict[str, bool], dict[str, str], list[str]]:
    """Options in any order, ``--name value`` or ``--name=value``; the rest positional.

    Hand-rolled (argparse costs the hook's start time, and its errors exit 2 where the hook
    must stay fail-open); shared by ``guest hook`` and ``guest follow``.
    """
    flags, values = dict(flags), dict(values)
    positional: list[str] = []
    i = 0
    while i < len(args):
        name, eq, value = args[i].partition("=")
        if name in flags and not eq:
            flags[name] = True
        elif name in values:
            if not eq:
                if i + 1 >= len(args):
                    raise GuestError(f"{name} needs a value")
                i += 1
                value = args[i]
            values[name] = value
        elif args[i].startswith("-"):
            raise GuestError(f"unknown option {args[i]}")
        else:
            positional.append(args[i])
        i += 1
    return flags, values, positional


def _seconds(name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise GuestError(f"{name} {text!r} is not a number of seconds") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise GuestError(f"{name} {text!r} is not a number of seconds")
    return value


def _path_values(env: Mapping[str, str]) -> dict[str, str]:
    """The path options both commands take, each defaulting to its environment variable."""
    return {
        "--map": env.get(ENV_MAP) or DEFAULT_GUEST_MAP,
        "--state": env.get(ENV_STATE) or DEFAULT_GUEST_STATE,
        "--proc-root": env.get(ENV_PROC_ROOT) or "/proc",
        "--cgroup-root": env.get(ENV_CGROUP_ROOT) or "/sys/fs/cgroup",
    }


def parse_args(args: list[str], env: Mapping[str, str] | None = None) -> Options:
    """Options in any order around STAGE; each path also from its environment variable."""
    env = os.environ if env is None else env
    flags, values, stages = _parse(
        args,
        {"--strict": False, "--verbose": False, "-v": False, "--widen-parents": False},
        {**_path_values(env), "--wait": env.get(ENV_WAIT) or "0"},
    )
    if len(stages) != 1 or stages[0] not in STAGES:
        raise GuestError(f"expected one STAGE of {', '.join(STAGES)}, got {stages or 'none'}")
    wait = _seconds("--wait", values["--wait"])
    return Options(
        stages[0],
        flags["--strict"],
        flags["--verbose"] or flags["-v"],
        flags["--widen-parents"],
        max(0.0, wait),
        values["--map"],
        values["--proc-root"],
        values["--cgroup-root"],
        values["--state"],
    )


def find_entry(path: str, container_id: str, wait: float) -> Entry:
    """The container's entry, polling up to ``wait`` seconds for the host to publish it.

    The host publishes from its own hooks, which may finish after the agent starts this
    one; and virtio-fs may serve a cached directory entry for about a second.
    """
    deadline = time.monotonic() + wait
    while True:
        try:
            entry = lookup(read_map(path), container_id)
            if entry is not None:
                return entry
            err = GuestError(f"container {container_id} is not in the guest map {path}")
        except GuestError as e:
            err = e
        if time.monotonic() >= deadline:
            raise err
        time.sleep(0.1)


class Report(NamedTuple):
    """What one invocation did: a line for ``--verbose``, notes that are always shown."""

    line: str
    notes: tuple[str, ...] = ()


def run(opts: Options, data: bytes) -> Report | None:
    """Handle one invocation; None when there was nothing to do (poststop).

    Every pinning stage also records the container for ``vmpin guest follow`` -- after a
    failure too, when the process lives, so that the follower pins it once the map names
    it (the host may publish after the last hook ran).
    """
    if opts.stage == "poststop":
        forget_stopped(opts.state_dir, data)
        return None  # the container's cgroup and threads are gone: nothing else to undo
    state = parse_state(data)
    if not state.pid:
        raise GuestError(f"OCI state of {state.id} has no pid")
    born = start_time(opts.proc, state.pid)
    entry: Entry | None = None
    try:
        entry = find_entry(opts.map_path, state.id, opts.wait)
        result = pin(opts.proc, opts.cgroup_root, state.pid, entry.guest_cpus, opts.widen_parents)
    except GuestError:
        if born is not None:
            record_attempt(opts, state, born, entry)
        raise
    line = (
        f"container {state.id} pinned to vCPUs {format_cpus(entry.guest_cpus)} "
        f"({result.method}: {result.where}, {result.tasks} tasks)"
    )
    if not entry.exact:
        line += f"; map not exact ({entry.mode}: {entry.reason})"
    notes = list(result.notes)
    # Not being able to record is worth a line even without --verbose: the container is
    # pinned now, but an update of its CPUs will not reach it.
    if born is None:
        notes.append(f"not recorded in {opts.state_dir}: no start time for pid {state.pid}")
    else:
        rec = Record(
            state.id,
            state.pid,
            born,
            result.method,
            result.cgroup,
            entry.guest_cpus,
            entry.generation,
            None,
            f"hook {opts.stage}",
        )
        try:
            write_record(opts.state_dir, rec)
        except GuestError as err:
            notes.append(f"not recorded for `vmpin guest follow`: {err}")
    return Report(line, tuple(notes))


def record_attempt(opts: Options, state: State, born: int, entry: Entry | None) -> None:
    """After a failed pin: record the container as not pinned yet, best effort and silently
    (the failure itself is the line on stderr).

    A record of the same process that says something *was* applied (prestart pinned, then
    poststart failed) is kept as it is: it is still true.
    """
    try:
        path = record_path(opts.state_dir, state.id)
        try:
            old = read_record(path)
        except GuestError:
            old = None
        if old is not None and (old.pid, old.start_time) == (state.pid, born) and old.method:
            return
        failed = (entry.generation, entry.guest_cpus) if entry is not None else None
        rec = Record(
            state.id, state.pid, born, None, None, None, None, failed, f"hook {opts.stage}"
        )
        write_record(opts.state_dir, rec)
    except GuestError:
        return


def forget_stopped(state_dir: str, data: bytes) -> None:
    """poststop: remove the container's record, and never fail or say anything.

    The OCI state at poststop may lack a pid, or be missing altogether; and a record the
    hook cannot remove here is forgotten by the follower once its process is gone.
    """
    with contextlib.suppress(GuestError, OSError):
        forget(record_path(state_dir, parse_state(data).id))


def main(args: list[str]) -> int:
    """The hook's entry point (``vmpin guest hook ARGS``); returns the exit status."""
    if "-h" in args or "--help" in args:
        print(USAGE)
        return 0
    strict = "--strict" in args
    stage = next((a for a in args if a in STAGES), "?")
    try:
        opts = parse_args(args)
        if sys.stdin is None or sys.stdin.isatty():
            raise GuestError("no OCI state on stdin")
        report = run(opts, sys.stdin.buffer.read())
        if report is not None and (opts.verbose or report.notes):
            # Notes (a widened parent, a cgroup left unwritten) are shown without --verbose
            # too: they are changes or failures someone should see.
            print(
                f"vmpin guest hook {stage}: " + "; ".join([report.line, *report.notes]),
                file=sys.stderr,
            )
        return 0
    except GuestError as err:
        print(f"vmpin guest hook {stage}: {err}", file=sys.stderr)
    except Exception as err:  # fail-open means *any* failure, not only the foreseen ones
        print(f"vmpin guest hook {stage}: unexpected {type(err).__name__}: {err}", file=sys.stderr)
    return 1 if strict else 0


# -- the follower ------------------------------------------------------------------------------
class FollowOptions(NamedTuple):
    once: bool
    interval: float
    strict: bool
    verbose: bool
    widen_parents: bool
    map_path: str
    state_dir: str
    proc: str
    cgroup_root: str


def parse_follow_args(args: list[str], env: Mapping[str, str] | None = None) -> FollowOptions:
    """``vmpin guest follow`` options; the paths as for the hook, from the same variables."""
    env = os.environ if env is None else env
    flags, values, extra = _parse(
        args,
        {
            "--once": False,
            "--strict": False,
            "--verbose": False,
            "-v": False,
            "--widen-parents": False,
        },
        {**_path_values(env), "--interval": str(DEFAULT_INTERVAL)},
    )
    if extra:
        raise GuestError(f"unexpected argument {extra[0]!r}")
    interval = _seconds("--interval", values["--interval"])
    if interval <= 0:
        raise GuestError(f"--interval {values['--interval']!r} must be more than 0 seconds")
    return FollowOptions(
        flags["--once"],
        interval,
        flags["--strict"],
        flags["--verbose"] or flags["-v"],
        flags["--widen-parents"],
        values["--map"],
        values["--state"],
        values["--proc-root"],
        values["--cgroup-root"],
    )


class PassResult(NamedTuple):
    """What one pass did: ``done`` for --verbose, ``notes`` always shown, ``failures``."""

    done: list[str]
    notes: list[str]
    failures: list[str]


def _save_if_changed(state_dir: str, path: str, old: Record, new: Record) -> None:
    """Write ``new`` unless it says what ``old`` says, or the record was removed meanwhile
    (poststop ran while we pinned: writing would bring back a stopped container's record)."""
    if record_doc(new) == record_doc(old) or not os.path.exists(path):
        return
    write_record(state_dir, new)


def follow_pass(opts: FollowOptions, full: bool = True) -> PassResult:
    """One pass over every record: forget the dead, re-pin what the map changed.

    ``full`` (``--once``, and every :data:`FULL_PASS_EVERY` seconds in the loop) also retries
    an entry whose pin failed before and cleans up temporaries; a loop pass leaves a known
    failure alone until the host publishes something else for that container.  The map is
    read only when some record is left to compare it with.
    """
    res = PassResult([], [], [])
    if full:
        remove_stale_temps(opts.state_dir)
    paths = list_records(opts.state_dir)
    if not paths:
        return res
    guest_map: GuestMap | None = None
    map_err: GuestError | None = None
    try:
        guest_map = read_map(opts.map_path)
    except GuestError as err:
        map_err = err
    live = 0
    for path in paths:
        try:
            rec = read_record(path)
        except GuestError as err:
            forget(path)
            res.failures.append(f"{err}; forgotten")
            continue
        if start_time(opts.proc, rec.pid) != rec.start_time:
            # Exited, or its pid now belongs to another process: either way not ours.
            if forget(path):
                res.done.append(f"container {rec.container}: process {rec.pid} is gone; forgotten")
            continue
        live += 1
        if guest_map is None:
            continue
        try:
            entry = lookup(guest_map, rec.container)
        except GuestError as err:
            res.failures.append(str(err))
            continue
        if entry is None or rec.applied(entry):
            continue  # not mapped (any more): leave it as it is, like the hook
        if not full and rec.failed == (entry.generation, entry.guest_cpus):
            continue
        try:
            if rec.method is None:  # never applied: find its cgroup as the hook would
                result = pin(
                    opts.proc, opts.cgroup_root, rec.pid, entry.guest_cpus, opts.widen_parents
                )
            else:  # where the hook pinned it: that cgroup, else that process tree
                result = pin_with(
                    opts.proc, rec.pid, entry.guest_cpus, rec.cgroup, opts.widen_parents
                )
        except GuestError as err:
            res.failures.append(
                f"container {rec.container}: vCPUs {format_cpus(entry.guest_cpus)} "
                f"(generation {entry.generation}): {err}"
            )
            failed = rec._replace(failed=(entry.generation, entry.guest_cpus), by="follow")
            try:
                _save_if_changed(opts.state_dir, path, rec, failed)
            except GuestError as err2:
                res.failures.append(str(err2))
            continue
        res.done.append(
            f"container {rec.container} re-pinned to vCPUs {format_cpus(entry.guest_cpus)} "
            f"(generation {entry.generation}; {result.method}: {result.where}, "
            f"{result.tasks} tasks)"
        )
        res.notes.extend(f"container {rec.container}: {n}" for n in result.notes)
        new = rec._replace(
            method=result.method,
            cgroup=result.cgroup,
            guest_cpus=entry.guest_cpus,
            generation=entry.generation,
            failed=None,
            by="follow",
        )
        try:
            _save_if_changed(opts.state_dir, path, rec, new)
        except GuestError as err:
            res.failures.append(f"re-pinned, but {err}")
    if map_err is not None and live:
        res.failures.insert(0, str(map_err))
    return res


def _stat_key(path: str) -> tuple[int, int, int] | None:
    """(inode, mtime_ns, size), None when missing: changes whenever the file does.

    The host replaces the map by rename, so the inode changes even when a rewrite lands
    within one timestamp tick and keeps the size; for the state dir, a record written,
    replaced or removed changes the directory's mtime.
    """
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


class _Stop(BaseException):
    """Raised by the SIGTERM handler, only while the loop sleeps (never inside a pass)."""


def follow(opts: FollowOptions, say: Callable[[str], None]) -> int:
    """Run passes until SIGTERM/SIGINT (or one, with --once); the exit status.

    The loop is cheap when nothing changed: it stats the map and the state dir and compares
    them with the last pass before reading anything.  A failure line is printed when it
    first appears, not again on every pass while it lasts.
    """
    if opts.once:
        res = _guarded_pass(opts, True)
        _report(opts, res, say, set())
        return 1 if opts.strict and res.failures else 0

    state = {"stopping": False, "sleeping": False}

    def on_signal(signum: int, frame: FrameType | None) -> None:
        state["stopping"] = True
        if state["sleeping"]:
            raise _Stop

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    last_key: object = None
    last_full = float("-inf")
    said: set[str] = set()
    try:
        while not state["stopping"]:
            now = time.monotonic()
            full = now - last_full >= FULL_PASS_EVERY
            # Taken *before* the pass: a record the hook writes during it changes the key,
            # so the next look passes again (our own writes cost one extra, idle pass).
            key = (_stat_key(opts.map_path), _stat_key(opts.state_dir))
            if full or key != last_key:
                res = _guarded_pass(opts, full)
                said = _report(opts, res, say, said)
                last_key = key
                if full:
                    last_full = now
            state["sleeping"] = True
            if state["stopping"]:
                break
            time.sleep(opts.interval)
            state["sleeping"] = False
    except _Stop:
        pass
    return 0


def _guarded_pass(opts: FollowOptions, full: bool) -> PassResult:
    """A pass that turns any error into a failure line: the loop must outlive a bad pass."""
    try:
        return follow_pass(opts, full)
    except GuestError as err:
        return PassResult([], [], [str(err)])
    except Exception as err:  # a bug or an unforeseen OS error: report it, keep following
        return PassResult([], [], [f"unexpected {type(err).__name__}: {err}"])


def _report(
    opts: FollowOptions, res: PassResult, say: Callable[[str], None], said: set[str]
) -> set[str]:
    """Print a pass's lines; the failures printed (or still standing), for the next pass."""
    for line in res.done if opts.verbose else []:
        say(line)
    for line in res.notes:
        say(line)
    for line in res.failures:
        if line not in said:
            say(line)
    return set(res.failures)


def follow_main(args: list[str]) -> int:
    """``vmpin guest follow ARGS``; the exit status (2: bad usage)."""
    if "-h" in args or "--help" in args:
        print(FOLLOW_USAGE)
        return 0

    def say(line: str) -> None:
        print(f"vmpin guest follow: {line}", file=sys.stderr, flush=True)

    try:
        opts = parse_follow_args(args)
    except GuestError as err:
        say(str(err))
        return 2
    return follow(opts, say)


def run_as_file() -> None:
    """Run as one file (the zipapp of :mod:`vmpin.guest.bundle`): kata-agent execs a hook
    with argv [name, stage]; the shipped wrapper (hooks/kata-guest/.../vmpin-guest) with
    "guest hook STAGE", as for the package. The follower: "guest follow ARGS", or "follow ARGS".
    """
    argv = sys.argv[1:]
    if argv[:2] == ["guest", "follow"] or argv[:1] == ["follow"]:
        sys.exit(follow_main(argv[2:] if argv[0] == "guest" else argv[1:]))
    sys.exit(main(argv[2:] if argv[:2] == ["guest", "hook"] else argv))


if __name__ == "__main__":
    run_as_file()
