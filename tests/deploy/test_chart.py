"""The Helm chart renders valid, lint-clean objects for every value set, and each feature does what it says."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import helm_python
import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubesgl.cli import build_parser
from support.chart import CHART, NAMESPACE, RELEASE, VALUE_SETS, merged, render
from support.crd_schemas import crd_kinds, validate_custom_resource

KUBE_VERSION = "1.32.0"


def one(objects: list[dict[str, Any]], kind: str, component: str) -> dict[str, Any]:
    found = [
        o
        for o in objects
        if o["kind"] == kind and o["metadata"]["labels"].get("app.kubernetes.io/component") == component
    ]
    assert len(found) == 1, f"expected one {kind} for {component}, found {len(found)}"
    return found[0]


def pod_specs(objects: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    for o in objects:
        if o["kind"] in ("Deployment", "StatefulSet", "Job"):
            yield o["metadata"]["name"], o["spec"]["template"]["spec"]
        elif o["kind"] == "LeaderWorkerSet":
            for role in ("leader", "worker"):
                yield (
                    f"{o['metadata']['name']}/{role}",
                    o["spec"]["leaderWorkerTemplate"][f"{role}Template"]["spec"],
                )
        elif o["kind"] == "Pod":
            yield o["metadata"]["name"], o["spec"]


def container(objects: list[dict[str, Any]], kind: str, component: str) -> dict[str, Any]:
    return one(objects, kind, component)["spec"]["template"]["spec"]["containers"][0]


def arg(container_spec: dict[str, Any], flag: str) -> str:
    args = container_spec["args"]
    return args[args.index(flag) + 1]


def env(container_spec: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container_spec.get("env", [])}


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_chart_lints_clean(value_set: str) -> None:
    report = helm_python.lint(CHART, VALUE_SETS[value_set], strict=True, kube_version="v1.32.0")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == [] and problems == [], report


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_every_rendered_object_is_valid(value_set: str) -> None:
    """Kubernetes kinds against Kubernetes 1.32's schemas, custom resources against their projects' CRDs
    (tests/data/crds); both strict: an unknown field fails."""
    for obj in render(VALUE_SETS[value_set]):
        if (obj["apiVersion"], obj["kind"]) in crd_kinds():
            validate_custom_resource(obj)
        else:
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


def test_every_custom_resource_kind_has_its_crd() -> None:
    rendered = {(o["apiVersion"], o["kind"]) for v in VALUE_SETS.values() for o in render(v)}
    custom = {k for k in rendered if "." in k[0].split("/")[0]} - {
        ("networking.k8s.io/v1", "Ingress"),
        ("networking.k8s.io/v1", "NetworkPolicy"),
        ("rbac.authorization.k8s.io/v1", "Role"),
        ("rbac.authorization.k8s.io/v1", "RoleBinding"),
    }
    assert custom == {
        ("keda.sh/v1alpha1", "ScaledObject"),
        ("monitoring.coreos.com/v1", "ServiceMonitor"),
        ("monitoring.coreos.com/v1", "PodMonitor"),
        ("monitoring.coreos.com/v1", "PrometheusRule"),
        ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"),
    }
    assert custom <= crd_kinds()


def test_crd_schemas_reject_malformed_objects() -> None:
    objects = render(VALUE_SETS["full-features"])
    scaled = next(o for o in objects if o["kind"] == "ScaledObject")
    validate_custom_resource(scaled)
    missing = json.loads(json.dumps(scaled))
    del missing["spec"]["scaleTargetRef"]
    with pytest.raises(jsonschema.ValidationError, match="scaleTargetRef"):
        validate_custom_resource(missing)
    # Strict like the API server's field validation: a misspelt field is an error, not ignored.
    lws = next(o for o in render(VALUE_SETS["multinode-gpu"]) if o["kind"] == "LeaderWorkerSet")
    validate_custom_resource(lws)
    lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["resourcez"] = {}
    with pytest.raises(jsonschema.ValidationError, match="resourcez"):
        validate_custom_resource(lws)


def test_optional_objects_appear_only_when_enabled() -> None:
    defaults = {o["kind"] for o in render({})}
    shipped = {o["kind"] for name, v in VALUE_SETS.items() if name != "defaults" for o in render(v)}
    optional = {
        "Ingress",
        "HorizontalPodAutoscaler",
        "ScaledObject",
        "ServiceMonitor",
        "PodMonitor",
        "PrometheusRule",
        "NetworkPolicy",
        "LeaderWorkerSet",
    }
    assert defaults.isdisjoint(optional)
    assert optional <= shipped


def test_scheduler_gets_tp_gpus() -> None:
    for tp in (1, 2, 4, 8):
        spec = one(render({"scheduler": {"tp": tp}}), "StatefulSet", "scheduler")["spec"]["template"]["spec"]
        scheduler = spec["containers"][0]
        assert arg(scheduler, "--tp") == str(tp)
        assert arg(scheduler, "--device") == "cuda"
        assert scheduler["resources"]["limits"]["nvidia.com/gpu"] == tp
        assert scheduler["resources"]["requests"]["nvidia.com/gpu"] == tp
        assert scheduler["image"].startswith("ghcr.io/kubesgl/kubesgl-cuda:")
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    cpu = container(render(VALUE_SETS["cpu-demo"]), "StatefulSet", "scheduler")
    assert "nvidia.com/gpu" not in json.dumps(cpu["resources"])
    assert arg(cpu, "--device") == "cpu"
    assert cpu["image"].startswith("ghcr.io/kubesgl/kubesgl-cpu-scheduler:")


def test_shm_volume_sized() -> None:
    spec = one(render({"scheduler": {"shmSize": "48Gi"}}), "StatefulSet", "scheduler")["spec"]["template"][
        "spec"
    ]
    dshm = next(v for v in spec["volumes"] if v["name"] == "dshm")
    assert dshm["emptyDir"] == {"medium": "Memory", "sizeLimit": "48Gi"}
    mounts = {m["mountPath"]: m["name"] for m in spec["containers"][0]["volumeMounts"]}
    assert mounts["/dev/shm"] == "dshm"


def test_startup_probe_covers_model_load() -> None:
    scheduler = container(render({}), "StatefulSet", "scheduler")
    startup = scheduler["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 30 * 60
    assert startup["httpGet"] == {"path": "/health", "port": "admin"}
    # Ready means the model is loaded and registered: traffic and rollouts wait for it.
    assert scheduler["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "admin"}
    assert scheduler["livenessProbe"]["httpGet"] == {"path": "/health", "port": "admin"}
    port = {p["name"]: p["containerPort"] for p in scheduler["ports"]}["admin"]
    assert arg(scheduler, "--admin-port") == str(port)


def test_every_service_probes_health_and_readiness() -> None:
    objects = render({})
    for kind, component, port in [
        ("Deployment", "gateway", "http"),
        ("Deployment", "tokenizer", "admin"),
        ("Deployment", "detokenizer", "admin"),
        ("StatefulSet", "scheduler", "admin"),
    ]:
        spec = container(objects, kind, component)
        assert spec["readinessProbe"]["httpGet"] == {"path": "/ready", "port": port}, component
        assert spec["livenessProbe"]["httpGet"] == {"path": "/health", "port": port}, component


def test_drain_grace_period() -> None:
    objects = render({})
    scheduler_pod = one(objects, "StatefulSet", "scheduler")["spec"]["template"]["spec"]
    drain = int(arg(scheduler_pod["containers"][0], "--drain-timeout"))
    assert drain >= 60 and scheduler_pod["terminationGracePeriodSeconds"] > drain
    gateway_pod = one(objects, "Deployment", "gateway")["spec"]["template"]["spec"]
    gateway = gateway_pod["containers"][0]
    pre_stop = int(gateway["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert pre_stop > 0
    assert gateway_pod["terminationGracePeriodSeconds"] > pre_stop + int(arg(gateway, "--drain-timeout"))
    for component in ("tokenizer", "detokenizer"):
        pod = one(objects, "Deployment", component)["spec"]["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] > int(arg(pod["containers"][0], "--drain-timeout"))
    with pytest.raises(helm_python.HelmError, match="must exceed scheduler.drainTimeoutSeconds"):
        render({"scheduler": {"drainTimeoutSeconds": 600, "terminationGracePeriodSeconds": 600}})
    with pytest.raises(helm_python.HelmError, match="gateway.terminationGracePeriodSeconds"):
        render({"gateway": {"drainTimeoutSeconds": 115}})


@pytest.mark.parametrize(
    ("gateway", "workers"),
    [
        ({}, "1"),  # the default request, 500m: one worker
        ({"resources": {"requests": {"cpu": "2500m"}}}, "3"),
        ({"resources": {"requests": {"cpu": 4}}}, "4"),
        ({"resources": {"requests": {"cpu": "0.2"}}}, "1"),
        ({"resources": {"requests": {}}}, "1"),
        ({"workers": 6, "resources": {"requests": {"cpu": "1"}}}, "6"),
    ],
)
def test_gateway_workers_follow_the_cpu_request(gateway: dict[str, Any], workers: str) -> None:
    """gateway.workers 0 (default) runs one gateway process per requested core, rounded up; a number is kept."""
    assert arg(container(render({"gateway": gateway}), "Deployment", "gateway"), "--workers") == workers


def test_security_contexts_hardened() -> None:
    for value_set, values in VALUE_SETS.items():
        for name, pod in pod_specs(render(values)):
            where = f"{value_set}: {name}"
            assert pod["securityContext"]["runAsNonRoot"] is True, where
            assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, where
            assert pod["automountServiceAccountToken"] is False, where
            for c in pod.get("initContainers", []) + pod["containers"]:
                sc = c["securityContext"]
                assert sc["allowPrivilegeEscalation"] is False, f"{where}/{c['name']}"
                assert sc["readOnlyRootFilesystem"] is True, f"{where}/{c['name']}"
                assert sc["capabilities"]["drop"] == ["ALL"], f"{where}/{c['name']}"
                assert "add" not in sc["capabilities"], f"{where}/{c['name']}"
                if not c["image"].startswith("ghcr.io/kubesgl/"):
                    continue
                # Read-only root: the paths our images write to are volumes.
                mounts = {m["mountPath"] for m in c["volumeMounts"]}
                assert {"/tmp"} <= mounts, f"{where}/{c['name']}"


def test_networkpolicy_isolates_nats() -> None:
    objects = render(VALUE_SETS["full-features"])
    policies = {o["metadata"]["name"]: o["spec"] for o in objects if o["kind"] == "NetworkPolicy"}
    nats = policies[f"{RELEASE}-nats"]
    client_rule = next(r for r in nats["ingress"] if r["ports"][0]["port"] == "client")
    assert client_rule["from"] == [
        {
            "podSelector": {
                "matchLabels": {"app.kubernetes.io/instance": RELEASE, "kubesgl.io/nats-client": "true"}
            }
        }
    ]
    # The label that opens NATS is on exactly the four kubesgl services' pods.
    clients = {
        o["metadata"]["labels"]["app.kubernetes.io/component"]
        for o in objects
        if o["kind"] in ("Deployment", "StatefulSet")
        and o["spec"]["template"]["metadata"]["labels"].get("kubesgl.io/nats-client") == "true"
    }
    assert clients == {"gateway", "tokenizer", "detokenizer", "scheduler"}
    test_pod = next(o for o in objects if o["kind"] == "Pod")
    assert "kubesgl.io/nats-client" not in test_pod["metadata"]["labels"]
    # Only the gateway takes traffic; the other services accept scrapes of their admin port only.
    gateway = policies[f"{RELEASE}-gateway"]
    np = VALUE_SETS["full-features"]["networkPolicy"]
    assert gateway["ingress"] == [
        {
            "ports": [{"port": "http", "protocol": "TCP"}],
            "from": np["gatewayFrom"] + [{"podSelector": {"matchLabels": _selector(test_pod)}}],
        },
        {"ports": [{"port": "http", "protocol": "TCP"}], "from": np["metricsFrom"]},
    ]
    for component in ("tokenizer", "detokenizer", "scheduler"):
        rules = policies[f"{RELEASE}-{component}"]["ingress"]
        assert rules == [{"ports": [{"port": "admin", "protocol": "TCP"}], "from": np["metricsFrom"]}]
    for spec in policies.values():
        assert spec["policyTypes"] == ["Ingress"]


def _selector(pod: dict[str, Any]) -> dict[str, str]:
    labels = pod["metadata"]["labels"]
    return {
        k: labels[k]
        for k in ("app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/component")
    }


def _admits(rule: dict[str, Any], pod: dict[str, Any]) -> bool:
    """Whether a NetworkPolicy ingress rule lets a pod of this release's namespace in (podSelector peers)."""
    if "from" not in rule:
        return True
    labels = pod["metadata"]["labels"]
    return any(
        set(peer) == {"podSelector"} and _matches(peer["podSelector"].get("matchLabels", {}), labels)
        for peer in rule["from"]
    )


def test_helm_test_pod_gets_through_the_gateway_policy() -> None:
    """With gatewayFrom set the gateway admits only those peers: the `helm test` pod is admitted explicitly,
    and nothing else of the release is."""
    objects = render(VALUE_SETS["full-features"])
    test_pod = next(o for o in objects if o["kind"] == "Pod")
    gateway = next(
        o for o in objects if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == f"{RELEASE}-gateway"
    )
    rule, _metrics = gateway["spec"]["ingress"]
    assert _admits(rule, test_pod)
    tokenizer_pod = one(objects, "Deployment", "tokenizer")["spec"]["template"]
    assert not any(_admits(r, tokenizer_pod) for r in gateway["spec"]["ingress"])
    # Without the test pod, no rule for it; without gatewayFrom, every source is admitted anyway.
    quiet = merged(VALUE_SETS["full-features"], {"tests": {"enabled": False}})
    gateway = next(
        o
        for o in render(quiet)
        if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == f"{RELEASE}-gateway"
    )
    assert (
        gateway["spec"]["ingress"][0]["from"] == VALUE_SETS["full-features"]["networkPolicy"]["gatewayFrom"]
    )
    open_policy = next(
        o
        for o in render({"networkPolicy": {"enabled": True}})
        if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == f"{RELEASE}-gateway"
    )
    assert _admits(open_policy["spec"]["ingress"][0], test_pod)


def test_multinode_ranks_reach_each_other() -> None:
    objects = render(VALUE_SETS["multinode-gpu"])
    policy = next(
        o for o in objects if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == f"{RELEASE}-scheduler"
    )
    lws = next(o for o in objects if o["kind"] == "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]
    leader, worker = lws["leaderTemplate"], lws["workerTemplate"]
    # Workers reach the leader's rendezvous and each other on any port; NATS only from the leader.
    rank_rule = next(r for r in policy["spec"]["ingress"] if "ports" not in r)
    assert _admits(rank_rule, worker) and _admits(rank_rule, leader)
    assert leader["metadata"]["labels"].get("kubesgl.io/nats-client") == "true"
    assert "kubesgl.io/nats-client" not in worker["metadata"]["labels"]
    single = next(
        o
        for o in render(VALUE_SETS["full-features"])
        if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == f"{RELEASE}-scheduler"
    )
    assert all("ports" in r for r in single["spec"]["ingress"])


def test_bundled_nats_pdb_spread_and_exporter_probes() -> None:
    objects = render(VALUE_SETS["full-features"])
    nats = one(objects, "StatefulSet", "nats")
    pdb = one(objects, "PodDisruptionBudget", "nats")["spec"]
    assert pdb["maxUnavailable"] == 1
    assert _matches(pdb["selector"]["matchLabels"], nats["spec"]["template"]["metadata"]["labels"])
    pod = nats["spec"]["template"]["spec"]
    [term] = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert _matches(
        term["podAffinityTerm"]["labelSelector"]["matchLabels"],
        nats["spec"]["template"]["metadata"]["labels"],
    )
    exporter = next(c for c in pod["containers"] if c["name"] == "exporter")
    assert (
        exporter["readinessProbe"]["httpGet"]
        == exporter["livenessProbe"]["httpGet"]
        == {"path": "/metrics", "port": "metrics"}
    )
    hard = one(render({"nats": {"bundled": {"podAntiAffinity": "hard"}}}), "StatefulSet", "nats")
    assert (
        "requiredDuringSchedulingIgnoredDuringExecution"
        in hard["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    )
    mine = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["infra"]}]}
                ]
            }
        }
    }
    own = one(render({"nats": {"bundled": {"affinity": mine}}}), "StatefulSet", "nats")
    assert own["spec"]["template"]["spec"]["affinity"] == mine
    assert (
        "affinity"
        not in one(render({"nats": {"bundled": {"podAntiAffinity": "none"}}}), "StatefulSet", "nats")["spec"][
            "template"
        ]["spec"]
    )


def credential_files(pod: dict[str, Any], container_spec: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """KUBESGL_NATS_*_FILE variables -> the (Secret, key) the file they name is mounted from."""
    mounts = {m["mountPath"]: m["name"] for m in container_spec.get("volumeMounts", [])}
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    found = {}
    for name, value in env(container_spec).items():
        if name.startswith("KUBESGL_NATS_") and name.endswith("_FILE"):
            directory, _, file = value.rpartition("/")
            secret = volumes[mounts[directory]]["secret"]
            [key] = [i["key"] for i in secret["items"] if i["path"] == file]
            found[name] = (secret["secretName"], key)
    return found


def test_no_container_takes_a_nats_credential_from_its_environment() -> None:
    """Credentials reach kubesgl's containers as files from the mounted Secret (KUBESGL_NATS_*_FILE), so they
    show in no `kubectl describe`, process environment or crash dump."""
    for value_set, values in VALUE_SETS.items():
        for where, pod in pod_specs(render(values)):
            for c in pod.get("initContainers", []) + pod["containers"]:
                refs = [e["name"] for e in c.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})]
                if c["name"] in ("nats", "credentials") or where.endswith("nats-credentials"):
                    continue  # the NATS server's own config reads its token from the environment
                assert not [r for r in refs if r.startswith("KUBESGL_NATS_")], (
                    value_set,
                    where,
                    c["name"],
                    refs,
                )
                if (
                    "KUBESGL_NATS_URL" in env(c)
                    and values.get("nats", {}).get("auth", {}).get("mode") != "none"
                ):
                    assert credential_files(pod, c), (value_set, where, c["name"])


def test_external_nats_runs_no_server_and_uses_secret_credentials() -> None:
    values = VALUE_SETS["external-nats"]
    objects = render(values)
    assert not [o for o in objects if o["metadata"]["labels"].get("app.kubernetes.io/component") == "nats"]
    for kind, component in [
        ("Deployment", "gateway"),
        ("Deployment", "tokenizer"),
        ("Deployment", "detokenizer"),
        ("StatefulSet", "scheduler"),
    ]:
        spec = one(objects, kind, component)["spec"]["template"]["spec"]
        variables = env(spec["containers"][0])
        assert variables["KUBESGL_NATS_URL"] == values["nats"]["external"]["url"]
        secret = values["nats"]["auth"]["existingSecret"]
        assert credential_files(spec, spec["containers"][0]) == {
            "KUBESGL_NATS_USER_FILE": (secret, "user"),
            "KUBESGL_NATS_PASSWORD_FILE": (secret, "password"),
        }
        assert variables["KUBESGL_NATS_TLS_CA"] == "/etc/kubesgl/nats-tls/ca.crt"
        assert variables["KUBESGL_NATS_TLS_CERT"] == "/etc/kubesgl/nats-tls/tls.crt"
        tls_volume = next(v for v in spec["volumes"] if v["name"] == "nats-tls")
        assert tls_volume["secret"]["secretName"] == values["nats"]["tls"]["existingSecret"]


def test_bundled_nats_enforces_the_token_the_services_send() -> None:
    objects = render({})
    # The hook Job makes the Secret in the cluster (test_chart_upgrades.py runs it).
    job = one(objects, "Job", "nats-credentials")["spec"]["template"]["spec"]["containers"][0]
    secret_name, token_key = env(job)["SECRET_NAME"], env(job)["TOKEN_KEY"]
    server = container(objects, "StatefulSet", "nats")
    assert env(server)["NATS_TOKEN"] == {"secretKeyRef": {"name": secret_name, "key": token_key}}
    conf = one(objects, "ConfigMap", "nats")["data"]["nats.conf"]
    assert "token: $NATS_TOKEN" in conf and "max_payload: 8388608" in conf
    gateway_pod = one(objects, "Deployment", "gateway")["spec"]["template"]["spec"]
    gateway = gateway_pod["containers"][0]
    assert credential_files(gateway_pod, gateway) == {"KUBESGL_NATS_TOKEN_FILE": (secret_name, token_key)}
    assert env(gateway)["KUBESGL_NATS_URL"] == f"nats://{RELEASE}-nats:4222"


def test_bundled_nats_runs_at_the_gomaxprocs_asked_for() -> None:
    assert env(container(render({}), "StatefulSet", "nats"))["GOMAXPROCS"] == "2"
    assert (
        env(container(render({"nats": {"bundled": {"goMaxProcs": 6}}}), "StatefulSet", "nats"))["GOMAXPROCS"]
        == "6"
    )
    assert "GOMAXPROCS" not in env(
        container(render({"nats": {"bundled": {"goMaxProcs": 0}}}), "StatefulSet", "nats")
    )


def test_bundled_nats_cluster_and_jetstream() -> None:
    objects = render(VALUE_SETS["full-features"])
    conf = one(objects, "ConfigMap", "nats")["data"]["nats.conf"]
    for i in range(3):
        assert f"nats://{RELEASE}-nats-{i}.{RELEASE}-nats-headless:6222" in conf
    assert "jetstream {" in conf and "max_file_store: 10G" in conf
    nats = one(objects, "StatefulSet", "nats")
    assert nats["spec"]["replicas"] == 3
    assert nats["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "10Gi"
    assert [c["name"] for c in nats["spec"]["template"]["spec"]["containers"]] == ["nats", "exporter"]


def test_keda_scales_schedulers_on_queue_depth() -> None:
    objects = render(VALUE_SETS["full-features"])
    scaled = next(o for o in objects if o["kind"] == "ScaledObject")["spec"]
    statefulset = one(objects, "StatefulSet", "scheduler")
    assert scaled["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "name": statefulset["metadata"]["name"],
    }
    trigger = scaled["triggers"][0]["metadata"]
    # Per pod first (max), so a pod two scrape jobs see still counts once.
    assert (
        trigger["query"]
        == f'sum(max by (pod) (sglang:num_queue_reqs{{namespace="{NAMESPACE}",pod=~"{RELEASE}-scheduler-[0-9]+"}}))'
    )
    assert trigger["serverAddress"] == "http://prometheus-operated.monitoring:9090"
    assert trigger["threshold"] == "8"
    # KEDA owns the replica count; the StatefulSet must not fight it.
    assert "replicas" not in statefulset["spec"]
    # Never to zero, never scaled down blind, and one new instance per model load.
    assert scaled["minReplicaCount"] >= 1
    assert scaled["fallback"] == {"failureThreshold": 3, "replicas": 1, "behavior": "currentReplicasIfHigher"}
    # A vanished metric (the query's result empty: test_prometheus_queries.py) is a failure the fallback counts,
    # not a queue of 0.
    assert trigger["ignoreNullValues"] == "false"
    behavior = scaled["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleUp"]["policies"] == [{"type": "Pods", "value": 1, "periodSeconds": 300}]
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] == 900
    # A multi-node instance scales as LWS groups (its leaders' queues).
    lws = next(o for o in render(VALUE_SETS["multinode-gpu"]) if o["kind"] == "ScaledObject")["spec"]
    assert lws["scaleTargetRef"] == {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "name": f"{RELEASE}-scheduler",
    }


def test_scale_to_zero_is_refused() -> None:
    values = {
        "scheduler": {
            "autoscaling": {"enabled": True, "prometheusAddress": "http://p:9090", "minReplicas": 0}
        }
    }
    with pytest.raises(helm_python.HelmError, match="minReplicas"):
        render(values)


def test_hpa_owns_replicas_when_enabled() -> None:
    objects = render(VALUE_SETS["full-features"])
    for component in ("gateway", "tokenizer", "detokenizer"):
        assert "replicas" not in one(objects, "Deployment", component)["spec"]
        hpa = one(objects, "HorizontalPodAutoscaler", component)["spec"]
        assert hpa["scaleTargetRef"]["name"] == f"{RELEASE}-{component}"
    gateway = one(objects, "HorizontalPodAutoscaler", "gateway")["spec"]
    # In flight per pod, next to CPU: the HPA follows whichever asks for more pods.
    assert gateway["metrics"][1] == {
        "type": "Pods",
        "pods": {
            "metric": {"name": "kubesgl_gateway_requests_in_flight"},
            "target": {"type": "AverageValue", "averageValue": "64"},
        },
    }
    assert gateway["behavior"] == {"scaleDown": {"stabilizationWindowSeconds": 300}}
    tokenizer = one(objects, "HorizontalPodAutoscaler", "tokenizer")["spec"]
    assert [m["type"] for m in tokenizer["metrics"]] == ["Resource"] and "behavior" not in tokenizer


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def pod_templates(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every workload's pod template by name (a LeaderWorkerSet's as <name>/leader and <name>/worker)."""
    templates = {}
    for o in objects:
        if o["kind"] in ("Deployment", "StatefulSet"):
            templates[o["metadata"]["name"]] = o["spec"]["template"]
        elif o["kind"] == "LeaderWorkerSet":
            lwt = o["spec"]["leaderWorkerTemplate"]
            templates |= {f"{o['metadata']['name']}/{r}": lwt[f"{r}Template"] for r in ("leader", "worker")}
    return templates


def scrape_targets(objects: list[dict[str, Any]]) -> dict[tuple[str, int], list[str]]:
    """(pod template, container port) -> every scrape that reaches it: pod annotations, ServiceMonitor
    endpoints (through the Services it selects) and PodMonitor endpoints."""
    pods = []  # (template name, labels, annotations, {port name: number})
    for name, template in pod_templates(objects).items():
        ports = {
            p["name"]: p["containerPort"] for c in template["spec"]["containers"] for p in c.get("ports", [])
        }
        meta = template["metadata"]
        pods.append((name, meta["labels"], meta.get("annotations", {}), ports))
    seen: dict[tuple[str, int], list[str]] = {}
    for name, _, pod_annotations, _ in pods:
        if pod_annotations.get("prometheus.io/scrape") == "true":
            seen.setdefault((name, int(pod_annotations["prometheus.io/port"])), []).append("annotations")
    for monitor in (o for o in objects if o["kind"] == "ServiceMonitor"):
        wanted = {e["port"] for e in monitor["spec"]["endpoints"]}
        for svc in (o for o in objects if o["kind"] == "Service"):
            if not _matches(monitor["spec"]["selector"]["matchLabels"], svc["metadata"]["labels"]):
                continue
            for port in (p for p in svc["spec"]["ports"] if p["name"] in wanted):
                for name, labels, _, ports in pods:
                    if _matches(svc["spec"]["selector"], labels) and port["targetPort"] in ports:
                        seen.setdefault((name, ports[port["targetPort"]]), []).append(
                            f"ServiceMonitor/{svc['metadata']['name']}"
                        )
    for monitor in (o for o in objects if o["kind"] == "PodMonitor"):
        for endpoint in monitor["spec"]["podMetricsEndpoints"]:
            for name, labels, _, ports in pods:
                if _matches(monitor["spec"]["selector"]["matchLabels"], labels) and endpoint["port"] in ports:
                    seen.setdefault((name, ports[endpoint["port"]]), []).append("PodMonitor")
    return seen


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_each_target_is_scraped_once(value_set: str) -> None:
    """Whatever the values, no pod port is scraped twice (a double scrape doubles every sum: KEDA would add
    instances for requests nobody queued), and when scraping is on every metrics port is scraped."""
    objects = render(VALUE_SETS[value_set])
    seen = scrape_targets(objects)
    assert {t: s for t, s in seen.items() if len(s) > 1} == {}
    metrics_ports = {
        (name, port)
        for o in objects
        if o["kind"] in ("Deployment", "StatefulSet")
        for name, port in [
            (o["metadata"]["name"], p["containerPort"])
            for c in o["spec"]["template"]["spec"]["containers"]
            for p in c.get("ports", [])
            if p["name"] in ("http", "admin", "metrics")
        ]
    } | {
        (f"{o['metadata']['name']}/leader", p["containerPort"])
        for o in objects
        if o["kind"] == "LeaderWorkerSet"
        for c in o["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"]
        for p in c.get("ports", [])
        if p["name"] == "admin"
    }
    assert set(seen) == metrics_ports
    # Worker pods of a multi-node instance serve no metrics (rank 0 counts for the whole instance).
    assert not [t for t in seen if t[0].endswith("/worker")]


SCRAPE_PATHS = {
    "serviceMonitor": {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": False}},
    "podMonitor": {"serviceMonitor": {"enabled": False}, "podMonitor": {"enabled": True}},
    "annotations": {"serviceMonitor": {"enabled": False}, "podMonitor": {"enabled": False}},
}


def _admitted(objects: list[dict[str, Any]], template: dict[str, Any], port: int, peers: list[Any]) -> bool:
    """Whether the NetworkPolicies selecting the pod let every one of `peers` reach its container `port`."""
    names = {
        p["containerPort"]: p["name"] for c in template["spec"]["containers"] for p in c.get("ports", [])
    }
    policies = [
        o["spec"]
        for o in objects
        if o["kind"] == "NetworkPolicy"
        and _matches(o["spec"]["podSelector"].get("matchLabels", {}), template["metadata"]["labels"])
    ]
    if not policies:
        return True  # an unselected pod is not isolated
    return any(
        ("ports" not in rule or any(p["port"] in (port, names[port]) for p in rule["ports"]))
        and (not rule.get("from") or all(peer in rule["from"] for peer in peers))
        for spec in policies
        for rule in spec.get("ingress", [])
    )


@pytest.mark.parametrize("scrape", sorted(SCRAPE_PATHS))
@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_network_policy_admits_every_scrape_from_metrics_from(value_set: str, scrape: str) -> None:
    """With NetworkPolicies on, Prometheus (networkPolicy.metricsFrom) reaches every port it is told to scrape,
    the gateway's too (its API port serves /metrics)."""
    values = merged(
        VALUE_SETS[value_set], {"networkPolicy": {"enabled": True}, "metrics": SCRAPE_PATHS[scrape]}
    )
    objects = render(values)
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())["networkPolicy"]["metricsFrom"]
    peers = values["networkPolicy"].get("metricsFrom", defaults)
    templates = pod_templates(objects)
    targets = scrape_targets(objects)
    assert targets
    refused = [t for t in targets if not _admitted(objects, templates[t[0]], t[1], peers)]
    assert refused == []


def test_both_monitors_are_refused() -> None:
    both = {"metrics": {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True}}}
    with pytest.raises(helm_python.HelmError, match="would scrape every pod twice"):
        render(both)
    # With a monitor on, the pods carry no scrape annotations a second (annotation-based) job would follow.
    for monitor in ("serviceMonitor", "podMonitor"):
        objects = render({"metrics": {monitor: {"enabled": True}}})
        for o in objects:
            if o["kind"] in ("Deployment", "StatefulSet"):
                assert "prometheus.io/scrape" not in o["spec"]["template"]["metadata"].get("annotations", {})


def test_model_sources() -> None:
    hf = VALUE_SETS["gpu-tp4"]
    objects = render(hf)
    statefulset = one(objects, "StatefulSet", "scheduler")
    pod = statefulset["spec"]["template"]["spec"]
    download = pod["initContainers"][0]
    download_env = env(download)
    assert download_env["HF_MODEL_REPO"] == "Qwen/Qwen3-8B"
    assert download_env["HF_MODEL_REVISION"] == hf["model"]["huggingface"]["revision"]
    assert download_env["HF_TOKEN"] == {"secretKeyRef": {"name": "hf-token", "key": "token"}}
    assert download_env["HF_MODEL_DIR"] == arg(pod["containers"][0], "--model")
    claim = statefulset["spec"]["volumeClaimTemplates"][0]["spec"]
    assert claim["resources"]["requests"]["storage"] == "40Gi" and claim["storageClassName"] == "fast-ssd"
    assert arg(pod["containers"][0], "--served-model-name") == "qwen3-8b"
    tokenizer = one(objects, "Deployment", "tokenizer")["spec"]["template"]["spec"]
    # Tokenizer pods fetch only tokenizer files, never the weights.
    assert "*.json" in env(tokenizer["initContainers"][0])["HF_ALLOW_PATTERNS"]
    assert arg(tokenizer["containers"][0], "--served-model-name") == "qwen3-8b"

    pvc = render(VALUE_SETS["external-nats"])
    for kind, component in [
        ("StatefulSet", "scheduler"),
        ("Deployment", "tokenizer"),
        ("Deployment", "detokenizer"),
    ]:
        spec = one(pvc, kind, component)["spec"]["template"]["spec"]
        assert "initContainers" not in spec
        volume = next(v for v in spec["volumes"] if v["name"] == "model")
        assert volume["persistentVolumeClaim"] == {"claimName": "models-rwx", "readOnly": True}
        assert arg(spec["containers"][0], "--model") == "/models/Qwen3-8B"
    assert "volumeClaimTemplates" not in one(pvc, "StatefulSet", "scheduler")["spec"]


def test_demo_init_container_builds_the_model_the_services_load(tmp_path: Path) -> None:
    objects = render(VALUE_SETS["cpu-demo"])
    pods = [
        one(objects, kind, component)["spec"]["template"]["spec"]
        for kind, component in [
            ("StatefulSet", "scheduler"),
            ("Deployment", "tokenizer"),
            ("Deployment", "detokenizer"),
        ]
    ]
    init = pods[0]["initContainers"][0]
    assert init["name"] == "demo-model" and init["image"].startswith("ghcr.io/kubesgl/kubesgl-cpu-scheduler:")
    mount = next(m["mountPath"] for m in init["volumeMounts"] if m["name"] == "model")
    # Run the init container's own script with the model volume at tmp_path.
    variables = env(init) | {"DEMO_MODEL_PARENT": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, *init["command"][1:]],
        env={**os.environ, **variables},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    for pod in pods:
        assert pod["initContainers"] == [init]
        model_arg = arg(pod["containers"][0], "--model")
        assert model_arg.startswith(mount + "/")
        model_dir = tmp_path / model_arg.removeprefix(mount + "/")
        assert (model_dir / "config.json").is_file() and (model_dir / "tokenizer.json").is_file()
        assert "emptyDir" in next(v for v in pod["volumes"] if v["name"] == "model")
    assert arg(pods[0]["containers"][0], "--served-model-name") == "demo"
    assert arg(pods[1]["containers"][0], "--served-model-name") == "demo"


def test_tracing_wired_from_values() -> None:
    objects = render(VALUE_SETS["full-features"])
    names = set()
    for kind, component in [
        ("Deployment", "gateway"),
        ("Deployment", "tokenizer"),
        ("Deployment", "detokenizer"),
        ("StatefulSet", "scheduler"),
    ]:
        variables = env(container(objects, kind, component))
        assert variables["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector.observability:4318"
        assert variables["OTEL_TRACES_SAMPLER_ARG"] == "0.25"
        assert "OTEL_SDK_DISABLED" not in variables
        names.add(variables["OTEL_SERVICE_NAME"])
    assert names == {"kubesgl-gateway", "kubesgl-tokenizer", "kubesgl-detokenizer", "kubesgl-scheduler"}
    assert env(container(render({}), "Deployment", "gateway"))["OTEL_SDK_DISABLED"] == "true"


def test_gateway_api_keys_and_body_limit() -> None:
    objects = render(
        VALUE_SETS["full-features"]
        | {"gateway": {"apiKeys": {"existingSecret": "keys"}, "maxRequestBodyBytes": 2097152}}
    )
    pod = one(objects, "Deployment", "gateway")["spec"]["template"]["spec"]
    gateway = pod["containers"][0]
    keys_file = env(gateway)["KUBESGL_API_KEYS_FILE"]
    mount = next(m for m in gateway["volumeMounts"] if m["name"] == "api-keys")
    assert keys_file == f"{mount['mountPath']}/keys" and mount["readOnly"] is True
    volume = next(v for v in pod["volumes"] if v["name"] == "api-keys")
    assert volume["secret"] == {"secretName": "keys", "items": [{"key": "api-keys", "path": "keys"}]}
    assert arg(gateway, "--max-body-bytes") == "2097152"
    assert "KUBESGL_API_KEYS_FILE" not in env(container(render({}), "Deployment", "gateway"))


def test_numeric_args_render_as_integers() -> None:
    scheduler = container(
        render({"scheduler": {"numPages": 1234567, "maxPrefillLength": 16384}}), "StatefulSet", "scheduler"
    )
    assert arg(scheduler, "--num-pages") == "1234567"
    assert arg(scheduler, "--max-prefill-length") == "16384"


# Service flags the chart sets from its values (argparse dests), whose chart defaults must be the services'.
VALUE_FLAGS = {
    "gateway": [
        "request_timeout",
        "inactivity_timeout",
        "tokenize_attempt_timeout",
        "max_concurrent_per_key",
    ],
    "tokenizer": ["routing_policy", "kv_block_size", "overlap_weight", "load_weight", "kv_stale_after"],
    "scheduler": ["kv_event_block_size"],
}
KINDS = {"gateway": "Deployment", "tokenizer": "Deployment", "scheduler": "StatefulSet"}


def parsed_args(objects: list[dict[str, Any]], component: str) -> argparse.Namespace:
    """The component's rendered args, parsed by the `kubesgl` command itself (an unknown flag fails)."""
    return build_parser(component).parse_args(container(objects, KINDS[component], component)["args"])


def service_defaults(component: str) -> argparse.Namespace:
    required = [] if component == "gateway" else ["--model", "/m"]
    return build_parser(component).parse_args([component, *required])


def test_routing_timeouts_and_key_limit_default_as_the_services_do() -> None:
    objects = render({})
    for component, dests in VALUE_FLAGS.items():
        args = container(objects, KINDS[component], component)["args"]
        rendered, defaults = parsed_args(objects, component), service_defaults(component)
        for dest in dests:
            assert "--" + dest.replace("_", "-") in args, dest
            assert getattr(rendered, dest) == getattr(defaults, dest), dest
    assert parsed_args(objects, "tokenizer").session_affinity is False
    affinity = render({"tokenizer": {"routing": {"sessionAffinity": {"enabled": True}}}})
    assert (
        parsed_args(affinity, "tokenizer").affinity_max_load
        == service_defaults("tokenizer").affinity_max_load
    )


def test_routing_values_reach_tokenizer_and_schedulers() -> None:
    routing = {
        "policy": "least-load",
        "kvBlockSize": 32,
        "sessionAffinity": {"enabled": True, "maxLoad": 0.75},
    }
    objects = render({"tokenizer": {"routing": routing}})
    tokenizer = parsed_args(objects, "tokenizer")
    assert tokenizer.routing_policy == "least-load"
    assert tokenizer.session_affinity is True and tokenizer.affinity_max_load == 0.75
    # The cache-aware knobs are not passed to another policy, and schedulers then publish no KV events.
    assert "--kv-block-size" not in container(objects, "Deployment", "tokenizer")["args"]
    assert parsed_args(objects, "scheduler").kv_event_block_size == 0
    # Cache-aware: the tokenizers hash the same blocks the schedulers publish.
    routing = {"kvBlockSize": 32, "overlapWeight": 2.5, "loadWeight": 0.5, "kvStaleAfterSeconds": 10}
    objects = render({"tokenizer": {"routing": routing}})
    tokenizer = parsed_args(objects, "tokenizer")
    assert tokenizer.routing_policy == "cache-aware" and tokenizer.kv_block_size == 32
    assert (tokenizer.overlap_weight, tokenizer.load_weight, tokenizer.kv_stale_after) == (2.5, 0.5, 10.0)
    assert tokenizer.session_affinity is False
    assert parsed_args(objects, "scheduler").kv_event_block_size == 32


def test_gateway_timeouts_and_key_limit_from_values() -> None:
    gateway = {
        "requestTimeoutSeconds": 1800,
        "inactivityTimeoutSeconds": 45.5,
        "tokenizeAttemptTimeoutSeconds": 2,
        "maxConcurrentPerKey": 16,
    }
    args = parsed_args(render({"gateway": gateway}), "gateway")
    assert args.request_timeout == 1800.0 and args.inactivity_timeout == 45.5
    assert args.tokenize_attempt_timeout == 2.0 and args.max_concurrent_per_key == 16


def test_ingress_routes_to_gateway_service() -> None:
    objects = render(VALUE_SETS["full-features"])
    ingress = next(o for o in objects if o["kind"] == "Ingress")["spec"]
    service = one(objects, "Service", "gateway")
    backend = ingress["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": service["metadata"]["name"], "port": {"name": "http"}}
    assert ingress["ingressClassName"] == "nginx" and ingress["tls"][0]["secretName"] == "llm-example-com-tls"


def test_dashboard_configmap_loads_json(tmp_path: Path) -> None:
    chart = tmp_path / "kubesgl"
    shutil.copytree(CHART, chart)
    board = {
        "title": "probe",
        "panels": [{"type": "timeseries", "targets": [{"expr": "sglang:num_queue_reqs"}]}],
    }
    (chart / "dashboards" / "probe.json").write_text(json.dumps(board))
    configmap = next(
        o
        for o in render({}, chart)
        if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("-dashboards")
    )
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(configmap["data"]["probe.json"]) == board
    # Every dashboard shipped in the chart is loaded and is valid JSON.
    for path in (CHART / "dashboards").glob("*.json"):
        assert json.loads(configmap["data"][path.name]) == json.loads(path.read_text())
    disabled = render({"metrics": {"grafanaDashboards": {"enabled": False}}}, chart)
    assert not [o for o in disabled if o["metadata"]["name"].endswith("-dashboards")]


class FakeGatewayModelsHandler(BaseHTTPRequestHandler):
    """Stands in for the gateway's GET /v1/models (the test is about the helm test pod's script)."""

    listed: list[str] = []
    seen_auth: list[str | None] = []

    def do_GET(self) -> None:
        self.seen_auth.append(self.headers.get("Authorization"))
        body = json.dumps(
            {"object": "list", "data": [{"id": m, "object": "model"} for m in self.listed]}
        ).encode()
        self.send_response(200 if self.path == "/v1/models" else 404)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def run_test_pod_script(
    pod: dict[str, Any], listed: list[str], tmp_path: Path
) -> subprocess.CompletedProcess[str]:
    FakeGatewayModelsHandler.listed = listed
    FakeGatewayModelsHandler.seen_auth = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeGatewayModelsHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        spec = pod["spec"]["containers"][0]
        variables = {k: v for k, v in env(spec).items() if isinstance(v, str)}
        variables["MODELS_URL"] = f"http://127.0.0.1:{server.server_port}/v1/models"
        variables["TIMEOUT_SECONDS"] = "1"
        if "API_KEYS_FILE" in variables:
            keys = tmp_path / "keys"
            keys.write_text("\n  sk-first  \nsk-second\n")
            variables["API_KEYS_FILE"] = str(keys)
        command = [sys.executable, *spec["command"][1:]]
        return subprocess.run(
            command, env={**os.environ, **variables}, capture_output=True, text=True, timeout=30
        )
    finally:
        server.shutdown()
        server.server_close()


def test_helm_test_pod_calls_models(tmp_path: Path) -> None:
    objects = render(VALUE_SETS["full-features"])
    pod = next(o for o in objects if o["kind"] == "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    gateway_service = one(objects, "Service", "gateway")
    port = gateway_service["spec"]["ports"][0]["port"]
    assert (
        env(pod["spec"]["containers"][0])["MODELS_URL"]
        == f"http://{gateway_service['metadata']['name']}:{port}/v1/models"
    )
    served = arg(container(objects, "StatefulSet", "scheduler"), "--served-model-name")
    assert env(pod["spec"]["containers"][0])["SERVED_MODEL"] == served

    passed = run_test_pod_script(pod, [served], tmp_path)
    assert passed.returncode == 0, passed.stderr
    assert FakeGatewayModelsHandler.seen_auth == ["Bearer sk-first"]
    failed = run_test_pod_script(pod, ["some-other-model"], tmp_path)
    assert failed.returncode != 0 and "FAIL" in failed.stderr


def test_every_image_can_be_pinned_by_digest() -> None:
    """Each image block takes a `digest` (sha256:...) that wins over its tag, the NATS server's and exporter's
    too, so a release can run exactly the images it was tested with."""
    digest = "sha256:" + "ab" * 32
    pinned = {"digest": digest}
    values = merged(
        VALUE_SETS["full-features"],
        {
            "image": {"cpu": pinned, "cpuScheduler": pinned, "cuda": pinned},
            "nats": {"bundled": {"image": pinned, "metrics": {"image": pinned}}},
        },
    )
    for where, pod in pod_specs(render(values)):
        for c in pod.get("initContainers", []) + pod["containers"]:
            assert c["image"].endswith("@" + digest), (where, c["name"], c["image"])
    # By default: tags (the chart's appVersion for kubesgl's own images).
    default = {c["image"] for _, pod in pod_specs(render({})) for c in pod["containers"]}
    assert "ghcr.io/kubesgl/kubesgl:0.1.0" in default and not [i for i in default if "@" in i]


@pytest.mark.parametrize("component", ["gateway", "tokenizer", "detokenizer"])
def test_stateless_services_survive_a_node_drain(component: str) -> None:
    """A PDB lets a drain take one replica at a time; tokenizer and detokenizer spread over nodes by default, so
    one node's loss leaves their queue group serving."""
    objects = render({})
    labels = one(objects, "Deployment", component)["spec"]["template"]["metadata"]["labels"]
    pdb = one(objects, "PodDisruptionBudget", component)["spec"]
    assert pdb["maxUnavailable"] == 1 and _matches(pdb["selector"]["matchLabels"], labels)
    if component != "gateway":
        [spread] = one(objects, "Deployment", component)["spec"]["template"]["spec"][
            "topologySpreadConstraints"
        ]
        assert (
            spread["topologyKey"] == "kubernetes.io/hostname"
            and spread["whenUnsatisfiable"] == "ScheduleAnyway"
        )
        assert _matches(spread["labelSelector"]["matchLabels"], labels)
    off = render({component: {"pdb": {"enabled": False}}})
    assert not [
        o
        for o in off
        if o["kind"] == "PodDisruptionBudget" and o["metadata"]["name"].endswith(f"-{component}")
    ]
