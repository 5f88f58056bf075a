"""Which flow a reconcile takes: steady on the stable revision, or a canary (started,
superseded, aborted, retried, prefetching, stepping); and the retiring old stable."""

from __future__ import annotations

from weightship.api.status import RevisionStatus
from weightship.core import inplace
from weightship.core.abort import abort, aborted
from weightship.core.context import POLL_SECONDS, RolloutContext, ceil_seconds
from weightship.core.control import ignore_requests
from weightship.core.decision import Event
from weightship.core.prefetch import prefetched
from weightship.core.steps import step


def steady(ctx: RolloutContext, stable: RevisionStatus) -> None:
    """No canary wanted: the spec asks for the stable revision."""
    canary = ctx.status.canary_revision
    if canary is not None:
        if ctx.status.abort is None:
            message = (
                f"spec went back to stable {stable.revision}; canary {canary.revision} "
                "dropped (stable kept full size throughout)"
            )
            ctx.history(canary, "RolledBack", "RevertedToStable", message)
            ctx.events.append(Event("Normal", "RevertedToStable", message))
            ctx.notify("RolledBack", "RevertedToStable", message)
        ctx.clear_canary()
    ignore_requests(ctx, "no canary in progress")
    ctx.status.current_step_index = len(ctx.steps)
    ctx.status.canary_weight = 100
    stable_rs = ctx.observed.replica_set(stable.pod_template_hash)
    available = stable_rs.available if stable_rs is not None else 0
    if available >= ctx.spec.replicas:
        ctx.settled(f"{stable.revision} serving on {available} replicas")
    else:
        ctx.progressing(
            "ReplicaSetUpdated",
            f"stable {stable.revision}: {available}/{ctx.spec.replicas} replicas available",
        )
        ctx.timers.append(POLL_SECONDS)


def canary(ctx: RolloutContext, desired: RevisionStatus) -> None:
    current = ctx.status.canary_revision
    if current is None or current.pod_template_hash != desired.pod_template_hash:
        _start_canary(ctx, desired, current)
    if ctx.status.abort is not None:
        if ctx.retry:
            _retry(ctx)
        else:
            ignore_requests(ctx, "the canary is aborted; retry or change spec")
            aborted(ctx)
            return
    if ctx.abort_reason is not None:
        abort(ctx, "ManualAbort", ctx.abort_reason, outcome="Aborted")
        return
    failed = inplace.canary_swap_failure(ctx) if ctx.in_place is not None else None
    if failed is not None and failed.swap is not None:
        swap = failed.swap
        abort(
            ctx,
            "SwapFailed",
            f"pod {failed.name} could not swap to {swap.revision} in place "
            f"({swap.reason or 'Failed'}): {swap.message or ''}".rstrip(": "),
            details=(("pod", failed.name), ("swap failure", swap.reason or "Failed")),
        )
        return
    if prefetched(ctx):
        step(ctx)


def _start_canary(
    ctx: RolloutContext, desired: RevisionStatus, previous: RevisionStatus | None
) -> None:
    if previous is not None:
        ctx.events.append(
            Event(
                "Normal",
                "Superseded",
                f"canary {previous.revision} superseded by {desired.revision}",
            )
        )
    ctx.clear_canary()
    status = ctx.status
    mode, why = inplace.update_mode(ctx, desired)
    desired = desired.model_copy(update={"update": mode, "update_reason": why})
    status.canary_revision = desired
    status.current_step_index = 0 if status.stable_revision is not None else len(ctx.steps)
    status.canary_weight = 0
    status.step_start_time = ctx.now
    status.prefetch = None
    ctx.retry = False
    first = " (first revision: steps skipped)" if status.stable_revision is None else ""
    how = "in place" if mode == "InPlace" else "by new pods"
    ctx.events.append(
        Event(
            "Normal",
            "NewRevision",
            f"new revision {desired.revision} ({desired.manifest_digest}){first}; "
            f"update {how}: {why}",
        )
    )


def _retry(ctx: RolloutContext) -> None:
    status = ctx.status
    status.abort = None
    status.analysis = None
    status.pause_start_time = None
    status.canary_weight = 0
    status.current_step_index = 0 if status.stable_revision is not None else len(ctx.steps)
    status.step_start_time = ctx.now
    ctx.retry = False
    revision = status.canary_revision.revision if status.canary_revision else "?"
    ctx.events.append(Event("Normal", "Retry", f"retrying canary {revision} from step 1"))


def retire(ctx: RolloutContext) -> None:
    """The old stable kept after a promotion (scaleDownDelaySeconds) goes when due."""
    retiring = ctx.status.retiring
    if retiring is None:
        return
    if ctx.now >= retiring.scale_down_at:
        ctx.status.retiring = None
    else:
        ctx.timers.append(ceil_seconds(retiring.scale_down_at - ctx.now))
