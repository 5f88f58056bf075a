"""kopf handlers: thin shells around `Reconciler.once`.

One daemon per ModelRollout runs the level-triggered loop (observe → decide → apply) and
sleeps until its requeue time, or until a watch event on the rollout, its ReplicaSets,
its pods or a WeightCache wakes it. Wake-ups are hints only: status is the memory, and a
restarted operator simply reconciles every rollout again.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from typing import Any

import kopf
from prometheus_client import start_http_server

from weightship.controller.builders import GROUP, ROLLOUT_LABEL
from weightship.controller.kube import VERSION, Conflict, Kube, load_client
from weightship.controller.reconcile import Reconciler
from weightship.controller.verifier import Verifier
from weightship.notify.slack import SlackSender

FINALIZER = f"{GROUP}/finalizer"
WAKE_POLL_SECONDS = 0.5


@kopf.on.startup(id="configure")
def configure(settings: kopf.OperatorSettings, memo: Any, **_: Any) -> None:
    """Every kopf setting lives here."""
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    settings.peering.name = "weightship"
    settings.peering.mandatory = False
    settings.peering.priority = int(os.environ.get("WEIGHTSHIP_PEERING_PRIORITY", "0"))
    settings.posting.level = logging.INFO
    settings.execution.max_workers = int(os.environ.get("WEIGHTSHIP_MAX_WORKERS", "32"))
    settings.watching.server_timeout = 120
    settings.watching.client_timeout = 150
    settings.networking.request_timeout = 30
    kube = Kube(load_client())
    memo.reconciler = Reconciler(
        kube,
        slack=SlackSender(),
        verifier=Verifier(kube, workers=int(os.environ.get("WEIGHTSHIP_VERIFY_WORKERS", "8"))),
    )
    memo.wakeups = {}
    memo.wakeups_lock = threading.Lock()
    port = int(os.environ.get("WEIGHTSHIP_METRICS_PORT", "9100"))
    if port:
        start_http_server(port)


def _wakeup(memo: Any, namespace: str, name: str) -> threading.Event:
    with memo.wakeups_lock:
        event: threading.Event = memo.wakeups.setdefault((namespace, name), threading.Event())
        return event


def _wake(memo: Any, namespace: str | None, name: str | None) -> None:
    if namespace and name:
        _wakeup(memo, namespace, name).set()


@kopf.daemon(GROUP, VERSION, "modelrollouts", id="reconcile", cancellation_timeout=10)
def reconcile(
    name: str,
    namespace: str | None,
    stopped: kopf.DaemonStopped,
    memo: Any,
    logger: logging.Logger | logging.LoggerAdapter[Any],
    **_: Any,
) -> None:
    assert namespace is not None  # ModelRollouts are namespaced
    wake = _wakeup(memo, namespace, name)
    reconciler: Reconciler = memo.reconciler
    while not stopped:
        wake.clear()
        try:
            delay = reconciler.once(namespace, name)
        except Conflict as e:
            logger.debug("%s", e)
            continue
        except Exception:
            logger.exception("reconcile failed; retrying")
            delay = 5.0
        if delay is None:
            return
        waited = 0.0
        while waited < delay and not stopped and not wake.is_set():
            wake.wait(WAKE_POLL_SECONDS)
            waited += WAKE_POLL_SECONDS


@kopf.on.event(GROUP, VERSION, "modelrollouts", id="wake-on-rollout")
def wake_on_rollout(name: str, namespace: str | None, memo: Any, **_: Any) -> None:
    _wake(memo, namespace, name)


@kopf.on.event(
    "apps", "v1", "replicasets", labels={ROLLOUT_LABEL: kopf.PRESENT}, id="wake-on-replicaset"
)
def wake_on_replicaset(
    namespace: str | None, labels: Mapping[str, str], memo: Any, **_: Any
) -> None:
    _wake(memo, namespace, labels.get(ROLLOUT_LABEL))


@kopf.on.event("", "v1", "pods", labels={ROLLOUT_LABEL: kopf.PRESENT}, id="wake-on-pod")
def wake_on_pod(namespace: str | None, labels: Mapping[str, str], memo: Any, **_: Any) -> None:
    _wake(memo, namespace, labels.get(ROLLOUT_LABEL))


@kopf.on.event(GROUP, VERSION, "weightcaches", id="wake-on-weightcache")
def wake_on_weightcache(status: kopf.Status, memo: Any, **_: Any) -> None:
    # A cache knows which rollouts pin it; anything else waits for its own requeue.
    for manifest in status.get("manifests") or []:
        for pin in manifest.get("pinnedBy") or []:
            namespace, _sep, name = str(pin).partition("/")
            _wake(memo, namespace, name)
