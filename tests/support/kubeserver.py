"""A local Kubernetes API test server (tests only): pods list/watch, events.k8s.io/v1, NodePinning.

No real apiserver can run on these machines (no etcd, no kube binaries), so the tests drive
the real ``kubernetes`` client against this server, which speaks the parts of the protocol
vmpin uses the way kube-apiserver does:

- **list/watch** of pods with ``fieldSelector=spec.nodeName=N``: a list carries the store's
  ``metadata.resourceVersion``; ``watch=true&resourceVersion=R`` streams every change after R
  as newline-delimited JSON over a *chunked* HTTP/1.1 response, then waits for more until
  ``timeoutSeconds``; with ``allowWatchBookmarks=true`` it sends BOOKMARK events (an object
  carrying only ``metadata.resourceVersion``) while idle.  A watch from a resourceVersion older
  than the compaction point gets HTTP 200 and one ERROR event with a Status of code 410
  (reason Expired), as the apiserver does ("too old resource version").
- **faults**: :meth:`KubeServer.fail` makes the next N requests on a path answer 429 or 500
  with ``Retry-After``.
- **validation**: Events against events.k8s.io/v1's rules (ValidateEventCreate/Update in
  kubernetes pkg/apis/core/validation/events.go: eventTime, reportingController,
  reportingInstance, action, reason required; note <= 1 kB; type Normal|Warning; series.count
  >= 2 with lastObservedTime; regarding in the event's namespace), and NodePinning objects
  against the openAPIV3Schema of deploy/crd.yaml with jsonschema -- strictly: a field the
  schema does not declare is rejected (the apiserver would prune it silently; a test should
  see it).  Patches must be JSON merge patches where the apiserver would refuse others
  (strategic merge is 415 on custom resources).

Every write is counted in :attr:`KubeServer.writes`.
"""

from __future__ import annotations

import copy
import json
import re
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import jsonschema
import yaml

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "deploy" / "crd.yaml"
MICROTIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z$")
QUALIFIED = re.compile(
    r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)


def _strict(schema: Any) -> Any:
    """The CRD schema with undeclared fields forbidden (unless preserve-unknown-fields)."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if (out.get("type") == "object" and "properties" in out
                and "additionalProperties" not in out
                and not out.get("x-kubernetes-preserve-unknown-fields")):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


def crd_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD.read_text())
    return _strict(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


class Invalid(Exception):
    pass


def validate_event(ev: dict[str, Any], namespace: str, *, update: bool = False) -> None:
    problems = []
    for key in ("eventTime", "reportingController", "reportingInstance", "action", "reason"):
        if not ev.get(key):
            problems.append(f"{key}: Required value")
    if ev.get("eventTime") and not MICROTIME.match(str(ev["eventTime"])):
        problems.append(f"eventTime: not a MicroTime: {ev['eventTime']!r}")
    for key in ("reportingInstance", "action", "reason"):
        if len(str(ev.get(key, ""))) > 128:
            problems.append(f"{key}: Too long: may not be longer than 128")
    if ev.get("reportingController") and not QUALIFIED.match(ev["reportingController"]):
        problems.append("reportingController: not a qualified name")
    if len(ev.get("note", "").encode()) > 1024:
        problems.append("note: Too long: may not be longer than 1024")
    if ev.get("type") not in ("Normal", "Warning"):
        problems.append(f"type: Unsupported value: {ev.get('type')!r}")
    reg = ev.get("regarding") or {}
    if reg.get("namespace") and reg["namespace"] != namespace:
        problems.append("regarding.namespace: does not match event.namespace")
    if not reg.get("kind") or not reg.get("name"):
        problems.append("regarding: Required value")
    series = ev.get("series")
    if series is not None:
        if not isinstance(series.get("count"), int) or series["count"] < 2:
            problems.append("series.count: should be at least 2")
        if not MICROTIME.match(str(series.get("lastObservedTime", ""))):
            problems.append("series.lastObservedTime: Required value")
    allowed = {"apiVersion", "kind", "metadata", "eventTime", "series", "reportingController",
               "reportingInstance", "action", "reason", "regarding", "related", "note", "type",
               "deprecatedSource", "deprecatedFirstTimestamp", "deprecatedLastTimestamp",
               "deprecatedCount"}
    unknown = set(ev) - allowed
    if unknown:
        problems.append(f"unknown fields {sorted(unknown)}")
    if problems:
        raise Invalid("; ".join(problems))


@dataclass
class Fault:
    path: str
    status: int
    retry_after: int | None
    times: int


@dataclass
class KubeServer:
    """The server's state; :meth:`start` serves it on 127.0.0.1 (a random port)."""

    bookmark_interval: float = 0.5
    rv: int = 1000
    compacted: int = 0
    pods: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    history: list[tuple[int, str, dict[str, Any]]] = field(default_factory=list)
    events: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    pinnings: dict[str, dict[str, Any]] = field(default_factory=dict)
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    faults: list[Fault] = field(default_factory=list)
    writes: dict[str, int] = field(default_factory=dict)
    requests: list[tuple[str, str, int]] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.cond = threading.Condition()
        self.schema = crd_schema()
        self.closing = False
        self.httpd: ThreadingHTTPServer | None = None

    # -- test-side mutations --------------------------------------------------------------
    def put_node(self, name: str) -> str:
        """A Node object (what the agent reads for its report's owner); returns its uid."""
        with self.cond:
            self.rv += 1
            uid = str(uuid.uuid4())
            self.nodes[name] = {"apiVersion": "v1", "kind": "Node",
                                "metadata": {"name": name, "uid": uid,
                                             "resourceVersion": str(self.rv)}}  # fmt: skip
        return uid

    def put_pod(
        self, namespace: str, name: str, node: str,
        annotations: dict[str, str] | None = None, uid: str | None = None,
    ) -> dict[str, Any]:
        with self.cond:
            old = self.pods.get((namespace, name))
            self.rv += 1
            pod = copy.deepcopy(old) if old else {
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"namespace": namespace, "name": name,
                             "uid": uid or str(uuid.uuid4())},
                "spec": {"nodeName": node, "containers": [{"name": "c", "image": "x"}]},
            }
            pod["metadata"]["annotations"] = dict(annotations or {})
            pod["metadata"]["resourceVersion"] = str(self.rv)
            self.pods[(namespace, name)] = pod
            self.history.append((self.rv, "MODIFIED" if old else "ADDED", copy.deepcopy(pod)))
            self.cond.notify_all()
            return pod

    def delete_pod(self, namespace: str, name: str) -> None:
        with self.cond:
            pod = self.pods.pop((namespace, name))
            self.rv += 1
            pod["metadata"]["resourceVersion"] = str(self.rv)
            self.history.append((self.rv, "DELETED", pod))
            self.cond.notify_all()

    def compact(self) -> None:
        """Forget the history (etcd compaction): older resourceVersions now get 410 Gone."""
        with self.cond:
            self.compacted = self.rv
            self.history.clear()

    def fail(self, path: str, status: int, times: int = 1, retry_after: int | None = 1) -> None:
        with self.cond:
            self.faults.append(Fault(path, status, retry_after, times))

    def count(self, key: str) -> int:
        with self.cond:
            return self.writes.get(key, 0)

    def hits(self, path: str, method: str = "GET") -> list[int]:
        with self.cond:
            return [code for m, p, code in self.requests if m == method and p.startswith(path)]

    def rbac_denials(self, roles: list[str]) -> list[str]:
        """Requests served so far that the named ClusterRoles of deploy/rbac.yaml do not allow."""
        granted: set[tuple[str, str, str]] = set()
        for doc in yaml.safe_load_all((ROOT / "deploy" / "rbac.yaml").read_text()):
            if doc["kind"] == "ClusterRole" and doc["metadata"]["name"] in roles:
                for rule in doc["rules"]:
                    for g in rule["apiGroups"]:
                        for r in rule["resources"]:
                            for v in rule["verbs"]:
                                granted.add((g, r, v))
        out = []
        with self.cond:
            requests = list(self.requests)
        for method, path, _ in requests:
            need = _rbac_need(method, path)
            if need is None or need not in granted:
                out.append(f"{method} {path} needs {need}")
        return out

    # -- serving ------------------------------------------------------------------------
    def start(self) -> str:
        server = self

        class Handler(_Handler):
            state = server

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def stop(self) -> None:
        with self.cond:
            self.closing = True
            self.cond.notify_all()
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()

    def kubeconfig(self, path: Path, url: str) -> Path:
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "test",
            "clusters": [{"name": "test", "cluster": {"server": url}}],
            "users": [{"name": "test", "user": {"token": "test-token"}}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}],
        }))
        return path


@contextmanager
def serving(tmp_path: Path, **kw: Any) -> Iterator[tuple[KubeServer, Path]]:
    """A started server and a kubeconfig pointing at it; stopped on exit."""
    server = KubeServer(**kw)
    url = server.start()
    try:
        yield server, server.kubeconfig(tmp_path / f"kubeconfig-{uuid.uuid4().hex[:8]}", url)
    finally:
        server.stop()


def _rbac_need(method: str, path: str) -> tuple[str, str, str] | None:
    """(apiGroup, resource, verb) a request needs, as the apiserver's authorizer sees it."""
    watch = path.endswith("?watch")
    parts = path.split("?")[0].strip("/").split("/")
    if parts[:2] == ["api", "v1"]:
        group, rest = "", parts[2:]
    elif parts[0] == "apis":
        group, rest = parts[1], parts[3:]
    else:
        return None
    if rest[:1] == ["namespaces"] and len(rest) > 2:
        rest = rest[2:]
    resource = rest[0]
    named = len(rest) > 1
    if len(rest) > 2:
        resource += "/" + rest[2]
    verb = {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}.get(method)
    if verb is None:
        verb = "watch" if watch else ("get" if named else "list")
    return group, resource, verb


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    state: KubeServer

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    # -- plumbing ----------------------------------------------------------------------
    def _send(self, code: int, body: Any, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)
        with self.state.cond:
            self.state.requests.append((self.command, urlsplit(self.path).path, code))

    def _error(self, code: int, reason: str, message: str,
               headers: dict[str, str] | None = None) -> None:
        if code in (400, 415, 422):
            with self.state.cond:
                self.state.rejected.append(f"{self.command} {self.path}: {message}")
        self._send(code, _status(code, reason, message), headers)

    def _body(self) -> Any:
        n = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(n) or b"{}")

    def _fault(self) -> bool:
        path = urlsplit(self.path).path
        with self.state.cond:
            for f in self.state.faults:
                if path.startswith(f.path) and f.times > 0:
                    f.times -= 1
                    fault = f
                    break
            else:
                return False
        headers = {"Retry-After": str(fault.retry_after)} if fault.retry_after is not None else {}
        reason = "TooManyRequests" if fault.status == 429 else "InternalError"
        self._error(fault.status, reason, "injected fault", headers)
        return True

    def _count(self, key: str) -> None:
        with self.state.cond:
            self.state.writes[key] = self.state.writes.get(key, 0) + 1

    # -- verbs -------------------------------------------------------------------------
    def do_GET(self) -> None:
        if self._fault():
            return
        url = urlsplit(self.path)
        q = {k: v[-1] for k, v in parse_qs(url.query).items()}
        parts = url.path.strip("/").split("/")
        if url.path == "/api/v1/pods":
            if q.get("watch") in ("true", "1"):
                return self._watch(q)
            return self._list_pods(q)
        if parts[:3] == ["api", "v1", "nodes"] and len(parts) == 4:
            with self.state.cond:
                node = copy.deepcopy(self.state.nodes.get(parts[3]))
            if node is None:
                return self._error(404, "NotFound", f"nodes {parts[3]!r} not found")
            return self._send(200, node)
        if url.path == "/apis/vmpin.io/v1alpha1/nodepinnings":
            with self.state.cond:
                items = [copy.deepcopy(v) for _, v in sorted(self.state.pinnings.items())]
                rv = str(self.state.rv)
            return self._send(200, {"apiVersion": "vmpin.io/v1alpha1", "kind": "NodePinningList",
                                    "metadata": {"resourceVersion": rv}, "items": items})
        if parts[:4] == ["apis", "vmpin.io", "v1alpha1", "nodepinnings"] and len(parts) == 5:
            with self.state.cond:
                obj = copy.deepcopy(self.state.pinnings.get(parts[4]))
            if obj is None:
                return self._error(404, "NotFound", f"nodepinnings {parts[4]!r} not found")
            return self._send(200, obj)
        return self._error(404, "NotFound", f"no route {url.path}")

    def do_POST(self) -> None:
        if self._fault():
            return
        url = urlsplit(self.path)
        parts = url.path.strip("/").split("/")
        body = self._body()
        if parts[:3] == ["apis", "events.k8s.io", "v1"] and parts[3] == "namespaces" \
                and parts[5:] == ["events"]:
            ns = parts[4]
            if body.get("metadata", {}).get("namespace", ns) != ns:
                return self._error(400, "BadRequest", "namespace of the object and the URL differ")
            try:
                validate_event(body, ns)
            except Invalid as err:
                return self._error(422, "Invalid", str(err))
            name = body["metadata"]["name"]
            with self.state.cond:
                if (ns, name) in self.state.events:
                    exists = True
                else:
                    exists = False
                    self.state.rv += 1
                    body["metadata"].update(namespace=ns, resourceVersion=str(self.state.rv),
                                            uid=str(uuid.uuid4()))
                    self.state.events[(ns, name)] = body
            if exists:
                return self._error(409, "AlreadyExists", f"events {name!r} already exists")
            self._count("event.create")
            return self._send(201, body)
        if url.path == "/apis/vmpin.io/v1alpha1/nodepinnings":
            name = body.get("metadata", {}).get("name")
            if not name:
                return self._error(422, "Invalid", "metadata.name: Required value")
            if "status" in body:  # the status subresource is on: create drops status
                body.pop("status")
            try:
                jsonschema.validate(body, self.state.schema)
            except jsonschema.ValidationError as err:
                return self._error(422, "Invalid", f"schema: {err.message} at {list(err.path)}")
            with self.state.cond:
                if name in self.state.pinnings:
                    exists = True
                else:
                    exists = False
                    self.state.rv += 1
                    body["metadata"]["resourceVersion"] = str(self.state.rv)
                    self.state.pinnings[name] = body
            if exists:
                return self._error(409, "AlreadyExists", f"nodepinnings {name!r} already exists")
            self._count("nodepinning.create")
            return self._send(201, body)
        return self._error(404, "NotFound", f"no route {url.path}")

    def do_PATCH(self) -> None:
        if self._fault():
            return
        url = urlsplit(self.path)
        parts = url.path.strip("/").split("/")
        ctype = self.headers.get("Content-Type", "")
        body = self._body()
        if parts[:3] == ["apis", "events.k8s.io", "v1"] and len(parts) == 7:
            ns, name = parts[4], parts[6]
            if ctype not in ("application/merge-patch+json",
                             "application/strategic-merge-patch+json"):
                return self._error(415, "UnsupportedMediaType", f"patch type {ctype!r}")
            with self.state.cond:
                old = self.state.events.get((ns, name))
            if old is None:
                return self._error(404, "NotFound", f"events {name!r} not found")
            new = merge_patch(old, body)
            try:
                validate_event(new, ns, update=True)
            except Invalid as err:
                return self._error(422, "Invalid", str(err))
            for immutable in ("eventTime", "regarding", "reason", "action", "note", "type",
                              "reportingController", "reportingInstance"):
                if new.get(immutable) != old.get(immutable):
                    return self._error(422, "Invalid", f"{immutable}: field is immutable")
            with self.state.cond:
                self.state.rv += 1
                new["metadata"]["resourceVersion"] = str(self.state.rv)
                self.state.events[(ns, name)] = new
            self._count("event.patch")
            return self._send(200, new)
        if parts[:4] == ["apis", "vmpin.io", "v1alpha1", "nodepinnings"] and len(parts) == 6 \
                and parts[5] == "status":
            name = parts[4]
            if ctype != "application/merge-patch+json":
                # custom resources: no strategic merge; JSON patch needs a list body
                return self._error(415, "UnsupportedMediaType", f"patch type {ctype!r}")
            with self.state.cond:
                old = self.state.pinnings.get(name)
            if old is None:
                return self._error(404, "NotFound", f"nodepinnings {name!r} not found")
            new = merge_patch(old, {"status": body.get("status")})  # /status: only status
            try:
                jsonschema.validate(new, self.state.schema)
            except jsonschema.ValidationError as err:
                return self._error(422, "Invalid", f"schema: {err.message} at {list(err.path)}")
            with self.state.cond:
                self.state.rv += 1
                new["metadata"]["resourceVersion"] = str(self.state.rv)
                self.state.pinnings[name] = new
            self._count("nodepinning.status")
            return self._send(200, new)
        return self._error(404, "NotFound", f"no route {url.path}")

    # -- pods ------------------------------------------------------------------------
    @staticmethod
    def _node_of(q: dict[str, str]) -> str | None:
        sel = q.get("fieldSelector", "")
        if not sel:
            return None
        key, _, value = sel.partition("=")
        if key != "spec.nodeName":
            raise Invalid(f"field label not supported: {key}")
        return value

    def _list_pods(self, q: dict[str, str]) -> None:
        try:
            node = self._node_of(q)
        except Invalid as err:
            return self._error(400, "BadRequest", str(err))
        with self.state.cond:
            items = [copy.deepcopy(p) for p in self.state.pods.values()
                     if node is None or p["spec"]["nodeName"] == node]
            rv = str(self.state.rv)
        self._send(200, {"apiVersion": "v1", "kind": "PodList",
                         "metadata": {"resourceVersion": rv}, "items": items})

    def _chunk(self, obj: Any) -> None:
        data = json.dumps(obj).encode() + b"\n"
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _watch(self, q: dict[str, str]) -> None:
        try:
            node = self._node_of(q)
        except Invalid as err:
            return self._error(400, "BadRequest", str(err))
        st = self.state
        timeout = float(q.get("timeoutSeconds") or 1800)
        bookmarks = q.get("allowWatchBookmarks") in ("true", "1")
        since = q.get("resourceVersion") or ""
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        with st.cond:
            st.requests.append(("GET", "/api/v1/pods?watch", 200))
        deadline = time.monotonic() + timeout
        try:
            with st.cond:
                if since in ("", "0"):
                    # no resourceVersion: synthetic ADDED for the current state, then changes
                    pending = [("ADDED", copy.deepcopy(p)) for p in st.pods.values()]
                    cursor = st.rv
                elif int(since) < st.compacted:
                    pending = []
                    cursor = -1
                else:
                    pending = []
                    cursor = int(since)
            if cursor < 0:
                self._chunk({"type": "ERROR", "object": _status(
                    410, "Expired", f"too old resource version: {since} ({st.compacted})")})
                return
            last_bookmark = time.monotonic()
            while True:
                for kind, obj in pending:
                    if node is None or obj["spec"]["nodeName"] == node:
                        self._chunk({"type": kind, "object": obj})
                now = time.monotonic()
                if now >= deadline:
                    return
                if bookmarks and now - last_bookmark >= st.bookmark_interval:
                    with st.cond:
                        rv = str(max(cursor, 0))
                    self._chunk({"type": "BOOKMARK", "object": {
                        "kind": "Pod", "apiVersion": "v1", "metadata": {"resourceVersion": rv}}})
                    last_bookmark = now
                with st.cond:
                    if st.closing:
                        return
                    new = [(r, k, o) for r, k, o in st.history if r > cursor]
                    if not new:
                        st.cond.wait(min(0.1, max(0.0, deadline - now)))
                        new = [(r, k, o) for r, k, o in st.history if r > cursor]
                    pending = [(k, copy.deepcopy(o)) for _, k, o in new]
                    if new:
                        cursor = new[-1][0]
        except (BrokenPipeError, ConnectionResetError, OSError):
            return
        finally:
            try:
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
            except OSError:
                pass
            self.close_connection = True
