"""Replica math for a canary that surges on top of a full-size stable.

Like Argo Rollouts with dynamicStableScale=false, the stable ReplicaSet keeps all
spec.replicas while the canary grows. It costs extra GPUs during a rollout, but an abort
never waits for GPUs to come back: the stable fleet is still there and serving.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from weightship.api.spec import CanaryStep


@dataclass(frozen=True)
class ReplicaCounts:
    stable: int
    canary: int


def canary_replicas(total: int, weight: int) -> int:
    """Canary pods for a weight: ceil(total * weight / 100), so any weight > 0 gets a pod."""
    if not 0 <= weight <= 100:
        raise ValueError(f"weight {weight} is outside 0..100")
    return (total * weight + 99) // 100


def replica_counts(total: int, weight: int) -> ReplicaCounts:
    return ReplicaCounts(stable=total, canary=canary_replicas(total, weight))


def weight_at_step(steps: Sequence[CanaryStep], step_index: int) -> int:
    """The weight in force at a step: that of the last setWeight before or at it (0 if none).
    Past the last step the canary takes all of it."""
    if step_index >= len(steps):
        return 100
    for step in reversed(steps[: step_index + 1]):
        if step.set_weight is not None:
            return step.set_weight
    return 0
