"""Find, read and write a container's cpuset cgroup, on cgroup v1 and v2.


runc applies a container's ``linux.resources.cpu.cpus`` by writing ``cpuset.cpus`` of the
container's cgroup; so for a runc container the cgroup *is* the pinning, and vmpin reads and
repairs it there rather than with sched_setaffinity (which the cgroup would override the next
time anything rewrites it).

Where the cgroup lives (every root comes from :class:`~vmpin.linux.paths.HostPaths`, so tests can
point this module at fixture trees):

- v1: the cpuset hierarchy is mounted at ``<cgroup>/cpuset``; a cgroup's path relative to it
  is the third field of the ``cpuset`` line in ``/proc/PID/cgroup``.
- v2: the unified hierarchy is ``<cgroup>`` itself when ``<cgroup>/cgroup.controllers``
  exists (pure v2), else ``<cgroup>/unified`` (hybrid: systemd mounts v2 there, usually with
  no controllers); the path is the ``0::`` line.  A v2 cgroup only has cpuset files when its
  parent enabled the controller (``cpuset`` listed in its own ``cgroup.controllers``).

A v1 cpuset line wins over v2: a controller is bound to one hierarchy at a time, so when v1
has cpuset, v2's cgroup for the same process has none.

The layouts :func:`find_container_cgroup` knows when no pid is at hand (FACTS.md):

========================  ======================================================================
runc, no cgroupsPath      ``/<id>`` below runc's own cgroup (``/<id>`` when runc runs in the root)
kubelet, cgroupfs driver  ``/kubepods[/burstable|/besteffort]/pod<uid>/<id>`` (CRI-O: ``crio-<id>``)
kubelet, systemd driver   ``/kubepods.slice[/kubepods-<qos>.slice]/kubepods[-<qos>]-pod<u>.slice``
                          ``/{cri-containerd,crio,docker}-<id>.scope`` (u: uid, ``-`` -> ``_``)
docker, cgroupfs          ``/docker/<id>``
========================  ======================================================================

``CgroupRef.rel`` is always in the form ``/proc/PID/cgroup`` uses: it starts with ``/``, and
the hierarchy's root is ``/``.

OSErrors are translated here, once, naming the file: ENOENT (the cgroup was removed, i.e. the
container is gone) -> :class:`ProcessGone`; EACCES/EPERM -> :class:`PermissionDenied` unless
the kernel meant something else (see :func:`write_cpus`); every refusal of a CPU list ->
:class:`AffinityRejected`.
"""

from __future__ import annotations

import errno
import os

from vmpin.core.cpuset import CpuSet
from vmpin.core.errors import AffinityRejected, HostError, PermissionDenied, ProcessGone
from vmpin.core.ids import check_id
from vmpin.linux import procfs
from vmpin.linux.paths import HostPaths

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.lean.records)
if TYPE_CHECKING:
    from typing import NamedTuple
else:
    from vmpin.lean.records import NamedTuple

#: the file names that differ between the two versions: (v1, v2).
_CPUS = ("cpuset.cpus", "cpuset.cpus")
_EFFECTIVE = ("cpuset.effective_cpus", "cpuset.cpus.effective")
_THREADS = ("tasks", "cgroup.threads")
_PROCS = ("cgroup.procs", "cgroup.procs")

#: systemd scope prefixes of the container runtimes that vmpin meets on a node.
SCOPE_PREFIXES = ("cri-containerd", "crio", "docker")
#: kubelet's QoS tiers below kubepods; "" is Guaranteed (pods directly under kubepods).
QOS_CLASSES = ("", "burstable", "besteffort")


class CgroupRef(NamedTuple):
    """One cgroup: its hierarchy version, its absolute directory, its path in the hierarchy.

    A NamedTuple rather than a dataclass, as everywhere on the hook path: importing
    ``dataclasses`` costs the hook ~10 ms.
    """

    version: int
    path: str
    rel: str

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)


# -- where the hierarchies are -------------------------------------------------------------
def v1_root(paths: HostPaths) -> str:
    """The cgroup v1 cpuset hierarchy's mount point."""
    return os.path.join(paths.cgroup, "cpuset")


def v2_root(paths: HostPaths) -> str:
    """The unified hierarchy: the cgroup root itself (pure v2) or its ``unified`` (hybrid)."""
    if os.path.exists(os.path.join(paths.cgroup, "cgroup.controllers")):
        return paths.cgroup
    return os.path.join(paths.cgroup, "unified")


def _ref(version: int, root: str, rel: str) -> CgroupRef | None:
    """A ref to ``root``+``rel`` if it is a directory holding cpuset files, else None."""
    rel = "/" + rel.strip("/")
    path = os.path.normpath(os.path.join(root, rel.lstrip("/")))
    if version == 1:
        return CgroupRef(1, path, rel) if os.path.exists(os.path.join(path, _CPUS[0])) else None
    if "cpuset" in _read_words(os.path.join(path, "cgroup.controllers")):
        return CgroupRef(2, path, rel)
    return None


def _read_words(path: str) -> list[str]:
    try:
        with open(path) as f:
            return f.read().split()
    except OSError:
        return []


# -- lookups -------------------------------------------------------------------------------
def cgroup_of_pid(paths: HostPaths, pid: int) -> CgroupRef | None:
    """The cpuset cgroup ``pid`` is in, or None when no hierarchy gives it a cpuset.

    Raises :class:`ProcessGone` when the process does not exist (any more).
    """
    v2_rel: str | None = None
    for hid, controllers, rel in procfs.cgroup_lines(paths.proc, pid):
        # A process whose cgroup was removed under it shows "/path (deleted)" (v2).
        rel = rel.removesuffix(" (deleted)")
        if hid == "0" and controllers == "":
            v2_rel = rel
        elif "cpuset" in controllers.split(","):
            # Usually mounted at <cgroup>/cpuset; a co-mounted hierarchy ("cpu,cpuset") sits
            # at a directory named after its controller list.
            for mount in ("cpuset", controllers):
                ref = _ref(1, os.path.join(paths.cgroup, mount), rel)
                if ref is not None:
                    return ref
    if v2_rel is not None:
        return _ref(2, v2_root(paths), v2_rel)
    return None


def ref_from_rel(paths: HostPaths, rel: str) -> CgroupRef | None:
    """A cgroup remembered by its ``rel`` (as stored by vmpin), looked up again.

    v1 first, as everywhere here; None when neither hierarchy has it with cpuset files (the
    container's cgroup was removed, or the host was rebooted into another layout).
    """
    return _ref(1, v1_root(paths), rel) or _ref(2, v2_root(paths), rel)


def candidate_paths(container_id: str, pod_uid: str | None = None) -> list[str]:
    """Relative cgroup paths (glob patterns when ``pod_uid`` is unknown) a container may have.

    Order: the plain runc/containerd layout first, then kubelet's cgroupfs layouts, then the
    systemd driver's, Guaranteed before Burstable before BestEffort.
    """
    check_id(container_id, "container id")
    if pod_uid is not None:
        check_id(pod_uid, "pod uid")
    uid = pod_uid if pod_uid is not None else "*"
    # systemd escapes "-" in unit names, so kubelet writes the pod uid with "_".
    uid_ = uid.replace("-", "_")
    out = [f"/{container_id}", f"/docker/{container_id}"]
    for qos in QOS_CLASSES:
        tier = f"/kubepods/{qos}" if qos else "/kubepods"
        out.append(f"{tier}/pod{uid}/{container_id}")
        out.append(f"{tier}/pod{uid}/crio-{container_id}")
    for qos in QOS_CLASSES:
        if qos:
            slice_dir = f"/kubepods.slice/kubepods-{qos}.slice/kubepods-{qos}-pod{uid_}.slice"
        else:
            slice_dir = f"/kubepods.slice/kubepods-pod{uid_}.slice"
        out.extend(f"{slice_dir}/{prefix}-{container_id}.scope" for prefix in SCOPE_PREFIXES)
    return out


def _glob_star(root: str, rel: str) -> list[str]:
    """``sorted(glob.glob(glob.escape(root) + rel))`` for a ``rel`` whose one ``*`` stands for
    the pod uid inside one path component (:func:`candidate_paths`).

    By hand: glob imports re, fnmatch and contextlib (~3 ms of a hook that re-plans the node
    in-process).  As glob: the ``*`` matches any run of characters within the component but
    not a hidden name (the fixed part before it never starts with a dot here), and each match
    must exist (``lexists``)."""
    parts = rel.split("/")
    at = next(i for i, p in enumerate(parts) if "*" in p)
    head, _, tail = parts[at].partition("*")
    parent = root + "/".join(parts[:at])
    rest = "/".join(parts[at + 1 :])
    try:
        names = os.listdir(parent or "/")
    except OSError:
        return []
    out = []
    for name in names:
        if (name.startswith(head) and name.endswith(tail) and len(name) >= len(head) + len(tail)
                and not name.startswith(".")):  # fmt: skip
            path = f"{parent}/{name}/{rest}" if rest else f"{parent}/{name}"
            if os.path.lexists(path):
                out.append(path)
    return sorted(out)


def find_container_cgroup(
    paths: HostPaths,
    container_id: str,
    pod_uid: str | None = None,
    pid: int | None = None,
) -> CgroupRef | None:
    """The cpuset cgroup of a container: by its pid when it has one, else by known layouts.

    A pid in the hierarchy's root cgroup tells nothing about the container (the cpuset
    controller is not bound to it, or the pid is a runtime's own process, e.g. a Kata shim),
    and writing the root would repin the whole host; so that answer falls through to the
    layouts.  A pid that has exited falls through too.
    """
    if pid is not None:
        try:
            ref = cgroup_of_pid(paths, pid)
        except ProcessGone:
            ref = None
        if ref is not None and ref.rel != "/":
            return ref
    roots = ((1, v1_root(paths)), (2, v2_root(paths)))
    for rel in candidate_paths(container_id, pod_uid):
        for version, root in roots:
            if "*" in rel:
                matches = _glob_star(root, rel)
                found = (_ref(version, root, m[len(root) :]) for m in matches)
                ref = next((r for r in found if r is not None), None)
            else:
                ref = _ref(version, root, rel)
            if ref is not None:
                return ref
    return None


# -- reading and writing -------------------------------------------------------------------
def _translate(err: OSError, path: str, what: str) -> HostError:
    if err.errno in (errno.ENOENT, errno.ENODEV, errno.ESRCH):
        return ProcessGone(f"cgroup file {path} is gone (the container was removed?)")
    if err.errno in (errno.EACCES, errno.EPERM):
        return PermissionDenied(f"permission denied {what} {path}")
    return HostError(f"{what} {path}: {err.strerror}")


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError as err:
        raise _translate(err, path, "reading") from err


def read_cpus(ref: CgroupRef) -> CpuSet:
    """``cpuset.cpus``: the CPUs asked for.  On v2 empty means "inherit the parent's"."""
    return CpuSet.parse(_read(ref.file(_CPUS[ref.version - 1])))


def read_effective(ref: CgroupRef) -> CpuSet:
    """The CPUs the cgroup's tasks may really use (asked for, within every ancestor's)."""
    return CpuSet.parse(_read(ref.file(_EFFECTIVE[ref.version - 1])))


def _ids(path: str) -> list[int]:
    return sorted({int(line) for line in _read(path).split()})


def tasks(ref: CgroupRef) -> list[int]:
    """Every thread id in the cgroup (v1 ``tasks``, v2 ``cgroup.threads``), sorted."""
    return _ids(ref.file(_THREADS[ref.version - 1]))


def procs(ref: CgroupRef) -> list[int]:
    """Every process (thread-group leader) id in the cgroup, sorted."""
    return _ids(ref.file(_PROCS[ref.version - 1]))


def parent(ref: CgroupRef) -> CgroupRef | None:
    """The parent cgroup, None for the hierarchy's root."""
    if ref.rel == "/":
        return None
    rel = os.path.dirname(ref.rel)
    return CgroupRef(ref.version, os.path.dirname(ref.path), rel)


def write_cpus(ref: CgroupRef, cpus: CpuSet) -> None:
    """Set ``cpuset.cpus`` and read it back.

    Why each refusal happens, so the message can say it (cpuset(7), kernel/cgroup/cpuset.c):

    - v1 requires a child's CPUs to lie within its parent's and answers EACCES (not EINVAL!)
      when they do not; that is not a permission problem, so it is reported as
      :class:`AffinityRejected` naming the parent, which must be widened first;
    - EBUSY: v1 again, a child cgroup still uses a CPU this write would take away (or an
      exclusive sibling holds it);
    - ERANGE / EINVAL: a CPU that is offline or does not exist;
    - ENOSPC: an empty cpuset while tasks are attached.
    """
    path = ref.file(_CPUS[ref.version - 1])
    text = cpus.to_list()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    except OSError as err:
        raise _write_error(ref, cpus, path, err) from err
    try:
        _take_turn(fd)
        try:
            os.ftruncate(fd, 0)
            os.write(fd, (text + "\n").encode())
        except OSError as err:
            raise _write_error(ref, cpus, path, err) from err
        actual = read_cpus(ref)
    finally:
        os.close(fd)  # (and the turn with it)
    if actual != cpus:
        raise AffinityRejected(f"{path}: wrote {text or '(empty)'}, kernel kept {actual}")


#: how long a write waits for another holder of the file's lock before it goes on without it
TURN_WAIT = 0.1


def _take_turn(fd: int) -> None:
    """Wait (briefly) for the other vmpin writers of this cgroup file: flock(2) on it.

    Passes past their budget run without the node's plan lock (vmpin.reconcile.reconciler),
    so two may write one container's cpuset at once.  In turns, each read-back sees its own
    write, never the other's (which it would report as the kernel refusing the set), and a
    tree of plain files -- a node's fixture -- never ends with two writes interleaved
    ("0-91" then "0" over it read "0\n91"), as the kernel's one-write-per-call files never
    do.  Anyone who can read the file can lock it, so the wait is bounded: past
    :data:`TURN_WAIT` the write goes on without its turn, as it did before turns.
    """
    import fcntl
    import time

    give_up = time.monotonic() + TURN_WAIT
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except OSError as err:
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EINTR):
                return  # a file system without flock: no turns to take
        if time.monotonic() >= give_up:
            return
        time.sleep(0.002)


def _write_error(ref: CgroupRef, cpus: CpuSet, path: str, err: OSError) -> HostError:
    text = cpus.to_list() or "(empty)"
    if err.errno in (errno.EACCES, errno.EPERM) and ref.version == 1:
        up = parent(ref)
        if up is not None:
            try:
                allowed = read_cpus(up)
            except HostError:
                allowed = None
            if allowed is not None and not cpus.issubset(allowed):
                return AffinityRejected(
                    f"cannot set {path} to {text}: cgroup v1 keeps a child's CPUs within its "
                    f"parent's, and {up.file(_CPUS[0])} is {allowed or '(empty)'} "
                    f"(widen the parent first)"
                )
    if err.errno == errno.EBUSY:
        return AffinityRejected(
            f"cannot set {path} to {text}: a child cgroup or an exclusive sibling "
            f"still uses a CPU it would remove (EBUSY)"
        )
    if err.errno in (errno.ERANGE, errno.EINVAL):
        return AffinityRejected(f"cannot set {path} to {text}: offline or nonexistent CPU")
    if err.errno == errno.ENOSPC:
        return AffinityRejected(f"cannot set {path} to {text}: tasks are attached (ENOSPC)")
    return _translate(err, path, "writing")
