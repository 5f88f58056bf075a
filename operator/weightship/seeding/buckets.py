"""The byte layout a broadcast uses: every tensor at an aligned offset of one flat "arena",
cut into fixed-size buckets, one broadcast per bucket.

Root and receivers compute the same plan from the manifest (tensors in manifest order), so
nothing about the layout travels on the wire. A receiver allocates the whole arena once and
receives each bucket straight into its slice: its tensors are views of the arena, with no
copy after the network. The root holds its tensors wherever its loader put them and packs
one bucket at a time into a small staging buffer, so it needs only bucket-sized extra
memory (it may already be using all of its GPU for the model).

Fixed cuts split big tensors across buckets and pack small ones together, so every
broadcast but the last moves exactly ``bucket_bytes``.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property

import torch

DEFAULT_BUCKET_BYTES = 64 * 1024 * 1024
# Offsets are aligned so that `view(dtype)` of an arena slice is legal for every dtype and
# kernels read aligned vectors; 64 bytes also keeps tensors off each other's cache lines.
ALIGN = 64


@dataclass(frozen=True)
class TensorSpec:
    """What a tensor is, without its bytes."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * dtype_itemsize(self.dtype)

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorSpec:
        return cls(name, tensor.dtype, tuple(tensor.shape))


@dataclass(frozen=True)
class Placement:
    """Where a tensor's bytes sit in the arena."""

    spec: TensorSpec
    offset: int

    @property
    def end(self) -> int:
        return self.offset + self.spec.nbytes


@dataclass(frozen=True)
class Piece:
    """The part of one tensor that falls in one bucket."""

    name: str
    tensor_start: int  # byte offset inside the tensor
    bucket_start: int  # byte offset inside the bucket
    length: int


@dataclass(frozen=True)
class BucketPlan:
    placements: tuple[Placement, ...]
    bucket_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.placements[-1].end if self.placements else 0

    @property
    def payload_bytes(self) -> int:
        """Tensor bytes, without alignment padding."""
        return sum(p.spec.nbytes for p in self.placements)

    @cached_property
    def buckets(self) -> tuple[tuple[int, int], ...]:
        """Arena ranges [start, end) of the buckets, in broadcast order."""
        total, size = self.total_bytes, self.bucket_bytes
        return tuple((s, min(s + size, total)) for s in range(0, total, size))

    @cached_property
    def _ends(self) -> list[int]:
        return [p.end for p in self.placements]

    def pieces(self, index: int) -> list[Piece]:
        """The tensor byte ranges that bucket ``index`` carries."""
        start, end = self.buckets[index]
        found = []
        # First placement ending after `start`; placements are sorted and disjoint.
        for p in self.placements[bisect.bisect_right(self._ends, start) :]:
            if p.offset >= end:
                break
            lo, hi = max(p.offset, start), min(p.end, end)
            if hi > lo:
                found.append(Piece(p.spec.name, lo - p.offset, lo - start, hi - lo))
        return found

    def last_bucket_of(self, name: str) -> int:
        """The bucket holding the last byte of tensor ``name`` (it is complete after it)."""
        p = self._by_name[name]
        return max(0, (p.end - 1) // self.bucket_bytes)

    @cached_property
    def _by_name(self) -> dict[str, Placement]:
        return {p.spec.name: p for p in self.placements}


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def dtype_itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def plan_buckets(
    specs: Iterable[TensorSpec], bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> BucketPlan:
    """Lay ``specs`` out in the given order at aligned offsets, cut in ``bucket_bytes``."""
    if bucket_bytes <= 0 or bucket_bytes % ALIGN:
        raise ValueError(f"bucket_bytes must be a positive multiple of {ALIGN}, got {bucket_bytes}")
    placements: list[Placement] = []
    seen: set[str] = set()
    offset = 0
    for spec in specs:
        if spec.name in seen:
            raise ValueError(f"tensor {spec.name!r} appears twice")
        seen.add(spec.name)
        offset = align_up(offset)
        placements.append(Placement(spec, offset))
        offset += spec.nbytes
    return BucketPlan(tuple(placements), bucket_bytes)


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor on its device (a view when contiguous)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def pack_bucket(
    plan: BucketPlan, index: int, tensors: Mapping[str, torch.Tensor], out: torch.Tensor
) -> torch.Tensor:
    """Copy bucket ``index``'s bytes into the front of ``out`` (uint8, 1-D); return that slice.

    Padding bytes between tensors are left as they are: no tensor covers them.
    """
    start, end = plan.buckets[index]
    bucket = out[: end - start]
    for piece in plan.pieces(index):
        src = byte_view(tensors[piece.name])[piece.tensor_start : piece.tensor_start + piece.length]
        bucket[piece.bucket_start : piece.bucket_start + piece.length].copy_(src)
    return bucket


def new_arena(plan: BucketPlan, device: str | torch.device = "cpu") -> torch.Tensor:
    return torch.empty(plan.total_bytes, dtype=torch.uint8, device=device)


def bucket_view(plan: BucketPlan, arena: torch.Tensor, index: int) -> torch.Tensor:
    start, end = plan.buckets[index]
    return arena[start:end]


def unpack(plan: BucketPlan, arena: torch.Tensor) -> dict[str, torch.Tensor]:
    """Named tensors with their dtype and shape, as views of ``arena`` (no copy)."""
    out = {}
    for p in plan.placements:
        raw = arena[p.offset : p.end]
        out[p.spec.name] = raw.view(p.spec.dtype).view(p.spec.shape)
    return out


def pack_all(
    plan: BucketPlan, tensors: Mapping[str, torch.Tensor], device: str | torch.device = "cpu"
) -> torch.Tensor:
    """The whole arena for ``tensors`` (tests and benchmarks; the root packs per bucket)."""
    arena = torch.zeros(plan.total_bytes, dtype=torch.uint8, device=device)
    for i, (start, _) in enumerate(plan.buckets):
        pack_bucket(plan, i, tensors, arena[start:])
    return arena
