"""spec.template.spec as admission checks it (weightship.api.podspec), on the model side:
what a ReplicaSet create refuses (the messages the API server gives, checked against a
real one by e2e/test_admission.py) is refused when the operator parses the rollout."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from pydantic import ValidationError

from weightship.api.models import ModelRollout
from weightship.api.podspec import check_pod_spec
from weightship_testing.samples import VALID_MANIFEST

SERVER = {"name": "server", "image": "img:1"}


def res(**resources: Any) -> dict[str, Any]:
    return {"containers": [{**SERVER, "resources": resources}]}


ADMITTED = [
    {"containers": [SERVER]},
    {"containers": [SERVER], "initContainers": [{"name": "init", "image": "x"}]},
    {"containers": [SERVER, {"name": "sidecar", "image": "y"}], "bogus": {"kept": True}},
    res(limits={"nvidia.com/gpu": 1, "cpu": "500m", "memory": "2Gi"}),
    res(limits={"nvidia.com/gpu": "2", "cpu": "1e3"}, requests={"cpu": "999", "memory": 10}),
    res(limits={"ephemeral-storage": "1Gi", "example.com/x": "2000m"}),
    res(requests={"cpu": "1"}, limits={"memory": "1Gi"}),  # no shared key: nothing to compare
]
REFUSED = [
    ({}, "containers"),
    ({"containers": []}, "containers"),
    ({"containers": {"a": 1}}, "containers"),
    ({"containers": ["server"]}, "containers[0]"),
    ({"containers": [{"image": "x"}]}, "containers[0].name"),
    ({"containers": [{"name": "Server", "image": "x"}]}, "containers[0].name"),
    ({"containers": [{"name": "a" * 64, "image": "x"}]}, "containers[0].name"),
    ({"containers": [{"name": "a"}]}, "containers[0].image"),
    ({"containers": [{"name": "a", "image": ""}]}, "containers[0].image"),
    ({"containers": [SERVER, SERVER]}, "unique"),
    ({"containers": [SERVER], "initContainers": [SERVER]}, "unique"),
    (res(limits={"cpu": "-1"}), "limits[cpu]"),
    (res(limits={"cpu": -1}), "limits[cpu]"),
    (res(limits={"cpu": 1.5}), "limits[cpu]"),
    (res(limits={"cpu": True}), "limits[cpu]"),
    (res(limits={"cpu": "abc"}), "limits[cpu]"),
    (res(limits={"cpu": "1e1.5"}), "limits[cpu]"),
    (res(limits={"cpu": "1" * 65}), "limits[cpu]"),
    (res(limits={"app": "1"}), "resource names"),
    (res(limits={"kubernetes.io/foo": "1"}), "resource names"),
    (res(limits={"example.com/a b": "1"}), "resource names"),
    (res(limits={"nvidia.com/gpu": "1.5"}), "whole numbers"),
    (res(limits={"nvidia.com/gpu": "1500m"}), "whole numbers"),
    (res(requests={"cpu": "2"}, limits={"cpu": 1}), "requests[cpu]"),
    (res(requests={"memory": "1.1Gi"}, limits={"memory": "1Gi"}), "requests[memory]"),
]


@pytest.mark.parametrize("spec", ADMITTED)
def test_what_a_replicaset_takes_is_admitted(spec: dict[str, Any]) -> None:
    assert check_pod_spec(copy.deepcopy(spec)) == spec
    manifest = copy.deepcopy(VALID_MANIFEST)
    manifest["spec"]["template"]["spec"] = spec
    assert ModelRollout.model_validate(manifest).spec.template is not None


@pytest.mark.parametrize(("spec", "named"), REFUSED)
def test_what_a_replicaset_refuses_is_refused_naming_the_field(
    spec: dict[str, Any], named: str
) -> None:
    manifest = copy.deepcopy(VALID_MANIFEST)
    manifest["spec"]["template"]["spec"] = spec
    with pytest.raises(ValidationError) as caught:
        ModelRollout.model_validate(manifest)
    assert named in str(caught.value)
