"""The chart's Grafana dashboard asks only for what the project exports.

Every PromQL query in charts/weightship/dashboards/weightship.json must name series that
the operator or the agent really exports (with the suffixes prometheus-client gives them),
group and filter only by labels those series carry (or the scrape adds), and the chart must
ship the file byte for byte. test_dashboard_queries in e2e runs each query against the real
Prometheus, so a syntax error cannot hide either.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase
from tests.unit.test_helm_chart import one, render

import weightship.controller.metrics  # noqa: F401 - registers the operator's metrics
from weightship.agent.metrics import AgentMetrics

DASHBOARD_PATH = (
    Path(__file__).resolve().parents[2] / "charts/weightship/dashboards/weightship.json"
)
DASHBOARD: dict[str, Any] = json.loads(DASHBOARD_PATH.read_text())
# Labels the scrape adds to every series (docs/helm.md; the local Prometheus relabels these).
SCRAPE_LABELS = {"namespace", "pod", "node", "instance", "job"}
PROMQL_WORDS = {
    "sum", "max", "min", "avg", "count", "by", "without", "rate", "increase", "irate",
    "histogram_quantile", "label_values", "le", "on", "ignoring", "and", "or", "unless",
}  # fmt: skip
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}


def exported() -> dict[str, set[str]]:
    """Series name -> its label names, for the operator's and the agent's metrics."""
    agent = CollectorRegistry()
    AgentMetrics.create(agent)
    series: dict[str, set[str]] = {}
    for registry in (REGISTRY, agent):
        for collector in list(registry._collector_to_names):
            if not isinstance(collector, MetricWrapperBase):
                continue
            labels = set(collector._labelnames)
            kind = collector._type
            for suffix in SUFFIXES.get(kind, ("",)):
                series[collector._name + suffix] = labels | (
                    {"le"} if suffix == "_bucket" else set()
                )
    return series


def queries() -> Iterator[tuple[str, str]]:
    for panel in DASHBOARD["panels"]:
        for target in panel["targets"]:
            yield panel["title"], target["expr"]
    for variable in DASHBOARD["templating"]["list"]:
        if variable["type"] == "query":
            yield f"variable {variable['name']}", variable["query"]["query"]


def names_in(expr: str) -> set[str]:
    without_strings = re.sub(r'"[^"]*"', '""', expr)
    without_ranges = re.sub(r"\[[^\]]*\]", "", without_strings)
    words = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", without_ranges))
    labels = labels_in(expr)
    return {w for w in words if w not in PROMQL_WORDS and w not in labels and not w.isdigit()}


def labels_in(expr: str) -> set[str]:
    grouped = {
        label.strip()
        for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr)
        for label in group.split(",")
        if label.strip()
    }
    matched = set(re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)\s*\"", expr))
    # Grafana's label_values(series, label): the last argument is a label.
    listed = set(re.findall(r"label_values\(.*,\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\)", expr))
    return grouped | matched | listed


def test_dashboard_has_the_panels_users_need() -> None:
    titles = {p["title"] for p in DASHBOARD["panels"]}
    for needed in ("Rollout phase", "Canary step", "Canary weight", "Staging throughput per node",
                   "Verification verdicts", "Reconcile latency p50 / p99"):  # fmt: skip
        assert needed in titles
    assert len({p["id"] for p in DASHBOARD["panels"]}) == len(DASHBOARD["panels"])


@pytest.mark.parametrize(("where", "expr"), list(queries()), ids=lambda v: str(v)[:60])
def test_every_query_names_exported_series_and_labels(where: str, expr: str) -> None:
    series = exported()
    names = names_in(expr)
    assert names, f"{where}: no series in {expr!r}"
    for name in names:
        assert name in series, f"{where}: {name} is not a series the project exports"
    allowed = set().union(*(series[n] for n in names)) | SCRAPE_LABELS
    for label in labels_in(expr):
        assert label in allowed, f"{where}: label {label!r} is on none of {sorted(names)}"


def test_name_check_catches_a_misspelled_metric() -> None:
    """The check above can fail: a metric the project does not export is named."""
    assert "weightship_reconcile_seconds_bucket" not in exported()
    assert names_in('sum by (le) (rate(weightship_reconcile_seconds_bucket{node=~"$n"}[5m]))') == {
        "weightship_reconcile_seconds_bucket"
    }


def test_chart_ships_the_dashboard_byte_for_byte() -> None:
    docs = render(("grafanaDashboard.enabled=true",))
    config_map = one(docs, "ConfigMap", "-dashboard")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(config_map["data"]["weightship.json"]) == DASHBOARD
    assert not [d for d in render(()) if d["metadata"]["name"].endswith("-dashboard")]
