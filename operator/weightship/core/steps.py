"""The canary steps in order (setWeight, pause, analysis), the promote request that skips
them, and the promotion that ends them."""

from __future__ import annotations

from datetime import timedelta

from weightship.api.status import RetiringRevision
from weightship.core.abort import abort, deadline_exceeded
from weightship.core.analysis_step import analysis_step
from weightship.core.context import RolloutContext
from weightship.core.decision import Event
from weightship.core.gates import GateResult
from weightship.core.pause import pause_step
from weightship.core.replicas import canary_replicas


def step(ctx: RolloutContext) -> None:
    """Run the current step, or the one a promote request lets through."""
    index = ctx.status.current_step_index or 0
    count = len(ctx.steps)
    if ctx.promote == "Full" and index < count:
        ctx.events.append(Event("Normal", "PromotedFull", "remaining steps skipped by promote"))
        ctx.status.current_step_index = index = count
        ctx.status.pause_start_time = None
        ctx.status.step_start_time = ctx.now
    elif ctx.promote is not None and index < count:
        ctx.events.append(Event("Normal", "StepPromoted", f"step {index + 1} skipped by promote"))
        ctx.advance(index)
        ctx.progressing("StepPromoted", f"step {index + 1}/{count} promoted")
        return
    ctx.promote = None
    if index >= count:
        _final(ctx)
        return
    current = ctx.steps[index]
    if current.set_weight is not None:
        _set_weight(ctx, index, current.set_weight)
    elif current.pause is not None:
        pause_step(ctx, index, current.pause)
    else:
        analysis_step(ctx, index, current)


def verify(ctx: RolloutContext, desired: int, label: str) -> GateResult | None:
    """Run the verified gate; None when it aborted or is still waiting."""
    result = ctx.gates.verified.evaluate(ctx.gate_input(desired))
    _seeded_condition(ctx, desired)
    ctx.condition("Verified", "True" if result.passed else "False", result.reason, result.message)
    if result.status == "Failed":
        abort(ctx, result.reason, result.message)
        return None
    if not result.passed:
        if not deadline_exceeded(ctx, label):
            ctx.progressing(result.reason, f"{label}: {result.message}")
        return None
    return result


def _seeded_condition(ctx: RolloutContext, desired: int) -> None:
    canary = ctx.status.canary_revision
    replica_set = ctx.observed.replica_set(canary.pod_template_hash if canary else None)
    seeded = replica_set.seeded if replica_set is not None else 0
    message = f"{seeded}/{desired} canary pods loaded their weights"
    if seeded >= desired:
        ctx.condition("Seeded", "True", "WeightsLoaded", message)
    else:
        ctx.condition("Seeded", "False", "Loading", message)


def _set_weight(ctx: RolloutContext, index: int, weight: int) -> None:
    label = f"{ctx.step_label(index)} setWeight {weight}"
    if verify(ctx, canary_replicas(ctx.spec.replicas, weight), label) is not None:
        ctx.status.canary_weight = weight
        ctx.advance(index, f"setWeight {weight}")


def _final(ctx: RolloutContext) -> None:
    label = "promoting" if ctx.status.stable_revision is not None else "first deployment"
    if verify(ctx, ctx.spec.replicas, label) is not None:
        _promote(ctx)


def _promote(ctx: RolloutContext) -> None:
    status = ctx.status
    canary, old = status.canary_revision, status.stable_revision
    assert canary is not None
    reason = "AllStepsCompleted" if old is not None else "FirstRevision"
    message = f"{canary.revision} promoted to stable" + (
        f" (was {old.revision})" if old is not None else ""
    )
    ctx.history(canary, "Promoted", reason, message)
    ctx.events.append(Event("Normal", "Promoted", message))
    ctx.notify("Promoted", reason, message)
    strategy = ctx.spec.strategy.canary
    delay = strategy.scale_down_delay_seconds if strategy.uses_gateway_api else 0
    if old is not None and delay > 0:
        status.retiring = RetiringRevision(
            **old.model_dump(), scale_down_at=ctx.now + timedelta(seconds=delay)
        )
    status.stable_revision = canary
    ctx.clear_canary()
    status.canary_weight = 100
    status.current_step_index = len(ctx.steps)
    ctx.settled(message)
    ctx.timers.append(0.0)
