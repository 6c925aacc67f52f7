"""values.yaml documents every key, and values.schema.json covers every key and rejects bad values."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import helm_python
import pytest
import yaml

CHART = Path(__file__).resolve().parents[2] / "charts" / "kubesgl"
VALUES_TEXT = (CHART / "values.yaml").read_text()
KEY_LINE = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z_][A-Za-z0-9_.-]*):(?: |$)")
LIST_ITEM = re.compile(r"^(?P<indent> *)- ")


def documented_keys(text: str) -> tuple[list[str], list[str]]:
    """(every key path declared outside list items, the ones without a comment on the line above)."""
    keys, undocumented = [], []
    stack: list[tuple[int, str]] = []
    list_indent: int | None = None  # keys inside a list item are example data, not values
    previous = ""
    for line in text.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if list_indent is not None and indent > list_indent:
            previous = line
            continue
        list_indent = None
        if item := LIST_ITEM.match(line):
            list_indent = len(item["indent"])
        elif key := KEY_LINE.match(line):
            while stack and stack[-1][0] >= indent:
                stack.pop()
            stack.append((indent, key["key"]))
            path = ".".join(k for _, k in stack)
            keys.append(path)
            if not previous.strip().startswith("#"):
                undocumented.append(path)
        previous = line
    return keys, undocumented


def value_paths(tree: dict[str, Any], prefix: str = "") -> list[str]:
    paths = []
    for key, value in tree.items():
        paths.append(prefix + key)
        if isinstance(value, dict):
            paths += value_paths(value, f"{prefix}{key}.")
    return paths


def schema_has(schema: dict[str, Any], path: str) -> bool:
    node = schema
    for part in path.split("."):
        properties = node.get("properties", {})
        if part not in properties:
            # A free-form map (labels, resources, affinity): its keys are the user's.
            return isinstance(node.get("additionalProperties"), dict) or (
                node.get("type") == "object" and "properties" not in node
            )
        node = properties[part]
    return True


def test_every_value_commented() -> None:
    keys, undocumented = documented_keys(VALUES_TEXT)
    assert sorted(keys) == sorted(value_paths(yaml.safe_load(VALUES_TEXT))), "the line scan missed keys"
    assert undocumented == []


def test_schema_covers_every_value() -> None:
    with helm_python.Chart.load(CHART) as chart:
        schema = chart.schema
    assert schema is not None
    missing = [p for p in value_paths(yaml.safe_load(VALUES_TEXT)) if not schema_has(schema, p)]
    assert missing == []


def validate(values: dict[str, Any]) -> None:
    with helm_python.Chart.load(CHART) as chart:
        chart.validate_schema(chart.merge_values(values))


@pytest.mark.parametrize("path", sorted((CHART / "ci").glob("*-values.yaml")), ids=lambda p: p.name)
def test_ci_value_sets_pass_schema(path: Path) -> None:
    validate(yaml.safe_load(path.read_text()))


BAD_VALUES: dict[str, tuple[dict[str, Any], str]] = {
    "unknown top-level key": ({"schedulr": {"tp": 2}}, "schedulr"),
    "misspelt nested key": ({"scheduler": {"tensorParallel": 2}}, "tensorParallel"),
    "tp not a power of two": ({"scheduler": {"tp": 3}}, "tp"),
    "tp as a string": ({"scheduler": {"tp": "4"}}, "tp"),
    "negative replicas": ({"gateway": {"replicas": -1}}, "replicas"),
    "unknown device": ({"scheduler": {"device": "tpu"}}, "device"),
    "unknown cache": ({"scheduler": {"cache": "lru"}}, "cache"),
    "unknown attention backend": ({"scheduler": {"attn": "xformers"}}, "attn"),
    "shm size not a quantity": ({"scheduler": {"shmSize": "lots"}}, "shmSize"),
    "port out of range": ({"gateway": {"port": 70000}}, "port"),
    "unknown model source": ({"model": {"source": "s3"}}, "source"),
    "pvc source without a claim": ({"model": {"source": "pvc"}}, "claimName"),
    "huggingface source without a repo": ({"model": {"huggingface": {"repo": ""}}}, "repo"),
    "huggingface repo without an owner": ({"model": {"huggingface": {"repo": "Qwen3-8B"}}}, "repo"),
    "demo model on GPU": ({"model": {"source": "demo"}}, "device"),
    "tensor parallel on CPU": ({"scheduler": {"device": "cpu", "tp": 2}, "model": {"source": "demo"}}, "tp"),
    "external NATS without a URL": ({"nats": {"mode": "external"}}, "url"),
    "external NATS with an http URL": (
        {"nats": {"mode": "external", "external": {"url": "http://nats:4222"}}},
        "url",
    ),
    "external NATS auth without a Secret": (
        {"nats": {"mode": "external", "external": {"url": "nats://nats:4222"}}},
        "existingSecret",
    ),
    "TLS without a Secret": ({"nats": {"tls": {"enabled": True}}}, "existingSecret"),
    "unknown NATS auth mode": ({"nats": {"auth": {"mode": "jwt"}}}, "mode"),
    "even NATS cluster size": ({"nats": {"bundled": {"replicas": 2}}}, "replicas"),
    "KEDA without Prometheus": ({"scheduler": {"autoscaling": {"enabled": True}}}, "prometheusAddress"),
    "HPA target above 100%": (
        {"tokenizer": {"autoscaling": {"targetCPUUtilizationPercentage": 150}}},
        "targetCPUUtilizationPercentage",
    ),
    "unknown service type": ({"gateway": {"service": {"type": "ExternalName"}}}, "type"),
    "unknown sampler": ({"tracing": {"sampler": "sometimes"}}, "sampler"),
    "OTLP endpoint without scheme": ({"tracing": {"otlpEndpoint": "collector:4318"}}, "otlpEndpoint"),
    "bad pull policy": ({"image": {"cpu": {"pullPolicy": "Sometimes"}}}, "pullPolicy"),
    "bad digest": ({"image": {"cuda": {"digest": "latest"}}}, "digest"),
    "ingress path not absolute": (
        {
            "gateway": {
                "ingress": {
                    "enabled": True,
                    "hosts": [{"host": "a", "paths": [{"path": "v1", "pathType": "Prefix"}]}],
                }
            }
        },
        "path",
    ),
    "startup probe of zero": ({"scheduler": {"startupProbe": {"failureThreshold": 0}}}, "failureThreshold"),
    "unknown routing policy": ({"tokenizer": {"routing": {"policy": "random"}}}, "policy"),
    "KV block size of zero": ({"tokenizer": {"routing": {"kvBlockSize": 0}}}, "kvBlockSize"),
    "fractional KV block size": ({"tokenizer": {"routing": {"kvBlockSize": 8.5}}}, "kvBlockSize"),
    "negative overlap weight": ({"tokenizer": {"routing": {"overlapWeight": -1}}}, "overlapWeight"),
    "load weight as a string": ({"tokenizer": {"routing": {"loadWeight": "high"}}}, "loadWeight"),
    "KV staleness of zero": ({"tokenizer": {"routing": {"kvStaleAfterSeconds": 0}}}, "kvStaleAfterSeconds"),
    "session affinity as a bare bool": (
        {"tokenizer": {"routing": {"sessionAffinity": True}}},
        "sessionAffinity",
    ),
    "affinity max load of zero": (
        {"tokenizer": {"routing": {"sessionAffinity": {"enabled": True, "maxLoad": 0}}}},
        "maxLoad",
    ),
    "misspelt routing key": ({"tokenizer": {"routing": {"polcy": "least-load"}}}, "polcy"),
    "request timeout of zero": ({"gateway": {"requestTimeoutSeconds": 0}}, "requestTimeoutSeconds"),
    "negative inactivity timeout": (
        {"gateway": {"inactivityTimeoutSeconds": -5}},
        "inactivityTimeoutSeconds",
    ),
    "tokenize attempt timeout as a duration": (
        {"gateway": {"tokenizeAttemptTimeoutSeconds": "5s"}},
        "tokenizeAttemptTimeoutSeconds",
    ),
    "more GPUs per node than a node has": ({"scheduler": {"tp": 16}}, "tp"),
    "tp not a multiple of the nodes": ({"scheduler": {"nodes": 4, "tp": 2}}, "tp"),
    "more than 8 GPUs per node over nodes": ({"scheduler": {"nodes": 2, "tp": 32}}, "tp"),
    "three nodes": ({"scheduler": {"nodes": 3, "tp": 3}}, "nodes"),
    "CPU ranks per pod other than one": (
        {"scheduler": {"device": "cpu", "nodes": 2, "tp": 4}, "model": {"source": "demo"}},
        "tp",
    ),
    "rendezvous port below 1024": ({"scheduler": {"distInitPort": 80}}, "distInitPort"),
    "negative rollout partition": ({"scheduler": {"rollout": {"partition": -1}}}, "partition"),
    "scale to zero": (
        {
            "scheduler": {
                "autoscaling": {"enabled": True, "prometheusAddress": "http://p:9090", "minReplicas": 0}
            }
        },
        "minReplicas",
    ),
    "unknown KEDA fallback behaviour": (
        {"scheduler": {"autoscaling": {"fallback": {"enabled": True, "behavior": "guess"}}}},
        "behavior",
    ),
    "HPA policy of an unknown type": (
        {
            "gateway": {
                "autoscaling": {
                    "behavior": {
                        "scaleUp": {"policies": [{"type": "Nodes", "value": 1, "periodSeconds": 60}]}
                    }
                }
            }
        },
        "type",
    ),
    "HPA policy period above 30 min": (
        {
            "scheduler": {
                "autoscaling": {
                    "behavior": {
                        "scaleDown": {"policies": [{"type": "Pods", "value": 1, "periodSeconds": 3600}]}
                    }
                }
            }
        },
        "periodSeconds",
    ),
    "in-flight target of zero": (
        {"gateway": {"autoscaling": {"targetInFlightPerReplica": 0}}},
        "targetInFlightPerReplica",
    ),
    "error ratio above 1": ({"metrics": {"prometheusRule": {"thresholds": {"errorRatio": 5}}}}, "errorRatio"),
    "alert duration without a unit": ({"metrics": {"prometheusRule": {"for": {"ttft": "10"}}}}, "ttft"),
    "runbook URL with an anchor": (
        {"metrics": {"prometheusRule": {"runbookBaseUrl": "https://x/runbook.md#top"}}},
        "runbookBaseUrl",
    ),
    "unknown NATS anti-affinity": ({"nats": {"bundled": {"podAntiAffinity": "always"}}}, "podAntiAffinity"),
    "NATS PDB of zero": (
        {"nats": {"bundled": {"pdb": {"enabled": True, "maxUnavailable": 0}}}},
        "maxUnavailable",
    ),
    "disaggregation roles with tensor parallelism": (
        {"scheduler": {"tp": 2, "roles": {"enabled": True}}},
        "tp",
    ),
    "a role of no instances": ({"scheduler": {"roles": {"decode": {"replicas": 0}}}}, "replicas"),
    "a role scaled to zero": (
        {"scheduler": {"roles": {"prefill": {"autoscaling": {"minReplicas": 0}}}}},
        "minReplicas",
    ),
    "decode KV usage target above 1": (
        {"scheduler": {"roles": {"decode": {"autoscaling": {"kvUsagePerReplica": 80}}}}},
        "kvUsagePerReplica",
    ),
    "transfer port below 1024": ({"scheduler": {"roles": {"transfer": {"ports": {"from": 80}}}}}, "from"),
    "misspelt role key": ({"scheduler": {"roles": {"prefill": {"replica": 2}}}}, "replica"),
    "a role that does not exist": ({"scheduler": {"roles": {"both": {"replicas": 1}}}}, "both"),
    "UCX transports as a list": ({"scheduler": {"roles": {"transfer": {"ucxTls": ["tcp"]}}}}, "ucxTls"),
    "negative per-key limit": ({"gateway": {"maxConcurrentPerKey": -1}}, "maxConcurrentPerKey"),
    "fractional per-key limit": ({"gateway": {"maxConcurrentPerKey": 2.5}}, "maxConcurrentPerKey"),
}


@pytest.mark.parametrize("case", sorted(BAD_VALUES))
def test_bad_values_rejected_by_schema(case: str) -> None:
    values, named = BAD_VALUES[case]
    with pytest.raises(helm_python.HelmValuesError, match=re.escape(named)):
        validate(values)
    # The same values fail a real render too: Helm validates before templating.
    with helm_python.Chart.load(CHART) as chart, pytest.raises(helm_python.HelmError):
        chart.render(values, name="kubesgl", namespace="llm")


# -- the chart version and the values a release accepts ----------------------------------------------------------
RELEASED = Path(__file__).resolve().parents[1] / "data" / "chart-releases"  # <version>.values.schema.json
CHANGELOG = CHART / "CHANGELOG.md"


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def _types(node: dict[str, Any]) -> set[str]:
    kind = node.get("type")
    return set(kind) if isinstance(kind, list) else {kind} if kind else set()


def values_breaking_changes(
    old: dict[str, Any], new: dict[str, Any], path: str = ""
) -> list[tuple[str, str]]:
    """(key path, what) for each change that makes some values valid under `old` invalid under `new`: a key
    removed (the schema rejects unknown keys), a type or an enum narrowed."""
    changes = []
    for key, was in old.get("properties", {}).items():
        where = f"{path}.{key}" if path else key
        now = new.get("properties", {}).get(key)
        if now is None:
            changes.append((where, "removed"))
            continue
        if _types(was) and not _types(was) <= _types(now):
            changes.append((where, f"type {sorted(_types(was))} -> {sorted(_types(now))}"))
        if "enum" in now and set(was.get("enum", now["enum"])) - set(now["enum"]):
            changes.append((where, f"choices {sorted(set(was['enum']) - set(now['enum']))} dropped"))
        changes += values_breaking_changes(was, now, where)
    return changes


def test_breaking_change_detection() -> None:
    old = {
        "properties": {
            "a": {"type": "object", "properties": {"b": {"type": "integer"}, "c": {"enum": [1, 2]}}}
        }
    }
    assert values_breaking_changes(old, old) == []
    new = {
        "properties": {"a": {"type": "object", "properties": {"b": {"type": "string"}, "c": {"enum": [1]}}}}
    }
    assert values_breaking_changes(old, new) == [
        ("a.b", "type ['integer'] -> ['string']"),
        ("a.c", "choices [2] dropped"),
    ]
    assert values_breaking_changes(old, {"properties": {}}) == [("a", "removed")]


def test_a_values_breaking_change_bumps_the_chart_version_and_is_in_the_changelog() -> None:
    version = yaml.safe_load((CHART / "Chart.yaml").read_text())["version"]
    released = sorted(
        (p.name.removesuffix(".values.schema.json") for p in RELEASED.glob("*.json")), key=_version
    )
    last = max((v for v in released if _version(v) <= _version(version)), key=_version)
    old = json.loads((RELEASED / f"{last}.values.schema.json").read_text())
    changes = values_breaking_changes(old, json.loads((CHART / "values.schema.json").read_text()))
    sections = re.split(r"^## ", CHANGELOG.read_text(), flags=re.M)[1:]
    assert sections and sections[0].startswith(version + " "), (
        f"CHANGELOG.md's first section is not {version}"
    )
    if not changes:
        return
    assert _version(version) > _version(last), (
        f"values-breaking changes since {last} without a new version: {changes}"
    )
    major, minor = _version(version)[:2]
    last_major, last_minor = _version(last)[:2]
    assert (major > last_major) if last_major >= 1 else (major, minor) > (last_major, last_minor), (
        version,
        last,
    )
    breaking = sections[0].split("### Values-breaking", 1)
    assert len(breaking) == 2, f"CHANGELOG.md {version} has no 'Values-breaking' part for {changes}"
    listed = breaking[1].split("\n### ", 1)[0]
    missing = [c for c in changes if f"`{c[0]}`" not in listed]
    assert missing == [], f"values-breaking changes since {last} the CHANGELOG does not name: {missing}"
