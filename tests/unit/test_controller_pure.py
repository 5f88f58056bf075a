"""The controller's pure builders and observation summaries."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

from weightship.api.models import ModelRollout
from weightship.api.names import REVISION_LABEL, ROLLOUT_LABEL, VERIFIED_GATE, staged_node_label
from weightship.controller.builders import gate_condition, replicaset_body, scale_patch
from weightship.controller.snapshot import (
    observed_pods,
    prefetch_observation,
    replica_set_observations,
)
from weightship.core.decision import EnvVar, SeedEnv, SetGate
from weightship.core.observed import ObservedPod
from weightship_testing.samples import VALID_MANIFEST

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
    assert not any(n.labelled for n in obs.nodes)
    labels = {"n1": {staged_node_label(DIGEST): "true"}, "n2": {"other": "true"}}
    labelled = prefetch_observation(DIGEST, ["n1", "n2", "n3"], caches, labels)
    assert [n.labelled for n in labelled.nodes] == [True, False, False]


def test_observed_pods_project_what_the_core_decides_on() -> None:
    raw = {
        "metadata": {
            "name": "llm-abc-1",
            "uid": "u-1",
            "creationTimestamp": "2026-11-30T00:00:00Z",
            "labels": {REVISION_LABEL: "abc"},
        },
        "spec": {"containers": [{"name": "server"}, {"name": "sidecar"}]},
        "status": {
            "phase": "Running",
            "podIP": "10.0.0.4",
            "conditions": [
                {"type": "Ready", "status": "True"},
                {"type": "ContainersReady", "status": "True"},
                {"type": VERIFIED_GATE, "status": "False", "reason": "Loading"},
            ],
            "containerStatuses": [{"restartCount": 2}, {"restartCount": 1}],
        },
    }
    gone = {"metadata": {"name": "old", "deletionTimestamp": "2026-11-30T01:00:00Z"}}
    assert observed_pods([raw, gone]) == (
        ObservedPod(
            name="llm-abc-1",
            revision_hash="abc",
            uid="u-1",
            created="2026-11-30T00:00:00Z",
            pod_ip="10.0.0.4",
            phase="Running",
            ready=True,
            containers_ready=True,
            weights_verified=False,
            containers=("server", "sidecar"),
            restarts=3,
            gate_reason="Loading",
        ),
        ObservedPod(name="old", deleting=True),
    )


def test_replica_set_observation_names_its_pods_containers() -> None:
    rs = [{"metadata": {"name": "llm-a", "labels": {REVISION_LABEL: "a"}}, "spec": {}}]
    member = {**pod("p1", "a", True, None), "spec": {"containers": [{"name": "server"}]}}
    (with_pods,) = replica_set_observations(rs, [member])
    (without,) = replica_set_observations(rs, [pod("other", "b", True, None)])
    assert (with_pods.containers, without.containers) == (("server",), ())


def test_scale_patch_sets_size_and_the_seed_env_on_named_containers() -> None:
    assert scale_patch(3) == {"spec": {"replicas": 3}}
    seed = SeedEnv(("server",), (EnvVar("WEIGHTSHIP_SEED_ROOT", "http://r:1"),))
    assert scale_patch(3, seed) == {
        "spec": {
            "replicas": 3,
            "template": {
                "spec": {
                    "containers": [
                        {
                            "name": "server",
                            "env": [{"name": "WEIGHTSHIP_SEED_ROOT", "value": "http://r:1"}],
                        }
                    ]
                }
            },
        }
    }


def test_an_opened_gate_renders_as_a_true_condition_in_utc() -> None:
    at = datetime(2026, 11, 30, 13, 0, tzinfo=timezone(timedelta(hours=1)))
    assert gate_condition(SetGate("p", "True", "NothingToVerify", "nothing", at)) == {
        "type": VERIFIED_GATE,
        "status": "True",
        "reason": "NothingToVerify",
        "message": "nothing",
        "lastTransitionTime": "2026-11-30T12:00:00Z",
    }
