"""The in-place flow of the decision core (updatePolicy InPlaceIfPossible), driven through
the same pure snapshot functions the controller uses, on a small simulated cluster: a
ReplicaSet per pod template, pods whose revision-hash label says what they hold, and swaps
that move one pod at a time."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pytest

from weightship.api.models import ModelRollout
from weightship.api.names import REVISION_LABEL, SWAP_ANNOTATION, TEMPLATE_LABEL, VERIFIED_GATE
from weightship.api.status import AbortRequest, ControlStatus, PromoteRequest
from weightship.controller.snapshot import observed_pods, replica_set_observations
from weightship.core.decide import decide
from weightship.core.decision import CreateReplicaSet, Decision, ScaleAction, SwapPod
from weightship.core.observed import Observed
from weightship_testing.core import (
    DIGEST_A,
    DIGEST_B,
    T0,
    at,
    make_rollout,
    staged,
    with_model_revision,
    with_status,
)

DIGEST_C = "sha256:" + "c" * 64
STABLE = make_rollout().spec.model.revision
STEPS = [{"setWeight": 50}, {"pause": {}}, {"setWeight": 100}]


def in_place(rollout: ModelRollout) -> ModelRollout:
    strategy = rollout.spec.strategy.model_copy(deep=True)
    strategy.canary.update_policy = "InPlaceIfPossible"
    return rollout.model_copy(
        update={"spec": rollout.spec.model_copy(update={"strategy": strategy})}
    )


@dataclass
class Cluster:
    """ReplicaSets and pods as the watch caches would hold them; swaps succeed unless the
    target digest is listed in ``fail_swaps`` (reason) or ``bad_prompts``."""

    replica_sets: list[dict[str, Any]] = field(default_factory=list)
    pods: list[dict[str, Any]] = field(default_factory=list)
    fail_swaps: dict[str, str] = field(default_factory=dict)
    bad_prompts: set[str] = field(default_factory=set)
    swapped: list[tuple[str, str]] = field(default_factory=list)
    created_pods: int = 0

    def observe(self, digest: str) -> Observed:
        return Observed(
            manifest=_resolved(digest),
            replica_sets=replica_set_observations(self.replica_sets, self.pods),
            pods=observed_pods(self.pods),
            prefetch=staged(digest),
        )

    def apply(self, decision: Decision, digest_of: dict[str, str]) -> None:
        for action in decision.scales:
            if isinstance(action, CreateReplicaSet):
                labels = {REVISION_LABEL: action.revision_hash}
                if action.template_hash:
                    labels[TEMPLATE_LABEL] = action.template_hash
                name = f"llm-{action.template_hash or action.revision_hash}"
                self.replica_sets.append(
                    {"metadata": {"name": name, "labels": labels}, "spec": {"replicas": 0}}
                )
                self._resize(name, action.replicas, labels)
            elif isinstance(action, ScaleAction):
                rs = next(r for r in self.replica_sets if r["metadata"]["name"] == action.name)
                self._resize(action.name, action.replicas, dict(rs["metadata"]["labels"]))
        for swap in decision.swaps:
            self.swap(swap)
        for retemplate in decision.retemplates:
            rs = next(r for r in self.replica_sets if r["metadata"]["name"] == retemplate.name)
            rs["metadata"]["labels"][REVISION_LABEL] = retemplate.revision_hash

    def _resize(self, name: str, replicas: int, labels: dict[str, str]) -> None:
        rs = next(r for r in self.replica_sets if r["metadata"]["name"] == name)
        rs["spec"]["replicas"] = replicas
        mine = [p for p in self.pods if p["owner"] == name]
        for pod in mine[replicas:]:
            self.pods.remove(pod)
        for _ in range(replicas - len(mine)):
            self.created_pods += 1
            self.pods.append(_pod(f"{name}-{self.created_pods}", name, labels))

    def swap(self, swap: SwapPod) -> None:
        pod = next(p for p in self.pods if p["metadata"]["name"] == swap.pod)
        record: dict[str, Any] = {
            "to": swap.to_revision_hash,
            "manifestDigest": swap.manifest_digest,
            "revision": swap.revision,
            "from": pod["metadata"]["labels"][REVISION_LABEL],
        }
        self.swapped.append((swap.pod, swap.revision))
        reason = self.fail_swaps.get(swap.manifest_digest)
        if reason is not None:
            record |= {"state": "Failed", "reason": reason, "message": "chunk 3 does not match"}
            _gate(pod, "False", "SwapFailed")
        else:
            record |= {"state": "Swapped", "seconds": 1.5, "pausedSeconds": 0.4}
            pod["metadata"]["labels"][REVISION_LABEL] = swap.to_revision_hash
            if swap.manifest_digest in self.bad_prompts:
                _gate(pod, "False", "GoldenPromptFailed")
            else:
                _gate(pod, "True", "Verified")
        pod["metadata"]["annotations"][SWAP_ANNOTATION] = json.dumps(record)

    def holding(self) -> dict[str, str]:
        return {p["metadata"]["name"]: p["metadata"]["labels"][REVISION_LABEL] for p in self.pods}


def _resolved(digest: str) -> Any:
    from weightship.core.observed import ManifestResolution

    return ManifestResolution(digest=digest)


def _pod(name: str, owner: str, labels: dict[str, str]) -> dict[str, Any]:
    pod: dict[str, Any] = {
        "owner": owner,
        "metadata": {"name": name, "labels": dict(labels), "annotations": {}},
        "spec": {"containers": [{"name": "server"}], "nodeName": "node-1"},
        "status": {"phase": "Running", "podIP": "10.0.0.1", "conditions": []},
    }
    _gate(pod, "True", "Verified")
    return pod


def _gate(pod: dict[str, Any], status: str, reason: str) -> None:
    ready = "True" if status == "True" else "False"
    pod["status"]["conditions"] = [
        {"type": VERIFIED_GATE, "status": status, "reason": reason},
        {"type": "Ready", "status": ready},
        {"type": "ContainersReady", "status": "True"},
    ]


def run(
    rollout: ModelRollout, cluster: Cluster, digest: str, digest_of: dict[str, str], *, rounds: int
) -> ModelRollout:
    """Reconcile ``rounds`` times, carrying out each decision (swaps finish at once)."""
    for i in range(rounds):
        decision = decide(rollout, cluster.observe(digest), at(i))
        cluster.apply(decision, digest_of)
        rollout = with_status(rollout, decision)
    return rollout


def healthy(replicas: int = 2) -> tuple[ModelRollout, Cluster, str]:
    rollout = in_place(make_rollout(STEPS, replicas=replicas))
    cluster = Cluster()
    rollout = run(rollout, cluster, DIGEST_A, {}, rounds=3)
    assert rollout.status.phase == "Healthy", rollout.status.message
    stable = rollout.status.stable_revision
    assert stable is not None and stable.template_hash
    return rollout, cluster, stable.pod_template_hash


def test_the_first_revision_creates_an_in_place_replica_set_selected_by_template() -> None:
    rollout, cluster, stable_hash = healthy()
    (rs,) = cluster.replica_sets
    assert rs["metadata"]["labels"][TEMPLATE_LABEL] == rollout.status.stable_revision.template_hash  # type: ignore[union-attr]
    assert set(cluster.holding().values()) == {stable_hash}


def test_a_model_only_change_swaps_pods_in_place_one_at_a_time_and_promotes() -> None:
    rollout, cluster, _stable_hash = healthy(replicas=2)
    pods_before = set(cluster.holding())
    rollout = with_model_revision(rollout, "v2")
    first = decide(rollout, cluster.observe(DIGEST_B), T0)
    canary = first.status.canary_revision
    assert canary is not None and canary.update == "InPlace", canary
    assert any("update in place" in e.message for e in first.events)
    rollout = run(rollout, cluster, DIGEST_B, {}, rounds=6)
    # setWeight 50 of 2 replicas: exactly one pod swapped, then the pause holds.
    assert rollout.status.phase == "Paused", rollout.status.message
    assert sorted(cluster.holding().values()).count(canary.pod_template_hash) == 1
    assert cluster.created_pods == 2  # nobody was replaced
    control = ControlStatus(promote=PromoteRequest(requested_at="t1"))
    rollout = rollout.model_copy(
        update={"status": rollout.status.model_copy(update={"control": control})}
    )
    rollout = run(rollout, cluster, DIGEST_B, {}, rounds=8)
    assert rollout.status.phase == "Healthy", rollout.status.message
    assert rollout.status.stable_revision.pod_template_hash == canary.pod_template_hash  # type: ignore[union-attr]
    assert set(cluster.holding()) == pods_before  # the same pods, no restart
    assert set(cluster.holding().values()) == {canary.pod_template_hash}
    assert [revision for _pod, revision in cluster.swapped] == ["v2", "v2"]
    (rs,) = cluster.replica_sets  # new pods would start on v2 now
    assert rs["metadata"]["labels"][REVISION_LABEL] == canary.pod_template_hash
    status = rollout.status.in_place
    assert status is not None and all(p.arrival == "Swapped" for p in status.pods), status
    assert all(p.swap_seconds == 1.5 for p in status.pods)


def test_a_bad_golden_prompt_after_a_swap_aborts_and_swaps_the_canary_back() -> None:
    rollout, cluster, stable_hash = healthy(replicas=2)
    cluster.bad_prompts.add(DIGEST_B)
    rollout = run(with_model_revision(rollout, "v3"), cluster, DIGEST_B, {}, rounds=8)
    assert rollout.status.phase == "Degraded", rollout.status.message
    assert rollout.status.abort is not None
    assert set(cluster.holding().values()) == {stable_hash}
    # into one canary, and back to the stable
    assert [r for _p, r in cluster.swapped] == ["v3", STABLE]
    assert cluster.created_pods == 2


def test_a_failed_swap_aborts_with_its_reason_and_repairs_the_pod() -> None:
    rollout, cluster, stable_hash = healthy(replicas=2)
    cluster.fail_swaps[DIGEST_B] = "ChecksumMismatch"
    rollout = run(with_model_revision(rollout, "v4"), cluster, DIGEST_B, {}, rounds=6)
    abort = rollout.status.abort
    assert abort is not None and abort.reason == "SwapFailed", rollout.status
    assert "ChecksumMismatch" in abort.message and "v4" in abort.message
    assert set(cluster.holding().values()) == {stable_hash}
    # The pod went to v4 (refused), then was swapped to stable again to reopen its gate.
    assert [r for _p, r in cluster.swapped] == ["v4", STABLE]


def test_a_template_change_replaces_pods_and_says_why() -> None:
    rollout, cluster, _stable = healthy(replicas=2)
    template = rollout.spec.template.model_copy(deep=True)  # type: ignore[union-attr]
    template.metadata.labels = {**(template.metadata.labels or {}), "tier": "gold"}  # type: ignore[union-attr]
    changed = with_model_revision(rollout, "v2")
    changed = changed.model_copy(
        update={"spec": changed.spec.model_copy(update={"template": template})}
    )
    decision = decide(changed, cluster.observe(DIGEST_B), T0)
    canary = decision.status.canary_revision
    assert canary is not None and canary.update == "Replace"
    assert canary.update_reason == "the pod template changed, not only spec.model"
    assert not decision.swaps


def test_recreate_policy_never_swaps() -> None:
    rollout = make_rollout(STEPS)
    decision = decide(rollout, Cluster().observe(DIGEST_A), T0)
    assert decision.status.canary_revision is not None
    assert decision.status.canary_revision.update == "Replace"
    assert decision.status.canary_revision.update_reason == "updatePolicy is Recreate"
    assert all(isinstance(a, CreateReplicaSet) and a.template_hash is None for a in decision.scales)


@pytest.mark.parametrize("reason", ["MixedWeights", "SwapTimeout"])
def test_a_pod_whose_swap_back_failed_is_restarted(reason: str) -> None:
    rollout, cluster, stable_hash = healthy(replicas=2)
    pod = cluster.pods[0]
    pod["metadata"]["annotations"][SWAP_ANNOTATION] = json.dumps(
        {"state": "Failed", "to": stable_hash, "manifestDigest": DIGEST_A, "reason": reason}
    )
    _gate(pod, "False", "SwapFailed")
    decision = decide(rollout, cluster.observe(DIGEST_A), T0)
    assert decision.restart_pods == (pod["metadata"]["name"],)


def test_a_pod_whose_server_restarted_after_a_swap_swaps_again_to_what_it_should_hold() -> None:
    """Its container restarted (say the engine died): it loaded the weights it was created
    with, its gate failed, and it swaps again to the revision its label names."""
    rollout, cluster, stable_hash = healthy(replicas=2)
    pod = cluster.pods[0]
    pod["metadata"]["annotations"][SWAP_ANNOTATION] = json.dumps(
        {"state": "Swapped", "to": stable_hash, "manifestDigest": DIGEST_A, "restarts": 0}
    )
    pod["status"]["containerStatuses"] = [{"name": "server", "restartCount": 1}]
    _gate(pod, "False", "ChecksumMismatch")
    pod["status"]["conditions"][2]["status"] = "True"  # the server is up again
    decision = decide(rollout, cluster.observe(DIGEST_A), T0)
    assert [(s.pod, s.to_revision_hash, s.purpose) for s in decision.swaps] == [
        (pod["metadata"]["name"], stable_hash, "repair")
    ]
    # Not restarted since its swap: nothing to repair.
    pod["status"]["containerStatuses"] = [{"name": "server", "restartCount": 0}]
    assert not decide(rollout, cluster.observe(DIGEST_A), T0).swaps


def test_a_refused_swap_back_hands_the_pod_back_to_the_verifier() -> None:
    rollout, cluster, stable_hash = healthy(replicas=2)
    pod = cluster.pods[0]
    pod["metadata"]["annotations"][SWAP_ANNOTATION] = json.dumps(
        {"state": "Failed", "to": stable_hash, "manifestDigest": DIGEST_A, "reason": "NoSwapKey"}
    )
    _gate(pod, "False", "SwapFailed")
    decision = decide(rollout, cluster.observe(DIGEST_A), T0)
    assert decision.reverify_pods == (pod["metadata"]["name"],)
    assert not decision.restart_pods and not decision.swaps
    _gate(pod, "False", "Pending")  # handed back: not again
    assert not decide(rollout, cluster.observe(DIGEST_A), T0).reverify_pods


# Parallel swaps within inPlace.maxUnavailable.


def bounded(replicas: int, max_unavailable: int | str, steps: list[dict[str, Any]]) -> Any:
    """A healthy in-place rollout of ``replicas`` pods, its model changed to v2."""
    rollout = in_place(make_rollout(steps, replicas=replicas))
    rollout.spec.strategy.canary.in_place.max_unavailable = max_unavailable
    cluster = Cluster()
    rollout = run(rollout, cluster, DIGEST_A, {}, rounds=3)
    assert rollout.status.phase == "Healthy", rollout.status.message
    return with_model_revision(rollout, "v2"), cluster


def first_swaps(rollout: ModelRollout, cluster: Cluster) -> tuple[ModelRollout, Decision]:
    """Decide (swaps not carried out) until a decision starts swaps."""
    for i in range(6):
        decision = decide(rollout, cluster.observe(DIGEST_B), at(i))
        rollout = with_status(rollout, decision)
        if decision.swaps:
            return rollout, decision
    raise AssertionError(f"no swap started: {rollout.status.message}")


def record_running(cluster: Cluster, swaps: tuple[SwapPod, ...]) -> None:
    """What apply writes as swaps start: the record Swapping, the gate closed."""
    for swap in swaps:
        pod = next(p for p in cluster.pods if p["metadata"]["name"] == swap.pod)
        pod["metadata"]["annotations"][SWAP_ANNOTATION] = json.dumps(
            {
                "state": "Swapping",
                "to": swap.to_revision_hash,
                "manifestDigest": swap.manifest_digest,
                "revision": swap.revision,
                "from": swap.from_revision_hash,
            }
        )
        _gate(pod, "False", "Swapping")


@pytest.mark.parametrize(
    ("replicas", "max_unavailable", "at_once"),
    [
        (4, "25%", 1),
        (4, "50%", 2),
        (4, "100%", 4),
        (4, 2, 2),
        (4, 10, 4),  # more than the replicas: all of them
        (4, "30%", 1),  # 1.2 rounds down
        (4, "10%", 1),  # 0.4 rounds down to 0: at least 1
        (5, "60%", 3),
        (7, "50%", 3),  # 3.5 rounds down
    ],
)
def test_a_promotion_swaps_as_many_pods_at_once_as_max_unavailable_allows(
    replicas: int, max_unavailable: int | str, at_once: int
) -> None:
    rollout, cluster = bounded(replicas, max_unavailable, [{"setWeight": 100}])
    rollout, decision = first_swaps(rollout, cluster)
    assert len(decision.swaps) == at_once
    assert len({s.pod for s in decision.swaps}) == at_once
    assert {s.revision for s in decision.swaps} == {"v2"}
    (event,) = [e for e in decision.events if e.reason == "SwapsStarted"]
    assert f"started {at_once} swap(s)" in event.message, event.message
    assert f"maxUnavailable {max_unavailable} of {replicas} replicas" in event.message
    # Running, they fill the bound: nothing more starts until one ends and is verified.
    record_running(cluster, decision.swaps)
    following = decide(rollout, cluster.observe(DIGEST_B), at(7))
    assert not following.swaps
    status = following.status.in_place
    assert status is not None and status.swapping_pods == at_once, status
    # They end; carried out to the end, every pod swapped once and none was replaced.
    for swap in decision.swaps:
        cluster.swap(swap)
    rollout = run(rollout, cluster, DIGEST_B, {}, rounds=12)
    assert rollout.status.phase == "Healthy", rollout.status.message
    assert sorted(p for p, _r in cluster.swapped) == sorted(cluster.holding())
    assert cluster.created_pods == replicas


def test_the_bound_resolves_against_spec_replicas_in_status() -> None:
    rollout, cluster = bounded(7, "50%", [{"setWeight": 100}])
    _rollout, decision = first_swaps(rollout, cluster)
    assert decision.status.in_place is not None
    assert decision.status.in_place.max_unavailable == 3


def test_pods_already_out_of_traffic_count_against_the_bound() -> None:
    rollout, cluster = bounded(4, "50%", [{"setWeight": 100}])
    down = cluster.pods[3]
    _gate(down, "False", "Pending")
    down["status"]["conditions"][2]["status"] = "False"  # its server is not up: no candidate
    _rollout, decision = first_swaps(rollout, cluster)
    assert len(decision.swaps) == 1
    assert down["metadata"]["name"] not in {s.pod for s in decision.swaps}


def test_a_canary_step_swaps_only_its_share_however_large_the_bound() -> None:
    rollout, cluster = bounded(4, "100%", STEPS)  # setWeight 50, pause, 100
    rollout, decision = first_swaps(rollout, cluster)
    assert len(decision.swaps) == 2
    # A running swap counts as arrived: the next decision does not start another.
    record_running(cluster, decision.swaps)
    assert not decide(rollout, cluster.observe(DIGEST_B), at(7)).swaps


@pytest.mark.parametrize(("max_unavailable", "back_at_once"), [(1, 1), (2, 2)])
def test_a_pod_out_of_traffic_already_swaps_back_without_taking_a_place(
    max_unavailable: int, back_at_once: int
) -> None:
    """A canary pod whose checks have not passed yet is out of traffic: it holds a place
    already, and swapping it back takes nothing more out."""
    rollout, cluster = bounded(4, max_unavailable, STEPS)
    rollout = run(rollout, cluster, DIGEST_B, {}, rounds=8)
    assert rollout.status.phase == "Paused", rollout.status.message
    canary = rollout.status.canary_revision
    assert canary is not None
    on_canary = sorted(
        p["metadata"]["name"]
        for p in cluster.pods
        if p["metadata"]["labels"][REVISION_LABEL] == canary.pod_template_hash
    )
    assert len(on_canary) == 2
    unready = next(p for p in cluster.pods if p["metadata"]["name"] == on_canary[1])
    _gate(unready, "False", "Pending")  # the verifier checks it again
    rollout = aborted(rollout)
    rollout, decision = first_swaps(rollout, cluster)
    # The unready pod first and free; the ready one only if a place is left.
    assert [s.pod for s in decision.swaps] == [on_canary[1], on_canary[0]][:back_at_once]


def aborted(rollout: ModelRollout) -> ModelRollout:
    abort = ControlStatus(abort=AbortRequest(requested_at="t1", reason="bad answers"))
    return rollout.model_copy(
        update={"status": rollout.status.model_copy(update={"control": abort})}
    )


@pytest.mark.parametrize(("max_unavailable", "at_once"), [(1, 1), ("50%", 2), ("100%", 2)])
def test_an_abort_swaps_the_canary_pods_back_in_parallel_under_the_bound(
    max_unavailable: int | str, at_once: int
) -> None:
    rollout, cluster = bounded(4, max_unavailable, STEPS)
    rollout = run(rollout, cluster, DIGEST_B, {}, rounds=8)
    assert rollout.status.phase == "Paused", rollout.status.message
    stable = rollout.status.stable_revision
    assert stable is not None
    rollout, decision = first_swaps(aborted(rollout), cluster)
    assert len(decision.swaps) == at_once
    assert {(s.to_revision_hash, s.purpose) for s in decision.swaps} == {
        (stable.pod_template_hash, "rollback")
    }
    # No new swap to the canary starts, and the swaps back finish the abort.
    record_running(cluster, decision.swaps)
    assert not decide(rollout, cluster.observe(DIGEST_B), at(7)).swaps
    for swap in decision.swaps:
        cluster.swap(swap)
    rollout = run(rollout, cluster, DIGEST_B, {}, rounds=8)
    assert set(cluster.holding().values()) == {stable.pod_template_hash}
    assert rollout.status.phase == "Degraded", rollout.status.message
