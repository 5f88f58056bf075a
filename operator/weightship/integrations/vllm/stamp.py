"""Which weights made each response: a gate in front of vLLM's routes and the headers it
stamps (plain ASGI, asyncio only; no HTTP framework, no vLLM).

Every HTTP response carries ``X-Weightship-Revision`` and
``X-Weightship-Manifest-Digest``. A request that may reach the model (anything but the
paths in ``UNGATED``) is admitted through the gate, which hands it the weights serving at
that moment; its response is stamped with those. While a swap runs the gate is closed:
new requests wait (up to the swap's bound) and are admitted, after the swap, with the
weights then serving. The swap seals the gate before any parameter changes: a request
admitted before that and still running is cut from then on (a 503 if it has sent nothing
yet, else the end of its body), so no response is ever stamped with one revision and made
by the other. After a swap that left mixed weights the gate refuses (503) until a later
swap succeeds. A swap asked to hold until verified leaves the gate verifying: only the
verifier's requests (``X-Weightship-Verify``, checked by the caller's ``is_verifier``)
reach the new weights, the others wait as at a closed gate, until the verifier says
they passed (``verified``) or another swap begins. A request waits at most the swap's
``maxHoldSeconds`` (then a 503, reason HoldTimeout); the gate measures each hold, from its
closing to its opening to every request (``last_held_s``), which is what a client of a
pod swapping in traffic waited at most.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from weightship.api.inference import VERIFY_HEADER, FailureReason
from weightship.integrations.serving import (
    DIGEST_HEADER_KEY,
    REVISION_HEADER_KEY,
    GateMode,
    Refused,
    Weights,
)

# Paths that never run the model: answered at once, even during a swap (probes, metrics,
# the plugin's own routes), stamped with the weights serving now.
UNGATED = frozenset({"/health", "/ping", "/metrics", "/version", "/v1/models", "/load"})
UNGATED_PREFIXES = ("/weightship/",)
# Requests waiting at a closed gate beyond this many are answered 503 at once.
MAX_HELD = 1024

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


@dataclass(frozen=True)
class Ticket:
    """An admitted request: the weights its response is stamped with, and the gate's
    epoch when it came in (a later seal makes it stale)."""

    epoch: int
    weights: Weights


class WeightsGate:
    def __init__(self, weights: Weights, clock: Callable[[], float] = time.monotonic) -> None:
        self.weights = weights
        self.epoch = 0
        self.mode: GateMode = "open"
        self.refusal = Refused(503, FailureReason.SWAP_IN_PROGRESS, "the weights are being swapped")
        self._clock = clock
        self._hold_until = 0.0
        self._opened = asyncio.Event()
        self._opened.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self.in_flight = 0
        self.held = 0
        self.max_hold_s: float | None = None  # per request, from the swap that closed it
        self._holding_since: float | None = None
        self.last_held_s: float | None = None
        """How long the last hold lasted: closed (a swap began) to open to every request."""

    # -- requests ------------------------------------------------------------------------

    async def admit(self, verifier: Callable[[], bool] | None = None) -> Ticket | Refused:
        """``verifier``: whether the request is the verifier's for the weights the gate
        verifies (asked whenever it verifies: a request held through a swap is asked about
        the weights that swap brought)."""
        arrived = self._clock()
        while True:
            if self.mode == "open" or (
                self.mode == "verifying" and verifier is not None and verifier()
            ):
                self.in_flight += 1
                self._idle.clear()
                return Ticket(self.epoch, self.weights)
            if self.mode == "refusing":
                return self.refusal
            now = self._clock()
            remaining = self._hold_until - now
            if self.max_hold_s is not None and arrived + self.max_hold_s - now <= 0:
                return Refused(
                    503,
                    FailureReason.HOLD_TIMEOUT,
                    f"held {self.max_hold_s:.0f} s (the swap's maxHoldSeconds) while this "
                    "server swapped its weights in place and verified them: send it again",
                )
            if self.max_hold_s is not None:
                remaining = min(remaining, arrived + self.max_hold_s - now)
            if remaining <= 0 and self.mode == "verifying":
                return Refused(
                    503, "Verifying", "held while the new weights are verified, for too long"
                )
            if remaining <= 0:
                return Refused(
                    503,
                    FailureReason.SWAP_IN_PROGRESS,
                    "held for the whole of a swap that has not ended",
                )
            if self.held >= MAX_HELD:
                return Refused(
                    503, FailureReason.SWAP_IN_PROGRESS, "too many requests wait for a swap"
                )
            self.held += 1
            try:
                await asyncio.wait_for(self._opened.wait(), remaining)
            except TimeoutError:
                pass
            finally:
                self.held -= 1

    def release(self, ticket: Ticket) -> None:
        self.in_flight -= 1
        if self.in_flight <= 0:
            self.in_flight = 0
            self._idle.set()

    def is_stale(self, ticket: Ticket) -> bool:
        return ticket.epoch < self.epoch

    # -- the swap ------------------------------------------------------------------------

    def close(self, hold_seconds: float, max_hold_s: float | None = None) -> None:
        """New requests wait, up to ``hold_seconds`` from now, each at most ``max_hold_s``.
        A hold that began before (a swap back after failed checks) goes on."""
        self.mode = "closed"
        self._hold_until = self._clock() + hold_seconds
        self.max_hold_s = max_hold_s
        if self._holding_since is None:
            self._holding_since = self._clock()
        self._opened.clear()

    def _hold_ended(self) -> None:
        if self._holding_since is not None:
            self.last_held_s = self._clock() - self._holding_since
            self._holding_since = None

    async def wait_idle(self, seconds: float) -> bool:
        """True once every admitted request is done, False after ``seconds``."""
        if self.in_flight == 0:
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), max(0.0, seconds))
        except TimeoutError:
            return self.in_flight == 0
        return True

    def seal(self) -> None:
        """Before any parameter changes: every request admitted so far is stale."""
        self.epoch += 1

    def open(self, weights: Weights) -> None:
        self.weights = weights
        self.mode = "open"
        self._hold_ended()
        self._opened.set()

    def verifying(self, weights: Weights, hold_seconds: float) -> None:
        """The swap is done: ``weights`` serve the verifier's requests only, until
        ``verified``; the others wait (still), up to ``hold_seconds`` from now."""
        self.weights = weights
        self.mode = "verifying"
        self._hold_until = self._clock() + hold_seconds
        # Wake the held requests to look again (the verifier's goes through), and let the
        # others wait on a fresh event.
        woken, self._opened = self._opened, asyncio.Event()
        woken.set()

    def verified(self, digest: str) -> bool:
        """The verifier passed ``digest``: open, if those are the weights it was verifying.
        Whether the gate is open with them now."""
        if self.mode == "verifying" and self.weights.manifest_digest == digest:
            self.open(self.weights)
        return self.mode == "open" and self.weights.manifest_digest == digest

    def refuse(self, reason: str, message: str) -> None:
        """No request is served (the weights are mixed) until ``open``."""
        self.refusal = Refused(503, reason, message)
        self.mode = "refusing"
        self._hold_ended()
        self._opened.set()  # the held ones are answered now


def asgi_header(scope: Scope, name: str) -> str | None:
    """The first value of header ``name``, decoded as latin-1."""
    wanted = name.lower().encode("ascii")
    for key, value in scope.get("headers") or []:
        if bytes(key).lower() == wanted:
            return bytes(value).decode("latin-1")
    return None


def gated(path: str) -> bool:
    return path not in UNGATED and not path.startswith(UNGATED_PREFIXES)


def _stamped(message: Message, weights: Weights) -> Message:
    drop = {REVISION_HEADER_KEY, DIGEST_HEADER_KEY}
    headers = [(k, v) for k, v in message.get("headers") or [] if bytes(k).lower() not in drop]
    return {**message, "headers": [*headers, *weights.headers()]}


def _refusal_messages(refused: Refused, weights: Weights) -> list[Message]:
    body = json.dumps(
        {
            "error": {"message": refused.message, "type": "ServiceUnavailable", "code": 503},
            "reason": refused.reason,
        }
    ).encode()
    start = {
        "type": "http.response.start",
        "status": refused.status,
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"retry-after", b"1"),
        ],
    }
    return [_stamped(start, weights), {"type": "http.response.body", "body": body}]


class StampMiddleware:
    """ASGI middleware: the gate, and the two headers on every HTTP response."""

    def __init__(
        self,
        app: ASGIApp,
        gate: WeightsGate,
        is_verifier: Callable[[str | None], bool] | None = None,
    ) -> None:
        self.app = app
        self.gate = gate
        self.is_verifier = is_verifier  # given X-Weightship-Verify (None: absent)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        gate = self.gate
        if not gated(str(scope.get("path", ""))):

            async def send_now(message: Message) -> None:
                if message.get("type") == "http.response.start":
                    message = _stamped(message, gate.weights)
                await send(message)

            await self.app(scope, receive, send_now)
            return

        is_verifier, header = self.is_verifier, asgi_header(scope, VERIFY_HEADER)
        verifier = None
        if is_verifier is not None and header is not None:

            def verifier() -> bool:
                return is_verifier(header)

        admitted = await gate.admit(verifier)
        if isinstance(admitted, Refused):
            for message in _refusal_messages(admitted, gate.weights):
                await send(message)
            return
        ticket = admitted
        started = cut = False

        async def send_checked(message: Message) -> None:
            nonlocal started, cut
            kind = message.get("type")
            if cut or kind not in ("http.response.start", "http.response.body"):
                if not cut:
                    await send(message)
                return
            if gate.is_stale(ticket):
                cut = True
                if not started:
                    stale = Refused(
                        503,
                        FailureReason.WEIGHTS_CHANGED,
                        "the weights were swapped during this request",
                    )
                    for refusal in _refusal_messages(stale, gate.weights):
                        await send(refusal)
                else:
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            if kind == "http.response.start":
                started = True
                message = _stamped(message, ticket.weights)
            await send(message)

        try:
            await self.app(scope, receive, send_checked)
        finally:
            gate.release(ticket)
