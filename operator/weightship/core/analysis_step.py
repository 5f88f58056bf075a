"""An analysis step: measure the step's metrics (core.analysis does the math), then pass,
abort, or pause while the result is inconclusive."""

from __future__ import annotations

from weightship.api.spec import CanaryStep, Metric
from weightship.core.abort import abort
from weightship.core.analysis import (
    apply_measurements,
    next_measurement_at,
    start_analysis,
    step_metrics,
)
from weightship.core.context import POLL_SECONDS, RolloutContext, ceil_seconds
from weightship.core.decision import Event


def analysis_step(ctx: RolloutContext, index: int, step: CanaryStep) -> None:
    status = ctx.status
    canary = status.canary_revision
    assert canary is not None
    metrics = step_metrics(ctx.rollout, step)
    analysis = status.analysis
    if (
        analysis is None
        or analysis.step_index != index
        or analysis.pod_template_hash != canary.pod_template_hash
    ):
        analysis = start_analysis(index, canary.pod_template_hash, metrics, ctx.now)
    status.analysis = apply_measurements(analysis, metrics, ctx.observed.measurements)
    result = ctx.gates.analysis.evaluate(ctx.gate_input(0))
    label = f"{ctx.step_label(index)} analysis"
    if result.passed:
        ctx.events.append(Event("Normal", "AnalysisSuccessful", f"{label}: {result.message}"))
        ctx.advance(index, "analysis")
    elif result.status == "Failed":
        abort(ctx, "AnalysisFailed", result.message)
    elif result.status == "Inconclusive":
        if status.pause_start_time is None:
            status.pause_start_time = ctx.now
            ctx.events.append(Event("Warning", "InconclusiveAnalysis", result.message))
            ctx.notify("Paused", "InconclusiveAnalysis", result.message)
        ctx.paused("InconclusiveAnalysis", f"{label} inconclusive: {result.message}")
        # An unreachable provider is still polled: the step resumes when it answers.
        _measurement_timer(ctx, metrics, fallback=None)
    else:
        if status.pause_start_time is not None:
            # Queries succeed again after an unreachable spell: carry on measuring.
            status.pause_start_time = None
            ctx.events.append(
                Event("Normal", "AnalysisResumed", f"{label}: queries succeed again; measuring")
            )
        ctx.progressing("AnalysisRunning", f"{label}: measuring")
        _measurement_timer(ctx, metrics, fallback=POLL_SECONDS)


def _measurement_timer(ctx: RolloutContext, metrics: list[Metric], fallback: float | None) -> None:
    analysis = ctx.status.analysis
    assert analysis is not None
    by_name = {m.name: m for m in metrics}
    due = [
        next_measurement_at(run, by_name[run.metric], analysis.started_at)
        for run in analysis.runs
        if run.metric in by_name
    ]
    pending = [ceil_seconds(at - ctx.now) for at in due if at is not None]
    if pending or fallback is not None:
        ctx.timers.append(min(pending, default=fallback or POLL_SECONDS))
