"""Table-driven tests of the rollout state machine, one transition at a time."""

from __future__ import annotations

from typing import Any

import pytest

from weightship.api.models import ModelRollout
from weightship.api.status import AbortRequest, ControlRequest, ControlStatus, PromoteRequest
from weightship.core.decide import decide, decide_invalid_spec
from weightship.core.decision import CreateReplicaSet, Decision, ScaleAction
from weightship.core.gates import ALWAYS_PASS_GATES
from weightship.core.observed import ObservedMeasurement, PodFailure, PodLoad
from weightship_testing.core import (
    DIGEST_A,
    DIGEST_B,
    T0,
    at,
    healthy_rollout,
    observe,
    replica_set,
    staged,
    with_model_revision,
    with_status,
)

STEPS: list[dict[str, Any]] = [
    {"setWeight": 25},
    {"pause": {"duration": "1m"}},
    {"setWeight": 50},
    {"pause": {}},
]
ANALYSIS_STEPS: list[dict[str, Any]] = [{"setWeight": 25}, {"analysis": {}}]


def advance(rollout: ModelRollout, observed: Any, now: Any) -> tuple[ModelRollout, Decision]:
    decision = decide(rollout, observed, now)
    return with_status(rollout, decision), decision


def reasons(decision: Decision) -> list[str]:
    return [event.reason for event in decision.events]


def scales(decision: Decision) -> dict[str, int]:
    return {action.role: action.replicas for action in decision.scales}


def condition(rollout: ModelRollout, type_: Any) -> tuple[str, str]:
    found = rollout.status.condition(type_)
    assert found is not None
    return found.status, found.reason


def canary_started(
    steps: list[dict[str, Any]] = STEPS, **spec: Any
) -> tuple[ModelRollout, str, str]:
    """Stable v1 on 4 replicas; v2 (DIGEST_B) applied and already staged: step 0 running."""
    rollout, stable = healthy_rollout(steps, **spec)
    rollout = with_model_revision(rollout, "v2")
    rollout, _ = advance(
        rollout, observe(replica_set(stable, 4), digest=DIGEST_B, prefetch=staged(DIGEST_B)), at(60)
    )
    assert rollout.status.canary_revision is not None
    return rollout, stable, rollout.status.canary_revision.pod_template_hash


def seen(stable: str, canary: str | None = None, canary_replicas: int = 0, **kw: Any) -> Any:
    sets = [replica_set(stable, 4)]
    if canary is not None:
        sets.append(replica_set(canary, canary_replicas, **kw))
    return observe(*sets, digest=DIGEST_B, prefetch=staged(DIGEST_B))


def at_step(rollout: ModelRollout, index: int, **status: Any) -> ModelRollout:
    new = rollout.status.model_copy(update={"current_step_index": index, **status})
    return rollout.model_copy(update={"status": new})


def with_control(rollout: ModelRollout, **requests: Any) -> ModelRollout:
    new = rollout.status.model_copy(update={"control": ControlStatus(**requests)})
    return rollout.model_copy(update={"status": new})


# --- new revision and prefetch ------------------------------------------------


def test_first_revision_skips_steps_and_becomes_stable() -> None:
    rollout, stable = healthy_rollout(STEPS)
    assert rollout.status.stable_revision is not None
    assert rollout.status.stable_revision.pod_template_hash == stable
    assert rollout.status.current_step_index == len(STEPS)
    assert [h.reason for h in rollout.status.history] == ["FirstRevision"]


@pytest.mark.parametrize(
    ("prefetch", "phase", "prefetched", "canary_scale"),
    [
        (None, "Prefetching", ("False", "Staging"), None),
        (staged(DIGEST_B, 5, 10), "Prefetching", ("False", "Staging"), None),
        (staged(DIGEST_A, 10, 10), "Prefetching", ("False", "Staging"), None),
        (staged(DIGEST_B, 0, 0), "Prefetching", ("False", "NoTargetNodes"), None),
        # minStagedPercent is 90 in the sample: 9/10 is enough
        (staged(DIGEST_B, 9, 10), "Progressing", ("True", "Staged"), 1),
    ],
)
def test_new_revision_waits_for_prefetch(
    prefetch: Any, phase: str, prefetched: tuple[str, str], canary_scale: int | None
) -> None:
    rollout, stable = healthy_rollout(STEPS)
    rollout = with_model_revision(rollout, "v2")
    observed = observe(replica_set(stable, 4), digest=DIGEST_B, prefetch=prefetch)
    rollout, decision = advance(rollout, observed, at(60))
    assert rollout.status.phase == phase
    assert condition(rollout, "Prefetched") == prefetched
    assert "NewRevision" in reasons(decision)
    assert scales(decision).get("canary") == canary_scale
    assert rollout.status.canary_revision is not None
    assert rollout.status.canary_revision.revision == "v2"


def test_promote_while_prefetching_is_reported_not_lost_silently() -> None:
    rollout, stable = healthy_rollout(STEPS)
    rollout = with_model_revision(rollout, "v2")
    observed = observe(replica_set(stable, 4), digest=DIGEST_B, prefetch=staged(DIGEST_B, 1, 10))
    rollout, _ = advance(rollout, observed, at(60))
    rollout = with_control(rollout, promote=PromoteRequest(requested_at="t1", mode="Full"))
    rollout, decision = advance(rollout, observed, at(61))
    assert rollout.status.phase == "Prefetching"
    assert "RequestIgnored" in reasons(decision)
    assert rollout.status.control is not None and rollout.status.control.promote is not None
    assert rollout.status.control.promote.acknowledged == "t1"
    assert rollout.status.current_step_index == 0


def test_prefetch_past_deadline_aborts() -> None:
    rollout, stable = healthy_rollout(STEPS)
    rollout = with_model_revision(rollout, "v2")
    observed = observe(replica_set(stable, 4), digest=DIGEST_B, prefetch=staged(DIGEST_B, 1, 10))
    rollout, _ = advance(rollout, observed, at(60))
    rollout, _ = advance(rollout, observed, at(60 + 600))
    assert rollout.status.phase == "Degraded"
    assert rollout.status.abort is not None
    assert rollout.status.abort.reason == "ProgressDeadlineExceeded"
    assert condition(rollout, "Progressing") == ("False", "ProgressDeadlineExceeded")


def test_prefetch_disabled_and_same_digest_skip_staging() -> None:
    rollout, stable = healthy_rollout(STEPS)
    # a template-only change keeps the digest: the weights are already on every node
    template = rollout.spec.template
    assert template is not None
    labels = {**template.metadata.labels, "tier": "gold"}
    new_template = template.model_copy(
        update={"metadata": template.metadata.model_copy(update={"labels": labels})}
    )
    changed = rollout.model_copy(
        update={"spec": rollout.spec.model_copy(update={"template": new_template})}
    )
    changed, decision = advance(changed, observe(replica_set(stable, 4)), at(60))
    assert condition(changed, "Prefetched") == ("True", "AlreadyStaged")
    assert scales(decision)["canary"] == 1


# --- setWeight ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("replicas", "weight", "canary"),
    [(4, 25, 1), (4, 50, 2), (10, 1, 1), (10, 33, 4), (3, 100, 3), (5, 0, 0)],
)
def test_set_weight_scales_canary_by_ceiling_and_keeps_stable_full(
    replicas: int, weight: int, canary: int
) -> None:
    rollout, stable, _ = canary_started([{"setWeight": weight}, {"pause": {}}], replicas=replicas)
    observed = observe(replica_set(stable, replicas), digest=DIGEST_B, prefetch=staged(DIGEST_B))
    _, decision = advance(rollout, observed, at(61))
    expected = {"canary": canary} if canary else {}
    assert scales(decision) == expected  # stable already has `replicas`: no action


def test_set_weight_completes_only_when_canary_is_verified() -> None:
    rollout, stable, canary = canary_started()
    waiting, decision = advance(rollout, seen(stable, canary, 1, verified=0), at(70))
    assert waiting.status.current_step_index == 0
    assert waiting.status.canary_weight == 0
    assert condition(waiting, "Verified") == ("False", "WaitingForVerifiedReplicas")
    assert decision.requeue_after == 15.0

    done, decision = advance(rollout, seen(stable, canary, 1), at(70))
    assert done.status.current_step_index == 1
    assert done.status.canary_weight == 25
    assert "StepCompleted" in reasons(decision)
    assert decision.requeue_after == 0.0


def test_failed_verification_aborts_with_the_pod_reason() -> None:
    rollout, stable, canary = canary_started()
    failure = PodFailure("llm-x-1", "GoldenPromptFailed", "capital: got 'Lyon'")
    aborted, decision = advance(rollout, seen(stable, canary, 1, failed=(failure,)), at(70))
    assert aborted.status.phase == "Degraded"
    assert aborted.status.abort is not None
    assert aborted.status.abort.reason == "VerificationFailed"
    assert "GoldenPromptFailed" in aborted.status.message
    assert aborted.status.history[-1].outcome == "RolledBack"
    assert [n.event for n in decision.notifications] == ["RolledBack"]


def test_stuck_set_weight_hits_progress_deadline() -> None:
    rollout, stable, canary = canary_started()
    _, decision = advance(rollout, seen(stable, canary, 1, verified=0), at(60 + 599))
    assert decision.status.abort is None
    aborted, _ = advance(rollout, seen(stable, canary, 1, verified=0), at(60 + 600))
    assert aborted.status.abort is not None
    assert aborted.status.abort.reason == "ProgressDeadlineExceeded"


# --- pauses -------------------------------------------------------------------


def test_timed_pause_uses_pause_start_time_and_requeues() -> None:
    rollout, stable, canary = canary_started()
    rollout = at_step(rollout, 1)
    observed = seen(stable, canary, 1)
    paused, decision = advance(rollout, observed, at(100))
    assert paused.status.phase == "Paused"
    assert paused.status.pause_start_time == at(100)
    assert decision.requeue_after == 60.0
    assert reasons(decision) == ["Paused"]

    again, decision = advance(paused, observed, at(130))
    assert again.status.pause_start_time == at(100)
    assert decision.requeue_after == 30.0
    assert reasons(decision) == []

    resumed, decision = advance(paused, observed, at(160))
    assert resumed.status.current_step_index == 2
    assert resumed.status.pause_start_time is None
    assert resumed.status.phase == "Progressing"


def test_indefinite_pause_waits_for_promote() -> None:
    rollout, stable, canary = canary_started()
    rollout = at_step(rollout, 3, canary_weight=50)
    observed = seen(stable, canary, 2)
    paused, decision = advance(rollout, observed, at(100))
    paused, decision = advance(paused, observed, at(100_000))
    assert paused.status.phase == "Paused"
    assert decision.requeue_after is None
    assert condition(paused, "Paused") == ("True", "PausedByStep")
    assert condition(paused, "Progressing") == ("Unknown", "RolloutPaused")

    requested = with_control(paused, promote=PromoteRequest(requested_at="2026-01-01T13:00:00Z"))
    promoted, decision = advance(requested, observed, at(100_001))
    assert promoted.status.current_step_index == 4
    assert promoted.status.control is not None
    assert promoted.status.control.promote is not None
    assert not promoted.status.control.promote.pending
    # the acknowledged request does not promote again
    again, _ = advance(promoted, observed, at(100_002))
    assert again.status.current_step_index == 4


def test_promote_full_skips_remaining_steps() -> None:
    rollout, stable, canary = canary_started()
    requested = with_control(rollout, promote=PromoteRequest(requested_at="t1", mode="Full"))
    promoting, decision = advance(requested, seen(stable, canary, 1), at(70))
    assert promoting.status.current_step_index == len(STEPS)
    assert scales(decision) == {"canary": 4}
    assert "PromotedFull" in reasons(decision)


# --- analysis -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "phase", "step", "abort_reason", "paused_reason"),
    [
        ([0.001, 0.002, 0.003], "Progressing", 2, None, None),
        ([0.5], "Degraded", 1, "AnalysisFailed", None),
        ([None], "Paused", 1, None, "InconclusiveAnalysis"),
        ([0.001], "Progressing", 1, None, None),  # 1 of count=3: still running
    ],
)
def test_analysis_step(
    values: list[float | None],
    phase: str,
    step: int,
    abort_reason: str | None,
    paused_reason: str | None,
) -> None:
    rollout, stable, canary = canary_started(ANALYSIS_STEPS)
    rollout = at_step(rollout, 1, canary_weight=25)
    measurements = tuple(
        ObservedMeasurement("error-rate", at(100 + 60 * i), value) for i, value in enumerate(values)
    )
    observed = seen(stable, canary, 1)
    observed = observe(
        *observed.replica_sets,
        digest=DIGEST_B,
        prefetch=staged(DIGEST_B),
        measurements=measurements,
    )
    after, _ = advance(rollout, observed, at(100 + 60 * len(values)))
    assert after.status.phase == phase
    assert after.status.current_step_index == step
    assert (after.status.abort.reason if after.status.abort else None) == abort_reason
    if paused_reason:
        assert condition(after, "Paused") == ("True", paused_reason)
        assert after.status.stable_revision is not None
        assert after.status.stable_revision.pod_template_hash == stable  # never promoted
    # replaying the same measurements changes nothing
    replay = decide(after, observed, at(100 + 60 * len(values)))
    if phase in ("Paused", "Degraded"):
        assert replay.status.analysis == after.status.analysis


def test_inconclusive_analysis_resumes_only_on_promote() -> None:
    rollout, stable, canary = canary_started(ANALYSIS_STEPS)
    rollout = at_step(rollout, 1, canary_weight=25)
    base = seen(stable, canary, 1)
    observed = observe(
        *base.replica_sets,
        digest=DIGEST_B,
        prefetch=staged(DIGEST_B),
        measurements=(ObservedMeasurement("error-rate", at(100), None),),
    )
    paused, _ = advance(rollout, observed, at(100))
    still, _ = advance(paused, observed, at(10_000))
    assert still.status.phase == "Paused"
    promoted, _ = advance(
        with_control(still, promote=PromoteRequest(requested_at="p")), observed, at(10_001)
    )
    assert promoted.status.current_step_index == 2


def test_unreachable_prometheus_pauses_then_resumes_by_itself() -> None:
    rollout, stable, canary = canary_started(ANALYSIS_STEPS)
    rollout = at_step(rollout, 1, canary_weight=25)
    base = seen(stable, canary, 1)

    def measured(*points: ObservedMeasurement) -> Any:
        return observe(
            *base.replica_sets, digest=DIGEST_B, prefetch=staged(DIGEST_B), measurements=points
        )

    errors = tuple(
        ObservedMeasurement("error-rate", at(100 + i), error="connection refused") for i in range(5)
    )
    paused, decision = advance(rollout, measured(*errors), at(105))
    assert paused.status.phase == "Paused"
    assert "unreachable" in paused.status.message
    assert decision.requeue_after is not None, "it keeps polling the provider"
    assert paused.status.current_step_index == 1, "never promoted while blind"

    back, decision = advance(
        paused, measured(ObservedMeasurement("error-rate", at(200), 0.0)), at(200)
    )
    assert back.status.phase == "Progressing"
    assert back.status.pause_start_time is None
    assert "AnalysisResumed" in reasons(decision)


# --- promotion ----------------------------------------------------------------


def test_last_step_promotes_and_scales_old_stable_down() -> None:
    rollout, stable, canary = canary_started()
    rollout = at_step(rollout, 4, canary_weight=50)
    waiting, decision = advance(rollout, seen(stable, canary, 2), at(200))
    assert scales(decision) == {"canary": 4}
    assert waiting.status.phase == "Progressing"

    promoted, decision = advance(rollout, seen(stable, canary, 4), at(200))
    assert promoted.status.phase == "Healthy"
    assert promoted.status.stable_revision is not None
    assert promoted.status.stable_revision.pod_template_hash == canary
    assert promoted.status.canary_revision is None
    assert promoted.status.history[-1].outcome == "Promoted"
    # replicaRatio: the old stable goes at once
    assert decision.scales == (ScaleAction(stable, "obsolete", 0, name=f"llm-{stable}"),)
    assert [n.event for n in decision.notifications] == ["Promoted"]


def test_who_seeded_whom_stays_in_status_after_promotion() -> None:
    rollout, stable, canary = canary_started()
    rollout = at_step(rollout, 4, canary_weight=50)
    loads = (
        PodLoad("llm-c-1", "cache", None, 0.5),
        PodLoad("llm-c-2", "broadcast", "llm-c-1", 1.5),
    )
    seeding, _ = advance(rollout, seen(stable, canary, 2, loads=loads[:1]), at(200))
    assert seeding.status.verification is not None
    assert [load.pod for load in seeding.status.verification.loads] == ["llm-c-1"]
    promoted, _ = advance(seeding, seen(stable, canary, 4, loads=loads), at(210))
    assert promoted.status.canary_revision is None
    verification = promoted.status.verification
    assert verification is not None and verification.pod_template_hash == canary
    assert [(x.pod, x.source, x.seeded_from) for x in verification.loads] == [
        ("llm-c-1", "cache", None),
        ("llm-c-2", "broadcast", "llm-c-1"),
    ]


def test_verification_failures_name_the_prompt_and_survive_the_abort() -> None:
    rollout, stable, canary = canary_started()
    failure = PodFailure(
        "llm-c-1",
        "GoldenPromptFailed",
        "golden prompt 'capital'",
        "capital",
        'equals " Paris."',
        " Lyon.",
    )
    aborted, _ = advance(rollout, seen(stable, canary, 1, failed=(failure,)), at(100))
    assert aborted.status.abort is not None and aborted.status.abort.reason == "VerificationFailed"
    (shown,) = aborted.status.verification.failures  # type: ignore[union-attr]
    assert (shown.prompt, shown.expected, shown.got) == ("capital", 'equals " Paris."', " Lyon.")
    # The canary's pods are deleted: the record stays while this revision is the canary.
    later, _ = advance(aborted, seen(stable, canary, 0), at(130))
    assert [f.pod for f in later.status.verification.failures] == ["llm-c-1"]  # type: ignore[union-attr]


def test_gateway_api_keeps_old_stable_for_scale_down_delay() -> None:
    routing = {
        "gatewayAPI": {
            "httpRoute": {"name": "llm"},
            "stableBackend": "llm-stable",
            "canaryBackend": "llm-canary",
        }
    }
    rollout, stable, canary = canary_started()
    strategy = rollout.spec.strategy.model_dump(by_alias=True)
    strategy["canary"]["trafficRouting"] = routing
    spec = rollout.spec.model_validate(
        {**rollout.spec.model_dump(by_alias=True), "strategy": strategy}
    )
    rollout = at_step(rollout.model_copy(update={"spec": spec}), 4, canary_weight=50)
    observed = seen(stable, canary, 4)
    promoted, decision = advance(rollout, observed, at(200))
    assert promoted.status.retiring is not None
    assert decision.traffic is not None
    assert (decision.traffic.stable, decision.traffic.canary) == (100, 0)
    assert decision.traffic.stable_hash == canary
    assert not any(a.revision_hash == stable for a in decision.scales)
    assert decision.requeue_after == 0.0
    later, decision = advance(
        promoted, observe(replica_set(stable, 4), replica_set(canary, 4), digest=DIGEST_B), at(230)
    )
    assert later.status.retiring is None
    assert scales(decision) == {"obsolete": 0}


# --- abort, retry -------------------------------------------------------------


def test_manual_abort_is_capacity_safe() -> None:
    rollout, stable, canary = canary_started()
    rollout = at_step(rollout, 3, canary_weight=50)
    requested = with_control(rollout, abort=AbortRequest(requested_at="a1", reason="bad vibes"))
    # stable not Ready yet: keep the canary where it is
    not_ready = observe(
        replica_set(stable, 4, ready=3),
        replica_set(canary, 2),
        digest=DIGEST_B,
        prefetch=staged(DIGEST_B),
    )
    aborted, decision = advance(requested, not_ready, at(300))
    assert aborted.status.phase == "Degraded"
    assert aborted.status.abort is not None
    assert aborted.status.abort.canary_scale_down_at is None
    assert aborted.status.canary_weight == 0
    assert scales(decision) == {}
    assert aborted.status.history[-1].outcome == "Aborted"
    assert condition(aborted, "Aborted") == ("True", "ManualAbort")

    ready = seen(stable, canary, 2)
    aborted, decision = advance(aborted, ready, at(310))
    assert aborted.status.abort is not None
    assert aborted.status.abort.canary_scale_down_at == at(340)
    assert scales(decision) == {}
    assert decision.requeue_after == 30.0
    done, decision = advance(aborted, ready, at(340))
    assert scales(decision) == {"canary": 0}
    assert done.status.phase == "Degraded"
    assert len(done.status.history) == len(aborted.status.history)  # recorded once


def test_retry_after_abort_restarts_steps() -> None:
    rollout, stable, canary = canary_started()
    failure = PodFailure("p", "ChecksumMismatch")
    aborted, _ = advance(rollout, seen(stable, canary, 1, failed=(failure,)), at(70))
    retried, decision = advance(
        with_control(aborted, retry=ControlRequest(requested_at="r1")),
        seen(stable, canary, 1),
        at(400),
    )
    assert retried.status.abort is None
    assert "Retry" in reasons(decision)
    assert retried.status.current_step_index == 1  # step 0 re-ran and passed
    assert condition(retried, "Aborted") == ("False", "NotAborted")


def test_aborted_rollout_stays_degraded_without_retry() -> None:
    rollout, stable, canary = canary_started()
    failure = PodFailure("p", "ChecksumMismatch")
    aborted, _ = advance(rollout, seen(stable, canary, 1, failed=(failure,)), at(70))
    later, decision = advance(aborted, seen(stable, canary, 0), at(5000))
    assert later.status.phase == "Degraded"
    assert reasons(decision) == []
    assert decision.notifications == ()


# --- spec changes -------------------------------------------------------------


def test_new_revision_mid_rollout_supersedes_canary() -> None:
    rollout, stable, canary = canary_started()
    rollout = at_step(rollout, 2, canary_weight=25)
    v3 = with_model_revision(rollout, "v3")
    after, decision = advance(v3, seen(stable, canary, 1), at(500))
    assert after.status.canary_revision is not None
    assert after.status.canary_revision.revision == "v3"
    assert after.status.current_step_index == 0
    assert "Superseded" in reasons(decision)
    by_hash = {a.revision_hash: a for a in decision.scales}
    assert by_hash[canary].replicas == 0
    new_hash = after.status.canary_revision.pod_template_hash
    assert by_hash[new_hash] == CreateReplicaSet(
        new_hash, "canary", 1, DIGEST_B, "spec.template", require_staged=True
    )


def test_reverting_spec_to_stable_drops_canary_without_prefetch() -> None:
    rollout, stable, canary = canary_started()
    rollout = at_step(rollout, 2, canary_weight=25)
    reverted = with_model_revision(rollout, "llama3-8b-2024-06-01")
    after, decision = advance(
        reverted, observe(replica_set(stable, 4), replica_set(canary, 1)), at(500)
    )
    assert after.status.phase == "Healthy"
    assert after.status.canary_revision is None
    assert scales(decision) == {"obsolete": 0}
    assert after.status.history[-1].reason == "RevertedToStable"


def test_observed_generation_follows_metadata() -> None:
    rollout, stable, canary = canary_started()
    assert rollout.status.observed_generation == 2
    bumped = rollout.model_copy(
        update={"metadata": rollout.metadata.model_copy(update={"generation": 7})}
    )
    after, _ = advance(bumped, seen(stable, canary, 1), at(70))
    assert after.status.observed_generation == 7
    assert all(c.observed_generation == 7 for c in after.status.conditions)


@pytest.mark.parametrize(
    ("digest", "error", "reason", "needle"),
    [
        (None, "NoSuchKey", "ManifestUnavailable", "weightship manifest s3://models/llama3-8b"),
        (None, None, "ManifestUnavailable", "`weightship manifest s3://"),
    ],
)
def test_missing_manifest_is_invalid_spec(
    digest: str | None, error: str | None, reason: str, needle: str
) -> None:
    rollout, stable = healthy_rollout(STEPS)
    rollout = with_model_revision(rollout, "v2")
    after, decision = advance(
        rollout, observe(replica_set(stable, 4), digest=digest, error=error), at(60)
    )
    assert after.status.phase == "Degraded"
    assert condition(after, "InvalidSpec") == ("True", reason)
    assert needle in after.status.message
    assert decision.scales == ()
    assert reasons(decision) == ["InvalidSpec"]
    assert [n.event for n in decision.notifications] == ["Failed"]
    _, decision = advance(
        after, observe(replica_set(stable, 4), digest=digest, error=error), at(120)
    )
    assert reasons(decision) == []  # reported once
    assert decision.requeue_after == 60.0


def test_pinned_digest_mismatch_is_invalid_spec() -> None:
    rollout, stable = healthy_rollout(STEPS)
    model = rollout.spec.model.model_copy(update={"manifest_digest": DIGEST_B})
    pinned = rollout.model_copy(update={"spec": rollout.spec.model_copy(update={"model": model})})
    after, _ = advance(pinned, observe(replica_set(stable, 4), digest=DIGEST_A), at(60))
    assert condition(after, "InvalidSpec") == ("True", "ManifestDigestMismatch")
    assert "weightship manifest s3://" in after.status.message


def test_decide_invalid_spec_for_unparseable_objects() -> None:
    rollout, _ = healthy_rollout(STEPS)
    decision = decide_invalid_spec(rollout.status, 9, "spec.replicas: must be >= 0", T0)
    assert decision.status.phase == "Degraded"
    assert decision.status.observed_generation == 9
    assert decision.scales == ()


# --- idempotence --------------------------------------------------------------


def test_decide_is_idempotent_and_never_runs_a_step_twice() -> None:
    rollout, stable, canary = canary_started()
    observed = seen(stable, canary, 1)
    assert decide(rollout, observed, at(70)) == decide(rollout, observed, at(70))
    after, first = advance(rollout, observed, at(70))
    assert reasons(first).count("StepCompleted") == 1
    again, second = advance(after, observed, at(70))
    assert again.status.current_step_index == 1  # now in the pause; step 0 is not re-run
    assert again.status.phase == "Paused"
    assert [e.message for e in second.events if e.reason == "StepCompleted"] == []


def test_status_patch_touches_only_acknowledged() -> None:
    rollout, stable, canary = canary_started()
    rollout = at_step(rollout, 3, canary_weight=50, pause_start_time=at(60))
    requested = with_control(rollout, promote=PromoteRequest(requested_at="p1"))
    decision = decide(requested, seen(stable, canary, 2), at(100))
    patch = decision.status_patch(requested.status)
    assert patch["control"] == {"promote": {"acknowledged": "p1"}}
    assert patch["currentStepIndex"] == 4
    assert patch["pauseStartTime"] is None


def test_always_pass_gates_walk_through_steps() -> None:
    rollout, stable, canary = canary_started(ANALYSIS_STEPS)
    observed = observe(replica_set(stable, 4), digest=DIGEST_B)
    for _ in range(3):
        rollout = with_status(rollout, decide(rollout, observed, at(70), ALWAYS_PASS_GATES))
    assert rollout.status.phase == "Healthy"
    assert rollout.status.stable_revision is not None
    assert rollout.status.stable_revision.pod_template_hash == canary


def test_notifications_follow_configured_events() -> None:
    rollout, stable, canary = canary_started()
    _, decision = advance(rollout, seen(stable, canary, 1), at(70))
    # StepCompleted is not in the sample's default events (Promoted, RolledBack, Failed)
    assert decision.notifications == ()
