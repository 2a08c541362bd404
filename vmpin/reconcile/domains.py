"""libvirt domains in the node pass: observe them as sandboxes, apply their plans through libvirt.

A domain is a sandbox with runtime ``libvirt`` whose id is its UUID.  It is not written to
the store: libvirt is the source of truth for which domains run and which threads they have,
so each pass observes them afresh (cheaply: :class:`vmpin.runtimes.libvirt.Connection`
remembers a classification while the QEMU's thread set is unchanged).  Observation gives it a
record and one container (named after the domain) that exist only in the observation, with the
mask from :func:`vmpin.runtimes.libvirt.choose_mask` (KubeVirt pod cpuset, then domain metadata)
as that container's CPU set; with none, it floats over kubelet's shared pool like any sandbox.

So :func:`vmpin.reconcile.plan.plan_node` plans a domain exactly as a Kata sandbox (1:1 in
topology order, partial, float; the helper policy), with every other sandbox in its
footprints, and the node-wide invariant and the audit cover domains with no change there.
Applying goes through libvirt (vCPU, iothread and emulator pins, live), only for the threads
whose affinity differs, then each thread's affinity is read back from the kernel; the guest
map goes into the domain's metadata.

The adapter (and libvirt-python) is imported on first use; when the extra is missing this says
so once (a warning) and observes no domain.  Observe and apply know this class only through
the protocol :class:`vmpin.reconcile.sources.DomainSource`, so the hook, which imports them,
never imports libvirt.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from vmpin.core.cpuset import CpuSet
from vmpin.core.errors import HostError, ProcessGone, VmpinError
from vmpin.core.planner import Policy
from vmpin.linux import procfs
from vmpin.linux.paths import HostPaths
from vmpin.reconcile.apply import Outcome
from vmpin.reconcile.observation import ContainerObs, SandboxObs, ThreadObs, VmmObs
from vmpin.runtimes.libvirtd import DEFAULT_URIS, wanted_uris
from vmpin.state.records import ContainerRec, SandboxRec

if TYPE_CHECKING:
    from vmpin.reconcile.plan import SandboxPlan
    from vmpin.runtimes import libvirt as lv



def _log() -> logging.Logger:
    return logging.getLogger("vmpin.libvirt")

_warned: list[bool] = []


def adapter() -> Any:
    """vmpin.runtimes.libvirt, or None (said once) when libvirt-python is not installed."""
    try:
        from vmpin.runtimes import libvirt as lv_mod
    except ImportError as err:
        if not _warned:
            _warned.append(True)
            _log().warning(
                "libvirt domains are not handled: %s (pip install 'vmpin[libvirt]')", err
            )
        return None
    return lv_mod


class LibvirtDomains:
    """Every running domain on the configured connections (``kubevirt`` = every launcher)."""

    def __init__(self, paths: HostPaths, uris: Iterable[str] = DEFAULT_URIS) -> None:
        self.paths = paths
        self.uris = tuple(uris)
        self._conns: dict[str, lv.Connection] = {}
        #: UUID -> (connection, domain) as last observed: apply and the CLI find them here
        self._seen: dict[str, tuple[lv.Connection, lv.Domain]] = {}
        # the agent's workers share one source: one libvirt conversation at a time
        self._lock = threading.RLock()

    def wanted_uris(self) -> list[str]:
        """The configured URIs, less the default one when no daemon serves it here."""
        return wanted_uris(self.uris)

    def _connections(self, lv_mod: Any) -> list[lv.Connection]:
        # kept open across passes (the agent), one per URI
        return [
            self._conns.setdefault(c.uri, c)
            for c in lv_mod.connections(self.paths, self.wanted_uris())
        ]

    def close(self) -> None:
        with self._lock:
            for conn in self._conns.values():
                conn.close()
            self._conns.clear()

    def find(self, key: str) -> tuple[lv.Connection, lv.Domain] | None:
        """A domain by UUID or name (observing first when it was not seen yet)."""
        with self._lock:
            for _ in range(2):
                for conn, d in self._seen.values():
                    if key in (d.uuid, d.name):
                        return conn, d
                self.sandboxes(lambda _sid: _default_policy())
        return None

    # -- observe ---------------------------------------------------------------------------
    def sandboxes(self, policy_for: Callable[[str], Policy]) -> list[SandboxObs]:
        with self._lock:
            if not self.wanted_uris():
                # no daemon serves the default connection (yet): nothing to observe, and no
                # libvirt-python loaded for it (12 MB of the agent's RSS, issue 14); the first
                # pass after a daemon starts imports it and connects
                self._seen = {}
                return []
            lv_mod = adapter()
            if lv_mod is None:
                return []
            out: list[SandboxObs] = []
            seen: dict[str, tuple[lv.Connection, lv.Domain]] = {}
            for conn in self._connections(lv_mod):
                try:
                    domains, errors = conn.domains()
                except VmpinError as err:
                    conn.close()
                    out.append(_error_obs(conn.uri, str(err), policy_for))
                    continue
                for e in errors:
                    out.append(_error_obs(conn.uri, e, policy_for))
                for d in domains:
                    seen[d.uuid] = (conn, d)
                    try:
                        out.append(self._domain(lv_mod, conn, d, policy_for(d.uuid)))
                    except Exception as err:  # one domain's failure is an error on it
                        msg = f"domain {d.name}: unexpected {type(err).__name__}: {err}"
                        out.append(_error_obs(conn.uri, msg, policy_for))
            self._seen = seen
            return out

    def _domain(self, lv_mod: Any, conn: lv.Connection, d: lv.Domain, policy: Policy) -> SandboxObs:
        choice = lv_mod.choose_mask(self.paths, d)
        record = SandboxRec(d.uuid, "libvirt", d.pid, d.start, gen=1, done_gen=1)
        container = ContainerRec(
            d.name, d.uuid, True, d.name, cpus=choice.mask, cpus_source=choice.source
        )
        containers = (ContainerObs(container),)
        notes = [f"domain {d.name} on {d.uri}; mask from {choice.source}: {choice.detail}"]
        try:
            cl = conn.classify(d)
        except ProcessGone:
            return SandboxObs(d.uuid, "libvirt", policy, record, containers, vmm_gone=True)
        except VmpinError as err:
            return SandboxObs(d.uuid, "libvirt", policy, record, containers, errors=(str(err),))
        threads = []
        for t in cl.threads:
            if t.layer == "kvm-helper":
                # KVM's vhost_task follows vCPU 0's cgroup, not a libvirt pin: not vmpin's
                notes.append(f"tid {t.tid} ({t.label}): KVM's helper, left as vCPU 0 has it")
                continue
            threads.append(self._thread(d.pid, t.tid, t.role, t.index, t.label))
        vmm = VmmObs(d.pid, d.start, tuple(threads), False, (), tuple(cl.layers), tuple(cl.notes))
        return SandboxObs(d.uuid, "libvirt", policy, record, containers, vmm, notes=tuple(notes))

    def _thread(
        self, pid: int, tid: int, role: str, index: int | None, label: str | None
    ) -> ThreadObs:
        base = ThreadObs(tid, role, index, label, "libvirt")
        try:
            actual = procfs.cpus_allowed(self.paths.proc, pid, tid)
            name = procfs.comm(self.paths.proc, pid, tid)
        except ProcessGone:
            return base
        except HostError as err:
            return ThreadObs(tid, role, index, label, "libvirt", error=str(err))
        return ThreadObs(tid, role, index, label, "libvirt", name, actual)

    # -- apply -----------------------------------------------------------------------------
    def apply(self, sp: SandboxPlan, publish: bool) -> dict[int, Outcome]:
        with self._lock:
            return self._apply(sp, publish)

    def _apply(self, sp: SandboxPlan, publish: bool) -> dict[int, Outcome]:
        found = self._seen.get(sp.id)
        out: dict[int, Outcome] = {}
        if found is None or sp.obs.vmm is None:
            return out
        conn, d = found
        # libvirt pins an iothread by its id: "iothread<N>" is the label classify gave it
        try:
            io = conn.classify(d).by_role("iothread")  # remembered from observe: no query
        except ProcessGone:
            return {t.tid: Outcome("gone", None) for t in sp.threads}
        except VmpinError:
            io = []
        io_ids = {t.tid: int(t.label[8:]) for t in io if t.label and t.label[8:].isdigit()}
        vcpus: dict[int, CpuSet] = {}
        iothreads: dict[int, CpuSet] = {}
        emulator: CpuSet | None = None
        todo = []
        for t in sp.threads:
            if t.actual is None or t.desired is None or t.actual == t.desired:
                continue
            todo.append(t)
            if t.role == "vcpu" and t.index is not None:
                vcpus[t.index] = t.desired
            elif t.role == "iothread" and t.tid in io_ids:
                iothreads[io_ids[t.tid]] = t.desired
            elif t.role == "emulator":
                emulator = t.desired  # one emulator pin covers every emulator thread
        error: str | None = None
        if todo:
            try:
                conn.pin(d, vcpus, iothreads, emulator)
            except ProcessGone:
                return {t.tid: Outcome("gone", None) for t in todo}
            except VmpinError as err:
                error = str(err)
        for t in sp.threads:
            if t.actual is None:
                out[t.tid] = Outcome("error" if t.error else "gone", None, t.error)
            elif t.desired is None:
                out[t.tid] = Outcome("unmanaged", t.actual)
            elif t.actual == t.desired:
                out[t.tid] = Outcome("ok", t.actual)
            else:
                try:  # read back from the kernel, not from libvirt's word
                    actual = procfs.cpus_allowed(self.paths.proc, d.pid, t.tid)
                except ProcessGone:
                    out[t.tid] = Outcome("gone", None)
                    continue
                if actual == t.desired:
                    out[t.tid] = Outcome("pinned", actual)
                else:
                    why = error or f"kernel holds {actual} after pinning {t.desired}"
                    out[t.tid] = Outcome("error", actual, why)
        if publish and sp.guest_map is not None:
            try:
                conn.publish_guest_map(d.uuid, sp.guest_map)
            except VmpinError as err:
                _log().warning("guest map not published", extra={"fields": {"error": str(err)}})
        return out


def _default_policy() -> Policy:
    return Policy()


def _error_obs(uri: str, error: str, policy_for: Callable[[str], Policy]) -> SandboxObs:
    """A connection or domain that could not be read: an error against it, never the node's."""
    sid = "libvirt:" + uri
    return SandboxObs(sid, "libvirt", policy_for(sid), None, errors=(error,))


__all__ = ["LibvirtDomains", "adapter"]
