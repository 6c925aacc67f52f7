"""Prefill/decode disaggregation through the whole stack: one prefill and one decode scheduler (KV through
NIXL over host memory) give the greedy completions one `both` scheduler gives (chunked prompts, a shared
prefix, n=2, JSON mode, prompt logprobs); a prefill instance killed with requests in flight loses none (the
decode instance prefills them itself after --disaggregation-timeout, generous here:
a CPU prefill instance's first prompts are slow). The chart's prefill/decode board (dashboards/roles/) charts
these two instances, scraped under the pod names the role StatefulSets give them: every query has data."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import TEST_SCHEDULER_ARGS
from kubesgl.launcher import ServiceProcess
from support.dashboard_queries import concrete, dashboards, exprs
from support.prometheus_server import PrometheusServer

pytest.importorskip("nixl_cu12", reason="NIXL (the disagg extra) is not installed")

ARGS = (
    *TEST_SCHEDULER_ARGS,
    "--page-size",
    "4",
    "--max-prefill-length",
    "24",
    "--disaggregation-timeout",
    "15",
)
SHARED = "You are a careful assistant who answers briefly about the weather in mountain towns. "
BODIES: list[dict[str, Any]] = [
    {"prompt": SHARED + "What about Zermatt in winter?", "max_tokens": 8},
    {"prompt": SHARED + "And Chamonix in spring, when the snow melts?", "max_tokens": 8, "n": 2},
    {"prompt": "Hi", "max_tokens": 6},
    {"prompt": "Count: one two three four five six seven", "max_tokens": 5, "echo": True, "logprobs": 1},
    {"prompt": "Give me a JSON object.", "max_tokens": 12, "response_format": {"type": "json_object"}},
]


def _complete(url: str, body: dict[str, Any]) -> list[Any]:
    r = httpx.post(f"{url}/v1/completions", json={"model": "demo", "temperature": 0, **body}, timeout=120)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    return [(c["text"], c["finish_reason"], (c.get("logprobs") or {}).get("tokens")) for c in choices]


def _run_all(url: str) -> list[list[Any]]:
    with concurrent.futures.ThreadPoolExecutor(len(BODIES)) as pool:
        return list(pool.map(lambda b: _complete(url, b), BODIES))


def test_prefill_and_decode_instances_match_one_colocated_instance(stack_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    # As `kubesgl up --prefill 1 --decode 1` starts them.
    stack = stack_factory(
        tmp_path / "stack", schedulers=0, prefill_schedulers=1, decode_schedulers=1, scheduler_args=ARGS
    )
    url = stack.gateway_urls[0]
    prefill, decode = [s for s in stack.services.values() if s.kind == "scheduler"]
    assert "prefill" in prefill.proc.args and "decode" in decode.proc.args
    got = _run_all(url)
    # Every request's prompt was computed by the prefill instance, its KV pulled by the decode instance.
    assert _metric(prefill.metrics_url, "kubesgl_pd_handoffs_total") >= len(BODIES)
    assert _metric(decode.metrics_url, "kubesgl_pd_transfer_bytes_total") > 0
    assert _metric(decode.metrics_url, "kubesgl_pd_transfer_duration_seconds_count") >= 1
    assert _metric(decode.metrics_url, "kubesgl_pd_fallbacks_total") == 0
    assert _empty_role_board_queries(prefill, decode, tmp_path / "prometheus") == []

    # The prefill instance dies with requests in flight: the decode instance prefills them; none is lost.
    with concurrent.futures.ThreadPoolExecutor(len(BODIES)) as pool:
        futures = [pool.submit(_complete, url, b) for b in BODIES]
        prefill.proc.kill()
        after_kill = [f.result() for f in futures]
    assert _metric(decode.metrics_url, "kubesgl_pd_fallbacks_total") > 0

    # The reference: one scheduler serving whole requests, the same flags.
    decode.proc.terminate()
    decode.proc.wait(30)
    both = stack.spawn("scheduler")
    stack.wait_ready(180, [both.name])
    want = [_complete(url, b) for b in BODIES]
    assert got == want
    assert after_kill == want


def _metric(url: str, name: str) -> float:
    """The sum of a metric's samples on one /metrics page (0 when it has none yet)."""
    text = httpx.get(url, timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith((name + " ", name + "{"))
    )


def _empty_role_board_queries(prefill: ServiceProcess, decode: ServiceProcess, workdir: Path) -> list[str]:
    """The role board's queries that return nothing when a Prometheus scrapes the two instances as the chart's
    <release>-scheduler-prefill-0 and -decode-0 pods."""
    workdir.mkdir()
    jobs = [
        {
            "job_name": f"kubesgl-scheduler-{role}",
            "static_configs": [
                {
                    "targets": [svc.metrics_url.removeprefix("http://").removesuffix("/metrics")],
                    "labels": {"namespace": "llm", "pod": f"kubesgl-scheduler-{role}-0"},
                }
            ],
        }
        for role, svc in (("prefill", prefill), ("decode", decode))
    ]
    prometheus = PrometheusServer(workdir, targets={}, scrape_configs=jobs)
    try:
        prometheus.wait_ready()
        # Three scrapes of both: rate() over the window has its two samples.
        prometheus.wait_for("min(count_over_time(up[1m])) >= 3 and min(up) == 1", bool, timeout_s=30)
        board = dashboards()["kubesgl-disaggregation.json"]
        return [e for e in exprs(board) if not prometheus.query(concrete(e, rate_interval="1m"))]
    finally:
        prometheus.stop()
