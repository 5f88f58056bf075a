"""Moving a bucket plan through a process group: the root's send loop and the receivers'
receive loop, one broadcast per bucket."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping

import torch

from weightship.seeding import transport
from weightship.seeding.buckets import BucketPlan, bucket_view, pack_bucket


def send_buckets(
    pg: transport.Group,
    plan: BucketPlan,
    tensors: Mapping[str, torch.Tensor],
    *,
    device: torch.device,
    timeout_s: float,
    sources: Mapping[int, torch.Tensor] | None = None,
    on_sent: Callable[[int], None] | None = None,
    window: int | None = None,
) -> None:
    """Broadcast every bucket from rank 0, in order.

    A bucket of a region in ``sources`` (region index -> its bytes, see ``region_views``)
    is sent straight from that memory. Any other bucket is packed into one of two staging
    buffers of ``plan.bucket_bytes`` on ``device``, while the previous one is on the wire.
    ``on_sent(n)`` runs once n buckets are out. ``window``: broadcasts on the wire at once
    at most (None: every bucket sent from ``sources`` is started at once, and ``on_sent``
    may run only once the backend has sent them all).
    """
    sources = sources or {}
    buffers: list[torch.Tensor] = []
    free: list[int] = []
    in_flight: deque[tuple[transport.Work, int | None]] = deque()
    sent = 0

    def finish_oldest() -> None:
        nonlocal sent
        work, slot = in_flight.popleft()
        transport.wait(work, timeout_s)
        if slot is not None:
            free.append(slot)
        sent += 1
        if on_sent is not None:
            on_sent(sent)

    for index, (start, end) in enumerate(plan.buckets):
        region = plan.region_of(start)
        slot = None
        if region in sources:
            offset = plan.regions[region][0]
            bucket = sources[region][start - offset : end - offset]
        else:
            if not buffers:
                buffers = [
                    torch.empty(plan.bucket_bytes, dtype=torch.uint8, device=device)
                    for _ in range(2)
                ]
                free = [0, 1]
            while not free:  # both buffers on the wire: the oldest must finish first
                finish_oldest()
            slot = free.pop()
            bucket = pack_bucket(plan, index, tensors, buffers[slot])
        while window is not None and len(in_flight) >= window:
            finish_oldest()
        in_flight.append((transport.start_broadcast(pg, bucket), slot))
    while in_flight:
        finish_oldest()


def receive_buckets(
    pg: transport.Group,
    plan: BucketPlan,
    arena: torch.Tensor,
    seconds_left: Callable[[], float],
    *,
    on_bucket: Callable[[int], None] | None = None,
) -> None:
    """Receive every bucket straight into its slice of ``arena``. All broadcasts are queued
    at once so the backend can overlap them; each wait is bounded by ``seconds_left()``.
    ``on_bucket(i)`` runs once bucket i is in, while later ones keep arriving."""
    works = [
        transport.start_broadcast(pg, bucket_view(plan, arena, i)) for i in range(len(plan.buckets))
    ]
    for index, work in enumerate(works):
        transport.wait(work, seconds_left())
        if on_bucket is not None:
            on_bucket(index)
