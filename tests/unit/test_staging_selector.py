"""Which nodes stage a rollout's weights: the operator resolves the selector (spec, else
the pod template's, a workloadRef Deployment's included), counts those nodes and publishes
the selector in status.prefetchNodeSelector; the agents follow what it published."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from weightship.agent.desired import staging_selector, wanted
from weightship.api.models import ModelRollout
from weightship.core.decide import decide
from weightship.core.targets import prefetch_node_selector
from weightship_testing.core import DIGEST_A, T0, observe, staged
from weightship_testing.samples import VALID_MANIFEST

GPU = {"nvidia.com/gpu.present": "true"}
POOL = {"pool": "a100"}


def spec_with(prefetch_selector: dict[str, str], template_selector: Any) -> ModelRollout:
    manifest = copy.deepcopy(VALID_MANIFEST)
    manifest["spec"]["prefetch"]["nodeSelector"] = prefetch_selector
    pod_spec = manifest["spec"]["template"]["spec"]
    pod_spec.pop("nodeSelector", None)
    if template_selector is not None:
        pod_spec["nodeSelector"] = template_selector
    return ModelRollout.model_validate(manifest)


@pytest.mark.parametrize(
    ("prefetch_selector", "template_selector", "expected"),
    [
        (GPU, POOL, GPU),  # the spec's own wins
        ({}, POOL, POOL),  # else the pods' nodes
        ({}, None, {}),  # else every node
        ({}, {}, {}),
        ({}, {"a": "1", "b": 2, "c": None}, {"a": "1"}),  # non-strings dropped (wider)
        ({}, "not a map", {}),
    ],
    ids=["prefetch", "template", "neither", "empty template", "odd values", "malformed"],
)
def test_the_selector_is_the_prefetchs_else_the_pod_templates(
    prefetch_selector: dict[str, str], template_selector: Any, expected: dict[str, str]
) -> None:
    rollout = spec_with(prefetch_selector, template_selector)
    template = rollout.spec.template.to_k8s() if rollout.spec.template else None
    assert prefetch_node_selector(rollout.spec, template) == expected


def test_a_huge_template_selector_is_cut_to_64_labels() -> None:
    labels = {f"k{i:03}": "v" for i in range(100)}
    rollout = spec_with({}, labels)
    assert prefetch_node_selector(rollout.spec, {"spec": {"nodeSelector": labels}}) == {
        f"k{i:03}": "v" for i in range(64)
    }


def test_a_workload_refs_deployment_template_is_used() -> None:
    manifest = copy.deepcopy(VALID_MANIFEST)
    template = manifest["spec"].pop("template")
    template["spec"]["nodeSelector"] = POOL
    manifest["spec"]["workloadRef"] = {"name": "llm"}
    manifest["spec"]["prefetch"]["nodeSelector"] = {}
    rollout = ModelRollout.model_validate(manifest)
    decision = decide(rollout, observe(prefetch=staged(DIGEST_A), workload_template=template), T0)
    assert decision.status.prefetch_node_selector == POOL
    # Without the Deployment (not found), nothing is published: the spec is invalid.
    invalid = decide(rollout, observe(prefetch=staged(DIGEST_A)), T0)
    assert invalid.status.prefetch_node_selector is None


@pytest.mark.parametrize(
    ("template_selector", "published"),
    [(POOL, POOL), (None, None)],
    ids=["template selector published", "every node: nothing published"],
)
def test_decide_publishes_the_resolved_selector(
    template_selector: Any, published: dict[str, str] | None
) -> None:
    rollout = spec_with({}, template_selector)
    decision = decide(rollout, observe(prefetch=staged(DIGEST_A)), T0)
    assert decision.status.prefetch_node_selector == published
    assert decision.status_patch(rollout.status).get("prefetchNodeSelector") == published


# --- the agents follow the operator ------------------------------------------------------


def rollout_body(
    prefetch_selector: dict[str, str] | None, published: dict[str, str] | None
) -> dict[str, Any]:
    status: dict[str, Any] = {"canaryRevision": {"manifestDigest": DIGEST_A}}
    if published is not None:
        status["prefetchNodeSelector"] = published
    prefetch = {} if prefetch_selector is None else {"nodeSelector": prefetch_selector}
    return {
        "metadata": {"namespace": "serving", "name": "llm"},
        "spec": {"prefetch": prefetch, "model": {"source": {"uri": "s3://models/x/"}}},
        "status": status,
    }


@pytest.mark.parametrize(
    ("prefetch_selector", "published", "expected"),
    [
        ({}, POOL, POOL),  # the operator resolved a template's (or a Deployment's) selector
        (GPU, GPU, GPU),
        (GPU, None, GPU),  # an operator from before publishes nothing: the spec's, as it counts
        (None, None, {}),  # every node
        ({}, {}, {}),
    ],
)
def test_agents_stage_where_the_operator_counts(
    prefetch_selector: dict[str, str] | None,
    published: dict[str, str] | None,
    expected: dict[str, str],
) -> None:
    body = rollout_body(prefetch_selector, published)
    assert dict(staging_selector(body)) == expected


def test_a_node_outside_the_published_selector_wants_nothing() -> None:
    body = rollout_body({}, POOL)
    assert [w.digest for w in wanted([body], {**POOL, "other": "x"})] == [DIGEST_A]
    assert wanted([body], {"pool": "h100"}) == []
    assert wanted([body], {}) == []
