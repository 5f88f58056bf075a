"""What the adapters observed, handed to `decide`. Plain frozen data, no clients."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from weightship.api.weightcache import StagingFailure


@dataclass(frozen=True)
class PodFailure:
    """A canary pod whose weights-verified gate failed (checksum or golden prompt)."""

    pod: str
    reason: str
    message: str = ""
    prompt: str | None = None
    expected: str | None = None
    got: str | None = None


@dataclass(frozen=True)
class PodLoad:
    """How a pod got its weights, as its verifier recorded it."""

    pod: str
    source: Literal["cache", "origin", "broadcast", "swap"] | None = None
    seeded_from: str | None = None
    seconds: float | None = None
    mode: Literal["loaded", "staged", "none"] | None = None  # how the verifier checked it


SwapPhase = Literal["Swapping", "Swapped", "Failed"]
SwapPurpose = Literal["canary", "promote", "rollback", "repair"]
SWAP_PURPOSES = ("canary", "promote", "rollback", "repair")


@dataclass(frozen=True)
class PodSwap:
    """A pod's last in-place swap, as its record on the pod says (written by apply: the
    core starts a swap, the swapper reports how it ended)."""

    to_revision_hash: str
    manifest_digest: str
    revision: str
    state: SwapPhase
    from_revision_hash: str | None = None
    started_at: datetime | None = None
    seconds: float | None = None
    paused_seconds: float | None = None
    reason: str | None = None
    message: str | None = None
    restarts: int | None = None
    """The pod's container restarts when the swap began: a restart since then loaded the
    weights the pod was created with, not the swapped ones."""
    purpose: SwapPurpose | None = None
    finished_at: datetime | None = None
    in_traffic: bool = False
    """The pod stayed in traffic (its gate open) and its server held requests through the
    swap and the checks after it (core.inplace: the last serving pod, or maxUnavailable 0)."""

    def same_swap(self, other: PodSwap) -> bool:
        """The same swap (its target and start; the record keeps whole seconds), whatever
        state each says it is in."""
        return (
            self.to_revision_hash == other.to_revision_hash
            and self.manifest_digest == other.manifest_digest
            and _second(self.started_at) == _second(other.started_at)
        )


def _second(at: datetime | None) -> int | None:
    return None if at is None else int(at.timestamp())


@dataclass(frozen=True)
class ReplicaSetObservation:
    """One ReplicaSet owned by the rollout, found by its revision-hash label."""

    name: str
    revision_hash: str
    replicas: int
    ready: int = 0
    available: int = 0
    seeded: int = 0
    """Pods whose weights are loaded (from broadcast or the node cache)."""
    verified: int = 0
    """Pods whose readiness gate weightship.io/weights-verified is True."""
    failed: tuple[PodFailure, ...] = ()
    loads: tuple[PodLoad, ...] = ()
    containers: tuple[str, ...] = ()
    """Container names of its pods (where a scale-up's seed env goes); () without pods."""
    template_hash: str | None = None
    """Set for an in-place ReplicaSet (selected by template hash, not revision): its pods
    may hold different revisions, and this observation counts only those of
    ``revision_hash``; ``replicas`` is then that count (the rest of the ReplicaSet's size
    goes to the revision its template names)."""
    template_revision_hash: str | None = None
    """The revision the in-place ReplicaSet's template names (what a new pod starts on)."""


@dataclass(frozen=True)
class NodeStaging:
    name: str
    state: Literal["Pending", "Staging", "Staged", "Failed"]
    bytes_done: int = 0
    bytes_total: int = 0
    message: str | None = None
    labelled: bool = False
    """The node already carries the staged label of this manifest."""
    failure: StagingFailure | None = None
    """Why its last attempt failed (its WeightCache's); kept while a retry is Staging."""
    started_at: datetime | None = None
    """When its last attempt started (the WeightCache entry's startedAt)."""


@dataclass(frozen=True)
class PrefetchObservation:
    """Staging of one manifest, summed from the WeightCaches of the target nodes."""

    digest: str
    target_nodes: int
    staged_nodes: int
    bytes_staged: int = 0
    bytes_total: int = 0
    nodes: tuple[NodeStaging, ...] = ()


@dataclass(frozen=True)
class ManifestResolution:
    """The manifest found for spec.model: its sha256, or why there is none."""

    digest: str | None = None
    error: str | None = None


@dataclass(frozen=True)
class ObservedMeasurement:
    """One query result for an analysis metric (see analysis.due_queries)."""

    metric: str
    at: datetime
    value: float | None = None
    error: str | None = None


@dataclass(frozen=True)
class PodVerdict:
    """The verifier's verdict on a pod's weights, not yet on its gate: the verifier is an
    observation source like the analysis queries; the core sets the gate from it."""

    status: Literal["True", "False"]
    reason: str
    message: str
    at: datetime
    annotations: tuple[tuple[str, str | None], ...] = ()
    """Written with the gate: how the weights arrived, the failing prompt, the restarts."""
    restarted: bool = False
    """The pod's containers restarted since its gate's verdict: written even if unchanged."""
    held_seconds: float | None = None
    """Verified weights of a swap in traffic now serve: how long its server held requests."""


@dataclass(frozen=True)
class ObservedPod:
    """One pod of the rollout, as far as decisions about it need to know."""

    name: str
    revision_hash: str | None = None
    uid: str = ""
    created: str = ""
    """creationTimestamp as the API writes it (RFC 3339 UTC: sorts as time does)."""
    pod_ip: str | None = None
    phase: str | None = None
    deleting: bool = False
    ready: bool = False
    containers_ready: bool = False
    weights_verified: bool = False
    """Its readiness gate weightship.io/weights-verified is True and says its weights
    passed (core.verification.gate_passed): not a pod kept in traffic while it swaps."""
    gate_open: bool = False
    """Its weights-verified gate is True (the pod may take traffic), passed or held."""
    containers: tuple[str, ...] = ()
    restarts: int = 0
    """Container restarts, summed over its containers."""
    node: str | None = None
    template_hash: str | None = None
    """The in-place ReplicaSet it belongs to (its template-hash label), if any."""
    swap: PodSwap | None = None
    """Its last in-place swap."""
    gate_reason: str | None = None
    """The reason of its weights-verified gate while its weights have not passed."""
    gate_since: datetime | None = None
    """When that gate last changed (its lastTransitionTime)."""
    gate_message: str | None = None
    """The message of its weights-verified gate, whatever its status."""
    verdict: PodVerdict | None = None
    """The verifier's latest verdict, when it is not on the gate yet."""
    held_seconds: float | None = None
    """How long its server held requests for its last swap in traffic (its verifier's note)."""
    swap_report: PodSwap | None = None
    """The swapper's report of how the pod's swap ended, when its record does not say so
    yet (the swapper is an observation source, like the verifier)."""


@dataclass(frozen=True)
class Observed:
    manifest: ManifestResolution
    replica_sets: tuple[ReplicaSetObservation, ...] = ()
    prefetch: PrefetchObservation | None = None
    measurements: tuple[ObservedMeasurement, ...] = ()
    workload_template: Mapping[str, Any] | None = field(default=None, compare=False)
    """Pod template of spec.workloadRef's Deployment; None when not found or not used."""
    workload_replicas: int | None = None
    """spec.replicas of that Deployment; None when not found or not used."""
    finalizer: bool = False
    """The operator's finalizer is on the rollout: deleting it waits until a Deployment it
    scaled down has its replicas back (controller/handlers.py)."""
    deleting: bool = False
    """The rollout has a deletionTimestamp."""
    pods: tuple[ObservedPod, ...] = ()
    """The rollout's pods (all revisions)."""

    def replica_set(self, revision_hash: str | None) -> ReplicaSetObservation | None:
        return next((r for r in self.replica_sets if r.revision_hash == revision_hash), None)
