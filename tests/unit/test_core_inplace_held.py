"""Swaps in traffic ("never dark", core.inplace): where leaving traffic would break
inPlace.maxUnavailable or leave no pod serving, a pod swaps with its gate open and its
server holding requests. Driven through the real decision core, the controller's own pod
writes (apply.pod_condition_writes) and snapshot, with the swapper's reports and the
verifier's verdicts fed back as the observation sources they are; each round checks that
some pod is in traffic, and that a pod in traffic whose weights have not passed is one
whose server holds its requests."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
from tests.unit.test_core_inplace import Cluster, _resolved, in_place

from weightship.api.models import ModelRollout
from weightship.api.names import (
    DIGEST_ANNOTATION,
    LOADED_ANNOTATION,
    SWAP_ANNOTATION,
    VERIFIED_GATE,
)
from weightship.controller.apply import pod_condition_writes
from weightship.controller.snapshot import observed_pods, pod_swap, replica_set_observations
from weightship.controller.verifier import on_gate
from weightship.core.decide import decide
from weightship.core.decision import Decision, SwapPod
from weightship.core.inplace import where
from weightship.core.observed import Observed, ObservedPod, PodSwap, PodVerdict
from weightship.core.pod_gates import pod_gates
from weightship.core.verification import IN_PROGRESS_REASONS, gate_passed, verdict_reason
from weightship_testing.core import DIGEST_A, DIGEST_B, at, make_rollout, staged, with_status

HELD_S = 2.5  # what the fake server says it held requests for
STEPS = [{"setWeight": 50}, {"pause": {}}, {"setWeight": 100}]


def _condition(pod: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(c for c in pod["status"]["conditions"] if c["type"] == kind)


@dataclass
class Live(Cluster):
    """The simulated cluster with the swapper and the verifier as the controller runs
    them: a swap started in one round is reported ended in the next; a pod whose gate is
    in progress gets a verdict (bad digests fail their golden prompt)."""

    reports: dict[str, PodSwap] = field(default_factory=dict)
    verdicts: dict[str, PodVerdict] = field(default_factory=dict)
    running: list[SwapPod] = field(default_factory=list)
    round: int = 0
    events: list[tuple[str, str]] = field(default_factory=list)
    holding_at_once: int = 0
    in_traffic_swaps: list[tuple[str, str]] = field(default_factory=list)

    def swap(self, swap: SwapPod) -> None:  # called by Cluster.apply: the swapper's turn
        self.swapped.append((swap.pod, swap.revision))
        if swap.in_traffic:
            self.in_traffic_swaps.append((swap.pod, swap.revision))
        self.running.append(swap)

    def observe(self, digest: str) -> Observed:
        for pod in self.pods:  # pods of the base simulator carry no uid
            pod["metadata"].setdefault("uid", pod["metadata"]["name"])
        return Observed(
            manifest=_resolved(digest),
            replica_sets=replica_set_observations(self.replica_sets, self.pods),
            pods=observed_pods(self.pods, self.verdicts, self.reports),
            prefetch=staged(digest),
        )

    def reconcile(self, rollout: ModelRollout, digest: str) -> tuple[ModelRollout, Decision]:
        self.round += 1
        decision = decide(rollout, self.observe(digest), at(self.round))
        self.events += [(e.reason, e.message) for e in decision.events]
        self.apply(decision, {})
        self._write(decision)
        self._swapper()
        self._verifier()
        self._check()
        return with_status(rollout, decision), decision

    def run(self, rollout: ModelRollout, digest: str, rounds: int) -> ModelRollout:
        for _ in range(rounds):
            rollout, _decision = self.reconcile(rollout, digest)
        return rollout

    def _pod(self, name: str) -> dict[str, Any]:
        return next(p for p in self.pods if p["metadata"]["name"] == name)

    def _write(self, decision: Decision) -> None:
        """What apply writes (the same writes, in the same order); kubelet's Ready follows
        the gate at once."""
        for write in pod_condition_writes(decision):
            pod = self._pod(write.pod)
            others = [c for c in pod["status"]["conditions"] if c["type"] != VERIFIED_GATE]
            pod["status"]["conditions"] = [write.condition, *others]
            _condition(pod, "Ready")["status"] = write.condition["status"]
            for key, value in (write.annotations or {}).items():
                if value is None:
                    pod["metadata"]["annotations"].pop(key, None)
                else:
                    pod["metadata"]["annotations"][key] = value
            pod["metadata"]["labels"].update(write.labels or {})

    def _swapper(self) -> None:
        """Reports for the swaps started last round; reports the records show are dropped."""
        for uid in list(self.reports):
            record = pod_swap(self._pod(uid)["metadata"]["annotations"])
            if record is not None and record.state != "Swapping":
                del self.reports[uid]
        for swap in self.running:
            record = swap.record()
            reason = self.fail_swaps.get(swap.manifest_digest)
            if reason is not None:
                ended = replace(record, state="Failed", reason=reason, message="chunk 3 is bad")
            else:
                ended = replace(record, state="Swapped", seconds=0.2, paused_seconds=0.1)
            self.reports[swap.pod] = replace(ended, finished_at=at(self.round))
        self.running = [s for s in self.running if False]

    def _verifier(self) -> None:
        for uid, verdict in list(self.verdicts.items()):
            if on_gate(self._pod(uid), verdict):
                del self.verdicts[uid]
        for pod in self.pods:
            gate = _condition(pod, VERIFIED_GATE)
            name = pod["metadata"]["name"]
            if gate["reason"] not in IN_PROGRESS_REASONS or name in self.verdicts:
                continue
            digest = pod["metadata"]["annotations"].get(DIGEST_ANNOTATION)
            record = pod_swap(pod["metadata"]["annotations"])
            held = record is not None and record.in_traffic
            if digest in self.bad_prompts:
                self.verdicts[name] = PodVerdict(
                    "False", "GoldenPromptFailed", "golden prompt 'capital': got Lyon", at(0)
                )
            else:
                note = json.dumps({"heldSeconds": HELD_S} if held else {})
                self.verdicts[name] = PodVerdict(
                    "True",
                    "Verified",
                    "checksum loaded; 1/1 golden prompts passed",
                    at(0),
                    annotations=((LOADED_ANNOTATION, note),),
                    held_seconds=HELD_S if held else None,
                )

    def _check(self) -> None:
        """Never dark; a pod in traffic whose weights have not passed is held by its
        server (it swaps in traffic); no pod holds bad weights with its gate passed."""
        ready = [p for p in self.pods if _condition(p, "Ready")["status"] == "True"]
        assert ready, f"round {self.round}: no pod in traffic"
        holding = 0
        for pod in ready:
            gate = _condition(pod, VERIFIED_GATE)
            if gate_passed(gate["status"], gate["reason"]):
                digest = pod["metadata"]["annotations"].get(DIGEST_ANNOTATION)
                assert digest not in self.bad_prompts, pod
                continue
            record = pod_swap(pod["metadata"]["annotations"])
            assert record is not None and record.in_traffic, (self.round, gate, record)
            if record.state != "Failed":
                holding += 1
        self.holding_at_once = max(self.holding_at_once, holding)


def one_replica(max_unavailable: int | str = "25%", replicas: int = 1) -> tuple[Any, Live]:
    rollout = in_place(make_rollout(STEPS, replicas=replicas))
    rollout.spec.strategy.canary.in_place.max_unavailable = max_unavailable
    cluster = Live()
    rollout = cluster.run(rollout, DIGEST_A, 3)
    assert rollout.status.phase == "Healthy", rollout.status.message
    for pod in cluster.pods:
        pod["metadata"]["annotations"][DIGEST_ANNOTATION] = DIGEST_A
    return rollout, cluster


def revision(rollout: ModelRollout, name: str, steps: list[dict[str, Any]]) -> ModelRollout:
    model = rollout.spec.model.model_copy(update={"revision": name})
    strategy = rollout.spec.strategy.model_copy(deep=True)
    strategy.canary.steps = make_rollout(steps).spec.strategy.canary.steps
    spec = rollout.spec.model_copy(update={"model": model, "strategy": strategy})
    metadata = rollout.metadata.model_copy(update={"generation": rollout.metadata.generation + 1})
    return rollout.model_copy(update={"spec": spec, "metadata": metadata})


def test_one_replica_swaps_in_traffic_and_is_never_dark() -> None:
    rollout, cluster = one_replica()
    (name,) = cluster.holding()
    rollout = cluster.run(revision(rollout, "v2", [{"setWeight": 100}]), DIGEST_B, 10)
    assert rollout.status.phase == "Healthy", rollout.status.message
    assert rollout.status.stable_revision is not None
    assert set(cluster.holding().values()) == {rollout.status.stable_revision.pod_template_hash}
    assert cluster.in_traffic_swaps == [(name, "v2")]
    assert cluster.created_pods == 1
    started = [m for r, m in cluster.events if r == "SwapsStarted"]
    assert len(started) == 1 and f"{name} to v2 in traffic" in started[0], started
    assert "its server holds requests" in started[0]
    held = [m for r, m in cluster.events if r == "SwapHeld"]
    assert held == [
        f"pod {name} stayed in traffic while it swapped to v2 in place: its server held "
        f"requests {HELD_S:.2f} s, until verified weights answered them"
    ]
    status = rollout.status.in_place
    assert status is not None and status.max_unavailable == 1
    (pod,) = status.pods
    assert pod.in_traffic is True and pod.held_seconds == HELD_S, pod
    assert pod.swap_state == "Swapped" and pod.swap_to == "v2"


def test_one_replica_with_a_bad_revision_is_held_swapped_back_and_never_dark() -> None:
    """The golden prompt fails on the swapped weights: the gate stays open (its server
    holds the requests), the canary aborts, and the old weights go back in traffic too."""
    rollout, cluster = one_replica()
    (name,) = cluster.holding()
    stable = rollout.status.stable_revision
    assert stable is not None
    cluster.bad_prompts.add(DIGEST_B)
    rollout = cluster.run(revision(rollout, "v3", [{"setWeight": 100}]), DIGEST_B, 12)
    assert rollout.status.phase == "Degraded", rollout.status.message
    assert rollout.status.abort is not None
    assert rollout.status.abort.reason == "VerificationFailed", rollout.status.abort
    assert set(cluster.holding().values()) == {stable.pod_template_hash}
    assert cluster.in_traffic_swaps == [(name, "v3"), (name, stable.revision)]
    gate = _condition(cluster.pods[0], VERIFIED_GATE)
    assert gate_passed(gate["status"], gate["reason"]), gate
    assert cluster.holding_at_once == 1


def test_a_swap_refused_before_any_weight_changed_stays_in_traffic_on_the_old_weights() -> None:
    rollout, cluster = one_replica()
    stable = rollout.status.stable_revision
    assert stable is not None
    cluster.fail_swaps[DIGEST_B] = "ChecksumMismatch"
    rollout = cluster.run(revision(rollout, "v5", [{"setWeight": 100}]), DIGEST_B, 10)
    abort = rollout.status.abort
    assert abort is not None and abort.reason == "SwapFailed", rollout.status
    assert set(cluster.holding().values()) == {stable.pod_template_hash}
    gate = _condition(cluster.pods[0], VERIFIED_GATE)
    assert gate_passed(gate["status"], gate["reason"]), gate


def test_a_refused_swap_back_in_traffic_is_verified_again_with_its_gate_open() -> None:
    """The swap back itself refused before any weight changed (say the swap key went
    missing): the server never left the stable weights, so the pod stays in traffic while
    the verifier checks them again; one out of traffic is handed back closed, as before."""
    rollout, cluster = one_replica()
    stable = rollout.status.stable_revision
    assert stable is not None
    pod = cluster.pods[0]
    record = {"state": "Failed", "to": stable.pod_template_hash, "manifestDigest": DIGEST_A}
    record |= {"reason": "NoSwapKey", "inTraffic": True}
    pod["metadata"]["annotations"][SWAP_ANNOTATION] = json.dumps(record)
    _condition(pod, VERIFIED_GATE).update(status="True", reason="SwapFailed")
    decision = decide(rollout, cluster.observe(DIGEST_A), at(50))
    assert not decision.reverify_pods
    (gate,) = [g for g in decision.pod_gates if g.pod == pod["metadata"]["name"]]
    assert (gate.status, gate.reason) == ("True", "Pending"), gate
    _condition(pod, VERIFIED_GATE).update(status="False")
    _condition(pod, "Ready")["status"] = "False"
    decision = decide(rollout, cluster.observe(DIGEST_A), at(51))
    assert decision.reverify_pods == (pod["metadata"]["name"],)
    assert not [g for g in decision.pod_gates if g.pod == pod["metadata"]["name"]]


def test_max_unavailable_zero_swaps_every_pod_in_traffic_one_at_a_time() -> None:
    rollout, cluster = one_replica(max_unavailable=0, replicas=3)
    rollout = cluster.run(revision(rollout, "v2", [{"setWeight": 100}]), DIGEST_B, 20)
    assert rollout.status.phase == "Healthy", rollout.status.message
    assert sorted(p for p, _r in cluster.in_traffic_swaps) == sorted(cluster.holding())
    assert cluster.holding_at_once == 1
    assert rollout.status.in_place is not None and rollout.status.in_place.max_unavailable == 0
    started = [m for r, m in cluster.events if r == "SwapsStarted"]
    assert all(m.startswith("started 1 swap(s)") for m in started), started
    assert "maxUnavailable 0 of 3 replicas" in started[0]


def test_two_replicas_swap_out_of_traffic_one_at_a_time_as_before() -> None:
    rollout, cluster = one_replica(replicas=2)
    rollout = cluster.run(revision(rollout, "v2", [{"setWeight": 100}]), DIGEST_B, 14)
    assert rollout.status.phase == "Healthy", rollout.status.message
    assert len(cluster.swapped) == 2 and not cluster.in_traffic_swaps


def test_the_last_serving_pod_swaps_in_traffic_when_the_bound_would_take_them_all() -> None:
    """maxUnavailable 100 % of 2: one leaves traffic, the other (the last serving) swaps
    in traffic at the same time."""
    rollout, cluster = one_replica(max_unavailable="100%", replicas=2)
    rollout, decision = cluster.reconcile(revision(rollout, "v2", [{"setWeight": 100}]), DIGEST_B)
    while not decision.swaps:
        rollout, decision = cluster.reconcile(rollout, DIGEST_B)
    assert sorted(s.in_traffic for s in decision.swaps) == [False, True]
    rollout = cluster.run(rollout, DIGEST_B, 10)
    assert rollout.status.phase == "Healthy", rollout.status.message


def _observed(*, ready: bool = True, swap: PodSwap | None = None, verified: bool = True) -> Any:
    return ObservedPod(
        "p",
        ready=ready,
        gate_open=ready,
        weights_verified=verified,
        swap=swap,
        containers_ready=True,
    )


HELD_SWAP = PodSwap("h2", DIGEST_B, "v2", "Swapped", in_traffic=True)


@pytest.mark.parametrize(
    ("bound", "room", "serving", "holding_now", "pod", "expected"),
    [
        (1, 1, 2, 0, _observed(), False),  # a place, another pod serves: out of traffic
        (1, 0, 2, 0, _observed(), None),  # the bound is full: wait for a place
        (1, 1, 1, 0, _observed(), True),  # the last serving pod: in traffic
        (0, 0, 3, 0, _observed(), True),  # maxUnavailable 0: in traffic
        (0, 0, 3, 1, _observed(), None),  # one pod swaps in traffic at a time
        (1, 1, 1, 1, _observed(), None),
        (0, 0, 1, 1, _observed(swap=HELD_SWAP, verified=False), True),  # its swap back
        (0, 0, 1, 0, _observed(ready=False), False),  # out of traffic already: stays out
    ],
)
def test_where_a_swap_runs(
    bound: int, room: int, serving: int, holding_now: int, pod: Any, expected: bool | None
) -> None:
    assert where(bound, room, serving, holding_now, pod) is expected


def test_a_verdict_against_weights_held_in_traffic_keeps_the_gate_open() -> None:
    verdict = PodVerdict("False", "GoldenPromptFailed", "got Lyon", at(1))
    pod = _observed(swap=HELD_SWAP, verified=False)
    pod = replace(pod, verdict=verdict, gate_reason="Pending", gate_message="verifying")
    (gate,) = pod_gates(make_rollout().spec, [pod], at(1))
    assert (gate.status, gate.reason) == ("True", "GoldenPromptFailed")
    # A restarted server holds nothing: the verdict closes the gate.
    (gate,) = pod_gates(
        make_rollout().spec, [replace(pod, verdict=replace(verdict, restarted=True))], at(1)
    )
    assert gate.status == "False"
    # Out of traffic, as before.
    out = replace(pod, swap=replace(HELD_SWAP, in_traffic=False), gate_open=False)
    (gate,) = pod_gates(make_rollout().spec, [out], at(1))
    assert gate.status == "False"


@pytest.mark.parametrize(
    ("status", "reason", "passed", "verdict"),
    [
        ("True", "Verified", True, False),
        ("True", "NothingToVerify", True, False),
        ("True", "Pending", False, False),  # in traffic, checks running
        ("True", "Swapping", False, False),
        ("True", "GoldenPromptFailed", False, True),  # in traffic, held, failed
        ("False", "GoldenPromptFailed", False, True),
        ("False", "Draining", False, False),
        ("False", "SwapFailed", False, False),
    ],
)
def test_what_a_gate_says_of_its_weights(
    status: str, reason: str, passed: bool, verdict: bool
) -> None:
    assert gate_passed(status, reason) is passed
    assert verdict_reason(status, reason) is verdict
