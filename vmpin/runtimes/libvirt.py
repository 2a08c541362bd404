"""libvirt domains as sandboxes: discovery, exact thread classification, pinning through libvirt.

The only module of vmpin that imports ``libvirt`` / ``libvirt_qemu`` (an import-linter
contract keeps it so).  It is imported lazily, by the agent and the CLI paths that handle
domains, never by the hook; without the optional extra (``pip install 'vmpin[libvirt]'``)
importing it raises ImportError and the caller says once that domains are not handled.

Why libvirt, not sched_setaffinity from outside: libvirt puts each vCPU thread of a domain in
a cpuset cgroup of its own (``/machine/qemu-N-NAME.libvirt-qemu/vcpuK``, seen with libvirt 9.0
on cgroup v1), so a raw affinity outside that cpuset is refused (EINVAL) or clipped, and
libvirt re-applies its own pinning on restart.  Pinning through ``virDomainPinVcpuFlags`` /
``virDomainPinIOThread`` / ``virDomainPinEmulator`` (``VIR_DOMAIN_AFFECT_LIVE``) moves the
cgroup and the thread affinity together, so libvirt and vmpin agree.  Live only: the domain's
persistent config is the operator's; a restarted domain comes back with its config pins and
vmpin re-pins it on the lifecycle event.

Exact classification, no guessing (libvirt holds the QMP socket, so vmpin asks through it):

- vCPU index -> thread id: ``query-cpus-fast`` through ``virDomainQemuMonitorCommand``;
- iothread id -> thread id: ``query-iothreads`` the same way; libvirt names its iothread
  objects ``iothread<N>`` where N is the id of ``virDomainPinIOThread``;
- emulator: every other thread of the QEMU process, except KVM's own ``kvm-*`` helper
  (kvm-nx-lpage-recovery), a vhost_task that sits in vCPU 0's cgroup and follows vCPU 0's
  pin, not the emulator pin: it is reported with role ``emulator`` and left unmanaged.

The QEMU pid is the thread group of vCPU 0's thread (``Tgid`` in its ``status``), and the
domain's identity is (pid, start time) like every other VMM's.

Which CPUs a domain may use (its sandbox mask), first found wins (:func:`choose_mask`):

1. KubeVirt: the cpuset of the pod container that holds the QEMU (kubelet's decision);
2. the domain's metadata under :data:`MASK_NS` (``<vmpin:mask cpus="2-3"/>``), written by an
   operator with ``virsh metadata`` or by ``vmpin update DOMAIN --cpuset-cpus``;
3. the node's shared pool (kubelet's defaultCpuSet) when known;
4. nothing: the domain is left as libvirt made it.

The guest map of a domain is published in its metadata under :data:`GUEST_MAP_NS` (JSON in
``<vmpin:guest-map>``), where ``virsh metadata`` and a guest-side agent relay can read it.

Connections: ``qemu:///system`` by default; KubeVirt's per-pod daemons are reached through the
virt-launcher process's root (:func:`kubevirt_uris`).  See docs/libvirt.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import libvirt
import libvirt_qemu

from vmpin.core.cpuset import CpuSet
from vmpin.core.errors import CpuSetError, HostError, LibvirtError, ProcessGone
from vmpin.linux import cgroups, procfs
from vmpin.linux.paths import HostPaths
from vmpin.runtimes.threads import Classification, VmmThread

DEFAULT_URI = "qemu:///system"
#: the operator's (or ``vmpin update``'s) mask for a domain: ``<vmpin:mask cpus="LIST"/>``.
MASK_NS = "https://github.com/vmpin/vmpin/xmlns/libvirt/mask/1"
MASK_PREFIX = "vmpin"
#: what vmpin publishes for the guest: ``<vmpin:guest-map>JSON</vmpin:guest-map>``.
GUEST_MAP_NS = "https://github.com/vmpin/vmpin/xmlns/libvirt/guest-map/1"
GUEST_MAP_PREFIX = "vmpingm"
#: KubeVirt's virt-launcher runs its own libvirt daemon; the socket inside the pod
#: (``qemu+unix:///session?socket=/var/run/libvirt/virtqemud-sock`` for root launchers,
#: KubeVirt's hypervisor runtime table).  Older launchers ran libvirtd: ``libvirt-sock``.
KUBEVIRT_SOCKETS = ("var/run/libvirt/virtqemud-sock", "var/run/libvirt/libvirt-sock")
KUBEVIRT_LAUNCHER = "virt-launcher"

_LIVE = libvirt.VIR_DOMAIN_AFFECT_LIVE


def _silence(_ctx: object, _err: object) -> None:
    """libvirt prints every error to stderr by default; vmpin reports them itself."""


libvirt.registerErrorHandler(_silence, None)


def _error(what: str, err: libvirt.libvirtError) -> LibvirtError:
    return LibvirtError(f"{what}: {err.get_error_message()}")


def _gone(err: libvirt.libvirtError) -> bool:
    """The domain stopped or was undefined under us: expected, like a thread exiting."""
    return err.get_error_code() in (
        libvirt.VIR_ERR_NO_DOMAIN,
        libvirt.VIR_ERR_OPERATION_INVALID,  # "domain is not running"
    )


class Domain(NamedTuple):
    """A running domain as seen once; (pid, start) identify its QEMU like any VMM."""

    uri: str
    name: str
    uuid: str
    pid: int
    start: int
    nvcpus: int
    #: the mask in the domain's metadata (:data:`MASK_NS`), None when there is none.
    metadata_mask: CpuSet | None

    @property
    def sandbox_id(self) -> str:
        """The domain's UUID: unique across connections and restarts, safe as a store id."""
        return self.uuid


class Pins(NamedTuple):
    """libvirt's live pins of one domain: what libvirt believes it applied."""

    vcpus: Mapping[int, CpuSet]
    iothreads: Mapping[int, CpuSet]
    emulator: CpuSet


class MaskChoice(NamedTuple):
    mask: CpuSet | None
    #: kubevirt | metadata | shared-pool | none
    source: str
    detail: str


def _cpus_of_map(cpumap: Sequence[bool]) -> CpuSet:
    return CpuSet(i for i, on in enumerate(cpumap) if on)


def _ns_host_tids(paths: HostPaths, pid: int) -> dict[int, int]:
    """Thread id in QEMU's own pid namespace -> host tid, from ``NSpid`` (last = innermost).

    libvirt answers with the ids QEMU sees; for a domain inside a pod's pid namespace
    (KubeVirt without hostPID) they differ from the host's.
    """
    out: dict[int, int] = {}
    for tid in procfs.tids(paths.proc, pid):
        try:
            nspid = procfs.status(paths.proc, pid, tid).get("NSpid", str(tid)).split()
        except ProcessGone:
            continue
        out[int(nspid[-1])] = tid
    return out


class Connection:
    """One libvirt connection (one daemon): the domains on it, their threads, their pins.

    ``launcher_pid``: the host pid of a KubeVirt virt-launcher whose daemon this is; its
    domains' thread ids are then translated out of the pod's pid namespace.
    """

    def __init__(self, uri: str, paths: HostPaths, launcher_pid: int | None = None) -> None:
        self.uri, self.paths, self.launcher_pid = uri, paths, launcher_pid
        self._conn: Any = None
        # What earlier passes learnt, so an idle pass costs no monitor command (each is a
        # libvirtd round trip, ~10-30 ms on a busy node): per UUID, the libvirt domain id
        # (new at every start), QEMU's pid, start time and vCPU count ...
        self._described: dict[str, tuple[int, int, int, int]] = {}
        # ... and the classification, valid while the same QEMU has exactly the same threads
        # (a hot-plugged vCPU or a new iothread adds one: then libvirt is asked again).
        self._classified: dict[str, tuple[int, int, frozenset[int], Classification]] = {}

    # -- connection ------------------------------------------------------------------------
    @property
    def conn(self) -> Any:
        if self._conn is None:
            try:
                self._conn = libvirt.open(self.uri)
            except libvirt.libvirtError as err:
                raise _error(f"libvirt {self.uri}", err) from err
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            # already closed when the daemon went away
            with contextlib.suppress(libvirt.libvirtError):
                self._conn.close()
            self._conn = None

    def ncpus(self) -> int:
        """How long a cpumap must be: the host's CPU count as libvirt counts it."""
        try:
            return int(self.conn.getCPUMap()[0])
        except libvirt.libvirtError as err:
            raise _error(f"libvirt {self.uri}: CPU map", err) from err

    def lookup(self, uuid: str) -> Any:
        try:
            return self.conn.lookupByUUIDString(uuid)
        except libvirt.libvirtError as err:
            raise _error(f"libvirt {self.uri}: domain {uuid}", err) from err

    # -- discovery -------------------------------------------------------------------------
    def domains(self) -> tuple[list[Domain], list[str]]:
        """The running domains, and one error line per domain that could not be read."""
        try:
            doms = self.conn.listAllDomains(libvirt.VIR_CONNECT_LIST_DOMAINS_ACTIVE)
        except libvirt.libvirtError as err:
            raise _error(f"libvirt {self.uri}: list domains", err) from err
        found, errors = [], []
        for dom in doms:
            try:
                found.append(self.describe(dom))
            except ProcessGone:
                continue  # stopped between the listing and now
            except (LibvirtError, HostError) as err:
                errors.append(f"domain {dom.name()}: {err}")
        return found, errors

    def describe(self, dom: Any) -> Domain:
        try:
            name, uuid, did = dom.name(), dom.UUIDString(), int(dom.ID())
            known = self._described.get(uuid)
            if known is not None and known[0] == did and self._same(known[1], known[2]):
                _, pid, start, nvcpus = known
            else:
                vcpus = self._vcpu_tids(dom)
                if not vcpus:
                    raise LibvirtError(f"domain {name}: QEMU reports no vCPU thread")
                tid = vcpus[min(vcpus)]
                pid = int(procfs.status(self.paths.proc, tid, None)["Tgid"])
                start, nvcpus = procfs.start_time(self.paths.proc, pid), len(vcpus)
                self._described[uuid] = (did, pid, start, nvcpus)
            mask = self.metadata_mask(dom)
        except libvirt.libvirtError as err:
            if _gone(err):
                raise ProcessGone(f"domain {self.uri} {err.get_error_message()}") from err
            raise _error(f"libvirt {self.uri}", err) from err
        return Domain(self.uri, name, uuid, pid, start, nvcpus, mask)

    def _same(self, pid: int, start: int) -> bool:
        try:
            return procfs.start_time(self.paths.proc, pid) == start
        except HostError:
            return False

    def _monitor(self, dom: Any, command: str) -> Any:
        """One QMP command through libvirt's monitor passthrough (libvirt holds the socket)."""
        reply = libvirt_qemu.qemuMonitorCommand(dom, json.dumps({"execute": command}), 0)
        return json.loads(reply)["return"]

    def _to_host(self, tids: dict[int, int], pid: int | None) -> dict[int, int]:
        if self.launcher_pid is None or pid is None:
            return tids
        ns = _ns_host_tids(self.paths, pid)
        return {k: ns[t] for k, t in tids.items() if t in ns}

    def _vcpu_tids(self, dom: Any) -> dict[int, int]:
        raw = {
            int(c["cpu-index"]): int(c["thread-id"]) for c in self._monitor(dom, "query-cpus-fast")
        }
        if self.launcher_pid is None:
            return raw
        # Inside a pod's pid namespace: find the host QEMU through any of its threads' NSpid.
        pid = self._host_pid(raw[min(raw)])
        return self._to_host(raw, pid)

    def _host_pid(self, ns_tid: int) -> int | None:
        """The host pid of the QEMU whose thread ``ns_tid`` (pod namespace) is, via NSpid."""
        assert self.launcher_pid is not None
        try:
            want = os.readlink(os.path.join(self.paths.proc, str(self.launcher_pid), "ns", "pid"))
        except OSError as err:
            raise ProcessGone(f"virt-launcher {self.launcher_pid} is gone") from err
        for pid in procfs.pids(self.paths.proc):
            try:
                if os.readlink(os.path.join(self.paths.proc, str(pid), "ns", "pid")) != want:
                    continue
                for tid in procfs.tids(self.paths.proc, pid):
                    nspid = procfs.status(self.paths.proc, pid, tid).get("NSpid", "").split()
                    if nspid and int(nspid[-1]) == ns_tid:
                        return pid
            except (OSError, HostError):
                continue
        return None

    # -- classification --------------------------------------------------------------------
    def classify(self, domain: Domain) -> Classification:
        """Every thread of the domain's QEMU, exactly: vCPUs and iothreads from libvirt."""
        tids = frozenset(procfs.tids(self.paths.proc, domain.pid))
        known = self._classified.get(domain.uuid)
        if known is not None and known[:3] == (domain.pid, domain.start, tids):
            return known[3]
        dom = self.lookup(domain.uuid)
        try:
            vcpus = self._vcpu_tids(dom)
            io_raw = self._monitor(dom, "query-iothreads")
        except libvirt.libvirtError as err:
            if _gone(err):
                raise ProcessGone(f"domain {domain.name} stopped") from err
            raise _error(f"domain {domain.name}", err) from err
        iothreads: dict[int, int] = {}
        notes: list[str] = []
        for io in io_raw:
            # libvirt names the object "iothread<id>"; other ids are not libvirt's to pin.
            ident = str(io["id"])
            if ident.startswith("iothread") and ident[8:].isdigit():
                iothreads[int(ident[8:])] = int(io["thread-id"])
            else:
                notes.append(f"iothread object {ident!r} is not libvirt's: emulator")
        iothreads = self._to_host(iothreads, domain.pid)
        threads = [
            VmmThread(t, "vcpu", i, f"vCPU {i}", "libvirt") for i, t in sorted(vcpus.items())
        ]
        threads += [
            VmmThread(t, "iothread", None, f"iothread{i}", "libvirt")
            for i, t in sorted(iothreads.items())
        ]
        exact = set(vcpus.values()) | set(iothreads.values())
        for tid in procfs.tids(self.paths.proc, domain.pid):
            if tid in exact:
                continue
            try:
                comm = procfs.comm(self.paths.proc, domain.pid, tid)
            except ProcessGone:
                continue
            # KVM's vhost_task helpers (kvm-nx-lpage-recovery) follow vCPU 0's cgroup, not
            # libvirt's emulator pin: reported, never managed.
            layer = "kvm-helper" if comm.startswith("kvm-") else "libvirt"
            threads.append(VmmThread(tid, "emulator", None, comm, layer))
        out = Classification(threads, ["libvirt"], notes)
        if {t.tid for t in threads} == tids:  # no thread came or went while we asked
            self._classified[domain.uuid] = (domain.pid, domain.start, tids, out)
        return out

    # -- pinning ---------------------------------------------------------------------------
    def pin(
        self,
        domain: Domain,
        vcpus: Mapping[int, CpuSet],
        iothreads: Mapping[int, CpuSet],
        emulator: CpuSet | None,
    ) -> Pins:
        """Pin live through libvirt (cgroup and affinity together), then read libvirt back."""
        dom = self.lookup(domain.uuid)
        n = self.ncpus()

        def cpumap(cpus: CpuSet) -> tuple[bool, ...]:
            if cpus.sorted()[-1] >= n:
                raise CpuSetError(f"domain {domain.name}: CPUs {cpus} beyond the host's {n}")
            return tuple(i in cpus for i in range(n))

        try:
            for idx, cpus in sorted(vcpus.items()):
                dom.pinVcpuFlags(idx, cpumap(cpus), _LIVE)
            for ident, cpus in sorted(iothreads.items()):
                dom.pinIOThread(ident, cpumap(cpus), _LIVE)
            if emulator is not None:
                dom.pinEmulator(cpumap(emulator), _LIVE)
        except libvirt.libvirtError as err:
            if _gone(err):
                raise ProcessGone(f"domain {domain.name} stopped") from err
            raise _error(f"domain {domain.name}: pin", err) from err
        return self.pins(domain, dom)

    def pins(self, domain: Domain, dom: Any = None) -> Pins:
        """libvirt's live pins (what libvirt believes; the threads' affinity is the truth)."""
        dom = dom if dom is not None else self.lookup(domain.uuid)
        try:
            vcpu = {i: _cpus_of_map(m) for i, m in enumerate(dom.vcpuPinInfo(_LIVE))}
            io = {int(i): _cpus_of_map(m) for i, m in (dom.ioThreadInfo(_LIVE) or [])}
            emu = _cpus_of_map(dom.emulatorPinInfo(_LIVE))
        except libvirt.libvirtError as err:
            if _gone(err):
                raise ProcessGone(f"domain {domain.name} stopped") from err
            raise _error(f"domain {domain.name}: pin info", err) from err
        return Pins(vcpu, io, emu)

    # -- metadata --------------------------------------------------------------------------
    def metadata_mask(self, dom: Any) -> CpuSet | None:
        text = self._metadata(dom, MASK_NS)
        if text is None:
            return None
        try:
            cpus = ET.fromstring(text).get("cpus")
        except ET.ParseError as err:
            raise LibvirtError(f"domain {dom.name()}: metadata {MASK_NS}: {err}") from err
        if cpus is None:
            raise LibvirtError(f"domain {dom.name()}: metadata {MASK_NS} has no cpus attribute")
        try:
            return CpuSet.parse(cpus)
        except CpuSetError as err:
            raise LibvirtError(f"domain {dom.name()}: metadata {MASK_NS}: {err}") from err

    def set_mask(self, uuid: str, cpus: CpuSet | None) -> None:
        """Write (or with None remove) the domain's mask: live, and in its config if persistent."""
        elem = None if cpus is None else f'<mask cpus="{cpus.to_list()}"/>'
        self._set_metadata(self.lookup(uuid), MASK_NS, MASK_PREFIX, elem, persistent=True)

    def publish_guest_map(self, uuid: str, doc: Mapping[str, Any]) -> None:
        """The guest map as JSON in the live metadata (it is only true while this QEMU runs)."""
        root = ET.Element("guest-map")
        root.text = json.dumps(doc, sort_keys=True)
        self._set_metadata(
            self.lookup(uuid), GUEST_MAP_NS, GUEST_MAP_PREFIX, ET.tostring(root, "unicode")
        )

    def guest_map(self, uuid: str) -> Any:
        text = self._metadata(self.lookup(uuid), GUEST_MAP_NS)
        if text is None:
            return None
        return json.loads(ET.fromstring(text).text or "null")

    def _metadata(self, dom: Any, uri: str) -> str | None:
        try:
            return str(dom.metadata(libvirt.VIR_DOMAIN_METADATA_ELEMENT, uri, _LIVE))
        except libvirt.libvirtError as err:
            if err.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN_METADATA:
                return None
            raise _error(f"domain metadata {uri}", err) from err

    def _set_metadata(
        self, dom: Any, uri: str, prefix: str, elem: str | None, persistent: bool = False
    ) -> None:
        flags = _LIVE
        try:
            if persistent and dom.isPersistent():
                flags |= libvirt.VIR_DOMAIN_AFFECT_CONFIG
            dom.setMetadata(libvirt.VIR_DOMAIN_METADATA_ELEMENT, elem, prefix, uri, flags)
        except libvirt.libvirtError as err:
            raise _error(f"domain {dom.name()}: set metadata {uri}", err) from err

    # -- events ----------------------------------------------------------------------------
    def watch(self, callback: Callable[[str, str], None]) -> int:
        """Call ``callback(uuid, event)`` on each lifecycle event (start, stop, ...).

        Needs :func:`start_event_loop` before the connection is opened (libvirt's rule).
        """

        def on_event(_conn: Any, dom: Any, event: int, _detail: int, _opaque: Any) -> None:
            callback(dom.UUIDString(), _EVENTS.get(event, str(event)))

        try:
            return int(
                self.conn.domainEventRegisterAny(
                    None, libvirt.VIR_DOMAIN_EVENT_ID_LIFECYCLE, on_event, None
                )
            )
        except libvirt.libvirtError as err:
            raise _error(f"libvirt {self.uri}: events", err) from err


_EVENTS = {
    libvirt.VIR_DOMAIN_EVENT_DEFINED: "defined",
    libvirt.VIR_DOMAIN_EVENT_UNDEFINED: "undefined",
    libvirt.VIR_DOMAIN_EVENT_STARTED: "started",
    libvirt.VIR_DOMAIN_EVENT_SUSPENDED: "suspended",
    libvirt.VIR_DOMAIN_EVENT_RESUMED: "resumed",
    libvirt.VIR_DOMAIN_EVENT_STOPPED: "stopped",
    libvirt.VIR_DOMAIN_EVENT_SHUTDOWN: "shutdown",
    libvirt.VIR_DOMAIN_EVENT_PMSUSPENDED: "pmsuspended",
    libvirt.VIR_DOMAIN_EVENT_CRASHED: "crashed",
}

_loop_started = False
_loop_lock = threading.Lock()


def start_event_loop() -> None:
    """libvirt's default event loop in a daemon thread, once per process.

    ``virEventRegisterDefaultImpl`` must run before any connection that registers callbacks
    is opened; ``virEventRunDefaultImpl`` then dispatches them, one iteration per call.
    """
    global _loop_started
    with _loop_lock:
        if _loop_started:
            return
        libvirt.virEventRegisterDefaultImpl()

        def run() -> None:
            while True:
                libvirt.virEventRunDefaultImpl()

        threading.Thread(target=run, name="libvirt-events", daemon=True).start()
        _loop_started = True


# -- connections and masks -------------------------------------------------------------------
def kubevirt_uris(paths: HostPaths) -> list[tuple[str, int]]:
    """(URI, launcher pid) of each KubeVirt virt-launcher's daemon, reached through its root.

    ``/proc/<pid>/root`` is the launcher's mount namespace, so its daemon's socket is a path
    on the host; the URI's ``socket=`` parameter points libvirt's client at it.
    """
    out = []
    for pid in procfs.pids(paths.proc):
        try:
            argv = procfs.cmdline(paths.proc, pid)
        except HostError:
            continue
        if not argv or os.path.basename(argv[0]) != KUBEVIRT_LAUNCHER:
            continue
        for rel in KUBEVIRT_SOCKETS:
            sock = os.path.join(paths.proc, str(pid), "root", rel)
            if os.path.exists(sock):
                driver = "session" if rel.endswith("virtqemud-sock") else "system"
                out.append((f"qemu+unix:///{driver}?socket={sock}", pid))
                break
    return out


def connections(paths: HostPaths, uris: Iterable[str] = (DEFAULT_URI,)) -> list[Connection]:
    """The configured URIs; the word ``kubevirt`` stands for every virt-launcher's daemon."""
    out = []
    for uri in uris:
        if uri == "kubevirt":
            out += [Connection(u, paths, pid) for u, pid in kubevirt_uris(paths)]
        else:
            out.append(Connection(uri, paths))
    return out


def pod_container_cpus(paths: HostPaths, pid: int) -> tuple[CpuSet, str] | None:
    """The cpuset of the pod container holding ``pid`` (KubeVirt), with its cgroup path.

    KubeVirt's QEMU runs in the virt-launcher pod's compute container; libvirt's cgroups sit
    below it.  The container's cgroup is the path down to the first component after
    ``pod<uid>`` (cgroupfs: ``kubepods[/qos]/pod<uid>/<container id>``; systemd:
    ``...-pod<uid>.slice/cri-containerd-<id>.scope``).  None when not under kubepods.
    """
    ref = cgroups.cgroup_of_pid(paths, pid)
    if ref is None or "kubepods" not in ref.rel:
        return None
    parts = ref.rel.strip("/").split("/")
    for i, part in enumerate(parts):
        is_pod = part.startswith("pod") or "-pod" in part
        if "kubepods" in parts[0] and is_pod and i + 1 < len(parts):
            rel = "/" + "/".join(parts[: i + 2])
            container = cgroups.ref_from_rel(paths, rel)
            if container is None:
                return None
            return cgroups.read_cpus(container), rel
    return None


def choose_mask(paths: HostPaths, domain: Domain, shared_pool: CpuSet | None = None) -> MaskChoice:
    """The domain's sandbox mask: KubeVirt pod cpuset > metadata > shared pool > none."""
    try:
        pod = pod_container_cpus(paths, domain.pid)
    except ProcessGone:
        pod = None
    if pod is not None:
        return MaskChoice(pod[0], "kubevirt", f"cpuset of pod container {pod[1]}")
    if domain.metadata_mask is not None:
        return MaskChoice(domain.metadata_mask, "metadata", f"domain metadata {MASK_NS}")
    if shared_pool:
        return MaskChoice(shared_pool, "shared-pool", "kubelet's shared pool")
    return MaskChoice(None, "none", "no mask given: left as libvirt made it")
