"""The Kubernetes API: the one module that imports the ``kubernetes`` client (import-linter).

What vmpin does through the API, all of it optional and off the hook path (``kubernetes``
takes 335 ms to import here; the agent imports this module only when the API is configured):

- :class:`PodWatch` -- list + watch the pods bound to this node (``fieldSelector
  spec.nodeName``), resuming from the last ``resourceVersion`` (bookmarks keep it fresh while
  nothing changes), relisting on 410 Gone (the apiserver compacted past it), backing off on
  errors and honouring ``Retry-After`` on 429/5xx.  Its callback sees every pod change; the
  agent re-plans the pod's sandbox when the policy annotations changed.
- :class:`EventRecorder` -- events.k8s.io/v1 Events on pods, aggregated the way client-go's
  EventSeries does: one Event object per (pod, reason, type, note); later occurrences raise
  ``series.count`` in one PATCH at most every ``interval`` seconds per object, and every write
  draws from one token bucket, so an update storm costs a bounded number of API writes.
- :class:`NodeReport` -- the node's ``NodePinning`` (vmpin.io/v1alpha1, deploy/crd.yaml):
  status only, written when it changed, at most once per ``min_interval``, and at least every
  ``heartbeat`` seconds so that ``vmpin cluster`` can tell a stale agent.
- :func:`list_reports` -- every node's report, for ``vmpin cluster``.

Patches are JSON merge patches (RFC 7386): the client would otherwise pick JSON patch or
strategic merge, and custom resources accept neither strategic merge nor a dict as JSON patch.
Errors reach callers as :class:`vmpin.core.errors.KubeError`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, NamedTuple

import urllib3
from kubernetes import client, config, watch
from kubernetes.client.rest import ApiException
from kubernetes.config.config_exception import ConfigException

from vmpin.core.errors import KubeError

log = logging.getLogger("vmpin.kube")

GROUP = "vmpin.io"
VERSION = "v1alpha1"
PLURAL = "nodepinnings"
KIND = "NodePinning"
CONTROLLER = "vmpin.io/agent"
MERGE_PATCH = "application/merge-patch+json"


def microtime(t: float | None = None) -> str:
    """metav1.MicroTime on the wire: RFC 3339 with microseconds, UTC."""
    dt = datetime.fromtimestamp(time.time() if t is None else t, tz=timezone.utc)
    return dt.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def rfc3339(t: float | None = None) -> str:
    """metav1.Time on the wire: RFC 3339, seconds."""
    dt = datetime.fromtimestamp(time.time() if t is None else t, tz=timezone.utc)
    return dt.strftime("%Y-%m-%dT%H:%M:%SZ")


def connect(kubeconfig: str | None = None) -> client.ApiClient | None:
    """An API client from the in-cluster service account or a kubeconfig; None without either.

    A kubeconfig that exists but does not load is an error (the operator asked for the API).
    Each call gets its own Configuration: nothing global is touched.
    """
    if kubeconfig is None:
        cfg = client.Configuration()
        try:
            config.load_incluster_config(client_configuration=cfg)
            return client.ApiClient(cfg)
        except ConfigException:
            pass
        kubeconfig = os.environ.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")
        if not os.path.exists(kubeconfig):
            return None
    cfg = client.Configuration()
    try:
        config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    except Exception as err:  # the loader raises TypeError/KeyError on malformed files too
        raise KubeError(f"kubeconfig {kubeconfig}: {type(err).__name__}: {err}") from err
    return client.ApiClient(cfg)


def _status(err: BaseException) -> int | None:
    return err.status if isinstance(err, ApiException) else None


def retry_after(err: BaseException) -> float | None:
    """The server's Retry-After (seconds) on a 429/5xx, when it sent one."""
    if not isinstance(err, ApiException) or not err.headers:
        return None
    value = err.headers.get("Retry-After")
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


@dataclass
class Backoff:
    """Exponential backoff with full jitter, capped; Retry-After wins when the server sent it."""

    base: float = 0.2
    cap: float = 30.0
    streak: int = 0

    def delay(self, err: BaseException | None = None) -> float:
        self.streak += 1
        server = retry_after(err) if err is not None else None
        if server is not None:
            return min(server, self.cap)
        return random.uniform(0, min(self.cap, self.base * 2 ** (self.streak - 1)))

    def reset(self) -> None:
        self.streak = 0


class Pod(NamedTuple):
    uid: str
    namespace: str
    name: str
    annotations: Mapping[str, str]
    resource_version: str


def _pod(obj: Mapping[str, Any]) -> Pod:
    meta = obj.get("metadata") or {}
    return Pod(
        str(meta.get("uid", "")),
        str(meta.get("namespace", "")),
        str(meta.get("name", "")),
        dict(meta.get("annotations") or {}),
        str(meta.get("resourceVersion", "")),
    )


@dataclass
class WatchStats:
    lists: int = 0
    watches: int = 0
    gone: int = 0
    errors: int = 0
    bookmarks: int = 0
    events: int = 0


class _RawWatch(watch.Watch):  # type: ignore[misc]
    """The client's Watch, yielding raw dicts: no V1Pod model built for every event.

    (Its ``deserialize=False`` path cannot report an ERROR event: it looks for a key that only
    the deserializing path sets.)
    """

    def get_return_type(self, func: object) -> None:
        return None


class PodWatch:
    """List + watch the pods bound to one node; ``on_event(type, pod)`` for each change.

    ``type`` is ADDED, MODIFIED, DELETED, or SYNCED (a pod seen by a (re)list); after a relist
    ``on_relist(uids)`` names every pod that exists, so the caller drops the others.
    """

    def __init__(
        self,
        api: client.ApiClient,
        node: str,
        on_event: Callable[[str, Pod], None],
        on_relist: Callable[[set[str]], None] | None = None,
        *,
        timeout_seconds: int = 60,
        backoff: Backoff | None = None,
    ) -> None:
        self.core = client.CoreV1Api(api)
        self.node = node
        self.on_event = on_event
        self.on_relist = on_relist
        self.timeout_seconds = timeout_seconds
        self.backoff = backoff or Backoff()
        self.resource_version: str | None = None
        self.stats = WatchStats()
        self.synced = threading.Event()
        self._stop = threading.Event()
        self._watch: watch.Watch | None = None
        self._thread: threading.Thread | None = None

    @property
    def selector(self) -> str:
        return f"spec.nodeName={self.node}"

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="vmpin-podwatch", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        w = self._watch
        if w is not None:
            w.stop()  # shuts the streaming socket down: the blocked read returns
        if self._thread is not None:
            self._thread.join(timeout)

    def relist(self) -> None:
        self.stats.lists += 1
        # _preload_content=False: the raw JSON, no model round trip for every pod on the node
        resp = self.core.list_pod_for_all_namespaces(
            field_selector=self.selector, _preload_content=False,
            _request_timeout=self.timeout_seconds,
        )
        body = json.loads(resp.data)
        uids = set()
        for item in body.get("items") or []:
            pod = _pod(item)
            uids.add(pod.uid)
            self.on_event("SYNCED", pod)
        if self.on_relist is not None:
            self.on_relist(uids)
        self.resource_version = str((body.get("metadata") or {}).get("resourceVersion") or "")
        self.synced.set()

    def watch_once(self) -> None:
        """One watch request from the current resourceVersion until the server ends it."""
        self.stats.watches += 1
        w = self._watch = _RawWatch()
        try:
            for ev in w.stream(
                self.core.list_pod_for_all_namespaces,
                field_selector=self.selector,
                resource_version=self.resource_version,
                allow_watch_bookmarks=True,
                # with timeout_seconds the client does not retry a 410 itself: we relist
                timeout_seconds=self.timeout_seconds,
                _request_timeout=self.timeout_seconds + 10,
            ):
                if self._stop.is_set():
                    break
                kind = ev.get("type")
                obj = ev.get("object") or {}
                rv = (obj.get("metadata") or {}).get("resourceVersion")
                if kind == "BOOKMARK":
                    self.stats.bookmarks += 1
                elif kind == "ERROR":
                    code = obj.get("code")
                    raise ApiException(status=code, reason=f"{obj.get('reason')}: "
                                       f"{obj.get('message')}")
                elif kind in ("ADDED", "MODIFIED", "DELETED"):
                    self.stats.events += 1
                    self.on_event(str(kind), _pod(obj))
                if rv:
                    self.resource_version = str(rv)
                self.backoff.reset()
        finally:
            self._watch = None

    def run(self) -> None:
        while not self._stop.is_set():
            try:
                if self.resource_version is None:
                    self.relist()
                self.watch_once()
            except Exception as err:  # any failure of the API or the connection: back off
                if self._stop.is_set():
                    return
                if _status(err) == 410:
                    # Gone: our resourceVersion was compacted away; only a relist recovers
                    self.stats.gone += 1
                    self.resource_version = None
                    log.info("pod watch: resourceVersion too old, relisting")
                    continue
                self.stats.errors += 1
                if not isinstance(err, (ApiException, urllib3.exceptions.HTTPError, OSError)):
                    log.exception("pod watch failed")
                delay = self.backoff.delay(err)
                log.warning("pod watch: %s; retrying in %.1fs", _describe(err), delay)
                self._stop.wait(delay)


def _request(
    api: client.ApiClient, method: str, path: str, body: Any,
    content_type: str = "application/json",
) -> Any:
    """One request with a JSON body sent as given.

    The generated methods coerce a dict body into their model first, and the model writes
    ``eventTime`` back with ``isoformat()``: a whole second then loses its ``.000000``, which
    the apiserver's MicroTime parser (layout 2006-01-02T15:04:05.000000Z07:00) refuses.
    """
    m, url, headers, data, post = api.param_serialize(
        method, path, header_params={"Content-Type": content_type, "Accept": "application/json"},
        body=body, auth_settings=["BearerToken"],
    )
    resp = api.call_api(m, url, headers, data, post)
    resp.read()
    if not 200 <= resp.status < 300:
        raise ApiException(http_resp=resp)
    return json.loads(resp.data or b"null")


def _describe(err: BaseException) -> str:
    if isinstance(err, ApiException):
        return f"HTTP {err.status} {err.reason}"
    return f"{type(err).__name__}: {err}"


class PodRef(NamedTuple):
    namespace: str
    name: str
    uid: str


@dataclass
class _Series:
    name: str
    ref: PodRef
    reason: str
    type: str
    action: str
    note: str
    first: float
    count: int = 1
    last: float = 0.0
    written_count: int = 0
    written_at: float = 0.0
    created: bool = False


@dataclass
class TokenBucket:
    """``burst`` writes at once, then ``rate`` per second: the recorder's write budget."""

    rate: float
    burst: float
    tokens: float = -1.0
    at: float = 0.0

    def take(self, now: float) -> bool:
        if self.tokens < 0:
            self.tokens, self.at = self.burst, now
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens >= 1:
            self.tokens -= 1
            return True
        return False


@dataclass
class WriteCounter:
    creates: int = 0
    patches: int = 0
    failures: int = 0

    @property
    def writes(self) -> int:
        return self.creates + self.patches


class EventRecorder:
    """events.k8s.io/v1 Events on pods, aggregated into series and rate-limited.

    :meth:`record` only counts (cheap, any thread); :meth:`flush` makes the writes.  An
    occurrence is never lost: when the budget is spent its count waits for a later flush.
    """

    def __init__(
        self,
        api: client.ApiClient,
        instance: str,
        *,
        interval: float = 10.0,
        rate: float = 1.0,
        burst: float = 20.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.events = client.EventsV1Api(api)
        self.instance = instance
        self.interval = interval
        self.bucket = TokenBucket(rate, burst)
        self.clock = clock
        self.written = WriteCounter()
        self._series: dict[tuple[str, str, str, str], _Series] = {}
        self._lock = threading.Lock()

    def record(
        self, ref: PodRef, reason: str, note: str, *, type: str = "Normal", action: str = ""
    ) -> None:
        now = self.clock()
        note = note[:1024]  # events.k8s.io/v1: note is at most 1 kB
        key = (ref.uid, reason, type, note)
        with self._lock:
            s = self._series.get(key)
            if s is None:
                digest = hashlib.sha256("\0".join(key).encode()).hexdigest()[:12]
                name = f"{ref.name}.vmpin.{digest}"[-253:].lstrip(".-")
                s = self._series[key] = _Series(
                    name, ref, reason, type, action or reason, note, now, last=now
                )
            else:
                s.count += 1
                s.last = now

    def forget(self, uid: str) -> None:
        """The pod is gone: its series end."""
        with self._lock:
            for key in [k for k in self._series if k[0] == uid]:
                del self._series[key]

    def pending(self) -> int:
        with self._lock:
            return sum(1 for s in self._series.values() if s.count != s.written_count)

    def flush(self) -> int:
        """Write what is due within the budget; the number of API writes made."""
        now = self.clock()
        with self._lock:
            due = [
                s for s in self._series.values()
                if s.count != s.written_count
                and (not s.created or now - s.written_at >= self.interval)
            ]
        made = 0
        for s in sorted(due, key=lambda s: s.first):
            if not self.bucket.take(now):
                break
            try:
                self._write(s, now)
                made += 1
            except ApiException as err:
                self.written.failures += 1
                log.warning("event %s on %s/%s: %s", s.reason, s.ref.namespace, s.ref.name,
                            _describe(err))
                if _status(err) == 404 and s.created:  # expired (events have a TTL): start over
                    s.created, s.written_count = False, 0
        return made

    def _write(self, s: _Series, now: float) -> None:
        count = s.count
        if not s.created:
            body: dict[str, Any] = {
                "apiVersion": "events.k8s.io/v1",
                "kind": "Event",
                "metadata": {"name": s.name, "namespace": s.ref.namespace},
                "eventTime": microtime(s.first),
                "reportingController": CONTROLLER,
                "reportingInstance": self.instance,
                "action": s.action,
                "reason": s.reason,
                "note": s.note,
                "type": s.type,
                "regarding": {"apiVersion": "v1", "kind": "Pod", "namespace": s.ref.namespace,
                              "name": s.ref.name, "uid": s.ref.uid},
            }
            if count > 1:  # series.count must be >= 2 (validation of events.k8s.io/v1)
                body["series"] = {"count": count, "lastObservedTime": microtime(s.last)}
            try:
                _request(self.events.api_client, "POST",
                         f"/apis/events.k8s.io/v1/namespaces/{s.ref.namespace}/events", body)
                self.written.creates += 1
            except ApiException as err:
                if _status(err) != 409:  # 409: created by an earlier run of the agent
                    raise
                self._patch(s, count)
        else:
            self._patch(s, count)
        s.created, s.written_count, s.written_at = True, count, now

    def _patch(self, s: _Series, count: int) -> None:
        body = {"series": {"count": max(count, 2), "lastObservedTime": microtime(s.last)}}
        self.events.patch_namespaced_event(
            s.name, s.ref.namespace, body, _content_type=MERGE_PATCH
        )
        self.written.patches += 1


@dataclass
class NodeReport:
    """The node's NodePinning status: written on change (rate-limited) and on a heartbeat."""

    api: client.ApiClient
    node: str
    min_interval: float = 3.0
    heartbeat: float = 60.0
    clock: Callable[[], float] = time.time
    written: WriteCounter = field(default_factory=WriteCounter)
    _desired: dict[str, Any] | None = None
    _last: dict[str, Any] | None = None
    _at: float = float("-inf")
    _exists: bool = False

    def __post_init__(self) -> None:
        self.custom = client.CustomObjectsApi(self.api)
        self._lock = threading.Lock()

    def set(self, status: Mapping[str, Any]) -> None:
        with self._lock:
            self._desired = dict(status)

    def due(self) -> bool:
        now = self.clock()
        with self._lock:
            if self._desired is None:
                return False
            if self._desired != self._last:
                return now - self._at >= self.min_interval
            return now - self._at >= self.heartbeat

    def flush(self) -> bool:
        """Write the status when due; True when a write was made."""
        if not self.due():
            return False
        with self._lock:
            status = dict(self._desired or {})
        now = self.clock()
        body = {"status": {**status, "nodeName": self.node, "heartbeatTime": rfc3339(now),
                           "heartbeatSeconds": int(self.heartbeat)}}
        if not self._exists:
            self._ensure()
        try:
            self.custom.patch_cluster_custom_object_status(
                GROUP, VERSION, PLURAL, self.node, body, _content_type=MERGE_PATCH
            )
        except ApiException as err:
            if _status(err) != 404:
                raise
            self._exists = False  # deleted under us: create again next time
            raise
        self.written.patches += 1
        with self._lock:
            self._last, self._at = status, now
        return True

    def _owner(self) -> list[dict[str, Any]]:
        """The Node as this object's owner, so that Kubernetes' garbage collector deletes the
        report with its node (it outlived it before).  [] when the node cannot be read: the
        report is still written, without an owner (a log line says why)."""
        try:
            node = client.CoreV1Api(self.api).read_node(self.node)
        except (ApiException, urllib3.exceptions.HTTPError, OSError) as err:
            why = _describe(err) if isinstance(err, ApiException) else str(err)
            log.warning("node %s: cannot read it for the NodePinning's owner: %s", self.node, why)
            return []
        uid = getattr(node.metadata, "uid", None)
        if not uid:
            return []
        return [{"apiVersion": "v1", "kind": "Node", "name": self.node, "uid": uid,
                 "blockOwnerDeletion": False, "controller": False}]  # fmt: skip

    def _ensure(self) -> None:
        meta: dict[str, Any] = {"name": self.node, "labels": {"app.kubernetes.io/name": "vmpin"}}
        owner = self._owner()
        if owner:
            meta["ownerReferences"] = owner
        body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "metadata": meta}
        try:
            self.custom.create_cluster_custom_object(GROUP, VERSION, PLURAL, body)
            self.written.creates += 1
        except ApiException as err:
            if _status(err) != 409:  # 409: it exists (an earlier run made it)
                raise
        self._exists = True


def list_reports(api: client.ApiClient) -> list[dict[str, Any]]:
    """Every node's NodePinning object (``vmpin cluster``)."""
    custom = client.CustomObjectsApi(api)
    try:
        out = custom.list_cluster_custom_object(GROUP, VERSION, PLURAL)
    except ApiException as err:
        raise KubeError(f"listing {PLURAL}.{GROUP}: {_describe(err)}") from err
    except (urllib3.exceptions.HTTPError, OSError) as err:
        raise KubeError(f"listing {PLURAL}.{GROUP}: {err}") from err
    return list(out.get("items") or [])


class Publisher:
    """One background thread that flushes an EventRecorder and a NodeReport every ``tick``."""

    def __init__(self, events: EventRecorder, report: NodeReport, tick: float = 0.25) -> None:
        self.events = events
        self.report = report
        self.tick = tick
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.backoff = Backoff(base=1.0, cap=60.0)

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="vmpin-kube-publish", daemon=True)
        self._thread.start()

    def flush_once(self) -> None:
        self.events.flush()
        self.report.flush()

    def run(self) -> None:
        while not self._stop.wait(self.tick):
            try:
                self.flush_once()
                self.backoff.reset()
            except Exception as err:  # the API failing must not end the agent: back off
                delay = self.backoff.delay(err)
                log.warning("publishing to the API: %s; retrying in %.1fs",
                            _describe(err), delay)
                self._stop.wait(delay)

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        with contextlib.suppress(Exception):
            self.flush_once()  # last counts out, best effort
