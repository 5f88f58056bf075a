"""Analysis evaluation and the gates, evaluated from status and observations only."""

from __future__ import annotations

from typing import Any

import pytest

from weightship.api.base import MAX_SHORT_TEXT
from weightship.api.spec import Metric
from weightship.api.status import MAX_MEASUREMENT_MESSAGE, MAX_MEASUREMENTS, MetricRun
from weightship.core.analysis import (
    apply_measurements,
    due_queries,
    measurement_phase,
    record_measurement,
    start_analysis,
)
from weightship.core.gates import GATES, GateInput, GateSet
from weightship.core.observed import ObservedMeasurement, PodFailure
from weightship_testing.core import (
    DIGEST_B,
    at,
    healthy_rollout,
    observe,
    replica_set,
    staged,
)


def metric(**overrides: Any) -> Metric:
    fields = {"name": "err", "query": "q", "max": 0.01, "count": 3, **overrides}
    return Metric.model_validate(fields)


@pytest.mark.parametrize(
    ("overrides", "value", "error", "phase"),
    [
        ({}, 0.005, None, "Successful"),
        ({}, 0.01, None, "Successful"),
        ({}, 0.02, None, "Failed"),
        ({"min": 0.5, "max": None}, 0.4, None, "Failed"),
        ({}, None, None, "Inconclusive"),
        ({}, float("nan"), None, "Inconclusive"),
        ({"noDataPolicy": "Fail"}, None, None, "Failed"),
        ({"noDataPolicy": "Pass"}, None, None, "Successful"),
        ({}, None, "connection refused", "Error"),
    ],
)
def test_measurement_phase(
    overrides: dict[str, Any], value: float | None, error: str | None, phase: str
) -> None:
    assert measurement_phase(metric(**overrides), value, error) == phase


def run_of(m: Metric, values: list[float | str | None]) -> MetricRun:
    run = MetricRun(metric=m.name)
    for i, value in enumerate(values):
        if isinstance(value, str):
            observed = ObservedMeasurement(m.name, at(i), error=value)
        else:
            observed = ObservedMeasurement(m.name, at(i), value)
        run = record_measurement(run, m, observed)
    return run


@pytest.mark.parametrize(
    ("overrides", "values", "phase"),
    [
        ({}, [0.0, 0.0], "Running"),
        ({}, [0.0, 0.0, 0.0], "Successful"),
        ({}, [0.0, 0.5], "Failed"),
        ({"failureLimit": 1}, [0.5, 0.0, 0.0], "Successful"),
        ({"failureLimit": 1}, [0.5, 0.5], "Failed"),
        ({}, [None], "Inconclusive"),
        ({"inconclusiveLimit": 1}, [None, 0.0], "Running"),
        ({}, ["e", "e", "e", "e"], "Running"),
        # An unreachable provider pauses (inconclusive) and never fails the canary...
        ({}, ["e", "e", "e", "e", "e"], "Inconclusive"),
        # ...and the run resumes as soon as a query succeeds again.
        ({}, ["e", "e", "e", "e", "e", "e", 0.0], "Running"),
        ({}, ["e", "e", "e", "e", 0.0, "e", "e", "e", "e"], "Running"),
        ({"consecutiveErrorLimit": 0}, ["e"], "Inconclusive"),
    ],
)
def test_metric_run_limits(overrides: dict[str, Any], values: list[Any], phase: str) -> None:
    assert run_of(metric(**overrides), values).phase == phase


def test_failed_run_explains_itself_and_bounds_measurements() -> None:
    failed = run_of(metric(), [0.5])
    assert failed.message is not None
    assert "err: 1 failed measurements (failureLimit 0)" in failed.message
    long = run_of(metric(count=100), [0.0] * 30)
    assert len(long.measurements) == MAX_MEASUREMENTS
    assert long.count == 30


def test_long_query_errors_are_cut_to_what_the_crd_admits() -> None:
    unreachable = run_of(metric(consecutiveErrorLimit=1), ["refused " * 200] * 2)
    assert unreachable.phase == "Inconclusive"
    assert {len(m.message or "") for m in unreachable.measurements} == {MAX_MEASUREMENT_MESSAGE}
    assert unreachable.message is not None and len(unreachable.message) < MAX_SHORT_TEXT
    MetricRun.model_validate(unreachable.model_dump())  # within every maxLength


def test_apply_measurements_ignores_replayed_ones() -> None:
    m = metric()
    analysis = start_analysis(1, "abc", [m], at(0))
    observed = [ObservedMeasurement("err", at(1), 0.0), ObservedMeasurement("other", at(1), 9.0)]
    once = apply_measurements(analysis, [m], observed)
    twice = apply_measurements(once, [m], observed)
    assert once == twice
    assert once.runs[0].count == 1
    assert once.phase == "Running"


def test_due_queries_follow_interval() -> None:
    rollout, _ = healthy_rollout([{"analysis": {}}])
    status = rollout.status.model_copy(
        update={
            "canary_revision": rollout.status.stable_revision,
            "current_step_index": 0,
        }
    )
    rollout = rollout.model_copy(update={"status": status})
    first = due_queries(rollout, at(0))
    assert [q.metric for q in first] == ["error-rate"]
    assert 'namespace="serving"' in first[0].query
    assert first[0].address == "http://prometheus.monitoring:9090"
    assert status.canary_revision is not None
    analysis = start_analysis(0, status.canary_revision.pod_template_hash, [], at(0))
    metrics = rollout.spec.strategy.canary.analysis
    assert metrics is not None
    analysis = analysis.model_copy(update={"runs": [MetricRun(metric="error-rate")]})
    analysis = apply_measurements(
        analysis, metrics.metrics, [ObservedMeasurement("error-rate", at(0), 0.0)]
    )
    measured = rollout.model_copy(
        update={"status": status.model_copy(update={"analysis": analysis})}
    )
    assert due_queries(measured, at(59)) == []  # interval is 1m in the sample
    assert len(due_queries(measured, at(60))) == 1


def gate_input(**overrides: Any) -> GateInput:
    rollout, stable = healthy_rollout()
    canary = rollout.status.stable_revision
    assert canary is not None
    canary = canary.model_copy(update={"manifest_digest": DIGEST_B, "pod_template_hash": "c"})
    fields: dict[str, Any] = {
        "rollout": rollout,
        "observed": observe(replica_set(stable, 4), digest=DIGEST_B),
        "canary": canary,
        "desired_canary_replicas": 2,
        **overrides,
    }
    return GateInput(**fields)


@pytest.mark.parametrize(
    ("observed", "status", "reason"),
    [
        (observe(prefetch=staged(DIGEST_B, 9, 10)), "Passed", "Staged"),
        (observe(prefetch=staged(DIGEST_B, 8, 10)), "Waiting", "Staging"),
        (observe(prefetch=None), "Waiting", "Staging"),
    ],
)
def test_prefetched_gate(observed: Any, status: str, reason: str) -> None:
    result = GATES["prefetched"].evaluate(gate_input(observed=observed))
    assert (result.status, result.reason) == (status, reason)


@pytest.mark.parametrize(
    ("canary_rs", "status", "reason"),
    [
        (replica_set("c", 2), "Passed", "Verified"),
        (replica_set("c", 2, verified=1), "Waiting", "WaitingForVerifiedReplicas"),
        (replica_set("c", 2, ready=1, verified=2), "Waiting", "WaitingForVerifiedReplicas"),
        (
            replica_set("c", 2, verified=1, failed=(PodFailure("p", "ChecksumMismatch"),)),
            "Failed",
            "VerificationFailed",
        ),
    ],
)
def test_verified_gate(canary_rs: Any, status: str, reason: str) -> None:
    result = GATES["verified"].evaluate(gate_input(observed=observe(canary_rs)))
    assert (result.status, result.reason) == (status, reason)


def test_always_pass_gate_and_registry() -> None:
    gates = GateSet.from_registry("always-pass", "verified", "analysis")
    assert gates.prefetched.evaluate(gate_input(observed=observe())).passed
    assert set(GATES) >= {"prefetched", "verified", "analysis", "always-pass"}
