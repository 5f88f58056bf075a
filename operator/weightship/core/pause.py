"""A pause step: for a duration, or until `weightship promote`."""

from __future__ import annotations

from weightship.api.durations import parse_duration
from weightship.api.spec import PauseStep
from weightship.core.context import RolloutContext, ceil_seconds
from weightship.core.decision import Event


def pause_step(ctx: RolloutContext, index: int, pause: PauseStep) -> None:
    status = ctx.status
    if status.pause_start_time is None:
        status.pause_start_time = ctx.now
        how = f"for {pause.duration}" if pause.duration else "until promoted"
        message = f"{ctx.step_label(index)}: paused {how}"
        ctx.events.append(Event("Normal", "Paused", message))
        ctx.notify("Paused", "PausedByStep", message)
    if pause.duration is None:
        ctx.paused("PausedByStep", f"{ctx.step_label(index)}: paused until `weightship promote`")
        return
    resume_at = status.pause_start_time + parse_duration(pause.duration)
    if ctx.now >= resume_at:
        ctx.advance(index, f"pause {pause.duration}")
        return
    ctx.paused(
        "PausedByStep",
        f"{ctx.step_label(index)}: paused for {pause.duration}, resumes at {resume_at.isoformat()}",
    )
    ctx.timers.append(ceil_seconds(resume_at - ctx.now))
