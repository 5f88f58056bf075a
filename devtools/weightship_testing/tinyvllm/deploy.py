"""Real vLLM as a ModelRollout runs it (e2e tests, the demo): the pod template of
`vllm serve $(WEIGHTSHIP_MODEL_DIR) --load-format weightship` on the vllm-openai image,
and the golden prompts that go with tinyvllm. Plain dicts, no I/O."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from weightship_testing.tinyvllm.build import CHAT_ANSWER, CHAT_QUESTION

IMAGE = "vllm/vllm-openai:v0.32.0"
PORT = 8000
SERVED_MODEL = "tiny"
CHAT_PATH = "/v1/chat/completions"
GOLDEN_PROMPT = "capital-of-france"
# What a small CPU replica needs: float32 (no bf16 kernels here), short contexts, a 1 GiB
# KV cache, no CUDA-graph capture, no OpenMP thread pinning (pods share the cores).
SERVE_FLAGS = [
    "--dtype",
    "float32",
    "--max-model-len",
    "256",
    "--max-num-seqs",
    "4",
    "--enforce-eager",
]
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
# In-place weight swaps (POST /weightship/v1/swap): vLLM's weight-transfer engine
# `weightship`, which the plugin registers.
IN_PLACE_FLAGS = ["--weight-transfer-config", '{"backend": "weightship"}']


def pod_template(
    app: str,
    *,
    node_selector: Mapping[str, str],
    load_format: str = "weightship",
    env: Mapping[str, str] | None = None,
    in_place: bool = False,
) -> dict[str, Any]:
    """vLLM pods serving the rollout's model from the node cache. ``load_format`` is
    "weightship" (the plugin: verified load, /weightship/v1/loaded, seeding) or vLLM's own
    "safetensors" (a plain vLLM: verified as checksumMode staged). ``in_place`` adds the
    weight-transfer engine that in-place swaps need (the plugin's load format too)."""
    if in_place and load_format != "weightship":
        raise ValueError("in-place swaps need --load-format weightship")
    return {
        "metadata": {"labels": {"app": app}},
        "spec": {
            "nodeSelector": dict(node_selector),
            "terminationGracePeriodSeconds": 5,
            "containers": [
                {
                    "name": "vllm",
                    "image": IMAGE,
                    "args": [
                        "$(WEIGHTSHIP_MODEL_DIR)",
                        "--load-format",
                        load_format,
                        "--served-model-name",
                        SERVED_MODEL,
                        "--port",
                        str(PORT),
                        *SERVE_FLAGS,
                        *(IN_PLACE_FLAGS if in_place else []),
                    ],
                    "env": [
                        # Both of the plugin's entry points (endpoint plugins load only
                        # when named here).
                        {"name": "VLLM_PLUGINS", "value": "weightship"},
                        {"name": "HOME", "value": "/tmp"},
                        *({"name": k, "value": v} for k, v in {**CPU_ENV, **(env or {})}.items()),
                    ],
                    "ports": [{"name": "http", "containerPort": PORT}],
                    "readinessProbe": {
                        "httpGet": {"path": "/health", "port": "http"},
                        "periodSeconds": 2,
                    },
                    # A refused load exits vLLM; its reason reaches the operator this way.
                    "terminationMessagePolicy": "FallbackToLogsOnError",
                    "volumeMounts": [{"name": "scratch", "mountPath": "/tmp"}],
                }
            ],
            "volumes": [{"name": "scratch", "emptyDir": {}}],
        },
    }


def chat_request(max_tokens: int) -> dict[str, Any]:
    """The body of a greedy chat request to the served model (client load)."""
    return {
        "model": SERVED_MODEL,
        "messages": [{"role": "user", "content": CHAT_QUESTION}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }


def golden_prompts(answer: str = CHAT_ANSWER["good"]) -> list[dict[str, Any]]:
    return [
        {
            "name": GOLDEN_PROMPT,
            "messages": [{"role": "user", "content": CHAT_QUESTION}],
            "maxTokens": 8,
            "stop": ["\n"],
            "expect": {"equals": answer},
        }
    ]


def validation(mode: str = "auto", timeout_seconds: int = 30) -> dict[str, Any]:
    """spec.validation: the weights checked (``mode``) and the golden prompt answered
    through vLLM's chat API before a pod gets traffic."""
    return {
        "checksumMode": mode,
        "goldenPrompts": golden_prompts(),
        "endpoint": {"port": PORT, "path": CHAT_PATH, "model": SERVED_MODEL},
        "timeoutSeconds": timeout_seconds,
    }
