"""The agent's link to Kubernetes: live per-pod policy, Events on pods, the node's report.

Imported by the agent only when the API is configured
(:func:`vmpin.service.settings.kube_configured`): it imports :mod:`vmpin.runtimes.kubeapi`,
hence the ``kubernetes`` client (335 ms, 35 MB of RSS here).  It owns:

- the pods bound to this node as the watch last saw them, and their policy annotations
  (:mod:`vmpin.core.podpolicy`): when a pod's policy annotations change, its sandboxes are
  queued at once (the agent's queue holds work back ``holdoff`` = 0.1 s at most), so the
  re-plan lands well within a second; annotations it cannot use become a log line and a
  ``BadAnnotation`` Event, and the node default applies to that setting;
- turning each sandbox pass into Events (``Pinned``, ``Repinned``, ``DriftRepaired``,
  ``Conflict``, ``CouldNotPin``, ``BadAnnotation``, ``AllocationRefused``; aggregated by
  :class:`EventRecorder`);
- the NodePinning status built from the passes (:class:`NodeReport` rate-limits its writes).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from vmpin.core.cpuset import CpuSet
from vmpin.core.planner import exclusive_cpus
from vmpin.core.podpolicy import is_policy_key, parse
from vmpin.reconcile.allocations import REFUSED
from vmpin.reconcile.reconciler import SandboxReport
from vmpin.runtimes import kubeapi
from vmpin.runtimes.kubeapi import EventRecorder, NodeReport, Pod, PodRef, PodWatch, Publisher
from vmpin.state.records import SandboxRec

log = logging.getLogger("vmpin.kube")


def _policy_annotations(pod: Pod | None) -> dict[str, str] | None:
    if pod is None:
        return None
    return {k: v for k, v in pod.annotations.items() if is_policy_key(k)}


class KubeLink:
    def __init__(
        self,
        api: Any,
        node: str,
        *,
        notify: Callable[[list[str]], int],
        sandboxes_of_pod: Callable[[str], list[str]],
        watch_timeout: int = 60,
        event_interval: float = 10.0,
        report_interval: float = 3.0,
        heartbeat: float = 60.0,
    ) -> None:
        self.node = node
        self.notify = notify
        self.sandboxes_of_pod = sandboxes_of_pod
        self.watch = PodWatch(api, node, self._on_pod, self._on_relist,
                              timeout_seconds=watch_timeout)
        self.events = EventRecorder(api, f"vmpin-{node}"[:128], interval=event_interval)
        self.report = NodeReport(api, node, min_interval=report_interval, heartbeat=heartbeat)
        self.publisher = Publisher(self.events, self.report)
        self._lock = threading.Lock()
        self._pods: dict[str, Pod] = {}
        self._sandboxes: dict[str, dict[str, Any]] = {}
        self._masks: dict[str, CpuSet] = {}
        self._containers: dict[str, list[dict[str, Any]]] = {}
        self._conflicts: dict[str, list[str]] = {}
        self._errors: dict[str, int] = {}
        #: sandboxes this agent has planned before (a later pass that writes = Repinned)
        self._seen: set[str] = set()
        #: sandbox -> how many threads/cgroups its last pass found drifted and put back
        self._drifted: dict[str, int] = {}
        #: condition type -> (its status, when it last changed)
        self._transitions: dict[str, tuple[str, str]] = {}
        #: pod uid -> monotonic time its policy annotations last changed (for re-plan latency)
        self.changed_at: dict[str, float] = {}
        #: bumped (under ``_lock``) when a pod's policy annotations change, a pod goes, or a
        #: list completes: the agent records the policies again only then
        self._policy_version = 0
        self._listed = False
        self.replans = 0

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        self.watch.start()
        self.publisher.start()

    def stop(self) -> None:
        self.watch.stop()
        self.publisher.stop()

    # -- pods ------------------------------------------------------------------------
    def annotations_for(self, pod_uid: str) -> Mapping[str, str] | None:
        """The pod's annotations as the API last showed them (None: not seen there)."""
        with self._lock:
            pod = self._pods.get(pod_uid)
        return None if pod is None else pod.annotations

    def policies(self, since: int) -> tuple[int, dict[str, dict[str, str]]] | None:
        """Every pod's policy annotations (pod uid -> the ``vmpin.io/`` and Crane keys it
        has, maybe none) with the version they are at; None before the first list completes
        (the API has not said which pods exist) or when nothing changed since ``since``."""
        with self._lock:
            if not self._listed or self._policy_version == since:
                return None
            return self._policy_version, {
                uid: _policy_annotations(pod) or {} for uid, pod in self._pods.items()
            }

    def _on_pod(self, kind: str, pod: Pod) -> None:
        with self._lock:
            old = self._pods.get(pod.uid)
            if kind == "DELETED":
                self._pods.pop(pod.uid, None)
            else:
                self._pods[pod.uid] = pod
            before, after = _policy_annotations(old), _policy_annotations(pod)
            if kind == "DELETED" or before != after:
                self._policy_version += 1
        if kind == "DELETED":
            self.events.forget(pod.uid)
            return
        if before == after:
            return
        _, problems = parse(after or {})
        ref = PodRef(pod.namespace, pod.name, pod.uid)
        for p in problems:
            log.warning("pod %s/%s: %s", pod.namespace, pod.name, p)
            self.events.record(ref, "BadAnnotation", str(p), type="Warning", action="Plan")
        sids = self.sandboxes_of_pod(pod.uid)
        if sids:
            self.changed_at[pod.uid] = time.monotonic()
            self.replans += 1
            self.notify(sids)

    def _on_relist(self, uids: set[str]) -> None:
        with self._lock:
            gone = [u for u in self._pods if u not in uids]
            for u in gone:
                del self._pods[u]
            self._listed = True
            self._policy_version += 1
        for u in gone:
            self.events.forget(u)

    # -- passes -> Events and the report ------------------------------------------------
    def after_pass(
        self, rec: SandboxRec, r: SandboxReport, *, drift: bool, publish: bool = True
    ) -> None:
        """Events for one sandbox's share of a pass; its entry in the report.

        ``publish=False`` leaves the report to :meth:`publish` (the agent calls it once per
        node pass: the report is built from every sandbox, so once per sandbox is quadratic).
        """
        sid = rec.id
        if r.vanished:
            self.forget_sandbox(sid, publish=publish)
            return
        ref = None
        if rec.pod_uid and rec.pod_name and rec.pod_namespace:
            ref = PodRef(rec.pod_namespace, rec.pod_name, rec.pod_uid)
        pinned = [t for t in r.threads if t.action == "pinned"]
        cgroups = sum(1 for d in r.cgroup_drift if d.get("repaired"))
        errors = list(r.errors) + [f"tid {t.tid}: {t.error}" for t in r.threads
                                   if t.action == "error"]
        policy = r.policy
        conflicts = [_conflict(c) for c in r.conflicts]
        if policy is not None and "shared with other sandboxes" in r.reason and (
            policy.vcpus == "1to1" or policy.cpuset == "exclusive"
        ):
            conflicts.append(f"sandbox {sid}: asks for exclusive CPUs but {r.reason}")
        if ref is not None:
            what = f"{r.mode} on CPUs {r.mask.to_list() or '-'} ({r.reason})"
            if errors:
                self.events.record(ref, "CouldNotPin", "; ".join(errors), type="Warning",
                                   action="Pin")
            if conflicts:
                self.events.record(ref, "Conflict", conflicts[0], type="Warning", action="Plan")
            for note in r.notes:  # vmpin could not allocate the CPUs the pod asks for
                if note.startswith(REFUSED):
                    self.events.record(ref, "AllocationRefused", note, type="Warning",
                                       action="Allocate")
            if pinned or cgroups:
                n = len(pinned) + cgroups
                if drift:
                    reason = "DriftRepaired"
                    note = f"{n} thread(s)/cgroup(s) had drifted and were put back: {what}"
                elif sid in self._seen:
                    reason, note = "Repinned", f"re-pinned after a change: {what}"
                else:
                    reason, note = "Pinned", f"pinned: {what}"
                self.events.record(ref, reason, note, action="Pin")
            if r.policy_source == "oci":
                for p in r.policy_problems:
                    self.events.record(ref, "BadAnnotation", p, type="Warning", action="Plan")
        self._seen.add(sid)
        entry: dict[str, Any] = {"id": sid, "runtime": r.runtime, "mask": r.mask.to_list(),
                                 "mode": r.mode, "reason": r.reason}
        if ref is not None:
            entry["pod"] = {"namespace": ref.namespace, "name": ref.name, "uid": ref.uid}
        if policy is not None:
            entry["policy"] = {"vcpus": policy.vcpus, "helpers": policy.helpers,
                               "guest": policy.guest, "cpuset": policy.cpuset,
                               "source": r.policy_source}
        counts: dict[str, int] = {}
        for t in r.threads:
            if t.desired is not None and t.actual is not None and not t.violates():
                counts[t.role] = counts.get(t.role, 0) + 1
        entry["pinned"] = counts
        if errors:
            entry["errors"] = errors[:20]
        with self._lock:
            self._sandboxes[sid] = entry
            self._masks[sid] = r.mask
            self._errors[sid] = len(errors)
            if drift and (pinned or cgroups):
                self._drifted[sid] = len(pinned) + cgroups
            else:
                self._drifted.pop(sid, None)
            self._conflicts[sid] = conflicts
            self._containers[sid] = [
                {"id": c.id, "sandbox": sid, "name": c.name or "",
                 "cpus": "" if c.cpus is None else c.cpus.to_list()}
                for c in r.containers if r.runtime == "runc" and not c.is_sandbox
            ]
        if publish:
            self.publish()

    def forget_sandbox(self, sid: str, *, publish: bool = True) -> None:
        with self._lock:
            for d in (self._sandboxes, self._masks, self._containers, self._conflicts,
                      self._errors, self._drifted):
                d.pop(sid, None)
            self._seen.discard(sid)
        if publish:
            self.publish()

    def publish(self) -> None:
        """Hand the report as it stands to :class:`NodeReport` (which rate-limits writes)."""
        self.report.set(self.status())

    def status(self) -> dict[str, Any]:
        """The NodePinning status (deploy/crd.yaml) from the latest pass over each sandbox."""
        with self._lock:
            sandboxes = [self._sandboxes[s] for s in sorted(self._sandboxes)]
            conflicts = [c for s in sorted(self._conflicts) for c in self._conflicts[s]]
            errors = sum(self._errors.values())
            containers = [c for s in sorted(self._containers) for c in self._containers[s]]
            exclusive = CpuSet.union_all(exclusive_cpus(self._masks).values())
            drifted = dict(self._drifted)
        kinds = {k: v for k, v in (("error", errors), ("conflict", len(conflicts))) if v}
        now = kubeapi.rfc3339()
        return {
            "observedTime": now,
            "sandboxCount": len(sandboxes),
            "containerCount": len(containers),
            "conflictCount": len(conflicts),
            # the lists are bounded (an object is at most ~1.5 MB in etcd): the counts are whole
            "truncated": max(len(sandboxes), len(containers), len(conflicts)) > MAX_LISTED,
            "exclusiveCpus": exclusive.to_list(),
            "sandboxes": sandboxes[:MAX_LISTED],
            "containers": containers[:MAX_LISTED],
            "conflicts": conflicts[:MAX_LISTED],
            "audit": {"ok": not kinds, "violations": errors + len(conflicts), "kinds": kinds,
                      "time": now},
            "conditions": self._conditions(errors, conflicts, drifted, now),
        }

    def _conditions(
        self, errors: int, conflicts: list[str], drifted: Mapping[str, int], now: str
    ) -> list[dict[str, str]]:
        """Ready, Drift and Conflict, as Kubernetes conditions: a reason in CamelCase, a
        message for people, and the time the status last flipped (kept across reports)."""
        found = [
            ("Ready", not errors, "Pinning" if not errors else "Errors",
             "every sandbox's last pass applied its plan" if not errors
             else f"{errors} thread(s) or sandbox(es) could not be pinned: see the sandboxes"),
            ("Drift", bool(drifted), "DriftRepaired" if drifted else "NoDrift",
             f"the last pass put back {sum(drifted.values())} thread(s)/cgroup(s) in"
             f" {', '.join(sorted(drifted)[:5])}" if drifted
             else "no thread or cgroup had moved off its plan"),
            ("Conflict", bool(conflicts), "ExclusiveCpusClaimedTwice" if conflicts
             else "NoConflict", conflicts[0] if conflicts else "no CPU is claimed twice"),
        ]  # fmt: skip
        out = []
        for kind, true, reason, message in found:
            status = "True" if true else "False"
            last = self._transitions.get(kind)
            if last is None or last[0] != status:
                last = self._transitions[kind] = (status, now)
            out.append({"type": kind, "status": status, "reason": reason,
                        "message": message[:1024], "lastTransitionTime": last[1]})  # fmt: skip
        return out


#: the most sandboxes, containers and conflicts a NodePinning lists (the counts stay whole)
MAX_LISTED = 500


def _conflict(c: Mapping[str, Any]) -> str:
    """One line for a node-plan conflict: the CPUs and both claimants."""
    who = [f"pod {x.get('pod')} container {x.get('container')} ({x.get('source')})"
           for x in c.get("claimants", [])]
    return f"CPUs {c.get('cpus')} claimed as exclusive by " + " and ".join(who)


def connect_link(
    kubeconfig: str | None,
    node: str,
    *,
    notify: Callable[[list[str]], int],
    sandboxes_of_pod: Callable[[str], list[str]],
    **kw: Any,
) -> KubeLink | None:
    """A started link, or None (logged once) when there are no credentials after all."""
    api = kubeapi.connect(kubeconfig)
    if api is None:
        log.warning("no Kubernetes API credentials: per-pod policy from OCI annotations only;"
                    " no Events, no NodePinning report")
        return None
    link = KubeLink(api, node, notify=notify, sandboxes_of_pod=sandboxes_of_pod, **kw)
    link.start()
    return link
