"""The Grafana dashboards shipped in the chart: well formed, and every metric they chart is one a kubesgl
service exports (the queries themselves are run against a real Prometheus in test_prometheus_scrape.py)."""

from __future__ import annotations

import re

import pytest
from support.dashboard_queries import dashboards, exported_names, exprs, metric_names, panels

REQUIRED = {
    "request rate": "kubesgl_gateway_requests_total",
    "time to first token": "sglang:time_to_first_token_seconds_bucket",
    "inter-token latency": "sglang:inter_token_latency_seconds_bucket",
    "end-to-end latency": "sglang:e2e_request_latency_seconds_bucket",
    "running requests": "sglang:num_running_reqs",
    "queued requests": "sglang:num_queue_reqs",
    "KV usage": "sglang:token_usage",
    "cache hit rate": "sglang:cache_hit_rate",
    "tokens/s": "sglang:generation_tokens_total",
    "tokenizer latency": "kubesgl_tokenizer_request_duration_seconds_bucket",
    "detokenizer latency": "kubesgl_detokenizer_request_duration_seconds_bucket",
    "NATS round trip": "kubesgl_nats_request_duration_seconds_bucket",
    # The cache-aware router's six metrics.
    "routing decisions by outcome": "kubesgl_router_decisions_total",
    "routing decision time": "kubesgl_router_decision_duration_seconds_bucket",
    "prefix overlap": "kubesgl_router_prefix_overlap_ratio_bucket",
    "index blocks per instance": "kubesgl_router_index_blocks",
    "index size": "kubesgl_router_index_size",
    "KV snapshots": "kubesgl_router_kv_snapshots_total",
    # SGLang's capacity and start-up gauges.
    "KV capacity": "sglang:max_total_num_tokens",
    "KV tokens used": "sglang:num_used_tokens",
    "preemptions (SGLang gauge)": "sglang:num_retracted_reqs",
    "preemptions (counter)": "sglang:num_retracted_requests_total",
    "engine start-up time": "sglang:engine_startup_time",
    "weight load time": "sglang:engine_load_weights_time",
    # Prefill/decode disaggregation (dashboards/roles/): each role's scaling signals and the handoffs between them.
    "pending prefill tokens": "kubesgl_scheduler_pending_prefill_tokens",
    "prompts handed off": "kubesgl_pd_handoffs_total",
    "KV transfer bytes": "kubesgl_pd_transfer_bytes_total",
    "KV transfer latency": "kubesgl_pd_transfer_duration_seconds_bucket",
    "fallbacks by reason": "kubesgl_pd_fallbacks_total",
}
ROLE_PODS = {"prefill": '".+-scheduler-prefill-[0-9]+"', "decode": '".+-scheduler-decode-[0-9]+"'}


def test_metric_name_parser_skips_functions_labels_and_keywords() -> None:
    expr = 'histogram_quantile(0.9, sum by (le, pod) (rate(a:b_bucket{x=~"y{1}"}[5m]))) / on (pod) c_total offset 5m'
    assert metric_names(expr) == {"a:b_bucket", "c_total"}


def test_dashboards_are_well_formed() -> None:
    found = dashboards()
    assert set(found) >= {"kubesgl-serving.json", "kubesgl-services.json", "kubesgl-disaggregation.json"}
    uids = [d["uid"] for d in found.values()]
    assert len(set(uids)) == len(uids)
    for name, dash in found.items():
        ids = [p["id"] for p in panels(dash)]
        assert len(set(ids)) == len(ids), f"{name}: duplicate panel ids"
        variables = {v["name"]: v for v in dash["templating"]["list"]}
        assert variables["datasource"]["query"] == "prometheus"
        for panel in panels(dash):
            if panel["type"] == "row":
                continue
            assert panel["title"] and panel.get("description"), f"{name}: panel without title/description"
            assert panel["targets"], f"{name}: {panel['title']} has no query"
            # Every query goes to the data source the user picked, so the board works in any Grafana.
            assert panel["datasource"]["uid"] == "${datasource}"
            assert all(t["datasource"]["uid"] == "${datasource}" for t in panel["targets"])


def test_every_dashboard_metric_is_exported_by_a_service() -> None:
    exported = exported_names()
    for name, dash in dashboards().items():
        for expr in exprs(dash):
            missing = metric_names(expr) - exported
            assert not missing, f"{name}: {expr} uses {missing}, which no kubesgl service exports"


@pytest.mark.parametrize("what", sorted(REQUIRED))
def test_dashboards_chart(what: str) -> None:
    used = {n for dash in dashboards().values() for e in exprs(dash) for n in metric_names(e)}
    assert REQUIRED[what] in used


def test_latency_quantiles_aggregate_buckets_by_le() -> None:
    for dash in dashboards().values():
        for expr in exprs(dash):
            if "histogram_quantile" in expr:
                assert "_bucket" in expr and "by (le" in expr, expr


def test_no_panel_groups_by_a_label_the_scrape_sets_for_kubernetes() -> None:
    """`instance`, `service` and `endpoint` are the scrape's (address, Kubernetes Service, port name): a panel
    grouping by one shows those, never a scheduler instance, a kubesgl component or an HTTP route."""
    for name, dash in dashboards().items():
        for expr in exprs(dash):
            for grouping in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
                used = {label.strip() for label in grouping.split(",")}
                assert not used & {"instance", "service", "endpoint"}, f"{name}: {expr}"


def test_role_board_panels_each_chart_one_role() -> None:
    """The prefill/decode board's queries select the pods of the role their row names (the StatefulSets
    <release>-scheduler-prefill and -decode), so a prefill instance's load never reads as a decode one's."""
    board = dashboards()["kubesgl-disaggregation.json"]
    role = None
    for panel in panels(board):
        if panel["type"] == "row":
            role = panel["title"].split()[0].lower()
            continue
        assert role in ROLE_PODS, panel["title"]
        for target in panel["targets"]:
            selectors = re.findall(r"pod=~(\"[^\"]*\")", target["expr"])
            assert selectors and set(selectors) == {ROLE_PODS[role]}, (panel["title"], target["expr"])
    assert set(dashboards()) - set(dashboards(roles=False)) == {"kubesgl-disaggregation.json"}
