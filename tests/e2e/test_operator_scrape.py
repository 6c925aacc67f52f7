"""The chart's alerts and dashboards on series as production stores them: a real Prometheus scrapes the live local
stack with the scrape jobs the Prometheus Operator generates from the chart's ServiceMonitor (and PodMonitor)
(support.operator_scrape: its relabelling adds `job`, `instance`, `namespace`, `service`, `endpoint`, `pod`,
`container`) and evaluates the chart's rendered PrometheusRule. Faults are injected into the stack: a small KV
pool under load (preemptions), a stopped detokenizer (the scheduler's batches time out and are sent again),
requests past their deadline (504), two NATS restarts (reconnects) and, last, a killed scheduler. Every alert
fires, except KubesglQueueGrowing, whose `offset 10m` cannot be met in a test of seconds (its promtool unit
test, tests/data/alerts, takes the same relabelled label sets); every dashboard query returns data (the
prefill/decode board's: tests/e2e/test_disaggregation_e2e.py, whose stack has those roles)."""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from conftest import TEST_SCHEDULER_ARGS, StackFactory
from kubesgl.launcher import Stack
from support.chart import NAMESPACE, render
from support.dashboard_queries import concrete, dashboards, exprs, panels
from support.local_stack import BackgroundLoad, metrics_targets, model_name
from support.operator_scrape import TARGET_LABELS, pods, scrape_configs
from support.prometheus_server import PrometheusServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

# A KV pool of 256 tokens (page size 1) under 3 streams of ~150 tokens each: the scheduler must preempt.
SCHEDULER_ARGS = (*TEST_SCHEDULER_ARGS, "--num-pages", "256", "--detok-timeout", "0.5")
MAX_TOKENS = 120
# Every alert at once: no `for:`, thresholds any live fault crosses.
RULE_VALUES = {
    "enabled": True,
    "thresholds": {
        "ttftP99Seconds": 0.0001,
        "queuePerInstance": 1,
        "kvCacheUsage": 0.01,
        "preemptionsPerSecond": 0.0001,
        "natsReconnectsPer10m": 1,
        "detokRetryRatio": 0.0001,
        "errorRatio": 0.0001,
        "migrationsPer10m": 1,
    },
    "for": dict.fromkeys(
        (
            "noLiveScheduler",
            "queueGrowing",
            "ttft",
            "kvCache",
            "detokRetries",
            "errorRate",
            "natsReconnects",
            "migrations",
        ),
        "0s",
    ),
}
# Fire at the last fault: the only scheduler dies under load, so no instance is left and the streams it held
# cannot move (migrations counted with outcome failed).
KILL_ALERTS = {"KubesglNoLiveScheduler", "KubesglMigrationStorm"}
LOAD_ALERTS = {"KubesglKVCacheNearlyFull", "KubesglRequestsPreempted", "KubesglTimeToFirstTokenHigh"}
DETOK_TIMEOUTS = 'sum(kubesgl_nats_request_duration_seconds_count{target="detok",outcome="timeout"})'
GATEWAY_504 = 'sum(kubesgl_gateway_requests_total{status="504"})'
NOT_LIVE = {"KubesglQueueGrowing": "compares with the queue 10 minutes ago (offset 10m)"}


def chart(monitor: str) -> list[dict[str, Any]]:
    return render({"metrics": {monitor: {"enabled": True}, "prometheusRule": RULE_VALUES}})


def rule_groups() -> list[dict[str, Any]]:
    [rule] = [o for o in chart("serviceMonitor") if o["kind"] == "PrometheusRule"]
    return rule["spec"]["groups"]


def operator_prometheus(stack: Stack, monitor: str, workdir: Any, rules: bool) -> PrometheusServer:
    objects = chart(monitor)
    live = pods(objects, metrics_targets(stack), NAMESPACE)
    server = PrometheusServer(
        workdir,
        targets={},
        scrape_configs=scrape_configs(objects, live, NAMESPACE),
        rule_groups=rule_groups() if rules else (),
    )
    server.wait_ready()
    server.wait_for("count(up == 1) == 4", lambda r: len(r) == 1, timeout_s=30)
    return server


def firing(prometheus: PrometheusServer) -> dict[str, list[dict[str, str]]]:
    out: dict[str, list[dict[str, str]]] = {}
    for series in prometheus.query('ALERTS{alertstate="firing"}'):
        out.setdefault(series["metric"]["alertname"], []).append(series["metric"])
    return out


def wait_firing(prometheus: PrometheusServer, names: set[str], timeout_s: float) -> dict[str, list]:
    deadline = time.monotonic() + timeout_s
    fired = firing(prometheus)
    while not names <= fired.keys() and time.monotonic() < deadline:
        time.sleep(0.5)
        fired = firing(prometheus)
    assert names <= fired.keys(), f"never fired: {sorted(names - fired.keys())}"
    return fired


def wait_firing_for_pods(prometheus: PrometheusServer, name: str, pods: int, timeout_s: float) -> list:
    """`name`'s firing series once it fires for `pods` pods: each pod's alert starts on its own evaluation, so
    the first time the name fires may be before the last pod's (seen on a loaded 2-core box: 3 of 4)."""
    deadline = time.monotonic() + timeout_s
    alerts = firing(prometheus).get(name, [])
    while len({a["pod"] for a in alerts}) < pods and time.monotonic() < deadline:
        time.sleep(0.5)
        alerts = firing(prometheus).get(name, [])
    return alerts


def panel_expr(title: str) -> str:
    [expr] = [
        t["expr"]
        for dash in dashboards(roles=False).values()
        for p in panels(dash)
        if p.get("title") == title
        for t in p["targets"]
    ]
    return concrete(expr)


def series_labels(prometheus: PrometheusServer) -> list[dict[str, str]]:
    return prometheus.api("series", **{"match[]": '{__name__=~"kubesgl_.+|sglang:.+"}'})


def empty_dashboard_queries(prometheus: PrometheusServer) -> list[str]:
    return [
        f"{name}: {expr}"
        for name, dash in dashboards(roles=False).items()
        for expr in exprs(dash)
        if not prometheus.query(concrete(expr, rate_interval="5m"))
    ]


@dataclass
class Observed:
    fired: dict[str, list[dict[str, str]]]  # alerts firing once every fault but the last was injected
    fired_without_scheduler: dict[str, list[dict[str, str]]]  # after the last fault: no scheduler
    empty_queries: list[str]  # dashboard queries without data
    series: dict[str, list[dict[str, str]]]  # every kubesgl series' labels, by monitor kind
    index_blocks: list[dict[str, str]]  # the "Prefix index blocks per instance" panel's series
    schedulers: list[str]  # the stack's scheduler instance ids


def inject_faults(stack: Stack, prometheus: PrometheusServer) -> dict[str, list[dict[str, str]]]:
    """Each fault twice, a scrape apart: the first makes its error series (the scrape sees it already
    counting), the second is the increase rate() sees. Returns the alerts seen firing meanwhile."""
    model = model_name(stack)
    [detok] = [s for s in stack.services.values() if s.kind == "detokenizer"]
    with BackgroundLoad(stack.gateway_urls[0], model, users=3, max_tokens=MAX_TOKENS):
        # Under load: KV in use, preemptions, TTFTs; the gauges' alerts fire only while it lasts.
        fired = wait_firing(prometheus, LOAD_ALERTS, timeout_s=60)
        for _ in range(2):
            # The detokenizer stops answering for longer than --detok-timeout: batches are sent again.
            # Stopped until a timeout is scraped (a fixed pause may fall where no batch is sent).
            seen = scalar(prometheus, DETOK_TIMEOUTS)
            detok.proc.send_signal(signal.SIGSTOP)
            try:
                prometheus.wait_for(f"{DETOK_TIMEOUTS} > {seen}", bool, timeout_s=30)
            finally:
                detok.proc.send_signal(signal.SIGCONT)
    # Requests past their deadline: 504 from the gateway.
    with httpx.Client(base_url=stack.gateway_urls[0], timeout=30) as client:
        for _ in range(2):
            seen = scalar(prometheus, GATEWAY_504)
            body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50}
            resp = client.post("/v1/chat/completions", json=body, headers={"X-Request-Timeout": "0.001"})
            assert resp.status_code == 504, resp.text
            prometheus.wait_for(f"{GATEWAY_504} > {seen}", bool, timeout_s=10)
    # Two NATS restarts: every pod reconnects twice.
    for times in (1, 2):
        stack.nats.restart()
        prometheus.wait_for(
            f"max by (pod) (kubesgl_nats_reconnects_total) >= {times}", lambda r: len(r) == 4, timeout_s=30
        )
    return fired


def scalar(prometheus: PrometheusServer, expr: str) -> float:
    """`expr`'s one value; 0 while it has none."""
    result = prometheus.query(expr)
    return float(result[0]["value"][1]) if result else 0.0


@pytest.fixture(scope="module")
def observed(stack_factory: StackFactory, tmp_path_factory: pytest.TempPathFactory) -> Observed:
    # The gateway as two workers: its /metrics must be one pod's sum for the dashboards and alerts.
    stack = stack_factory(tmp_path_factory.mktemp("stack"), scheduler_args=SCHEDULER_ARGS, gateway_workers=2)
    try:
        prometheus = operator_prometheus(stack, "serviceMonitor", tmp_path_factory.mktemp("prometheus"), True)
        try:
            # Quiet once the scheduler's series are scraped (the first evaluations may precede the first scrape).
            prometheus.wait_for('ALERTS{alertname="KubesglNoLiveScheduler"}', lambda r: not r, timeout_s=10)
            fired = inject_faults(stack, prometheus)
            live_alerts = {r["alert"] for group in rule_groups() for r in group["rules"]}
            later = live_alerts - {*NOT_LIVE, *LOAD_ALERTS, *KILL_ALERTS}
            fired |= wait_firing(prometheus, later, timeout_s=30)
            fired["KubesglNatsReconnectStorm"] = wait_firing_for_pods(
                prometheus, "KubesglNatsReconnectStorm", 4, timeout_s=30
            )
            empty = empty_dashboard_queries(prometheus)
            index_blocks = [
                r["metric"] for r in prometheus.query(panel_expr("Prefix index blocks per instance"))
            ]
            series = {"ServiceMonitor": series_labels(prometheus)}
            # The same pods under the PodMonitor's scrape jobs (a second Prometheus: one scrape path at a time).
            by_pods = operator_prometheus(
                stack, "podMonitor", tmp_path_factory.mktemp("prometheus-pods"), False
            )
            try:
                series["PodMonitor"] = series_labels(by_pods)
            finally:
                by_pods.stop()
            # Last: the only scheduler dies under load; its series go stale and KubesglNoLiveScheduler fires;
            # the streams it held find no instance to move to and KubesglMigrationStorm fires.
            [scheduler] = [s for s in stack.services.values() if s.kind == "scheduler"]
            with BackgroundLoad(stack.gateway_urls[0], model_name(stack), users=3, max_tokens=MAX_TOKENS):
                prometheus.wait_for(
                    "sum(sglang:num_running_reqs) > 0", bool, timeout_s=30
                )  # streams in flight
                scheduler.proc.kill()
                scheduler.proc.wait(10)
                without = wait_firing(prometheus, KILL_ALERTS, timeout_s=30)
            schedulers = [str(s.instance_id) for s in stack.services.values() if s.kind == "scheduler"]
            return Observed(fired, without, empty, series, index_blocks, schedulers)
        finally:
            prometheus.stop()
    finally:
        stack.stop(timeout_s=10)


def test_every_alert_fires_on_operator_relabelled_series(observed: Observed) -> None:
    assert "KubesglNoLiveScheduler" not in observed.fired
    assert observed.fired_without_scheduler.keys() >= KILL_ALERTS
    # The per-pod alerts name the pods as Kubernetes does.
    assert {a["pod"] for a in observed.fired["KubesglKVCacheNearlyFull"]} == {"kubesgl-scheduler-0"}
    assert {a["pod"] for a in observed.fired["KubesglRequestsPreempted"]} == {"kubesgl-scheduler-0"}
    assert len({a["pod"] for a in observed.fired["KubesglNatsReconnectStorm"]}) == 4


@pytest.mark.parametrize("monitor_kind", sorted(TARGET_LABELS))
def test_series_keep_the_apps_labels(observed: Observed, monitor_kind: str) -> None:
    series = observed.series[monitor_kind]
    assert series
    renamed = sorted({k for s in series for k in s if k.startswith("exported_")})
    assert not renamed, f"labels the scrape renamed (they collide with its target labels): {renamed}"
    for labels in series:
        assert TARGET_LABELS[monitor_kind] <= labels.keys(), labels
        assert labels["namespace"] == NAMESPACE and labels["pod"].startswith("kubesgl-"), labels


def test_index_blocks_panel_shows_scheduler_instances(observed: Observed) -> None:
    """Grouped by the router's scheduler instance, not by Prometheus's `instance` (the tokenizer's address)."""
    assert [set(m) for m in observed.index_blocks] == [{"scheduler_instance"}]
    assert [m["scheduler_instance"] for m in observed.index_blocks] == observed.schedulers


def test_every_dashboard_query_returns_data(observed: Observed) -> None:
    assert not observed.empty_queries, "dashboard queries without data:\n" + "\n".join(observed.empty_queries)
