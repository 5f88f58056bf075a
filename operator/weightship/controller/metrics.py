"""The operator's own Prometheus metrics (prometheus-client)."""

from __future__ import annotations

import contextlib
import time

from prometheus_client import Counter, Gauge, Histogram

from weightship.api.status import ModelRolloutStatus

PHASES = ("Pending", "Prefetching", "Progressing", "Paused", "Healthy", "Degraded")

RECONCILES = Counter("weightship_reconciles", "ModelRollout reconciles run")
RECONCILE_ERRORS = Counter("weightship_reconcile_errors", "Reconciles that raised")
RECONCILE_SECONDS = Histogram(
    "weightship_reconcile_duration_seconds",
    "Reconcile duration",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)


LEADER_HELP = "1 on the operator replica that runs, 0 on a standby (leader election)"
# Served by the replica that runs kopf; a standby serves this name alone, at 0
# (controller/leader.py), as client-go's leader_election_master_status.
LEADER = Gauge("weightship_operator_leader", LEADER_HELP)
QUEUE_DEPTH = Gauge("weightship_workqueue_depth", "Rollouts ready to reconcile, not yet taken")
QUEUE_WAITING = Gauge("weightship_workqueue_waiting", "Rollouts waiting on a requeue timer")
EVENTS_DROPPED = Counter(
    "weightship_events_dropped", "Kubernetes Events not posted: the API server was too far behind"
)
ROLLOUT_PHASE = Gauge(
    "weightship_rollout_phase", "1 for the rollout's current phase", ["namespace", "name", "phase"]
)
ROLLOUT_STEP = Gauge("weightship_rollout_step", "Current canary step index", ["namespace", "name"])
ROLLOUT_WEIGHT = Gauge(
    "weightship_rollout_canary_weight", "Canary weight, 0-100", ["namespace", "name"]
)
ROLLOUT_ABORTED = Gauge(
    "weightship_rollout_aborted",
    "1 while the rollout's canary is aborted (status.abort), by the abort's reason",
    ["namespace", "name", "reason"],
)
ROLLOUT_RECONCILED = Gauge(
    "weightship_rollout_last_reconcile_timestamp_seconds",
    "When the rollout was last reconciled to the end (Unix time)",
    ["namespace", "name"],
)
ROLLOUT_RECONCILE_DUE = Gauge(
    "weightship_rollout_next_reconcile_timestamp_seconds",
    "When the rollout's next reconcile is due at the latest (Unix time): its last one's "
    "requeue (a pause's end, the next measurement; 30 s when idle); events come sooner",
    ["namespace", "name"],
)
_abort_reasons: dict[tuple[str, str], str] = {}  # the reason each aborted rollout is shown with
VERIFICATIONS = Counter(
    "weightship_pod_verifications",
    "Readiness-gate verdicts written to pods, by status and reason",
    ["namespace", "status", "reason"],
)
VERIFICATION_SECONDS = Histogram(
    "weightship_pod_verification_duration_seconds",
    "One verification round of one pod (load report and golden prompts)",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
SWAPS = Counter(
    "weightship_pod_swaps",
    "In-place weight swaps that ended, by outcome (Swapped, Failed) and failure reason",
    ["namespace", "outcome", "reason"],
)
SWAP_SECONDS = Histogram(
    "weightship_pod_swap_duration_seconds",
    "One in-place swap of one pod, from leaving traffic to swapped (verification after)",
    buckets=(0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
)
SWAP_HELD_SECONDS = Histogram(
    "weightship_pod_swap_held_seconds",
    "One in-place swap in traffic: how long the pod's server held client requests, from the "
    "swap's start until verified weights answered them (as the server measured it)",
    buckets=(0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
)


def record_rollout(
    namespace: str, name: str, status: ModelRolloutStatus, next_in: float | None = None
) -> None:
    """After a reconcile; ``next_in``: seconds until the next one is due at the latest."""
    for phase in PHASES:
        ROLLOUT_PHASE.labels(namespace, name, phase).set(1 if status.phase == phase else 0)
    ROLLOUT_STEP.labels(namespace, name).set(status.current_step_index or 0)
    ROLLOUT_WEIGHT.labels(namespace, name).set(status.canary_weight)
    _record_abort(namespace, name, status.abort.reason if status.abort else None)
    now = time.time()
    ROLLOUT_RECONCILED.labels(namespace, name).set(now)
    if next_in is not None:
        ROLLOUT_RECONCILE_DUE.labels(namespace, name).set(now + next_in)


def _record_abort(namespace: str, name: str, reason: str | None) -> None:
    """One series while aborted, with the abort's reason; none otherwise (so an alert on it
    resolves when a retry or a new revision clears the abort)."""
    previous = _abort_reasons.get((namespace, name))
    if previous is not None and previous != reason:
        with contextlib.suppress(KeyError):
            ROLLOUT_ABORTED.remove(namespace, name, previous)
    if reason is None:
        _abort_reasons.pop((namespace, name), None)
        return
    _abort_reasons[(namespace, name)] = reason
    ROLLOUT_ABORTED.labels(namespace, name, reason).set(1)


def forget_rollout(namespace: str, name: str) -> None:
    """A deleted rollout's series go with it (else 100s of churned rollouts pile up)."""
    for phase in PHASES:
        with contextlib.suppress(KeyError):
            ROLLOUT_PHASE.remove(namespace, name, phase)
    for gauge in (ROLLOUT_STEP, ROLLOUT_WEIGHT, ROLLOUT_RECONCILED, ROLLOUT_RECONCILE_DUE):
        with contextlib.suppress(KeyError):
            gauge.remove(namespace, name)
    _record_abort(namespace, name, None)
