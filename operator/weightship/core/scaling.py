"""How big each ReplicaSet should be, where traffic goes, and which manifests stay pinned:
derived from the status a reconcile has just decided."""

from __future__ import annotations

from weightship.core.context import RolloutContext
from weightship.core.decision import ReplicaSetRole, ScaleAction, TrafficWeights
from weightship.core.prefetch import prefetch_done
from weightship.core.replicas import canary_replicas, weight_at_step


def canary_target(ctx: RolloutContext) -> int:
    status = ctx.status
    canary = status.canary_revision
    if canary is None:
        return 0
    if status.abort is not None:
        scale_down_at = status.abort.canary_scale_down_at
        if scale_down_at is not None and ctx.now >= scale_down_at:
            return 0
        current = ctx.observed.replica_set(canary.pod_template_hash)
        return current.replicas if current is not None else 0
    if not prefetch_done(ctx):
        return 0
    return canary_replicas(
        ctx.spec.replicas, weight_at_step(ctx.steps, status.current_step_index or 0)
    )


def scales(ctx: RolloutContext) -> tuple[ScaleAction, ...]:
    status = ctx.status
    targets: dict[str, tuple[ReplicaSetRole, int]] = {}
    for replica_set in ctx.observed.replica_sets:
        targets[replica_set.revision_hash] = ("obsolete", 0)
    if status.retiring is not None:
        targets[status.retiring.pod_template_hash] = ("retiring", ctx.spec.replicas)
    if status.canary_revision is not None:
        targets[status.canary_revision.pod_template_hash] = ("canary", canary_target(ctx))
    if status.stable_revision is not None:
        targets[status.stable_revision.pod_template_hash] = ("stable", ctx.spec.replicas)
    actions = []
    for revision, (role, replicas) in sorted(targets.items()):
        current = ctx.observed.replica_set(revision)
        if current is None and replicas > 0:
            actions.append(ScaleAction(revision, role, replicas, create=True))
        elif current is not None and current.replicas != replicas:
            actions.append(ScaleAction(revision, role, replicas, name=current.name))
    return tuple(actions)


def traffic(ctx: RolloutContext) -> TrafficWeights | None:
    status = ctx.status
    if ctx.invalid or not ctx.spec.strategy.canary.uses_gateway_api:
        return None
    canary = status.canary_revision
    weight = status.canary_weight if canary is not None and status.abort is None else 0
    stable = status.stable_revision
    return TrafficWeights(
        stable=100 - weight,
        canary=weight,
        stable_hash=stable.pod_template_hash if stable else None,
        canary_hash=canary.pod_template_hash if canary else None,
    )


def pins(ctx: RolloutContext) -> tuple[str, ...]:
    status = ctx.status
    revisions = (status.canary_revision, status.stable_revision, status.retiring)
    digests = [r.manifest_digest for r in revisions if r is not None and r.manifest_digest]
    return tuple(dict.fromkeys(digests))
