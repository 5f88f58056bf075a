"""Kubernetes adapter for the agent: its node, rollouts (watched), WeightCaches. No Secrets:
the agent's S3 credential is a mounted file (weightship.agent.credentials).

Retries live here (tenacity, shared with the controller's adapter), nowhere else.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from kubernetes import client, watch
from kubernetes.client.rest import ApiException

from weightship.controller.builders import GROUP
from weightship.controller.kube import VERSION, api_retry, load_client

log = logging.getLogger(__name__)

ROLLOUTS = "modelrollouts"
CACHES = "weightcaches"

__all__ = ["AgentKube", "RolloutInformer", "load_client"]


class AgentKube:
    def __init__(self, api: client.ApiClient) -> None:
        self.api = api
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)

    @api_retry
    def node(self, name: str) -> dict[str, Any]:
        return dict(self.api.sanitize_for_serialization(self.core.read_node(name)))

    @api_retry
    def list_rollouts(self) -> dict[str, Any]:
        # resourceVersion "0": served from the API server's watch cache, not etcd.
        return dict(
            self.custom.list_cluster_custom_object(GROUP, VERSION, ROLLOUTS, resource_version="0")
        )

    @api_retry
    def weight_caches(self) -> list[dict[str, Any]]:
        listing = self.custom.list_cluster_custom_object(
            GROUP, VERSION, CACHES, resource_version="0"
        )
        return list(listing.get("items", []))

    @api_retry
    def get_weight_cache(self, name: str) -> dict[str, Any] | None:
        try:
            return dict(self.custom.get_cluster_custom_object(GROUP, VERSION, CACHES, name))
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    @api_retry
    def ensure_weight_cache(self, node: dict[str, Any]) -> dict[str, Any]:
        """This node's WeightCache, created when missing. The Node owns it, so it goes
        when the node is deleted."""
        name = node["metadata"]["name"]
        found = self.get_weight_cache(name)
        if found is not None:
            return found
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "WeightCache",
            "metadata": {
                "name": name,
                "labels": {"app.kubernetes.io/managed-by": "weightship-agent"},
                "ownerReferences": [
                    {
                        "apiVersion": "v1",
                        "kind": "Node",
                        "name": name,
                        "uid": node["metadata"]["uid"],
                    }
                ],
            },
            "spec": {"nodeName": name},
        }
        try:
            return dict(self.custom.create_cluster_custom_object(GROUP, VERSION, CACHES, body))
        except ApiException as e:
            if e.status != 409:
                raise
        return dict(self.custom.get_cluster_custom_object(GROUP, VERSION, CACHES, name))

    @api_retry
    def patch_weight_cache_status(self, name: str, status: dict[str, Any]) -> None:
        self.custom.patch_cluster_custom_object_status(
            GROUP, VERSION, CACHES, name, {"status": status}
        )


class RolloutInformer:
    """A local copy of every ModelRollout: one list, then a watch; relists on 410 Gone.

    Agents never poll rollouts: with thousands of nodes the watch is what keeps the API
    server's load flat. `on_change` is called after every event (a hint to re-evaluate).
    """

    def __init__(
        self,
        kube: AgentKube,
        on_change: Callable[[], None],
        *,
        watch_timeout_s: int = 300,
        retry_s: float = 5.0,
    ) -> None:
        self.kube = kube
        self.on_change = on_change
        self.watch_timeout_s = watch_timeout_s
        self.retry_s = retry_s
        self.synced = threading.Event()
        self._items: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def snapshot(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._items.values())

    def start(self, stop: threading.Event) -> None:
        self._thread = threading.Thread(
            target=self._run, args=(stop,), name="rollout-informer", daemon=True
        )
        self._thread.start()

    def _run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                listing = self.kube.list_rollouts()
                with self._lock:
                    self._items = {_key(o): o for o in listing.get("items", [])}
                self.synced.set()
                self.on_change()
                self._watch(stop, listing["metadata"]["resourceVersion"])
            except Exception as e:  # the API server restarting, RBAC, network: relist
                if not stop.is_set():
                    log.warning(
                        "watching ModelRollouts failed, relisting in %ss: %s", self.retry_s, e
                    )
                    stop.wait(self.retry_s)

    def _watch(self, stop: threading.Event, resource_version: str) -> None:
        while not stop.is_set():
            w = watch.Watch()
            for event in w.stream(
                self.kube.custom.list_cluster_custom_object,
                GROUP,
                VERSION,
                ROLLOUTS,
                resource_version=resource_version,
                timeout_seconds=self.watch_timeout_s,
                allow_watch_bookmarks=True,
            ):
                if stop.is_set():
                    w.stop()
                    return
                kind, obj = event["type"], event["object"]
                if kind == "ERROR":
                    return  # 410 Gone and friends: the caller relists
                resource_version = obj["metadata"]["resourceVersion"]
                if kind == "BOOKMARK":
                    continue
                with self._lock:
                    if kind == "DELETED":
                        self._items.pop(_key(obj), None)
                    else:
                        self._items[_key(obj)] = obj
                self.on_change()


def _key(obj: dict[str, Any]) -> str:
    meta = obj["metadata"]
    return f"{meta.get('namespace')}/{meta['name']}"
