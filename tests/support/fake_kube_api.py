"""FakeKubeAPI: stands in for a Kubernetes API server in chart tests (no kube-apiserver can run here).

It serves just what Helm's `lookup` and the chart's in-cluster scripts call, over real HTTP: API discovery
(`/api/v1`, `/apis/<group>/<version>`), GET of one object or a list, and POST (create; 409 when it exists).
The tests it serves are about the chart's templates and scripts, not about the API server: Helm's own
client-go code (through helm_python's `Config.render`) discovers the kind and GETs the object exactly as it
would from a cluster. `store()` adds the defaults kube-apiserver 1.32 writes into the fields the chart
compares, so a check that an API server's stored object would trip also trips here.
"""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

# (apiVersion, kind) -> (plural resource, namespaced): the kinds the chart renders or looks up.
KINDS: dict[tuple[str, str], tuple[str, bool]] = {
    ("v1", "Secret"): ("secrets", True),
    ("v1", "ConfigMap"): ("configmaps", True),
    ("v1", "Service"): ("services", True),
    ("v1", "ServiceAccount"): ("serviceaccounts", True),
    ("v1", "Namespace"): ("namespaces", False),
    ("apps/v1", "StatefulSet"): ("statefulsets", True),
    ("apps/v1", "Deployment"): ("deployments", True),
    ("batch/v1", "Job"): ("jobs", True),
    ("policy/v1", "PodDisruptionBudget"): ("poddisruptionbudgets", True),
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): ("leaderworkersets", True),
    ("apiextensions.k8s.io/v1", "CustomResourceDefinition"): ("customresourcedefinitions", False),
}


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "reason": reason,
        "message": message,
        "code": code,
    }


def store(obj: dict[str, Any]) -> dict[str, Any]:
    """`obj` as kube-apiserver stores it, in the fields the chart's upgrade checks read: each
    volumeClaimTemplate gets apiVersion/kind, volumeMode Filesystem and a Pending status, and quantities
    are canonical (the API server writes 51200Mi back as 50Gi)."""
    obj = copy.deepcopy(obj)
    obj.setdefault("metadata", {}).setdefault("uid", f"uid-{obj['metadata']['name']}")
    for claim in obj.get("spec", {}).get("volumeClaimTemplates", []):
        claim.setdefault("apiVersion", "v1")
        claim.setdefault("kind", "PersistentVolumeClaim")
        claim["spec"].setdefault("volumeMode", "Filesystem")
        claim["status"] = {"phase": "Pending"}
        requests = claim["spec"].get("resources", {}).get("requests", {})
        if "storage" in requests:
            requests["storage"] = canonical_quantity(str(requests["storage"]))
    return obj


_BINARY = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}


def canonical_quantity(text: str) -> str:
    """The largest binary suffix that keeps a whole number (what the API server does for binary sizes)."""
    for suffix, power in _BINARY.items():
        if text.endswith(suffix):
            value = int(text.removesuffix(suffix)) * 1024**power
            break
    else:
        return text
    for suffix, power in reversed(_BINARY.items()):
        if value % 1024**power == 0:
            return f"{value // 1024**power}{suffix}"
    return str(value)


class FakeKubeAPI:
    """Objects by (apiVersion, kind, namespace, name); `requests` records (method, path) of every call."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str, str], dict[str, Any]] = {}
        self.requests: list[tuple[str, str]] = []
        # Paths whose next GET answers 404 although the object exists (another writer's race, for tests).
        self.stale_once: set[str] = set()
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self._server.server_port}"

    def add(self, obj: dict[str, Any], namespace: str) -> None:
        """Stores `obj` (as the API server would, see `store`) in `namespace`."""
        kind = (obj["apiVersion"], obj["kind"])
        if kind not in KINDS:
            return  # a kind this fake does not serve (custom resources other than LWS): lookup never asks for it
        ns = namespace if KINDS[kind][1] else ""
        with self._lock:
            self.objects[(*kind, ns, obj["metadata"]["name"])] = store(obj)

    def install(self, objects: list[dict[str, Any]], namespace: str) -> None:
        for obj in objects:
            self.add(obj, namespace)

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        with self._lock:
            return self.objects.get((api_version, kind, namespace, name))

    # -- HTTP ----------------------------------------------------------------------------------------
    def _route(self, path: str) -> tuple[tuple[str, str] | None, str, str | None, str | None]:
        """(kind, apiVersion, namespace, name) for a resource path; kind None for a discovery path."""
        parts = [p for p in path.split("?")[0].split("/") if p]
        if parts[:1] == ["api"]:
            api_version, rest = (parts[1] if len(parts) > 1 else ""), parts[2:]
        elif parts[:1] == ["apis"] and len(parts) >= 3:
            api_version, rest = f"{parts[1]}/{parts[2]}", parts[3:]
        else:
            return None, "", None, None
        namespace = None
        if rest[:1] == ["namespaces"] and len(rest) >= 3:
            namespace, rest = rest[1], rest[2:]
        if not rest:
            return None, api_version, None, None
        plural, name = rest[0], (rest[1] if len(rest) > 1 else None)
        for (version, kind), (resource, _) in KINDS.items():
            if version == api_version and resource == plural:
                return (version, kind), api_version, namespace, name
        return ("", plural), api_version, namespace, name

    def _discovery(self, api_version: str) -> dict[str, Any] | None:
        resources = [
            {
                "name": resource,
                "singularName": kind.lower(),
                "namespaced": namespaced,
                "kind": kind,
                "verbs": ["create", "delete", "get", "list", "patch", "update", "watch"],
            }
            for (version, kind), (resource, namespaced) in KINDS.items()
            if version == api_version
        ]
        if not resources:
            return None
        return {
            "kind": "APIResourceList",
            "apiVersion": "v1",
            "groupVersion": api_version,
            "resources": resources,
        }

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        api = self

        class Handler(BaseHTTPRequestHandler):
            def _send(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                api.requests.append(("GET", self.path.split("?")[0]))
                kind, api_version, namespace, name = api._route(self.path)
                if kind is None:
                    found = api._discovery(api_version)
                    if found is None:
                        self._send(404, _status(404, "NotFound", f"{self.path} not found"))
                    else:
                        self._send(200, found)
                    return
                with api._lock:
                    if name is not None:
                        obj = api.objects.get((*kind, namespace or "", name))
                        if self.path.split("?")[0] in api.stale_once:
                            api.stale_once.discard(self.path.split("?")[0])
                            obj = None
                        if obj is None:
                            self._send(404, _status(404, "NotFound", f'{kind[1]} "{name}" not found'))
                        else:
                            self._send(200, obj)
                        return
                    items = [
                        o
                        for (v, k, ns, _), o in api.objects.items()
                        if (v, k) == kind and ns == (namespace or "")
                    ]
                self._send(200, {"kind": f"{kind[1]}List", "apiVersion": api_version, "items": items})

            def do_POST(self) -> None:
                api.requests.append(("POST", self.path.split("?")[0]))
                kind, _, namespace, _ = api._route(self.path)
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                if kind is None or kind[0] == "":
                    self._send(404, _status(404, "NotFound", f"{self.path} not found"))
                    return
                key = (*kind, namespace or "", body["metadata"]["name"])
                with api._lock:
                    if key in api.objects:
                        self._send(409, _status(409, "AlreadyExists", f'"{key[3]}" already exists'))
                        return
                    api.objects[key] = store(body)
                self._send(201, api.objects[key])

            def log_message(self, *args: object) -> None:
                pass

        return Handler

    @contextmanager
    def serving(self) -> Iterator[FakeKubeAPI]:
        thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._server.shutdown()
            self._server.server_close()
            thread.join(timeout=5)
