"""Pods leave traffic before they go (pure).

A ReplicaSet scaled down deletes pods at once, and a pod stopped while routers still send
it requests drops them. So a scale-down runs in two steps. First the pods that will go (the
ones the ReplicaSet controller deletes first: unscheduled, then pending, then unready, then
the newest) are drained: their weights-verified gate goes False with reason Draining, so
they leave the Service's ready endpoints, and they get the lowest pod-deletion-cost, so the
ReplicaSet controller picks exactly them (a pod whose verification failed never served:
it keeps its verdict). Once they are unready and have been out of traffic
for the drain delay, the ReplicaSet is resized. The pod template's own preStop hook and
grace period still run at deletion.

The drain delay is ``scaleDownDelaySeconds`` under replicaRatio routing (Argo Rollouts'
name and default). An aborted canary leaves traffic as soon as the stable is ready again
and is deleted ``abortScaleDownDelaySeconds`` later; under gatewayAPI routing the route's
weights already moved and the old stable was kept for its delay, so those pods only wait
to be unready.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta

from weightship.core.context import RolloutContext, ceil_seconds
from weightship.core.decision import DrainPod, Event, ReplicaSetAction, ScaleAction
from weightship.core.observed import ObservedPod, ReplicaSetObservation
from weightship.core.verification import DRAINING, IN_PROGRESS_REASONS

STILL_READY_GRACE = timedelta(seconds=30)
"""A drained pod still Ready this long past its delay (its template has no readiness gate
to close) is deleted anyway: a scale-down is delayed, never stuck."""

SHOWN = 5  # pod names in a Draining event
_PHASE_RANK = {"Pending": 0, "Unknown": 1, "Running": 2}


@dataclass(frozen=True)
class Drains:
    scales: tuple[ReplicaSetAction, ...]
    """The resizes that may happen now: scale-downs whose pods have drained, the rest."""
    drain: tuple[DrainPod, ...] = ()
    undrain: tuple[str, ...] = ()


def drained(ctx: RolloutContext, actions: Sequence[ReplicaSetAction]) -> Drains:
    """Hold each scale-down until the pods it deletes have left traffic; drain those pods;
    give back the drained pods no scale-down takes any more."""
    targets = {a.name: a.replicas for a in actions if isinstance(a, ScaleAction)}
    leaving: dict[str, ObservedPod] = {}
    held: set[str] = set()
    for replica_set in ctx.observed.replica_sets:
        if replica_set.template_hash is not None:
            continue  # in-place pods swap, their ReplicaSet shrinks only with spec.replicas
        pods = _pods_of(ctx, replica_set)
        target = min(targets.get(replica_set.name, replica_set.replicas), replica_set.replicas)
        going = _aborted_canary(ctx, replica_set, pods) or _going(pods, target)
        leaving.update((p.name, p) for p in going)
        if replica_set.name in targets and target < replica_set.replicas:
            wait = _wait(ctx, replica_set, going)
            if wait is not None:
                held.add(replica_set.name)
                ctx.timers.append(wait)
    now = ctx.now
    drain = tuple(
        DrainPod(pod.name, "leaving traffic before its ReplicaSet scales down", now)
        for pod in leaving.values()
        if pod.gate_reason != DRAINING and not _failed(pod)
    )
    undrain = tuple(
        pod.name
        for pod in ctx.observed.pods
        if pod.gate_reason == DRAINING
        and not pod.deleting
        and pod.template_hash is None
        and pod.name not in leaving
    )
    scales = tuple(a for a in actions if not (isinstance(a, ScaleAction) and a.name in held))
    if drain:
        names = sorted(d.pod for d in drain)
        shown = ", ".join(names[:SHOWN]) + (
            f" and {len(names) - SHOWN} more" * (len(names) > SHOWN)
        )
        ctx.events.append(
            Event(
                "Normal", "Draining", f"leaving traffic before a scale-down deletes them: {shown}"
            )
        )
    return Drains(scales, drain, undrain)


def _pods_of(ctx: RolloutContext, replica_set: ReplicaSetObservation) -> list[ObservedPod]:
    return [
        p
        for p in ctx.observed.pods
        if p.revision_hash == replica_set.revision_hash
        and p.template_hash is None
        and not p.deleting
    ]


def _going(pods: Iterable[ObservedPod], target: int) -> list[ObservedPod]:
    """The pods a resize to ``target`` deletes, ranked as the ReplicaSet controller ranks
    them (drained ones first: they carry the lowest deletion cost)."""
    newest_first = sorted(pods, key=lambda p: p.created, reverse=True)
    ranked = sorted(
        newest_first,
        key=lambda p: (
            p.node is not None,
            _PHASE_RANK.get(p.phase or "", 3),
            p.ready,
            p.gate_reason != DRAINING,
        ),
    )
    return ranked[: max(0, len(ranked) - target)]


def _failed(pod: ObservedPod) -> bool:
    """Its gate holds a verdict against it: it never served and never will, and the
    verdict stays on it for whoever looks."""
    reason = pod.gate_reason
    return reason is not None and reason != DRAINING and reason not in IN_PROGRESS_REASONS


def _aborted_canary(
    ctx: RolloutContext, replica_set: ReplicaSetObservation, pods: list[ObservedPod]
) -> list[ObservedPod]:
    """Under replicaRatio, an aborted canary's pods all leave traffic once the stable is
    ready again (abort.canary_scale_down_at set): they go when that time comes."""
    abort, canary = ctx.status.abort, ctx.status.canary_revision
    if (
        abort is None
        or abort.canary_scale_down_at is None
        or canary is None
        or canary.pod_template_hash != replica_set.revision_hash
        or ctx.spec.strategy.canary.uses_gateway_api
    ):
        return []
    return pods


def _delay(ctx: RolloutContext, replica_set: ReplicaSetObservation) -> timedelta:
    canary, status = ctx.spec.strategy.canary, ctx.status
    aborted_canary = (
        status.abort is not None
        and status.canary_revision is not None
        and status.canary_revision.pod_template_hash == replica_set.revision_hash
    )
    if canary.uses_gateway_api or aborted_canary:
        return timedelta(0)
    return timedelta(seconds=canary.scale_down_delay_seconds)


def _wait(
    ctx: RolloutContext, replica_set: ReplicaSetObservation, going: Sequence[ObservedPod]
) -> float | None:
    """Seconds until the pods a scale-down deletes have drained; None once they have."""
    delay = _delay(ctx, replica_set)
    waits = []
    for pod in going:
        if _failed(pod):
            continue
        since = pod.gate_since if pod.gate_reason == DRAINING else None
        if since is None:
            waits.append(1.0)  # drained by this decision: look again once that is seen
            continue
        due = since + delay + (STILL_READY_GRACE if pod.ready else timedelta(0))
        if ctx.now < due:
            waits.append(ceil_seconds(due - ctx.now))
    return max(waits) if waits else None
