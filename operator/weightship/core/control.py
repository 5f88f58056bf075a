"""Imperative requests (status.control): promote, abort and retry, acknowledged once."""

from __future__ import annotations

from weightship.core.context import RolloutContext
from weightship.core.decision import Event


def acknowledge_control(ctx: RolloutContext) -> None:
    control = ctx.status.control
    if control is None:
        return
    if control.promote is not None and control.promote.pending:
        ctx.promote = control.promote.mode
        control.promote.acknowledged = control.promote.requested_at
    if control.abort is not None and control.abort.pending:
        by = control.abort.requested_by
        ctx.abort_reason = control.abort.reason or (
            f"requested by {by}" if by else "requested by user"
        )
        control.abort.acknowledged = control.abort.requested_at
    if control.retry is not None and control.retry.pending:
        ctx.retry = True
        control.retry.acknowledged = control.retry.requested_at


def ignore_requests(ctx: RolloutContext, why: str) -> None:
    for name, pending in (
        ("promote", ctx.promote is not None),
        ("abort", ctx.abort_reason is not None),
        ("retry", ctx.retry),
    ):
        if pending:
            ctx.events.append(Event("Normal", "RequestIgnored", f"{name} ignored: {why}"))
    ctx.promote, ctx.abort_reason, ctx.retry = None, None, False
