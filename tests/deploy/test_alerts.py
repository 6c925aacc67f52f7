"""The chart's PrometheusRule: Prometheus's own promtool accepts the rules (`check rules`) and every alert
fires and stays quiet where its unit tests say (`promtool test rules`, tests/data/alerts/<alert>.test.yaml);
every alert uses only metrics kubesgl exports and links a docs/runbook.md section that exists."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.chart import ROOT, merged, render
from support.dashboard_queries import exported_labels, exported_names, metric_names
from support.operator_scrape import TARGET_LABELS

PROMTOOL = shutil.which("promtool")
ALERT_TESTS = ROOT / "tests" / "data" / "alerts"
RUNBOOK = ROOT / "docs" / "runbook.md"

pytestmark = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not installed (Debian/Ubuntu: apt-get install prometheus)"
)


ON = {"metrics": {"prometheusRule": {"enabled": True}}}
# The chart renders these only with scheduler.roles (their series come from prefill and decode instances).
ROLES = merged(ON, {"scheduler": {"roles": {"enabled": True}}})
ROLE_ALERTS = {"KubesglPdFallbackStorm"}


def rules(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    [rule] = [o for o in render(ON if values is None else values) if o["kind"] == "PrometheusRule"]
    return rule["spec"]["groups"]


def alerts(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    return [r for g in rules(values) for r in g["rules"]]


def every_alert() -> list[dict[str, Any]]:
    """The default render's alerts and those only scheduler.roles adds."""
    return alerts() + [a for a in alerts(ROLES) if a["alert"] in ROLE_ALERTS]


def promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def write_rules(directory: Path, groups: list[dict[str, Any]]) -> Path:
    path = directory / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": groups}))
    return path


def test_promtool_checks_the_rendered_rules(tmp_path: Path) -> None:
    for groups in (
        rules(),
        rules({"metrics": {"prometheusRule": {"enabled": True, "for": {"ttft": "30m"}}}}),
        rules(ROLES),
    ):
        done = promtool("check", "rules", str(write_rules(tmp_path, groups)), cwd=tmp_path)
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"SUCCESS: {sum(len(g['rules']) for g in groups)} rules found" in done.stdout
    # promtool does reject a broken rule (the check above can fail).
    broken = [{"name": "x", "rules": [{"alert": "Broken", "expr": "sum(rate(x[5m])"}]}]
    done = promtool("check", "rules", str(write_rules(tmp_path, broken)), cwd=tmp_path)
    assert done.returncode != 0


def test_every_alert_has_a_unit_test_that_fires_and_one_that_does_not() -> None:
    names = {a["alert"] for a in every_alert()}
    assert names == {p.name.removesuffix(".test.yaml") for p in ALERT_TESTS.glob("*.test.yaml")}
    for name in names:
        spec = yaml.safe_load((ALERT_TESTS / f"{name}.test.yaml").read_text())
        cases = [c for t in spec["tests"] for c in t["alert_rule_test"] if c["alertname"] == name]
        assert any(c["exp_alerts"] for c in cases), f"{name}: no case where it fires"
        assert any(not c["exp_alerts"] for c in cases), f"{name}: no case where it stays quiet"


@pytest.mark.parametrize("test_file", sorted(p.name for p in ALERT_TESTS.glob("*.test.yaml")))
def test_promtool_unit_tests(test_file: str, tmp_path: Path) -> None:
    write_rules(tmp_path, rules(ROLES if test_file.removesuffix(".test.yaml") in ROLE_ALERTS else None))
    shutil.copy(ALERT_TESTS / test_file, tmp_path / test_file)
    done = promtool("test", "rules", test_file, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr


def test_unit_test_series_are_labelled_as_the_operator_scrape_stores_them() -> None:
    """The promtool input series carry what Prometheus stores under the chart's ServiceMonitor: the operator's
    target labels (job, instance, namespace, service, endpoint, pod, container) and the metric's own labels,
    none of them renamed (tests/e2e/test_operator_scrape.py sees the same from live services)."""
    exported = exported_labels()
    for path in sorted(ALERT_TESTS.glob("*.test.yaml")):
        for test in yaml.safe_load(path.read_text())["tests"]:
            for series in test["input_series"]:
                name, _, body = series["series"].partition("{")
                labels = set(re.findall(r'(\w+)="', body))
                own = labels - TARGET_LABELS["ServiceMonitor"]
                assert TARGET_LABELS["ServiceMonitor"] <= labels, (path.name, series["series"])
                assert own <= exported[name], (path.name, name, own - exported[name])


def test_alerts_use_only_exported_metrics() -> None:
    exported = exported_names() | {"up"}
    for alert in every_alert():
        used = metric_names(alert["expr"])
        assert used and not used - exported, f"{alert['alert']}: {used - exported} is exported by no service"


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to dashes."""
    out = set()
    for line in markdown.splitlines():
        if m := re.match(r"^#{1,6}\s+(.*)$", line):
            out.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return out


def test_every_alert_links_its_runbook_section() -> None:
    anchors = _anchors(RUNBOOK.read_text())
    for alert in every_alert():
        annotations = alert["annotations"]
        assert annotations["summary"] and annotations["description"], alert["alert"]
        base, _, anchor = annotations["runbook_url"].partition("#")
        assert base == "https://github.com/kubesgl/kubesgl/blob/main/docs/runbook.md"
        assert anchor in anchors, f"{alert['alert']}: docs/runbook.md has no section #{anchor}"
        assert alert["labels"]["severity"] in ("warning", "critical")


def test_rules_are_scoped_to_the_release() -> None:
    """Every selector names this release's namespace and pods: two releases in one Prometheus never mix."""
    for alert in every_alert():
        selectors = re.findall(r"\{([^}]*)\}", alert["expr"])
        assert selectors, alert["alert"]
        for selector in selectors:
            assert 'namespace="llm"' in selector and 'pod=~"kubesgl-' in selector, (alert["alert"], selector)


def test_roles_add_the_fallback_alert_and_point_the_scheduler_alerts_at_both_roles() -> None:
    """With scheduler.roles the instances are <release>-scheduler-prefill-N and -decode-N: the scheduler alerts
    must see them (KubesglNoLiveScheduler would fire forever otherwise), the fallback alert only decode ones."""
    assert not {a["alert"] for a in alerts()} & ROLE_ALERTS
    by_name = {a["alert"]: a["expr"] for a in alerts(ROLES)}
    assert by_name.keys() >= ROLE_ALERTS
    for name, expr in by_name.items():
        patterns = [p for p in re.findall(r'pod=~"([^"]+)"', expr) if p.startswith("kubesgl-scheduler")]
        for pattern in patterns:
            roles = {r for r in ("prefill", "decode") if re.fullmatch(pattern, f"kubesgl-scheduler-{r}-3")}
            assert roles == ({"decode"} if name in ROLE_ALERTS else {"prefill", "decode"}), (name, pattern)
            assert not re.fullmatch(pattern, "kubesgl-scheduler-0"), (name, pattern)
    assert by_name["KubesglNoLiveScheduler"].count("scheduler-(prefill|decode)") == 1
