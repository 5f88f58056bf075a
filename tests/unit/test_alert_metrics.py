"""The series the alerts need (charts/weightship/files/alerts.yaml), as the operator and the
agent export them: an aborted rollout's reason, when a rollout was last reconciled and when
its next reconcile is due, the manifests an agent fails to stage by reason, the bytes
rollouts pin, the agent's last report."""

from __future__ import annotations

import time
from datetime import UTC, datetime

from prometheus_client import REGISTRY, CollectorRegistry

from weightship.agent.metrics import FAILURE_REASONS, AgentMetrics
from weightship.agent.status import Entry
from weightship.api.status import AbortStatus, ModelRolloutStatus
from weightship.api.weightcache import StagingFailure
from weightship.controller import metrics

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def aborted(reason: str) -> ModelRolloutStatus:
    abort = AbortStatus(reason=reason, message="m", aborted_at=NOW, pod_template_hash="abc")
    return ModelRolloutStatus(phase="Degraded", abort=abort)


def aborted_value(name: str, reason: str) -> float | None:
    return REGISTRY.get_sample_value(
        "weightship_rollout_aborted", {"namespace": "ns", "name": name, "reason": reason}
    )


def reconciled_at(name: str) -> float | None:
    return REGISTRY.get_sample_value(
        "weightship_rollout_last_reconcile_timestamp_seconds", {"namespace": "ns", "name": name}
    )


def test_an_aborted_rollout_has_one_series_with_its_reason_until_the_abort_is_cleared() -> None:
    metrics.record_rollout("ns", "a", aborted("OriginMismatch"))
    assert aborted_value("a", "OriginMismatch") == 1.0
    # Another abort reason replaces the first (one series per rollout, never two).
    metrics.record_rollout("ns", "a", aborted("VerificationFailed"))
    assert aborted_value("a", "OriginMismatch") is None
    assert aborted_value("a", "VerificationFailed") == 1.0
    # A retry (or a new revision) clears status.abort: the series goes, the alert resolves.
    metrics.record_rollout("ns", "a", ModelRolloutStatus(phase="Progressing"))
    assert aborted_value("a", "VerificationFailed") is None
    assert REGISTRY.get_sample_value(
        "weightship_rollout_phase", {"namespace": "ns", "name": "a", "phase": "Progressing"}
    )


def due_at(name: str) -> float | None:
    return REGISTRY.get_sample_value(
        "weightship_rollout_next_reconcile_timestamp_seconds", {"namespace": "ns", "name": name}
    )


def test_every_reconcile_stamps_the_rollout_and_a_deleted_rollout_leaves_no_series() -> None:
    before = time.time()
    metrics.record_rollout("ns", "b", aborted("AnalysisFailed"), next_in=3600.0)  # a long pause
    stamp = reconciled_at("b")
    assert stamp is not None and before <= stamp <= time.time()
    assert due_at("b") == stamp + 3600.0
    metrics.record_rollout("ns", "b", aborted("AnalysisFailed"), next_in=30.0)
    again = reconciled_at("b")
    assert again is not None and due_at("b") == again + 30.0
    metrics.forget_rollout("ns", "b")
    assert reconciled_at("b") is None
    assert due_at("b") is None
    assert aborted_value("b", "AnalysisFailed") is None
    # Recorded again after being forgotten (a rollout re-created with the same name).
    metrics.record_rollout("ns", "b", aborted("AnalysisFailed"))
    assert aborted_value("b", "AnalysisFailed") == 1.0
    metrics.forget_rollout("ns", "b")


def failure(reason: str) -> StagingFailure:
    return StagingFailure.model_validate({"reason": reason, "since": NOW})


def test_agent_gauges_follow_the_reported_entries() -> None:
    registry = CollectorRegistry()
    started = time.time()
    agent = AgentMetrics.create(registry)

    def sample(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    # Until its first write the last report is the agent's start (a fresh agent is no alert).
    last = sample("weightship_agent_last_report_timestamp_seconds")
    assert last is not None and started <= last <= time.time()
    assert all(sample("weightship_agent_failing_models", reason=r) == 0 for r in FAILURE_REASONS)

    entries = [
        Entry("sha256:1", "Staged", bytes_total=100, pinned_by=("serving/llm",)),
        Entry("sha256:2", "Failed", bytes_total=50, failure=failure("DiskFull")),
        # A retry under way keeps its failure: still failing.
        Entry(
            "sha256:3", "Staging", bytes_total=30, pinned_by=("a/b",), failure=failure("DiskFull")
        ),
        Entry("sha256:4", "Failed", failure=failure("OriginMismatch")),
        Entry("sha256:5", "Staged", bytes_total=70),  # unpinned: eviction may free it
    ]
    agent.observe_entries(entries)
    assert sample("weightship_agent_failing_models", reason="DiskFull") == 2
    assert sample("weightship_agent_failing_models", reason="OriginMismatch") == 1
    assert sample("weightship_agent_failing_models", reason="SourceUnavailable") == 0
    assert sample("weightship_agent_cache_pinned_bytes") == 130
    assert sample("weightship_agent_models", state="Failed") == 2
    assert sample("weightship_agent_models", state="Staged") == 2

    # Staged at last: nothing fails any more.
    agent.observe_entries([Entry("sha256:2", "Staged", bytes_total=50, pinned_by=("x/y",))])
    assert all(sample("weightship_agent_failing_models", reason=r) == 0 for r in FAILURE_REASONS)
    assert sample("weightship_agent_cache_pinned_bytes") == 50
    assert set(FAILURE_REASONS) >= {"DiskFull", "OriginMismatch", "SourceUnavailable"}
