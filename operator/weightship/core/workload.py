"""spec.workloadRef: an existing Deployment hands its capacity over to the rollout.

The rollout builds its ReplicaSets from the Deployment's pod template while the
Deployment keeps serving, untouched, until the rollout's own stable ReplicaSet has all
spec.replicas pods (at least one) available. Then, one reconcile after the other:

1. its spec.replicas is recorded in status.workload (status is the only memory), which
   makes kopf put the operator's finalizer on the rollout (controller/handlers.py);
2. once the record is stored and the finalizer is on, the Deployment is scaled to zero,
   and kept there while the rollout names it (a sync that scales it up again is undone).

It gets the recorded count back when the rollout no longer names it (workloadRef changed,
or replaced by spec.template) and when the rollout is deleted (`give_back`, called by the
deletion handler the finalizer waits for). An abort never scales it: before the first
revision is stable it was never scaled down, and afterwards an abort returns to the
rollout's stable ReplicaSet, which keeps its full size.
"""

from __future__ import annotations

from weightship.api.status import WorkloadStatus
from weightship.core.context import RolloutContext
from weightship.core.decision import Event, ScaleWorkload

FINALIZER_WAIT_SECONDS = 2.0
"""kopf adds the finalizer on the event of the status write; look again soon after."""


def workload_actions(ctx: RolloutContext) -> tuple[ScaleWorkload, ...]:
    """Scale-downs and give-backs of workloadRef Deployments, updating status.workload."""
    actions: list[ScaleWorkload] = []
    record = ctx.status.workload
    ref = ctx.spec.workload_ref
    if record is not None and (ref is None or ref.name != record.name):
        actions.append(give_back(record))
        ctx.events.append(
            Event(
                "Normal",
                "WorkloadReleased",
                f"Deployment {record.name} scaled back to {record.replicas} replicas: "
                "spec.workloadRef no longer names it",
            )
        )
        ctx.status.workload = record = None
    replicas = ctx.observed.workload_replicas
    if ref is None or replicas is None or ctx.invalid or ctx.observed.deleting:
        return tuple(actions)
    if not _stable_serving(ctx):
        return tuple(actions)  # the ReplicaSets are watched: their change wakes this up
    if record is None:
        if replicas == 0:
            return tuple(actions)  # nothing to take over
        ctx.status.workload = WorkloadStatus(name=ref.name, replicas=replicas)
        ctx.timers.append(FINALIZER_WAIT_SECONDS)
        return tuple(actions)
    if not ctx.observed.finalizer:
        ctx.timers.append(FINALIZER_WAIT_SECONDS)
        return tuple(actions)
    if replicas != 0:
        scaled = Event(
            "Normal",
            "WorkloadScaledDown",
            f"Deployment {ref.name} scaled from {replicas} to 0 replicas: the rollout's "
            f"stable ReplicaSet serves all {ctx.spec.replicas}; deleting the rollout "
            f"scales it back to {record.replicas}",
        )
        actions.append(ScaleWorkload(ref.name, 0, scaled))
    return tuple(actions)


def give_back(record: WorkloadStatus) -> ScaleWorkload:
    """What the Deployment a rollout scaled down gets when the rollout lets it go."""
    return ScaleWorkload(record.name, record.replicas)


def _stable_serving(ctx: RolloutContext) -> bool:
    """The rollout's own stable ReplicaSet has every replica the spec asks for available."""
    stable = ctx.status.stable_revision
    if stable is None or ctx.spec.replicas < 1:
        return False
    replica_set = ctx.observed.replica_set(stable.pod_template_hash)
    return replica_set is not None and replica_set.available >= ctx.spec.replicas
