"""The largest WeightCache and ModelRollout status the CRDs admit stays far below etcd's
1.5 MiB, the models parse it, and a bound removed from the schema is caught (issue 42).
e2e/test_object_bounds.py stores the same objects in the real API server."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from pydantic import BaseModel

from weightship.api import crdgen
from weightship.api.status import ModelRolloutStatus
from weightship.api.weightcache import WeightCacheStatus
from weightship_testing.largest import UnboundedError, largest

# The status body alone; the stored object adds metadata and managedFields (the e2e test
# measures that, under 1 MiB).
STATUS_BOUND = {"WeightCache": 384 * 1024, "ModelRollout": 640 * 1024}
MODELS: dict[str, type[BaseModel]] = {
    "WeightCache": WeightCacheStatus,
    "ModelRollout": ModelRolloutStatus,
}


def status_schema(kind: str) -> dict[str, Any]:
    resource = next(r for r in crdgen.RESOURCES if r.kind == kind)
    schema = crdgen.crd(resource)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return copy.deepcopy(schema["properties"]["status"])


@pytest.mark.parametrize("kind", ["WeightCache", "ModelRollout"])
def test_largest_status_is_small_and_parses(kind: str) -> None:
    status = largest(status_schema(kind), ".status")
    size = len(json.dumps(status, separators=(",", ":")))
    print(f"largest {kind} status: {size} bytes")
    assert size < STATUS_BOUND[kind]
    MODELS[kind].model_validate(status)  # what the operator and the agent read back


def test_every_list_and_map_is_filled_to_its_bound() -> None:
    status = largest(status_schema("WeightCache"), ".status")
    manifests = status["manifests"]
    assert len(manifests) == 64 and len({m["digest"] for m in manifests}) == 64
    pins = manifests[0]["pinnedBy"]
    assert len(pins) == 8 and len(set(pins)) == 8 and {len(p) for p in pins} == {317}
    rollout = largest(status_schema("ModelRollout"), ".status")
    assert [c["type"] for c in rollout["conditions"]] == [
        "Prefetched", "Seeded", "Verified", "Progressing", "Paused", "Aborted", "InvalidSpec"
    ]  # fmt: skip
    selector = rollout["prefetchNodeSelector"]
    assert len(selector) == 64 and {len(k) for k in selector} == {317}


def _remove(schema: dict[str, Any], path: tuple[str, ...], key: str) -> dict[str, Any]:
    node = schema
    for part in path:
        node = node["items"] if part == "[]" else node["properties"][part]
    del node[key]
    return schema


@pytest.mark.parametrize(
    ("kind", "path", "key", "found"),
    [
        ("WeightCache", ("manifests",), "maxItems", "an array without maxItems"),
        ("WeightCache", ("manifests", "[]", "pinnedBy", "[]"), "maxLength", "a string"),
        ("WeightCache", ("manifests", "[]", "startedAt"), "maxLength", "a string"),
        ("ModelRollout", ("prefetchNodeSelector",), "maxProperties", "a map without"),
        ("ModelRollout", ("prefetchNodeSelector",), "x-kubernetes-validations", "CEL rule"),
    ],
)
def test_a_removed_bound_is_caught(kind: str, path: tuple[str, ...], key: str, found: str) -> None:
    schema = _remove(status_schema(kind), path, key)
    with pytest.raises(UnboundedError, match=found):
        largest(schema, ".status")


def test_preserved_unknown_fields_are_unbounded() -> None:
    with pytest.raises(UnboundedError, match="preserve-unknown-fields"):
        largest({"type": "object", "x-kubernetes-preserve-unknown-fields": True})
