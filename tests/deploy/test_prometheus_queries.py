"""Every dashboard query is valid PromQL for a real Prometheus (the Debian `prometheus` package)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
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
