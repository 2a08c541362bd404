"""What runc itself believes about a container: its ``state.json`` under runc's root.

Why vmpin reads it: ``runc update --cpuset-cpus`` rewrites the container's cgroup and fires no
hook, so a changed ``cpuset.cpus`` alone cannot tell a legitimate update (kubelet, through the
CRI, through runc) from drift (something wrote the cgroup behind runc's back).  runc records
every update in its state first, so comparing the two tells them apart: runc's state changed
-> adopt it; only the cgroup changed -> drift, repair it.

The file (runc 1.1.5, checked on a real container before and after ``runc update``)::

    <runc root>/<container id>/state.json          mode 0600, rewritten by rename
    {
      "id": "...", "init_process_pid": 7288, "init_process_start": 31829,
      "config": {"cgroups": {"name": "...", "path": "", ...,
                             "cpuset_cpus": "0-1", "cpuset_mems": "0", ...}},
      "cgroup_paths": {"cpuset": "/sys/fs/cgroup/cpuset/<id>",
                       "": "/sys/fs/cgroup/unified/<id>", ...}
    }

The CPU list is at ``config.cgroups.cpuset_cpus``: runc's ``configs.Cgroup`` embeds
``*Resources`` without a JSON name, so the resource fields sit inline, not under a
``resources`` key.  ``runc update --cpuset-cpus 1`` changes it to ``"1"`` (and, as a side
effect of runc 1.1, resets ``cpuset_mems`` to ``""`` when ``--cpuset-mems`` is not given; the
cgroup's own cpuset.mems stays).

``""`` means "runc says nothing", not "no CPU set" nor "the cgroup's CPUs": ``runc update
--memory 64M CTR`` (any update without ``--cpuset-cpus``) rewrites the state with
``cpuset_cpus: ""`` while the cgroup keeps its CPUs (runc skips empty fields when writing the
cgroup), and a container created without a cpuset inherited its parent's.  :func:`runc_cpus`
returns ``""`` then, and the plan adopts nothing from it (``reconcile.plan.refresh``).  Taking
the cgroup's own value as runc's (as vmpin did before issue 26) laundered drift: a hand edit
of the cgroup after such an update was adopted as ``source runc`` and never repaired.  A
nested ``config.cgroups.resources`` is read as a fallback in case a future runc names the
struct.

runc stores ``--cpuset-cpus`` verbatim and the kernel accepts more than the plain list
("0-7:2/4", "1,,0", "N"), so the value is parsed with the kernel's grammar
(:meth:`CpuSet.parse_kernel`) and returned in the normal form.

``init_process_start`` is the init's start time in clock ticks (``/proc/PID/stat`` field 22):
with the pid it identifies the process, so a reused pid is not mistaken for the container.

Where runc's root is: plain ``runc`` (and podman, CRI-O) default to ``/run/runc``; containerd's
runc shim runs ``runc --root <Root>/<namespace>`` with ``Root`` from the handler's runc options,
default ``/run/containerd/runc`` (containerd 1.6 ``pkg/process/init.go`` ``NewRunc``), so a
Kubernetes node's containers live in ``/run/containerd/runc/k8s.io``.  ``paths.runc_root`` is
therefore a search list (:func:`runc_roots`): roots separated by ``:``, an entry ending in
``/*`` standing for every directory in it (containerd's namespaces).  The default covers both
without configuration.
"""

from __future__ import annotations

import os

from vmpin.core.cpuset import CpuSet
from vmpin.core.errors import (
    CpuSetError,
    HostError,
    ProcessGone,
    RuntimeKindError,
    SpecError,
)
from vmpin.core.ids import check_id
from vmpin.linux import procfs
from vmpin.linux.files import load_json, read_host_file
from vmpin.linux.paths import HostPaths

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.lean.records)
if TYPE_CHECKING:
    from typing import Any


def runc_roots(paths: HostPaths) -> list[str]:
    """Every runc root ``paths.runc_root`` names, in its order (``DIR/*``: DIR's subdirectories).

    Evaluated on each call: containerd creates a namespace's directory with its first
    container.  A ``DIR/*`` whose DIR is missing names nothing (no containerd on the node).
    """
    roots: list[str] = []
    for entry in paths.runc_root.split(":"):
        if not entry:
            continue
        if entry.endswith("/*"):
            parent = entry[:-2] or "/"
            try:
                with os.scandir(parent) as it:
                    found = sorted(e.path for e in it if e.is_dir(follow_symlinks=False))
            except OSError:
                continue
            roots.extend(found)
        else:
            roots.append(entry)
    return roots


def state_path(paths: HostPaths, container_id: str) -> str:
    """The container's state.json in the first root that has it (else under the first root).

    Container ids are unique per runc root only; the first root listed wins, so list the
    one that matters most first (the default lists ``/run/runc`` before containerd's).
    """
    name = check_id(container_id, "container id")
    roots = runc_roots(paths)
    for root in roots:
        path = os.path.join(root, name, "state.json")
        if os.path.exists(path):
            return path
    return os.path.join(roots[0] if roots else paths.runc_root, name, "state.json")


def read_state(paths: HostPaths, container_id: str) -> dict[str, Any] | None:
    """runc's state of the container as JSON, None when runc has none (not runc's, deleted)."""
    path = state_path(paths, container_id)
    read = read_host_file(path, "runc state", HostError, RuntimeKindError)
    if read is None:
        return None
    try:
        state = load_json(read[0], f"runc state {path}")
    except SpecError as err:
        raise RuntimeKindError(str(err)) from None
    if not isinstance(state, dict):
        raise RuntimeKindError(f"runc state {path}: expected a JSON object")
    return state


def _cgroup_config(state: dict[str, Any]) -> dict[str, Any]:
    config = state.get("config")
    cgroups = config.get("cgroups") if isinstance(config, dict) else None
    return cgroups if isinstance(cgroups, dict) else {}


def runc_cpus(paths: HostPaths, container_id: str) -> str | None:
    """The container's CPUs as runc last applied them, in the normal list form.

    None when runc has no state for the container; ``""`` when runc's state holds no cpuset
    (created without one, or an update that did not touch it): runc says nothing about the
    CPUs then.  Raises :class:`RuntimeKindError` naming the state file for a value the kernel
    would refuse.
    """
    state = read_state(paths, container_id)
    if state is None:
        return None
    cgroups = _cgroup_config(state)
    value = cgroups.get("cpuset_cpus")
    if value is None:
        nested = cgroups.get("resources") or cgroups.get("Resources")
        value = nested.get("cpuset_cpus") if isinstance(nested, dict) else None
    path = state_path(paths, container_id)
    if value is not None and not isinstance(value, str):
        raise RuntimeKindError(f"runc state {path}: config.cgroups.cpuset_cpus is not a string")
    if not value or not value.strip():
        return ""
    try:
        return CpuSet.parse_kernel(value, _nr_cpu_ids(paths)).to_list()
    except CpuSetError as err:
        raise RuntimeKindError(f"runc state {path}: config.cgroups.cpuset_cpus: {err}") from None


def _nr_cpu_ids(paths: HostPaths) -> int | None:
    """nr_cpu_ids, the bitmap size the kernel parses cpuset.cpus against: possible's last + 1."""
    try:
        with open(os.path.join(paths.sys, "devices/system/cpu/possible")) as f:
            return CpuSet.parse(f.read()).sorted()[-1] + 1
    except (OSError, CpuSetError, IndexError):
        return None


def runc_init_pid(paths: HostPaths, container_id: str) -> int | None:
    """The container's init pid, if runc has state for it and that process still exists.

    The pid is checked against ``init_process_start``: after the container died its pid
    may name an unrelated process, which must never be pinned (or killed) in its stead.
    """
    state = read_state(paths, container_id)
    if state is None:
        return None
    pid = state.get("init_process_pid")
    start = state.get("init_process_start")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return None
    try:
        alive_since = procfs.start_time(paths.proc, pid)
    except ProcessGone:
        return None
    if isinstance(start, int) and start != alive_since:
        return None
    return pid


def runc_cgroup_paths(paths: HostPaths, container_id: str) -> dict[str, str]:
    """Where runc put the container's cgroups, by controller ("" is the v2 hierarchy).

    Absolute host paths as runc saw them (not under ``paths.cgroup``): the ground truth for
    a runc container whatever layout put it there.  Empty when runc has no state.
    """
    state = read_state(paths, container_id)
    found = state.get("cgroup_paths") if state is not None else None
    if not isinstance(found, dict):
        return {}
    return {k: v for k, v in found.items() if isinstance(k, str) and isinstance(v, str)}
