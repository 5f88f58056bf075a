"""EventPoster: events leave the reconcile workers, in order, bounded."""

from __future__ import annotations

import threading
from typing import Any

from weightship.controller import metrics
from weightship.controller.events import EventPoster

BODY: dict[str, Any] = {"metadata": {"name": "r", "namespace": "ns"}}


def test_events_are_posted_in_order_off_the_caller() -> None:
    posted: list[str] = []
    poster = EventPoster(lambda body, kind, reason, message: posted.append(reason), threads=1)
    for i in range(50):
        poster.submit(BODY, "Normal", f"R{i}", "m")
    poster.close()
    assert posted == [f"R{i}" for i in range(50)]


def test_a_full_queue_drops_and_counts_instead_of_waiting() -> None:
    release = threading.Event()
    poster = EventPoster(lambda *_: release.wait(5), threads=1, max_queue=2)
    before = metrics.EVENTS_DROPPED._value.get()
    for _ in range(10):  # one is being posted, two wait, the rest are dropped
        poster.submit(BODY, "Normal", "R", "m")
    dropped = metrics.EVENTS_DROPPED._value.get() - before
    release.set()
    poster.close()
    assert 7 <= dropped <= 8


def test_a_failing_post_does_not_stop_the_poster() -> None:
    posted: list[str] = []

    def post(body: dict[str, Any], kind: str, reason: str, message: str) -> None:
        if reason == "bad":
            raise RuntimeError("API server says no")
        posted.append(reason)

    poster = EventPoster(post, threads=1)
    for reason in ("a", "bad", "b"):
        poster.submit(BODY, "Normal", reason, "m")
    poster.close()
    assert posted == ["a", "b"]
