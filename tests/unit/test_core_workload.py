"""Table tests of spec.workloadRef's hand-over (core.workload through `decide`): the
adopted Deployment keeps its replicas until the rollout's stable ReplicaSet serves all of
its own, is scaled to zero only once its count is recorded and the finalizer is on, and
gets the recorded count back when the rollout stops naming it (or is deleted)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from weightship.api.models import ModelRollout
from weightship.api.spec import WorkloadRef
from weightship.api.status import AbortRequest, ControlStatus, WorkloadStatus
from weightship.core.decide import decide
from weightship.core.decision import Decision, ScaleWorkload
from weightship.core.observed import Observed, ReplicaSetObservation
from weightship.core.workload import give_back
from weightship_testing.core import (
    DIGEST_A,
    DIGEST_B,
    T0,
    at,
    observe,
    replica_set,
    staged,
    with_model_revision,
    with_status,
)
from weightship_testing.samples import VALID_MANIFEST

TEMPLATE: dict[str, Any] = copy.deepcopy(VALID_MANIFEST["spec"]["template"])
RECORD = WorkloadStatus(name="llm", replicas=3)


def adopting(replicas: int = 4, **spec: Any) -> ModelRollout:
    manifest = copy.deepcopy(VALID_MANIFEST)
    manifest["metadata"]["generation"] = 1
    manifest["spec"].pop("template")
    manifest["spec"].update(workloadRef={"name": "llm"}, replicas=replicas, **spec)
    return ModelRollout.model_validate(manifest)


def see(
    *replica_sets: ReplicaSetObservation,
    deployment: int | None = 3,
    finalizer: bool = True,
    digest: str = DIGEST_A,
    **extra: Any,
) -> Observed:
    """What observe hands decide: the Deployment at `deployment` replicas (None: gone)."""
    return observe(
        *replica_sets,
        digest=digest,
        prefetch=staged(digest),
        workload_template=TEMPLATE if deployment is not None else None,
        workload_replicas=deployment,
        finalizer=finalizer,
        **extra,
    )


def first_revision(rollout: ModelRollout) -> tuple[ModelRollout, str]:
    """The rollout's first revision created (its ReplicaSet not ready yet), and its hash."""
    first = decide(rollout, see(), T0)
    assert first.status.canary_revision is not None
    assert first.workloads == () and first.status.workload is None
    return with_status(rollout, first), first.status.canary_revision.pod_template_hash


def serving(replicas: int = 4) -> tuple[ModelRollout, str]:
    """The first revision stable on all `replicas`: status.workload recorded."""
    rollout, stable = first_revision(adopting(replicas))
    recorded = decide(rollout, see(replica_set(stable, replicas)), at(1))
    assert recorded.status.phase == "Healthy", recorded.status.message
    return with_status(rollout, recorded), stable


def scales(decision: Decision) -> list[tuple[str, int]]:
    return [(a.name, a.replicas) for a in decision.workloads]


# --- the Deployment keeps its capacity until the rollout's own pods serve --------------


@pytest.mark.parametrize(
    ("ready", "verified"),
    [(0, 0), (3, 3), (4, 3)],
    ids=["no pod ready", "3 of 4 ready", "4 ready, 3 verified"],
)
def test_the_deployment_is_untouched_until_the_stable_serves_every_replica(
    ready: int, verified: int
) -> None:
    rollout, first = first_revision(adopting(4))
    decision = decide(rollout, see(replica_set(first, 4, ready=ready, verified=verified)), at(1))
    assert scales(decision) == []
    assert decision.status.workload is None


def test_first_the_count_is_recorded_then_the_deployment_goes_to_zero() -> None:
    rollout, stable = first_revision(adopting(4))
    recorded = decide(rollout, see(replica_set(stable, 4)), at(1))
    assert recorded.status.workload == RECORD
    assert scales(recorded) == []  # not in the reconcile whose status write may fail
    assert recorded.requeue_after is not None
    rollout = with_status(rollout, recorded)

    scaled = decide(rollout, see(replica_set(stable, 4)), at(2))
    assert scales(scaled) == [("llm", 0)]
    assert scaled.status.workload == RECORD
    # Posted with the scale, not after the status write: a retry after a failed write
    # finds the Deployment at zero and decides no scale, nor its event.
    assert scaled.events == ()
    (event,) = [w.event for w in scaled.workloads]
    assert event is not None and event.reason == "WorkloadScaledDown"
    assert "back to 3" in event.message
    rollout = with_status(rollout, scaled)

    settled = decide(rollout, see(replica_set(stable, 4), deployment=0), at(3))
    assert scales(settled) == [] and settled.status.workload == RECORD


def test_no_scale_down_before_the_finalizer_is_on() -> None:
    rollout, stable = serving()
    waiting = decide(rollout, see(replica_set(stable, 4), finalizer=False), at(2))
    assert scales(waiting) == []
    assert waiting.requeue_after is not None and waiting.requeue_after <= 5
    assert waiting.status.workload == RECORD


def test_a_deployment_scaled_up_again_is_scaled_down_again() -> None:
    rollout, stable = serving()
    decision = decide(rollout, see(replica_set(stable, 4), deployment=5), at(2))
    assert scales(decision) == [("llm", 0)]
    assert decision.status.workload == RECORD  # what it gets back stays the adopted count


@pytest.mark.parametrize(
    ("deployment", "deleting", "digest"),
    [(3, True, DIGEST_A), (None, False, DIGEST_A), (3, False, None)],
    ids=["the rollout is being deleted", "the Deployment is gone", "the spec is invalid"],
)
def test_nothing_is_scaled_down_when(
    deployment: int | None, deleting: bool, digest: str | None
) -> None:
    rollout, stable = serving()
    observed = observe(
        replica_set(stable, 4),
        digest=digest,
        error=None if digest else "gone",
        workload_template=TEMPLATE if deployment is not None else None,
        workload_replicas=deployment,
        finalizer=True,
        deleting=deleting,
    )
    decision = decide(rollout, observed, at(2))
    assert scales(decision) == []
    assert decision.status.workload == RECORD  # kept: the deletion handler gives it back


def test_a_deployment_already_at_zero_is_not_taken_over() -> None:
    rollout, stable = first_revision(adopting(4))
    decision = decide(rollout, see(replica_set(stable, 4), deployment=0), at(1))
    assert scales(decision) == [] and decision.status.workload is None


def test_zero_replicas_never_take_the_deployments_capacity() -> None:
    rollout = adopting(0)
    for second in range(3):
        decision = decide(rollout, see(), at(second))
        rollout = with_status(rollout, decision)
        assert scales(decision) == [] and decision.status.workload is None
    assert rollout.status.phase == "Healthy"


def test_an_aborted_canary_leaves_the_deployment_at_zero() -> None:
    """After the hand-over an abort goes back to the rollout's own stable (full size)."""
    rollout, stable = serving()
    rollout = with_status(rollout, decide(rollout, see(replica_set(stable, 4)), at(2)))
    rollout = with_model_revision(rollout, "v2")
    canary = decide(rollout, see(replica_set(stable, 4), deployment=0, digest=DIGEST_B), at(3))
    rollout = with_status(rollout, canary)
    assert rollout.status.canary_revision is not None
    request = ControlStatus(abort=AbortRequest(requested_at=at(4).isoformat(), reason="no"))
    rollout = rollout.model_copy(
        update={"status": rollout.status.model_copy(update={"control": request})}
    )
    aborted = decide(rollout, see(replica_set(stable, 4), deployment=0, digest=DIGEST_B), at(5))
    assert aborted.status.abort is not None, aborted.status.message
    assert scales(aborted) == [] and aborted.status.workload == RECORD


# --- the Deployment gets its replicas back ----------------------------------------------


def test_a_rollout_that_names_another_deployment_gives_the_first_back() -> None:
    rollout, stable = serving()
    spec = rollout.spec.model_copy(update={"workload_ref": WorkloadRef(name="other")})
    rollout = rollout.model_copy(update={"spec": spec})
    decision = decide(rollout, see(replica_set(stable, 4), deployment=2), at(2))
    assert scales(decision) == [("llm", 3)]
    assert "WorkloadReleased" in [e.reason for e in decision.events]
    # The other Deployment is a new adoption: recorded now, scaled down after.
    assert decision.status.workload == WorkloadStatus(name="other", replicas=2)


def test_a_rollout_switched_to_spec_template_gives_the_deployment_back() -> None:
    rollout, stable = serving()
    body = rollout.to_k8s()
    del body["spec"]["workloadRef"]
    body["spec"]["template"] = TEMPLATE
    rollout = ModelRollout.model_validate(body)
    decision = decide(rollout, observe(replica_set(stable, 4), prefetch=staged(DIGEST_A)), at(2))
    assert scales(decision) == [("llm", 3)]
    assert decision.status.workload is None  # kopf then drops the finalizer


def test_give_back_restores_the_recorded_count() -> None:
    assert give_back(RECORD) == ScaleWorkload("llm", 3)
