"""Read kubelet's CPU manager checkpoint (``/var/lib/kubelet/cpu_manager_state``), never write it.

Why: kubelet's static policy decides every container's CPUs and re-sends shared containers'
cpusets through the CRI as the shared pool changes; the checkpoint is where that decision is
written down.  For a container whose runtime cannot apply a cpuset (a Kata VM) it is the one
place the decision is visible on the node, and it tells vmpin the shared pool a sandbox with
no exclusive CPUs should float over.

Read as kubelet reads it (pkg/kubelet/cm/cpumanager/state/checkpoint.go and
state_checkpoint.go, kubernetes master 2025; keys matched as Go's encoding/json matches them,
see :mod:`vmpin.core.gojson`)::

    v1 (< 1.12)  {"policyName","defaultCpuSet","entries": {"<container id>": "8-13"},"checksum"}
    v2           {"policyName","defaultCpuSet","entries": {"<pod uid>": {"<name>": "8-13"}},
                  "checksum"}
    v3           v2 + "podEntries": {"<pod uid>": {"cpuSet": "2-5"}}   (pod-level resources)
    v4           v3 at the top level with "checksum": 0, for older kubelets, plus
                 "data": "<the v3 fields as a JSON string>", "dataChecksum": N

A v4 file (``data`` or ``dataChecksum`` set) is read from ``data`` only: kubelet treats it as
authoritative and the top-level copy may be stale.  ``entries``/``podEntries`` are omitempty.
A ``none`` policy file has an empty ``defaultCpuSet`` and pins nothing.

Checksums, reproduced exactly (FNV-32a over a go-spew ``%#v`` dump with SortKeys, the form
``checksum.New`` / ``hashutil.DeepHashObject`` / ``dump.ForHash`` hash):

- ``dataChecksum`` = fnv32a("(string)" + data);
- ``checksum`` = fnv32a("(*state.<Name>){PolicyName:(string)... Checksum:(checksum.Checksum)0}")
  where kubelet accepts the v1 struct (``Entries`` a ``map[string]string``), the v2 struct and
  the v3 struct (with ``PodEntries``), each under its own type name or renamed
  ``CPUManagerCheckpoint`` (the rollback-compatible form); 0 means "no checksum" (old file
  backend) and is accepted, but then ``podEntries`` are ignored as kubelet's v2 reader does.

A file kubelet would refuse (bad checksum, wrong JSON types, unparsable CPU list, a policy
name missing) raises :class:`KubeError`, one line naming the path and what is wrong.  The
caller then keeps the last checkpoint it read successfully (see :class:`CheckpointReader`);
a process that never read a good one has none: vmpin applies no kubelet decision (containers
keep the CPUs their runtime reported) until kubelet rewrites the file.  kubelet itself
refuses to start on such a file.

kubelet rewrites the file by rename, so a reader sees a whole old or a whole new file.
"""

from __future__ import annotations

import os

from vmpin.core import gojson
from vmpin.core.cpuset import CpuSet
from vmpin.core.errors import CpuSetError, KubeError, SpecError
from vmpin.linux.files import load_json, read_host_file

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.lean.records)
if TYPE_CHECKING:
    from typing import Any, Mapping, NamedTuple
else:
    from vmpin.lean.records import NamedTuple

STATIC = "static"

#: JSON names of the fields of kubelet's checkpoint structs (v4 = v3 + data).
_V3_FIELDS = ("policyName", "defaultCpuSet", "entries", "podEntries", "checksum")
_V4_FIELDS = (*_V3_FIELDS, "data", "dataChecksum")
_DATA_FIELDS = ("policyName", "defaultCpuSet", "entries", "podEntries")
_MAX_U64 = (1 << 64) - 1


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
    #: pod uid -> the pod's CPUs (v3/v4 ``podEntries``, pod-level resource managers)
    pods: Mapping[str, CpuSet] = {}


def read_checkpoint(path: str) -> Checkpoint | None:
    """Parse and verify the checkpoint at ``path``; None when there is none.

    Raises :class:`KubeError` naming the path and the field for a file kubelet would refuse,
    and :class:`PermissionDenied` when it cannot be read.
    """
    read = read_host_file(path, "kubelet checkpoint", KubeError, KubeError)
    return None if read is None else parse_checkpoint(read[0], path, read[1])


def parse_checkpoint(raw: str | bytes, path: str, mtime_ns: int = 0) -> Checkpoint:
    """The checkpoint in ``raw`` (the file's bytes), as kubelet would restore it."""
    try:
        doc = load_json(raw, f"kubelet checkpoint {path}", object_pairs_hook=gojson.Obj)
    except SpecError as err:
        raise KubeError(str(err)) from None
    return _Decoder(path).checkpoint(doc, mtime_ns)


class _Decoder:
    def __init__(self, path: str) -> None:
        self.path = path

    def bad(self, where: str, why: str) -> KubeError:
        return KubeError(f"kubelet checkpoint {self.path}: field {where!r}: {why}")

    # -- Go's decoding of one struct field -------------------------------------------------
    def string(self, obj: Any, name: str, fields: tuple[str, ...], where: str) -> str:
        out = ""
        for value in gojson.field_values(obj, name, fields):
            if value is None:  # null leaves a Go string as it was
                continue
            if not isinstance(value, str):
                raise self.bad(where, f"expected a string, got {type(value).__name__}")
            out = value
        return out

    def u64(self, obj: Any, name: str, fields: tuple[str, ...]) -> int:
        out = 0
        for value in gojson.field_values(obj, name, fields):
            if value is None:
                continue
            # Go decodes into uint64 with ParseUint: no sign, fraction or exponent.
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= _MAX_U64:
                raise self.bad(name, f"expected an unsigned 64-bit integer, got {value!r}")
            out = value
        return out

    def string_map(self, value: Any, where: str) -> dict[str, str] | None:
        if value is None:
            return None
        if not isinstance(value, dict):
            raise self.bad(where, f"expected an object, got {type(value).__name__}")
        out: dict[str, str] = {}
        for key, item in value.pairs if isinstance(value, gojson.Obj) else value.items():
            if item is not None and not isinstance(item, str):
                raise self.bad(f"{where}.{key}", f"expected a CPU list string, got {item!r}")
            out[key] = item if item is not None else ""  # null decodes to the zero value
        return out

    def merged(self, obj: Any, name: str, fields: tuple[str, ...], nested: int) -> Any:
        """A map field: each occurrence merged into the last (null resets it to nil)."""
        out: dict[str, Any] | None = {}  # kubelet's constructors make() every map
        for value in gojson.field_values(obj, name, fields):
            if value is None:
                out = None
                continue
            if not isinstance(value, dict):
                raise self.bad(name, f"expected an object, got {type(value).__name__}")
            if out is None:
                out = {}
            pairs = value.pairs if isinstance(value, gojson.Obj) else value.items()
            for key, item in pairs:
                if nested == 2:  # map[string]map[string]string: an inner map is replaced
                    out[key] = self.string_map(item, f"{name}.{key}")
                elif nested == 1:  # map[string]string
                    if item is not None and not isinstance(item, str):
                        raise self.bad(f"{name}.{key}", f"expected a string, got {item!r}")
                    out[key] = item if item is not None else ""
                else:  # podEntries: map[string]PodEntry
                    if item is None:
                        out[key] = ""
                        continue
                    if not isinstance(item, dict):
                        raise self.bad(f"{name}.{key}", f"expected an object, got {item!r}")
                    out[key] = self.string(item, "cpuSet", ("cpuSet",), f"{name}.{key}.cpuSet")
        return out

    def cpus(self, value: str, where: str) -> CpuSet:
        # kubelet parses with k8s.io/utils/cpuset.Parse, the strict list grammar.
        try:
            return CpuSet.parse(value)
        except CpuSetError as err:
            raise self.bad(where, str(err)) from err

    # -- the checkpoint --------------------------------------------------------------------
    def checkpoint(self, doc: Any, mtime_ns: int) -> Checkpoint:
        if not isinstance(doc, dict):
            raise KubeError(f"kubelet checkpoint {self.path}: expected a JSON object")
        data = self.string(doc, "data", _V4_FIELDS, "data")
        data_sum = self.u64(doc, "dataChecksum", _V4_FIELDS)
        if data or data_sum:
            return self.v4(doc, data, data_sum, mtime_ns)
        return self.legacy(doc, mtime_ns)

    def v4(self, doc: Any, data: str, data_sum: int, mtime_ns: int) -> Checkpoint:
        self.fields(doc, _V4_FIELDS)  # the whole blob is decoded: type errors fail it
        if not data:
            raise self.bad("data", "missing while dataChecksum is set")
        actual = fnv32a("(string)" + data)
        if actual != data_sum:
            raise self.bad(
                "dataChecksum", f"{data_sum} does not match the data ({actual}): corrupted"
            )
        try:
            inner = load_json(data, f"kubelet checkpoint {self.path}: field 'data'",
                              object_pairs_hook=gojson.Obj)
        except SpecError as err:
            raise KubeError(str(err)) from None
        if not isinstance(inner, dict):
            raise self.bad("data", "expected a JSON object")
        policy, default, entries, pods = self.fields(inner, _DATA_FIELDS)
        return self.result(policy, default, entries, pods, mtime_ns)

    def fields(
        self, doc: Any, fields: tuple[str, ...]
    ) -> tuple[str, str, dict[str, Any] | None, dict[str, Any] | None]:
        policy = self.string(doc, "policyName", fields, "policyName")
        default = self.string(doc, "defaultCpuSet", fields, "defaultCpuSet")
        entries = self.merged(doc, "entries", fields, 2)
        pods = self.merged(doc, "podEntries", fields, 0)
        return policy, default, entries, pods

    def legacy(self, doc: Any, mtime_ns: int) -> Checkpoint:
        checksum = self.u64(doc, "checksum", _V4_FIELDS)
        raw_entries = [v for v in gojson.field_values(doc, "entries", _V4_FIELDS) if v]
        v1 = bool(raw_entries) and all(
            isinstance(v, dict) and all(isinstance(i, str) or i is None for i in v.values())
            for v in raw_entries
        )
        if v1:
            policy = self.string(doc, "policyName", _V4_FIELDS, "policyName")
            default = self.string(doc, "defaultCpuSet", _V4_FIELDS, "defaultCpuSet")
            flat = self.merged(doc, "entries", _V4_FIELDS, 1)
            if checksum and checksum != fnv32a(
                _dump_v1("CPUManagerCheckpoint", policy, default, flat)
            ):
                raise self.bad("checksum", f"{checksum} does not match the contents: corrupted")
            return self.result(policy, default, None, None, mtime_ns, by_id=flat or {})
        policy, default, entries, pods = self.fields(doc, _V3_FIELDS)
        if checksum:
            v3 = {fnv32a(_dump(n, policy, default, entries, pods)) for n in _V3_NAMES}
            if checksum not in v3:
                pods = None  # read as v2: kubelet's v2 struct has no podEntries
                v2 = {fnv32a(_dump(n, policy, default, entries)) for n in _V2_NAMES}
                if not entries:
                    v2.add(fnv32a(_dump_v1("CPUManagerCheckpoint", policy, default, entries)))
                if checksum not in v2:
                    raise self.bad("checksum", f"{checksum} does not match the contents: corrupted")
        else:
            pods = None  # "accept empty checksum" is the v1/v2 readers' rule only
        return self.result(policy, default, entries, pods, mtime_ns)

    def result(
        self,
        policy: str,
        default_text: str,
        entries: dict[str, Any] | None,
        pods: dict[str, Any] | None,
        mtime_ns: int,
        by_id: dict[str, str] | None = None,
    ) -> Checkpoint:
        if not policy:
            # kubelet refuses: the configured policy differs from "" (it is never empty).
            raise self.bad("policyName", "missing or empty")
        default = self.cpus(default_text, "defaultCpuSet")
        out: dict[str, dict[str, CpuSet]] = {}
        for uid, containers in (entries or {}).items():
            out[uid] = {
                name: self.cpus(text, f"entries.{uid}.{name}")
                for name, text in (containers or {}).items()
            }
        pod_cpus = {
            uid: self.cpus(text, f"podEntries.{uid}.cpuSet") for uid, text in (pods or {}).items()
        }
        ids = {cid: self.cpus(text, f"entries.{cid}") for cid, text in (by_id or {}).items()}
        return Checkpoint(policy, default, out, mtime_ns, ids, pod_cpus)


class CheckpointReader:
    """The checkpoint at one path, re-read when it changes, falling back to the last good one.

    :meth:`read` returns ``(checkpoint, error)``: on a file kubelet would refuse, the error
    line and the last checkpoint this reader parsed successfully (None if it never did).
    A missing file is not an error and forgets the last good one (kubelet starts afresh).
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.good: Checkpoint | None = None
        self._seen: tuple[int, int] | None = None
        self._error: str | None = None

    def read(self) -> tuple[Checkpoint | None, str | None]:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self.good, self._seen, self._error = None, None, None
            return None, None
        except OSError:
            st = None
        key = (st.st_mtime_ns, st.st_ino) if st is not None else None
        if key is not None and key == self._seen:
            return self.good, self._error
        try:
            cp = read_checkpoint(self.path)
        except KubeError as err:  # PermissionDenied propagates: it is the host's, not the file's
            self._seen, self._error = (
                key,
                f"{err}; using the last good checkpoint"
                + (
                    ""
                    if self.good is not None
                    else " (none read yet: no kubelet CPU decisions applied)"
                ),
            )
            return self.good, self._error
        self.good, self._seen, self._error = cp, key, None
        return cp, None


# -- kubelet's checksum ----------------------------------------------------------------------
_V2_NAMES = ("CPUManagerCheckpoint", "CPUManagerCheckpointV2")
_V3_NAMES = ("CPUManagerCheckpoint", "CPUManagerCheckpointV3")


def v2_checksum(policy: str, default: str, entries: dict[str, dict[str, str]]) -> int:
    """The ``checksum`` kubelet writes into a v2 checkpoint with these fields (for tests and
    tools that stand in for kubelet; vmpin itself never writes the file)."""
    return fnv32a(_dump("CPUManagerCheckpoint", policy, default, entries))


def fnv32a(text: str) -> int:
    """FNV-1a, 32 bits (Go's hash/fnv New32a), over the text's UTF-8 bytes."""
    h = 0x811C9DC5
    for byte in _go_bytes(text):
        h = ((h ^ byte) * 0x01000193) & 0xFFFFFFFF
    return h


def _go_bytes(text: str) -> bytes:
    # Go decodes an unpaired \uD800 escape to U+FFFD; Python keeps the lone surrogate.
    return (
        text.encode("utf-8", "surrogatepass").decode("utf-8", "replace").encode("utf-8")
        if any("\ud800" <= c <= "\udfff" for c in text)
        else text.encode("utf-8")
    )


def _spew_map(value: dict[str, Any] | None, item: Any) -> str:
    # go-spew with SortKeys: string keys in byte order (= code point order), "map[k:v k:v]";
    # a nil map is "<nil>" (kubelet's make()d maps print "map[]").
    if value is None:
        return "<nil>"
    return "map[" + " ".join(f"{k}:{item(value[k])}" for k in sorted(value)) + "]"


def _spew_cpuset(text: str) -> str:
    # PodEntry.CPUSet is a k8s.io/utils/cpuset.CPUSet{elems map[int]struct{}}: int keys sort
    # numerically.  Parse errors surface later, when the entry itself is parsed.
    try:
        cpus = CpuSet.parse(text).sorted()
    except CpuSetError:
        cpus = []
    elems = " ".join(f"{c}:{{}}" for c in cpus)
    return f"{{CPUSet:(cpuset.CPUSet){{elems:(map[int]struct {{}})map[{elems}]}}}}"


def _dump(
    name: str,
    policy: str,
    default: str,
    entries: dict[str, Any] | None,
    pods: dict[str, Any] | bool | None = False,
) -> str:
    """go-spew's ``%#v`` of a ``*state.<name>`` (v2, or v3 when ``pods`` is given)."""
    inner = _spew_map(entries, lambda m: _spew_map(m, str))
    text = (
        f"(*state.{name}){{PolicyName:(string){policy} DefaultCPUSet:(string){default} "
        f"Entries:(map[string]map[string]string){inner} "
    )
    if pods is not False:
        pods_map = pods if isinstance(pods, dict) or pods is None else None
        text += f"PodEntries:(state.PodCPUAssignments){_spew_map(pods_map, _spew_cpuset)} "
    return text + "Checksum:(checksum.Checksum)0}"


def _dump_v1(name: str, policy: str, default: str, entries: dict[str, Any] | None) -> str:
    return (
        f"(*state.{name}){{PolicyName:(string){policy} DefaultCPUSet:(string){default} "
        f"Entries:(map[string]string){_spew_map(entries, str)} Checksum:(checksum.Checksum)0}}"
    )


#: the container name kubelet gives a pod's infra (pause) container (pkg/kubelet/leaky:
#: ``PodInfraContainerName``); CRI-O labels its infra container with it.  A Kubernetes
#: container name is a DNS label (lowercase), so no app or init container can be called this.
INFRA_NAME = "POD"


def is_infra(is_sandbox: bool, pod_uid: str | None, name: str | None) -> bool:
    """A pod's infra (pause) container, however its runtime names it.

    kubelet's CPU manager assigns CPUs to a pod's app and init containers only (its policy's
    ``Allocate`` runs per ``v1.Container`` of the pod spec, and the checkpoint is keyed by
    their names); the infra container is not one of them.  CRI-O names it ``POD``
    (``io.kubernetes.container.name``, ContainerType ``sandbox``); containerd marks it
    ``container-type: sandbox`` and gives it no container name.  Either way it is the
    sandbox container of a pod (a pod uid).  A plain ``runc run`` container is its own
    sandbox too, but has no pod uid: it is a workload, not an infra container.
    """
    return name == INFRA_NAME or (is_sandbox and bool(pod_uid))


def cpus_for(
    cp: Checkpoint, pod_uid: str, container_name: str | None, container_id: str | None = None
) -> CpuSet | None:
    """The CPUs kubelet gives a pod's app or init container, or None when the checkpoint does
    not say.  Never ask it for an infra container (:func:`is_infra`): kubelet gives that none.

    - a v1 entry for the container's id (kubelet < 1.12 keyed entries by container id):
      its exclusive CPUs;
    - an entry for (pod uid, container name): its exclusive CPUs;
    - a pod-level entry (``podEntries``) for the pod: the pod's CPUs, which its containers
      without an exclusive assignment of their own share;
    - otherwise, under the static policy, ``defaultCpuSet``: the shared pool every container
      without an exclusive assignment runs on (the caller vouches that this is a pod's
      app or init container: the checkpoint lists only the exclusive ones, so it cannot tell
      a shared container from one it never heard of);
    - under any other policy ("none"), or when the shared pool is empty (kubelet has not
      initialised it): None, kubelet pins nothing and vmpin should not invent a set.
    """
    if container_id and cp.by_container_id:
        by_id = cp.by_container_id.get(container_id)
        if by_id:
            return by_id
    exclusive = cp.entries.get(pod_uid, {}).get(container_name) if container_name else None
    if exclusive:
        return exclusive
    pod = cp.pods.get(pod_uid)
    if pod:
        return pod
    if cp.policy == STATIC and cp.default:
        return cp.default
    return None
