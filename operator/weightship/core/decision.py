"""What `decide` wants done, fully resolved: controller/apply.py carries the actions out
(rendering Kubernetes bodies with controller/builders.py) and decides nothing itself."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from weightship.api.spec import NotificationEvent
from weightship.api.status import ModelRolloutStatus
from weightship.core.observed import PodSwap, SwapPurpose
from weightship.core.patch import merge_patch

ReplicaSetRole = Literal["stable", "canary", "retiring", "obsolete"]


@dataclass(frozen=True)
class EnvVar:
    name: str
    value: str


@dataclass(frozen=True)
class SeedEnv:
    """Env of the pods a scale-up creates: where they receive their weights by broadcast
    (core.seeding); empty values make them load from the node cache."""

    containers: tuple[str, ...]
    env: tuple[EnvVar, ...]


@dataclass(frozen=True)
class ScaleAction:
    """Set the size of one observed ReplicaSet (in the same write, `seed` on a scale-up)."""

    revision_hash: str
    role: ReplicaSetRole
    replicas: int
    name: str
    """Name of the observed ReplicaSet."""
    seed: SeedEnv | None = None


@dataclass(frozen=True)
class CreateReplicaSet:
    """Create the ReplicaSet of the spec's current revision (the only one with a template)."""

    revision_hash: str
    role: ReplicaSetRole
    replicas: int
    manifest_digest: str
    template_source: Literal["spec.template", "workloadRef"]
    require_staged: bool
    """Its pods require nodes labelled as holding the staged weights (NodeLabel)."""
    template_hash: str | None = None
    """Set for updatePolicy InPlaceIfPossible: the ReplicaSet selects its pods by this
    template hash, not by revision, so they can swap weights without leaving it."""
    template: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)


ReplicaSetAction = ScaleAction | CreateReplicaSet


@dataclass(frozen=True)
class SwapPod:
    """Swap a running pod's weights in place to another revision: apply takes it out of
    traffic and records the swap (``RecordSwap``), then the swapper drives the pod's
    inference server (drain, verified load) and reports how it ended."""

    pod: str
    to_revision_hash: str
    manifest_digest: str
    revision: str
    purpose: SwapPurpose
    from_revision_hash: str | None = None
    """The revision the pod holds now (its revision-hash label)."""
    restarts: int = 0
    """The pod's container restarts as the swap starts."""
    started_at: datetime | None = None
    in_traffic: bool = False
    """The pod stays in traffic (gate open) and its server holds requests (core.inplace)."""

    def record(self) -> PodSwap:
        """The pod's swap record while it runs."""
        return PodSwap(
            to_revision_hash=self.to_revision_hash,
            manifest_digest=self.manifest_digest,
            revision=self.revision,
            state="Swapping",
            from_revision_hash=self.from_revision_hash,
            started_at=self.started_at,
            restarts=self.restarts,
            purpose=self.purpose,
            in_traffic=self.in_traffic,
        )


@dataclass(frozen=True)
class RetemplateReplicaSet:
    """Point an in-place ReplicaSet's pod template at the stable revision, so a pod it
    creates from now on (a replacement) starts on the stable weights."""

    name: str
    revision_hash: str
    manifest_digest: str
    template_hash: str
    template: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)


@dataclass(frozen=True)
class ScaleWorkload:
    """Set spec.replicas of the spec.workloadRef Deployment (its scale subresource).
    ``event``: posted once the scale is done, not after the status write as decided
    events are: a scale-down is not decided again after a failed status write (the
    Deployment is at zero by then), so its event would be lost with it."""

    name: str
    replicas: int
    event: Event | None = None


@dataclass(frozen=True)
class SetGate:
    """Set a pod's weights-verified readiness gate: the verifier's verdict, or True when
    there is nothing to verify (core.pod_gates). The annotations go in the same write."""

    pod: str
    status: Literal["True", "False"]
    reason: str
    message: str
    at: datetime
    annotations: tuple[tuple[str, str | None], ...] = ()


@dataclass(frozen=True)
class RecordSwap:
    """Write a pod's in-place swap record with its weights-verified gate, in one write:
    Swapping as the swap starts (the gate closed: the pod leaves traffic), then how it
    ended, as the swapper reported it. Once Swapped, the pod moves to the new revision
    (its revision-hash label, digest and revision annotations; its verification notes
    cleared), the gate Pending for the verifier."""

    pod: str
    swap: PodSwap
    gate: SetGate


@dataclass(frozen=True)
class DrainPod:
    """Take a pod that is about to be deleted out of traffic: its weights-verified gate
    goes False (reason Draining), so it leaves the Service's ready endpoints, and it gets
    the lowest pod-deletion-cost, so its ReplicaSet deletes it before any other."""

    pod: str
    message: str
    at: datetime


@dataclass(frozen=True)
class NodeLabel:
    """Mark a node as holding a manifest's staged weights: canary pods require it."""

    node: str
    manifest_digest: str


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
    """Revision hash the canary backend Service must select (the stable's when there is no
    canary, so it never selects pods of a dropped revision)."""


@dataclass(frozen=True)
class Decision:
    status: ModelRolloutStatus
    scales: tuple[ReplicaSetAction, ...] = ()
    """ReplicaSets to create or resize, in revision-hash order."""
    not_rebuilt: tuple[str, ...] = ()
    """Revisions whose ReplicaSet is gone but wanted: only the spec's current revision can
    be built again, from its template (apply logs these)."""
    node_labels: tuple[NodeLabel, ...] = ()
    pod_gates: tuple[SetGate, ...] = ()
    """Weights-verified gates to set (apply is the only writer of the condition)."""
    events: tuple[Event, ...] = ()
    notifications: tuple[Notification, ...] = ()
    traffic: TrafficWeights | None = None
    pin_digests: tuple[str, ...] = ()
    """Manifests the node agents must keep staged and pinned (canary, stable, retiring)."""
    workloads: tuple[ScaleWorkload, ...] = ()
    """Deployments named by spec.workloadRef to scale down, or given back (core.workload)."""
    swaps: tuple[SwapPod, ...] = ()
    """In-place weight swaps to start (core.inplace), within inPlace.maxUnavailable.
    Apply records each (``swap_records``) before the swapper starts it."""
    swap_records: tuple[RecordSwap, ...] = ()
    """Swap records to write with their gates: the swaps starting, and those the swapper
    reported ended (core.inplace)."""
    retemplates: tuple[RetemplateReplicaSet, ...] = ()
    reverify_pods: tuple[str, ...] = ()
    """Pods whose swap was refused before any weight changed: they hold what they held,
    so their gate goes back to Pending for the verifier to check them again."""
    restart_pods: tuple[str, ...] = ()
    """Pods to delete (their ReplicaSet replaces them): an in-place swap back to stable
    failed, so only a fresh start gets them to verified weights."""
    drain_pods: tuple[DrainPod, ...] = ()
    """Pods to take out of traffic before a scale-down deletes them (core.drain)."""
    undrain_pods: tuple[str, ...] = ()
    """Drained pods no scale-down takes any more: their gate goes back to Pending for the
    verifier to open again."""
    requeue_after: float | None = None
    """Seconds until decide should run again even if nothing changes; None: wait for events."""

    def status_patch(self, old: ModelRolloutStatus) -> dict[str, Any]:
        """JSON merge patch for the status subresource: only changed keys, nulls for removed
        ones. It never rewrites a user's pending control request, only `acknowledged`."""
        return merge_patch(old.to_k8s(), self.status.to_k8s())
