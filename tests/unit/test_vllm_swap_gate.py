"""The gate in front of vLLM's routes and the headers it stamps (plain ASGI, driven here
with an app of our own; the real vLLM runs in e2e/test_vllm_swap_engine.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from weightship.integrations.serving import (
    DIGEST_HEADER_KEY,
    REVISION_HEADER_KEY,
    Refused,
    Weights,
    verified_answer,
)
from weightship.integrations.vllm.stamp import MAX_HELD, StampMiddleware, WeightsGate, gated

V1 = Weights("v1", "sha256:" + "1" * 64)
V2 = Weights("v2", "sha256:" + "2" * 64)


class App:
    """An ASGI app that answers each request when told to (``release``), in one or two
    body messages, and may try to set the stamp headers itself."""

    def __init__(self) -> None:
        self.gates: dict[str, asyncio.Event] = {}
        self.halfway: dict[str, asyncio.Event] = {}

    def release(self, path: str) -> None:
        self.gates.setdefault(path, asyncio.Event()).set()

    def finish(self, path: str) -> None:
        self.halfway.setdefault(path, asyncio.Event()).set()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        path = scope["path"]
        await self.gates.setdefault(path, asyncio.Event()).wait()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/plain"), (REVISION_HEADER_KEY, b"spoofed")],
            }
        )
        if path.startswith("/stream"):
            await send({"type": "http.response.body", "body": b"first ", "more_body": True})
            await self.halfway.setdefault(path, asyncio.Event()).wait()
        await send({"type": "http.response.body", "body": path.encode()})


Sent = list[dict[str, Any]]


def request(
    middleware: StampMiddleware, path: str, verify: str | None = None
) -> tuple[asyncio.Task[None], Sent]:
    sent: Sent = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Any) -> None:
        sent.append(dict(message))

    sent_headers = [] if verify is None else [(b"X-Weightship-Verify", verify.encode())]
    scope = {"type": "http", "path": path, "method": "POST", "headers": sent_headers}
    return asyncio.get_running_loop().create_task(middleware(scope, receive, send)), sent


def status(sent: Sent) -> int:
    return int(next(m for m in sent if m["type"] == "http.response.start")["status"])


def headers(sent: Sent) -> dict[bytes, bytes]:
    start = next(m for m in sent if m["type"] == "http.response.start")
    return dict(start["headers"])


def stamped(sent: Sent) -> tuple[str, str]:
    h = headers(sent)
    return h[REVISION_HEADER_KEY].decode(), h[DIGEST_HEADER_KEY].decode()


def body(sent: Sent) -> bytes:
    return b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), 10))


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_every_response_is_stamped_with_the_weights_serving_it() -> None:
    async def test() -> None:
        app, gate = App(), WeightsGate(V1)
        mw = StampMiddleware(app, gate)
        app.release("/v1/chat/completions")
        app.release("/health")
        for path in ("/v1/chat/completions", "/health"):
            task, sent = request(mw, path)
            await task
            assert status(sent) == 200 and stamped(sent) == ("v1", V1.manifest_digest)
            assert list(headers(sent)).count(REVISION_HEADER_KEY) == 1  # the app's own is replaced
        assert gate.in_flight == 0

    run(test)


def test_requests_arriving_during_a_swap_wait_and_get_the_new_weights() -> None:
    async def test() -> None:
        app, gate = App(), WeightsGate(V1)
        mw = StampMiddleware(app, gate)
        app.release("/v1/completions")
        app.release("/health")
        gate.close(60)
        held, held_sent = request(mw, "/v1/completions")
        probe, probe_sent = request(mw, "/health")
        await probe  # probes are never held
        assert status(probe_sent) == 200 and stamped(probe_sent)[0] == "v1"
        await settle()
        assert not held.done() and gate.held == 1 and gate.in_flight == 0
        gate.seal()
        gate.open(V2)
        await held
        assert status(held_sent) == 200 and stamped(held_sent) == ("v2", V2.manifest_digest)

    run(test)


def test_swapped_weights_held_for_verification_serve_only_the_verifier_until_they_pass() -> None:
    """A request a stale router sends during a swap asked to hold until verified waits
    past the swap, while the verifier's golden prompt (its token in X-Weightship-Verify)
    reaches the new weights; once they pass the held one gets them too. A request with a
    wrong token waits like any other."""

    async def test() -> None:
        app, gate = App(), WeightsGate(V1)
        mw = StampMiddleware(app, gate, is_verifier=lambda h: h == "Bearer good")
        app.release("/v1/completions")
        gate.close(60)
        held, held_sent = request(mw, "/v1/completions")
        await settle()
        gate.seal()
        gate.verifying(V2, 60)
        await settle()
        assert not held.done() and gate.held == 1  # the swap is over; still held
        forged, forged_sent = request(mw, "/v1/completions", verify="Bearer forged")
        golden, golden_sent = request(mw, "/v1/completions", verify="Bearer good")
        await golden
        assert status(golden_sent) == 200 and stamped(golden_sent)[0] == "v2"
        await settle()
        assert not held.done() and not forged.done() and gate.held == 2
        assert not gate.verified(V1.manifest_digest or "")  # not the weights it verifies
        assert gate.verified(V2.manifest_digest or "")
        await asyncio.gather(held, forged)
        assert status(held_sent) == 200 and stamped(held_sent)[0] == "v2"
        assert status(forged_sent) == 200 and stamped(forged_sent)[0] == "v2"
        assert gate.verified(V2.manifest_digest or "")  # told again: still open

    run(test)


def test_the_verifiers_request_held_through_the_swap_is_asked_about_the_new_weights() -> None:
    """A golden prompt that arrives while the gate is still closed waits; once the swap
    leaves the gate verifying, its token is checked against the weights it now verifies
    and it goes through (it is not held until the hold bound)."""

    async def test() -> None:
        app, gate = App(), WeightsGate(V1)
        good = "Bearer for-v2"
        mw = StampMiddleware(app, gate, is_verifier=lambda h: h == good and gate.weights == V2)
        app.release("/v1/completions")
        gate.close(60)
        golden, golden_sent = request(mw, "/v1/completions", verify=good)
        await settle()
        assert not golden.done()
        gate.seal()
        gate.verifying(V2, 60)
        await asyncio.wait_for(golden, 5)
        assert status(golden_sent) == 200 and stamped(golden_sent)[0] == "v2"

    run(test)


def test_weights_that_fail_verification_never_serve_the_held_requests() -> None:
    """The operator swaps back after a failed golden prompt: what waited during the bad
    weights' verification is served by the weights swapped back, once verified."""

    async def test() -> None:
        app, gate = App(), WeightsGate(V1)
        mw = StampMiddleware(app, gate, is_verifier=lambda h: h == "Bearer good")
        app.release("/v1/completions")
        gate.close(60)
        gate.seal()
        gate.verifying(V2, 60)  # V2 turns out bad
        held, held_sent = request(mw, "/v1/completions")
        await settle()
        gate.close(60)  # the swap back
        gate.seal()
        await settle()
        assert not held.done()
        gate.verifying(V1, 60)
        assert gate.verified(V1.manifest_digest or "")
        await held
        assert status(held_sent) == 200 and stamped(held_sent)[0] == "v1"

    run(test)


def test_a_request_held_past_the_verification_bound_is_a_503() -> None:
    async def test() -> None:
        gate = WeightsGate(V1)
        mw = StampMiddleware(App(), gate, is_verifier=lambda h: False)
        gate.close(60)
        gate.seal()
        gate.verifying(V2, 0.05)
        task, sent = request(mw, "/v1/completions")
        await task
        assert status(sent) == 503 and json.loads(body(sent))["reason"] == "Verifying"

    run(test)


def test_a_request_held_longer_than_the_swap_may_take_is_a_503() -> None:
    async def test() -> None:
        gate = WeightsGate(V1)
        mw = StampMiddleware(App(), gate)
        gate.close(0.05)
        task, sent = request(mw, "/v1/completions")
        await task
        assert status(sent) == 503 and json.loads(body(sent))["reason"] == "SwapInProgress"
        assert stamped(sent)[0] == "v1"

    run(test)


def test_a_request_held_longer_than_the_swaps_max_hold_is_a_503_saying_so() -> None:
    """inPlace.maxHoldSeconds bounds each request, whatever the swap's own bounds: a
    client of a pod swapping in traffic gets a clear answer, never an endless wait."""

    async def test() -> None:
        gate = WeightsGate(V1)
        mw = StampMiddleware(App(), gate)
        gate.close(60, max_hold_s=0.05)
        task, sent = request(mw, "/v1/completions")
        await task
        answer = json.loads(body(sent))
        assert status(sent) == 503 and answer["reason"] == "HoldTimeout", answer
        assert "maxHoldSeconds" in answer["error"]["message"]
        assert headers(sent)[b"retry-after"] == b"1"

    run(test)


def test_the_gate_measures_each_hold_through_a_swap_back_until_it_opens() -> None:
    """From the first swap's close to the opening to every request: a swap back after
    failed checks goes on with the same hold."""
    now = [100.0]
    gate = WeightsGate(V1, clock=lambda: now[0])
    gate.close(60, max_hold_s=30)
    now[0] = 101.0
    gate.seal()
    gate.verifying(V2, 60)  # V2 fails its checks
    now[0] = 103.0
    gate.close(60, max_hold_s=30)  # the swap back
    gate.seal()
    now[0] = 104.0
    gate.verifying(V1, 60)
    assert gate.last_held_s is None  # still holding
    now[0] = 105.5
    assert gate.verified(V1.manifest_digest or "")
    assert gate.last_held_s == 5.5
    assert verified_answer(True, gate.mode, V1.manifest_digest, gate.last_held_s)[1].to_json() == {
        "accepted": True,
        "gate": "open",
        "heldSeconds": 5.5,
    }
    # Told again (the verifier's retry): still open, the same hold reported.
    assert gate.verified(V1.manifest_digest or "") and gate.last_held_s == 5.5


def test_the_gate_holds_a_bounded_number_of_requests() -> None:
    async def test() -> None:
        gate = WeightsGate(V1)
        gate.close(60)
        gate.held = MAX_HELD  # as if that many were waiting
        got = await gate.admit()
        assert isinstance(got, Refused) and got.status == 503

    run(test)


def test_mixed_weights_serve_nothing_until_a_good_swap() -> None:
    async def test() -> None:
        app, gate = App(), WeightsGate(V1)
        mw = StampMiddleware(app, gate)
        app.release("/v1/completions")
        gate.close(60)
        held, held_sent = request(mw, "/v1/completions")
        await settle()
        gate.refuse("MixedWeights", "rank 1: boom")
        await held
        assert status(held_sent) == 503 and json.loads(body(held_sent))["reason"] == "MixedWeights"
        later, later_sent = request(mw, "/v1/completions")
        await later
        assert status(later_sent) == 503
        gate.open(V2)
        again, again_sent = request(mw, "/v1/completions")
        await again
        assert status(again_sent) == 200 and stamped(again_sent)[0] == "v2"

    run(test)


def test_a_request_admitted_before_the_seal_never_sends_what_came_after_it() -> None:
    """One answers after the seal and before anything was sent: a 503, never a 200 stamped
    with the weights it was admitted under. One streaming since before the seal ends
    there: nothing of what its generation sends afterwards goes out."""

    async def test() -> None:
        app, gate = App(), WeightsGate(V1)
        mw = StampMiddleware(app, gate)
        late, late_sent = request(mw, "/v1/completions")
        app.release("/stream")
        stream, stream_sent = request(mw, "/stream")
        await settle()
        assert gate.in_flight == 2 and stamped(stream_sent)[0] == "v1"
        gate.close(60)
        assert not await gate.wait_idle(0.05)  # both still running
        gate.seal()
        gate.open(V2)
        app.release("/v1/completions")
        app.finish("/stream")
        await late
        await stream
        assert status(late_sent) == 503
        assert json.loads(body(late_sent))["reason"] == "WeightsChanged"
        assert body(stream_sent) == b"first "  # the rest was cut
        assert stream_sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
        assert gate.in_flight == 0

    run(test)


def test_wait_idle_returns_once_admitted_requests_are_done() -> None:
    async def test() -> None:
        app, gate = App(), WeightsGate(V1)
        mw = StampMiddleware(app, gate)
        assert await gate.wait_idle(0)
        task, _ = request(mw, "/v1/completions")
        await settle()
        gate.close(60)
        waiter = asyncio.get_running_loop().create_task(gate.wait_idle(5))
        await settle()
        assert not waiter.done()
        app.release("/v1/completions")
        await task
        assert await waiter

    run(test)


def test_header_values_are_printable_ascii() -> None:
    weird = Weights("v2\r\nX-Evil: 1", None)
    assert dict(weird.headers())[REVISION_HEADER_KEY] == b"v2X-Evil: 1"
    assert dict(weird.headers())[DIGEST_HEADER_KEY] == b""
    assert dict(Weights("", None).headers())[REVISION_HEADER_KEY] == b"unknown"


def test_probes_metrics_and_the_plugins_own_routes_are_not_gated() -> None:
    for path in ("/health", "/metrics", "/ping", "/v1/models", "/weightship/v1/loaded"):
        assert not gated(path)
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize"):
        assert gated(path)


def test_lifespan_passes_through_a_closed_gate() -> None:
    async def test() -> None:
        seen: list[str] = []

        async def app(scope: Any, receive: Any, send: Any) -> None:
            seen.append(scope["type"])

        gate = WeightsGate(V1)
        gate.close(60)
        mw = StampMiddleware(app, gate)

        async def nothing() -> dict[str, Any]:
            return {}

        async def drop(message: Any) -> None:
            return None

        await mw({"type": "lifespan"}, nothing, drop)
        assert seen == ["lifespan"]

    run(test)
