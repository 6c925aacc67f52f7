"""The scrape configuration the Prometheus Operator generates from the chart's ServiceMonitor or PodMonitor, for a
real Prometheus in tests, so series arrive labelled as production stores them.

The relabelling is the operator's (prometheus-operator pkg/prometheus/promcfg.go, generateServiceMonitorConfig
and generatePodMonitorConfig, read at 6adcebc): keep the selected Services (pods) and the endpoint's port, then
set `namespace`, `service`, `pod`, `container`, `job` and `endpoint`; `instance` is the scraped address;
`honor_labels` is the endpoint's `honorLabels` (false by default), so a label the app exports under one of those
names is renamed `exported_<name>`. Sharding is left out (one shard keeps every target and adds no label).

Kubernetes discovery (role `endpoints` / `pod`) is replaced by static targets that carry the `__meta_kubernetes_*`
labels the discovery gives each endpoint of the rendered Services and pod templates, at the addresses of live
local services: the relabelling rules run unchanged on them inside Prometheus.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

# The labels the operator's relabelling puts on every series of a target (besides the app's own).
TARGET_LABELS = {
    "ServiceMonitor": frozenset({"job", "instance", "namespace", "service", "endpoint", "pod", "container"}),
    "PodMonitor": frozenset({"job", "instance", "namespace", "endpoint", "pod", "container"}),
}
# Any Kubernetes scrape path may add these too (the operator's `node` for a node-backed endpoint).
RESERVED_LABELS = TARGET_LABELS["ServiceMonitor"] | {"node"}


@dataclass(frozen=True)
class Pod:
    """A pod of a rendered workload, its one container's ports served at local addresses."""

    name: str
    namespace: str
    labels: dict[str, str]
    container: str
    ports: dict[str, str]  # container port name -> host:port serving it here


def _sanitize(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def _meta(prefix: str, labels: dict[str, str]) -> dict[str, str]:
    out = {f"{prefix}_label_{_sanitize(k)}": v for k, v in labels.items()}
    return out | {f"{prefix}_labelpresent_{_sanitize(k)}": "true" for k in labels}


def pods(objects: list[dict[str, Any]], addresses: dict[str, list[str]], namespace: str) -> list[Pod]:
    """The pods the rendered Deployments and StatefulSets would run, one per live address of their component
    (`addresses`: component -> host:port); names as Kubernetes gives them (StatefulSet ordinals, a
    ReplicaSet hash for Deployments)."""
    found = []
    for obj in objects:
        if obj["kind"] not in ("Deployment", "StatefulSet"):
            continue
        template = obj["spec"]["template"]
        labels = template["metadata"]["labels"]
        container = template["spec"]["containers"][0]
        for i, address in enumerate(addresses.get(labels["app.kubernetes.io/component"], [])):
            [port] = [p["name"] for p in container["ports"]]  # every kubesgl service serves one port
            name = obj["metadata"]["name"]
            name = f"{name}-{i}" if obj["kind"] == "StatefulSet" else f"{name}-5d9f8c7b6-{i:05d}"
            found.append(Pod(name, namespace, labels, container["name"], {port: address}))
    return found


def _endpoint_targets(objects: list[dict[str, Any]], live: list[Pod]) -> list[dict[str, Any]]:
    """What role `endpoints` discovers: one target per (Service port, ready pod it selects)."""
    targets = []
    for svc in objects:
        if svc["kind"] != "Service" or not svc["spec"].get("selector"):
            continue
        selector = svc["spec"]["selector"]
        for pod in live:
            if any(pod.labels.get(k) != v for k, v in selector.items()):
                continue
            for port in svc["spec"]["ports"]:
                target_port = port.get("targetPort", port["port"])
                if target_port not in pod.ports:
                    continue
                labels = {
                    "__meta_kubernetes_namespace": pod.namespace,
                    "__meta_kubernetes_service_name": svc["metadata"]["name"],
                    "__meta_kubernetes_endpoint_port_name": port.get("name", ""),
                    "__meta_kubernetes_endpoint_address_target_kind": "Pod",
                    "__meta_kubernetes_endpoint_address_target_name": pod.name,
                    **_meta("__meta_kubernetes_service", svc["metadata"].get("labels", {})),
                    **_pod_meta(pod, target_port),
                }
                targets.append({"targets": [pod.ports[target_port]], "labels": labels})
    return targets


def _pod_meta(pod: Pod, port: str) -> dict[str, str]:
    return {
        "__meta_kubernetes_pod_name": pod.name,
        "__meta_kubernetes_pod_container_name": pod.container,
        "__meta_kubernetes_pod_container_port_name": port,
        "__meta_kubernetes_pod_phase": "Running",
        **_meta("__meta_kubernetes_pod", pod.labels),
    }


def _pod_targets(live: list[Pod]) -> list[dict[str, Any]]:
    """What role `pod` discovers: one target per container port."""
    return [
        {
            "targets": [address],
            "labels": {"__meta_kubernetes_namespace": pod.namespace, **_pod_meta(pod, port)},
        }
        for pod in live
        for port, address in pod.ports.items()
    ]


def _keep_selected(meta: str, selector: dict[str, Any]) -> list[dict[str, Any]]:
    rules = [
        {
            "action": "keep",
            "source_labels": [f"{meta}_label_{_sanitize(k)}", f"{meta}_labelpresent_{_sanitize(k)}"],
            "regex": f"({v});true",
        }
        for k, v in sorted(selector.get("matchLabels", {}).items())
    ]
    assert not selector.get("matchExpressions"), "only matchLabels selectors are modelled"
    return rules


def _service_monitor(monitor: dict[str, Any], objects: list[dict[str, Any]], live: list[Pod]) -> list[dict]:
    spec, ns, name = monitor["spec"], monitor["metadata"].get("namespace"), monitor["metadata"]["name"]
    targets = [
        t
        for t in _endpoint_targets(objects, live)
        if t["labels"]["__meta_kubernetes_namespace"] in spec["namespaceSelector"]["matchNames"]
    ]
    kind_name = [
        "__meta_kubernetes_endpoint_address_target_kind",
        "__meta_kubernetes_endpoint_address_target_name",
    ]
    configs = []
    for i, ep in enumerate(spec["endpoints"]):
        relabel = [
            {"source_labels": ["job"], "target_label": "__tmp_prometheus_job_name"},
            *_keep_selected("__meta_kubernetes_service", spec["selector"]),
            {
                "action": "keep",
                "source_labels": ["__meta_kubernetes_endpoint_port_name"],
                "regex": ep["port"],
            },
            {
                "source_labels": kind_name,
                "separator": ";",
                "regex": "Node;(.*)",
                "replacement": "${1}",
                "target_label": "node",
            },
            {
                "source_labels": kind_name,
                "separator": ";",
                "regex": "Pod;(.*)",
                "replacement": "${1}",
                "target_label": "pod",
            },
            {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
            {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "service"},
            {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
            {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
            {
                "action": "drop",
                "source_labels": ["__meta_kubernetes_pod_phase"],
                "regex": "(Failed|Succeeded)",
            },
            {
                "source_labels": ["__meta_kubernetes_service_name"],
                "target_label": "job",
                "replacement": "${1}",
            },
            {"target_label": "endpoint", "replacement": ep["port"]},
        ]
        configs.append(_job(f"serviceMonitor/{ns}/{name}/{i}", ep, targets, relabel))
    return configs


def _pod_monitor(monitor: dict[str, Any], live: list[Pod]) -> list[dict]:
    spec, ns, name = monitor["spec"], monitor["metadata"].get("namespace"), monitor["metadata"]["name"]
    targets = [
        t
        for t in _pod_targets(live)
        if t["labels"]["__meta_kubernetes_namespace"] in spec["namespaceSelector"]["matchNames"]
    ]
    configs = []
    for i, ep in enumerate(spec["podMetricsEndpoints"]):
        relabel = [
            {"source_labels": ["job"], "target_label": "__tmp_prometheus_job_name"},
            {
                "action": "drop",
                "source_labels": ["__meta_kubernetes_pod_phase"],
                "regex": "(Failed|Succeeded)",
            },
            *_keep_selected("__meta_kubernetes_pod", spec["selector"]),
            {
                "action": "keep",
                "source_labels": ["__meta_kubernetes_pod_container_port_name"],
                "regex": ep["port"],
            },
            {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
            {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
            {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
            {"target_label": "job", "replacement": f"{ns}/{name}"},
            {"target_label": "endpoint", "replacement": ep["port"]},
        ]
        configs.append(_job(f"podMonitor/{ns}/{name}/{i}", ep, targets, relabel))
    return configs


def _job(name: str, ep: dict[str, Any], targets: list[dict], relabel: list[dict]) -> dict[str, Any]:
    return {
        "job_name": name,
        "honor_labels": bool(ep.get("honorLabels", False)),
        "metrics_path": ep.get("path", "/metrics"),
        "static_configs": targets,
        "relabel_configs": relabel,
    }


def scrape_configs(objects: list[dict[str, Any]], live: list[Pod], namespace: str) -> list[dict[str, Any]]:
    """The operator's scrape jobs for the rendered ServiceMonitor or PodMonitor among `objects` (the chart's
    render, with its `namespace` filled in), over `live` pods."""
    monitors = [o for o in objects if o["kind"] in TARGET_LABELS]
    assert len(monitors) == 1, f"expected one ServiceMonitor or PodMonitor, found {len(monitors)}"
    [monitor] = monitors
    monitor = {**monitor, "metadata": {"namespace": namespace, **monitor["metadata"]}}
    if monitor["kind"] == "ServiceMonitor":
        return _service_monitor(monitor, objects, live)
    return _pod_monitor(monitor, live)
