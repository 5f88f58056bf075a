"""An injected error rate, for test servers (echoserver, tinyllm): a canary with a bad
knob must fail its analysis every time, so failures are spread evenly, not at random."""

from __future__ import annotations

import threading


class ErrorInjector:
    """A rate (0..1) of requests get a 500, spread evenly and
    deterministically, so a canary with a bad knob fails analysis every time."""

    def __init__(self, rate: float) -> None:
        self.rate = min(max(rate, 0.0), 1.0)
        self.count = 0
        self.lock = threading.Lock()

    def next_fails(self) -> bool:
        with self.lock:
            self.count += 1
            return int(self.count * self.rate) > int((self.count - 1) * self.rate)
