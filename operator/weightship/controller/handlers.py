"""kopf handlers: thin shells around the work queue, the watch caches and `Reconciler`.

- `@kopf.index` handlers keep what reconciles read, fed by kopf's watches (cache.py);
  nodes and WeightCaches, thousands in a fleet, are kept by two informers (informer.py).
- `@kopf.on.event` handlers only enqueue the rollout an event concerns. They are async and
  never block: the event loop is what dispatches every rollout.
- A fixed pool of worker threads (`WEIGHTSHIP_RECONCILE_WORKERS`, controller/settings.py)
  takes rollouts from the queue and runs the blocking reconcile, so concurrency does not
  grow with the number of rollouts and a burst of events for one rollout makes one
  reconcile.

Events are hints only: status is the memory. kopf fills every index before it calls any
other handler, and its first listing of ModelRollouts is an event for each one, so a
restarted operator reconciles every rollout again, from complete caches.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from collections.abc import Mapping
from typing import Any

import kopf
from kubernetes import client
from prometheus_client import start_http_server

from weightship.api.names import CACHE_PLURAL, FINALIZER, GROUP, ROLLOUT_LABEL, VERSION
from weightship.api.status import WorkloadStatus
from weightship.controller import apply, cache, metrics
from weightship.controller.events import EventPoster
from weightship.controller.kube import POD_WRITERS, Conflict, Kube
from weightship.controller.reconcile import Reconciler
from weightship.controller.settings import ControllerSettings, SettingsError
from weightship.controller.swapper import DEFAULT_WORKERS as SWAP_WORKERS
from weightship.controller.swapper import Swapper
from weightship.controller.verifier import Verifier
from weightship.controller.workqueue import Workers, WorkQueue
from weightship.core.workload import give_back
from weightship.kube.client import load_client
from weightship.kube.informer import Informer
from weightship.notify.slack import SlackSender

log = logging.getLogger(__name__)

INDEXES = ("rollouts", "rollout_replicasets", "rollout_pods")
# A WeightCache changes up to once per node per 10 s while it stages: a rollout that
# waits for staging reconciles at most once a second for all of its nodes together.
STAGING_WAKE_DELAY_S = 1.0
EVENT_THREADS = 2
RECONCILE_IN_FLIGHT_WAIT_S = 30.0


@kopf.on.startup(id="configure")
def configure(settings: kopf.OperatorSettings, memo: Any, **_: Any) -> None:
    """Every kopf setting lives here."""
    config = controller_settings(memo)
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    settings.peering.name = "weightship"
    settings.peering.mandatory = False
    settings.peering.priority = config.peering_priority
    settings.posting.level = logging.INFO
    # kopf's own executor runs only sync handlers (this one): reconciles have their pool.
    settings.execution.max_workers = config.kopf_max_workers
    settings.watching.server_timeout = 120
    settings.watching.client_timeout = 150
    settings.networking.request_timeout = 30


def controller_settings(memo: Any) -> ControllerSettings:
    """The settings `weightship operator` read before it started kopf, from kopf's memo;
    read here when kopf was started some other way (`kopf run`)."""
    if "controller_settings" not in memo:
        try:
            memo.controller_settings = ControllerSettings.from_env(os.environ)
        except SettingsError as error:
            raise kopf.PermanentError(str(error)) from None
    config: ControllerSettings = memo.controller_settings
    return config


@kopf.on.startup(id="start-workers")
async def start_workers(memo: Any, **kwargs: Any) -> None:
    """The queue, the caches' view and the worker threads (kopf passes the indexes)."""
    config = controller_settings(memo)
    reconcile_workers, verify_workers = config.reconcile_workers, config.verify_workers
    # One connection per thread that calls the API (the 2 informers' watches hold theirs):
    # past its pool size urllib3 opens and drops a TLS connection per request.
    api = await asyncio.to_thread(
        _client,
        reconcile_workers + verify_workers + SWAP_WORKERS + EVENT_THREADS + POD_WRITERS + 2 + 4,
    )
    kube = Kube(api)
    queue: WorkQueue[cache.RolloutKey] = WorkQueue()
    loop = asyncio.get_running_loop()
    by_digest: kopf.Index[Any, Any] = kwargs["rollouts_by_digest"]
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    nodes = Informer("nodes", core.list_node, cache.index_node_labels)
    caches = Informer(
        "weightcaches",
        functools.partial(custom.list_cluster_custom_object, GROUP, VERSION, CACHE_PLURAL),
        cache.index_cache_entries,
        # Called on the informer's thread: the kopf index is read on the loop.
        on_event=lambda body: loop.call_soon_threadsafe(
            _enqueue_for_cache, queue, by_digest, body.get("status") or {}
        ),
    )
    view = cache.ClusterView({name: kwargs[name] for name in INDEXES}, nodes, caches, loop)
    reconciler = Reconciler(
        kube,
        view,
        slack=SlackSender(),
        verifier=Verifier(
            kube,
            workers=verify_workers,
            cache_dir=config.cache_dir,
            on_verdict=lambda namespace, name: queue.add((namespace, name)),
        ),
        swapper=Swapper(
            kube,
            workers=SWAP_WORKERS,
            on_done=lambda namespace, name: queue.add((namespace, name)),
        ),
        requeue=queue.add,
        cache_dir=config.cache_dir,
        events=EventPoster(kube.event, threads=EVENT_THREADS),
    )

    def failed(key: cache.RolloutKey, error: BaseException) -> None:
        log.error("reconciling %s/%s failed; retrying with back-off", *key, exc_info=error)

    workers = Workers(
        queue,
        lambda key: reconciler.once(*key),
        reconcile_workers,
        on_error=failed,
        requeue_now=(Conflict,),
    )
    memo.queue, memo.workers, memo.reconciler = queue, workers, reconciler
    memo.informers = (nodes, caches)
    nodes.start()
    caches.start()
    metrics.QUEUE_DEPTH.set_function(lambda: len(queue))
    metrics.QUEUE_WAITING.set_function(queue.waiting)
    workers.start()
    if config.metrics_port:
        metrics.LEADER.set(1)
        await asyncio.to_thread(start_http_server, config.metrics_port)


@kopf.on.cleanup(id="stop-workers")
async def stop_workers(memo: Any, **_: Any) -> None:
    workers: Workers[cache.RolloutKey] | None = getattr(memo, "workers", None)
    if workers is not None:
        await asyncio.to_thread(workers.stop)
        memo.reconciler.close()
    for informer in getattr(memo, "informers", ()):
        await asyncio.to_thread(informer.stop)


def _client(connections: int) -> client.ApiClient:
    configuration = load_client().configuration
    configuration.connection_pool_maxsize = connections
    return client.ApiClient(configuration)


def _enqueue(memo: Any, namespace: str | None, name: str | None) -> None:
    queue: WorkQueue[cache.RolloutKey] | None = getattr(memo, "queue", None)
    if queue is not None and namespace and name:
        queue.add((namespace, name))


# ---- the watch caches -----------------------------------------------------------------
@kopf.index(GROUP, VERSION, "modelrollouts", id="rollouts")
async def rollouts(
    body: kopf.Body, namespace: str | None, name: str | None, **_: Any
) -> dict[Any, Any]:
    return {(namespace, name): cache.index_rollout(body)}


@kopf.index(
    GROUP,
    VERSION,
    "modelrollouts",
    id="rollouts_by_digest",
    field="spec.prefetch.enabled",
    value=True,
)
async def rollouts_by_digest(
    status: kopf.Status, namespace: str | None, name: str | None, **_: Any
) -> dict[Any, Any]:
    """Prefetching rollouts by the digests they stage: whom a WeightCache change concerns."""
    digests = {
        (status.get(revision) or {}).get("manifestDigest")
        for revision in ("canaryRevision", "stableRevision")
    }
    return {digest: (namespace, name) for digest in digests if digest}


@kopf.index(
    "apps", "v1", "replicasets", labels={ROLLOUT_LABEL: kopf.PRESENT}, id="rollout_replicasets"
)
async def rollout_replicasets(
    body: kopf.Body, namespace: str | None, labels: Mapping[str, str], **_: Any
) -> dict[Any, Any]:
    return {(namespace, labels[ROLLOUT_LABEL]): cache.index_replicaset(body)}


@kopf.index("", "v1", "pods", labels={ROLLOUT_LABEL: kopf.PRESENT}, id="rollout_pods")
async def rollout_pods(
    body: kopf.Body, namespace: str | None, labels: Mapping[str, str], **_: Any
) -> dict[Any, Any]:
    return {(namespace, labels[ROLLOUT_LABEL]): cache.index_pod(body)}


# ---- deletion -------------------------------------------------------------------------
@kopf.on.delete(
    GROUP,
    VERSION,
    "modelrollouts",
    id="give-back-workload",
    field="status.workload",
    value=kopf.PRESENT,
    backoff=5,
)
def give_back_workload(
    status: kopf.Status, namespace: str | None, name: str | None, memo: Any, **_: Any
) -> None:
    """A rollout that scaled its workloadRef Deployment to zero gives it back its replicas.
    kopf puts the finalizer on a rollout only while status.workload records such a
    Deployment, so this runs before the rollout is gone, and only for those; a failed
    write raises and kopf retries (the scale is idempotent)."""
    namespace = namespace or "default"
    record = WorkloadStatus.model_validate(dict(status["workload"]))
    # Reconciles from now on see the deletion and scale nothing down; one that began
    # before it may still write its scale-down: give back only after it is done.
    memo.queue.wait_idle((namespace, name), RECONCILE_IN_FLIGHT_WAIT_S)
    apply.apply_workloads(memo.reconciler.kube, namespace, [give_back(record)])


# ---- events only enqueue --------------------------------------------------------------
@kopf.on.event(GROUP, VERSION, "modelrollouts", id="enqueue-rollout")
async def enqueue_rollout(name: str | None, namespace: str | None, memo: Any, **_: Any) -> None:
    _enqueue(memo, namespace, name)


@kopf.on.event(
    "apps", "v1", "replicasets", labels={ROLLOUT_LABEL: kopf.PRESENT}, id="enqueue-replicaset"
)
async def enqueue_replicaset(
    namespace: str | None, labels: Mapping[str, str], memo: Any, **_: Any
) -> None:
    _enqueue(memo, namespace, labels.get(ROLLOUT_LABEL))


@kopf.on.event("", "v1", "pods", labels={ROLLOUT_LABEL: kopf.PRESENT}, id="enqueue-pod")
async def enqueue_pod(
    namespace: str | None, labels: Mapping[str, str], memo: Any, **_: Any
) -> None:
    _enqueue(memo, namespace, labels.get(ROLLOUT_LABEL))


def _enqueue_for_cache(
    queue: WorkQueue[cache.RolloutKey], by_digest: kopf.Index[Any, Any], status: Mapping[str, Any]
) -> None:
    """A WeightCache changed (on the loop): wake the rollouts that pin or prefetch its
    digests, in a second (one reconcile per second for any number of nodes' progress)."""
    for manifest in status.get("manifests") or []:
        wanted = set(by_digest.get(manifest.get("digest"), ()))
        for pin in manifest.get("pinnedBy") or []:
            namespace, _sep, name = str(pin).partition("/")
            if namespace and name:
                wanted.add((namespace, name))
        for key in wanted:
            queue.add_after(key, STAGING_WAKE_DELAY_S)
