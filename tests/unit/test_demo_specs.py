"""The demo's rollouts are valid ModelRollouts, and its vLLM act's is set up for in-place
updates (the demo itself runs on the local cluster: `make demo`)."""

from __future__ import annotations

from weightship.api.spec import ModelRolloutSpec
from weightship_dev import demo
from weightship_testing.tinyvllm import deploy

ENDPOINT = "http://127.0.0.1:7070"


def test_the_demo_rollouts_are_admitted_by_the_model() -> None:
    ModelRolloutSpec.model_validate(demo.rollout_spec("s3://demo-models/llm/v1/", "v1", ENDPOINT))
    spec = ModelRolloutSpec.model_validate(
        demo.vllm_rollout_spec("s3://demo-models/llm-vllm/v1/", ENDPOINT)
    )
    assert spec.strategy.canary.update_policy == "InPlaceIfPossible"


def test_the_vllm_pods_can_swap_in_place() -> None:
    spec = demo.vllm_rollout_spec("s3://demo-models/llm-vllm/v1/", ENDPOINT)
    (container,) = spec["template"]["spec"]["containers"]
    args = container["args"]
    assert args[args.index("--load-format") + 1] == "weightship"
    assert args[-2:] == deploy.IN_PLACE_FLAGS
    assert spec["replicas"] == 1 and spec["strategy"]["canary"]["steps"] == [{"setWeight": 100}]
