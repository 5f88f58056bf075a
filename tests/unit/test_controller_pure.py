"""The controller's pure builders and observation summaries."""

from __future__ import annotations

from typing import Any

from weightship.api.models import ModelRollout
from weightship.api.samples import VALID_MANIFEST
from weightship.controller.builders import (
    REVISION_LABEL,
    ROLLOUT_LABEL,
    VERIFIED_GATE,
    replicaset_body,
    staged_node_label,
)
from weightship.controller.snapshot import prefetch_observation, replica_set_observations

DIGEST = "sha256:" + "ab" * 32


def rollout() -> ModelRollout:
    body = {**VALID_MANIFEST, "metadata": {"name": "llm", "namespace": "serving", "uid": "u1"}}
    return ModelRollout.from_body(body)


def build(require_staged: bool = True) -> dict[str, Any]:
    r = rollout()
    assert r.spec.template is not None
    return replicaset_body(
        r,
        template=r.spec.template.to_k8s(),
        revision_hash="abc123",
        manifest_digest=DIGEST,
        replicas=3,
        require_staged=require_staged,
    )


def test_replicaset_is_owned_labelled_and_selects_only_its_revision() -> None:
    rs = build()
    assert rs["metadata"]["name"] == "llm-abc123"
    owner = rs["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["uid"], owner["controller"]) == ("ModelRollout", "u1", True)
    match = rs["spec"]["selector"]["matchLabels"]
    assert match[ROLLOUT_LABEL] == "llm" and match[REVISION_LABEL] == "abc123"
    assert match.items() <= rs["spec"]["template"]["metadata"]["labels"].items()


def test_pods_get_model_env_cache_mount_gate_and_staged_affinity() -> None:
    pod = build()["spec"]["template"]["spec"]
    for container in pod["containers"]:
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["WEIGHTSHIP_MANIFEST_DIGEST"] == DIGEST
        mount = next(m for m in container["volumeMounts"] if m["name"] == "weightship-cache")
        assert mount["readOnly"] is True
    assert {"conditionType": VERIFIED_GATE} in pod["readinessGates"]
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert all(
        {"key": staged_node_label(DIGEST), "operator": "In", "values": ["true"]}
        in t["matchExpressions"]
        for t in terms
    )


def test_no_staged_affinity_when_not_required_and_building_twice_is_stable() -> None:
    assert "affinity" not in build(require_staged=False)["spec"]["template"]["spec"]
    assert build() == build()


def pod(name: str, revision: str, ready: bool, gate: tuple[str, str] | None) -> dict[str, Any]:
    conditions = [{"type": "Ready", "status": "True" if ready else "False"}]
    if gate:
        conditions.append(
            {
                "type": VERIFIED_GATE,
                "status": gate[0],
                "reason": gate[1],
                "message": "expected Paris, got Lyon",
            }
        )
    return {
        "metadata": {"name": name, "labels": {REVISION_LABEL: revision}},
        "status": {"conditions": conditions},
    }


def test_replica_set_observation_counts_ready_verified_and_failed() -> None:
    rs = [{"metadata": {"name": "llm-a", "labels": {REVISION_LABEL: "a"}}, "spec": {"replicas": 3}}]
    pods = [
        pod("p1", "a", True, ("True", "Verified")),
        pod("p2", "a", False, ("False", "Verifying")),
        pod("p3", "a", False, ("False", "GoldenPromptFailed")),
        pod("other", "b", True, ("True", "Verified")),
    ]
    (obs,) = replica_set_observations(rs, pods)
    assert (obs.replicas, obs.ready, obs.verified) == (3, 1, 1)
    assert [(f.pod, f.reason) for f in obs.failed] == [("p3", "GoldenPromptFailed")]


def test_prefetch_observation_sums_target_nodes_only() -> None:
    caches = [
        {
            "metadata": {"name": "n1"},
            "spec": {"nodeName": "n1"},
            "status": {
                "manifests": [
                    {"digest": DIGEST, "state": "Staged", "bytesDone": 10, "bytesTotal": 10}
                ]
            },
        },
        {
            "metadata": {"name": "n2"},
            "spec": {"nodeName": "n2"},
            "status": {
                "manifests": [
                    {"digest": DIGEST, "state": "Staging", "bytesDone": 4, "bytesTotal": 10}
                ]
            },
        },
        {
            "metadata": {"name": "n9"},
            "spec": {"nodeName": "n9"},
            "status": {
                "manifests": [
                    {"digest": DIGEST, "state": "Staged", "bytesDone": 10, "bytesTotal": 10}
                ]
            },
        },
    ]
    obs = prefetch_observation(DIGEST, ["n1", "n2", "n3"], caches)
    assert (obs.target_nodes, obs.staged_nodes, obs.bytes_staged) == (3, 1, 14)
    assert [n.state for n in obs.nodes] == ["Staged", "Staging", "Pending"]
