"""decide(rollout, observed, now) -> Decision: the whole rollout state machine, purely.

Modelled on Argo Rollouts' rolloutContext: every call rebuilds the picture from the spec,
the status (the controller's only memory) and fresh observations, makes at most one step
transition, and returns the new status with the actions that go with it. Calling it twice
on the same inputs gives the same Decision, and since a completed step is recorded in
status.currentStepIndex in the same patch that acts on it, no step ever runs twice.

Flow of a new revision: Prefetching → canary steps (setWeight / pause / analysis) →
promotion (canary becomes stable, old stable retires) → Healthy. Any failed gate, metric,
deadline or a manual abort leads to a capacity-safe abort → Degraded.

This module only orchestrates; each concern has its own module: desired (the spec's
revision), control (promote/abort/retry requests), canary (steady or canary flow),
prefetch (and staged node labels), steps, pause, analysis_step, abort, projection (status
from observations), scaling (ReplicaSet creates and sizes, traffic, pins), drain (pods
leave traffic before a scale-down deletes them), seeding (who
seeds a scale-up), pod_gates (each pod's weights-verified gate), workload (a workloadRef
Deployment's scale-down and give-back) and targets (the nodes that stage).
"""

from __future__ import annotations

from datetime import datetime

from weightship.api.models import ModelRollout
from weightship.api.status import ModelRolloutStatus
from weightship.core import canary, drain, inplace, prefetch, projection, scaling, workload
from weightship.core.context import RolloutContext
from weightship.core.control import acknowledge_control
from weightship.core.decision import (
    Decision,
    Event,
    ReplicaSetAction,
    RetemplateReplicaSet,
    SetGate,
    SwapPod,
)
from weightship.core.desired import desired_revision, mark_invalid, spec_template
from weightship.core.gates import DEFAULT_GATES, GateSet
from weightship.core.observed import Observed, ReplicaSetObservation
from weightship.core.pod_gates import pod_gates
from weightship.core.targets import prefetch_node_selector


def decide(
    rollout: ModelRollout, observed: Observed, now: datetime, gates: GateSet = DEFAULT_GATES
) -> Decision:
    ctx = RolloutContext(rollout, observed, now, gates)
    _reconcile(ctx)
    return _decision(ctx)


def decide_invalid_spec(
    status: ModelRolloutStatus, generation: int, message: str, now: datetime
) -> Decision:
    """For objects the models cannot parse: report InvalidSpec and change nothing else."""
    new = status.model_copy(deep=True)
    events = mark_invalid(new, generation, "ValidationFailed", message, now)
    return Decision(status=new, events=tuple(events), requeue_after=None)


def _reconcile(ctx: RolloutContext) -> None:
    ctx.status.observed_generation = ctx.generation
    acknowledge_control(ctx)
    desired = ctx.desired = desired_revision(ctx)
    if desired is None:
        return
    ctx.condition("InvalidSpec", "False", "Valid", "spec and manifest are valid")
    ctx.status.prefetch_node_selector = prefetch_node_selector(ctx.spec, spec_template(ctx)) or None
    ctx.in_place = inplace.home_replica_set(ctx)
    stable = ctx.status.stable_revision
    if stable is not None and desired.pod_template_hash == stable.pod_template_hash:
        canary.steady(ctx, stable)
    else:
        canary.canary(ctx, desired)
    canary.retire(ctx)


def _decision(ctx: RolloutContext) -> Decision:
    if not ctx.invalid:
        projection.project_observations(ctx)
    # Every condition was (re)considered against this generation.
    ctx.status.conditions = [
        c.model_copy(update={"observed_generation": ctx.generation}) for c in ctx.status.conditions
    ]
    swaps: tuple[SwapPod, ...] = ()
    retemplates: tuple[RetemplateReplicaSet, ...] = ()
    restarts: tuple[str, ...] = ()
    reverify: tuple[str, ...] = ()
    reverify_open: tuple[SetGate, ...] = ()
    home = None if ctx.invalid else inplace.home_replica_set(ctx)  # after any promotion
    replica_sets: tuple[ReplicaSetAction, ...] = ()
    not_rebuilt: tuple[str, ...] = ()
    if ctx.invalid:
        pass
    elif home is not None:
        scales, rebuilt = inplace.replica_set_actions(ctx, home)
        replica_sets, not_rebuilt, retemplates = tuple(scales), (), tuple(rebuilt)
        replica_sets += scaling.obsolete_scale_downs(ctx, home)
        started = inplace.swaps(ctx, home, scaling.canary_target(ctx))
        if started:
            message = inplace.swaps_started(ctx, home, started)
            ctx.events.append(Event("Normal", "SwapsStarted", message))
        swaps = tuple(started)
        restarts = inplace.restarts(ctx, home)
        reverify = inplace.reverifications(ctx, home)
        reverify_open = inplace.reverifications_in_traffic(ctx, home)
    else:
        replica_sets, not_rebuilt = scaling.replica_set_actions(ctx)
    # A swap that ended is recorded whatever the spec says now; one starts only above.
    swap_records = inplace.swap_records(ctx, swaps)
    if inplace.enabled(ctx):
        ctx.events.extend(inplace.held_events(ctx))
    drains = drain.Drains(replica_sets) if ctx.invalid else drain.drained(ctx, replica_sets)
    if not ctx.invalid and inplace.enabled(ctx):
        ctx.status.in_place = inplace.in_place_status(ctx, home or _template_home(ctx))
    workloads = workload.workload_actions(ctx)
    return Decision(
        status=ctx.status,
        scales=drains.scales,
        not_rebuilt=not_rebuilt,
        node_labels=prefetch.staged_node_labels(ctx.observed),
        pod_gates=(*pod_gates(ctx.spec, ctx.observed.pods, ctx.now), *reverify_open),
        events=tuple(ctx.events),
        notifications=tuple(ctx.notifications),
        traffic=scaling.traffic(ctx),
        pin_digests=scaling.pins(ctx),
        workloads=workloads,
        swaps=swaps,
        swap_records=swap_records,
        retemplates=retemplates,
        restart_pods=restarts,
        reverify_pods=reverify,
        drain_pods=drains.drain,
        undrain_pods=drains.undrain,
        requeue_after=min(ctx.timers) if ctx.timers else None,
    )


def _template_home(ctx: RolloutContext) -> ReplicaSetObservation | None:
    """The stable's in-place ReplicaSet even while a canary replaces pods (for status)."""
    stable = ctx.status.stable_revision
    home = ctx.observed.replica_set(stable.pod_template_hash) if stable else None
    return home if home is not None and home.template_hash is not None else None
