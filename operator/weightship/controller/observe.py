"""Build `Observed` for one rollout: ReplicaSets and pods, the manifest in S3, staging
progress from WeightCaches, and due Prometheus measurements. Adapters only: no decisions.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

from weightship.api.models import ModelRollout
from weightship.controller.builders import REVISION_LABEL, VERIFIED_GATE
from weightship.controller.kube import Kube
from weightship.controller.pods import condition, is_true
from weightship.controller.verifier import FAILED_PROMPT_ANNOTATION, LOADED_ANNOTATION
from weightship.core.analysis import due_queries
from weightship.core.observed import (
    ManifestResolution,
    NodeStaging,
    Observed,
    ObservedMeasurement,
    PodFailure,
    PodLoad,
    PrefetchObservation,
    ReplicaSetObservation,
)
from weightship.core.verification import IN_PROGRESS_REASONS
from weightship.data.manifest import ManifestError
from weightship.data.s3 import RetryPolicy, S3Location, S3Origin, S3Settings, make_client

log = logging.getLogger(__name__)

MANIFEST_TTL_SECONDS = 30.0


def _json_annotation(annotations: dict[str, str], key: str) -> dict[str, Any]:
    try:
        value = json.loads(annotations.get(key) or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _opt_str(value: object) -> str | None:
    return None if value is None else str(value)


def replica_set_observations(
    replica_sets: list[dict[str, Any]], pods: list[dict[str, Any]]
) -> tuple[ReplicaSetObservation, ...]:
    """Pure: count ready, verified and failed pods per revision."""
    by_revision: dict[str, list[dict[str, Any]]] = {}
    for pod in pods:
        if (pod.get("metadata") or {}).get("deletionTimestamp"):
            continue
        revision = (pod["metadata"].get("labels") or {}).get(REVISION_LABEL)
        if revision:
            by_revision.setdefault(revision, []).append(pod)
    out = []
    for rs in replica_sets:
        revision = (rs["metadata"].get("labels") or {}).get(REVISION_LABEL)
        if not revision:
            continue
        members = by_revision.get(revision, [])
        failed = []
        loads = []
        for pod in members:
            gate = condition(pod, VERIFIED_GATE)
            notes = pod["metadata"].get("annotations") or {}
            if (
                gate
                and gate.get("status") == "False"
                and gate.get("reason") not in IN_PROGRESS_REASONS
            ):
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
                        source if source in ("cache", "origin", "broadcast") else None,
                        _opt_str(loaded.get("seededFrom")),
                        float(seconds) if isinstance(seconds, int | float) else None,
                    )
                )
        ready = sum(is_true(p, "Ready") for p in members)
        out.append(
            ReplicaSetObservation(
                name=rs["metadata"]["name"],
                revision_hash=revision,
                replicas=int((rs.get("spec") or {}).get("replicas") or 0),
                ready=ready,
                available=ready,
                seeded=sum(
                    LOADED_ANNOTATION in (p["metadata"].get("annotations") or {})
                    or is_true(p, "ContainersReady")
                    for p in members
                ),
                verified=sum(is_true(p, VERIFIED_GATE) for p in members),
                failed=tuple(failed),
                loads=tuple(sorted(loads, key=lambda load: load.pod)),
            )
        )
    return tuple(out)


def prefetch_observation(
    digest: str, target_nodes: list[str], caches: list[dict[str, Any]]
) -> PrefetchObservation:
    """Pure: sum the staging of `digest` over the WeightCaches of the target nodes."""
    by_node = {(c.get("spec") or {}).get("nodeName") or c["metadata"]["name"]: c for c in caches}
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


class ManifestResolver:
    """Reads `weightship-manifest.json` from S3, cached briefly (S3 is not watched)."""

    def __init__(self, kube: Kube) -> None:
        self.kube = kube
        self.lock = threading.Lock()
        self.cache: dict[tuple[str, str | None], tuple[float, ManifestResolution]] = {}

    def resolve(self, rollout: ModelRollout) -> ManifestResolution:
        source = rollout.spec.model.source
        key = (source.uri, source.endpoint)
        with self.lock:
            hit = self.cache.get(key)
            if hit and time.monotonic() - hit[0] < MANIFEST_TTL_SECONDS:
                return hit[1]
        resolution = self._read(rollout)
        with self.lock:
            self.cache[key] = (time.monotonic(), resolution)
        return resolution

    def _read(self, rollout: ModelRollout) -> ManifestResolution:
        source = rollout.spec.model.source
        creds: dict[str, str] = {}
        try:
            if source.credentials_secret_ref is not None:
                creds = self.kube.secret_data(
                    rollout.metadata.namespace or "default", source.credentials_secret_ref.name
                )
            client = make_client(S3Settings.from_secret(source.endpoint, source.region, creds))
            origin = S3Origin(
                client,
                S3Location.parse(source.uri),
                retry=RetryPolicy(attempts=3, max_backoff_s=2.0),
            )
            manifest = origin.read_manifest()
        except ManifestError as e:
            return ManifestResolution(error=f"manifest at {source.uri} is invalid: {e}")
        except Exception as e:  # any S3 or credential failure is reported
            return ManifestResolution(error=f"cannot read the manifest at {source.uri}: {e}")
        return ManifestResolution(digest=manifest.digest)


MeasureFn = Callable[[str, str], float | None]


def prometheus_measure(address: str, query: str) -> float | None:
    """Run an instant query; None when it returns no data. Raises on errors."""
    from prometheus_api_client import PrometheusConnect

    result = PrometheusConnect(url=address, disable_ssl=True).custom_query(
        query, params={"timeout": "10s"}
    )
    if not result:
        return None
    return float(result[0]["value"][1])


def observe(
    kube: Kube,
    manifests: ManifestResolver,
    rollout: ModelRollout,
    now: datetime,
    measure: MeasureFn = prometheus_measure,
) -> Observed:
    namespace = rollout.metadata.namespace or "default"
    name = rollout.metadata.name
    manifest = manifests.resolve(rollout)
    replica_sets = replica_set_observations(
        kube.replicasets(namespace, name), kube.pods(namespace, name)
    )
    prefetch = None
    if rollout.spec.prefetch.enabled and manifest.digest:
        targets = [n["metadata"]["name"] for n in kube.nodes(rollout.spec.prefetch.node_selector)]
        prefetch = prefetch_observation(manifest.digest, targets, kube.weight_caches())
    measurements = []
    for q in due_queries(rollout, now):
        try:
            measurements.append(ObservedMeasurement(q.metric, now, measure(q.address, q.query)))
        except Exception as e:  # unreachable: an error
            measurements.append(ObservedMeasurement(q.metric, now, error=str(e)[:300]))
    template = None
    if rollout.spec.workload_ref is not None:
        template = kube.deployment_template(namespace, rollout.spec.workload_ref.name)
    return Observed(
        manifest=manifest,
        replica_sets=replica_sets,
        prefetch=prefetch,
        measurements=tuple(measurements),
        workload_template=template,
    )
