"""The stand-in inference server (weightship_dev.standin) against the operator's own swap
client and verifier: the swapper (controller/swapper.py) asks it to swap with the pod's
token and follows the swap to its end, the verifier (controller/verifier.py) reads its
/weightship/v1/loaded and asks the golden prompt with the swap token, then tells it the
weights passed. The stand-in imports the plugin's gate, stamps and contract; these tests
keep its side of the protocol from drifting from the client's."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from datetime import UTC, datetime
from email.message import Message
from typing import Any

import pytest

from weightship.api.env import (
    MANIFEST_DIGEST_ENV,
    MODEL_REVISION_ENV,
    POD_NAME_ENV,
    ROLLOUT_UID_ENV,
    SEED_KEY_ENV,
)
from weightship.api.inference import DIGEST_HEADER, LOADED_PATH, REVISION_HEADER, SWAP_PATH
from weightship.api.models import ModelRollout
from weightship.api.names import DIGEST_ANNOTATION, REVISION_LABEL, SWAP_ANNOTATION
from weightship.controller.builders import gate_condition, swap_record
from weightship.controller.seedkey import KEY_FIELD
from weightship.controller.snapshot import observed_pods
from weightship.controller.swapper import Swapper
from weightship.controller.verifier import Verifier
from weightship.core.decision import SwapPod
from weightship.core.observed import PodSwap
from weightship.core.pod_gates import pod_gates
from weightship_dev import standin, standinfleet
from weightship_testing.core import T0, make_rollout

KEY = bytes(range(32))
V1 = "sha256:" + "a" * 64
V2 = "sha256:" + "b" * 64
POD = "llm-t-1"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


class Running:
    """A stand-in on a loopback port, its event loop on a thread of its own."""

    def __init__(self, server: standin.PodServer) -> None:
        self.server = server
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        site = asyncio.run_coroutine_threadsafe(
            standin.serve("127.0.0.1", 0, lambda _address: server), self.loop
        ).result(10)
        self.port = int(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
        self.site = site

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.site.stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"


def env(rollout: ModelRollout, key: bytes = KEY) -> dict[str, str]:
    """What the operator puts in the pod's env (controller/builders.model_env)."""
    return {
        MODEL_REVISION_ENV: "v1",
        MANIFEST_DIGEST_ENV: V1,
        SEED_KEY_ENV: key.hex(),
        ROLLOUT_UID_ENV: rollout.metadata.uid or "",
        POD_NAME_ENV: POD,
    }


def verifying_rollout(port: int, mode: str = "loaded") -> ModelRollout:
    rollout = make_rollout()
    rollout.spec.validation = type(rollout.spec.validation).model_validate(
        {
            "checksumMode": mode,
            "goldenPrompts": [
                {"name": "capital", "messages": QUESTION, "expect": {"equals": "Paris."}}
            ],
            "endpoint": {"port": port, "path": standin.CHAT_PATH, "model": "tiny"},
            "timeoutSeconds": 5,
        }
    )
    rollout.spec.strategy.canary.in_place.drain_timeout_seconds = 5
    rollout.spec.strategy.canary.in_place.swap_timeout_seconds = 20
    return rollout


@pytest.fixture
def running() -> Iterator[Running]:
    rollout = make_rollout()
    how = standin.Behaviour(swap_seconds=0.4, revision_answers={"v3": "Lyon."})
    server = Running(standin.PodServer(env(rollout), how))
    yield server
    server.close()


class Reads:
    """The Kube the swapper and the verifier get: the pod, unready once its gate closed,
    and the rollout's seeding key."""

    def __init__(self, key: bytes = KEY) -> None:
        self.key = key
        self.done = threading.Event()

    def pod(self, namespace: str, name: str) -> dict[str, Any]:
        return {"status": {"conditions": [{"type": "Ready", "status": "False"}]}}

    def secret_data(self, namespace: str, name: str) -> dict[str, str]:
        return {KEY_FIELD: self.key.hex()}

    def on_done(self, namespace: str, name: str) -> None:
        self.done.set()


def raw_pod(port: int, record: PodSwap, digest: str) -> dict[str, Any]:
    return {
        "metadata": {
            "name": POD,
            "namespace": "serving",
            "uid": "u1",
            "labels": {REVISION_LABEL: "h1"},
            "annotations": {SWAP_ANNOTATION: swap_record(record), DIGEST_ANNOTATION: digest},
        },
        "spec": {"containers": [{"name": "server"}]},
        "status": {"podIP": "127.0.0.1", "phase": "Running"},
    }


def swap(running: Running, rollout: ModelRollout, to: SwapPod, reads: Reads) -> PodSwap:
    """The swapper's swap of the pod, as the controller starts it; its report."""
    pod = raw_pod(running.port, to.record(), to.manifest_digest)
    reads.done.clear()
    swapper = Swapper(reads, on_done=reads.on_done, endpoints_grace_s=0.0)  # type: ignore[arg-type]
    swapper.submit(rollout, [to], [pod])
    assert reads.done.wait(30)
    swapper.close()
    ((_uid, report),) = swapper.pending([pod]).items()
    return report


def verify(rollout: ModelRollout, pod: dict[str, Any], reads: Reads) -> dict[str, Any]:
    """The verifier's verdict on the pod, as the gate condition it becomes."""
    reads.done.clear()
    verifier = Verifier(reads, workers=1, on_verdict=reads.on_done)  # type: ignore[arg-type]
    assert verifier.submit(rollout, [pod]) is True
    assert reads.done.wait(30)
    verifier.pool.shutdown(wait=True)
    (gate,) = pod_gates(
        rollout.spec, observed_pods([pod], verifier.pending([pod])), datetime.now(UTC)
    )
    return gate_condition(gate)


def chat(running: Running, timeout: float = 30.0) -> tuple[int, Message, str]:
    body = json.dumps({"model": "tiny", "messages": QUESTION, "max_tokens": 8}).encode()
    request = urllib.request.Request(
        running.url(standin.CHAT_PATH), body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        doc = json.loads(response.read())
        return response.status, response.headers, doc["choices"][0]["message"]["content"]


def get(running: Running, path: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(running.url(path), timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


TO_V2 = SwapPod(POD, "h2", V2, "v2", "canary", "h1", 0, T0)


def test_a_swap_asked_by_the_swapper_then_verified_by_the_verifier(running: Running) -> None:
    """The swapper's swap takes the stand-in's swap time with requests held; the swapped
    weights serve the verifier alone (its golden prompt carries the swap token) until it
    says they passed; a request held meanwhile is answered by them, stamped v2."""
    rollout = verifying_rollout(running.port)
    reads = Reads()
    status, before = get(running, LOADED_PATH)
    assert status == 200 and before["manifestDigest"] == V1 and before["source"] == "cache"
    started = time.monotonic()
    report = swap(running, rollout, TO_V2, reads)
    assert report.state == "Swapped", report
    # It takes the swap time it was given, with requests held throughout (a lower bound:
    # the sleep's; how much longer is the machine's).
    assert report.paused_seconds is not None and report.paused_seconds >= 0.4
    assert time.monotonic() - started >= 0.4
    status, loaded = get(running, LOADED_PATH)
    assert (loaded["state"], loaded["manifestDigest"], loaded["source"]) == ("Loaded", V2, "swap")
    _, state = get(running, SWAP_PATH)
    assert state["state"] == "Swapped" and state["revision"] == "v2" and state["swappable"]

    with ThreadPoolExecutor(1) as pool:
        held: Future[tuple[int, Message, str]] = pool.submit(chat, running)
        time.sleep(0.5)
        assert not held.done()  # the new weights are not verified: nobody but the verifier
        pod = raw_pod(running.port, report, V2)
        condition = verify(rollout, pod, reads)
        assert (condition["status"], condition["reason"]) == ("True", "Verified"), condition
        assert condition["message"].startswith(f"checksum loaded; digest {V2} verified")
        status, headers, text = held.result(10)
    assert (status, text) == (200, "Paris.")
    assert (headers[REVISION_HEADER], headers[DIGEST_HEADER]) == ("v2", V2)
    assert chat(running)[1][REVISION_HEADER] == "v2"

    # Sent again (an operator restarted mid-swap): already loaded, nothing paused.
    again = swap(running, rollout, TO_V2, reads)
    assert again.state == "Swapped" and again.paused_seconds is None


def test_a_subtly_bad_revision_fails_its_golden_prompt_and_serves_no_one(
    running: Running,
) -> None:
    rollout = verifying_rollout(running.port, mode="none")
    reads = Reads()
    to_v3 = replace(TO_V2, to_revision_hash="h3", manifest_digest=V2, revision="v3")
    report = swap(running, rollout, to_v3, reads)
    assert report.state == "Swapped"
    condition = verify(rollout, raw_pod(running.port, report, V2), reads)
    assert (condition["status"], condition["reason"]) == ("False", "GoldenPromptFailed")
    assert 'expected equals "Paris.", got "Lyon."' in condition["message"]
    with pytest.raises(TimeoutError):  # held: the weights never passed
        chat(running, timeout=1.0)


def test_a_token_for_another_rollout_is_refused(running: Running) -> None:
    rollout = verifying_rollout(running.port)
    report = swap(running, rollout, TO_V2, Reads(key=bytes(32)))
    assert report.state == "Failed" and report.reason == "Unauthorized", report
    _, loaded = get(running, LOADED_PATH)
    assert loaded["manifestDigest"] == V1
    status, headers, _ = chat(running)  # the old weights serve on
    assert status == 200 and headers[REVISION_HEADER] == "v1"


def test_a_starting_server_answers_nothing_yet() -> None:
    rollout = make_rollout()
    clock = [0.0]
    how = standin.Behaviour(start_seconds=60.0)
    running = Running(standin.PodServer(env(rollout), how, clock=lambda: clock[0]))
    try:
        assert get(running, "/health")[0] == 503
        assert get(running, LOADED_PATH)[0] == 503
        clock[0] = 60.0
        assert get(running, "/health")[0] == 200
        assert get(running, LOADED_PATH)[1]["state"] == "Loaded"
    finally:
        running.close()


def test_the_pod_command_is_the_behaviour_it_asks_for() -> None:
    argv = standin.command(swap_seconds=1.02, start_seconds=65.7, answer="Paris.")
    assert argv[:3] == ["python3", "-m", "weightship_dev.standin"]
    how = standin.behaviour_from_argv(argv[3:])
    assert (how.swap_seconds, how.start_seconds, how.answer) == (1.02, 65.7, "Paris.")
    with pytest.raises(SystemExit):
        standin.behaviour_from_argv(["--swap-seconds", "-1"])


def test_the_stand_in_imports_no_torch() -> None:
    """A process per pod at 100 replicas: without torch it is ~60 MB, with it ~560 MB."""
    code = "import sys, weightship_dev.standin; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


GATE = "weightship.io/weights-verified"


def kwok_pod(conditions: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "metadata": {"name": "p", "uid": "u"},
        "spec": {
            "readinessGates": [{"conditionType": GATE}],
            "containers": [{"command": standin.command(swap_seconds=2, start_seconds=3)}],
        },
        "status": {"conditions": conditions},
    }


def test_the_fleet_plays_the_kubelets_readiness_for_kwok_pods() -> None:
    """Ready only while started and every gate is True; a gate KWOK forged (True, no
    reason) is removed, so the verifier checks the pod as a real one."""
    ready = {"type": "Ready", "status": "True"}
    containers = {"type": "ContainersReady", "status": "True"}
    forged = {"type": GATE, "status": "True"}
    now = "2026-12-07T20:00:00Z"
    patch = standinfleet.readiness_patch(kwok_pod([ready, containers, forged]), True, now)
    assert patch is not None
    assert patch["status"]["conditions"] == [
        {"type": GATE, "$patch": "delete"},
        {"type": "Ready", "status": "False", "lastTransitionTime": now},
    ]
    verified = {**forged, "reason": "Verified"}
    assert standinfleet.readiness_patch(kwok_pod([ready, containers, verified]), True, now) is None
    starting = standinfleet.readiness_patch(kwok_pod([ready, containers, verified]), False, now)
    assert starting is not None
    assert [(c["type"], c["status"]) for c in starting["status"]["conditions"]] == [
        ("ContainersReady", "False"),
        ("Ready", "False"),
    ]
    swapping = {**verified, "status": "False", "reason": "Swapping"}
    patch = standinfleet.readiness_patch(kwok_pod([ready, containers, swapping]), True, now)
    assert patch is not None
    assert [(c["type"], c["status"]) for c in patch["status"]["conditions"]] == [("Ready", "False")]
    argv = standinfleet.standin_args(kwok_pod([]))
    assert argv is not None and standin.behaviour_from_argv(argv).start_seconds == 3
    assert standinfleet.standin_args({"spec": {"containers": [{"command": ["sh"]}]}}) is None
