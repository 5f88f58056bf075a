"""Gates: checks a canary must pass before it moves on, evaluated from Observed only.

Gates are pluggable so tests (and future checks) can swap them: `decide` takes a GateSet.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

from weightship.api.models import ModelRollout
from weightship.api.status import AnalysisStatus, RevisionStatus
from weightship.core.observed import Observed
from weightship.core.staging_failure import failed_nodes

GateStatus = Literal["Passed", "Waiting", "Inconclusive", "Failed"]


@dataclass(frozen=True)
class GateResult:
    status: GateStatus
    reason: str
    message: str

    @property
    def passed(self) -> bool:
        return self.status == "Passed"


@dataclass(frozen=True)
class GateInput:
    rollout: ModelRollout
    observed: Observed
    canary: RevisionStatus
    desired_canary_replicas: int
    analysis: AnalysisStatus | None = None


class Gate(Protocol):
    @property
    def name(self) -> str: ...

    def evaluate(self, gate_input: GateInput) -> GateResult: ...


@dataclass(frozen=True)
class PrefetchedGate:
    """Enough target nodes have the canary's weights staged and verified."""

    name: str = "prefetched"

    def evaluate(self, gate_input: GateInput) -> GateResult:
        spec = gate_input.rollout.spec.prefetch
        digest = gate_input.canary.manifest_digest
        stable = gate_input.rollout.status.stable_revision
        if not spec.enabled:
            return GateResult("Passed", "PrefetchDisabled", "spec.prefetch.enabled is false")
        if stable is not None and stable.manifest_digest == digest:
            return GateResult("Passed", "AlreadyStaged", f"{digest} is the stable's weights")
        seen = gate_input.observed.prefetch
        if seen is None or seen.digest != digest:
            return GateResult("Waiting", "Staging", f"waiting for node agents to stage {digest}")
        if seen.target_nodes == 0:
            return GateResult(
                "Waiting", "NoTargetNodes", "no node matches spec.prefetch.nodeSelector"
            )
        message = (
            f"{seen.staged_nodes}/{seen.target_nodes} nodes staged "
            f"(need {spec.min_staged_percent}%)"
        )
        if seen.staged_nodes * 100 >= spec.min_staged_percent * seen.target_nodes:
            return GateResult("Passed", "Staged", message)
        failed = failed_nodes(seen)  # a full disk, an unreachable origin: named, and waited on
        return GateResult("Waiting", "Staging", f"{message}; {failed}" if failed else message)


@dataclass(frozen=True)
class VerifiedGate:
    """The canary has its desired pods available, each with weights-verified True."""

    name: str = "verified"

    def evaluate(self, gate_input: GateInput) -> GateResult:
        threshold = gate_input.rollout.spec.validation.failure_threshold
        replica_set = gate_input.observed.replica_set(gate_input.canary.pod_template_hash)
        failures = replica_set.failed if replica_set is not None else ()
        if len(failures) >= threshold:
            first = failures[0]
            return GateResult(
                "Failed",
                "VerificationFailed",
                f"{len(failures)} canary pod(s) failed verification; {first.pod}: "
                f"{first.reason}: {first.message}".rstrip(": "),
            )
        desired = gate_input.desired_canary_replicas
        verified = 0 if replica_set is None else min(replica_set.available, replica_set.verified)
        message = f"{verified}/{desired} canary pods available and verified"
        if verified >= desired:
            return GateResult("Passed", "Verified", message)
        return GateResult("Waiting", "WaitingForVerifiedReplicas", message)


@dataclass(frozen=True)
class AnalysisGate:
    """The current analysis step's metrics passed (see weightship.core.analysis)."""

    name: str = "analysis"

    def evaluate(self, gate_input: GateInput) -> GateResult:
        analysis = gate_input.analysis
        if analysis is None or analysis.phase == "Running":
            return GateResult("Waiting", "AnalysisRunning", "measuring canary metrics")
        message = analysis.message or f"analysis {analysis.phase.lower()}"
        if analysis.phase == "Successful":
            return GateResult("Passed", "AnalysisSuccessful", message)
        if analysis.phase == "Inconclusive":
            return GateResult("Inconclusive", "InconclusiveAnalysis", message)
        return GateResult("Failed", "AnalysisFailed", message)


@dataclass(frozen=True)
class AlwaysPassGate:
    """For tests and dry runs."""

    name: str = "always-pass"

    def evaluate(self, gate_input: GateInput) -> GateResult:
        return GateResult("Passed", "AlwaysPass", "gate disabled")


GATES: dict[str, Gate] = {
    gate.name: gate for gate in (PrefetchedGate(), VerifiedGate(), AnalysisGate(), AlwaysPassGate())
}


def register_gate(gate: Gate) -> None:
    GATES[gate.name] = gate


@dataclass(frozen=True)
class GateSet:
    """The gate used at each point of the flow."""

    prefetched: Gate
    verified: Gate
    analysis: Gate

    @classmethod
    def from_registry(
        cls, prefetched: str = "prefetched", verified: str = "verified", analysis: str = "analysis"
    ) -> GateSet:
        return cls(GATES[prefetched], GATES[verified], GATES[analysis])


DEFAULT_GATES = GateSet.from_registry()
ALWAYS_PASS_GATES = GateSet.from_registry("always-pass", "always-pass", "always-pass")
