"""One reconcile's working state, shared by the concern modules (steps, pause, analysis,
abort, projection, scaling), like Argo Rollouts' rolloutContext: the rollout, the fresh
observations, the status being built, and what the reconcile has to say so far.

Only status bookkeeping lives here (conditions, phase, history, notifications, timers);
every rollout decision is in the module of its concern.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from weightship.api.models import ModelRollout
from weightship.api.spec import CanaryStep, NotificationEvent
from weightship.api.status import (
    MAX_HISTORY,
    ConditionStatus,
    ConditionType,
    HistoryEntry,
    HistoryOutcome,
    ModelRolloutStatus,
    PromoteMode,
    RevisionStatus,
)
from weightship.core.conditions import set_condition
from weightship.core.decision import Event, Notification
from weightship.core.gates import GateInput, GateSet
from weightship.core.observed import Observed, ReplicaSetObservation

POLL_SECONDS = 15.0
"""Re-check this often while waiting on observations (watches usually come sooner)."""


def ceil_seconds(delta: timedelta) -> float:
    return max(0.0, delta.total_seconds())


@dataclass
class RolloutContext:
    rollout: ModelRollout
    observed: Observed
    now: datetime
    gates: GateSet
    status: ModelRolloutStatus = field(init=False)
    events: list[Event] = field(default_factory=list)
    notifications: list[Notification] = field(default_factory=list)
    timers: list[float] = field(default_factory=list)
    promote: PromoteMode | None = None
    """A pending promote request, acknowledged this reconcile (None once handled)."""
    abort_reason: str | None = None
    """A pending abort request's reason."""
    retry: bool = False
    invalid: bool = False
    """The spec or its manifest is unusable: no ReplicaSet actions this time."""
    desired: RevisionStatus | None = None
    """The revision the spec asks for (None while the spec is invalid)."""
    in_place: ReplicaSetObservation | None = None
    """The in-place ReplicaSet whose pods swap weights to reach the wanted counts (None:
    ReplicaSets are resized as usual); see core.inplace."""

    def __post_init__(self) -> None:
        self.status = self.rollout.status.model_copy(deep=True)
        self.spec = self.rollout.spec
        self.steps: list[CanaryStep] = self.spec.strategy.canary.steps
        self.generation = self.rollout.metadata.generation

    # --- inputs to gates ------------------------------------------------------------------------

    def gate_input(self, desired_canary: int) -> GateInput:
        assert self.status.canary_revision is not None
        return GateInput(
            self.rollout,
            self.observed,
            self.status.canary_revision,
            desired_canary,
            self.status.analysis,
        )

    def step_label(self, index: int) -> str:
        return f"step {index + 1}/{len(self.steps)}"

    # --- status bookkeeping ---------------------------------------------------------------------

    def condition(
        self, type_: ConditionType, status: ConditionStatus, reason: str, message: str
    ) -> None:
        self.status.conditions = set_condition(
            self.status.conditions,
            type_,
            status,
            reason,
            message,
            now=self.now,
            generation=self.generation,
        )

    def progressing(self, reason: str, message: str) -> None:
        self.status.phase = "Progressing"
        self.status.message = message
        self.condition("Progressing", "True", reason, message)
        self.condition("Paused", "False", "NotPaused", "")
        self.condition("Aborted", "False", "NotAborted", "")

    def paused(self, reason: str, message: str) -> None:
        self.status.phase = "Paused"
        self.status.message = message
        self.condition("Progressing", "Unknown", "RolloutPaused", message)
        self.condition("Paused", "True", reason, message)
        self.condition("Aborted", "False", "NotAborted", "")

    def settled(self, message: str) -> None:
        self.status.phase = "Healthy"
        self.status.message = message
        self.condition("Progressing", "True", "RolloutCompleted", message)
        self.condition("Paused", "False", "NotPaused", "")
        self.condition("Aborted", "False", "NotAborted", "")

    def clear_canary(self) -> None:
        status = self.status
        status.canary_revision = None
        status.abort = None
        status.analysis = None
        status.pause_start_time = None
        status.step_start_time = None

    def advance(self, index: int, completed: str | None = None) -> None:
        """Step `index` is done: the next one starts now (and runs at once)."""
        status = self.status
        status.current_step_index = index + 1
        status.step_start_time = self.now
        status.pause_start_time = None
        self.timers.append(0.0)
        if completed is not None:
            message = f"step {index + 1}/{len(self.steps)} completed: {completed}"
            self.events.append(Event("Normal", "StepCompleted", message))
            self.notify("StepCompleted", "StepCompleted", message)
            self.progressing("StepCompleted", message)

    def history(
        self, revision: RevisionStatus, outcome: HistoryOutcome, reason: str, message: str
    ) -> None:
        entry = HistoryEntry(
            revision=revision.revision,
            manifest_digest=revision.manifest_digest,
            pod_template_hash=revision.pod_template_hash,
            outcome=outcome,
            at=self.now,
            reason=reason,
            message=message[:1024],
        )
        self.status.history = [*self.status.history, entry][-MAX_HISTORY:]

    def notify(
        self,
        event: NotificationEvent,
        reason: str,
        message: str,
        extra: tuple[tuple[str, str], ...] = (),
    ) -> None:
        notifications = self.spec.notifications
        slack = notifications.slack if notifications is not None else None
        if slack is None or event not in slack.events:
            return
        status = self.status
        meta = self.rollout.metadata
        details = {
            "rollout": f"{meta.namespace}/{meta.name}",
            "canary": status.canary_revision.revision if status.canary_revision else "",
            "stable": status.stable_revision.revision if status.stable_revision else "",
            "step": f"{status.current_step_index or 0}/{len(self.steps)}",
            "weight": f"{status.canary_weight}%",
        }
        canary_rs = self.observed.replica_set(
            status.canary_revision.pod_template_hash if status.canary_revision else None
        )
        failed = next((f for f in canary_rs.failed if f.prompt), None) if canary_rs else None
        if failed is not None:
            details |= {
                "golden prompt": failed.prompt or "",
                "expected": failed.expected or "",
                "got": failed.got or "",
            }
        details |= dict(extra)
        self.notifications.append(Notification(event, reason, message, tuple(details.items())))
