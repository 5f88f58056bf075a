"""decide(rollout, observed, now) -> Decision: the whole rollout state machine, purely.

Modelled on Argo Rollouts' rolloutContext: every call rebuilds the picture from the spec,
the status (the controller's only memory) and fresh observations, makes at most one step
transition, and returns the new status with the actions that go with it. Calling it twice
on the same inputs gives the same Decision, and since a completed step is recorded in
status.currentStepIndex in the same patch that acts on it, no step ever runs twice.

Flow of a new revision: Prefetching → canary steps (setWeight / pause / analysis) →
promotion (canary becomes stable, old stable retires) → Healthy. Any failed gate, metric,
deadline or a manual abort leads to a capacity-safe abort → Degraded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from weightship.api.models import ModelRollout
from weightship.api.spec import CanaryStep, Metric, NotificationEvent, PauseStep
from weightship.api.status import (
    MAX_HISTORY,
    MAX_POD_LOADS,
    MAX_PREFETCH_NODES,
    MAX_VERIFICATION_FAILURES,
    AbortStatus,
    ConditionStatus,
    ConditionType,
    HistoryEntry,
    HistoryOutcome,
    ModelRolloutStatus,
    PodLoad,
    PodVerificationFailure,
    PrefetchNodeStatus,
    PrefetchStatus,
    PromoteMode,
    ReplicaStatus,
    RetiringRevision,
    RevisionStatus,
    VerificationStatus,
)
from weightship.core.analysis import (
    apply_measurements,
    next_measurement_at,
    start_analysis,
    step_metrics,
)
from weightship.core.conditions import set_condition
from weightship.core.decision import (
    Decision,
    Event,
    Notification,
    ReplicaSetRole,
    ScaleAction,
    TrafficWeights,
)
from weightship.core.durations import parse_duration
from weightship.core.gates import DEFAULT_GATES, GateInput, GateResult, GateSet
from weightship.core.observed import Observed
from weightship.core.replicas import canary_replicas, weight_at_step
from weightship.core.revision import revision_hash

POLL_SECONDS = 15.0
"""Re-check this often while waiting on observations (watches usually come sooner)."""
INVALID_SPEC_RETRY_SECONDS = 60.0
"""S3 is not watched: look for a missing manifest again this often."""


def decide(
    rollout: ModelRollout, observed: Observed, now: datetime, gates: GateSet = DEFAULT_GATES
) -> Decision:
    run = _Reconcile(rollout, observed, now, gates)
    run.reconcile()
    return run.decision()


def decide_invalid_spec(
    status: ModelRolloutStatus, generation: int, message: str, now: datetime
) -> Decision:
    """For objects the models cannot parse: report InvalidSpec and change nothing else."""
    new = status.model_copy(deep=True)
    events = _mark_invalid(new, generation, "ValidationFailed", message, now)
    return Decision(status=new, events=tuple(events), requeue_after=None)


def _mark_invalid(
    status: ModelRolloutStatus, generation: int, reason: str, message: str, now: datetime
) -> list[Event]:
    previous = status.condition("InvalidSpec")
    status.observed_generation = generation
    status.phase = "Degraded"
    status.message = message
    status.conditions = set_condition(
        status.conditions, "InvalidSpec", "True", reason, message, now=now, generation=generation
    )
    status.conditions = set_condition(
        status.conditions,
        "Progressing",
        "False",
        "InvalidSpec",
        message,
        now=now,
        generation=generation,
    )
    if previous is not None and previous.status == "True" and previous.message == message:
        return []
    return [Event("Warning", "InvalidSpec", message)]


def _ceil_seconds(delta: timedelta) -> float:
    return max(0.0, delta.total_seconds())


@dataclass
class _Reconcile:
    rollout: ModelRollout
    observed: Observed
    now: datetime
    gates: GateSet
    status: ModelRolloutStatus = field(init=False)
    events: list[Event] = field(default_factory=list)
    notifications: list[Notification] = field(default_factory=list)
    timers: list[float] = field(default_factory=list)
    promote: PromoteMode | None = None
    abort_reason: str | None = None
    retry: bool = False
    invalid: bool = False

    def __post_init__(self) -> None:
        self.status = self.rollout.status.model_copy(deep=True)
        self.spec = self.rollout.spec
        self.steps: list[CanaryStep] = self.spec.strategy.canary.steps
        self.generation = self.rollout.metadata.generation

    # --- top level -------------------------------------------------------------------------

    def reconcile(self) -> None:
        self.status.observed_generation = self.generation
        self._acknowledge_control()
        desired = self._desired_revision()
        if desired is None:
            return
        self._condition("InvalidSpec", "False", "Valid", "spec and manifest are valid")
        stable = self.status.stable_revision
        if stable is not None and desired.pod_template_hash == stable.pod_template_hash:
            self._steady(stable)
        else:
            self._canary(desired)
        self._retire()

    def decision(self) -> Decision:
        if not self.invalid:
            self._observe_replicas()
        # Every condition was (re)considered against this generation.
        self.status.conditions = [
            c.model_copy(update={"observed_generation": self.generation})
            for c in self.status.conditions
        ]
        return Decision(
            status=self.status,
            scales=() if self.invalid else self._scales(),
            events=tuple(self.events),
            notifications=tuple(self.notifications),
            traffic=self._traffic(),
            pin_digests=self._pins(),
            requeue_after=min(self.timers) if self.timers else None,
        )

    # --- spec → desired revision ----------------------------------------------------------------

    def _desired_revision(self) -> RevisionStatus | None:
        model = self.spec.model
        uri = model.source.uri
        manifest = self.observed.manifest
        if manifest.digest is None:
            detail = manifest.error or "not found"
            self._invalid(
                "ManifestUnavailable",
                f"weights manifest for {uri} is unavailable ({detail}); write it with "
                f"`weightship manifest {uri}`",
            )
            return None
        if model.manifest_digest is not None and model.manifest_digest != manifest.digest:
            self._invalid(
                "ManifestDigestMismatch",
                f"manifest at {uri} has digest {manifest.digest} but spec.model.manifestDigest "
                f"pins {model.manifest_digest}; re-run `weightship manifest {uri}` or update "
                "the pin",
            )
            return None
        template: Any
        if self.spec.template is not None:
            template = self.spec.template.to_k8s()
        else:
            template = self.observed.workload_template
            if template is None:
                ref = self.spec.workload_ref
                name = ref.name if ref is not None else "?"
                self._invalid(
                    "WorkloadNotFound", f"Deployment {name} named by spec.workloadRef not found"
                )
                return None
        return RevisionStatus(
            revision=model.revision,
            manifest_digest=manifest.digest,
            pod_template_hash=revision_hash(
                template,
                model_uri=uri,
                model_revision=model.revision,
                manifest_digest=manifest.digest,
            ),
        )

    def _invalid(self, reason: str, message: str) -> None:
        self.invalid = True
        events = _mark_invalid(self.status, self.generation, reason, message, self.now)
        if events:
            self.events += events
            self._notify("Failed", reason, message)
        self.timers.append(INVALID_SPEC_RETRY_SECONDS)

    # --- imperative requests -----------------------------------------------------------------

    def _acknowledge_control(self) -> None:
        control = self.status.control
        if control is None:
            return
        if control.promote is not None and control.promote.pending:
            self.promote = control.promote.mode
            control.promote.acknowledged = control.promote.requested_at
        if control.abort is not None and control.abort.pending:
            by = control.abort.requested_by
            self.abort_reason = control.abort.reason or (
                f"requested by {by}" if by else "requested by user"
            )
            control.abort.acknowledged = control.abort.requested_at
        if control.retry is not None and control.retry.pending:
            self.retry = True
            control.retry.acknowledged = control.retry.requested_at

    def _ignore_requests(self, why: str) -> None:
        for name, pending in (
            ("promote", self.promote is not None),
            ("abort", self.abort_reason is not None),
            ("retry", self.retry),
        ):
            if pending:
                self.events.append(Event("Normal", "RequestIgnored", f"{name} ignored: {why}"))
        self.promote, self.abort_reason, self.retry = None, None, False

    # --- no canary wanted ---------------------------------------------------------------------

    def _steady(self, stable: RevisionStatus) -> None:
        canary = self.status.canary_revision
        if canary is not None:
            if self.status.abort is None:
                message = (
                    f"spec went back to stable {stable.revision}; canary {canary.revision} "
                    "dropped (stable kept full size throughout)"
                )
                self._history(canary, "RolledBack", "RevertedToStable", message)
                self.events.append(Event("Normal", "RevertedToStable", message))
                self._notify("RolledBack", "RevertedToStable", message)
            self._clear_canary()
        self._ignore_requests("no canary in progress")
        self.status.current_step_index = len(self.steps)
        self.status.canary_weight = 100
        stable_rs = self.observed.replica_set(stable.pod_template_hash)
        available = stable_rs.available if stable_rs is not None else 0
        if available >= self.spec.replicas:
            self._settled(f"{stable.revision} serving on {available} replicas")
        else:
            self._progressing(
                "ReplicaSetUpdated",
                f"stable {stable.revision}: {available}/{self.spec.replicas} replicas available",
            )
            self.timers.append(POLL_SECONDS)

    def _clear_canary(self) -> None:
        status = self.status
        status.canary_revision = None
        status.abort = None
        status.analysis = None
        status.pause_start_time = None
        status.step_start_time = None

    # --- canary ---------------------------------------------------------------------------------

    def _canary(self, desired: RevisionStatus) -> None:
        canary = self.status.canary_revision
        if canary is None or canary.pod_template_hash != desired.pod_template_hash:
            self._start_canary(desired, canary)
        if self.status.abort is not None:
            if self.retry:
                self._retry()
            else:
                self._ignore_requests("the canary is aborted; retry or change spec")
                self._aborted()
                return
        if self.abort_reason is not None:
            self._abort("ManualAbort", self.abort_reason, outcome="Aborted")
            return
        if self._prefetched():
            self._step()

    def _start_canary(self, desired: RevisionStatus, previous: RevisionStatus | None) -> None:
        if previous is not None:
            self.events.append(
                Event(
                    "Normal",
                    "Superseded",
                    f"canary {previous.revision} superseded by {desired.revision}",
                )
            )
        self._clear_canary()
        status = self.status
        status.canary_revision = desired
        status.current_step_index = 0 if status.stable_revision is not None else len(self.steps)
        status.canary_weight = 0
        status.step_start_time = self.now
        status.prefetch = None
        self.retry = False
        first = " (first revision: steps skipped)" if status.stable_revision is None else ""
        self.events.append(
            Event(
                "Normal",
                "NewRevision",
                f"new revision {desired.revision} ({desired.manifest_digest}){first}",
            )
        )

    def _retry(self) -> None:
        status = self.status
        status.abort = None
        status.analysis = None
        status.pause_start_time = None
        status.canary_weight = 0
        status.current_step_index = 0 if status.stable_revision is not None else len(self.steps)
        status.step_start_time = self.now
        self.retry = False
        revision = status.canary_revision.revision if status.canary_revision else "?"
        self.events.append(Event("Normal", "Retry", f"retrying canary {revision} from step 1"))

    def _gate_input(self, desired_canary: int) -> GateInput:
        assert self.status.canary_revision is not None
        return GateInput(
            self.rollout,
            self.observed,
            self.status.canary_revision,
            desired_canary,
            self.status.analysis,
        )

    def _prefetched(self) -> bool:
        status = self.status
        canary = status.canary_revision
        assert canary is not None
        if self._prefetch_done():
            return True
        result = self.gates.prefetched.evaluate(self._gate_input(0))
        self._condition(
            "Prefetched", "True" if result.passed else "False", result.reason, result.message
        )
        if status.prefetch is None or status.prefetch.manifest_digest != canary.manifest_digest:
            status.prefetch = PrefetchStatus(manifest_digest=canary.manifest_digest)
        if result.passed:
            self.events.append(Event("Normal", "Prefetched", result.message))
            status.step_start_time = self.now
            return True
        if self.promote is not None:
            # Steps have not started: say so rather than drop the request silently.
            self.events.append(
                Event(
                    "Normal", "RequestIgnored", "promote ignored: the canary is still prefetching"
                )
            )
            self.promote = None
        if not self._deadline_exceeded("prefetch"):
            self._progressing("Prefetching", f"prefetching {canary.revision}: {result.message}")
            self.status.phase = "Prefetching"
        return False

    def _prefetch_done(self) -> bool:
        prefetch, canary = self.status.prefetch, self.status.canary_revision
        condition = self.status.condition("Prefetched")
        return (
            prefetch is not None
            and canary is not None
            and prefetch.manifest_digest == canary.manifest_digest
            and condition is not None
            and condition.status == "True"
        )

    def _step(self) -> None:
        index = self.status.current_step_index or 0
        if self.promote == "Full" and index < len(self.steps):
            self.events.append(
                Event("Normal", "PromotedFull", "remaining steps skipped by promote")
            )
            self.status.current_step_index = index = len(self.steps)
            self.status.pause_start_time = None
            self.status.step_start_time = self.now
        elif self.promote is not None and index < len(self.steps):
            self.events.append(
                Event("Normal", "StepPromoted", f"step {index + 1} skipped by promote")
            )
            self._advance(index)
            self._progressing("StepPromoted", f"step {index + 1}/{len(self.steps)} promoted")
            return
        self.promote = None
        if index >= len(self.steps):
            self._final()
            return
        step = self.steps[index]
        if step.set_weight is not None:
            self._set_weight(index, step.set_weight)
        elif step.pause is not None:
            self._pause(index, step.pause)
        else:
            self._analysis(index, step)

    def _advance(self, index: int, completed: str | None = None) -> None:
        status = self.status
        status.current_step_index = index + 1
        status.step_start_time = self.now
        status.pause_start_time = None
        self.timers.append(0.0)
        if completed is not None:
            message = f"step {index + 1}/{len(self.steps)} completed: {completed}"
            self.events.append(Event("Normal", "StepCompleted", message))
            self._notify("StepCompleted", "StepCompleted", message)
            self._progressing("StepCompleted", message)

    def _step_label(self, index: int) -> str:
        return f"step {index + 1}/{len(self.steps)}"

    def _verify(self, desired: int, label: str) -> GateResult | None:
        """Run the verified gate; None when it aborted or is still waiting."""
        result = self.gates.verified.evaluate(self._gate_input(desired))
        self._seeded_condition(desired)
        self._condition(
            "Verified", "True" if result.passed else "False", result.reason, result.message
        )
        if result.status == "Failed":
            self._abort(result.reason, result.message)
            return None
        if not result.passed:
            if not self._deadline_exceeded(label):
                self._progressing(result.reason, f"{label}: {result.message}")
            return None
        return result

    def _set_weight(self, index: int, weight: int) -> None:
        label = f"{self._step_label(index)} setWeight {weight}"
        if self._verify(canary_replicas(self.spec.replicas, weight), label) is not None:
            self.status.canary_weight = weight
            self._advance(index, f"setWeight {weight}")

    def _pause(self, index: int, pause: PauseStep) -> None:
        status = self.status
        if status.pause_start_time is None:
            status.pause_start_time = self.now
            how = f"for {pause.duration}" if pause.duration else "until promoted"
            message = f"{self._step_label(index)}: paused {how}"
            self.events.append(Event("Normal", "Paused", message))
            self._notify("Paused", "PausedByStep", message)
        if pause.duration is None:
            self._paused(
                "PausedByStep",
                f"{self._step_label(index)}: paused until `weightship promote`",
            )
            return
        resume_at = status.pause_start_time + parse_duration(pause.duration)
        if self.now >= resume_at:
            self._advance(index, f"pause {pause.duration}")
            return
        self._paused(
            "PausedByStep",
            f"{self._step_label(index)}: paused for {pause.duration}, "
            f"resumes at {resume_at.isoformat()}",
        )
        self.timers.append(_ceil_seconds(resume_at - self.now))

    def _analysis(self, index: int, step: CanaryStep) -> None:
        status = self.status
        canary = status.canary_revision
        assert canary is not None
        metrics = step_metrics(self.rollout, step)
        analysis = status.analysis
        if (
            analysis is None
            or analysis.step_index != index
            or analysis.pod_template_hash != canary.pod_template_hash
        ):
            analysis = start_analysis(index, canary.pod_template_hash, metrics, self.now)
        status.analysis = apply_measurements(analysis, metrics, self.observed.measurements)
        result = self.gates.analysis.evaluate(self._gate_input(0))
        label = f"{self._step_label(index)} analysis"
        if result.passed:
            self.events.append(Event("Normal", "AnalysisSuccessful", f"{label}: {result.message}"))
            self._advance(index, "analysis")
        elif result.status == "Failed":
            self._abort("AnalysisFailed", result.message)
        elif result.status == "Inconclusive":
            if status.pause_start_time is None:
                status.pause_start_time = self.now
                self.events.append(Event("Warning", "InconclusiveAnalysis", result.message))
                self._notify("Paused", "InconclusiveAnalysis", result.message)
            self._paused("InconclusiveAnalysis", f"{label} inconclusive: {result.message}")
            # An unreachable provider is still polled: the step resumes when it answers.
            self._measurement_timer(metrics, fallback=None)
        else:
            if status.pause_start_time is not None:
                # Queries succeed again after an unreachable spell: carry on measuring.
                status.pause_start_time = None
                self.events.append(
                    Event("Normal", "AnalysisResumed", f"{label}: queries succeed again; measuring")
                )
            self._progressing("AnalysisRunning", f"{label}: measuring")
            self._measurement_timer(metrics, fallback=POLL_SECONDS)

    def _measurement_timer(self, metrics: list[Metric], fallback: float | None) -> None:
        analysis = self.status.analysis
        assert analysis is not None
        by_name = {m.name: m for m in metrics}
        due = [
            next_measurement_at(run, by_name[run.metric], analysis.started_at)
            for run in analysis.runs
            if run.metric in by_name
        ]
        pending = [_ceil_seconds(at - self.now) for at in due if at is not None]
        if pending or fallback is not None:
            self.timers.append(min(pending, default=fallback or POLL_SECONDS))

    def _final(self) -> None:
        label = "promoting" if self.status.stable_revision is not None else "first deployment"
        if self._verify(self.spec.replicas, label) is not None:
            self._promote()

    def _promote(self) -> None:
        status = self.status
        canary, old = status.canary_revision, status.stable_revision
        assert canary is not None
        reason = "AllStepsCompleted" if old is not None else "FirstRevision"
        message = f"{canary.revision} promoted to stable" + (
            f" (was {old.revision})" if old is not None else ""
        )
        self._history(canary, "Promoted", reason, message)
        self.events.append(Event("Normal", "Promoted", message))
        self._notify("Promoted", reason, message)
        strategy = self.spec.strategy.canary
        delay = strategy.scale_down_delay_seconds if strategy.uses_gateway_api else 0
        if old is not None and delay > 0:
            status.retiring = RetiringRevision(
                **old.model_dump(), scale_down_at=self.now + timedelta(seconds=delay)
            )
        status.stable_revision = canary
        self._clear_canary()
        status.canary_weight = 100
        status.current_step_index = len(self.steps)
        self._settled(message)
        self.timers.append(0.0)

    # --- abort ----------------------------------------------------------------------------------

    def _deadline_exceeded(self, what: str) -> bool:
        seconds = self.spec.strategy.canary.progress_deadline_seconds
        deadline = (self.status.step_start_time or self.now) + timedelta(seconds=seconds)
        if self.now >= deadline:
            self._abort(
                "ProgressDeadlineExceeded",
                f"{what} made no progress within progressDeadlineSeconds ({seconds}s)",
            )
            return True
        self.timers.append(min(POLL_SECONDS, _ceil_seconds(deadline - self.now)))
        return False

    def _abort(self, reason: str, message: str, outcome: HistoryOutcome = "RolledBack") -> None:
        status = self.status
        canary = status.canary_revision
        assert canary is not None
        status.abort = AbortStatus(
            reason=reason,
            message=message,
            aborted_at=self.now,
            pod_template_hash=canary.pod_template_hash,
        )
        status.canary_weight = 0
        status.pause_start_time = None
        self._history(canary, outcome, reason, message)
        back_to = status.stable_revision.revision if status.stable_revision else "nothing"
        story = f"canary {canary.revision} aborted ({reason}): {message}; back to {back_to}"
        self.events.append(Event("Warning", reason, story))
        self._notify("RolledBack", reason, story)
        self._aborted()

    def _aborted(self) -> None:
        """Capacity-safe: stable is full size and Ready before the canary scales down."""
        status = self.status
        abort = status.abort
        assert abort is not None
        stable = status.stable_revision
        stable_rs = self.observed.replica_set(stable.pod_template_hash) if stable else None
        stable_ready = stable is None or (
            stable_rs is not None and stable_rs.available >= self.spec.replicas
        )
        delay = timedelta(seconds=self.spec.strategy.canary.abort_scale_down_delay_seconds)
        if abort.canary_scale_down_at is None and stable_ready:
            abort.canary_scale_down_at = self.now + delay
        if abort.canary_scale_down_at is None:
            waiting = "waiting for stable to be Ready before scaling the canary down"
            self.timers.append(POLL_SECONDS)
        elif self.now < abort.canary_scale_down_at:
            waiting = f"canary scales down at {abort.canary_scale_down_at.isoformat()}"
            self.timers.append(_ceil_seconds(abort.canary_scale_down_at - self.now))
        else:
            waiting = "canary scaled down"
        message = f"aborted ({abort.reason}): {abort.message}; {waiting}"
        status.phase = "Degraded"
        status.message = message
        progressing_reason = (
            "ProgressDeadlineExceeded"
            if abort.reason == "ProgressDeadlineExceeded"
            else "RolloutAborted"
        )
        self._condition("Progressing", "False", progressing_reason, message)
        self._condition("Paused", "False", "NotPaused", "")
        self._condition("Aborted", "True", abort.reason, abort.message)

    # --- retiring old stable ----------------------------------------------------------------------

    def _retire(self) -> None:
        retiring = self.status.retiring
        if retiring is None:
            return
        if self.now >= retiring.scale_down_at:
            self.status.retiring = None
        else:
            self.timers.append(_ceil_seconds(retiring.scale_down_at - self.now))

    # --- status helpers ---------------------------------------------------------------------------

    def _condition(
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

    def _progressing(self, reason: str, message: str) -> None:
        self.status.phase = "Progressing"
        self.status.message = message
        self._condition("Progressing", "True", reason, message)
        self._condition("Paused", "False", "NotPaused", "")
        self._condition("Aborted", "False", "NotAborted", "")

    def _paused(self, reason: str, message: str) -> None:
        self.status.phase = "Paused"
        self.status.message = message
        self._condition("Progressing", "Unknown", "RolloutPaused", message)
        self._condition("Paused", "True", reason, message)
        self._condition("Aborted", "False", "NotAborted", "")

    def _settled(self, message: str) -> None:
        self.status.phase = "Healthy"
        self.status.message = message
        self._condition("Progressing", "True", "RolloutCompleted", message)
        self._condition("Paused", "False", "NotPaused", "")
        self._condition("Aborted", "False", "NotAborted", "")

    def _seeded_condition(self, desired: int) -> None:
        canary = self.status.canary_revision
        replica_set = self.observed.replica_set(canary.pod_template_hash if canary else None)
        seeded = replica_set.seeded if replica_set is not None else 0
        message = f"{seeded}/{desired} canary pods loaded their weights"
        if seeded >= desired:
            self._condition("Seeded", "True", "WeightsLoaded", message)
        else:
            self._condition("Seeded", "False", "Loading", message)

    def _history(
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

    def _notify(self, event: NotificationEvent, reason: str, message: str) -> None:
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
        self.notifications.append(Notification(event, reason, message, tuple(details.items())))

    # --- derived outputs --------------------------------------------------------------------------

    def _canary_target(self) -> int:
        status = self.status
        canary = status.canary_revision
        if canary is None:
            return 0
        if status.abort is not None:
            scale_down_at = status.abort.canary_scale_down_at
            if scale_down_at is not None and self.now >= scale_down_at:
                return 0
            current = self.observed.replica_set(canary.pod_template_hash)
            return current.replicas if current is not None else 0
        if not self._prefetch_done():
            return 0
        return canary_replicas(
            self.spec.replicas, weight_at_step(self.steps, status.current_step_index or 0)
        )

    def _scales(self) -> tuple[ScaleAction, ...]:
        status = self.status
        targets: dict[str, tuple[ReplicaSetRole, int]] = {}
        for replica_set in self.observed.replica_sets:
            targets[replica_set.revision_hash] = ("obsolete", 0)
        if status.retiring is not None:
            targets[status.retiring.pod_template_hash] = ("retiring", self.spec.replicas)
        if status.canary_revision is not None:
            targets[status.canary_revision.pod_template_hash] = ("canary", self._canary_target())
        if status.stable_revision is not None:
            targets[status.stable_revision.pod_template_hash] = ("stable", self.spec.replicas)
        actions = []
        for revision, (role, replicas) in sorted(targets.items()):
            current = self.observed.replica_set(revision)
            if current is None and replicas > 0:
                actions.append(ScaleAction(revision, role, replicas, create=True))
            elif current is not None and current.replicas != replicas:
                actions.append(ScaleAction(revision, role, replicas, name=current.name))
        return tuple(actions)

    def _traffic(self) -> TrafficWeights | None:
        status = self.status
        if self.invalid or not self.spec.strategy.canary.uses_gateway_api:
            return None
        canary = status.canary_revision
        weight = status.canary_weight if canary is not None and status.abort is None else 0
        stable = status.stable_revision
        return TrafficWeights(
            stable=100 - weight,
            canary=weight,
            stable_hash=stable.pod_template_hash if stable else None,
            canary_hash=canary.pod_template_hash if canary else None,
        )

    def _pins(self) -> tuple[str, ...]:
        status = self.status
        revisions = (status.canary_revision, status.stable_revision, status.retiring)
        digests = [r.manifest_digest for r in revisions if r is not None and r.manifest_digest]
        return tuple(dict.fromkeys(digests))

    def _observe_verification(self) -> None:
        """Failures and loads of the canary's pods, or of the stable's when there is no
        canary (so who seeded whom stays visible after a promotion). Pods come and go (an
        abort deletes them): records of the same revision are kept until another starts."""
        status = self.status
        canary = status.canary_revision or status.stable_revision
        if canary is None:
            status.verification = None
            return
        replica_set = self.observed.replica_set(canary.pod_template_hash)
        old = status.verification
        if old is None or old.pod_template_hash != canary.pod_template_hash:
            old = VerificationStatus(pod_template_hash=canary.pod_template_hash)
        failures = {f.pod: f for f in old.failures}
        loads = {load.pod: load for load in old.loads}
        if replica_set is not None:
            for f in replica_set.failed:
                failures[f.pod] = PodVerificationFailure(
                    pod=f.pod,
                    reason=f.reason,
                    message=f.message[:1024],
                    prompt=f.prompt,
                    expected=f.expected and f.expected[:1024],
                    got=f.got and f.got[:1024],
                )
            for load in replica_set.loads:
                loads[load.pod] = PodLoad(
                    pod=load.pod,
                    source=load.source,
                    seeded_from=load.seeded_from,
                    seconds=load.seconds,
                )
        status.verification = VerificationStatus(
            pod_template_hash=canary.pod_template_hash,
            verified=replica_set.verified if replica_set is not None else 0,
            failures=[failures[k] for k in sorted(failures)][:MAX_VERIFICATION_FAILURES],
            loads=[loads[k] for k in sorted(loads)][-MAX_POD_LOADS:],
        )

    def _observe_replicas(self) -> None:
        status = self.status
        stable = self.observed.replica_set(
            status.stable_revision.pod_template_hash if status.stable_revision else None
        )
        canary = self.observed.replica_set(
            status.canary_revision.pod_template_hash if status.canary_revision else None
        )
        present = [rs for rs in (stable, canary) if rs is not None]
        status.replicas = ReplicaStatus(
            stable=stable.replicas if stable else 0,
            canary=canary.replicas if canary else 0,
            ready=sum(rs.ready for rs in present),
            verified=sum(rs.verified for rs in present),
        )
        self._observe_verification()
        seen = self.observed.prefetch
        prefetch = status.prefetch
        if seen is not None and prefetch is not None and seen.digest == prefetch.manifest_digest:
            pending = sorted(
                (n for n in seen.nodes if n.state != "Staged"),
                key=lambda n: (n.state != "Failed", n.name),
            )[:MAX_PREFETCH_NODES]
            status.prefetch = PrefetchStatus(
                manifest_digest=seen.digest,
                staged_nodes=seen.staged_nodes,
                target_nodes=seen.target_nodes,
                bytes_staged=seen.bytes_staged,
                bytes_total=seen.bytes_total,
                nodes=[
                    PrefetchNodeStatus(
                        name=n.name,
                        state=n.state,
                        bytes_done=n.bytes_done,
                        bytes_total=n.bytes_total,
                        message=n.message,
                    )
                    for n in pending
                ],
            )
