"""Readiness gates end to end: the reference inference server (torch, safetensors, greedy
decoding) on process nodes, the operator's verifier checking loaded digests and golden
prompts, and a Slack receiver hearing about the rollback."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from e2e.operator_fixtures import (
    Rollouts,
    tinyllm_models,
    tinyllm_rollout_body,
)
from weightship.api.names import REVISION_LABEL, VERIFIED_GATE
from weightship_dev import testkit
from weightship_dev.layout import BRIDGE_IP
from weightship_dev.slackreceiver import SlackReceiver
from weightship_testing.tinyllm.knowledge import GOLDEN_PROMPTS, SUBTLY_BAD_FACT

NAMESPACE_PREFIX = "gt-"


@pytest.fixture(scope="module")
def models(cluster: Any) -> Iterator[dict[str, str]]:
    """good (twice, as v1 and v2), subtly bad and corrupt versions of the tiny model."""
    yield from tinyllm_models(
        cluster.s3_endpoint,
        "tinyllm",
        [
            ("v1", "good", 0),
            ("v2", "good", 1),  # another good build: other noise weights, other digest
            ("bad", "subtly-bad", 0),
            ("corrupt", "corrupt", 2),  # a manifest of its own (v1 is seed 0)
        ],
    )


def degraded(rollouts: Rollouts, name: str, revision: str) -> dict[str, Any]:
    """The status once rolled back: Degraded, canary at 0, its ReplicaSet scaled to 0."""
    return rollouts.wait(
        name,
        f"{revision} rolled back",
        lambda s: (
            s.get("phase") == "Degraded"
            and (s.get("canaryRevision") or {}).get("revision") == revision
            and s.get("canaryWeight") == 0
            and (s.get("replicas") or {}).get("canary") == 0
        ),
        timeout=120,
    )["status"]


def gate(pod: Any) -> Any:
    return next((c for c in pod.status.conditions or [] if c.type == VERIFIED_GATE), None)


def is_ready(pod: Any) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])


def pods_of(cluster: Any, namespace: str, revision_hash: str) -> list[Any]:
    return list(
        cluster.core.list_namespaced_pod(
            namespace, label_selector=f"{REVISION_LABEL}={revision_hash}"
        ).items
    )


def test_good_revision_is_verified_and_promoted(
    cluster: Any, rollouts: Rollouts, models: dict[str, str]
) -> None:
    ns = rollouts.namespace
    body = tinyllm_rollout_body("llm", models["v1"], "v1", [{"setWeight": 50}], cluster.s3_endpoint)
    rollouts.create(body)
    rollouts.healthy_on("llm", "v1")
    rollouts.set_model("llm", models["v2"], "v2")
    status = rollouts.healthy_on("llm", "v2")["status"]
    assert status["history"][-1]["outcome"] == "Promoted"
    stable_hash = status["stableRevision"]["podTemplateHash"]
    pods = pods_of(cluster, ns, stable_hash)
    assert len(pods) == 2
    for pod in pods:
        condition = gate(pod)
        assert condition.status == "True" and condition.reason == "Verified", condition
        assert status["stableRevision"]["manifestDigest"] in condition.message
        assert f"{len(GOLDEN_PROMPTS)}/{len(GOLDEN_PROMPTS)} golden prompts" in condition.message
        assert is_ready(pod)


def test_bad_weights_never_serve_and_roll_back(
    cluster: Any, rollouts: Rollouts, models: dict[str, str]
) -> None:
    ns = rollouts.namespace
    with SlackReceiver(host=BRIDGE_IP) as slack:
        cluster.core.create_namespaced_secret(
            ns, {"metadata": {"name": "slack"}, "stringData": {"url": slack.url}}
        )
        body = tinyllm_rollout_body(
            "llm", models["v1"], "v1", [{"setWeight": 50}], cluster.s3_endpoint
        )
        body["spec"]["notifications"] = {
            "slack": {"webhookSecretRef": {"name": "slack"}, "events": ["RolledBack"]}
        }
        rollouts.create(body)
        rollouts.healthy_on("llm", "v1")

        # Subtly bad: its checksums are fine, one golden prompt is answered wrongly.
        rollouts.set_model("llm", models["bad"], "bad")
        status = degraded(rollouts, "llm", "bad")
        assert status["abort"]["reason"] == "VerificationFailed", status["abort"]
        failure = status["verification"]["failures"][0]
        assert failure["reason"] == "GoldenPromptFailed"
        assert failure["prompt"] == SUBTLY_BAD_FACT
        assert failure["got"] != "" and "Paris" in failure["expected"]
        assert SUBTLY_BAD_FACT in status["abort"]["message"]
        assert (status["stableRevision"] or {})["revision"] == "v1"
        message = testkit.wait_until(
            lambda: next((m for m in slack.received if "RolledBack" in m["text"]), None),
            timeout=30,
            what="the rollback on Slack",
        )
        assert SUBTLY_BAD_FACT in str(message["blocks"]), message

        # Corrupt: bytes differ from the manifest. The pods refuse them and never serve.
        rollouts.set_model("llm", models["corrupt"], "corrupt")
        seen_ready: list[str] = []

        def corrupt_rejected() -> dict[str, Any] | None:
            s = rollouts.get("llm").get("status") or {}
            canary = (s.get("canaryRevision") or {}).get("podTemplateHash")
            if canary:
                seen_ready.extend(
                    p.metadata.name for p in pods_of(cluster, ns, canary) if is_ready(p)
                )
            done = (
                s.get("phase") == "Degraded"
                and (s.get("canaryRevision") or {}).get("revision") == "corrupt"
            )
            return s if done else None

        status = testkit.wait_until(corrupt_rejected, timeout=120, what="corrupt rolled back")
        assert not seen_ready, f"corrupt canary pods turned Ready: {seen_ready}"
        assert status["abort"]["reason"] == "VerificationFailed"
        assert status["verification"]["failures"][0]["reason"] == "ChecksumMismatch"
        assert status["canaryWeight"] == 0
        stable = pods_of(cluster, ns, status["stableRevision"]["podTemplateHash"])
        assert len(stable) == 2 and all(is_ready(p) for p in stable)
