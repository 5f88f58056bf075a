"""The API server stores the largest WeightCache and ModelRollout status the CRDs admit,
and the stored object, managedFields included, stays far below etcd's 1.5 MiB (issue 42).

The objects are built by walking the generated schemas (weightship_testing.largest):
every array at maxItems, every string at maxLength, every map at maxProperties. A bound
removed from the models makes the walk raise, so this test cannot pass by measuring less.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from weightship.api.names import (
    API_VERSION,
    CACHE_KIND,
    CACHE_PLURAL,
    GROUP,
    PEER_GROUP_LABEL,
    ROLLOUT_PLURAL,
    VERSION,
)
from weightship_dev import testkit
from weightship_testing.largest import largest
from weightship_testing.samples import VALID_MANIFEST

NAMESPACE_PREFIX = "bounds-"
CRDS = Path(__file__).resolve().parents[1] / "crds"
# etcd refuses a value over 1.5 MiB; the largest object must leave room to spare.
STORED_BOUND = 1024 * 1024
# No agent takes this cache for a peer: agents list only their own peer group's caches.
NO_AGENT_GROUP = "object-bounds-test"


def schema(kind: str) -> dict[str, Any]:
    crd = yaml.safe_load((CRDS / f"{kind.lower()}.yaml").read_text())
    found: dict[str, Any] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return found


def stored_size(name: str, stored: dict[str, Any]) -> int:
    size = len(json.dumps(stored, separators=(",", ":")))
    managed = len(json.dumps(stored["metadata"].get("managedFields", []), separators=(",", ":")))
    status = len(json.dumps(stored["status"], separators=(",", ":")))
    print(f"{name}: stored {size} bytes (status {status}, managedFields {managed})")
    return size


@pytest.fixture
def custom(cluster: Any, crds: None) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(cluster.api)


@pytest.fixture
def cache_name(custom: client.CustomObjectsApi) -> Iterator[str]:
    name = testkit.unique_name("bounds")
    yield name
    custom.delete_cluster_custom_object(GROUP, VERSION, CACHE_PLURAL, name)


def test_the_largest_weightcache_is_stored(
    custom: client.CustomObjectsApi, cache_name: str
) -> None:
    whole = schema(CACHE_KIND)["properties"]
    spec, status = largest(whole["spec"], ".spec"), largest(whole["status"], ".status")
    body = {
        "apiVersion": API_VERSION,
        "kind": CACHE_KIND,
        "metadata": {"name": cache_name, "labels": {PEER_GROUP_LABEL: NO_AGENT_GROUP}},
        "spec": spec,
    }
    custom.create_cluster_custom_object(GROUP, VERSION, CACHE_PLURAL, body)
    stored = custom.patch_cluster_custom_object_status(
        GROUP, VERSION, CACHE_PLURAL, cache_name, {"status": status}
    )
    assert stored["status"] == status  # nothing refused, nothing pruned
    assert stored_size("largest WeightCache", stored) < STORED_BOUND
    again = custom.get_cluster_custom_object(GROUP, VERSION, CACHE_PLURAL, cache_name)
    assert again["status"] == status
    # The bound is the API server's: one pin more is refused (the agent cuts and counts).
    status["manifests"][0]["pinnedBy"].append("one/more")
    with pytest.raises(ApiException) as refused:
        custom.patch_cluster_custom_object_status(
            GROUP, VERSION, CACHE_PLURAL, cache_name, {"status": status}
        )
    assert refused.value.status == 422 and "pinnedBy" in str(refused.value.body)


def test_the_largest_modelrollout_status_is_stored(
    custom: client.CustomObjectsApi, namespace: str
) -> None:
    """The spec is the sample's: a pod template is as unbounded as a Deployment's."""
    status = largest(schema("ModelRollout")["properties"]["status"], ".status")
    body = {**VALID_MANIFEST, "metadata": {"name": "largest", "namespace": namespace}}
    args = (GROUP, VERSION, namespace, ROLLOUT_PLURAL)
    custom.create_namespaced_custom_object(*args, body)
    stored = custom.patch_namespaced_custom_object_status(*args, "largest", {"status": status})
    assert stored["status"] == status
    assert stored_size("largest ModelRollout", stored) < STORED_BOUND
