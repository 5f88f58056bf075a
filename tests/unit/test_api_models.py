"""The pydantic models mirror the CRD: the same manifests are valid and invalid for both."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from weightship.api.models import ModelRollout, WeightCache
from weightship.api.status import ControlRequest, ModelRolloutStatus
from weightship_testing.samples import INVALID_MANIFESTS, VALID_MANIFEST

REPO = Path(__file__).resolve().parents[2]


def test_valid_manifest_parses_with_defaults() -> None:
    rollout = ModelRollout.model_validate(VALID_MANIFEST)
    spec = rollout.spec
    # Removed (refused at admission, ignored when stored): cachePath is install-time
    # agent.cacheDir, tolerations the agent DaemonSet's, the chunk size the manifest's.
    assert spec.prefetch.cache_path is None
    assert spec.prefetch.tolerations is None
    assert spec.prefetch.chunk_size_bytes is None
    assert spec.prefetch.peer_to_peer is True
    assert spec.seeding.backend == "auto"
    assert spec.seeding.timeout_seconds == 300
    assert spec.validation.endpoint.path == "/v1/completions"
    assert spec.validation.golden_prompts[0].max_tokens == 4
    metric = spec.strategy.canary.analysis.metrics[0]  # type: ignore[union-attr]
    assert (metric.no_data_policy, metric.consecutive_error_limit) == ("Inconclusive", 4)
    assert spec.strategy.canary.progress_deadline_seconds == 600
    assert spec.strategy.canary.abort_scale_down_delay_seconds == 30
    assert spec.notifications is not None and spec.notifications.slack is not None
    assert spec.notifications.slack.webhook_secret_ref.key == "url"
    assert spec.notifications.slack.events == ["Promoted", "RolledBack", "Failed"]
    assert rollout.status == ModelRolloutStatus()


def test_round_trip_keeps_camel_case_and_drops_unset() -> None:
    rollout = ModelRollout.model_validate(VALID_MANIFEST)
    body = rollout.to_k8s()
    assert body["spec"]["model"]["source"]["credentialsSecretRef"] == {"name": "s3-credentials"}
    assert "manifestDigest" not in body["spec"]["model"]
    assert ModelRollout.model_validate(body) == rollout


@pytest.mark.parametrize(
    ("description", "manifest", "expected"),
    INVALID_MANIFESTS,
    ids=[case[0] for case in INVALID_MANIFESTS],
)
def test_invalid_manifests_are_rejected(
    description: str, manifest: dict[str, Any], expected: str
) -> None:
    with pytest.raises(ValidationError) as caught:
        ModelRollout.model_validate(manifest)
    # pydantic names the field by its location; CEL mirrors name it in the message
    text = str(caught.value)
    field = expected.split(" ")[0].removeprefix("spec.").split("[")[0].split(".")[-1]
    assert field in text or expected in text, text


def test_invalid_manifests_cover_enough_cases() -> None:
    assert len(INVALID_MANIFESTS) >= 10
    assert len({description for description, _, _ in INVALID_MANIFESTS}) == len(INVALID_MANIFESTS)


def test_each_invalid_manifest_changes_one_thing() -> None:
    for description, manifest, _ in INVALID_MANIFESTS:
        assert manifest != VALID_MANIFEST, description
        assert manifest["metadata"] == VALID_MANIFEST["metadata"], description


def test_workload_ref_instead_of_template() -> None:
    manifest = copy.deepcopy(VALID_MANIFEST)
    del manifest["spec"]["template"]
    manifest["spec"]["workloadRef"] = {"name": "llm"}
    rollout = ModelRollout.model_validate(manifest)
    assert rollout.spec.workload_ref is not None
    assert rollout.spec.workload_ref.kind == "Deployment"


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("validation", "goldenPrompts", 0, "expect"), {"regex": "("}),
        (("strategy", "canary", "analysis", "metrics", 0, "query"), "x{a='{{ nope }}'}"),
        (("strategy", "canary", "analysis", "metrics", 0, "min"), 1.0),
    ],
)
def test_pydantic_only_checks(path: tuple[Any, ...], value: Any) -> None:
    """Checks CEL cannot express (regex syntax, query variables) or min <= max."""
    manifest = copy.deepcopy(VALID_MANIFEST)
    node: Any = manifest["spec"]
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(ValidationError):
        ModelRollout.model_validate(manifest)


@pytest.mark.parametrize("limit", ["100Mi", "1.5G", 1048576, "500k"])
def test_bandwidth_limit_accepts_quantities(limit: Any) -> None:
    manifest = copy.deepcopy(VALID_MANIFEST)
    manifest["spec"]["prefetch"]["bandwidthLimit"] = limit
    assert ModelRollout.model_validate(manifest).spec.prefetch.bandwidth_limit == limit


@pytest.mark.parametrize("bound", [0, 1, 250, "0%", "1%", "25%", "100%"])
def test_in_place_max_unavailable_takes_a_count_or_a_percent(bound: Any) -> None:
    manifest = copy.deepcopy(VALID_MANIFEST)
    manifest["spec"]["strategy"]["canary"]["inPlace"] = {"maxUnavailable": bound}
    assert (
        ModelRollout.model_validate(manifest).spec.strategy.canary.in_place.max_unavailable == bound
    )
    # A Deployment's default.
    assert (
        ModelRollout.model_validate(VALID_MANIFEST).spec.strategy.canary.in_place.max_unavailable
        == "25%"
    )


def test_control_request_is_pending_until_acknowledged() -> None:
    request = ControlRequest(requested_at="2026-01-01T00:00:00Z")
    assert request.pending
    request.acknowledged = request.requested_at
    assert not request.pending
    newer = request.model_copy(update={"requested_at": "2026-01-01T00:01:00Z"})
    assert newer.pending


def test_example_manifest_is_valid() -> None:
    example = yaml.safe_load((REPO / "examples" / "rollout-basic.yaml").read_text())
    rollout = ModelRollout.model_validate(example)
    assert rollout.spec.model.source.uri.startswith("s3://")


def test_weight_cache_parses() -> None:
    cache = WeightCache.model_validate(
        {
            "metadata": {"name": "gpu-node-1"},
            "spec": {"nodeName": "gpu-node-1"},
            "status": {
                "freeBytes": 10,
                "manifests": [{"digest": "sha256:" + "a" * 64, "state": "Staged"}],
            },
        }
    )
    assert cache.status.manifests[0].state == "Staged"
    with pytest.raises(ValidationError):
        WeightCache.model_validate(
            {"spec": {"nodeName": "n"}, "status": {"manifests": [{"digest": "x", "state": "Ok"}]}}
        )
