"""The OCI runtime state (a hook's stdin), the bundle's config.json, who a container is, and
the hook's event made of them (:func:`hook_event`: what only the moment of the hook can read,
handed to vmpin.wire.hookevent and journaled by vmpin.state.journal).

Read just deeply enough: ``linux.resources.cpu.{cpus,mems}`` and ``annotations``; the rest of
a spec is not vmpin's business, so there is no model of it (and no pydantic: this module is on
the hook path).

Every CRI flavour names the same facts differently; :func:`identify` folds them into one
:class:`Identity`.  Sources, first match wins per field:

==============  =========================================  ==================================
fact            containerd (CRI), io.kubernetes.cri.*      CRI-O and podman (libpod)
==============  =========================================  ==================================
is sandbox      container-type=sandbox                     io.kubernetes.cri-o.ContainerType
sandbox id      sandbox-id                                 io.kubernetes.cri-o.SandboxID
pod uid         sandbox-uid                                io.kubernetes.pod.uid
pod name / ns   sandbox-name / sandbox-namespace           io.kubernetes.pod.name / .namespace
container name  container-name                             io.kubernetes.container.name
==============  =========================================  ==================================

Kata's own ``io.katacontainers.pkg.oci.container_type`` (pod_sandbox / pod_container) and
dockershim's ``io.kubernetes.docker.type`` / ``io.kubernetes.sandbox.id`` are understood too.
A container with none of these is a sandbox of its own (plain ``runc run``, podman without a
pod): its sandbox id is its own id.

Kata's quirks (FACTS.md): ``ociVersion`` and ``status`` may be empty, and for poststart and
poststop the state's ``id`` is the *sandbox* id.  The hook therefore resolves a container by
its bundle first (see :mod:`vmpin.service.hook`); this module only refuses to invent what is
missing.
"""

from __future__ import annotations

import os

from vmpin.core import gojson
from vmpin.core.cpuset import CpuSet
from vmpin.core.errors import CpuSetError, IdError, SpecError, VmpinError
from vmpin.core.ids import check_id
from vmpin.linux.files import check_text, load_json, read_bytes
from vmpin.wire.hookevent import PID_MAX, HookEvent, Identity

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.lean.records)
if TYPE_CHECKING:
    from typing import Any, NamedTuple

    from vmpin.linux.paths import HostPaths
    from vmpin.wire.jsonio import Selector
else:
    from vmpin.lean.records import NamedTuple

#: the largest OCI state / config.json a hook accepts (Kata's, with every annotation, ~20 KiB).
MAX_DOC = 1 << 20
#: annotations vmpin keeps per container, and the longest value (kubelet caps the whole
#: annotation map at 256 KiB).
MAX_ANNOTATIONS = 512
MAX_TEXT = 64 << 10
#: the stages whose bundle must be read (a later stage's container was recorded at create)
CREATE_STAGES = ("prestart", "createRuntime", "createContainer")
#: only these run in the host's pid namespace (createContainer sees the container's pid 1)
HOST_PID_STAGES = ("prestart", "createRuntime", "poststart")


class State(NamedTuple):
    id: str
    status: str
    pid: int | None
    bundle: str
    annotations: dict[str, str]
    oci_version: str = ""


class Resources(NamedTuple):
    """The CPU part of an OCI LinuxResources object; ``None`` = not set."""

    cpus: CpuSet | None = None
    mems: str | None = None
    #: the CFS limit, ``cpu.quota`` / ``cpu.period`` (microseconds; None = not set)
    quota: int | None = None
    period: int | None = None

    @property
    def whole_cpus(self) -> int | None:
        """The CPU limit in whole CPUs; None without a limit or when it is not whole (only
        integer CPUs are given exclusively, by kubelet and by vmpin: docs/allocation.md)."""
        quota, period = self.quota, self.period
        if not quota or not period or quota <= 0 or period <= 0 or quota % period:
            return None
        return quota // period


def _obj(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise SpecError(f"{where}: expected a JSON object, got {type(value).__name__}")
    return value


def _loads(text: str | bytes, where: str, keep: Selector | None = None) -> Any:
    if len(text) > MAX_DOC:
        raise SpecError(f"{where}: {len(text)} bytes, over the limit of {MAX_DOC}")
    # Go's key matching (gojson.Obj keeps repeated keys) on the one depth-limited reader
    return load_json(text, where, object_pairs_hook=gojson.Obj, keep=keep)


def _text(value: str, where: str) -> str:
    """Text that will be journaled and stored: valid UTF-8 and of a sane length."""
    if len(value) > MAX_TEXT:
        raise SpecError(f"{where}: {len(value)} characters, over the limit of {MAX_TEXT}")
    return check_text(value, where)


def _annotations(value: Any, where: str) -> dict[str, str]:
    if value is None:
        return {}
    obj = _obj(value, where)
    bad = [k for k, v in obj.items() if not isinstance(v, str)]
    if bad:
        raise SpecError(f"{where}: annotation {bad[0]!r} is not a string")
    if len(obj) > MAX_ANNOTATIONS:
        raise SpecError(f"{where}: {len(obj)} annotations, over the limit of {MAX_ANNOTATIONS}")
    # every text at once (a hook checks two maps, the state's and the spec's, at every
    # start): one encoding and one length test, and no message built for texts that pass
    texts = [*obj, *obj.values()]
    try:
        "".join(texts).encode()  # (any lone surrogate fails it, as it fails _text)
        fine = not texts or max(map(len, texts)) <= MAX_TEXT
    except UnicodeEncodeError:
        fine = False
    if not fine:  # the first that fails, in the map's order, says why
        for k, v in obj.items():
            _text(k, f"{where}: annotation key")
            _text(v, f"{where}: annotation {k!r}")
    return dict(obj)


def parse_state(text: str | bytes, where: str = "state") -> State:
    """Parse the OCI state a hook receives on stdin."""
    if not text.strip():
        raise SpecError(f"{where}: empty (a hook reads the OCI state on stdin)")
    obj = _obj(_loads(text, where), where)
    cid = obj.get("id")
    if not isinstance(cid, str) or not cid:
        raise SpecError(f"{where}: field 'id' missing or not a string")
    check_id(cid, f"{where}: field 'id'")
    bundle = obj.get("bundle", "")
    if not isinstance(bundle, str):
        raise SpecError(f"{where}: field 'bundle' is not a string")
    _text(bundle, f"{where}: field 'bundle'")
    if bundle and not os.path.isabs(bundle):
        raise SpecError(f"{where}: field 'bundle' is not an absolute path: {bundle!r}")
    if "\0" in bundle:
        raise SpecError(f"{where}: field 'bundle' holds a NUL byte: {bundle!r}")
    pid = obj.get("pid")
    if pid is not None and (
        not isinstance(pid, int) or isinstance(pid, bool) or not 0 <= pid <= PID_MAX
    ):
        raise SpecError(f"{where}: field 'pid' is not a process id (0..{PID_MAX}): {pid!r}")
    for key in ("status", "ociVersion"):
        if obj.get(key) is not None and not isinstance(obj.get(key), str):
            raise SpecError(f"{where}: field {key!r} is not a string")
        if obj.get(key):
            _text(obj[key], f"{where}: field {key!r}")
    return State(
        id=cid,
        status=obj.get("status") or "",
        pid=pid or None,
        bundle=bundle,
        annotations=_annotations(obj.get("annotations"), f"{where}: field 'annotations'"),
        oci_version=obj.get("ociVersion") or "",
    )


#: JSON names of runtime-spec's LinuxResources and LinuxCPU fields (specs-go/config.go).
_RESOURCES_FIELDS = (
    "devices", "memory", "cpu", "pids", "blockIO", "hugepageLimits", "network", "rdma", "unified",
)  # fmt: skip
_CPU_FIELDS = (
    "shares", "quota", "burst", "period", "realtimeRuntime", "realtimePeriod", "cpus", "mems",
    "idle",
)  # fmt: skip


_SPEC_FIELDS = (
    "ociVersion", "process", "root", "hostname", "domainname", "mounts", "hooks", "annotations",
    "linux", "solaris", "windows", "vm", "zos",
)  # fmt: skip
_LINUX_FIELDS = (
    "uidMappings", "gidMappings", "sysctl", "resources", "cgroupsPath", "namespaces", "devices",
    "seccomp", "rootfsPropagation", "maskedPaths", "readonlyPaths", "mountLabel", "intelRdt",
    "personality", "timeOffsets",
)  # fmt: skip


def _go_string(obj: Any, name: str, fields: tuple[str, ...], where: str) -> str | None:
    """A string field as Go decodes it: keys folded, last one wins, null leaves it unset."""
    out: str | None = None
    for value in gojson.field_values(obj, name, fields):
        if value is None:
            continue
        if not isinstance(value, str):
            raise SpecError(f"{where}.{name}: not a string: {value!r}")
        out = value
    return out


def _go_object(obj: Any, name: str, fields: tuple[str, ...], where: str) -> list[Any]:
    values = [v for v in gojson.field_values(obj, name, fields) if v is not None]
    for value in values:
        _obj(value, f"{where}.{name}")
    return values


def parse_resources(obj: Any, where: str) -> Resources:
    """Read the CPUs and memory nodes out of a LinuxResources object, as runc decodes it.

    runc decodes config.json and ``runc update -r`` with Go's encoding/json: keys match
    case-insensitively ("CPU", "Cpus"), see :mod:`vmpin.core.gojson`.  ``unified``
    ``cpuset.cpus`` / ``cpuset.mems`` (cgroup v2 files written verbatim) are written after
    ``cpu.cpus`` by runc's fs2 manager, so they win.  runc passes the list to the kernel
    verbatim, so it is read with the kernel's grammar; a list that needs the CPU count
    (``N``, ``all``) is refused here, where the host is not known.
    """
    if obj is None:
        return Resources()
    res = _obj(obj, where)
    cpus_text: str | None = None
    mems: str | None = None
    quota = period = None
    for cpu in _go_object(res, "cpu", _RESOURCES_FIELDS, where):
        cpus_text = _go_string(cpu, "cpus", _CPU_FIELDS, f"{where}.cpu") or cpus_text
        mems = _go_string(cpu, "mems", _CPU_FIELDS, f"{where}.cpu") or mems
        quota = _go_int(cpu, "quota", quota)
        period = _go_int(cpu, "period", period)
    for unified in _go_object(res, "unified", _RESOURCES_FIELDS, where):
        pairs = unified.pairs if isinstance(unified, gojson.Obj) else unified.items()
        for key, value in pairs:  # map keys are exact: they are file names
            if key not in ("cpuset.cpus", "cpuset.mems"):
                continue
            if not isinstance(value, str):
                raise SpecError(f"{where}.unified.{key}: not a string: {value!r}")
            if key == "cpuset.cpus":
                cpus_text = value
            else:
                mems = value
    cpus: CpuSet | None = None
    if cpus_text is not None and cpus_text.strip():
        try:
            cpus = CpuSet.parse_kernel(cpus_text)
        except CpuSetError as err:
            raise SpecError(f"{where}.cpu.cpus: {err}") from None
        if not cpus:  # ",": the kernel reads an empty set, which no task can run on
            raise SpecError(f"{where}.cpu.cpus: {cpus_text!r} names no CPU")
    if mems:
        try:  # stored and handed to cgroups: a list the kernel reads
            CpuSet.parse_kernel(mems)
        except CpuSetError as err:
            raise SpecError(f"{where}.cpu.mems: {err}") from None
    return Resources(cpus, mems or None, quota, period)


def _go_int(obj: Any, name: str, out: int | None) -> int | None:
    """An integer field of LinuxCPU as Go decodes it (keys folded, the last one wins), else
    ``out``.  Only read for the CPU limit's count (vmpin.core.podpolicy): a value that is not
    a 64-bit integer is left out rather than refused, as before vmpin read these fields."""
    for value in gojson.field_values(obj, name, _CPU_FIELDS):
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) < 1 << 63:
            out = value
    return out


def parse_resources_json(text: str | bytes, where: str) -> Resources:
    """Parse a LinuxResources JSON document, as ``runc update -r`` takes it."""
    return parse_resources(_obj(_loads(text, where), where), where)


class Config(NamedTuple):
    resources: Resources
    annotations: dict[str, str]


def _spec_member(key: str) -> Selector | bool | None:
    """What parse_config reads of a config.json: the annotations and, of every member Go
    decodes into ``linux``, its ``resources`` -- not the process, mounts, namespaces or
    seccomp profile, most of a containerd spec's bytes (vmpin.wire.jsonio.loads_members)."""
    if key == "annotations":
        return True
    return _linux_member if gojson.matches(key, "linux", _SPEC_FIELDS) else None


def _linux_member(key: str) -> bool | None:
    return True if gojson.matches(key, "resources", _LINUX_FIELDS) else None


def parse_config(text: str | bytes, where: str = "config.json") -> Config:
    obj = _obj(_loads(text, where, _spec_member), where)
    resources = Resources()
    # runc decodes config.json with Go's encoding/json too: "Linux"/"Resources" count.
    for linux in _go_object(obj, "linux", _SPEC_FIELDS, f"{where}:"):
        for res in _go_object(linux, "resources", _LINUX_FIELDS, f"{where}: linux"):
            resources = parse_resources(res, f"{where}: linux.resources")
    return Config(resources, _annotations(obj.get("annotations"), f"{where}: annotations"))


def read_config(bundle: str) -> Config:
    """The bundle's config.json, read as a file others can write (vmpin.linux.files)."""
    path = os.path.join(bundle, "config.json")
    try:
        data = read_bytes(path, limit=MAX_DOC, what="bundle config")
    except FileNotFoundError:
        raise SpecError(f"{path}: bundle has no config.json") from None
    except OSError as err:
        raise SpecError(f"{path}: {err.strerror}") from None
    return parse_config(data, path)


_SANDBOX_TYPES = {"sandbox", "podsandbox", "pod_sandbox"}
_TYPE_KEYS = (
    "io.kubernetes.cri.container-type",
    "io.kubernetes.cri-o.ContainerType",
    "io.kubernetes.docker.type",
    "io.katacontainers.pkg.oci.container_type",
)
_SANDBOX_ID_KEYS = (
    "io.kubernetes.cri.sandbox-id",
    "io.kubernetes.cri-o.SandboxID",
    "io.kubernetes.sandbox.id",
)
_POD_UID = ("io.kubernetes.cri.sandbox-uid", "io.kubernetes.pod.uid")
_POD_NAME = ("io.kubernetes.cri.sandbox-name", "io.kubernetes.pod.name")
_POD_NS = ("io.kubernetes.cri.sandbox-namespace", "io.kubernetes.pod.namespace")
_CTR_NAME = ("io.kubernetes.cri.container-name", "io.kubernetes.container.name")


def _first(annotations: dict[str, str], keys: tuple[str, ...]) -> str | None:
    for key in keys:
        value = annotations.get(key)
        if value:
            return value
    return None


def identify(container_id: str, annotations: dict[str, str]) -> Identity:
    """Fold any runtime's annotations into one identity (see the module table)."""
    ctype = _first(annotations, _TYPE_KEYS)
    sandbox_id = _first(annotations, _SANDBOX_ID_KEYS)
    is_sandbox = ctype in _SANDBOX_TYPES if ctype else sandbox_id in (None, container_id)
    if is_sandbox:
        # A sandbox container is its own sandbox, whatever its annotations repeat.
        sandbox_id = container_id
    elif not sandbox_id:
        sandbox_id = container_id
    check_id(sandbox_id, "annotation sandbox id")
    pod_uid = _first(annotations, _POD_UID)
    if pod_uid is not None:
        # a pod uid names files and store keys too (the API's policy records, pod cgroup
        # paths): "../../x" was stored and broke every later audit (issue 26)
        check_id(pod_uid, "annotation pod uid")
    return Identity(
        container_id=container_id,
        sandbox_id=sandbox_id,
        is_sandbox=is_sandbox,
        pod_uid=pod_uid,
        pod_name=_first(annotations, _POD_NAME),
        pod_namespace=_first(annotations, _POD_NS),
        name=_first(annotations, _CTR_NAME),
    )


# -- a hook's event: what only the moment of the hook knows --------------------------------------
def container_id_from_bundle(bundle: str) -> str | None:
    """containerd: .../<ns>/<id>; CRI-O: .../overlay-containers/<id>/userdata."""
    if not bundle:
        return None
    path = bundle.rstrip("/")
    base = os.path.basename(path)
    if base == "userdata":
        base = os.path.basename(os.path.dirname(path))
    try:
        return check_id(base)
    except IdError:
        return None


def identity(state: State, annotations: dict[str, str]) -> Identity:
    """Who the hook's container is: :func:`identify`, but by the bundle when Kata's state id
    is the sandbox's."""
    ident = identify(state.id, annotations)
    if not ident.is_sandbox and ident.sandbox_id == state.id:
        # Kata's poststart/poststop: the id is the sandbox's; the bundle names the container.
        cid = container_id_from_bundle(state.bundle)
        if cid is None or cid == state.id:
            raise SpecError(
                f"state id {state.id!r} is the sandbox id and bundle {state.bundle!r} names no"
                " container: cannot tell which container this is"
            )
        ident = identify(cid, annotations)
    return ident


def detect_runtime(
    paths: HostPaths, sandbox_id: str, hint_pid: int | None, hint_start: int | None = None
) -> str:
    """Kata when the sandbox has a VM dir or the state pid is its QEMU; plain otherwise.
    ``hint_start``: the pid's start time, when the caller read it (before this call)."""
    if os.path.isdir(os.path.join(paths.vm_dir, sandbox_id)):
        return "kata"
    raw = _cmdline(paths, hint_pid) if hint_pid else None
    if hint_pid is None or raw is None or sandbox_id not in raw:
        return "runc"
    from vmpin.linux import procfs
    from vmpin.runtimes import vmm

    # the command line read here is not read again; the start time, read before it, is
    # compared after it (vmm._read_vmm: the pid was not reused meanwhile)
    known = None if hint_start is None else (hint_start, procfs.split_cmdline(raw))
    return "kata" if vmm.is_vmm_of(paths, hint_pid, sandbox_id, known) else "runc"


def _cmdline(paths: HostPaths, pid: int) -> str | None:
    """``pid``'s command line as text; None when it is gone.  Whether it holds the sandbox's
    id at all tells most pids apart: a sandbox's QEMU names it (``-name sandbox-<id>``, the id
    verbatim since ids hold no ``,`` for QEMU to escape), so a pid whose command line does not
    -- a runc container's init, at every plain start -- is told apart with this one read,
    without vmpin.runtimes.vmm's module and its four (0.8 M of the runc hook's 46.6 M
    instructions, a bare interpreter 38.6 M: docs/benchmarks.md)."""
    from vmpin.linux import procfs

    try:
        return procfs.read_text(paths.proc, pid, "cmdline")
    except VmpinError:
        return None  # (gone: not a VMM either)


def _start_time(paths: HostPaths, pid: int) -> int | None:
    from vmpin.linux import procfs

    try:
        return procfs.start_time(paths.proc, pid)
    except VmpinError:
        return None


def hook_event(paths: HostPaths, stage: str, state: State | bytes) -> HookEvent:
    """Everything about this hook call that must be read now (the bundle may be gone later,
    the pid reused): the state (``bytes``: as the hook's stdin has it), the bundle's
    config.json, the pid's start time, the runtime.  Raises on bad input; what could not be
    stored is refused by :meth:`HookEvent.to_json`, i.e. when the journal writes it, before
    anything else is written."""
    if not isinstance(state, State):
        state = parse_state(state, f"hook {stage}: state")
    host_pid = state.pid if stage in HOST_PID_STAGES else None
    pid_start = _start_time(paths, host_pid) if host_pid else None
    annotations = dict(state.annotations)
    cpus: CpuSet | None = None
    mems: str | None = None
    has_config = False
    limit: int | None = None
    if stage != "poststop":
        if not state.bundle:
            raise SpecError(f"hook {stage}: state has no bundle")
        try:
            config: Config | None = read_config(state.bundle)
        except SpecError:
            if stage in CREATE_STAGES:
                raise
            config = None  # a later stage of a container recorded at create: not needed
        if config is not None:
            annotations = {**config.annotations, **annotations}
            cpus, mems = config.resources.cpus, config.resources.mems
            has_config = True
            limit = config.resources.whole_cpus
    elif state.bundle:
        # what a container gives up when it goes (its spec's CPUs, when its bundle is still
        # there): whether a VM may have them to itself now (vmpin.state.summary)
        try:
            cpus = read_config(state.bundle).resources.cpus
        except SpecError:
            cpus = None
    try:
        ident: Identity | None = identity(state, annotations)
    except VmpinError:
        if stage in CREATE_STAGES:
            raise
        ident = None  # poststop/poststart: the store may know it by bundle
    runtime = (
        None if ident is None else detect_runtime(paths, ident.sandbox_id, host_pid, pid_start)
    )
    return HookEvent(
        stage, state.id, state.bundle, state.annotations, host_pid, pid_start, ident, cpus,
        mems, runtime, has_config, limit,
    )  # fmt: skip
