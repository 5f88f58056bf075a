"""Pods leave traffic before a scale-down deletes them (core/drain.py), driven through the
controller's own snapshot functions on a small simulated cluster whose ReplicaSet
controller deletes pods as Kubernetes' does: unready before ready, then the lowest
pod-deletion-cost, then the newest."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from weightship.api.models import ModelRollout
from weightship.api.names import DELETION_COST_ANNOTATION, REVISION_LABEL, VERIFIED_GATE
from weightship.api.status import AbortRequest, ControlStatus, PromoteRequest
from weightship.controller.builders import DRAINED_DELETION_COST, gate_condition
from weightship.controller.snapshot import observed_pods, replica_set_observations
from weightship.core.decide import decide
from weightship.core.decision import CreateReplicaSet, Decision, ScaleAction
from weightship.core.observed import ManifestResolution, Observed
from weightship.core.pod_gates import draining
from weightship.core.verification import DRAINING
from weightship_testing.core import (
    DIGEST_A,
    DIGEST_B,
    at,
    make_rollout,
    staged,
    with_model_revision,
    with_status,
)

STEPS = [{"setWeight": 50}, {"pause": {}}]


@dataclass
class Cluster:
    replica_sets: list[dict[str, Any]] = field(default_factory=list)
    pods: list[dict[str, Any]] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    created: int = 0

    def observe(self, digest: str) -> Observed:
        return Observed(
            manifest=ManifestResolution(digest=digest),
            replica_sets=replica_set_observations(self.replica_sets, self.pods),
            pods=observed_pods(self.pods),
            prefetch=staged(digest),
        )

    def apply(self, decision: Decision) -> None:
        for action in decision.scales:
            if isinstance(action, CreateReplicaSet):
                labels = {REVISION_LABEL: action.revision_hash}
                name = f"llm-{action.revision_hash}"
                self.replica_sets.append(
                    {"metadata": {"name": name, "labels": labels}, "spec": {"replicas": 0}}
                )
                self.resize(name, action.replicas)
            elif isinstance(action, ScaleAction):
                self.resize(action.name, action.replicas)
        for drain in decision.drain_pods:
            pod = self.pod(drain.pod)
            _set_gate(pod, gate_condition(draining(drain)))
            pod["metadata"]["annotations"][DELETION_COST_ANNOTATION] = DRAINED_DELETION_COST
        for name in decision.undrain_pods:
            pod = self.pod(name)
            pod["metadata"]["annotations"].pop(DELETION_COST_ANNOTATION, None)
            _set_gate(pod, {"type": VERIFIED_GATE, "status": "True", "reason": "Verified"})

    def pod(self, name: str) -> dict[str, Any]:
        return next(p for p in self.pods if p["metadata"]["name"] == name)

    def resize(self, name: str, replicas: int) -> None:
        rs = next(r for r in self.replica_sets if r["metadata"]["name"] == name)
        rs["spec"]["replicas"] = replicas
        mine = [p for p in self.pods if p["owner"] == name]
        for pod in sorted(mine, key=_deletion_rank)[: max(0, len(mine) - replicas)]:
            self.pods.remove(pod)
            self.deleted.append(pod["metadata"]["name"])
        for _ in range(replicas - len(mine)):
            self.created += 1
            labels = dict(rs["metadata"]["labels"])
            self.pods.append(_pod(f"{name}-{self.created}", name, labels, self.created))

    def set_ready(self, name: str, ready: bool) -> None:
        for c in self.pod(name)["status"]["conditions"]:
            if c["type"] == "Ready":
                c["status"] = "True" if ready else "False"

    def of(self, revision: str) -> list[str]:
        return [
            p["metadata"]["name"]
            for p in self.pods
            if p["metadata"]["labels"][REVISION_LABEL] == revision
        ]


def _deletion_rank(pod: dict[str, Any]) -> tuple[bool, int, int]:
    """The ReplicaSet controller's order (kubernetes controller_utils ActivePodsWithRanks,
    the parts this cluster models): unready first, lower deletion cost, newer."""
    ready = any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"]["conditions"])
    cost = int(pod["metadata"]["annotations"].get(DELETION_COST_ANNOTATION, "0"))
    return ready, cost, -pod["order"]


def _pod(name: str, owner: str, labels: dict[str, str], order: int) -> dict[str, Any]:
    return {
        "owner": owner,
        "order": order,
        "metadata": {
            "name": name,
            "labels": labels,
            "annotations": {},
            "creationTimestamp": f"2026-01-01T11:{order:02d}:00Z",
        },
        "spec": {"containers": [{"name": "server"}], "nodeName": "node-1"},
        "status": {
            "phase": "Running",
            "podIP": "10.0.0.1",
            "conditions": [
                {"type": VERIFIED_GATE, "status": "True", "reason": "Verified"},
                {"type": "Ready", "status": "True"},
                {"type": "ContainersReady", "status": "True"},
            ],
        },
    }


def _set_gate(pod: dict[str, Any], gate: dict[str, Any]) -> None:
    conditions = pod["status"]["conditions"]
    conditions[:] = [c for c in conditions if c["type"] != VERIFIED_GATE] + [gate]
    for c in conditions:
        if c["type"] == "Ready":
            c["status"] = gate["status"]  # the readiness gate is the pod's only unready cause


def reconcile(
    rollout: ModelRollout, cluster: Cluster, digest: str, now: datetime
) -> tuple[ModelRollout, Decision]:
    decision = decide(rollout, cluster.observe(digest), now)
    cluster.apply(decision)
    return with_status(rollout, decision), decision


def run(
    rollout: ModelRollout, cluster: Cluster, digest: str, start: float, end: float
) -> ModelRollout:
    """Reconcile once a second from ``start`` to ``end`` (seconds after T0)."""
    for second in range(int(start), int(end)):
        rollout, _ = reconcile(rollout, cluster, digest, at(second))
    return rollout


def control(rollout: ModelRollout, **requests: Any) -> ModelRollout:
    status = rollout.status.model_copy(update={"control": ControlStatus(**requests)})
    return rollout.model_copy(update={"status": status})


def paused_canary(**spec: Any) -> tuple[ModelRollout, Cluster, str, str]:
    """3 stable pods of v1 and the canary v2 paused at 50 % (2 pods), every pod ready."""
    rollout = make_rollout(STEPS, replicas=3, **spec)
    cluster = Cluster()
    rollout = run(rollout, cluster, DIGEST_A, 0, 3)
    assert rollout.status.phase == "Healthy", rollout.status.message
    stable = rollout.status.stable_revision.pod_template_hash  # type: ignore[union-attr]
    rollout = run(with_model_revision(rollout, "v2"), cluster, DIGEST_B, 3, 8)
    assert rollout.status.phase == "Paused", rollout.status.message
    canary = rollout.status.canary_revision.pod_template_hash  # type: ignore[union-attr]
    assert len(cluster.of(stable)) == 3 and len(cluster.of(canary)) == 2
    return rollout, cluster, stable, canary


def test_after_a_promotion_the_old_pods_leave_traffic_then_go_after_the_delay() -> None:
    rollout, cluster, stable, canary = paused_canary()
    rollout = control(rollout, promote=PromoteRequest(requested_at="t1"))
    rollout = run(rollout, cluster, DIGEST_B, 10, 14)  # the canary grows to 3, promoted
    assert rollout.status.stable_revision.pod_template_hash == canary  # type: ignore[union-attr]
    old = cluster.of(stable)
    assert len(old) == 3, "the old stable is still there, draining"
    assert all(_gate_reason(cluster, p) == DRAINING for p in old)
    assert not any(p.ready for p in cluster.observe(DIGEST_B).pods if p.name in old)
    assert not cluster.deleted
    # Still there 29 s after they left (scaleDownDelaySeconds 30), gone at 30 s.
    drained_at = min(_gate_since(cluster, p) for p in old)
    rollout, decision = reconcile(rollout, cluster, DIGEST_B, drained_at + (at(29) - at(0)))
    assert len(cluster.of(stable)) == 3 and decision.requeue_after is not None
    assert decision.requeue_after <= 1
    rollout, decision = reconcile(rollout, cluster, DIGEST_B, drained_at + (at(30) - at(0)))
    assert cluster.of(stable) == [] and sorted(cluster.deleted) == sorted(old)
    assert rollout.status.phase == "Healthy"
    assert len(cluster.of(canary)) == 3 and not decision.drain_pods


def test_fewer_replicas_drains_exactly_the_pod_the_replica_set_deletes() -> None:
    rollout = make_rollout(STEPS, replicas=3)
    cluster = Cluster()
    rollout = run(rollout, cluster, DIGEST_A, 0, 3)
    stable = rollout.status.stable_revision.pod_template_hash  # type: ignore[union-attr]
    pods = cluster.of(stable)
    cluster.set_ready(pods[0], False)  # an unready pod goes before the newest ready one
    spec = rollout.spec.model_copy(update={"replicas": 2})
    rollout = rollout.model_copy(update={"spec": spec})
    rollout, decision = reconcile(rollout, cluster, DIGEST_A, at(10))
    assert [d.pod for d in decision.drain_pods] == [pods[0]]
    assert not any(isinstance(s, ScaleAction) for s in decision.scales)
    rollout = run(rollout, cluster, DIGEST_A, 11, 45)
    assert cluster.deleted == [pods[0]] and cluster.of(stable) == pods[1:]


def test_a_drained_pod_no_scale_down_takes_comes_back() -> None:
    rollout = make_rollout(STEPS, replicas=3)
    cluster = Cluster()
    rollout = run(rollout, cluster, DIGEST_A, 0, 3)
    stable = rollout.status.stable_revision.pod_template_hash  # type: ignore[union-attr]
    smaller = rollout.model_copy(update={"spec": rollout.spec.model_copy(update={"replicas": 2})})
    smaller, decision = reconcile(smaller, cluster, DIGEST_A, at(10))
    (drained,) = [d.pod for d in decision.drain_pods]
    # The user changes their mind before the delay is over: the pod is handed back.
    back = smaller.model_copy(update={"spec": smaller.spec.model_copy(update={"replicas": 3})})
    back, decision = reconcile(back, cluster, DIGEST_A, at(20))
    assert decision.undrain_pods == (drained,) and not cluster.deleted
    assert len(cluster.of(stable)) == 3 and _gate_reason(cluster, drained) is None


def test_an_aborted_canary_leaves_traffic_at_once_and_goes_after_the_abort_delay() -> None:
    rollout, cluster, stable, canary = paused_canary()
    rollout = control(rollout, abort=AbortRequest(requested_at="t1", reason="bad answers"))
    rollout, decision = reconcile(rollout, cluster, DIGEST_B, at(10))
    assert rollout.status.phase == "Degraded", rollout.status.message
    assert sorted(d.pod for d in decision.drain_pods) == sorted(cluster.of(canary))
    assert not any(isinstance(s, ScaleAction) for s in decision.scales)
    rollout = run(rollout, cluster, DIGEST_B, 11, 39)  # abortScaleDownDelaySeconds 30
    assert len(cluster.of(canary)) == 2 and not cluster.deleted
    rollout = run(rollout, cluster, DIGEST_B, 40, 42)
    assert cluster.of(canary) == [] and len(cluster.of(stable)) == 3


def test_a_pod_whose_gate_does_not_close_goes_after_a_bounded_wait() -> None:
    rollout = make_rollout(STEPS, replicas=2)
    cluster = Cluster()
    rollout = run(rollout, cluster, DIGEST_A, 0, 3)
    smaller = rollout.model_copy(update={"spec": rollout.spec.model_copy(update={"replicas": 1})})
    smaller, decision = reconcile(smaller, cluster, DIGEST_A, at(10))
    (drained,) = [d.pod for d in decision.drain_pods]
    cluster.set_ready(drained, True)  # a template without the readiness gate stays Ready
    smaller = run(smaller, cluster, DIGEST_A, 11, 69)
    assert drained not in cluster.deleted  # delay 30 + 30 still ready
    run(smaller, cluster, DIGEST_A, 70, 72)
    assert cluster.deleted == [drained]


def test_nothing_reopens_or_fails_a_draining_pod() -> None:
    """Trivial gates do not open it, and it is not counted as a failed verification."""
    rollout = make_rollout(STEPS, replicas=2, validation={"checksum": False, "mode": "none"})
    cluster = Cluster()
    rollout = run(rollout, cluster, DIGEST_A, 0, 3)
    smaller = rollout.model_copy(update={"spec": rollout.spec.model_copy(update={"replicas": 1})})
    smaller, _ = reconcile(smaller, cluster, DIGEST_A, at(10))
    _, decision = reconcile(smaller, cluster, DIGEST_A, at(11))
    assert not decision.pod_gates
    assert all(not rs.failed for rs in cluster.observe(DIGEST_A).replica_sets)


def _gate(cluster: Cluster, pod: str) -> dict[str, Any]:
    return next(c for c in cluster.pod(pod)["status"]["conditions"] if c["type"] == VERIFIED_GATE)


def _gate_reason(cluster: Cluster, pod: str) -> str | None:
    gate = _gate(cluster, pod)
    return None if gate["status"] == "True" else gate["reason"]


def _gate_since(cluster: Cluster, pod: str) -> datetime:
    return datetime.fromisoformat(_gate(cluster, pod)["lastTransitionTime"])


def test_a_canary_pod_that_failed_verification_keeps_its_verdict_and_goes() -> None:
    rollout, cluster, stable, canary = paused_canary()
    bad, good = cluster.of(canary)
    failed = {"type": VERIFIED_GATE, "status": "False", "reason": "GoldenPromptFailed"}
    _set_gate(cluster.pod(bad), failed)
    rollout = control(rollout, abort=AbortRequest(requested_at="t1", reason="bad answers"))
    rollout, decision = reconcile(rollout, cluster, DIGEST_B, at(10))
    assert rollout.status.abort is not None, rollout.status.message
    assert [d.pod for d in decision.drain_pods] == [good]
    rollout = run(rollout, cluster, DIGEST_B, 11, 39)
    assert _gate(cluster, bad)["reason"] == "GoldenPromptFailed"
    run(rollout, cluster, DIGEST_B, 40, 42)
    assert sorted(cluster.deleted) == sorted([bad, good]) and len(cluster.of(stable)) == 3
