"""Build `Observed` for one rollout: ReplicaSets and pods, the manifest in S3, staging
progress from WeightCaches, and due Prometheus measurements. Adapters only: no decisions.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import datetime

from weightship.api.models import ModelRollout
from weightship.controller.kube import Kube
from weightship.controller.snapshot import prefetch_observation, replica_set_observations
from weightship.core.analysis import due_queries
from weightship.core.observed import ManifestResolution, Observed, ObservedMeasurement
from weightship.data.manifest import ManifestError
from weightship.data.s3 import RetryPolicy, S3Location, S3Origin, S3Settings, make_client

log = logging.getLogger(__name__)

MANIFEST_TTL_SECONDS = 30.0


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
