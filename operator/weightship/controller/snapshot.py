"""Pure projections of raw Kubernetes objects (as the watch caches hold them) into the
core's `Observed` pieces. No clients, no I/O: observe gathers, these convert.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from weightship.api.names import (
    FAILED_PROMPT_ANNOTATION,
    LOADED_ANNOTATION,
    REVISION_LABEL,
    SWAP_ANNOTATION,
    TEMPLATE_LABEL,
    VERIFIED_GATE,
    staged_node_label,
)
from weightship.controller.pods import condition, is_true
from weightship.core.observed import (
    SWAP_PURPOSES,
    NodeStaging,
    ObservedPod,
    PodFailure,
    PodLoad,
    PodSwap,
    PodVerdict,
    PrefetchObservation,
    ReplicaSetObservation,
)
from weightship.core.staging_failure import parse_failure
from weightship.core.verification import gate_passed, verdict_reason
from weightship.kube.rfc3339 import time_or_none


def _json_annotation(annotations: dict[str, str], key: str) -> dict[str, Any]:
    try:
        value = json.loads(annotations.get(key) or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _opt_str(value: object) -> str | None:
    return None if value is None else str(value)


def observed_pods(
    raw_pods: list[dict[str, Any]],
    verdicts: Mapping[str, PodVerdict] | None = None,
    swaps: Mapping[str, PodSwap] | None = None,
) -> tuple[ObservedPod, ...]:
    """Pure: the rollout's pods as the core's decisions (seed root, gates, drains, swaps)
    read them, with the verifier's verdicts not yet on their gates and the swapper's
    reports not yet on their records (both by pod uid)."""
    out = []
    for pod in raw_pods:
        meta = pod.get("metadata") or {}
        status = pod.get("status") or {}
        containers = ((pod.get("spec") or {}).get("containers")) or []
        gate = condition(pod, VERIFIED_GATE) or {}
        passed = gate_passed(gate.get("status"), gate.get("reason"))
        held = _json_annotation(meta.get("annotations") or {}, LOADED_ANNOTATION).get("heldSeconds")
        out.append(
            ObservedPod(
                name=meta["name"],
                revision_hash=(meta.get("labels") or {}).get(REVISION_LABEL),
                uid=str(meta.get("uid") or ""),
                created=str(meta.get("creationTimestamp") or ""),
                pod_ip=status.get("podIP") or None,
                phase=status.get("phase"),
                deleting=bool(meta.get("deletionTimestamp")),
                ready=is_true(pod, "Ready"),
                containers_ready=is_true(pod, "ContainersReady"),
                weights_verified=passed,
                gate_open=is_true(pod, VERIFIED_GATE),
                gate_reason=None if passed else _opt_str(gate.get("reason")),
                gate_since=time_or_none(gate.get("lastTransitionTime")),
                gate_message=_opt_str(gate.get("message")),
                verdict=(verdicts or {}).get(str(meta.get("uid") or "")),
                containers=tuple(str(c["name"]) for c in containers if c.get("name")),
                restarts=sum(
                    int(c.get("restartCount") or 0) for c in status.get("containerStatuses") or []
                ),
                node=(pod.get("spec") or {}).get("nodeName") or None,
                template_hash=(meta.get("labels") or {}).get(TEMPLATE_LABEL),
                swap=pod_swap(meta.get("annotations") or {}),
                held_seconds=float(held) if isinstance(held, int | float) else None,
                swap_report=(swaps or {}).get(str(meta.get("uid") or "")),
            )
        )
    return tuple(out)


def pod_swap(annotations: Mapping[str, str]) -> PodSwap | None:
    """The record of a pod's last swap (SWAP_ANNOTATION, as builders.swap_record writes
    it)."""
    doc = _json_annotation(dict(annotations), SWAP_ANNOTATION)
    state, to, digest = doc.get("state"), doc.get("to"), doc.get("manifestDigest")
    if state not in ("Swapping", "Swapped", "Failed") or not isinstance(to, str) or not digest:
        return None
    seconds, paused = doc.get("seconds"), doc.get("pausedSeconds")
    return PodSwap(
        to_revision_hash=to,
        manifest_digest=str(digest),
        revision=str(doc.get("revision") or ""),
        state=state,
        from_revision_hash=_opt_str(doc.get("from")),
        started_at=time_or_none(doc.get("startedAt")),
        seconds=float(seconds) if isinstance(seconds, int | float) else None,
        paused_seconds=float(paused) if isinstance(paused, int | float) else None,
        reason=_opt_str(doc.get("reason")),
        message=_opt_str(doc.get("message")),
        restarts=restarts if isinstance(restarts := doc.get("restarts"), int) else None,
        purpose=purpose if (purpose := doc.get("purpose")) in SWAP_PURPOSES else None,
        finished_at=time_or_none(doc.get("finishedAt")),
        in_traffic=doc.get("inTraffic") is True,
    )


def _container_names(pods: list[dict[str, Any]]) -> tuple[str, ...]:
    """Container names of a revision's pods (its template's; the caches keep them)."""
    for pod in pods:
        containers = (pod.get("spec") or {}).get("containers") or []
        names = tuple(str(c["name"]) for c in containers if c.get("name"))
        if names:
            return names
    return ()


def replica_set_observations(
    replica_sets: list[dict[str, Any]], pods: list[dict[str, Any]]
) -> tuple[ReplicaSetObservation, ...]:
    """Pure: count ready, verified and failed pods per revision. An in-place ReplicaSet
    (template-hash label) holds pods of several revisions: each revision among them is
    observed as a ReplicaSet of its own (core.inplace)."""
    by_revision: dict[tuple[str | None, str], list[dict[str, Any]]] = {}
    for pod in pods:
        if (pod.get("metadata") or {}).get("deletionTimestamp"):
            continue
        labels = pod["metadata"].get("labels") or {}
        revision = labels.get(REVISION_LABEL)
        if revision:
            by_revision.setdefault((labels.get(TEMPLATE_LABEL), revision), []).append(pod)
    out = []
    for rs in replica_sets:
        labels = rs["metadata"].get("labels") or {}
        revision = labels.get(REVISION_LABEL)
        if not revision:
            continue
        name = rs["metadata"]["name"]
        size = int((rs.get("spec") or {}).get("replicas") or 0)
        template = labels.get(TEMPLATE_LABEL)
        if template is None:
            out.append(_observation(name, revision, size, by_revision.get((None, revision), [])))
            continue
        others = {r: members for (t, r), members in by_revision.items() if t == template}
        others.pop(revision, None)
        own = by_revision.get((template, revision), [])
        rest = sum(len(m) for m in others.values())
        out.append(_observation(name, revision, max(0, size - rest), own, template, revision))
        for other, members in sorted(others.items()):
            out.append(_observation(name, other, len(members), members, template, revision))
    return tuple(out)


def _observation(
    name: str,
    revision: str,
    replicas: int,
    members: list[dict[str, Any]],
    template: str | None = None,
    template_revision: str | None = None,
) -> ReplicaSetObservation:
    failed = []
    loads = []
    for pod in members:
        gate = condition(pod, VERIFIED_GATE)
        notes = pod["metadata"].get("annotations") or {}
        # A verdict against the weights, the gate open or not (a pod swapping in traffic
        # keeps it open); a swap's outcome is its record's, a drain is no verdict.
        if gate and verdict_reason(gate.get("status"), gate.get("reason")):
            prompt = _json_annotation(notes, FAILED_PROMPT_ANNOTATION)
            failed.append(
                PodFailure(
                    pod["metadata"]["name"],
                    str(gate.get("reason")),
                    str(gate.get("message") or ""),
                    prompt=_opt_str(prompt.get("name")),
                    expected=_opt_str(prompt.get("expected")),
                    got=_opt_str(prompt.get("got")),
                )
            )
        loaded = _json_annotation(notes, LOADED_ANNOTATION)
        if loaded:
            source = loaded.get("source")
            seconds = loaded.get("seconds")
            loads.append(
                PodLoad(
                    pod["metadata"]["name"],
                    source if source in ("cache", "origin", "broadcast", "swap") else None,
                    _opt_str(loaded.get("seededFrom")),
                    float(seconds) if isinstance(seconds, int | float) else None,
                    mode if (mode := loaded.get("mode")) in ("loaded", "staged", "none") else None,
                )
            )
    ready = sum(is_true(p, "Ready") for p in members)
    return ReplicaSetObservation(
        name=name,
        revision_hash=revision,
        replicas=replicas,
        ready=ready,
        available=ready,
        seeded=sum(
            LOADED_ANNOTATION in (p["metadata"].get("annotations") or {})
            or is_true(p, "ContainersReady")
            for p in members
        ),
        verified=sum(
            gate_passed(g.get("status"), g.get("reason"))
            for p in members
            if (g := condition(p, VERIFIED_GATE)) is not None
        ),
        failed=tuple(failed),
        loads=tuple(sorted(loads, key=lambda load: load.pod)),
        containers=_container_names(members),
        template_hash=template,
        template_revision_hash=template_revision,
    )


def prefetch_observation(
    digest: str,
    target_nodes: list[str],
    caches: list[dict[str, Any]],
    node_labels: Mapping[str, Mapping[str, str]] | None = None,
) -> PrefetchObservation:
    """Pure: sum the staging of `digest` over the WeightCaches of the target nodes.
    `node_labels` (by node name) tells which nodes carry the staged label already, so
    the core labels only the others; without it every staged node is labelled."""
    label = staged_node_label(digest)
    labels = node_labels or {}
    # A WeightCache speaks for the node it is named after (the admission policy lets an
    # agent write only that one); one whose spec.nodeName names another node is ignored.
    by_node = {
        c["metadata"]["name"]: c
        for c in caches
        if (c.get("spec") or {}).get("nodeName") in (None, c["metadata"]["name"])
    }
    nodes = []
    for node in sorted(target_nodes):
        entry = next(
            (
                m
                for m in ((by_node.get(node) or {}).get("status") or {}).get("manifests") or []
                if m.get("digest") == digest
            ),
            None,
        )
        if entry is None:
            nodes.append(NodeStaging(node, "Pending"))
            continue
        state = {"Staging": "Staging", "Staged": "Staged", "Failed": "Failed"}.get(
            entry.get("state", ""), "Pending"
        )
        nodes.append(
            NodeStaging(
                node,
                state,  # type: ignore[arg-type]
                int(entry.get("bytesDone") or 0),
                int(entry.get("bytesTotal") or 0),
                entry.get("lastError"),
                labelled=(labels.get(node) or {}).get(label) == "true",
                failure=parse_failure(entry.get("failure")),
                started_at=time_or_none(entry.get("startedAt")),
            )
        )
    return PrefetchObservation(
        digest=digest,
        target_nodes=len(nodes),
        staged_nodes=sum(n.state == "Staged" for n in nodes),
        bytes_staged=sum(n.bytes_done for n in nodes),
        bytes_total=sum(n.bytes_total for n in nodes),
        nodes=tuple(nodes),
    )
