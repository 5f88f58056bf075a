"""Analysis steps, evaluated purely from status plus fresh measurements.

Semantics follow Argo Rollouts' AnalysisRun: a metric fails once failed > failureLimit, is
inconclusive once inconclusive > inconclusiveLimit, and passes after `count` measurements.
Empty or NaN results follow the metric's noDataPolicy instead of erroring (a top complaint
about Argo and Flagger). Unlike Argo, consecutive query errors > consecutiveErrorLimit do not
fail the canary: an unreachable Prometheus says nothing about the model. The run is
inconclusive (the rollout pauses, never promotes), keeps measuring, and resumes by itself
once a query succeeds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from weightship.api.durations import parse_duration
from weightship.api.models import ModelRollout
from weightship.api.promql import render_query
from weightship.api.spec import CanaryStep, Metric
from weightship.api.status import (
    MAX_MEASUREMENT_MESSAGE,
    MAX_MEASUREMENTS,
    AnalysisPhase,
    AnalysisStatus,
    Measurement,
    MeasurementPhase,
    MetricRun,
)
from weightship.core.observed import ObservedMeasurement
from weightship.errortext import bounded

_NO_DATA: dict[str, MeasurementPhase] = {
    "Inconclusive": "Inconclusive",
    "Fail": "Failed",
    "Pass": "Successful",
}


@dataclass(frozen=True)
class AnalysisQuery:
    """A PromQL query the Prometheus adapter should run now."""

    metric: str
    address: str
    query: str


def measurement_phase(metric: Metric, value: float | None, error: str | None) -> MeasurementPhase:
    if error is not None:
        return "Error"
    if value is None or math.isnan(value):
        return _NO_DATA[metric.no_data_policy]
    if metric.min is not None and value < metric.min:
        return "Failed"
    if metric.max is not None and value > metric.max:
        return "Failed"
    return "Successful"


def unreachable(metric: Metric, run: MetricRun) -> bool:
    """Too many query errors in a row: the provider, not the canary, is in trouble."""
    return run.consecutive_error > metric.consecutive_error_limit


def metric_phase(metric: Metric, run: MetricRun) -> AnalysisPhase:
    if run.failed > metric.failure_limit:
        return "Failed"
    if unreachable(metric, run):
        return "Inconclusive"
    if run.inconclusive > metric.inconclusive_limit:
        return "Inconclusive"
    if run.count >= metric.count:
        return "Successful"
    return "Running"


def _describe(metric: Metric, run: MetricRun) -> str | None:
    if run.phase == "Inconclusive" and unreachable(metric, run):
        last_error = run.measurements[-1].message if run.measurements else None
        return (
            f"{metric.name}: {run.consecutive_error} query errors in a row "
            f"(consecutiveErrorLimit {metric.consecutive_error_limit}), last: {last_error}; "
            f"the metrics provider looks unreachable: paused, measuring every "
            f"{metric.interval}, resumes when a query succeeds"
        )
    if run.phase == "Failed":
        last = next((m for m in reversed(run.measurements) if m.phase == "Failed"), None)
        value = "no data" if last is None or last.value is None else f"{last.value:g}"
        return (
            f"{metric.name}: {run.failed} failed measurements (failureLimit "
            f"{metric.failure_limit}); last failing value {value}, bounds "
            f"[{_bound(metric.min)}, {_bound(metric.max)}]"
        )
    if run.phase == "Inconclusive":
        return (
            f"{metric.name}: {run.inconclusive} inconclusive measurements (inconclusiveLimit "
            f"{metric.inconclusive_limit}); promote or abort"
        )
    return None


def _bound(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def record_measurement(run: MetricRun, metric: Metric, observed: ObservedMeasurement) -> MetricRun:
    """The run after one more measurement."""
    phase = measurement_phase(metric, observed.value, observed.error)
    value = (
        observed.value if observed.value is not None and not math.isnan(observed.value) else None
    )
    message = observed.error if phase == "Error" else ("no data" if value is None else None)
    if message is not None:
        message = bounded(message, MAX_MEASUREMENT_MESSAGE)
    measurement = Measurement(value=value, phase=phase, at=observed.at, message=message)
    updated = run.model_copy(
        update={
            "count": run.count + (phase != "Error"),
            "successful": run.successful + (phase == "Successful"),
            "failed": run.failed + (phase == "Failed"),
            "inconclusive": run.inconclusive + (phase == "Inconclusive"),
            "error": run.error + (phase == "Error"),
            "consecutive_error": run.consecutive_error + 1 if phase == "Error" else 0,
            "measurements": [*run.measurements, measurement][-MAX_MEASUREMENTS:],
        }
    )
    updated.phase = metric_phase(metric, updated)
    updated.message = _describe(metric, updated)
    return updated


def step_metrics(rollout: ModelRollout, step: CanaryStep) -> list[Metric]:
    """Metrics an analysis step runs: those it names, or all of them."""
    analysis = rollout.spec.strategy.canary.analysis
    if step.analysis is None or analysis is None:
        return []
    names = step.analysis.metrics
    return [m for m in analysis.metrics if not names or m.name in names]


def start_analysis(
    step_index: int, canary_hash: str, metrics: Sequence[Metric], now: datetime
) -> AnalysisStatus:
    return AnalysisStatus(
        step_index=step_index,
        pod_template_hash=canary_hash,
        started_at=now,
        runs=[MetricRun(metric=m.name) for m in metrics],
    )


def combined_phase(runs: Sequence[MetricRun]) -> AnalysisPhase:
    phases = {run.phase for run in runs}
    if "Failed" in phases:
        return "Failed"
    if "Inconclusive" in phases:
        return "Inconclusive"
    if phases <= {"Successful"}:
        return "Successful"
    return "Running"


def apply_measurements(
    analysis: AnalysisStatus,
    metrics: Sequence[Metric],
    measurements: Sequence[ObservedMeasurement],
) -> AnalysisStatus:
    """Record measurements newer than each run's last one. Replaying the same observations
    changes nothing, which keeps decide idempotent."""
    by_name = {m.name: m for m in metrics}
    runs = []
    for run in analysis.runs:
        metric = by_name.get(run.metric)
        if metric is not None:
            last_at = run.measurements[-1].at if run.measurements else None
            fresh = sorted(
                (m for m in measurements if m.metric == run.metric),
                key=lambda m: m.at,
            )
            for observed in fresh:
                if not measuring(metric, run):
                    break
                if last_at is None or observed.at > last_at:
                    run = record_measurement(run, metric, observed)
        runs.append(run)
    phase = combined_phase(runs)
    messages = [run.message for run in runs if run.message and run.phase == phase]
    return analysis.model_copy(
        update={"runs": runs, "phase": phase, "message": "; ".join(messages) or None}
    )


def measuring(metric: Metric, run: MetricRun) -> bool:
    """Still taking measurements: running, or waiting out an unreachable provider."""
    return run.phase == "Running" or (run.phase == "Inconclusive" and unreachable(metric, run))


def next_measurement_at(run: MetricRun, metric: Metric, started_at: datetime) -> datetime | None:
    if not measuring(metric, run):
        return None
    if not run.measurements:
        return started_at
    return run.measurements[-1].at + parse_duration(metric.interval)


def query_variables(rollout: ModelRollout, metric: Metric) -> dict[str, str]:
    status = rollout.status
    canary, stable = status.canary_revision, status.stable_revision
    return {
        "namespace": rollout.metadata.namespace or "",
        "rollout": rollout.metadata.name,
        "canaryRevision": canary.revision if canary else "",
        "canaryHash": canary.pod_template_hash if canary else "",
        "stableRevision": stable.revision if stable else "",
        "stableHash": stable.pod_template_hash if stable else "",
        "interval": metric.interval,
    }


def due_queries(rollout: ModelRollout, now: datetime) -> list[AnalysisQuery]:
    """Queries to run before calling decide: every metric of the current analysis step whose
    next measurement is due (all of them when the step has not started yet)."""
    status, canary = rollout.status, rollout.spec.strategy.canary
    index = status.current_step_index
    if (
        canary.analysis is None
        or status.abort is not None
        or status.canary_revision is None
        or index is None
        or index >= len(canary.steps)
    ):
        return []
    metrics = step_metrics(rollout, canary.steps[index])
    analysis = status.analysis
    current = (
        analysis is not None
        and analysis.step_index == index
        and analysis.pod_template_hash == status.canary_revision.pod_template_hash
    )
    runs = {r.metric: r for r in analysis.runs} if analysis is not None and current else {}
    queries = []
    for metric in metrics:
        run = runs.get(metric.name)
        due_at = (
            next_measurement_at(run, metric, analysis.started_at)
            if run is not None and analysis is not None
            else now
        )
        if due_at is not None and due_at <= now:
            query = render_query(metric.query, query_variables(rollout, metric))
            queries.append(AnalysisQuery(metric.name, canary.analysis.prometheus.address, query))
    return queries
