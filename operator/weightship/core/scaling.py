"""How big each ReplicaSet should be (and how a missing one is built, and how the pods a
scale-up creates are seeded), where traffic goes, and which manifests stay pinned:
derived from the status a reconcile has just decided."""

from __future__ import annotations

from weightship.core.context import RolloutContext
from weightship.core.decision import (
    CreateReplicaSet,
    ReplicaSetAction,
    ReplicaSetRole,
    ScaleAction,
    TrafficWeights,
)
from weightship.core.desired import spec_template
from weightship.core.observed import ReplicaSetObservation
from weightship.core.prefetch import prefetch_done
from weightship.core.replicas import canary_replicas, weight_at_step
from weightship.core.seeding import scale_up_seed


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


def targets(ctx: RolloutContext) -> dict[str, tuple[ReplicaSetRole, int]]:
    """The wanted size of every ReplicaSet by revision hash; observed ones not wanted: 0."""
    status = ctx.status
    wanted: dict[str, tuple[ReplicaSetRole, int]] = {}
    for replica_set in ctx.observed.replica_sets:
        wanted[replica_set.revision_hash] = ("obsolete", 0)
    if status.retiring is not None:
        wanted[status.retiring.pod_template_hash] = ("retiring", ctx.spec.replicas)
    if status.canary_revision is not None:
        wanted[status.canary_revision.pod_template_hash] = ("canary", canary_target(ctx))
    if status.stable_revision is not None:
        wanted[status.stable_revision.pod_template_hash] = ("stable", ctx.spec.replicas)
    return wanted


def replica_set_actions(
    ctx: RolloutContext,
) -> tuple[tuple[ReplicaSetAction, ...], tuple[str, ...]]:
    """The creates and resizes that reach the targets, and the wanted revisions whose
    ReplicaSet is missing but cannot be built (not the spec's current revision)."""
    actions: list[ReplicaSetAction] = []
    not_rebuilt = []
    for revision, (role, replicas) in sorted(targets(ctx).items()):
        current = ctx.observed.replica_set(revision)
        if current is not None and not _sized_by(current):
            continue  # pods of another revision inside an in-place ReplicaSet
        if current is None and replicas > 0:
            create = _create(ctx, revision, role, replicas)
            if create is None:
                not_rebuilt.append(revision)
            else:
                actions.append(create)
        elif current is not None and current.replicas != replicas:
            seed = scale_up_seed(ctx.spec, ctx.observed.pods, current, replicas)
            actions.append(ScaleAction(revision, role, replicas, current.name, seed))
    return tuple(actions), tuple(not_rebuilt)


def _sized_by(observation: ReplicaSetObservation) -> bool:
    """Whether resizing this observation resizes its ReplicaSet: always, except for the
    pods of an in-place ReplicaSet that hold another revision than its template's."""
    return (
        observation.template_hash is None
        or observation.revision_hash == observation.template_revision_hash
    )


def obsolete_scale_downs(
    ctx: RolloutContext, home: ReplicaSetObservation
) -> tuple[ReplicaSetAction, ...]:
    """With in-place updates: every other ReplicaSet of the rollout (one of a revision that
    replaced pods before) is sized by its target as usual, which is 0 unless it retires."""
    wanted = targets(ctx)
    actions: list[ReplicaSetAction] = []
    for current in ctx.observed.replica_sets:
        if current.name == home.name or not _sized_by(current):
            continue
        role, replicas = wanted.get(current.revision_hash, ("obsolete", 0))
        if current.replicas != replicas:
            actions.append(ScaleAction(current.revision_hash, role, replicas, current.name))
    return tuple(actions)


def _create(
    ctx: RolloutContext, revision: str, role: ReplicaSetRole, replicas: int
) -> CreateReplicaSet | None:
    """Only the spec's current revision has a template: spec.template, or the observed
    workloadRef Deployment's. A canary whose weights are new to the stable waits for
    nodes that staged them."""
    desired = ctx.desired
    template = spec_template(ctx)
    if (
        desired is None
        or desired.pod_template_hash != revision
        or desired.manifest_digest is None
        or template is None
    ):
        return None
    stable = ctx.status.stable_revision
    staged_elsewhere = stable is not None and stable.manifest_digest == desired.manifest_digest
    return CreateReplicaSet(
        revision,
        role,
        replicas,
        manifest_digest=desired.manifest_digest,
        template_source="spec.template" if ctx.spec.template is not None else "workloadRef",
        require_staged=ctx.spec.prefetch.enabled and not staged_elsewhere and role == "canary",
        template=template,
        template_hash=desired.template_hash
        if ctx.spec.strategy.canary.update_policy == "InPlaceIfPossible"
        else None,
    )


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
        canary_hash=canary.pod_template_hash
        if canary
        else stable.pod_template_hash
        if stable
        else None,
    )


def pins(ctx: RolloutContext) -> tuple[str, ...]:
    status = ctx.status
    revisions = (status.canary_revision, status.stable_revision, status.retiring)
    digests = [r.manifest_digest for r in revisions if r is not None and r.manifest_digest]
    return tuple(dict.fromkeys(digests))
