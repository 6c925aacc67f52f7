"""The Grafana dashboards in the chart, read for tests: their PromQL, the metric names it uses, and the
names kubesgl's services export (from the telemetry module itself, not a list kept by hand)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from kubesgl.runtime.telemetry.metrics import (
    DetokenizerMetrics,
    DisaggregationMetrics,
    GatewayMetrics,
    SchedulerMetrics,
    TokenizerMetrics,
    new_registry,
)

DASHBOARDS = Path(__file__).resolve().parents[2] / "charts" / "kubesgl" / "dashboards"

_PROMQL_WORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "bool",
}
_PROMQL_WORDS |= {"inf", "nan"}


def dashboards(roles: bool = True) -> dict[str, dict[str, Any]]:
    """The chart's boards by file name; roles=False leaves out dashboards/roles/, which the chart loads only with
    scheduler.roles (their series come from prefill and decode instances)."""
    paths = sorted(DASHBOARDS.glob("*.json")) + (sorted(DASHBOARDS.glob("roles/*.json")) if roles else [])
    return {p.name: json.loads(p.read_text()) for p in paths}


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def exprs(dashboard: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in panels(dashboard) for t in p.get("targets", [])]


def concrete(expr: str, model: str = ".*", rate_interval: str = "1m") -> str:
    """The query Grafana would send, with the dashboard variables filled in."""
    return expr.replace("$__rate_interval", rate_interval).replace("$model", model)


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (not functions, keywords, labels or literals)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings first: they may hold braces
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\boffset\s+-?\w+", " ", text)
    text = re.sub(r"(?<![A-Za-z_:])\d+(\.\d*)?([eE][-+]?\d+)?", " ", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        rest = text[m.end() :].lstrip()
        if rest.startswith("(") or m.group().lower() in _PROMQL_WORDS:
            continue
        names.add(m.group())
    return names


def _registries() -> list[Any]:
    """One registry per kubesgl service, holding every metric that service exports."""
    registries = []
    for build in (
        # A prefill or decode instance adds its handoff metrics to the scheduler's.
        lambda r: (SchedulerMetrics(r, "m", page_size=1, num_pages=1), DisaggregationMetrics(r)),
        GatewayMetrics,
        TokenizerMetrics,
        DetokenizerMetrics,
    ):
        registry = new_registry()
        build(registry)
        registries.append(registry)
    return registries


_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
}


def exported_names() -> set[str]:
    """Every series name some kubesgl service's /metrics can serve."""
    return set(exported_labels())


def exported_labels() -> dict[str, set[str]]:
    """Every series name some kubesgl service's /metrics can serve -> the label names it carries."""
    found: dict[str, set[str]] = {}
    for registry in _registries():
        # Declared names, not samples': a labelled metric has no sample before its first child.
        declared = {
            name: set(getattr(collector, "_labelnames", ()))
            for collector, names in registry._collector_to_names.items()
            for name in names
        }
        for family in registry.collect():
            labels = {k for sample in family.samples for k in sample.labels}
            for suffix in _SUFFIXES.get(family.type, ("",)):
                name = family.name + suffix
                extra = {"le"} if suffix == "_bucket" else set()
                found[name] = labels | declared.get(name, set()) | extra
    return found
