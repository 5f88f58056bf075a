"""The agent's peer group on its WeightCache: set when created, moved when the group
changes, dropped when it is unset; and only the group's WeightCaches are listed."""

from __future__ import annotations

from typing import Any

from weightship.agent.kube import AgentKube
from weightship.api.names import PEER_GROUP_LABEL

NODE = {"metadata": {"name": "gpu-1", "uid": "u-1"}}


class Custom:
    """The three CustomObjectsApi calls AgentKube.ensure_weight_cache and weight_caches
    make, over one dict of WeightCaches (a stand-in for the API server)."""

    def __init__(self, caches: dict[str, dict[str, Any]] | None = None) -> None:
        self.caches = caches or {}
        self.selectors: list[str] = []

    def get_cluster_custom_object(self, *args: Any, **_: Any) -> dict[str, Any]:
        from kubernetes.client.rest import ApiException

        name = args[-1]
        if name not in self.caches:
            raise ApiException(status=404)
        return self.caches[name]

    def create_cluster_custom_object(self, *args: Any, **_: Any) -> dict[str, Any]:
        body = args[-1]
        self.caches[body["metadata"]["name"]] = body
        return body

    def patch_cluster_custom_object(self, *args: Any, **_: Any) -> dict[str, Any]:
        name, patch = args[-2], args[-1]
        labels = self.caches[name]["metadata"].setdefault("labels", {})
        for key, value in patch["metadata"]["labels"].items():
            if value is None:
                labels.pop(key, None)
            else:
                labels[key] = value
        return self.caches[name]

    def list_cluster_custom_object(self, *args: Any, label_selector: str = "", **_: Any) -> Any:
        self.selectors.append(label_selector)
        key, _, value = label_selector.partition("=")
        items = [
            c
            for c in self.caches.values()
            if not key or (c["metadata"].get("labels") or {}).get(key) == value
        ]
        return {"items": items}


def kube(custom: Custom, group: str) -> AgentKube:
    k = AgentKube.__new__(AgentKube)
    k.custom, k.peer_group = custom, group  # type: ignore[assignment]
    return k


def labels(custom: Custom) -> dict[str, str]:
    return dict(custom.caches["gpu-1"]["metadata"].get("labels") or {})


def test_the_group_is_set_moved_and_dropped_on_the_nodes_weightcache() -> None:
    custom = Custom()
    kube(custom, "zone-a").ensure_weight_cache(NODE)
    assert labels(custom)[PEER_GROUP_LABEL] == "zone-a"
    kube(custom, "zone-b").ensure_weight_cache(NODE)  # the agent restarted in another group
    assert labels(custom)[PEER_GROUP_LABEL] == "zone-b"
    kube(custom, "").ensure_weight_cache(NODE)
    assert PEER_GROUP_LABEL not in labels(custom)
    assert labels(custom)["app.kubernetes.io/managed-by"] == "weightship-agent"


def test_only_the_groups_weightcaches_are_peers() -> None:
    custom = Custom()
    for name, group in (("a", "zone-a"), ("b", "zone-b"), ("c", "")):
        kube(custom, group).ensure_weight_cache({"metadata": {"name": name, "uid": name}})
    names = lambda caches: sorted(c["metadata"]["name"] for c in caches)  # noqa: E731
    assert names(kube(custom, "zone-a").weight_caches()) == ["a"]
    assert names(kube(custom, "").weight_caches()) == ["a", "b", "c"]
    assert custom.selectors == [f"{PEER_GROUP_LABEL}=zone-a", ""]
