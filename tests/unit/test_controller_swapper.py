"""The swapper against a real HTTP server on loopback speaking the plugin's swap protocol
(POST/GET /weightship/v1/swap), with the Kubernetes writes recorded: what it writes to the
pod before, after a success and after a failure, and the token it sends."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from typing import Any, ClassVar

import pytest

from weightship.api.names import DIGEST_ANNOTATION, REVISION_LABEL, SWAP_ANNOTATION, VERIFIED_GATE
from weightship.controller.seedkey import swap_group
from weightship.controller.snapshot import pod_swap
from weightship.controller.swapper import Swapper
from weightship.core.decision import SwapPod
from weightship.core.seedtoken import check_token
from weightship.httpserver import Server
from weightship_testing.core import make_rollout

KEY = bytes(range(32))
DIGEST = "sha256:" + "b" * 64


class Plugin(BaseHTTPRequestHandler):
    """The plugin's side: accepts a swap, then answers GET with ``outcome`` for its digest."""

    outcome: ClassVar[dict[str, Any]] = {}
    posted: ClassVar[list[tuple[dict[str, Any], str]]] = []
    post_status: ClassVar[int] = 202

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Plugin.posted.append((body, self.headers.get("Authorization", "")))
        doc = {"state": "Draining", "manifestDigest": body["manifestDigest"]}
        self._answer(Plugin.post_status, {"accepted": True, "swap": doc})

    def do_GET(self) -> None:
        self._answer(200, {"manifestDigest": DIGEST, **Plugin.outcome})

    def _answer(self, status: int, doc: dict[str, Any]) -> None:
        data = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def plugin() -> Iterator[int]:
    Plugin.posted = []
    Plugin.post_status = 202
    with Server(("127.0.0.1", 0), Plugin).start("plugin") as server:
        yield server.server_port


class Writes:
    """The Kube calls the swapper makes, recorded (the pod is unready once its gate is)."""

    def __init__(self) -> None:
        self.patches: list[tuple[dict[str, Any], dict[str, Any], dict[str, Any]]] = []

    def patch_pod_condition(
        self,
        namespace: str,
        name: str,
        condition: dict[str, Any],
        annotations: dict[str, Any] | None = None,
        labels: dict[str, str] | None = None,
    ) -> None:
        self.patches.append((condition, annotations or {}, labels or {}))

    def pod(self, namespace: str, name: str) -> dict[str, Any]:
        return {"status": {"conditions": [{"type": "Ready", "status": "False"}]}}

    def secret_data(self, namespace: str, name: str) -> dict[str, str]:
        return {"key": KEY.hex()}


def swap(port: int, writes: Writes) -> None:
    rollout = make_rollout()
    rollout.spec.validation.endpoint.port = port
    pod = {
        "metadata": {
            "name": "llm-t-1",
            "namespace": "serving",
            "uid": "u1",
            "labels": {REVISION_LABEL: "h1"},
        },
        "status": {"podIP": "127.0.0.1"},
    }
    swapper = Swapper(writes)  # type: ignore[arg-type]
    job = swapper._job(
        rollout, pod, SwapPod("llm-t-1", "h2", DIGEST, "v2", "canary"), "t0", resume=False
    )
    swapper._run(job)
    swapper.close()


def test_a_swap_takes_the_pod_out_then_moves_it_to_the_new_revision_unverified(plugin: int) -> None:
    Plugin.outcome = {"state": "Swapped", "seconds": 1.25, "pausedSeconds": 0.5}
    writes = Writes()
    swap(plugin, writes)
    ((body, authorization),) = Plugin.posted
    assert body["manifestDigest"] == DIGEST and body["revision"] == "v2"
    # The rollout verifies pods: the server holds the new weights for the verifier.
    assert body["holdUntilVerified"] is True
    token = authorization.removeprefix("Bearer ")
    rollout = make_rollout()
    assert (
        check_token(
            KEY, rollout.metadata.uid or "", DIGEST, swap_group("llm-t-1"), token, time.time()
        )
        is None
    )
    (out, out_notes, out_labels), (done, done_notes, done_labels) = writes.patches
    assert out["type"] == VERIFIED_GATE and out["status"] == "False" and out["reason"] == "Swapping"
    assert json.loads(out_notes[SWAP_ANNOTATION])["state"] == "Swapping" and not out_labels
    # Swapped: the new revision's label and digest, the gate left to the verifier.
    assert done["status"] == "False" and done["reason"] == "Pending"
    assert done_labels == {REVISION_LABEL: "h2"} and done_notes[DIGEST_ANNOTATION] == DIGEST
    record = pod_swap(done_notes)
    assert record is not None and record.state == "Swapped" and record.to_revision_hash == "h2"
    assert (
        record.seconds == 1.25
        and record.paused_seconds == 0.5
        and record.from_revision_hash == "h1"
    )


def test_a_failed_swap_keeps_the_pod_on_its_revision_with_the_reason(plugin: int) -> None:
    Plugin.outcome = {"state": "Failed", "reason": "ChecksumMismatch", "message": "chunk 3"}
    writes = Writes()
    swap(plugin, writes)
    _out, (failed, notes, labels) = writes.patches
    assert failed["reason"] == "SwapFailed" and "ChecksumMismatch" in failed["message"]
    assert not labels and DIGEST_ANNOTATION not in notes
    record = pod_swap(notes)
    assert record is not None and record.state == "Failed" and record.reason == "ChecksumMismatch"


def test_a_server_without_swaps_is_not_supported(plugin: int) -> None:
    Plugin.post_status = 501
    writes = Writes()
    swap(plugin, writes)
    record = pod_swap(writes.patches[-1][1])
    assert record is not None and record.reason == "NotSupported"
