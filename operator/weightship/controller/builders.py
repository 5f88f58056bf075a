"""Pure builders of the Kubernetes objects the controller owns (no I/O).

Like dask-kubernetes' `build_*_spec` functions: plain dicts in, plain dicts out, so the
shapes are unit-tested without a cluster.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from weightship.api.env import (
    CACHE_DIR_ENV,
    MANIFEST_DIGEST_ENV,
    MODEL_DIR_ENV,
    MODEL_REVISION_ENV,
    MODEL_URI_ENV,
    POD_IP_ENV,
    POD_NAME_ENV,
    S3_ENDPOINT_ENV,
)
from weightship.api.models import ModelRollout
from weightship.api.names import (
    DIGEST_ANNOTATION,
    FAILED_PROMPT_ANNOTATION,
    LOADED_ANNOTATION,
    MODEL_REVISION_ANNOTATION,
    RESTARTS_ANNOTATION,
    REVISION_LABEL,
    ROLLOUT_LABEL,
    SWAP_ANNOTATION,
    TEMPLATE_LABEL,
    VERIFIED_GATE,
    staged_node_label,
)
from weightship.controller.seedkey import seed_key_env
from weightship.core.decision import RecordSwap, SeedEnv, SetGate
from weightship.core.observed import PodSwap
from weightship.data import viewlayout
from weightship.weightformat.cachedir import (
    FILES_DIR,
    MANIFEST_DIGEST,
    MANIFEST_FILE,
    STAGED_MARKER,
    host_model_root,
)

# The lowest pod-deletion-cost there is: a scale-down takes exactly the drained pods.
DRAINED_DELETION_COST = str(-(2**31))
# The node cache is install-time configuration (the chart's agent.cacheDir, the operator's
# WEIGHTSHIP_CACHE_DIR), never a rollout's: a rollout-chosen hostPath could be `/`.
DEFAULT_CACHE_DIR = "/var/cache/weightship"
# A pod mounts, read-only, only what reading its pinned model needs: the model's files
# (the folder it serves), its manifest and the marker saying every chunk was verified
# (weightship.loader.locate_staged). `File` mounts wait for the marker: the pod starts on
# a node only once the model is staged there, as a kubelet waits for any hostPath.
CACHE_VOLUME = "weightship-cache"
MODEL_VOLUMES = {
    CACHE_VOLUME: ("files", "Directory"),
    "weightship-manifest": (MANIFEST_FILE, "File"),
    "weightship-staged": (STAGED_MARKER, "File"),
}
# A pod of an updatePolicy InPlaceIfPossible rollout swaps to weights that were not known
# when it started, so instead it mounts its rollout's view (weightship.data.views): one
# folder the node agent keeps holding exactly the models that rollout pins and the node
# has staged (hard links), plus the view's receipt for its own revision, which exists
# only once the view shows it: a `File` mount, so the pod waits for it as for STAGED. The
# view folder alone would not do: it exists as soon as an earlier revision is shown.
VIEW_VOLUME = "weightship-view"
VIEW_READY_VOLUME = "weightship-view-ready"
VIEW_VOLUMES = {VIEW_VOLUME: "Directory", VIEW_READY_VOLUME: "File"}
# Names a pod template cannot use: the controller's node mounts replace them.
NODE_VOLUMES = frozenset({*MODEL_VOLUMES, *VIEW_VOLUMES})


def staged_model_root(cache_dir: str, manifest_digest: str) -> str:
    """`<cacheDir>/models/<hex>`: where the node agent stages one model (data.chunkstore)."""
    return host_model_root(cache_dir, manifest_digest)


def staged_model_dir(cache_dir: str, manifest_digest: str) -> str | None:
    if not MANIFEST_DIGEST.fullmatch(manifest_digest or ""):
        return None
    return f"{staged_model_root(cache_dir, manifest_digest)}/{FILES_DIR}"


def rollout_view_root(cache_dir: str, uid: str) -> str:
    """`<cacheDir>/views/<uid>`: the rollout's view of the node cache (data.views); the
    uid must be a lowercase UUID (ValueError otherwise)."""
    return viewlayout.view_root(cache_dir, uid)


def uses_view(rollout: ModelRollout) -> bool:
    """Whether the rollout's new pods mount its view rather than one model: prefetch on
    and updatePolicy InPlaceIfPossible."""
    return (
        rollout.spec.prefetch.enabled
        and rollout.spec.strategy.canary.update_policy == "InPlaceIfPossible"
    )


def mounts_view(pod: Mapping[str, Any]) -> bool:
    """Whether a pod (a raw or cache-trimmed pod object) mounts its rollout's view, so it
    can read revisions other than the one it started on."""
    containers = (pod.get("spec") or {}).get("containers") or []
    return any(
        m.get("name") == VIEW_VOLUME for c in containers for m in c.get("volumeMounts") or []
    )


def pod_model_dir(
    cache_dir: str, manifest_digest: str, *, view_uid: str | None = None
) -> str | None:
    """`$(WEIGHTSHIP_MODEL_DIR)` of a pod: the model's files in its rollout's view with
    ``view_uid``, else in the node cache; None for a digest that is not sha256."""
    if not MANIFEST_DIGEST.fullmatch(manifest_digest or ""):
        return None
    if view_uid is None:
        return staged_model_dir(cache_dir, manifest_digest)
    return viewlayout.view_model_dir(cache_dir, view_uid, manifest_digest)


def replicaset_name(rollout_name: str, revision_hash: str) -> str:
    return f"{rollout_name}-{revision_hash}"[:253]


def model_env(
    rollout: ModelRollout, manifest_digest: str, cache_dir: str = DEFAULT_CACHE_DIR
) -> list[dict[str, Any]]:
    """What the pod's servers read: the model, and, with prefetch on, where its staged copy
    is mounted (the same paths as on the node, so `locate_staged(WEIGHTSHIP_CACHE_DIR,
    digest)` finds it). With updatePolicy InPlaceIfPossible the cache a pod is told of is
    its rollout's view, where `locate_staged` finds every revision the rollout pins (the
    next one of an in-place swap too), and the model folder is its revision's there.
    With prefetch off nothing of the node is mounted, so no cache path is named either:
    a server then fetches its own weights."""
    model = rollout.spec.model
    cache_env: list[dict[str, Any]] = []
    if uses_view(rollout):  # the view: every revision the rollout pins, as its cache
        uid = _view_uid(rollout)
        cache_env = [
            {"name": CACHE_DIR_ENV, "value": rollout_view_root(cache_dir, uid)},
            {
                "name": MODEL_DIR_ENV,
                "value": viewlayout.view_model_dir(cache_dir, uid, manifest_digest),
            },
        ]
    elif rollout.spec.prefetch.enabled:
        cache_env = [
            {"name": CACHE_DIR_ENV, "value": cache_dir},
            {"name": MODEL_DIR_ENV, "value": staged_model_dir(cache_dir, manifest_digest) or ""},
        ]
    env: list[dict[str, Any]] = [
        {"name": MODEL_URI_ENV, "value": model.source.uri},
        {"name": MODEL_REVISION_ENV, "value": model.revision},
        {"name": MANIFEST_DIGEST_ENV, "value": manifest_digest},
        *cache_env,
        # Who this replica is and where peers reach it, for broadcast seeding.
        {"name": POD_NAME_ENV, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        *seed_key_env(rollout),  # the rollout's seeding key, by reference (seedkey.py)
    ]
    if model.source.endpoint:
        env.append({"name": S3_ENDPOINT_ENV, "value": model.source.endpoint})
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


def gate_condition(gate: SetGate) -> dict[str, Any]:
    """The pod condition of the weights-verified readiness gate, as the core decided it:
    the one place its dict is built."""
    return {
        "type": VERIFIED_GATE,
        "status": gate.status,
        "reason": gate.reason,
        "message": gate.message[:1024],
        "lastTransitionTime": _rfc3339(gate.at),
    }


def swap_record(swap: PodSwap) -> str:
    """A pod's swap record (SWAP_ANNOTATION; snapshot.pod_swap reads it)."""
    doc: dict[str, Any] = {
        "state": swap.state,
        "to": swap.to_revision_hash,
        "from": swap.from_revision_hash,
        "manifestDigest": swap.manifest_digest,
        "revision": swap.revision,
        "purpose": swap.purpose,
        "startedAt": _rfc3339(swap.started_at) if swap.started_at else None,
        "restarts": swap.restarts,
    }
    if swap.in_traffic:
        doc["inTraffic"] = True
    ended = {
        "finishedAt": _rfc3339(swap.finished_at) if swap.finished_at else None,
        "seconds": swap.seconds,
        "pausedSeconds": swap.paused_seconds,
        "reason": swap.reason,
        "message": swap.message[:500] if swap.message else None,
    }
    doc.update({k: v for k, v in ended.items() if v is not None})
    return json.dumps(doc, sort_keys=True)


def swap_record_write(
    record: RecordSwap,
) -> tuple[dict[str, Any], dict[str, str | None], dict[str, str]]:
    """The condition, annotations and labels of one RecordSwap's write: the record and the
    gate; once Swapped, also the pod's new revision (its label, digest and revision
    annotations), with the notes of its last verification cleared."""
    swap = record.swap
    annotations: dict[str, str | None] = {SWAP_ANNOTATION: swap_record(swap)}
    labels: dict[str, str] = {}
    if swap.state == "Swapped":
        annotations |= {
            DIGEST_ANNOTATION: swap.manifest_digest,
            MODEL_REVISION_ANNOTATION: swap.revision,
            LOADED_ANNOTATION: None,
            FAILED_PROMPT_ANNOTATION: None,
            RESTARTS_ANNOTATION: None,
        }
        labels[REVISION_LABEL] = swap.to_revision_hash
    return gate_condition(record.gate), annotations, labels


def _rfc3339(at: datetime) -> str:
    return at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def model_volumes(
    cache_dir: str, manifest_digest: str, *, view_uid: str | None = None
) -> list[dict[str, Any]]:
    """The read-only hostPath volumes of one staged model, nothing else of the node; with
    ``view_uid``, those of that rollout's view instead: the view, and its receipt for
    this model (the start gate)."""
    if view_uid is not None:
        paths = {
            VIEW_VOLUME: rollout_view_root(cache_dir, view_uid),
            VIEW_READY_VOLUME: viewlayout.ready_marker(cache_dir, view_uid, manifest_digest),
        }
        return [
            {"name": name, "hostPath": {"path": paths[name], "type": kind}}
            for name, kind in VIEW_VOLUMES.items()
        ]
    root = staged_model_root(cache_dir, manifest_digest)
    return [
        {"name": name, "hostPath": {"path": f"{root}/{sub}", "type": kind}}
        for name, (sub, kind) in MODEL_VOLUMES.items()
    ]


def _view_uid(rollout: ModelRollout) -> str:
    """The rollout's uid as a view path element: a UUID, as the API server assigns."""
    uid = rollout.metadata.uid
    try:
        return viewlayout.check_uid(uid)
    except ValueError:
        raise ValueError(
            f"rollout {rollout.metadata.namespace}/{rollout.metadata.name} has uid "
            f"{str(uid)[:80]!r}, not a UUID: its view of the node cache has no path"
        ) from None


def _inject_container(
    container: dict[str, Any], env: list[dict[str, Any]], volumes: list[dict[str, Any]]
) -> None:
    names = {e["name"] for e in env}
    container["env"] = [e for e in container.get("env") or [] if e.get("name") not in names] + env
    mounts = [m for m in container.get("volumeMounts") or [] if m.get("name") not in NODE_VOLUMES]
    # At the path it has on the node; the view's receipt lies inside the view, so the
    # view comes first (a runtime mounts a parent before what lies inside it anyway).
    for volume in volumes:
        mounts.append(
            {"name": volume["name"], "mountPath": volume["hostPath"]["path"], "readOnly": True}
        )
    container["volumeMounts"] = mounts


def _quantities_as_strings(container: dict[str, Any]) -> None:
    """Resource quantities written as JSON integers (`nvidia.com/gpu: 1`), as strings: the
    API server reads both, the kubernetes client's ReplicaSet model takes only strings."""
    resources = container.get("resources")
    for what in ("limits", "requests"):
        values = resources.get(what) if isinstance(resources, dict) else None
        if isinstance(values, dict):
            for key, value in values.items():
                if isinstance(value, int) and not isinstance(value, bool):
                    values[key] = str(value)


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
    cache_dir: str = DEFAULT_CACHE_DIR,
    template_hash: str | None = None,
) -> dict[str, Any]:
    """The ReplicaSet of one revision, owned by the rollout (garbage-collected with it).
    With ``template_hash`` (updatePolicy InPlaceIfPossible) it is named and selects its
    pods by the template hash instead, so its pods may swap to later revisions in place.

    With prefetch on, its pods mount the staged model (model_volumes), or with updatePolicy
    InPlaceIfPossible their rollout's view; with it off nothing of the node: the server
    fetches its weights itself."""
    meta = rollout.metadata
    name = replicaset_name(meta.name, template_hash or revision_hash)
    selector = dict(rollout.spec.selector.match_labels or {})
    own_labels = {ROLLOUT_LABEL: meta.name, REVISION_LABEL: revision_hash}
    if template_hash is not None:
        own_labels[TEMPLATE_LABEL] = template_hash
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
    env = model_env(rollout, manifest_digest, cache_dir)
    mine: list[dict[str, Any]] = []
    if uses_view(rollout):
        mine = model_volumes(cache_dir, manifest_digest, view_uid=_view_uid(rollout))
    elif rollout.spec.prefetch.enabled:
        mine = model_volumes(cache_dir, manifest_digest)
    for container in spec.get("containers") or []:
        _inject_container(container, env, mine)
    for container in [*(spec.get("containers") or []), *(spec.get("initContainers") or [])]:
        _quantities_as_strings(container)
    volumes = [v for v in spec.get("volumes") or [] if v.get("name") not in NODE_VOLUMES]
    spec["volumes"] = [*volumes, *mine]
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
            "selector": {"matchLabels": {**selector, **_selecting(own_labels)}},
            "template": pod,
        },
    }


def _selecting(own_labels: Mapping[str, str]) -> dict[str, str]:
    """An in-place ReplicaSet selects by template, not revision: its pods change revision."""
    if TEMPLATE_LABEL in own_labels:
        return {k: v for k, v in own_labels.items() if k != REVISION_LABEL}
    return dict(own_labels)


def retemplate_patch(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """JSON patch pointing an in-place ReplicaSet at the revision ``body`` (a
    replicaset_body) renders: its template whole, and its revision label and annotations.
    Its selector stays: the template keeps the template-hash label it selects by."""
    meta = body["metadata"]
    return [
        {"op": "replace", "path": "/metadata/labels", "value": meta["labels"]},
        {"op": "replace", "path": "/metadata/annotations", "value": meta["annotations"]},
        {"op": "replace", "path": "/spec/template", "value": body["spec"]["template"]},
    ]
