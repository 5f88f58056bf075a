"""Pure builders of the Kubernetes objects the controller owns (no I/O).

Like dask-kubernetes' `build_*_spec` functions: plain dicts in, plain dicts out, so the
shapes are unit-tested without a cluster.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from datetime import UTC
from typing import Any

from weightship.api.models import ModelRollout
from weightship.core.decision import OpenGate, SeedEnv

GROUP = "weightship.io"
ROLLOUT_LABEL = f"{GROUP}/rollout"
REVISION_LABEL = f"{GROUP}/revision-hash"
DIGEST_ANNOTATION = f"{GROUP}/manifest-digest"
MODEL_REVISION_ANNOTATION = f"{GROUP}/model-revision"
VERIFIED_GATE = f"{GROUP}/weights-verified"
CACHE_VOLUME = "weightship-cache"
# The pinned model's staged folder, for servers that read it themselves (`vllm serve
# $(WEIGHTSHIP_MODEL_DIR)`): the path the node agent stages it at (data.chunkstore).
MODEL_DIR_ENV = "WEIGHTSHIP_MODEL_DIR"


def staged_model_dir(cache_path: str, manifest_digest: str) -> str | None:
    if not manifest_digest:
        return None
    return f"{cache_path.rstrip('/')}/models/{manifest_digest.removeprefix('sha256:')}/files"


def staged_node_label(manifest_digest: str) -> str:
    """Node label set once a node has every chunk of `manifest_digest` staged."""
    return f"staged.{GROUP}/{manifest_digest.removeprefix('sha256:')[:16]}"


def replicaset_name(rollout_name: str, revision_hash: str) -> str:
    return f"{rollout_name}-{revision_hash}"[:253]


def model_env(rollout: ModelRollout, manifest_digest: str) -> list[dict[str, Any]]:
    model = rollout.spec.model
    env: list[dict[str, Any]] = [
        {"name": "WEIGHTSHIP_MODEL_URI", "value": model.source.uri},
        {"name": "WEIGHTSHIP_MODEL_REVISION", "value": model.revision},
        {"name": "WEIGHTSHIP_MANIFEST_DIGEST", "value": manifest_digest},
        {"name": "WEIGHTSHIP_CACHE_DIR", "value": rollout.spec.prefetch.cache_path},
        {
            "name": MODEL_DIR_ENV,
            "value": staged_model_dir(rollout.spec.prefetch.cache_path, manifest_digest) or "",
        },
        # Who this replica is and where peers reach it, for broadcast seeding.
        {"name": "WEIGHTSHIP_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "WEIGHTSHIP_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ]
    if model.source.endpoint:
        env.append({"name": "WEIGHTSHIP_S3_ENDPOINT", "value": model.source.endpoint})
    return env


def scale_patch(replicas: int, seed: SeedEnv | None = None) -> dict[str, Any]:
    """Strategic merge patch of a ReplicaSet: its size and, in the same write, the seed env
    of the pods it creates next (containers and env merge by name)."""
    patch: dict[str, Any] = {"spec": {"replicas": replicas}}
    if seed is not None and seed.env:
        env = [{"name": e.name, "value": e.value} for e in seed.env]
        patch["spec"]["template"] = {
            "spec": {"containers": [{"name": name, "env": env} for name in seed.containers]}
        }
    return patch


def verified_condition(gate: OpenGate) -> dict[str, Any]:
    """The pod condition that opens the weights-verified readiness gate."""
    return {
        "type": VERIFIED_GATE,
        "status": "True",
        "reason": gate.reason,
        "message": gate.message,
        "lastTransitionTime": gate.at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def _inject_container(
    container: dict[str, Any], env: list[dict[str, Any]], cache_path: str
) -> None:
    names = {e["name"] for e in env}
    container["env"] = [e for e in container.get("env") or [] if e.get("name") not in names] + env
    mounts = [m for m in container.get("volumeMounts") or [] if m.get("name") != CACHE_VOLUME]
    mounts.append({"name": CACHE_VOLUME, "mountPath": cache_path, "readOnly": True})
    container["volumeMounts"] = mounts


def _staged_affinity(pod_spec: dict[str, Any], label: str) -> None:
    """Require nodes labelled as staged: added to every existing nodeSelectorTerm (ANDed)."""
    affinity = pod_spec.setdefault("affinity", {})
    node_affinity = affinity.setdefault("nodeAffinity", {})
    required = node_affinity.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    terms = required.setdefault("nodeSelectorTerms", []) or [{}]
    requirement = {"key": label, "operator": "In", "values": ["true"]}
    for term in terms:
        term.setdefault("matchExpressions", []).append(requirement)
    required["nodeSelectorTerms"] = terms


def replicaset_body(
    rollout: ModelRollout,
    *,
    template: Mapping[str, Any],
    revision_hash: str,
    manifest_digest: str,
    replicas: int,
    require_staged: bool,
) -> dict[str, Any]:
    """The ReplicaSet of one revision, owned by the rollout (garbage-collected with it)."""
    meta = rollout.metadata
    name = replicaset_name(meta.name, revision_hash)
    selector = dict(rollout.spec.selector.match_labels or {})
    own_labels = {ROLLOUT_LABEL: meta.name, REVISION_LABEL: revision_hash}
    pod = copy.deepcopy(dict(template))
    pod_meta = pod.setdefault("metadata", {}) or {}
    pod["metadata"] = pod_meta
    pod_meta["labels"] = {**(pod_meta.get("labels") or {}), **selector, **own_labels}
    pod_meta["annotations"] = {
        **(pod_meta.get("annotations") or {}),
        DIGEST_ANNOTATION: manifest_digest,
        MODEL_REVISION_ANNOTATION: rollout.spec.model.revision,
    }
    spec = pod.setdefault("spec", {})
    env = model_env(rollout, manifest_digest)
    cache_path = rollout.spec.prefetch.cache_path
    for container in spec.get("containers") or []:
        _inject_container(container, env, cache_path)
    volumes = [v for v in spec.get("volumes") or [] if v.get("name") != CACHE_VOLUME]
    volumes.append(
        {"name": CACHE_VOLUME, "hostPath": {"path": cache_path, "type": "DirectoryOrCreate"}}
    )
    spec["volumes"] = volumes
    gates = [g for g in spec.get("readinessGates") or [] if g.get("conditionType") != VERIFIED_GATE]
    spec["readinessGates"] = [*gates, {"conditionType": VERIFIED_GATE}]
    if require_staged:
        _staged_affinity(spec, staged_node_label(manifest_digest))
    return {
        "apiVersion": "apps/v1",
        "kind": "ReplicaSet",
        "metadata": {
            "name": name,
            "namespace": meta.namespace,
            "labels": {**selector, **own_labels},
            "annotations": {
                DIGEST_ANNOTATION: manifest_digest,
                MODEL_REVISION_ANNOTATION: rollout.spec.model.revision,
            },
            "ownerReferences": [
                {
                    "apiVersion": rollout.api_version,
                    "kind": rollout.kind,
                    "name": meta.name,
                    "uid": meta.uid,
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {**selector, **own_labels}},
            "template": pod,
        },
    }
