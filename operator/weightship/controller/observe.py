"""Build `Observed` for one rollout from the watch caches, the manifest in S3 and due
Prometheus measurements. Adapters only: no decisions.

The cluster objects come from `cache.ClusterView` (no API reads). What is not watched is
fetched off the reconcile workers, on small bounded pools: the manifest (S3) and the
analysis queries (Prometheus). A reconcile never waits for them: it gets a result when
there is one, and the lookup's completion enqueues the rollout again.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from weightship.api.models import ModelRollout
from weightship.api.names import FINALIZER
from weightship.controller.cache import ClusterView, RolloutKey, RolloutObjects
from weightship.controller.kube import Kube
from weightship.controller.snapshot import (
    observed_pods,
    prefetch_observation,
    replica_set_observations,
)
from weightship.core.analysis import AnalysisQuery, due_queries
from weightship.core.observed import (
    ManifestResolution,
    Observed,
    ObservedMeasurement,
    PodSwap,
    PodVerdict,
)
from weightship.core.targets import prefetch_node_selector
from weightship.data.s3 import RetryPolicy, S3Location, S3Origin, S3Settings, make_client
from weightship.weightformat.manifest import ManifestError

log = logging.getLogger(__name__)

MANIFEST_RETRY_S = (5.0, 300.0)  # back-off after a failed read: first, at most
MAX_CACHED_SOURCES = 4096
MEASUREMENT_MAX_AGE_S = 30.0
TEMPLATE_TTL_S = 30.0

Notify = Callable[[RolloutKey], None]


class _Lookups:
    """Results of slow lookups by key, computed on a bounded pool; each key is computed
    once at a time, and whoever asked while it ran is notified when it is done."""

    def __init__(self, workers: int, name: str, notify: Notify) -> None:
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
        self.notify = notify
        self.lock = threading.Lock()
        self.waiters: dict[Hashable, set[RolloutKey]] = {}

    def start(self, key: Hashable, waiter: RolloutKey, fn: Callable[[], None]) -> None:
        with self.lock:
            if key in self.waiters:
                self.waiters[key].add(waiter)
                return
            self.waiters[key] = {waiter}

        def run() -> None:
            try:
                fn()
            finally:
                with self.lock:
                    waiting = self.waiters.pop(key, set())
                for rollout in waiting:
                    self.notify(rollout)

        self.pool.submit(run)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


@dataclass
class _Manifest:
    resolution: ManifestResolution | None  # None: never read yet
    retry_at: float = 0.0
    failures: int = 0


class ManifestResolver:
    """The manifest digest of each rollout's source, read from S3 once per source.

    Manifests are immutable in practice (a new model version is a new URI or revision),
    so a digest found stays until the source in the spec changes; the credentials Secret
    is read only for that one read. A failed read is retried with back-off, from 5 s up to
    5 minutes, while the last answer (the error) stays what the rollout reports.
    """

    def __init__(self, kube: Kube, notify: Notify = lambda key: None, workers: int = 4) -> None:
        self.kube = kube
        self.lookups = _Lookups(workers, "manifest", notify)
        self.lock = threading.Lock()
        self.cache: OrderedDict[Hashable, _Manifest] = OrderedDict()

    @staticmethod
    def source_key(rollout: ModelRollout) -> Hashable:
        source = rollout.spec.model.source
        secret = source.credentials_secret_ref
        return (
            rollout.metadata.namespace or "default",
            source.uri,
            source.endpoint,
            source.region,
            secret.name if secret is not None else None,
            rollout.spec.model.revision,
        )

    def resolve(self, rollout: ModelRollout, waiter: RolloutKey) -> ManifestResolution | None:
        """The resolution known now; None while the first read runs."""
        key = self.source_key(rollout)
        with self.lock:
            entry = self.cache.get(key)
            if entry is not None:
                self.cache.move_to_end(key)
            due = entry is None or (
                entry.resolution is not None
                and entry.resolution.error is not None
                and time.monotonic() >= entry.retry_at
            )
        if due:
            self.lookups.start(key, waiter, lambda: self._read_into(key, rollout))
        return entry.resolution if entry is not None else None

    def _read_into(self, key: Hashable, rollout: ModelRollout) -> None:
        resolution = self._read(rollout)
        with self.lock:
            entry = self.cache.get(key) or _Manifest(None)
            entry.resolution = resolution
            if resolution.error is None:
                entry.failures = 0
            else:
                first, most = MANIFEST_RETRY_S
                entry.retry_at = time.monotonic() + min(most, first * 2.0**entry.failures)
                entry.failures += 1
            self.cache[key] = entry
            self.cache.move_to_end(key)
            while len(self.cache) > MAX_CACHED_SOURCES:
                self.cache.popitem(last=False)

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


class Measurements:
    """Due analysis queries, run on their own pool. A result is handed to the next
    reconcile of its rollout once (and dropped when no reconcile takes it in 30 s)."""

    def __init__(self, measure: MeasureFn, notify: Notify = lambda key: None, workers: int = 4):
        self.measure = measure
        self.lookups = _Lookups(workers, "measure", notify)
        self.lock = threading.Lock()
        self.results: dict[Hashable, tuple[float, ObservedMeasurement]] = {}

    def take(
        self, waiter: RolloutKey, queries: list[AnalysisQuery]
    ) -> tuple[list[ObservedMeasurement], bool]:
        """Results ready for `queries`, and whether any query is still running."""
        out, pending = [], False
        now = time.monotonic()
        for q in queries:
            key = (waiter, q.metric, q.address, q.query)
            with self.lock:
                hit = self.results.pop(key, None)
                for stale in [k for k, (t, _m) in self.results.items() if now - t > 30]:
                    del self.results[stale]
            if hit is not None:
                out.append(hit[1])
                continue
            pending = True
            self.lookups.start(key, waiter, functools.partial(self._run, key, q))
        return out, pending

    def _run(self, key: Hashable, q: AnalysisQuery) -> None:
        at = datetime.now(UTC)
        try:
            result = ObservedMeasurement(q.metric, at, self.measure(q.address, q.query))
        except Exception as e:  # unreachable: an error
            result = ObservedMeasurement(q.metric, at, error=str(e)[:300])
        with self.lock:
            self.results[key] = (time.monotonic(), result)


@dataclass(frozen=True)
class Workload:
    """What the rollout reads of its spec.workloadRef Deployment."""

    template: dict[str, Any]
    replicas: int


class Templates:
    """spec.workloadRef's Deployment (pod template and replica count), re-read at most
    every 30 s (Deployments are not watched: the operator would have to hold every
    Deployment of the cluster), and at once after the operator scaled it (`forget`)."""

    def __init__(self, kube: Kube) -> None:
        self.kube = kube
        self.lock = threading.Lock()
        self.cache: dict[tuple[str, str], tuple[float, Workload | None]] = {}

    def get(self, namespace: str, name: str) -> Workload | None:
        key = (namespace, name)
        with self.lock:
            hit = self.cache.get(key)
        if hit is not None and time.monotonic() - hit[0] < TEMPLATE_TTL_S:
            return hit[1]
        spec = self.kube.deployment(namespace, name)
        workload = None
        if spec is not None:
            replicas = spec.get("replicas")
            workload = Workload(
                template=dict(spec.get("template") or {}),
                replicas=1 if replicas is None else int(replicas),  # the API's default
            )
        with self.lock:
            self.cache[key] = (time.monotonic(), workload)
        return workload

    def forget(self, namespace: str, name: str) -> None:
        with self.lock:
            self.cache.pop((namespace, name), None)


@dataclass(frozen=True)
class Observation:
    observed: Observed
    waiting: bool  # a measurement still runs, or the node caches are still listing


def observe(
    view: ClusterView,
    objects: RolloutObjects,
    rollout: ModelRollout,
    manifests: ManifestResolver,
    measurements: Measurements,
    templates: Templates,
    now: datetime,
    verdicts: Mapping[str, PodVerdict] | None = None,
    swaps: Mapping[str, PodSwap] | None = None,
) -> Observation | None:
    """None while the manifest is being read for the first time. ``verdicts``: the
    verifier's, not yet on the pods' gates; ``swaps``: the swapper's reports, not yet on
    the pods' records (both by pod uid)."""
    namespace = rollout.metadata.namespace or "default"
    key = (namespace, rollout.metadata.name)
    manifest = manifests.resolve(rollout, key)
    if manifest is None:
        return None
    replica_sets = replica_set_observations(objects.replica_sets, objects.pods)
    workload = None
    if rollout.spec.workload_ref is not None:
        workload = templates.get(namespace, rollout.spec.workload_ref.name)
    template = workload.template if workload is not None else None
    prefetch = None
    staging_synced = True
    if rollout.spec.prefetch.enabled and manifest.digest:
        pod_template = rollout.spec.template.to_k8s() if rollout.spec.template else template
        selector = prefetch_node_selector(rollout.spec, pod_template)
        staging = view.staging(selector, manifest.digest)
        staging_synced = staging.synced
        if staging.synced:  # else: no observation yet (the prefetch gate waits)
            prefetch = prefetch_observation(
                manifest.digest, staging.target_nodes, staging.caches, staging.node_labels
            )
    measured, waiting = measurements.take(key, due_queries(rollout, now))
    meta = objects.rollout.get("metadata") or {}
    return Observation(
        Observed(
            manifest=manifest,
            replica_sets=replica_sets,
            pods=observed_pods(objects.pods, verdicts, swaps),
            prefetch=prefetch,
            measurements=tuple(measured),
            workload_template=template,
            workload_replicas=workload.replicas if workload is not None else None,
            finalizer=FINALIZER in (meta.get("finalizers") or ()),
            deleting=meta.get("deletionTimestamp") is not None,
        ),
        waiting or not staging_synced,
    )
