"""Every dashboard query is valid PromQL for a real Prometheus (the Debian `prometheus` package), and the KEDA
trigger's query reads empty, not 0, when no scheduler is scraped."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from support.chart import render
from support.dashboard_queries import concrete, dashboards, exprs
from support.prometheus_server import PrometheusServer


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrometheusServer]:
    server = PrometheusServer(Path(tmp_path_factory.mktemp("prometheus")), targets={})
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def test_every_dashboard_query_parses_in_prometheus(prometheus: PrometheusServer) -> None:
    for name, dash in dashboards().items():
        for expr in exprs(dash):
            try:
                prometheus.query(concrete(expr))
            except ValueError as e:
                pytest.fail(f"{name}: {expr}: {e}")


def test_a_broken_query_is_reported(prometheus: PrometheusServer) -> None:
    with pytest.raises(ValueError, match="bad_data"):
        prometheus.query("sum by (le (rate(x[1m]))")


@pytest.mark.parametrize("roles", [False, True], ids=["one StatefulSet", "prefill and decode"])
def test_keda_query_is_empty_when_no_scheduler_is_scraped(prometheus: PrometheusServer, roles: bool) -> None:
    """Without any scheduler series the result is an empty vector, which KEDA (ignoreNullValues "false") counts
    as a failed poll towards the fallback; a query that read 0 would scale down blind. So for every trigger of
    each disaggregation role's ScaledObject too."""
    keda = {"enabled": True, "prometheusAddress": "http://p:9090"}
    objects = render({"scheduler": {"autoscaling": keda, "roles": {"enabled": roles}}})
    triggers = [t for o in objects if o["kind"] == "ScaledObject" for t in o["spec"]["triggers"]]
    assert len(triggers) == (3 if roles else 1)
    for trigger in triggers:
        assert prometheus.query(trigger["metadata"]["query"]) == []
        assert trigger["metadata"]["ignoreNullValues"] == "false"
