"""weightship's alerts on the real Prometheus of the local cluster.

The chart's rules, rendered by helm as the plain rules file of its ConfigMap (with short
`for`s through alerts.for, 1m and 5m by default), are loaded into the local Prometheus
(rule_files, reloaded). The operator runs as a process whose /metrics Prometheus scrapes
(a file-discovered target); the agents are pods, scraped by annotation. One real rollout
of weights whose bytes changed in S3 after publishing is a staging failure on the nodes
and, once two nodes agree, an abort: WeightshipStagingFailing (per node, OriginMismatch)
and WeightshipRolloutAborted (OriginMismatch) fire, with their runbook links. The bytes
restored and the rollout retried, it becomes Healthy and both resolve.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.agent_fixtures import Agents
from e2e.operator_fixtures import OperatorProcess, Rollouts
from e2e.test_staging_failure import ORIGINALS, prefetching_rollout
from e2e.test_staging_failure import models as models  # the corrupt and good models
from weightship import rollouts as user_actions
from weightship_dev import promctl, testkit
from weightship_dev.install import helm

NAMESPACE_PREFIX = "al-"
FOR = "3s"  # the tested alerts' `for` here: long enough to be pending first, short for CI
TESTED = ("WeightshipRolloutAborted", "WeightshipStagingFailing")
RULES_NAME = "weightship-e2e"
RUNBOOK = "https://github.com/weightship/weightship/blob/main/docs/runbook.md"
CHART = Path(__file__).resolve().parents[1] / "charts" / "weightship"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def alert_rules(cluster: Any) -> Iterator[dict[str, Any]]:
    """The chart's rules ConfigMap, loaded into the local Prometheus for this module."""
    sets = ["--set", "alerts.configMap.enabled=true"]
    for name in TESTED:
        sets += ["--set", f"alerts.for.{name}={FOR}"]
    out = helm(
        cluster.paths, "template", "ws", str(CHART), "--namespace", "ws",
        "--kube-version", "1.34.0", *sets,
    )  # fmt: skip
    config_map = next(
        d
        for d in yaml.safe_load_all(out)
        if d and d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-alerts")
    )
    text = config_map["data"]["weightship-alerts.yaml"]
    path = promctl.load_rules(cluster.paths, RULES_NAME, text)
    try:
        yield {"path": path, "rules": yaml.safe_load(text)}
    finally:
        promctl.remove_rules(cluster.paths, RULES_NAME)


@pytest.fixture(scope="module")
def operator(cluster: Any, crds: None) -> Iterator[OperatorProcess]:
    """This module's operator, with /metrics on a free port that Prometheus scrapes."""
    port = free_port()
    op = OperatorProcess(
        cluster.paths.admin_kubeconfig,
        cluster.paths.root / "operator-e2e-alerts.log",
        (f"{NAMESPACE_PREFIX}*",),
        metrics_port=port,
    )
    op.start()
    target = f"127.0.0.1:{port}"
    promctl.add_target(cluster.paths, "e2e-alerts-operator", target, {"job": "operator"})
    try:
        testkit.wait_until(
            lambda: promctl.target_health(f"http://{target}/metrics") == "up",
            timeout=60,
            what="Prometheus scraping the operator",
            detail=op.tail,
        )
        yield op
    finally:
        promctl.remove_target(cluster.paths, "e2e-alerts-operator")
        op.stop()


def alerts_of(alertname: str, namespace: str) -> list[dict[str, Any]]:
    """The alerts of one rule in the test's namespace, as the rules API shows them."""
    rule = rule_named(alertname)
    return [a for a in rule.get("alerts") or [] if a["labels"].get("namespace") == namespace]


def rule_named(alertname: str) -> dict[str, Any]:
    return next(
        r
        for g in promctl.rule_groups()
        for r in g["rules"]
        if r.get("name") == alertname and g["file"].endswith(f"{RULES_NAME}.yaml")
    )


def firing(alertname: str, namespace: str, **labels: str) -> list[dict[str, Any]]:
    """ALERTS{alertstate="firing"} series of the alert in the namespace."""
    matchers = {"alertname": alertname, "alertstate": "firing", "namespace": namespace, **labels}
    selector = ",".join(f'{k}="{v}"' for k, v in matchers.items())
    return promctl.query(f"ALERTS{{{selector}}}")


def resolved_after(alertname: str, namespace: str, since: float) -> bool:
    """An evaluation of the rule after `since` left no alert in the namespace."""
    rule = rule_named(alertname)
    return promctl.evaluated_since(rule, since) and not alerts_of(alertname, namespace)


def test_a_real_staging_failure_and_abort_fire_their_alerts_and_resolve_after_the_fix(
    cluster: Any,
    alert_rules: dict[str, Any],
    agents: Agents,
    rollouts: Rollouts,
    models: dict[str, str],
) -> None:
    ns = rollouts.namespace
    # Every rule of the chart evaluates on the real series without an error.
    testkit.wait_until(
        lambda: all(
            r["health"] == "ok"
            for g in promctl.rule_groups(alert_rules["path"])
            for r in g["rules"]
        ),
        timeout=30,
        what="every rule evaluated once, without an error",
        detail=lambda: str([r.get("lastError") for g in promctl.rule_groups() for r in g["rules"]]),
    )

    rollouts.create(prefetching_rollout(cluster, models["corrupt"], "corrupt"))
    created = time.monotonic()
    status = rollouts.wait("llm", "aborted", lambda s: bool(s.get("abort")), timeout=180)["status"]
    aborted = time.monotonic()
    assert status["abort"]["reason"] == "OriginMismatch", status["abort"]

    def aborted_alert() -> list[dict[str, Any]]:
        return firing("WeightshipRolloutAborted", ns, name="llm", reason="OriginMismatch")

    testkit.wait_until(
        aborted_alert,
        timeout=60,
        what="WeightshipRolloutAborted firing",
        detail=lambda: str(promctl.query(f'weightship_rollout_aborted{{namespace="{ns}"}}')),
    )
    aborted_fired = time.monotonic()
    [alert] = alerts_of("WeightshipRolloutAborted", ns)
    assert alert["state"] == "firing" and alert["labels"]["severity"] == "warning"
    assert alert["annotations"]["runbook_url"] == f"{RUNBOOK}#weightshiprolloutaborted"
    assert f"{ns}/llm aborted its canary (OriginMismatch)" in alert["annotations"]["description"]

    # Per node: the nodes that read the corrupt chunk (two at least: they made the abort).
    def staging_alerts() -> list[dict[str, Any]] | None:
        series = firing("WeightshipStagingFailing", ns, reason="OriginMismatch")
        return series if len(series) >= 2 else None

    testkit.wait_until(
        staging_alerts,
        timeout=60,
        what="WeightshipStagingFailing firing on two nodes",
        detail=lambda: str(promctl.query(f'weightship_agent_failing_models{{namespace="{ns}"}}')),
    )
    staging_fired = time.monotonic()
    nodes = {a["labels"]["node"] for a in alerts_of("WeightshipStagingFailing", ns)}
    assert len(nodes) >= 2 and nodes <= set(cluster.process_nodes), nodes
    for a in alerts_of("WeightshipStagingFailing", ns):
        assert a["annotations"]["runbook_url"] == f"{RUNBOOK}#weightshipstagingfailing"
        assert a["labels"]["node"] in a["annotations"]["description"]
    print(
        f"\naborted {aborted - created:.1f}s after the rollout was created; "
        f"WeightshipRolloutAborted firing {aborted_fired - aborted:.1f}s after the abort, "
        f"WeightshipStagingFailing on {len(nodes)} nodes {staging_fired - aborted:.1f}s after "
        f"(for: {FOR}; scrape and evaluation every 2s)"
    )

    # The fix: the published bytes back in S3, and a retry.
    bucket, key, published = ORIGINALS[models["corrupt"]]
    testkit.s3_client(cluster.s3_endpoint).put_object(
        Bucket=bucket, Key=key, Body=published.read_bytes()
    )
    user_actions.retry(cluster.api, ns, "llm")
    rollouts.healthy_on("llm", "corrupt", timeout=120)
    healthy = time.monotonic()

    # Resolved: the series say so (no abort, no failing model on any agent), then an
    # evaluation of each rule after that leaves no alert of this namespace.
    def series_fixed() -> bool:
        still_aborted = promctl.query(f'weightship_rollout_aborted{{namespace="{ns}"}}')
        failing = promctl.query(f'weightship_agent_failing_models{{namespace="{ns}"}} > 0')
        agents_seen = promctl.query(f'weightship_agent_failing_models{{namespace="{ns}"}}')
        return not still_aborted and not failing and len(agents_seen) > 0

    testkit.wait_until(series_fixed, timeout=60, what="the abort and the failures gone")
    fixed_at = time.time()
    for name in TESTED:
        testkit.wait_until(
            lambda name=name: resolved_after(name, ns, fixed_at),
            timeout=60,
            what=f"{name} resolved",
            detail=lambda name=name: str(alerts_of(name, ns)),
        )
    print(f"both alerts resolved {time.monotonic() - healthy:.1f}s after Healthy (the retry)")
