"""Aborting a canary: deadlines, the abort itself, and the capacity-safe scale-down after
it (stable full size and Ready before the canary goes)."""

from __future__ import annotations

from datetime import timedelta

from weightship.api.status import AbortStatus, HistoryOutcome
from weightship.core.context import POLL_SECONDS, RolloutContext, ceil_seconds
from weightship.core.decision import Event


def deadline_exceeded(ctx: RolloutContext, what: str) -> bool:
    seconds = ctx.spec.strategy.canary.progress_deadline_seconds
    deadline = (ctx.status.step_start_time or ctx.now) + timedelta(seconds=seconds)
    if ctx.now >= deadline:
        abort(
            ctx,
            "ProgressDeadlineExceeded",
            f"{what} made no progress within progressDeadlineSeconds ({seconds}s)",
        )
        return True
    ctx.timers.append(min(POLL_SECONDS, ceil_seconds(deadline - ctx.now)))
    return False


def abort(
    ctx: RolloutContext,
    reason: str,
    message: str,
    outcome: HistoryOutcome = "RolledBack",
    details: tuple[tuple[str, str], ...] = (),
) -> None:
    """``details``: extra fields for the Slack message (a staging failure's file, chunk)."""
    status = ctx.status
    canary = status.canary_revision
    assert canary is not None
    status.abort = AbortStatus(
        reason=reason,
        message=message,
        aborted_at=ctx.now,
        pod_template_hash=canary.pod_template_hash,
    )
    status.canary_weight = 0
    status.pause_start_time = None
    ctx.history(canary, outcome, reason, message)
    back_to = status.stable_revision.revision if status.stable_revision else "nothing"
    story = f"canary {canary.revision} aborted ({reason}): {message}; back to {back_to}"
    ctx.events.append(Event("Warning", reason, story))
    ctx.notify("RolledBack", reason, story, details)
    aborted(ctx)


def aborted(ctx: RolloutContext) -> None:
    """Capacity-safe: stable is full size and Ready before the canary scales down."""
    status = ctx.status
    abort = status.abort
    assert abort is not None
    stable = status.stable_revision
    stable_rs = ctx.observed.replica_set(stable.pod_template_hash) if stable else None
    stable_ready = stable is None or (
        stable_rs is not None and stable_rs.available >= ctx.spec.replicas
    )
    delay = timedelta(seconds=ctx.spec.strategy.canary.abort_scale_down_delay_seconds)
    if ctx.in_place is not None:
        # The canary's pods are the stable's capacity: they swap back at once.
        stable_ready, delay = True, timedelta(0)
    if abort.canary_scale_down_at is None and stable_ready:
        abort.canary_scale_down_at = ctx.now + delay
    if abort.canary_scale_down_at is None:
        waiting = "waiting for stable to be Ready before scaling the canary down"
        ctx.timers.append(POLL_SECONDS)
    elif ctx.now < abort.canary_scale_down_at:
        waiting = f"canary scales down at {abort.canary_scale_down_at.isoformat()}"
        ctx.timers.append(ceil_seconds(abort.canary_scale_down_at - ctx.now))
    else:
        waiting = "canary scaled down"
    message = f"aborted ({abort.reason}): {abort.message}; {waiting}"
    status.phase = "Degraded"
    status.message = message
    progressing_reason = (
        "ProgressDeadlineExceeded"
        if abort.reason == "ProgressDeadlineExceeded"
        else "RolloutAborted"
    )
    ctx.condition("Progressing", "False", progressing_reason, message)
    ctx.condition("Paused", "False", "NotPaused", "")
    ctx.condition("Aborted", "True", abort.reason, abort.message)
