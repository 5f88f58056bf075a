"""validation.checksumMode (loaded, staged, auto, none), chat golden prompts and failed
loads told by a termination message: the verifier against real local HTTP servers."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import REGISTRY
from pydantic import ValidationError

from weightship.api.inference import LoadReport, termination_message
from weightship.api.models import ModelRollout
from weightship.api.names import (
    DIGEST_ANNOTATION,
    LOADED_ANNOTATION,
    SWAP_ANNOTATION,
    VERIFIED_GATE,
    staged_node_label,
)
from weightship.api.spec import GoldenPrompt, ValidationSpec
from weightship.controller.builders import CACHE_VOLUME, gate_condition, staged_model_dir
from weightship.controller.seedkey import KEY_FIELD, seed_key_secret_name
from weightship.controller.snapshot import observed_pods
from weightship.controller.verifier import (
    VERIFIED_PATH,
    Verifier,
    completion_request,
    staged_evidence,
    termination_messages,
)
from weightship.core.pod_gates import pod_gates
from weightship.core.seedtoken import check_token
from weightship.core.verification import StagedEvidence
from weightship.httpserver import QuietHandler, Server
from weightship_testing.samples import VALID_MANIFEST

DIGEST = "sha256:" + "cd" * 32
SEED_KEY = bytes(range(32))
CACHE = "/var/cache/weightship"


def test_checksum_modes_and_the_older_boolean() -> None:
    assert ValidationSpec.model_validate({}).mode == "auto"
    assert ValidationSpec.model_validate({"checksum": True}).mode == "loaded"
    assert ValidationSpec.model_validate({"checksum": False}).mode == "none"
    both = {"checksum": True, "checksumMode": "staged"}
    assert ValidationSpec.model_validate(both).mode == "staged"
    with pytest.raises(ValidationError, match="checksumMode"):
        ValidationSpec.model_validate({"checksumMode": "sometimes"})


def test_a_golden_prompt_is_a_prompt_or_messages() -> None:
    expect = {"equals": "Paris."}
    with pytest.raises(ValidationError, match="exactly one of prompt or messages"):
        GoldenPrompt.model_validate({"name": "x", "expect": expect})
    with pytest.raises(ValidationError, match="exactly one of prompt or messages"):
        GoldenPrompt.model_validate(
            {
                "name": "x",
                "prompt": "p",
                "messages": [{"role": "user", "content": "q"}],
                "expect": expect,
            }
        )
    with pytest.raises(ValidationError, match="stop"):
        GoldenPrompt.model_validate(
            {"name": "x", "prompt": "p", "stop": ["a", "b", "c", "d", "e"], "expect": expect}
        )


def test_completion_and_chat_requests() -> None:
    plain = GoldenPrompt.model_validate(
        {"name": "c", "prompt": "The capital is", "maxTokens": 4, "expect": {"prefix": " P"}}
    )
    assert completion_request(plain, chat=False, model=None) == {
        "prompt": "The capital is",
        "max_tokens": 4,
        "temperature": 0,
    }
    assert completion_request(plain, chat=True, model="tiny") == {
        "messages": [{"role": "user", "content": "The capital is"}],
        "max_tokens": 4,
        "temperature": 0,
        "model": "tiny",
    }
    chat = GoldenPrompt.model_validate(
        {
            "name": "c",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Q"},
            ],
            "stop": ["\n"],
            "expect": {"equals": "A"},
        }
    )
    body = completion_request(chat, chat=True, model=None)
    assert body["messages"][0] == {"role": "system", "content": "Be brief."}
    assert body["stop"] == ["\n"] and "model" not in body


def vllm_pod(*, read_only: bool = True, args: list[str] | None = None) -> dict[str, Any]:
    return {
        "metadata": {
            "name": "p1",
            "namespace": "ns",
            "uid": "uid-p1",
            "annotations": {DIGEST_ANNOTATION: DIGEST},
        },
        "spec": {
            "nodeName": "gpu-1",
            "containers": [
                {
                    "name": "vllm",
                    "args": args
                    if args is not None
                    else ["$(WEIGHTSHIP_MODEL_DIR)", "--port", "8000"],
                    "volumeMounts": [
                        {"name": CACHE_VOLUME, "mountPath": CACHE, "readOnly": read_only}
                    ],
                }
            ],
        },
        "status": {"phase": "Running", "podIP": "127.0.0.1"},
    }


def test_staged_evidence_from_the_pod_object() -> None:
    model_dir = staged_model_dir(CACHE, DIGEST)
    assert model_dir == f"{CACHE}/models/{'cd' * 32}/files"
    good = staged_evidence(vllm_pod(), model_dir)
    assert good == StagedEvidence("gpu-1", True, False, True)
    assert staged_evidence(vllm_pod(args=[str(model_dir)]), model_dir).serves_model_dir
    assert not staged_evidence(vllm_pod(args=["/models/elsewhere"]), model_dir).serves_model_dir
    assert not staged_evidence(vllm_pod(read_only=False), model_dir).cache_read_only


def test_termination_messages_of_this_run_and_the_last() -> None:
    pod = vllm_pod()
    pod["status"]["containerStatuses"] = [
        {"state": {"running": {}}, "lastState": {"terminated": {"message": "last"}}},
        {"state": {"terminated": {"message": "now"}}, "lastState": {}},
    ]
    assert termination_messages(pod) == ("last", "now")


class ServerState:
    def __init__(self) -> None:
        self.loaded: dict[str, Any] | None = None  # None: no /weightship/v1/loaded (404)
        self.answer = "Paris."
        self.requests: list[dict[str, Any]] = []
        self.headers: list[tuple[str, dict[str, str]]] = []  # (path, headers) of each POST
        self.verified_status = 200  # the answer to POST /weightship/v1/swap/verified
        self.held_seconds: float | None = None  # what that answer says the server held


@pytest.fixture
def server() -> Iterator[tuple[int, ServerState]]:
    state = ServerState()

    class Handler(QuietHandler):
        def do_GET(self) -> None:
            if state.loaded is None:
                self.send_json(404, {"detail": "Not Found"})  # what vLLM without the plugin says
            else:
                self.send_json(200, state.loaded)

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            state.headers.append((self.path, dict(self.headers.items())))
            if self.path == VERIFIED_PATH:
                answer: dict[str, Any] = {"accepted": state.verified_status == 200}
                if state.held_seconds is not None:
                    answer["heldSeconds"] = state.held_seconds
                self.send_json(state.verified_status, answer)
                return
            state.requests.append(body)
            if self.path != "/v1/chat/completions":
                self.send_json(404, {"detail": "Not Found"})
                return
            message = {"role": "assistant", "content": state.answer}
            self.send_json(200, {"choices": [{"message": message}]})

    with Server(("127.0.0.1", 0), Handler).start("inference") as httpd:
        yield httpd.server_port, state


class NodeKube:
    """The verifier's kube: nodes to read (labels); verdicts reported, as observations."""

    def __init__(self, labels: dict[str, str]) -> None:
        self.labels = labels
        self.secrets = {("ns", seed_key_secret_name("llm")): {KEY_FIELD: SEED_KEY.hex()}}
        self.done = threading.Event()
        self.core = SimpleNamespace(
            read_node=lambda name: SimpleNamespace(metadata=SimpleNamespace(labels=self.labels))
        )

    def on_verdict(self, namespace: str, name: str) -> None:
        self.done.set()

    def secret_data(self, namespace: str, name: str) -> dict[str, str]:
        return self.secrets[(namespace, name)]


def verify(
    port: int, mode: str, pod: dict[str, Any], labels: dict[str, str] | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    body = json.loads(json.dumps(VALID_MANIFEST))
    body["spec"]["validation"] = {
        "checksumMode": mode,
        "goldenPrompts": [
            {
                "name": "capital",
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "expect": {"equals": "Paris."},
            }
        ],
        "endpoint": {"port": port, "path": "/v1/chat/completions", "model": "tiny"},
        "timeoutSeconds": 5,
    }
    kube = NodeKube(labels if labels is not None else {staged_node_label(DIGEST): "true"})
    verifier = Verifier(kube, workers=1, cache_dir=CACHE, on_verdict=kube.on_verdict)  # type: ignore[arg-type]
    rollout = ModelRollout.model_validate(body)
    assert verifier.submit(rollout, [pod]) is True
    assert kube.done.wait(30)
    verifier.pool.shutdown(wait=True)
    # The verdict reaches the gate as the controller carries it: core.pod_gates, apply.
    observed = observed_pods([pod], verifier.pending([pod]))
    (gate,) = pod_gates(rollout.spec, observed, datetime.now(UTC))
    condition, annotations = gate_condition(gate), dict(gate.annotations)
    return condition, json.loads(annotations.get(LOADED_ANNOTATION) or "{}")


def test_auto_on_plain_vllm_verifies_the_staged_cache(server: tuple[int, ServerState]) -> None:
    port, state = server
    condition, loaded = verify(port, "auto", vllm_pod())
    assert (condition["status"], condition["reason"]) == ("True", "Verified"), condition
    assert condition["message"].startswith("checksum staged")
    assert "on node gpu-1, mounted read-only" in condition["message"]
    assert loaded["mode"] == "staged"
    assert state.requests[0]["model"] == "tiny" and state.requests[0]["temperature"] == 0


def test_staged_needs_the_node_to_have_verified_the_model(server: tuple[int, ServerState]) -> None:
    port, _ = server
    condition, loaded = verify(port, "staged", vllm_pod(), labels={})
    assert (condition["status"], condition["reason"]) == ("False", "NotStaged"), condition
    assert loaded["mode"] == "staged"
    condition, _ = verify(port, "staged", vllm_pod(read_only=False))
    assert condition["reason"] == "CacheNotReadOnly"
    condition, _ = verify(port, "staged", vllm_pod(args=["/models/other"]))
    assert condition["reason"] == "ModelDirNotUsed"


def test_loaded_on_a_server_without_the_plugin_is_a_clear_failure(
    server: tuple[int, ServerState],
) -> None:
    port, _ = server
    condition, _ = verify(port, "loaded", vllm_pod())
    assert (condition["status"], condition["reason"]) == ("False", "NoLoadReport")
    assert "checksumMode" in condition["message"] or "staged" in condition["message"]


def test_auto_with_the_plugin_reads_the_load_report(server: tuple[int, ServerState]) -> None:
    port, state = server
    state.loaded = {
        "state": "Loaded",
        "manifestDigest": DIGEST,
        "verified": True,
        "source": "broadcast",
        "seededFrom": "p0",
        "loadSeconds": 0.2,
    }
    condition, loaded = verify(port, "auto", vllm_pod())
    assert condition["status"] == "True", condition
    assert condition["message"].startswith(f"checksum loaded; digest {DIGEST} verified")
    assert "seeded by p0" in condition["message"]
    assert loaded == {"mode": "loaded", "seededFrom": "p0", "seconds": 0.2, "source": "broadcast"}


def test_a_wrong_chat_answer_fails_with_the_diff(server: tuple[int, ServerState]) -> None:
    port, state = server
    state.answer = "Lyon."
    condition, _ = verify(port, "none", vllm_pod())
    assert (condition["status"], condition["reason"]) == ("False", "GoldenPromptFailed")
    assert 'expected equals "Paris.", got "Lyon."' in condition["message"]


def swapped_pod() -> dict[str, Any]:
    pod = vllm_pod()
    record = {"state": "Swapped", "manifestDigest": DIGEST, "revision": "v2"}
    pod["metadata"]["annotations"][SWAP_ANNOTATION] = json.dumps(record)
    return pod


def test_a_pod_swapped_in_traffic_gets_how_long_its_server_held_requests(
    server: tuple[int, ServerState],
) -> None:
    """Swapped in traffic (its gate kept open): the server's answer to the verifier's word
    says how long it held requests; the verdict notes it (status.inPlace, the SwapHeld
    Event) and the held-seconds histogram counts it."""
    port, state = server
    state.held_seconds = 3.25
    pod = swapped_pod()
    record = json.loads(pod["metadata"]["annotations"][SWAP_ANNOTATION])
    pod["metadata"]["annotations"][SWAP_ANNOTATION] = json.dumps(record | {"inTraffic": True})
    pod["status"]["conditions"] = [
        {"type": VERIFIED_GATE, "status": "True", "reason": "Pending", "message": "verifying"}
    ]
    before = REGISTRY.get_sample_value("weightship_pod_swap_held_seconds_count") or 0.0
    condition, loaded = verify(port, "none", pod)
    assert (condition["status"], condition["reason"]) == ("True", "Verified"), condition
    assert loaded["heldSeconds"] == 3.25, loaded
    assert REGISTRY.get_sample_value("weightship_pod_swap_held_seconds_count") == before + 1
    # Swapped out of traffic: nothing held for clients, nothing noted.
    state.headers.clear()
    _condition, loaded = verify(port, "none", swapped_pod())
    assert "heldSeconds" not in loaded, loaded


def test_weights_swapped_in_place_are_reached_with_the_swap_token_then_opened_to_traffic(
    server: tuple[int, ServerState],
) -> None:
    """A pod swapped in place holds the new weights from traffic until they pass: the
    golden prompt carries the pod's swap token (X-Weightship-Verify), and once it passes
    the verifier tells the server (POST /weightship/v1/swap/verified) before the gate
    opens. A pod started with its weights is told nothing."""
    port, state = server
    condition, _ = verify(port, "none", swapped_pod())
    assert condition["status"] == "True", condition
    (prompt_path, prompt), (told_path, told) = state.headers
    assert (prompt_path, told_path) == ("/v1/chat/completions", VERIFIED_PATH)
    uid = ModelRollout.model_validate(VALID_MANIFEST).metadata.uid or ""
    for value in (prompt["X-Weightship-Verify"], told["Authorization"]):
        token = value.removeprefix("Bearer ")
        assert check_token(SEED_KEY, uid, DIGEST, "swap/p1", token, time.time()) is None
    state.headers.clear()
    verify(port, "none", vllm_pod())
    assert [path for path, _ in state.headers] == ["/v1/chat/completions"]
    assert "X-Weightship-Verify" not in state.headers[0][1]


def test_swapped_weights_the_server_was_not_told_of_keep_the_gate_pending(
    server: tuple[int, ServerState],
) -> None:
    port, state = server
    state.verified_status = 409
    condition, _ = verify(port, "none", swapped_pod())
    assert (condition["status"], condition["reason"]) == ("False", "Pending"), condition
    assert "the server was not told" in condition["message"]


def test_a_server_that_exited_refusing_its_weights_fails_the_gate() -> None:
    pod = vllm_pod()
    refused = LoadReport(
        state="Failed", reason="ChecksumMismatch", message="model.safetensors chunk 0"
    )
    pod["status"]["containerStatuses"] = [
        {
            "state": {"waiting": {"reason": "CrashLoopBackOff"}},
            "lastState": {"terminated": {"exitCode": 1, "message": termination_message(refused)}},
        }
    ]
    condition, loaded = verify(9, "auto", pod)  # nothing listens on port 9
    assert (condition["status"], condition["reason"]) == ("False", "ChecksumMismatch"), condition
    assert "model.safetensors" in condition["message"] and loaded["mode"] == "loaded"


def release(port: int, verifier: Verifier, pod: dict[str, Any]) -> bool:
    """Submit ``pod`` of a rollout that verifies nothing; wait for what that started."""
    body = json.loads(json.dumps(VALID_MANIFEST))
    body["spec"]["validation"] = {"checksumMode": "none", "endpoint": {"port": port}}
    rollout = ModelRollout.model_validate(body)
    waiting = verifier.submit(rollout, [pod])
    deadline = time.monotonic() + 30
    while verifier.in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not verifier.in_flight
    return waiting


@pytest.mark.parametrize("answer", [200, 409])
def test_validation_switched_off_tells_a_swapped_server_to_serve_its_new_weights(
    server: tuple[int, ServerState], answer: int
) -> None:
    """A pod swapped in place while the rollout verified holds its new weights from
    traffic until the verifier says they passed; with validation switched off since,
    nobody would: the verifier tells the server (signed with the pod's swap token) once,
    and again at the next reconcile only if the server did not hear it."""
    port, state = server
    state.verified_status = answer
    kube = NodeKube({})
    verifier = Verifier(kube, workers=1, cache_dir=CACHE)  # type: ignore[arg-type]
    assert release(port, verifier, swapped_pod()) is False  # nothing waits for a verdict
    assert release(port, verifier, swapped_pod()) is False
    assert release(port, verifier, vllm_pod()) is False  # started with its weights: nothing
    verifier.pool.shutdown(wait=True)
    told = [headers for path, headers in state.headers if path == VERIFIED_PATH]
    assert len(told) == (1 if answer == 200 else 2)
    assert [path for path, _ in state.headers] == [VERIFIED_PATH] * len(told)  # no prompt
    uid = ModelRollout.model_validate(VALID_MANIFEST).metadata.uid or ""
    token = told[0]["Authorization"].removeprefix("Bearer ")
    assert check_token(SEED_KEY, uid, DIGEST, "swap/p1", token, time.time()) is None
