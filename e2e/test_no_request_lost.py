"""No request lost in a rollout (issue 23, item 1), end to end: a client sends steady load
to the ready endpoints of a Service over 3 replicas of the reference server (as a router
would: EndpointSlices, round robin) while the rollout is promoted from v1 to v2, a canary
is aborted, and a canary is dropped by reverting the spec. Every pod that goes first leaves
the endpoints (its weights-verified gate goes False, reason Draining, an Event says so)
and is deleted only after scaleDownDelaySeconds; not one request fails."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from e2e.operator_fixtures import Rollouts, tinyllm_models, tinyllm_rollout_body
from weightship import rollouts as user_actions
from weightship.api.names import REVISION_LABEL, ROLLOUT_LABEL, VERIFIED_GATE
from weightship.core.verification import DRAINING
from weightship_dev import testkit
from weightship_dev.loadgen import ServiceLoad, app_service
from weightship_testing.tinyllm.settings import DEFAULT_PORT

NAMESPACE_PREFIX = "nrl-"
REPLICAS = 3
STEPS = [{"setWeight": 34}, {"pause": {}}]  # one canary pod of three, then wait for us
DRAIN_S = 3
RATE = 8.0  # requests per second


@pytest.fixture(scope="module")
def models(cluster: Any) -> Iterator[dict[str, str]]:
    yield from tinyllm_models(
        cluster.s3_endpoint, "nrl", [("v1", "good", 0), ("v2", "good", 1), ("v3", "good", 2)]
    )


def pods_of(cluster: Any, namespace: str, revision_hash: str) -> list[Any]:
    return list(
        cluster.core.list_namespaced_pod(
            namespace, label_selector=f"{ROLLOUT_LABEL}=llm,{REVISION_LABEL}={revision_hash}"
        ).items
    )


def wait_gone(cluster: Any, namespace: str, revision_hash: str, what: str) -> None:
    testkit.wait_until(
        lambda: not pods_of(cluster, namespace, revision_hash),
        timeout=120,
        what=what,
        detail=lambda: str([p.metadata.name for p in pods_of(cluster, namespace, revision_hash)]),
    )


def drained_events(rollouts: Rollouts) -> list[str]:
    return [e.message for e in rollouts.events("llm") if e.reason == DRAINING]


def wait_drained(cluster: Any, rollouts: Rollouts, revision_hash: str, what: str) -> None:
    """Every pod of ``revision_hash`` left the endpoints before it went: the Draining event
    names it, and while it was still there its gate said Draining and it was not ready."""
    names = {p.metadata.name for p in pods_of(cluster, rollouts.namespace, revision_hash)}
    assert names, f"{what}: no pods of {revision_hash} to watch"
    seen: set[str] = set()

    def check() -> bool:
        for pod in pods_of(cluster, rollouts.namespace, revision_hash):
            conditions = {c.type: c for c in pod.status.conditions or []}
            gate, ready = conditions.get(VERIFIED_GATE), conditions.get("Ready")
            if gate and gate.reason == DRAINING and ready and ready.status == "False":
                seen.add(pod.metadata.name)
        return not pods_of(cluster, rollouts.namespace, revision_hash)

    testkit.wait_until(check, timeout=120, interval=0.2, what=what)
    events = " ".join(drained_events(rollouts))
    assert all(n in events for n in names), (names, events)
    assert seen == names, f"{what}: pods deleted without being seen drained: {names - seen}"


def test_no_request_fails_through_a_promotion_an_abort_and_a_rollback(
    cluster: Any, rollouts: Rollouts, models: dict[str, str]
) -> None:
    ns = rollouts.namespace
    app_service(cluster.core, ns, "llm", DEFAULT_PORT)
    body = tinyllm_rollout_body(
        "llm",
        models["v1"],
        "v1",
        STEPS,
        cluster.s3_endpoint,
        REPLICAS,
        scaleDownDelaySeconds=DRAIN_S,
        abortScaleDownDelaySeconds=DRAIN_S,
    )
    rollouts.create(body)
    v1 = rollouts.healthy_on("llm", "v1")["status"]["stableRevision"]["podTemplateHash"]
    load = ServiceLoad(
        cluster.api,
        ns,
        "llm",
        DEFAULT_PORT,
        "/v1/completions",
        {"prompt": "The capital of France is", "max_tokens": 4},
        rate=RATE,
        timeout_s=30.0,
    )
    with load:
        # 1. v1 -> v2: a canary pod, promoted; the three v1 pods drain, then go.
        rollouts.set_model("llm", models["v2"], "v2")
        rollouts.wait_phase("llm", "Paused", timeout=120)
        user_actions.promote(cluster.api, ns, "llm")
        status = rollouts.healthy_on("llm", "v2")["status"]
        v2 = status["stableRevision"]["podTemplateHash"]
        wait_drained(cluster, rollouts, v1, "the v1 pods drained and deleted")
        during_promotion = load.count()

        # 2. v3, aborted: its canary pod leaves the endpoints at once, then goes.
        rollouts.set_model("llm", models["v3"], "v3")
        v3 = rollouts.wait_phase("llm", "Paused", timeout=120)["status"]["canaryRevision"][
            "podTemplateHash"
        ]
        user_actions.abort(cluster.api, ns, "llm", reason="no request lost e2e")
        rollouts.wait_phase("llm", "Degraded")
        wait_drained(cluster, rollouts, v3, "the aborted v3 canary drained and deleted")

        # 3. A rollback while a canary serves: v1 again as a canary, then the spec goes
        #    back to v2 (what a GitOps revert does); the canary drains, then goes.
        rollouts.set_model("llm", models["v1"], "v1")
        canary = rollouts.wait(
            "llm",
            "a v1 canary serving",
            lambda s: (
                s.get("phase") == "Paused"
                and (s.get("canaryRevision") or {}).get("revision") == "v1"
            ),
            timeout=120,
        )["status"]["canaryRevision"]["podTemplateHash"]
        rollouts.set_model("llm", models["v2"], "v2")
        rollouts.healthy_on("llm", "v2")
        wait_drained(cluster, rollouts, canary, "the reverted v1 canary drained and deleted")
        assert len(pods_of(cluster, ns, v2)) == REPLICAS
    answers = load.answers
    t0 = answers[0].started if answers else 0.0
    failed = [a for a in answers if not a.ok]
    print(
        f"no request lost: {len(failed)} failed of {len(answers)} requests "
        f"({during_promotion} through the promotion) at {RATE:g}/s over a promotion, an "
        f"abort and a rollback; {load.no_endpoint_waits} waits for an endpoint"
    )
    assert len(answers) >= 50, "the load never ran"
    assert not failed, [(a.endpoint, a.status, a.error, a.started - t0) for a in failed[:10]]
