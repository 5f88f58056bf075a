"""ModelRollout.status: everything the controller knows, since status is its only memory.

Every field is declared so the apiserver prunes nothing. Lists are bounded so the object
stays small on a 1,000-GPU fleet.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AwareDatetime, Field

from weightship.api.base import (
    MAX_LABEL_KEY,
    MAX_LABEL_VALUE,
    MAX_MESSAGE,
    MAX_NAME,
    MAX_SHORT_TEXT,
    ApiModel,
    cel,
    validations,
)
from weightship.api.weightcache import StagingFailure

MAX_HISTORY = 10
MAX_MEASUREMENTS = 10
MAX_PREFETCH_NODES = 50
MAX_VERIFICATION_FAILURES = 5
MAX_POD_LOADS = 20
MAX_SWAP_PODS = 50
# Kubernetes allows a condition 32 KiB of message; seven of them were most of the largest
# status. status.message keeps MAX_MESSAGE for the whole story.
MAX_CONDITION_MESSAGE = 4096
# One measurement's error detail; the metric's own message quotes the last one. The
# controller keeps 300 characters of a query error (controller.observe), so what earlier
# versions stored still fits when the list is written again.
MAX_MEASUREMENT_MESSAGE = 300

# Phase → Argo CD health: Pending/Prefetching/Progressing → Progressing, Paused → Suspended,
# Healthy → Healthy, Degraded → Degraded.
Phase = Literal["Pending", "Prefetching", "Progressing", "Paused", "Healthy", "Degraded"]
PHASES: tuple[Phase, ...] = (
    "Pending",
    "Prefetching",
    "Progressing",
    "Paused",
    "Healthy",
    "Degraded",
)
ConditionType = Literal[
    "Prefetched", "Seeded", "Verified", "Progressing", "Paused", "Aborted", "InvalidSpec"
]
CONDITION_TYPES: tuple[ConditionType, ...] = (
    "Prefetched",
    "Seeded",
    "Verified",
    "Progressing",
    "Paused",
    "Aborted",
    "InvalidSpec",
)
ConditionStatus = Literal["True", "False", "Unknown"]
HistoryOutcome = Literal["Promoted", "RolledBack", "Aborted"]
MeasurementPhase = Literal["Successful", "Failed", "Inconclusive", "Error"]
AnalysisPhase = Literal["Running", "Successful", "Failed", "Inconclusive"]
NodeStageState = Literal["Pending", "Staging", "Staged", "Failed"]
PromoteMode = Literal["Step", "Full"]
LoadSource = Literal["cache", "origin", "broadcast", "swap"]
UpdateMode = Literal["InPlace", "Replace"]
SwapState = Literal["Swapping", "Swapped", "Failed"]
PodArrival = Literal["Started", "Seeded", "Swapped"]


class Condition(ApiModel):
    """A Kubernetes condition (metav1.Condition)."""

    type: ConditionType = Field(description="Condition type.")
    status: ConditionStatus = Field(description="True, False or Unknown.")
    reason: str = Field(
        description="CamelCase machine-readable reason.",
        min_length=1,
        max_length=MAX_SHORT_TEXT,
        pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$",
    )
    message: str = Field("", description="Human-readable detail.", max_length=MAX_CONDITION_MESSAGE)
    last_transition_time: AwareDatetime = Field(
        description="When status last changed (not when the message did)."
    )
    observed_generation: int | None = Field(
        None, description="metadata.generation the condition was computed from.", ge=0
    )


class RevisionStatus(ApiModel):
    """Identity of a deployed revision."""

    revision: str = Field(
        description="spec.model.revision of this revision.", max_length=MAX_LABEL_VALUE
    )
    manifest_digest: str | None = Field(
        None, description="sha256 of the weights manifest.", max_length=71
    )
    pod_template_hash: str = Field(
        description="Hash naming the ReplicaSet (pod template plus weights).", max_length=63
    )
    template_hash: str | None = Field(
        None,
        description="Hash of the pod template alone: revisions with the same one differ "
        "only in their weights, which updatePolicy InPlaceIfPossible swaps in place.",
        max_length=63,
    )
    update: UpdateMode | None = Field(
        None,
        description="How this revision reached its pods: InPlace (running pods swapped "
        "their weights) or Replace (new pods).",
    )
    update_reason: str | None = Field(
        None, description="Why it went that way.", max_length=MAX_SHORT_TEXT
    )


class PodSwapStatus(ApiModel):
    """One pod of an in-place rollout: the weights it serves and how they got there."""

    pod: str = Field(description="Pod name.", max_length=MAX_NAME)
    revision: str | None = Field(
        None, description="spec.model.revision of the weights it holds.", max_length=MAX_LABEL_VALUE
    )
    pod_template_hash: str | None = Field(
        None, description="The revision hash it belongs to now.", max_length=63
    )
    arrival: PodArrival = Field(
        "Started",
        description="Started (loaded at start), Seeded (by broadcast) or Swapped (in place).",
    )
    swap_state: SwapState | None = Field(
        None, description="The last swap: Swapping, Swapped or Failed."
    )
    swap_to: str | None = Field(
        None, description="Revision the last swap went to.", max_length=MAX_LABEL_VALUE
    )
    swap_seconds: float | None = Field(
        None, description="Duration of the last swap (out of traffic to swapped).", ge=0
    )
    paused_seconds: float | None = Field(
        None, description="How long the engine was paused in the last swap.", ge=0
    )
    in_traffic: bool | None = Field(
        None,
        description="The last swap kept the pod in traffic (it was the last serving pod, or "
        "inPlace.maxUnavailable is 0): its server held client requests through the swap and "
        "the checks.",
    )
    held_seconds: float | None = Field(
        None,
        description="For a swap in traffic: how long its server held client requests, from "
        "the swap's start until the verified weights (or, after failed checks, the old ones "
        "swapped back) served them, as the server measured it.",
        ge=0,
    )
    reason: str | None = Field(
        None, description="Why the last swap failed.", max_length=MAX_SHORT_TEXT
    )
    message: str | None = Field(None, description="Detail.", max_length=MAX_SHORT_TEXT)


class InPlaceStatus(ApiModel):
    """Pods of a rollout with updatePolicy InPlaceIfPossible and their swaps."""

    swapping: str | None = Field(
        None,
        description="A pod swapping its weights now (the first by name).",
        max_length=MAX_NAME,
    )
    swapping_pods: int = Field(0, description="Pods swapping their weights now.", ge=0)
    max_unavailable: int | None = Field(
        None,
        description="Pods that may be out of traffic at once for swaps: "
        "spec.strategy.canary.inPlace.maxUnavailable resolved against spec.replicas (0: "
        "every swap keeps its pod in traffic).",
        ge=0,
    )
    pods: list[PodSwapStatus] = Field(
        default_factory=list,
        description=f"Up to {MAX_SWAP_PODS} pods, by name.",
        max_length=MAX_SWAP_PODS,
    )


class RetiringRevision(RevisionStatus):
    """The previous stable, kept up until scaleDownAt after a promotion."""

    scale_down_at: AwareDatetime = Field(description="When its ReplicaSet scales to zero.")


class PrefetchNodeStatus(ApiModel):
    """Staging progress on one node."""

    name: str = Field(description="Node name.", max_length=253)
    state: NodeStageState = Field(description="Pending, Staging, Staged or Failed.")
    bytes_done: int = Field(0, description="Bytes staged.", ge=0)
    bytes_total: int = Field(0, description="Bytes to stage.", ge=0)
    message: str | None = Field(None, description="Last error, if any.", max_length=MAX_SHORT_TEXT)
    failure: StagingFailure | None = Field(
        None, description="Why its last stage failed, as its WeightCache reports it."
    )


class PrefetchStatus(ApiModel):
    """Staging of the canary weights across target nodes."""

    manifest_digest: str | None = Field(None, description="Manifest being staged.", max_length=71)
    staged_nodes: int = Field(0, description="Nodes with every chunk staged and verified.", ge=0)
    target_nodes: int = Field(0, description="Nodes that should stage the weights.", ge=0)
    bytes_staged: int = Field(0, description="Bytes staged, summed over nodes.", ge=0)
    bytes_total: int = Field(0, description="Bytes to stage, summed over nodes.", ge=0)
    nodes: list[PrefetchNodeStatus] = Field(
        default_factory=list,
        description=f"Up to {MAX_PREFETCH_NODES} nodes that are not staged yet, failed first.",
        max_length=MAX_PREFETCH_NODES,
    )


class ReplicaStatus(ApiModel):
    """Pod counts."""

    stable: int = Field(0, description="Pods of the stable revision.", ge=0)
    canary: int = Field(0, description="Pods of the canary revision.", ge=0)
    ready: int = Field(0, description="Ready pods, both revisions.", ge=0)
    verified: int = Field(0, description="Canary pods whose weights passed verification.", ge=0)


class PodLoad(ApiModel):
    """How one canary pod got its weights: who seeded whom, and how long it took."""

    pod: str = Field(description="Pod name.", max_length=MAX_NAME)
    source: LoadSource | None = Field(
        None, description="cache (node cache), origin (S3) or broadcast (from a loaded peer)."
    )
    seeded_from: str | None = Field(
        None, description="The pod that broadcast the weights.", max_length=MAX_NAME
    )
    seconds: float | None = Field(None, description="Time to loaded and verified.", ge=0)
    mode: Literal["loaded", "staged", "none"] | None = Field(
        None,
        description="How the verifier checked the weights (spec.validation.checksum; auto "
        "resolves to loaded or staged per pod).",
    )


class PodVerificationFailure(ApiModel):
    """A canary pod whose weights-verified gate failed, with the failing golden prompt."""

    pod: str = Field(description="Pod name.", max_length=MAX_NAME)
    reason: str = Field(
        description="e.g. ChecksumMismatch, DigestMismatch, GoldenPromptFailed.",
        max_length=MAX_SHORT_TEXT,
    )
    message: str = Field("", description="What failed.", max_length=MAX_SHORT_TEXT)
    prompt: str | None = Field(
        None, description="Name of the failing golden prompt.", max_length=MAX_LABEL_VALUE
    )
    expected: str | None = Field(
        None, description="What the prompt expected.", max_length=MAX_SHORT_TEXT
    )
    got: str | None = Field(
        None, description="What the replica answered.", max_length=MAX_SHORT_TEXT
    )


class VerificationStatus(ApiModel):
    """The readiness-gate verification of one revision's pods."""

    pod_template_hash: str = Field(
        description="Revision these pods belong to.", max_length=MAX_LABEL_VALUE
    )
    verified: int = Field(0, description="Pods with weights-verified True.", ge=0)
    failures: list[PodVerificationFailure] = Field(
        default_factory=list,
        description=f"Up to {MAX_VERIFICATION_FAILURES} pods that failed verification.",
        max_length=MAX_VERIFICATION_FAILURES,
    )
    loads: list[PodLoad] = Field(
        default_factory=list,
        description=f"How up to {MAX_POD_LOADS} pods loaded their weights.",
        max_length=MAX_POD_LOADS,
    )


class Measurement(ApiModel):
    """One metric measurement."""

    value: float | None = Field(None, description="Query result; empty when no data or error.")
    phase: MeasurementPhase = Field(description="Successful, Failed, Inconclusive or Error.")
    at: AwareDatetime = Field(description="When it was taken.")
    message: str | None = Field(
        None, description="Error or no-data detail.", max_length=MAX_MEASUREMENT_MESSAGE
    )


class MetricRun(ApiModel):
    """Counts and recent measurements of one metric in the current analysis step."""

    metric: str = Field(description="Metric name.", max_length=63)
    phase: AnalysisPhase = Field(
        "Running", description="Running, Successful, Failed or Inconclusive."
    )
    count: int = Field(0, description="Measurements taken (errors excluded).", ge=0)
    successful: int = Field(0, description="Successful measurements.", ge=0)
    failed: int = Field(0, description="Failed measurements.", ge=0)
    inconclusive: int = Field(0, description="Inconclusive measurements.", ge=0)
    error: int = Field(0, description="Query errors.", ge=0)
    consecutive_error: int = Field(0, description="Query errors in a row.", ge=0)
    message: str | None = Field(
        None, description="Why the metric ended.", max_length=MAX_SHORT_TEXT
    )
    measurements: list[Measurement] = Field(
        default_factory=list,
        description=f"The last {MAX_MEASUREMENTS} measurements, oldest first.",
        max_length=MAX_MEASUREMENTS,
    )


class AnalysisStatus(ApiModel):
    """Result of the analysis step in progress (or the last one)."""

    step_index: int = Field(description="Index of the analysis step.", ge=0)
    pod_template_hash: str = Field(description="Canary revision analysed.", max_length=63)
    phase: AnalysisPhase = Field(
        "Running", description="Running, Successful, Failed or Inconclusive."
    )
    message: str | None = Field(None, description="Summary.", max_length=MAX_SHORT_TEXT)
    started_at: AwareDatetime = Field(description="When the step started.")
    runs: list[MetricRun] = Field(
        default_factory=list,
        description="One entry per metric.",
        max_length=32,
        json_schema_extra={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["metric"],
        },
    )


class HistoryEntry(ApiModel):
    """A promotion or rollback."""

    revision: str = Field(description="spec.model.revision concerned.", max_length=MAX_LABEL_VALUE)
    manifest_digest: str | None = Field(None, description="Its manifest digest.", max_length=71)
    pod_template_hash: str | None = Field(None, description="Its ReplicaSet hash.", max_length=63)
    outcome: HistoryOutcome = Field(
        description="Promoted, RolledBack (automatic) or Aborted (manual)."
    )
    at: AwareDatetime = Field(description="When it happened.")
    reason: str = Field(description="CamelCase reason.", max_length=MAX_SHORT_TEXT)
    message: str | None = Field(None, description="Detail.", max_length=MAX_SHORT_TEXT)


class AbortStatus(ApiModel):
    """Set while the canary is aborted; cleared by retry or a new revision."""

    reason: str = Field(
        description="CamelCase reason, e.g. AnalysisFailed.", max_length=MAX_SHORT_TEXT
    )
    message: str = Field("", description="What failed.", max_length=MAX_SHORT_TEXT)
    aborted_at: AwareDatetime = Field(description="When the abort started.")
    pod_template_hash: str = Field(description="The aborted canary revision.", max_length=63)
    canary_scale_down_at: AwareDatetime | None = Field(
        None,
        description="When the canary scales to zero: set once stable is Ready again, plus "
        "abortScaleDownDelaySeconds.",
    )


class ControlRequest(ApiModel):
    """An imperative request, written to the status subresource by `weightship promote|abort|
    retry` (or any client). It is pending while requestedAt differs from acknowledged, so a new
    request is never lost to a controller write that raced with it."""

    requested_at: str = Field(
        description="Unique token for this request, normally an RFC 3339 timestamp.",
        min_length=1,
        max_length=64,
    )
    requested_by: str | None = Field(None, description="Who asked.", max_length=253)
    acknowledged: str | None = Field(
        None, description="requestedAt of the last request the controller acted on.", max_length=64
    )

    @property
    def pending(self) -> bool:
        return self.requested_at != self.acknowledged


class PromoteRequest(ControlRequest):
    """Advance the canary: Step skips the current step, Full skips all remaining ones."""

    mode: PromoteMode = Field("Step", description="Step or Full.")


class AbortRequest(ControlRequest):
    """Abort the canary and go back to stable."""

    reason: str | None = Field(
        None, description="Why, shown in status and Slack.", max_length=MAX_SHORT_TEXT
    )


class WorkloadStatus(ApiModel):
    """The spec.workloadRef Deployment this rollout scaled to zero, and what it gets back."""

    name: str = Field(
        description="Name of the Deployment, in the rollout's namespace.", max_length=MAX_NAME
    )
    replicas: int = Field(
        description="Its spec.replicas when the rollout took over: restored when the rollout "
        "is deleted or no longer refers to it.",
        ge=0,
    )


class ControlStatus(ApiModel):
    """Imperative actions. They live in status, never in spec, so GitOps shows no drift."""

    promote: PromoteRequest | None = Field(None, description="Promote request.")
    abort: AbortRequest | None = Field(None, description="Abort request.")
    retry: ControlRequest | None = Field(None, description="Retry an aborted canary from step 0.")


class ModelRolloutStatus(ApiModel):
    """Observed state, computed by the controller. Only status.control is written by users."""

    phase: Phase = Field(
        "Pending",
        description="Pending, Prefetching, Progressing, Paused (Argo CD: Suspended), Healthy or "
        "Degraded.",
    )
    message: str = Field(
        "", description="Why the rollout is in this phase.", max_length=MAX_MESSAGE
    )
    observed_generation: int = Field(0, description="Last metadata.generation acted on.", ge=0)
    stable_revision: RevisionStatus | None = Field(None, description="Revision serving production.")
    canary_revision: RevisionStatus | None = Field(None, description="Revision being rolled out.")
    current_step_index: int | None = Field(
        None, description="Index of the canary step in progress; len(steps) when done.", ge=0
    )
    canary_weight: int = Field(0, description="Weight routed to the canary, 0-100.", ge=0, le=100)
    pause_start_time: AwareDatetime | None = Field(
        None, description="When the current pause began."
    )
    step_start_time: AwareDatetime | None = Field(
        None, description="When the current step (or prefetch) began; for progressDeadlineSeconds."
    )
    prefetch: PrefetchStatus | None = Field(None, description="Staging progress of the canary.")
    replicas: ReplicaStatus = Field(default_factory=ReplicaStatus, description="Pod counts.")
    analysis: AnalysisStatus | None = Field(None, description="Current or last analysis step.")
    verification: VerificationStatus | None = Field(
        None,
        description="Verification of the canary's pods (the stable's when there is no "
        "canary): failures and how each pod loaded its weights.",
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        description="Prefetched, Seeded, Verified, Progressing, Paused, Aborted, InvalidSpec.",
        max_length=len(CONDITION_TYPES),
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    history: list[HistoryEntry] = Field(
        default_factory=list,
        description=f"The last {MAX_HISTORY} promotions and rollbacks, oldest first.",
        max_length=MAX_HISTORY,
    )
    abort: AbortStatus | None = Field(None, description="Set while aborted.")
    retiring: RetiringRevision | None = Field(
        None, description="Previous stable awaiting scale-down after a promotion."
    )
    control: ControlStatus | None = Field(
        None, description="Imperative requests (promote, abort, retry); see ControlRequest."
    )
    prefetch_node_selector: dict[str, Annotated[str, Field(max_length=MAX_LABEL_VALUE)]] | None = (
        Field(
            None,
            description="The nodes that stage the weights, as the operator resolved them: "
            "spec.prefetch.nodeSelector, else the pod template's nodeSelector (for workloadRef, "
            "the Deployment's). Unset means every node. The node agents follow it.",
            max_length=64,
            # Keys are label keys, which the selector's sources were checked as; the schema
            # bounds only their length (no propertyNames in a structural schema).
            json_schema_extra=validations(
                cel(f"self.all(k, k.size() <= {MAX_LABEL_KEY})", "keys are label keys")
            ),
        )
    )
    workload: WorkloadStatus | None = Field(
        None,
        description="Set while the spec.workloadRef Deployment is scaled to zero by this "
        "rollout (its deletion then waits until the Deployment has its replicas back).",
    )
    in_place: InPlaceStatus | None = Field(
        None, description="In-place swaps (updatePolicy InPlaceIfPossible only)."
    )

    def condition(self, type_: ConditionType) -> Condition | None:
        return next((c for c in self.conditions if c.type == type_), None)
