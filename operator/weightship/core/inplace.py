"""In-place updates (updatePolicy InPlaceIfPossible): which way a revision change goes,
and which pod swaps its weights next. Pure.

Pods of an in-place rollout live in one ReplicaSet per pod template (selected by the
template hash, not by revision), and each pod's revision-hash label names the weights it
holds. The observation layer counts each revision's pods as a ReplicaSet of its own
(controller.snapshot), so the canary state machine (steps, gates, promotion, abort) runs
unchanged; only how the wanted counts are reached differs: by swapping one running pod at
a time from one revision to another instead of resizing ReplicaSets.
"""

from __future__ import annotations

from collections.abc import Iterable

from weightship.api.inference import FailureReason
from weightship.api.status import (
    MAX_SWAP_PODS,
    InPlaceStatus,
    PodSwapStatus,
    RevisionStatus,
    UpdateMode,
)
from weightship.core.context import RolloutContext
from weightship.core.decision import (
    RecordSwap,
    RetemplateReplicaSet,
    ScaleAction,
    SetGate,
    SwapPod,
)
from weightship.core.desired import spec_template
from weightship.core.observed import ObservedPod, PodSwap, ReplicaSetObservation, SwapPurpose
from weightship.core.verification import PENDING, SWAP_FAILED, SWAPPING

INTACT_REASONS = frozenset(
    {
        FailureReason.CHECKSUM_MISMATCH,
        FailureReason.NOT_STAGED,
        FailureReason.MANIFEST_MISMATCH,
        FailureReason.CONFIG_CHANGED,
        FailureReason.ENGINE_SLEEPING,
        FailureReason.DRAIN_TIMEOUT,
        FailureReason.UNAUTHORIZED,
        FailureReason.NO_SWAP_KEY,
        FailureReason.NOT_SUPPORTED,
        FailureReason.REFUSED,
    }
)
"""Swap failures found before any weight changed: the pod still holds what it had."""


def enabled(ctx: RolloutContext) -> bool:
    return ctx.spec.strategy.canary.update_policy == "InPlaceIfPossible"


def update_mode(ctx: RolloutContext, desired: RevisionStatus) -> tuple[UpdateMode, str]:
    """How a new canary reaches its pods, and why (status, the NewRevision event)."""
    if not enabled(ctx):
        return "Replace", "updatePolicy is Recreate"
    stable = ctx.status.stable_revision
    if stable is None:
        return "Replace", "first revision: its pods start on it"
    home = ctx.observed.replica_set(stable.pod_template_hash)
    if home is None or home.template_hash is None:
        return "Replace", "the stable pods were not created for in-place updates"
    if home.template_hash != desired.template_hash:
        return "Replace", "the pod template changed, not only spec.model"
    return "InPlace", "only spec.model changed: running pods swap their weights"


def home_replica_set(ctx: RolloutContext) -> ReplicaSetObservation | None:
    """The in-place ReplicaSet the stable pods live in, when the spec's revision has the
    same pod template (so its pods swap rather than being replaced); else None."""
    stable, desired = ctx.status.stable_revision, ctx.desired
    if not enabled(ctx) or stable is None or desired is None or desired.template_hash is None:
        return None
    canary = ctx.status.canary_revision
    if canary is not None and canary.update == "Replace":
        return None
    home = ctx.observed.replica_set(stable.pod_template_hash)
    if home is None or home.template_hash != desired.template_hash:
        return None
    return home


def canary_swap_failure(ctx: RolloutContext) -> ObservedPod | None:
    """A pod whose swap to the canary failed (bad bytes, engine error, timeout)."""
    canary = ctx.status.canary_revision
    if canary is None:
        return None
    return next(
        (
            p
            for p in sorted(ctx.observed.pods, key=_name)
            if p.swap is not None
            and p.swap.state == "Failed"
            and p.swap.to_revision_hash == canary.pod_template_hash
            and p.revision_hash != canary.pod_template_hash
        ),
        None,
    )


def _name(pod: ObservedPod) -> str:
    return pod.name


def _members(ctx: RolloutContext, home: ReplicaSetObservation) -> list[ObservedPod]:
    return sorted(
        (p for p in ctx.observed.pods if p.template_hash == home.template_hash and not p.deleting),
        key=_name,
    )


def _serving_order(pods: Iterable[ObservedPod], staged: frozenset[str] | None) -> list[ObservedPod]:
    """Swap candidates first: up (the server answers), not serving, on a node that staged
    the target; then by name, so the choice is the same on every reconcile."""
    up = [p for p in pods if p.phase == "Running" and p.pod_ip and p.containers_ready]
    return sorted(
        up,
        key=lambda p: (p.ready, staged is not None and p.node not in staged, p.name),
    )


def _staged_nodes(ctx: RolloutContext) -> frozenset[str] | None:
    prefetch = ctx.observed.prefetch
    if prefetch is None:
        return None
    return frozenset(n.name for n in prefetch.nodes if n.state == "Staged")


def swaps(ctx: RolloutContext, home: ReplicaSetObservation, canary_wanted: int) -> list[SwapPod]:
    """The next swap, if none is running: repairs first, then pods on a revision that is
    neither stable nor canary, then the canary count up (or down) to ``canary_wanted``."""
    stable = ctx.status.stable_revision
    assert stable is not None
    canary = ctx.status.canary_revision
    members = _members(ctx, home)
    if any(p.swap is not None and p.swap.state == "Swapping" for p in members):
        return []
    canary_hash = canary.pod_template_hash if canary is not None else None
    on_canary = [p for p in members if p.revision_hash == canary_hash]

    def to(pod: ObservedPod, revision: RevisionStatus, purpose: SwapPurpose) -> list[SwapPod]:
        return [
            SwapPod(
                pod.name,
                revision.pod_template_hash,
                revision.manifest_digest or "",
                revision.revision,
                purpose,
                from_revision_hash=pod.revision_hash,
                restarts=pod.restarts,
                started_at=ctx.now,
            )
        ]

    for pod in members:  # a failed swap: back to what the pod should hold
        swap = pod.swap
        failed = swap is not None and swap.state == "Failed" and pod not in on_canary
        if failed and swap is not None and swap.to_revision_hash != stable.pod_template_hash:
            return to(pod, stable, "repair")
        if _restarted_since_swap(pod) and pod.revision_hash is not None:
            held = stable if pod.revision_hash == stable.pod_template_hash else canary
            if held is not None and held.pod_template_hash == pod.revision_hash:
                return to(pod, held, "repair")
    strays = [p for p in members if p.revision_hash not in (stable.pod_template_hash, canary_hash)]
    for pod in _serving_order(strays, None):
        if canary is not None and len(on_canary) < canary_wanted:
            return to(pod, canary, "canary")
        return to(pod, stable, "rollback" if canary is None else "repair")
    if canary is not None and len(on_canary) < canary_wanted:
        on_stable = [p for p in members if p.revision_hash == stable.pod_template_hash]
        purpose: SwapPurpose = "promote" if canary_wanted >= ctx.spec.replicas else "canary"
        for pod in _serving_order(on_stable, _staged_nodes(ctx)):
            return to(pod, canary, purpose)
    if len(on_canary) > canary_wanted:
        for pod in _serving_order(on_canary, None):
            return to(pod, stable, "rollback")
    return []


def swap_records(ctx: RolloutContext, starting: Iterable[SwapPod]) -> tuple[RecordSwap, ...]:
    """What apply writes on the pods of in-place swaps: each swap starting (its record
    Swapping, the gate closed so the pod leaves traffic before the swapper asks its server
    to drain), then each swap the swapper reported ended, as it ended."""
    starts = (
        RecordSwap(
            swap.pod,
            swap.record(),
            SetGate(
                swap.pod,
                "False",
                SWAPPING,
                f"out of traffic: swapping to {swap.revision} in place",
                ctx.now,
            ),
        )
        for swap in starting
    )
    ends = (
        RecordSwap(pod.name, report, _ended_gate(pod.name, report, ctx))
        for pod in sorted(ctx.observed.pods, key=_name)
        if (report := pod.swap_report) is not None
        and report.state != "Swapping"
        and pod.swap is not None
        and pod.swap.state == "Swapping"
        and pod.swap.same_swap(report)
    )
    return (*starts, *ends)


def _ended_gate(pod: str, report: PodSwap, ctx: RolloutContext) -> SetGate:
    at = report.finished_at or ctx.now
    if report.state == "Swapped":
        # The verifier's turn: checked as a new pod is before it takes traffic.
        message = f"swapped to {report.revision} in place; verifying"
        return SetGate(pod, "False", PENDING, message, at)
    message = f"swap to {report.revision} failed ({report.reason}): {report.message or ''}"
    return SetGate(pod, "False", SWAP_FAILED, message, at)


def _restarted_since_swap(pod: ObservedPod) -> bool:
    """Its server restarted after a swap: it loaded the weights the pod was created with
    (its environment's), not those its label names, and must swap to them again."""
    swap = pod.swap
    return (
        swap is not None
        and swap.state == "Swapped"
        and swap.restarts is not None
        and pod.restarts > swap.restarts
        and pod.containers_ready
        and not pod.weights_verified
    )


def _failed_swaps_back(ctx: RolloutContext, home: ReplicaSetObservation) -> list[ObservedPod]:
    """Pods whose last swap, back to the stable weights, failed."""
    stable = ctx.status.stable_revision
    assert stable is not None
    return [
        p
        for p in _members(ctx, home)
        if p.swap is not None
        and p.swap.state == "Failed"
        and p.swap.to_revision_hash == stable.pod_template_hash
    ]


def reverifications(ctx: RolloutContext, home: ReplicaSetObservation) -> tuple[str, ...]:
    """Pods whose swap back to the stable weights was refused before any weight changed
    (e.g. the swap key was missing): they hold the stable weights still, so their gate
    (closed by the swap) is handed back to the verifier."""
    return tuple(
        p.name
        for p in _failed_swaps_back(ctx, home)
        if p.swap is not None
        and p.swap.reason in INTACT_REASONS
        and p.revision_hash == p.swap.to_revision_hash
        and p.gate_reason == SWAP_FAILED
    )


def restarts(ctx: RolloutContext, home: ReplicaSetObservation) -> tuple[str, ...]:
    """Pods whose swap back to the stable weights failed: only a fresh start mends them."""
    return tuple(
        p.name
        for p in _failed_swaps_back(ctx, home)
        if p.swap is not None and p.swap.reason not in INTACT_REASONS
    )


def replica_set_actions(
    ctx: RolloutContext, home: ReplicaSetObservation
) -> tuple[list[ScaleAction], list[RetemplateReplicaSet]]:
    """The in-place ReplicaSet keeps spec.replicas pods whatever revision each holds, and
    its template follows the stable revision once the spec asks for it."""
    stable, desired = ctx.status.stable_revision, ctx.desired
    assert stable is not None
    size = sum(r.replicas for r in ctx.observed.replica_sets if r.name == home.name)
    scales = []
    if size != ctx.spec.replicas:
        scales.append(
            ScaleAction(
                home.template_revision_hash or stable.pod_template_hash,
                "stable",
                ctx.spec.replicas,
                home.name,
            )
        )
    retemplates = []
    template = spec_template(ctx)
    if (
        home.template_revision_hash != stable.pod_template_hash
        and desired is not None
        and desired.pod_template_hash == stable.pod_template_hash
        and stable.manifest_digest
        and template is not None
        and home.template_hash is not None
    ):
        retemplates.append(
            RetemplateReplicaSet(
                home.name,
                stable.pod_template_hash,
                stable.manifest_digest,
                home.template_hash,
                template,
            )
        )
    return scales, retemplates


def in_place_status(
    ctx: RolloutContext, home: ReplicaSetObservation | None
) -> InPlaceStatus | None:
    """What `weightship status` shows per pod of an in-place rollout."""
    if not enabled(ctx) or home is None:
        return None
    revisions = {
        r.pod_template_hash: r.revision
        for r in (ctx.status.stable_revision, ctx.status.canary_revision)
        if r is not None
    }
    pods = []
    swapping = None
    for pod in _members(ctx, home)[:MAX_SWAP_PODS]:
        swap = pod.swap
        if swap is not None and swap.state == "Swapping":
            swapping = pod.name
        arrived = swap is not None and swap.state == "Swapped"
        pods.append(
            PodSwapStatus(
                pod=pod.name,
                revision=revisions.get(pod.revision_hash or ""),
                pod_template_hash=pod.revision_hash,
                arrival="Swapped"
                if arrived and swap is not None and swap.to_revision_hash == pod.revision_hash
                else "Started",
                swap_state=swap.state if swap else None,
                swap_to=swap.revision if swap else None,
                swap_seconds=swap.seconds if swap else None,
                paused_seconds=swap.paused_seconds if swap else None,
                reason=swap.reason if swap else None,
                message=(swap.message or "")[:1000] if swap and swap.message else None,
            )
        )
    return InPlaceStatus(swapping=swapping, pods=pods)
