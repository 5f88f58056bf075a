"""In-place swaps, the swapper reporting, the core deciding, apply writing: the swapper
against a real HTTP server on loopback speaking the contract (POST/GET SWAP_PATH), with
Kubernetes reads only (a write would fail the test); then what the core decides from its
report and what apply writes for it, before the swap, after a success and after a failure.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from http.server import BaseHTTPRequestHandler
from typing import Any, ClassVar

import pytest

from weightship.api.inference import SwapRequest
from weightship.api.names import (
    DIGEST_ANNOTATION,
    LOADED_ANNOTATION,
    REVISION_LABEL,
    SWAP_ANNOTATION,
    VERIFIED_GATE,
)
from weightship.controller.apply import pod_condition_writes
from weightship.controller.builders import swap_record
from weightship.controller.kube import PodConditionWrite
from weightship.controller.seedkey import swap_group
from weightship.controller.snapshot import observed_pods, pod_swap
from weightship.controller.swapper import Swapper
from weightship.core import inplace
from weightship.core.context import RolloutContext
from weightship.core.decide import decide
from weightship.core.decision import Decision, SwapPod
from weightship.core.gates import DEFAULT_GATES
from weightship.core.observed import ManifestResolution, Observed, PodSwap
from weightship.core.seedtoken import check_token
from weightship.httpserver import Server
from weightship_testing.core import DIGEST_A, T0, make_rollout

KEY = bytes(range(32))
DIGEST = "sha256:" + "b" * 64
SWAP = SwapPod("llm-t-1", "h2", DIGEST, "v2", "canary", "h1", 0, T0)


class Plugin(BaseHTTPRequestHandler):
    """The server's side: accepts a swap, then answers GET with ``outcome`` for its digest."""

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


class Reads:
    """The Kube the swapper gets: the pod (unready once its gate closed) and the seeding
    key. Anything else it touches is recorded, and fails the test."""

    def __init__(self) -> None:
        self.other: list[str] = []

    def pod(self, namespace: str, name: str) -> dict[str, Any]:
        return {"status": {"conditions": [{"type": "Ready", "status": "False"}]}}

    def secret_data(self, namespace: str, name: str) -> dict[str, str]:
        return {"key": KEY.hex()}

    def __getattr__(self, name: str) -> Any:
        self.other.append(name)
        raise AssertionError(f"the swapper called Kube.{name}")


def raw_pod(record: PodSwap | None = None, port: int = 0) -> dict[str, Any]:
    annotations = {SWAP_ANNOTATION: swap_record(record)} if record is not None else {}
    return {
        "metadata": {
            "name": "llm-t-1",
            "namespace": "serving",
            "uid": "u1",
            "labels": {REVISION_LABEL: "h1"},
            "annotations": annotations,
        },
        "status": {"podIP": "127.0.0.1", "phase": "Running"},
    }


def swap(port: int, reads: Reads) -> tuple[Swapper, dict[str, Any], PodSwap]:
    """Start SWAP as reconcile does after apply recorded it; the swapper's report."""
    rollout = make_rollout()
    rollout.spec.validation.endpoint.port = port
    pod = raw_pod(SWAP.record())
    done = threading.Event()
    swapper = Swapper(reads, on_done=lambda namespace, name: done.set())  # type: ignore[arg-type]
    swapper.endpoints_grace_s = 0.0
    swapper.submit(rollout, [SWAP], [pod])
    assert done.wait(30)
    swapper.close()
    assert not reads.other
    ((uid, report),) = swapper.pending([pod]).items()
    assert uid == "u1" and report.same_swap(SWAP.record())
    return swapper, pod, report


def test_the_swapper_asks_for_the_swap_and_reports_how_it_ended(plugin: int) -> None:
    Plugin.outcome = {"state": "Swapped", "seconds": 1.25, "pausedSeconds": 0.5}
    _swapper, _pod, report = swap(plugin, Reads())
    ((body, authorization),) = Plugin.posted
    # The contract's request; the rollout verifies pods: the server holds the new weights
    # for the verifier, each waiting request at most inPlace.maxHoldSeconds.
    assert SwapRequest.parse(json.dumps(body).encode()) == SwapRequest(
        DIGEST, "v2", 30, 300, hold_until_verified=True, max_hold_s=60
    )
    token = authorization.removeprefix("Bearer ")
    rollout = make_rollout()
    assert (
        check_token(
            KEY, rollout.metadata.uid or "", DIGEST, swap_group("llm-t-1"), token, time.time()
        )
        is None
    )
    assert report.state == "Swapped" and report.to_revision_hash == "h2"
    assert report.seconds == 1.25 and report.paused_seconds == 0.5
    assert report.from_revision_hash == "h1" and report.finished_at is not None


def test_a_failed_swap_is_reported_with_its_reason(plugin: int) -> None:
    Plugin.outcome = {"state": "Failed", "reason": "ChecksumMismatch", "message": "chunk 3"}
    _swapper, _pod, report = swap(plugin, Reads())
    assert report.state == "Failed" and report.reason == "ChecksumMismatch"
    assert report.message == "chunk 3"


def test_a_server_without_swaps_is_not_supported(plugin: int) -> None:
    Plugin.post_status = 501
    _swapper, _pod, report = swap(plugin, Reads())
    assert report.state == "Failed" and report.reason == "NotSupported"


def test_a_report_waits_for_the_record_and_its_swap_is_not_followed_again(plugin: int) -> None:
    Plugin.outcome = {"state": "Swapped"}
    swapper, pod, report = swap(plugin, Reads())
    rollout = make_rollout()
    rollout.spec.validation.endpoint.port = plugin
    # The record still says Swapping: the swap runs, as far as the rollout knows, but the
    # report waits for the core; nothing asks the server again.
    assert swapper.resume(rollout, [pod])
    assert not swapper.in_flight and len(Plugin.posted) == 1
    assert swapper.pending([pod]) == {"u1": report}
    # Apply wrote the report: it is dropped.
    written = raw_pod(report)
    assert not swapper.resume(rollout, [written])
    assert swapper.pending([written]) == {}


class TwoAtOnce(Plugin):
    """A swap that ends only once two swaps were asked for: a swapper that ran one at a
    time would see the first time out."""

    def do_GET(self) -> None:
        state = "Swapped" if len(Plugin.posted) >= 2 else "Swapping"
        self._answer(200, {"manifestDigest": DIGEST, "state": state})


def test_the_swapper_runs_the_swaps_of_one_rollout_at_once() -> None:
    Plugin.posted = []
    Plugin.post_status = 202
    rollout = make_rollout()
    rollout.spec.strategy.canary.in_place.drain_timeout_seconds = 0
    rollout.spec.strategy.canary.in_place.swap_timeout_seconds = 10
    swaps = [SWAP, replace(SWAP, pod="llm-t-2")]
    pods = [raw_pod(SWAP.record()), raw_pod(SWAP.record())]
    pods[1]["metadata"] |= {"name": "llm-t-2", "uid": "u2"}
    ended = threading.Semaphore(0)
    reads = Reads()
    swapper = Swapper(reads, on_done=lambda namespace, name: ended.release())  # type: ignore[arg-type]
    swapper.endpoints_grace_s = 0.0
    with Server(("127.0.0.1", 0), TwoAtOnce).start("plugin") as server:
        rollout.spec.validation.endpoint.port = server.server_port
        swapper.submit(rollout, swaps, pods)
        assert ended.acquire(timeout=30) and ended.acquire(timeout=30)
    swapper.close()
    assert not reads.other and not swapper.in_flight
    reports = swapper.pending(pods)
    assert {uid: r.state for uid, r in reports.items()} == {"u1": "Swapped", "u2": "Swapped"}


def decision_on(pod: dict[str, Any], reports: dict[str, PodSwap] | None = None) -> Decision:
    observed = Observed(
        manifest=ManifestResolution(digest=DIGEST_A), pods=observed_pods([pod], None, reports)
    )
    return decide(make_rollout(), observed, T0)


def test_a_swap_starts_with_its_record_and_the_gate_closed_in_one_write() -> None:
    rollout = make_rollout()
    ctx = RolloutContext(rollout, Observed(ManifestResolution(digest=DIGEST_A)), T0, DEFAULT_GATES)
    decision = Decision(status=rollout.status, swap_records=inplace.swap_records(ctx, [SWAP]))
    (write,) = pod_condition_writes(decision)
    assert write.condition["type"] == VERIFIED_GATE and write.condition["status"] == "False"
    assert write.condition["reason"] == "Swapping" and not write.labels
    assert pod_swap(dict(write.annotations or {})) == SWAP.record()
    assert json.loads((write.annotations or {})[SWAP_ANNOTATION])["purpose"] == "canary"


def swap_writes(decision: Decision) -> list[PodConditionWrite]:
    return [w for w in pod_condition_writes(decision) if SWAP_ANNOTATION in (w.annotations or {})]


def test_the_core_records_a_swapped_report_and_moves_the_pod_to_its_revision() -> None:
    report = PodSwap(
        "h2", DIGEST, "v2", "Swapped", "h1", T0, 1.25, 0.5, restarts=0, purpose="canary"
    )
    decision = decision_on(raw_pod(SWAP.record()), {"u1": report})
    (record,) = decision.swap_records
    assert record.swap == report
    (write,) = [
        w for w in pod_condition_writes(decision) if SWAP_ANNOTATION in (w.annotations or {})
    ]
    # Swapped: the new revision's label and digest, the gate left to the verifier.
    assert write.condition["status"] == "False" and write.condition["reason"] == "Pending"
    notes = dict(write.annotations or {})
    assert write.labels == {REVISION_LABEL: "h2"} and notes[DIGEST_ANNOTATION] == DIGEST
    assert LOADED_ANNOTATION in notes and notes[LOADED_ANNOTATION] is None
    assert pod_swap(notes) == report
    # Once the record shows it, nothing more is written.
    assert not decision_on(raw_pod(report), {"u1": report}).swap_records


def test_the_core_records_a_failed_report_and_keeps_the_pod_on_its_revision() -> None:
    report = PodSwap(
        "h2", DIGEST, "v2", "Failed", "h1", T0, reason="ChecksumMismatch", message="chunk 3"
    )
    decision = decision_on(raw_pod(SWAP.record()), {"u1": report})
    (write,) = [
        w for w in pod_condition_writes(decision) if SWAP_ANNOTATION in (w.annotations or {})
    ]
    assert write.condition["reason"] == "SwapFailed"
    assert "ChecksumMismatch" in write.condition["message"]
    assert not write.labels and DIGEST_ANNOTATION not in (write.annotations or {})
    record = pod_swap(dict(write.annotations or {}))
    assert record is not None and record.state == "Failed" and record.reason == "ChecksumMismatch"


def test_a_report_of_another_swap_than_the_recorded_one_is_not_written() -> None:
    other = PodSwap("h3", DIGEST, "v3", "Swapped", "h1", T0)
    assert not decision_on(raw_pod(SWAP.record()), {"u1": other}).swap_records


class AllAtOnce(Plugin):
    """A swap that ends only once SWAPS swaps were asked for."""

    SWAPS = 6

    def do_GET(self) -> None:
        state = "Swapped" if len(Plugin.posted) >= AllAtOnce.SWAPS else "Swapping"
        self._answer(200, {"manifestDigest": DIGEST, "state": state})


def test_swaps_at_once_are_not_bounded_by_the_swappers_threads() -> None:
    """Six swaps on a swapper with one thread: each waits for its server without holding
    it (a thread per swap held through the wait would see the first one time out)."""
    Plugin.posted = []
    Plugin.post_status = 202
    rollout = make_rollout()
    rollout.spec.strategy.canary.in_place.drain_timeout_seconds = 0
    rollout.spec.strategy.canary.in_place.swap_timeout_seconds = 10
    swaps = [replace(SWAP, pod=f"llm-t-{i}") for i in range(AllAtOnce.SWAPS)]
    pods = []
    for i in range(AllAtOnce.SWAPS):
        pod = raw_pod(SWAP.record())
        pod["metadata"] |= {"name": f"llm-t-{i}", "uid": f"u{i}"}
        pods.append(pod)
    ended = threading.Semaphore(0)
    reads = Reads()
    swapper = Swapper(reads, workers=1, on_done=lambda namespace, name: ended.release())  # type: ignore[arg-type]
    swapper.endpoints_grace_s = 0.0
    with Server(("127.0.0.1", 0), AllAtOnce).start("plugin") as server:
        rollout.spec.validation.endpoint.port = server.server_port
        swapper.submit(rollout, swaps, pods)
        assert all(ended.acquire(timeout=30) for _ in swaps)
    swapper.close()
    reports = swapper.pending(pods)
    assert sorted(r.state for r in reports.values()) == ["Swapped"] * AllAtOnce.SWAPS


class ReadyPods(Reads):
    """A Kube whose pods stay Ready, counting the reads of them."""

    def __init__(self) -> None:
        super().__init__()
        self.pod_reads = 0

    def pod(self, namespace: str, name: str) -> dict[str, Any]:
        self.pod_reads += 1
        return {"status": {"conditions": [{"type": "Ready", "status": "True"}]}}


def test_a_swap_waits_for_a_reconcile_to_show_its_pod_unready_and_reads_nothing(
    plugin: int,
) -> None:
    """The swap asks the server only after the pods a reconcile reads show the pod
    unready: no GET of the pod in the meantime."""
    Plugin.outcome = {"state": "Swapped"}
    rollout = make_rollout()
    rollout.spec.validation.endpoint.port = plugin
    ready = raw_pod(SWAP.record())
    ready["status"]["conditions"] = [{"type": "Ready", "status": "True"}]
    done = threading.Event()
    reads = ReadyPods()
    swapper = Swapper(reads, on_done=lambda namespace, name: done.set())  # type: ignore[arg-type]
    swapper.endpoints_grace_s = 0.0
    swapper.submit(rollout, [SWAP], [ready])
    assert swapper.resume(rollout, [ready])
    assert not done.wait(1.0) and not Plugin.posted  # still Ready: not asked
    unready = raw_pod(SWAP.record())
    unready["status"]["conditions"] = [{"type": "Ready", "status": "False"}]
    swapper.resume(rollout, [unready])
    assert done.wait(30)
    swapper.close()
    assert len(Plugin.posted) == 1 and reads.pod_reads == 0 and not reads.other
    ((_uid, report),) = swapper.pending([unready]).items()
    assert report.state == "Swapped"
