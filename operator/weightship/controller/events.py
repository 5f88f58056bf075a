"""Kubernetes Events of the rollouts, posted off the reconcile workers.

An Event is a record for people (status is the memory), and its POST cost a reconcile as
much API time as the status patch (bench_scale's profile: 16 % of the workers' time at
100 rollouts, against 21 % for status). So the reconcile queues them here, after its
status write succeeded (a 409 retries without duplicates), and two threads post them in
order. The queue is bounded: when the API server is that far behind, events are dropped
and counted (weightship_events_dropped_total), never waited for.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from weightship.controller import metrics

log = logging.getLogger(__name__)

Post = Callable[[dict[str, Any], str, str, str], object]  # (rollout body, type, reason, message)


class EventPoster:
    def __init__(self, post: Post, threads: int = 2, max_queue: int = 2000) -> None:
        self.post = post
        self.queue: queue.Queue[tuple[dict[str, Any], str, str, str] | None] = queue.Queue(
            maxsize=max_queue
        )
        self.threads = [
            threading.Thread(target=self._drain, name=f"events-{i}", daemon=True)
            for i in range(threads)
        ]
        for thread in self.threads:
            thread.start()

    def submit(self, rollout: dict[str, Any], kind: str, reason: str, message: str) -> None:
        try:
            self.queue.put_nowait((rollout, kind, reason, message))
        except queue.Full:
            metrics.EVENTS_DROPPED.inc()

    def close(self, timeout_s: float = 5.0) -> None:
        for _thread in self.threads:
            try:
                self.queue.put(None, timeout=timeout_s)
            except queue.Full:
                break
        for thread in self.threads:
            thread.join(timeout_s)

    def _drain(self) -> None:
        while (item := self.queue.get()) is not None:
            try:
                self.post(*item)
            except Exception as e:  # best effort: the rollout goes on
                log.warning("posting an event for %s failed: %s", item[0]["metadata"]["name"], e)
