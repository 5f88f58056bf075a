"""In-place updates (updatePolicy InPlaceIfPossible): which way a revision change goes,
and which pod swaps its weights next. Pure.

Pods of an in-place rollout live in one ReplicaSet per pod template (selected by the
template hash, not by revision), and each pod's revision-hash label names the weights it
holds. The observation layer counts each revision's pods as a ReplicaSet of its own
(controller.snapshot), so the canary state machine (steps, gates, promotion, abort) runs
unchanged; only how the wanted counts are reached differs: by swapping running pods from
one revision to another, as many at once as inPlace.maxUnavailable allows, instead of
resizing ReplicaSets.

A swap takes its pod out of traffic (its gate closed) unless that would break the bound or
leave no pod of the rollout serving (one replica, or maxUnavailable 0): then the pod swaps
**in traffic**, one such pod at a time. Its gate stays open and its server holds the
requests it gets (the vLLM plugin's gate) through the swap and the checks, then answers
them with the verified new weights, or with the old ones swapped back if the checks fail.
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
    Event,
    RecordSwap,
    RetemplateReplicaSet,
    ScaleAction,
    SetGate,
    SwapPod,
)
from weightship.core.desired import spec_template
from weightship.core.observed import ObservedPod, PodSwap, ReplicaSetObservation, SwapPurpose
from weightship.core.pod_gates import held_in_traffic
from weightship.core.verification import PENDING, SWAP_FAILED, SWAPPING

MAX_EVENT_PODS = 5  # pods named in a SwapsStarted event; the rest are counted
MAX_HOLDING = 1
"""Pods of a rollout swapping in traffic at once: each holds its clients' requests for
seconds (tens on a big model), so they take turns, as a Deployment with maxUnavailable 0
surges one pod at a time."""

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


def max_unavailable(ctx: RolloutContext) -> int:
    """inPlace.maxUnavailable as a pod count: a percent of spec.replicas rounds down, as
    Kubernetes rounds a Deployment's maxUnavailable, but a percent above 0 % to at least 1
    (as before 0 was allowed: 25 % of 2 replicas still swaps one out of traffic). 0: no
    pod leaves traffic for a swap; each swaps in traffic."""
    bound = ctx.spec.strategy.canary.in_place.max_unavailable
    if isinstance(bound, str):
        percent = int(bound.removesuffix("%"))
        return max(1, ctx.spec.replicas * percent // 100) if percent else 0
    return bound


def _swapping(pod: ObservedPod) -> bool:
    return pod.swap is not None and pod.swap.state == "Swapping"


def _out_of_traffic(pod: ObservedPod) -> bool:
    """Swapping out of traffic (its gate closed with the record; kubelet may not have
    marked it unready yet), or not ready for any other reason: each counts against
    maxUnavailable. A pod swapping in traffic serves (its server holds the requests)."""
    in_traffic = pod.swap is not None and pod.swap.in_traffic
    return (_swapping(pod) and not in_traffic) or not pod.ready


def holding(pod: ObservedPod) -> bool:
    """Swapping in traffic, or swapped in traffic and not verified yet: its server holds
    its clients' requests."""
    return held_in_traffic(pod) and (_swapping(pod) or not pod.weights_verified)


def _holds(pod: ObservedPod) -> str | None:
    """The revision the pod holds, or will hold once its running swap ends."""
    if pod.swap is not None and _swapping(pod):
        return pod.swap.to_revision_hash
    return pod.revision_hash


class _Batch:
    """The swaps one decision starts, within maxUnavailable: each pod in traffic that
    swaps out of traffic takes one of the places left, and only while another pod still
    serves; a pod already out of traffic (counted) takes none. Where no place is left by
    the bound (0) or no other pod would serve, the pod swaps in traffic, if no other does
    (MAX_HOLDING); a pod holding already (its checks failed) swaps back in traffic."""

    def __init__(self, ctx: RolloutContext, members: list[ObservedPod]) -> None:
        self.ctx = ctx
        self.bound = max_unavailable(ctx)
        self.room = self.bound - sum(1 for p in members if _out_of_traffic(p))
        self.serving = sum(1 for p in members if not _out_of_traffic(p))
        self.holding = sum(1 for p in members if holding(p))
        self.swaps: list[SwapPod] = []
        self._pods: set[str] = set()

    def add(self, pod: ObservedPod, revision: RevisionStatus, purpose: SwapPurpose) -> bool:
        """Start this swap if the pod is free and the bound allows it; whether it starts."""
        if _swapping(pod) or pod.name in self._pods:
            return False
        in_traffic = where(self.bound, self.room, self.serving, self.holding, pod)
        if in_traffic is None:
            return False
        if in_traffic and not holding(pod):
            self.holding += 1
        elif not in_traffic and pod.ready:
            self.room -= 1
            self.serving -= 1
        self._pods.add(pod.name)
        self.swaps.append(
            SwapPod(
                pod.name,
                revision.pod_template_hash,
                revision.manifest_digest or "",
                revision.revision,
                purpose,
                from_revision_hash=pod.revision_hash,
                restarts=pod.restarts,
                started_at=self.ctx.now,
                in_traffic=in_traffic,
            )
        )
        return True


def where(bound: int, room: int, serving: int, holding_now: int, pod: ObservedPod) -> bool | None:
    """Whether a pod's swap keeps it in traffic (True) or takes it out (False), or None
    while it must wait. ``room``: places left under the bound; ``serving``: pods in traffic
    now, this one included; ``holding_now``: pods swapping in traffic now.

    Out of traffic while that keeps the bound and another pod serves; while the bound is
    full, it waits for a place (as a Deployment does). In traffic where leaving is never
    allowed (the bound is 0) or would leave no pod serving (the last one: never dark), one
    pod at a time; a pod holding already (checks failed, its old weights go back) stays
    in. A pod out of traffic already swaps where it is."""
    if holding(pod):
        return True
    if not pod.ready:
        return False
    if room > 0 and serving > 1:
        return False
    if room <= 0 < bound:
        return None
    return True if holding_now < MAX_HOLDING else None


def swaps(ctx: RolloutContext, home: ReplicaSetObservation, canary_wanted: int) -> list[SwapPod]:
    """The swaps to start now, as many as maxUnavailable allows, pods already out of
    traffic counted: repairs first, then pods on a revision that is neither stable nor
    canary, then the canary count up (or down) to ``canary_wanted``. A running swap counts
    as having arrived, so no decision overshoots the count."""
    stable = ctx.status.stable_revision
    assert stable is not None
    canary = ctx.status.canary_revision
    members = _members(ctx, home)
    batch = _Batch(ctx, members)
    canary_hash = canary.pod_template_hash if canary is not None else None
    on_canary = [p for p in members if _holds(p) == canary_hash]
    canaries = len(on_canary)

    for pod in members:  # a failed swap: back to what the pod should hold
        swap = pod.swap
        failed = swap is not None and swap.state == "Failed" and pod not in on_canary
        if failed and swap is not None and swap.to_revision_hash != stable.pod_template_hash:
            batch.add(pod, stable, "repair")
        elif _restarted_since_swap(pod) and pod.revision_hash is not None:
            held = stable if pod.revision_hash == stable.pod_template_hash else canary
            if held is not None and held.pod_template_hash == pod.revision_hash:
                batch.add(pod, held, "repair")
    strays = [p for p in members if _holds(p) not in (stable.pod_template_hash, canary_hash)]
    for pod in _serving_order(strays, None):
        if canary is not None and canaries < canary_wanted:
            canaries += batch.add(pod, canary, "canary")
        else:
            batch.add(pod, stable, "rollback" if canary is None else "repair")
    if canary is not None and canaries < canary_wanted:
        on_stable = [p for p in members if _holds(p) == stable.pod_template_hash]
        purpose: SwapPurpose = "promote" if canary_wanted >= ctx.spec.replicas else "canary"
        for pod in _serving_order(on_stable, _staged_nodes(ctx)):
            if canaries >= canary_wanted:
                break
            canaries += batch.add(pod, canary, purpose)
    for pod in _serving_order(on_canary, None):  # an abort swaps them back, as many at once
        if canaries <= canary_wanted:
            break
        canaries -= batch.add(pod, stable, "rollback")
    return batch.swaps


def swaps_started(ctx: RolloutContext, home: ReplicaSetObservation, started: list[SwapPod]) -> str:
    """The SwapsStarted event's message: how many pods swap at once, and the bound."""
    swapping = sum(1 for p in _members(ctx, home) if _swapping(p)) + len(started)
    names = ", ".join(
        f"{s.pod} to {s.revision}{' in traffic' if s.in_traffic else ''}"
        for s in started[:MAX_EVENT_PODS]
    )
    more = f" and {len(started) - MAX_EVENT_PODS} more" if len(started) > MAX_EVENT_PODS else ""
    bound = ctx.spec.strategy.canary.in_place.max_unavailable
    held = (
        "; a pod swapping in traffic stays in the Service and its server holds requests "
        "until verified weights answer them (leaving would break the bound or leave no pod "
        "serving)"
        if any(s.in_traffic for s in started)
        else ""
    )
    return (
        f"started {len(started)} swap(s) in place ({names}{more}); {swapping} pod(s) swapping "
        f"at once, at most {max_unavailable(ctx)} out of traffic "
        f"(maxUnavailable {bound} of {ctx.spec.replicas} replicas){held}"
    )


def held_events(ctx: RolloutContext) -> list[Event]:
    """A SwapHeld event for each pod swapped in traffic whose verified weights now serve
    (the verifier's verdict, not on its gate yet): how long its server held requests."""
    out = []
    for pod in sorted(ctx.observed.pods, key=_name):
        verdict, swap = pod.verdict, pod.swap
        if (
            verdict is None
            or verdict.status != "True"
            or verdict.held_seconds is None
            or swap is None
            or not swap.in_traffic
            or pod.weights_verified
        ):
            continue
        out.append(
            Event(
                "Normal",
                "SwapHeld",
                f"pod {pod.name} stayed in traffic while it swapped to {swap.revision} in "
                f"place: its server held requests {verdict.held_seconds:.2f} s, until verified "
                "weights answered them",
            )
        )
    return out


def swap_records(ctx: RolloutContext, starting: Iterable[SwapPod]) -> tuple[RecordSwap, ...]:
    """What apply writes on the pods of in-place swaps: each swap starting (its record
    Swapping, the gate closed so the pod leaves traffic before the swapper asks its server
    to drain, or left open for a swap in traffic), then each swap the swapper reported
    ended, as it ended."""
    starts = (RecordSwap(swap.pod, swap.record(), _started_gate(swap, ctx)) for swap in starting)
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


HELD = "its server holds requests until verified weights answer them"


def _started_gate(swap: SwapPod, ctx: RolloutContext) -> SetGate:
    if swap.in_traffic:
        message = f"in traffic: swapping to {swap.revision} in place; {HELD}"
        return SetGate(swap.pod, "True", SWAPPING, message, ctx.now)
    message = f"out of traffic: swapping to {swap.revision} in place"
    return SetGate(swap.pod, "False", SWAPPING, message, ctx.now)


def _ended_gate(pod: str, report: PodSwap, ctx: RolloutContext) -> SetGate:
    at = report.finished_at or ctx.now
    if report.state == "Swapped":
        # The verifier's turn: checked as a new pod is before it takes traffic. In traffic,
        # the server lets only the verifier reach the new weights meanwhile.
        if report.in_traffic:
            message = f"swapped to {report.revision} in place, in traffic; verifying ({HELD})"
            return SetGate(pod, "True", PENDING, message, at)
        message = f"swapped to {report.revision} in place; verifying"
        return SetGate(pod, "False", PENDING, message, at)
    message = f"swap to {report.revision} failed ({report.reason}): {report.message or ''}"
    if report.in_traffic and report.reason in INTACT_REASONS:
        # Nothing changed: the server serves the weights it had (verified) again.
        return SetGate(pod, "True", SWAP_FAILED, f"{message}; in traffic on its old weights", at)
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


def _refused_swaps_back(ctx: RolloutContext, home: ReplicaSetObservation) -> list[ObservedPod]:
    return [
        p
        for p in _failed_swaps_back(ctx, home)
        if p.swap is not None
        and p.swap.reason in INTACT_REASONS
        and p.revision_hash == p.swap.to_revision_hash
        and p.gate_reason == SWAP_FAILED
    ]


def reverifications(ctx: RolloutContext, home: ReplicaSetObservation) -> tuple[str, ...]:
    """Pods whose swap back to the stable weights was refused before any weight changed
    (e.g. the swap key was missing): they hold the stable weights still, so their gate
    (closed by the swap) is handed back to the verifier."""
    return tuple(p.name for p in _refused_swaps_back(ctx, home) if not p.gate_open)


def reverifications_in_traffic(
    ctx: RolloutContext, home: ReplicaSetObservation
) -> tuple[SetGate, ...]:
    """The same for a pod that swapped in traffic: its server serves the stable weights it
    never left, so its gate stays open while the verifier checks them again."""
    return tuple(
        SetGate(
            p.name,
            "True",
            PENDING,
            "its swap was refused; in traffic on the weights it had; verifying",
            ctx.now,
        )
        for p in _refused_swaps_back(ctx, home)
        if p.gate_open
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
    members = _members(ctx, home)
    swapping = [p.name for p in members if _swapping(p)]
    pods = []
    for pod in members[:MAX_SWAP_PODS]:
        swap = pod.swap
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
                in_traffic=True if swap is not None and swap.in_traffic else None,
                held_seconds=pod.held_seconds if swap is not None and swap.in_traffic else None,
                reason=swap.reason if swap else None,
                message=(swap.message or "")[:1000] if swap and swap.message else None,
            )
        )
    return InPlaceStatus(
        swapping=swapping[0] if swapping else None,
        swapping_pods=len(swapping),
        max_unavailable=max_unavailable(ctx),
        pods=pods,
    )
