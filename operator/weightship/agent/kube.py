"""Kubernetes adapter for the agent: its node, rollouts (watched), WeightCaches. No Secrets:
the agent's S3 credential is a mounted file (weightship.agent.credentials).

The client, the retry policy and the list-then-watch cache are the shared ones
(`weightship.kube`); the agent imports nothing from the controller.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Hashable
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException

from weightship.api.names import (
    API_VERSION,
    CACHE_KIND,
    CACHE_PLURAL,
    GROUP,
    PEER_GROUP_LABEL,
    ROLLOUT_PLURAL,
    VERSION,
)
from weightship.kube.client import api_retry
from weightship.kube.informer import Informer

# (connect, read) seconds for each call but the watch: an API server that is down or cut
# off must not hold a stage's start or a status write forever.
REQUEST_TIMEOUT_S = (5.0, 60.0)


class AgentKube:
    def __init__(self, api: client.ApiClient, peer_group: str = "") -> None:
        self.api = api
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.peer_group = peer_group

    @api_retry
    def node(self, name: str) -> dict[str, Any]:
        return dict(
            self.api.sanitize_for_serialization(
                self.core.read_node(name, _request_timeout=REQUEST_TIMEOUT_S)
            )
        )

    @api_retry
    def weight_caches(self) -> list[dict[str, Any]]:
        """The WeightCaches of this agent's peer group (every one without a group)."""
        selector = f"{PEER_GROUP_LABEL}={self.peer_group}" if self.peer_group else ""
        listing = self.custom.list_cluster_custom_object(
            GROUP,
            VERSION,
            CACHE_PLURAL,
            resource_version="0",
            label_selector=selector,
            _request_timeout=REQUEST_TIMEOUT_S,
        )
        return list(listing.get("items", []))

    @api_retry
    def get_weight_cache(self, name: str) -> dict[str, Any] | None:
        try:
            return dict(
                self.custom.get_cluster_custom_object(
                    GROUP, VERSION, CACHE_PLURAL, name, _request_timeout=REQUEST_TIMEOUT_S
                )
            )
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    @api_retry
    def ensure_weight_cache(self, node: dict[str, Any]) -> dict[str, Any]:
        """This node's WeightCache, created when missing. The Node owns it, so it goes
        when the node is deleted."""
        name = node["metadata"]["name"]
        group = {PEER_GROUP_LABEL: self.peer_group or None}
        found = self.get_weight_cache(name)
        if found is not None:
            labels = (found.get("metadata") or {}).get("labels") or {}
            if labels.get(PEER_GROUP_LABEL) != group[PEER_GROUP_LABEL]:
                # This node's agent changed groups: its peers find it in the new one only.
                found = dict(
                    self.custom.patch_cluster_custom_object(
                        GROUP,
                        VERSION,
                        CACHE_PLURAL,
                        name,
                        {"metadata": {"labels": group}},
                        _request_timeout=REQUEST_TIMEOUT_S,
                    )
                )
            return found
        body = {
            "apiVersion": API_VERSION,
            "kind": CACHE_KIND,
            "metadata": {
                "name": name,
                "labels": {
                    "app.kubernetes.io/managed-by": "weightship-agent",
                    **({PEER_GROUP_LABEL: self.peer_group} if self.peer_group else {}),
                },
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
            return dict(
                self.custom.create_cluster_custom_object(
                    GROUP, VERSION, CACHE_PLURAL, body, _request_timeout=REQUEST_TIMEOUT_S
                )
            )
        except ApiException as e:
            if e.status != 409:
                raise
        return dict(
            self.custom.get_cluster_custom_object(
                GROUP, VERSION, CACHE_PLURAL, name, _request_timeout=REQUEST_TIMEOUT_S
            )
        )

    @api_retry
    def patch_weight_cache_status(self, name: str, status: dict[str, Any]) -> None:
        self.custom.patch_cluster_custom_object_status(
            GROUP,
            VERSION,
            CACHE_PLURAL,
            name,
            {"status": status},
            _request_timeout=REQUEST_TIMEOUT_S,
        )


def rollout_informer(
    kube: AgentKube, on_change: Callable[[], None], *, stop: threading.Event
) -> Informer:
    """A local copy of every ModelRollout: one list, then a watch; relists on 410 Gone.

    Agents never poll rollouts: with thousands of nodes the watch is what keeps the API
    server's load flat, and each relist is served from its watch cache (one unpaged list
    at resourceVersion 0). `on_change` is called after every listing and every event (a
    hint to re-evaluate); `snapshot()` is every rollout. Setting `stop` ends the thread.
    """
    return Informer(
        ROLLOUT_PLURAL,
        api_retry(
            functools.partial(
                kube.custom.list_cluster_custom_object, GROUP, VERSION, ROLLOUT_PLURAL
            )
        ),
        _whole,
        on_event=lambda _: on_change(),
        on_list=on_change,
        page_size=None,
        stop=stop,
    )


def _whole(obj: dict[str, Any]) -> dict[Hashable, Any]:
    """The rollout itself, under its namespace and name."""
    meta = obj["metadata"]
    return {(meta.get("namespace"), meta["name"]): obj}
