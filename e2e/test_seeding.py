"""Broadcast seeding end to end on process nodes: node agents stage the weights, the
reference server loads them, and when the canary scales from 1 to 3 the operator names the
first verified replica as root and the two new ones receive its weights over gloo."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from e2e.agent_fixtures import PROCESS, Agents
from e2e.operator_fixtures import (
    Rollouts,
    tinyllm_models,
    tinyllm_rollout_body,
)
from weightship import rollouts as user_actions
from weightship.api.env import SEED_KEY_ENV
from weightship.api.names import REVISION_LABEL, VERIFIED_GATE
from weightship.controller.seedkey import seed_key_secret_name
from weightship.core.seedtoken import join_token
from weightship.seeding.protocol import JOIN_PATH
from weightship_dev import testkit
from weightship_testing.tinyllm.settings import DEFAULT_PORT

NAMESPACE_PREFIX = "sd-"
# 1 canary pod at 33 %, then 3: the scale-up the broadcast serves; the pause keeps the
# canary's status (who seeded whom) in view until the test promotes.
STEPS = [{"setWeight": 33}, {"setWeight": 100}, {"pause": {}}]


@pytest.fixture(scope="module")
def models(cluster: Any) -> Iterator[dict[str, str]]:
    yield from tinyllm_models(
        cluster.s3_endpoint, "seeding", [("v1", "good", 0), ("v2", "good", 1)]
    )


def start(
    cluster: Any, rollouts: Rollouts, models: dict[str, str], env: dict[str, str] | None = None
) -> None:
    """v1 stable on 3 replicas, then v2 as the canary."""
    body = tinyllm_rollout_body(
        "llm",
        models["v1"],
        "v1",
        STEPS,
        cluster.s3_endpoint,
        replicas=3,
        env={"WEIGHTSHIP_SEED_BUCKET_BYTES": str(1 << 20), **(env or {})},
    )
    body["spec"]["prefetch"] = {"enabled": True, "nodeSelector": PROCESS, "minStagedPercent": 100}
    body["spec"]["seeding"] = {"broadcast": True, "backend": "gloo", "timeoutSeconds": 30}
    rollouts.create(body)
    rollouts.healthy_on("llm", "v1", timeout=150)
    rollouts.set_model("llm", models["v2"], "v2")


def canary_pods(cluster: Any, namespace: str, status: dict[str, Any]) -> list[Any]:
    canary = status["canaryRevision"]["podTemplateHash"]
    return list(
        cluster.core.list_namespaced_pod(
            namespace, label_selector=f"{REVISION_LABEL}={canary}"
        ).items
    )


def gate(pod: Any) -> Any:
    return next((c for c in pod.status.conditions or [] if c.type == VERIFIED_GATE), None)


def is_ready(pod: Any) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])


def paused_on_three(rollouts: Rollouts) -> dict[str, Any]:
    return rollouts.wait(
        "llm",
        "paused with 3 verified canary pods",
        lambda s: (
            s.get("phase") == "Paused"
            and (s.get("verification") or {}).get("verified") == 3
            and len((s.get("verification") or {}).get("loads") or []) == 3
        ),
        timeout=150,
    )["status"]


def post_join(ip: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        f"http://{ip}:{DEFAULT_PORT}{JOIN_PATH}", data=json.dumps(body).encode(), method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def assert_root_refuses_strangers(cluster: Any, rollouts: Rollouts, root: Any) -> None:
    """The root pod's real server: a join with only its URL and the manifest digest, or
    with a token made without the rollout's key, gets nothing (issue 12, High 2)."""
    digest = root.metadata.annotations["weightship.io/manifest-digest"]
    join = {"group": "stranger", "worldSize": 2, "member": "x", "digest": digest}
    status, doc = post_join(root.status.pod_ip, join)
    assert (status, doc["reason"]) == (401, "TokenMissing"), doc
    uid = rollouts.get("llm")["metadata"]["uid"]
    forged = join_token(bytes(32), uid, digest, "stranger", 2_000_000_000)
    status, doc = post_join(root.status.pod_ip, {**join, "token": forged})
    assert (status, doc["reason"]) == (403, "TokenInvalid"), doc
    assert "storePort" not in doc and forged not in json.dumps(doc)
    # The key: one Secret per rollout, owned by it; pods read it by reference only.
    secret = cluster.core.read_namespaced_secret(seed_key_secret_name("llm"), rollouts.namespace)
    assert secret.metadata.labels["weightship.io/seeding-key"] == "true"
    assert [o.uid for o in secret.metadata.owner_references] == [uid]
    env = {e.name: e for e in root.spec.containers[0].env}
    assert (
        env[SEED_KEY_ENV].value is None and env[SEED_KEY_ENV].value_from.secret_key_ref.key == "key"
    )


def promote_to_healthy(cluster: Any, rollouts: Rollouts) -> None:
    user_actions.promote(cluster.api, rollouts.namespace, "llm")
    rollouts.healthy_on("llm", "v2")


def test_scale_up_seeds_new_replicas_by_broadcast(
    cluster: Any, agents: Agents, rollouts: Rollouts, models: dict[str, str]
) -> None:
    start(cluster, rollouts, models)
    status = paused_on_three(rollouts)
    loads = {load["pod"]: load for load in status["verification"]["loads"]}
    (root,) = [p for p, load in loads.items() if load.get("source") != "broadcast"]
    assert loads[root]["source"] == "cache", loads  # the first canary pod: staged weights
    seeded = [load for load in loads.values() if load.get("source") == "broadcast"]
    assert len(seeded) == 2, loads
    for load in seeded:
        assert load["seededFrom"] == root and load["seconds"] > 0, load
    for pod in canary_pods(cluster, rollouts.namespace, status):
        condition = gate(pod)
        assert condition.status == "True", condition
        assert is_ready(pod)
        if pod.metadata.name != root:
            assert f"seeded by {root}" in condition.message
    (root_pod,) = [
        p for p in canary_pods(cluster, rollouts.namespace, status) if p.metadata.name == root
    ]
    assert_root_refuses_strangers(cluster, rollouts, root_pod)
    promote_to_healthy(cluster, rollouts)


def test_root_killed_mid_broadcast_falls_back_to_the_node_cache(
    cluster: Any, agents: Agents, rollouts: Rollouts, models: dict[str, str]
) -> None:
    # The root process exits after sending one 1 MiB bucket of the ~11 MiB model.
    start(cluster, rollouts, models, env={"WEIGHTSHIP_SEED_FAULT": "root-exit-after-buckets=1"})
    status = paused_on_three(rollouts)
    loads = status["verification"]["loads"]
    assert all(load["source"] == "cache" for load in loads), loads
    pods = canary_pods(cluster, rollouts.namespace, status)
    restarted = [
        p.metadata.name
        for p in pods
        if sum(c.restart_count for c in p.status.container_statuses or []) > 0
    ]
    assert len(restarted) == 1, "the root died and was restarted by its kubelet"
    assert all(is_ready(p) and gate(p).status == "True" for p in pods)
    promote_to_healthy(cluster, rollouts)


def test_tampered_broadcast_is_caught_and_never_serves(
    cluster: Any, agents: Agents, rollouts: Rollouts, models: dict[str, str]
) -> None:
    # Each receiver flips a byte of one bucket it received (test-only fault knob).
    start(cluster, rollouts, models, env={"WEIGHTSHIP_SEED_FAULT": "tamper"})
    seen_ready: set[str] = set()

    def rolled_back() -> dict[str, Any] | None:
        s = rollouts.get("llm").get("status") or {}
        if s.get("canaryRevision"):
            for pod in canary_pods(cluster, rollouts.namespace, s):
                if is_ready(pod):
                    seen_ready.add(pod.metadata.name)
        return s if s.get("phase") == "Degraded" else None

    status = testkit.wait_until(rolled_back, timeout=150, what="the tampered canary rolled back")
    assert status["abort"]["reason"] == "VerificationFailed", status["abort"]
    failures = status["verification"]["failures"]
    assert failures and all(f["reason"] == "BroadcastChecksumMismatch" for f in failures), failures
    root = [load["pod"] for load in status["verification"]["loads"]]
    assert seen_ready <= set(root), f"a tampered replica turned Ready: {seen_ready - set(root)}"
    assert status["stableRevision"]["revision"] == "v1"
