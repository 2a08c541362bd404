"""Read kubelet's CPU manager checkpoint (``/var/lib/kubelet/cpu_manager_state``), never write it.

Why: kubelet's static policy decides every container's CPUs and re-sends shared containers'
cpusets through the CRI as the shared pool changes; the checkpoint is where that decision is
written down.  For a container whose runtime cannot apply a cpuset (a Kata VM) it is the one
place the decision is visible on the node, and it tells vmpin the shared pool a sandbox with
no exclusive CPUs should float over.

Formats read (kubelet's pkg/kubelet/cm/cpumanager/state/checkpoint.go)::

    v2 (kubelet >= 1.12)   {"policyName": "static", "defaultCpuSet": "0-7,14-15",
                            "entries": {"<pod uid>": {"<container name>": "8-13"}},
                            "checksum": 1234}
    v1                     {"policyName": "static", "defaultCpuSet": "0-7",
                            "entries": {"<container id>": "8-13"}, "checksum": 1234}
    policy "none"          {"policyName": "none", "defaultCpuSet": "", "checksum": 1234}

``entries`` is ``omitempty``: a static checkpoint with no exclusive assignment has none, in
either version.  Newer kubelets add keys (``podEntries``, ``data``, ``dataChecksum``) and keep
the fields above at the top level for older readers; vmpin reads only those.  The checksum is
FNV over a Go-specific dump of the struct: it is not verified (vmpin cannot reproduce it
faithfully) and never recomputed, because vmpin never writes the file.

kubelet rewrites the file by rename, so a reader sees a whole old or a whole new file.
"""

from __future__ import annotations

import errno
import os

from vmpin.core.cpuset import CpuSet
from vmpin.core.errors import CpuSetError, KubeError, PermissionDenied, SpecError
from vmpin.linux.files import load_json, read_bytes

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.core._lean)
if TYPE_CHECKING:
    from typing import Any, Mapping, NamedTuple
else:
    from vmpin.core._lean import NamedTuple

STATIC = "static"


class Checkpoint(NamedTuple):
    """One reading of the checkpoint.

    ``entries`` maps pod uid -> container name -> exclusive CPUs (v2).  A v1 file keys its
    entries by container id instead; those land in ``by_container_id``.  ``mtime_ns`` lets a
    watcher skip a file it has already read.  (A NamedTuple: no ``dataclasses`` on the hook
    path.)
    """

    policy: str
    default: CpuSet
    entries: dict[str, dict[str, CpuSet]]
    mtime_ns: int
    by_container_id: Mapping[str, CpuSet] = {}


def read_checkpoint(path: str) -> Checkpoint | None:
    """Parse the checkpoint at ``path``; None when there is none (no CPU manager state yet).

    Raises :class:`KubeError` naming the path and the field for a malformed file, and
    :class:`PermissionDenied` when it cannot be read.
    """
    try:
        mtime_ns = os.stat(path).st_mtime_ns
        raw = read_bytes(path, what="kubelet checkpoint")
    except FileNotFoundError:
        return None
    except OSError as err:
        if err.errno in (errno.EACCES, errno.EPERM):
            raise PermissionDenied(f"permission denied reading kubelet checkpoint {path}") from err
        raise KubeError(f"reading kubelet checkpoint {path}: {err.strerror}") from err
    except SpecError as err:  # a FIFO, device or huge file where the checkpoint should be
        raise KubeError(str(err)) from None
    try:
        doc = load_json(raw, f"kubelet checkpoint {path}")
    except SpecError as err:
        raise KubeError(str(err)) from None
    return _parse(doc, path, mtime_ns)


def _parse(doc: Any, path: str, mtime_ns: int) -> Checkpoint:
    def bad(where: str, why: str) -> KubeError:
        return KubeError(f"kubelet checkpoint {path}: field {where!r}: {why}")

    def cpus(value: Any, where: str) -> CpuSet:
        if not isinstance(value, str):
            raise bad(where, f"expected a CPU list string, got {type(value).__name__}")
        try:
            return CpuSet.parse(value)
        except CpuSetError as err:
            raise bad(where, str(err)) from err

    if not isinstance(doc, dict):
        raise KubeError(f"kubelet checkpoint {path}: expected a JSON object")
    policy = doc.get("policyName")
    if not isinstance(policy, str) or not policy:
        raise bad("policyName", "missing" if policy is None else "expected a non-empty string")
    if "defaultCpuSet" not in doc:
        raise bad("defaultCpuSet", "missing")
    default = cpus(doc["defaultCpuSet"], "defaultCpuSet")
    raw_entries = doc.get("entries")
    if raw_entries is None:
        raw_entries = {}
    if not isinstance(raw_entries, dict):
        raise bad("entries", f"expected an object, got {type(raw_entries).__name__}")
    entries: dict[str, dict[str, CpuSet]] = {}
    by_id: dict[str, CpuSet] = {}
    for key, value in raw_entries.items():
        if isinstance(value, str):  # v1: container id -> cpus
            by_id[key] = cpus(value, f"entries.{key}")
        elif isinstance(value, dict):  # v2: pod uid -> container name -> cpus
            entries[key] = {name: cpus(c, f"entries.{key}.{name}") for name, c in value.items()}
        else:
            raise bad(f"entries.{key}", "expected an object of container name -> CPU list")
    checksum = doc.get("checksum")
    if checksum is not None and (not isinstance(checksum, int) or isinstance(checksum, bool)):
        raise bad("checksum", f"expected an integer, got {type(checksum).__name__}")
    return Checkpoint(policy, default, entries, mtime_ns, by_id)


def cpus_for(cp: Checkpoint, pod_uid: str, container_name: str) -> CpuSet | None:
    """The CPUs kubelet gives a container, or None when the checkpoint does not say.

    - an entry for (pod uid, container name): its exclusive CPUs;
    - otherwise, under the static policy, ``defaultCpuSet``: the shared pool every container
      without an exclusive assignment runs on (the caller vouches that this is a pod's
      container: the checkpoint lists only the exclusive ones, so it cannot tell a shared
      container from one it never heard of);
    - under any other policy ("none"), or when the shared pool is empty (kubelet has not
      initialised it): None, kubelet pins nothing and vmpin should not invent a set.
    """
    exclusive = cp.entries.get(pod_uid, {}).get(container_name)
    if exclusive:
        return exclusive
    if cp.policy == STATIC and cp.default:
        return cp.default
    return None
