"""The weights-verified gate of pods with nothing to verify (pure).

With no checksum (checksumMode none, or checksum false) and no golden prompts in
spec.validation, the gate opens once a pod's containers are ready. Anything to verify is
the verifier's job (controller/verifier.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from weightship.api.spec import ModelRolloutSpec
from weightship.core.decision import OpenGate
from weightship.core.observed import ObservedPod
from weightship.core.verification import DRAINING

NOTHING_TO_VERIFY = "NothingToVerify"


def trivial_gates(
    spec: ModelRolloutSpec, pods: Sequence[ObservedPod], now: datetime
) -> tuple[OpenGate, ...]:
    validation = spec.validation
    if validation.mode != "none" or validation.golden_prompts:
        return ()
    return tuple(
        OpenGate(
            pod.name,
            NOTHING_TO_VERIFY,
            "spec.validation has no checksum and no golden prompts",
            now,
        )
        for pod in pods
        if pod.containers_ready and not pod.weights_verified and pod.gate_reason != DRAINING
    )
