"""The Prefetching phase: a canary's steps start once its weights are staged on enough
nodes (the prefetched gate), within the progress deadline."""

from __future__ import annotations

from weightship.api.status import PrefetchStatus
from weightship.core.abort import abort, deadline_exceeded
from weightship.core.context import RolloutContext
from weightship.core.decision import Event, NodeLabel
from weightship.core.observed import Observed
from weightship.core.staging_failure import deterministic_failure


def prefetched(ctx: RolloutContext) -> bool:
    status = ctx.status
    canary = status.canary_revision
    assert canary is not None
    if prefetch_done(ctx):
        return True
    result = ctx.gates.prefetched.evaluate(ctx.gate_input(0))
    ctx.condition("Prefetched", "True" if result.passed else "False", result.reason, result.message)
    if status.prefetch is None or status.prefetch.manifest_digest != canary.manifest_digest:
        status.prefetch = PrefetchStatus(manifest_digest=canary.manifest_digest)
    if result.passed:
        ctx.events.append(Event("Normal", "Prefetched", result.message))
        status.step_start_time = ctx.now
        return True
    if ctx.promote is not None:
        # Steps have not started: say so rather than drop the request silently.
        ctx.events.append(
            Event("Normal", "RequestIgnored", "promote ignored: the canary is still prefetching")
        )
        ctx.promote = None
    seen = ctx.observed.prefetch
    if seen is not None and seen.digest == canary.manifest_digest:
        verdict = deterministic_failure(seen, status.step_start_time)
        if verdict is not None:  # every node fails alike: the deadline would only be waited out
            ctx.condition("Prefetched", "False", verdict.reason, verdict.message)
            abort(ctx, verdict.reason, verdict.message, details=verdict.details)
            return False
    if not deadline_exceeded(ctx, "prefetch"):
        ctx.progressing("Prefetching", f"prefetching {canary.revision}: {result.message}")
        ctx.status.phase = "Prefetching"
    return False


def prefetch_done(ctx: RolloutContext) -> bool:
    prefetch, canary = ctx.status.prefetch, ctx.status.canary_revision
    condition = ctx.status.condition("Prefetched")
    return (
        prefetch is not None
        and canary is not None
        and prefetch.manifest_digest == canary.manifest_digest
        and condition is not None
        and condition.status == "True"
    )


def staged_node_labels(observed: Observed) -> tuple[NodeLabel, ...]:
    """Nodes that have staged the spec's manifest get its label (canary pods require it),
    unless they carry it already."""
    prefetch = observed.prefetch
    if prefetch is None:
        return ()
    return tuple(
        NodeLabel(node.name, prefetch.digest)
        for node in prefetch.nodes
        if node.state == "Staged" and not node.labelled
    )
