"""Which weights made each proxied response: the adapter's gate (threads; the vLLM
plugin's ``stamp.WeightsGate`` is the asyncio one, with the same rules).

A request that reaches the model is admitted through the gate, which hands it the weights
serving at that moment; its response is stamped with those
(``X-Weightship-Revision``, ``X-Weightship-Manifest-Digest``). While a swap runs the gate
is closed: new requests wait (up to the swap's bound) and are admitted after it with the
weights then serving. Before any weight changes the swap seals the gate: a request
admitted before that and still running is cut (a 503 if nothing was sent yet, else its
connection is closed mid-body), so no response is stamped with one revision and made by
the other. After a swap that left mixed weights the gate refuses (503) until a later swap
succeeds. A swap asked to hold until verified leaves the gate verifying: the verifier's
requests reach the new weights, the others wait as at a closed gate until ``verified``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from weightship.api.inference import FailureReason
from weightship.integrations.serving import GateMode, Refused, Weights


@dataclass(eq=False)
class Ticket:
    """An admitted request: the weights its response is stamped with."""

    weights: Weights
    cut: bool = False
    _on_cut: Callable[[], None] | None = field(default=None, repr=False)

    def on_cut(self, action: Callable[[], None]) -> None:
        """Run ``action`` (e.g. shut the upstream socket) when the gate cuts this request."""
        self._on_cut = action
        if self.cut:
            action()


class Gate:
    def __init__(self, weights: Weights, clock: Callable[[], float] = time.monotonic) -> None:
        self.weights = weights
        self.mode: GateMode = "open"
        self.refusal: Refused | None = None
        self._clock = clock
        self._cond = threading.Condition()
        self._in_flight: set[Ticket] = set()
        self._hold_until = 0.0

    @property
    def in_flight(self) -> int:
        with self._cond:
            return len(self._in_flight)

    def admit(self, verifier: Callable[[], bool] | None = None) -> Ticket | Refused:
        """A ticket with the weights serving now; while closed, or verifying and this is
        not the verifier's request (``verifier``, asked whenever the gate verifies),
        waits (at most the swap's bound)."""

        def held() -> bool:
            if self.mode == "verifying":
                return verifier is None or not verifier()
            return self.mode == "closed"

        with self._cond:
            while held():
                remaining = self._hold_until - self._clock()
                if remaining <= 0 and self.mode == "verifying":
                    return Refused(503, "Verifying", "the new weights are being verified")
                if remaining <= 0:
                    return Refused(
                        503, FailureReason.SWAP_IN_PROGRESS, "the weights are being swapped"
                    )
                self._cond.wait(remaining)
            if self.mode == "refusing":
                return self.refusal or Refused(503, "Refusing", "the weights are not known good")
            ticket = Ticket(self.weights)
            self._in_flight.add(ticket)
            return ticket

    def release(self, ticket: Ticket) -> None:
        with self._cond:
            self._in_flight.discard(ticket)
            self._cond.notify_all()

    def close(self, hold_s: float) -> None:
        """New requests wait, at most ``hold_s`` from now."""
        with self._cond:
            self.mode = "closed"
            self._hold_until = self._clock() + hold_s

    def wait_idle(self, timeout: float) -> bool:
        """True once no admitted request is in flight, False when ``timeout`` passed."""
        deadline = self._clock() + timeout
        with self._cond:
            while self._in_flight:
                remaining = deadline - self._clock()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return True

    def seal(self) -> int:
        """Cut every request still in flight; how many were."""
        with self._cond:
            cut = list(self._in_flight)
            self._in_flight.clear()
            for ticket in cut:
                ticket.cut = True
            self._cond.notify_all()
        for ticket in cut:
            if ticket._on_cut is not None:
                with contextlib.suppress(OSError):  # its connection is gone already
                    ticket._on_cut()
        return len(cut)

    def open(self, weights: Weights) -> None:
        with self._cond:
            self.weights = weights
            self.mode = "open"
            self.refusal = None
            self._cond.notify_all()

    def verifying(self, weights: Weights, hold_s: float) -> None:
        """The swap is done: ``weights`` serve the verifier only, until ``verified``; the
        other requests wait, at most ``hold_s`` from now."""
        with self._cond:
            self.weights = weights
            self.mode = "verifying"
            self._hold_until = self._clock() + hold_s
            self._cond.notify_all()

    def verified(self, digest: str) -> bool:
        """The verifier passed ``digest``: open, if those are the weights it verifies.
        Whether the gate is open with them now."""
        with self._cond:
            if self.mode == "verifying" and self.weights.manifest_digest == digest:
                self.mode = "open"
                self._cond.notify_all()
            return self.mode == "open" and self.weights.manifest_digest == digest

    def refuse(self, reason: str, message: str) -> None:
        with self._cond:
            self.mode = "refusing"
            self.refusal = Refused(503, reason, message)
            self._cond.notify_all()
