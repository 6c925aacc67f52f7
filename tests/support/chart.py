"""The Helm chart rendered with the real Helm library (helm_python), as the deploy and e2e tests read it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import helm_python
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kubesgl"
# The chart's example value sets (charts/kubesgl/ci/*-values.yaml) by name, plus the defaults.
VALUE_SETS: dict[str, dict[str, Any]] = {"defaults": {}} | {
    path.name.removesuffix("-values.yaml"): yaml.safe_load(path.read_text())
    for path in sorted((CHART / "ci").glob("*-values.yaml"))
}
RELEASE, NAMESPACE = "kubesgl", "llm"


def render(values: dict[str, Any], chart: Path = CHART) -> list[dict[str, Any]]:
    """Every object the chart renders for `values` (NOTES.txt left out)."""
    with helm_python.Chart.load(chart) as loaded:
        manifests = loaded.render(values, name=RELEASE, namespace=NAMESPACE)
    objects = []
    for template, text in manifests.items():
        if not template.endswith("NOTES.txt"):
            objects += [doc for doc in yaml.safe_load_all(text) if doc]
    return objects


def merged(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Deep merge of two values trees (override wins)."""
    out = dict(base)
    for key, value in override.items():
        out[key] = (
            merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
        )
    return out
