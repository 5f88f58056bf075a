"""What `decide` wants done. The kopf handlers apply it; they decide nothing themselves."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from weightship.api.spec import NotificationEvent
from weightship.api.status import ModelRolloutStatus
from weightship.core.patch import merge_patch

ReplicaSetRole = Literal["stable", "canary", "retiring", "obsolete"]


@dataclass(frozen=True)
class ScaleAction:
    """Scale (or create, from spec.template / the workloadRef template) one ReplicaSet."""

    revision_hash: str
    role: ReplicaSetRole
    replicas: int
    create: bool = False
    name: str | None = None
    """Name of the observed ReplicaSet; None when it must be created."""


@dataclass(frozen=True)
class Event:
    type: Literal["Normal", "Warning"]
    reason: str
    message: str


@dataclass(frozen=True)
class Notification:
    """A Slack post; already filtered by spec.notifications.slack.events."""

    event: NotificationEvent
    reason: str
    message: str
    details: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class TrafficWeights:
    """HTTPRoute backend weights (gatewayAPI routing only)."""

    stable: int
    canary: int
    stable_hash: str | None = None
    """Revision hash the stable backend Service must select."""
    canary_hash: str | None = None
    """Revision hash the canary backend Service must select."""


@dataclass(frozen=True)
class Decision:
    status: ModelRolloutStatus
    scales: tuple[ScaleAction, ...] = ()
    events: tuple[Event, ...] = ()
    notifications: tuple[Notification, ...] = ()
    traffic: TrafficWeights | None = None
    pin_digests: tuple[str, ...] = ()
    """Manifests the node agents must keep staged and pinned (canary, stable, retiring)."""
    requeue_after: float | None = None
    """Seconds until decide should run again even if nothing changes; None: wait for events."""

    def status_patch(self, old: ModelRolloutStatus) -> dict[str, Any]:
        """JSON merge patch for the status subresource: only changed keys, nulls for removed
        ones. It never rewrites a user's pending control request, only `acknowledged`."""
        return merge_patch(old.to_k8s(), self.status.to_k8s())
