"""Who sets a pod's weights-verified gate (pure): the core, from what it observed.

With something to verify (a checksum or golden prompts in spec.validation), the
verifier (controller/verifier.py) checks the pod and reports its verdict as an
observation (`ObservedPod.verdict`); the gate takes the verdict when it says something
new. With nothing to verify, the gate opens once a pod's containers are ready. A pod
that is draining before its deletion (core.drain) keeps its gate closed. A pod swapping in
traffic (core.inplace) keeps its gate open whatever the verdict on its new weights: its
server holds the requests until they pass, or until the old weights are swapped back.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from datetime import datetime

from weightship.api.spec import ModelRolloutSpec, ValidationSpec
from weightship.core.decision import DrainPod, SetGate
from weightship.core.observed import ObservedPod, PodVerdict
from weightship.core.verification import DRAINING, NOTHING_TO_VERIFY, PENDING

__all__ = ["NOTHING_TO_VERIFY", "draining", "held_in_traffic", "pending", "pod_gates", "verifies"]


def verifies(validation: ValidationSpec) -> bool:
    """Whether the verifier checks pods (a checksum or golden prompts to check)."""
    return validation.mode != "none" or bool(validation.golden_prompts)


def pod_gates(
    spec: ModelRolloutSpec, pods: Sequence[ObservedPod], now: datetime
) -> tuple[SetGate, ...]:
    if not verifies(spec.validation):
        return tuple(_trivial(pods, now))
    return tuple(_verdicts(pods))


def draining(drain: DrainPod) -> SetGate:
    """The gate closed on a pod about to be deleted (core.drain)."""
    return SetGate(drain.pod, "False", DRAINING, drain.message, drain.at)


def pending(pod: str, why: str, at: datetime) -> SetGate:
    """The gate handed (back) to the verifier."""
    return SetGate(pod, "False", PENDING, f"{why}; verifying", at)


def _trivial(pods: Sequence[ObservedPod], now: datetime) -> Iterator[SetGate]:
    message = "spec.validation has no checksum and no golden prompts"
    for pod in pods:
        if pod.containers_ready and not pod.weights_verified and pod.gate_reason != DRAINING:
            yield SetGate(pod.name, "True", NOTHING_TO_VERIFY, message, now)


def _verdicts(pods: Sequence[ObservedPod]) -> Iterator[SetGate]:
    for pod in pods:
        verdict = pod.verdict
        if verdict is None or pod.deleting or pod.gate_reason == DRAINING:
            continue
        if verdict.restarted or not _on_gate(pod, verdict):
            yield SetGate(
                pod.name,
                "True" if held_in_traffic(pod, verdict) else verdict.status,
                verdict.reason,
                verdict.message,
                verdict.at,
                verdict.annotations,
            )


def held_in_traffic(pod: ObservedPod, verdict: PodVerdict | None = None) -> bool:
    """The pod swapped in traffic and its gate is still open: its server holds requests
    for the swapped weights' checks, so a verdict against them keeps the gate open (the
    core swaps the old weights back; a restarted server holds nothing and leaves)."""
    swap = pod.swap
    return (
        swap is not None
        and swap.in_traffic
        and swap.state in ("Swapping", "Swapped")
        and pod.gate_open
        and not (verdict is not None and verdict.restarted)
    )


def _on_gate(pod: ObservedPod, verdict: PodVerdict) -> bool:
    """The gate says what the verdict says already (no write per verification poll)."""
    if pod.gate_message != verdict.message:
        return False
    if verdict.status == "True":
        return pod.weights_verified
    return not pod.weights_verified and pod.gate_reason == verdict.reason
