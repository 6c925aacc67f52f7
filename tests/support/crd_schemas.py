"""Validators for the custom resources the chart renders, from the CRDs their projects publish (vendored in
tests/data/crds with their source commits): KEDA's ScaledObject, prometheus-operator's ServiceMonitor,
PodMonitor and PrometheusRule, and kubernetes-sigs/lws' LeaderWorkerSet.

Each CRD's openAPIV3Schema is made strict the way the API server's strict field validation is (kubectl
--validate=strict, Helm's server-side apply): an object schema that lists its properties and does not
preserve unknown fields rejects any other field, where a plain JSON Schema would let a misspelt one through.
"""

from __future__ import annotations

import copy
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import yaml

CRDS = Path(__file__).resolve().parents[1] / "data" / "crds"
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _strict(node: Any) -> Any:
    if isinstance(node, list):
        return [_strict(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _strict(v) for k, v in node.items()}
    if out.pop("x-kubernetes-int-or-string", False):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@cache
def _validators() -> dict[tuple[str, str], jsonschema.Draft7Validator]:
    found = {}
    for path in sorted(CRDS.glob("*.yaml")):
        for crd in yaml.load_all(path.read_text(), Loader=_LOADER):
            if not crd or crd.get("kind") != "CustomResourceDefinition":
                continue
            group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
            for version in crd["spec"]["versions"]:
                if not version.get("served"):
                    continue
                schema = _strict(copy.deepcopy(version["schema"]["openAPIV3Schema"]))
                # metadata is the API server's (ObjectMeta), not the CRD's to describe.
                schema["properties"]["metadata"] = {"type": "object", "required": ["name"]}
                schema.setdefault("required", [])
                schema["required"] = sorted({*schema["required"], "apiVersion", "kind", "metadata", "spec"})
                found[(f"{group}/{version['name']}", kind)] = jsonschema.Draft7Validator(schema)
    return found


def crd_kinds() -> set[tuple[str, str]]:
    return set(_validators())


def validate_custom_resource(obj: dict[str, Any]) -> None:
    """Raises jsonschema.ValidationError when `obj` breaks its CRD's schema; KeyError for a kind not vendored."""
    _validators()[(obj["apiVersion"], obj["kind"])].validate(obj)
