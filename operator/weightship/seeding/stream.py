"""Moving a bucket plan through a process group: the root's send loop and the receivers'
receive loop, one broadcast per bucket."""

from __future__ import annotations

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
    on_sent: Callable[[int], None] | None = None,
) -> None:
    """Broadcast every bucket from rank 0, packing the next bucket while the last is sent.

    Two staging buffers of ``plan.bucket_bytes`` on ``device`` are all the extra memory.
    ``on_sent(n)`` runs once n buckets are out.
    """
    buffers = [
        torch.empty(plan.bucket_bytes, dtype=torch.uint8, device=device)
        for _ in range(min(2, len(plan.buckets)))
    ]
    in_flight: list[transport.Work] = []
    sent = 0

    def finish_oldest() -> None:
        nonlocal sent
        transport.wait(in_flight.pop(0), timeout_s)
        sent += 1
        if on_sent is not None:
            on_sent(sent)

    for index in range(len(plan.buckets)):
        if len(in_flight) == len(buffers):  # the oldest buffer must be free to reuse
            finish_oldest()
        bucket = pack_bucket(plan, index, tensors, buffers[index % len(buffers)])
        in_flight.append(transport.start_broadcast(pg, bucket))
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
