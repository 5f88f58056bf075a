"""Every query of the chart's Grafana dashboard parses and runs in the real Prometheus."""

from __future__ import annotations

import re

import pytest
import requests
from tests.unit.test_grafana_dashboard import queries

from e2e.conftest import Cluster

pytestmark = pytest.mark.e2e


def as_promql(expr: str) -> str:
    """Grafana's template variables as "all"; label_values(sel, label) as its selector."""
    expr = re.sub(r"\$\w+", ".*", expr)
    values = re.fullmatch(r"label_values\((.*?)(?:,\s*\w+)?\)", expr)
    return values[1] if values else expr


@pytest.mark.parametrize(("where", "expr"), list(queries()), ids=lambda v: str(v)[:60])
def test_dashboard_query_runs_in_prometheus(cluster: Cluster, where: str, expr: str) -> None:
    answer = requests.get(
        f"{cluster.prometheus_url}/api/v1/query", params={"query": as_promql(expr)}, timeout=10
    )
    assert answer.status_code == 200, f"{where}: {answer.text[:300]}"
    assert answer.json()["status"] == "success"


def test_a_broken_query_is_refused(cluster: Cluster) -> None:
    """The check can fail: Prometheus answers 400 to a query that does not parse."""
    assert as_promql('label_values(up{job=~"$job"}, job)') == 'up{job=~".*"}'
    answer = requests.get(
        f"{cluster.prometheus_url}/api/v1/query",
        params={"query": "sum by (le (rate(x[5m]))"},
        timeout=10,
    )
    assert answer.status_code == 400
