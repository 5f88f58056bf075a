"""The byte layout a broadcast uses: every tensor at an offset of one flat "arena", made of
regions, each cut into fixed-size buckets, one broadcast per bucket.

Root and receivers compute the same plan from the manifest, so nothing about the layout
travels on the wire. For a model, each safetensors file is one region laid out as the file
is (``plan_files``): a root that loaded with ``weightship.loader`` (one buffer per file)
already holds every bucket contiguously and broadcasts views of its memory, with no copy.
Other roots pack each bucket into a staging buffer (``pack_bucket``), so they need only
bucket-sized extra memory, never a second copy of the model. A receiver allocates the whole
arena once and receives each bucket straight into its slice: its tensors are views of the
arena (or, for the rare tensor misaligned for its dtype, a copy).

Fixed cuts split big tensors across buckets and pack small ones together, so every
broadcast but a region's last moves exactly ``bucket_bytes``.
"""

from __future__ import annotations

import bisect
import itertools
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
    placements: tuple[Placement, ...]  # sorted by offset
    regions: tuple[tuple[int, int], ...]  # arena ranges; no bucket spans two
    bucket_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.regions[-1][1] if self.regions else 0

    @property
    def payload_bytes(self) -> int:
        """Tensor bytes, without alignment padding."""
        return sum(p.spec.nbytes for p in self.placements)

    @cached_property
    def buckets(self) -> tuple[tuple[int, int], ...]:
        """Arena ranges [start, end) of the buckets, in broadcast order."""
        size = self.bucket_bytes
        return tuple(
            (s, min(s + size, end)) for start, end in self.regions for s in range(start, end, size)
        )

    def region_of(self, offset: int) -> int:
        """The index of the region holding arena byte ``offset``."""
        return bisect.bisect_right([start for start, _ in self.regions], offset) - 1

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
        return max(0, bisect.bisect_right(self._bucket_starts, max(p.offset, p.end - 1)) - 1)

    @cached_property
    def _bucket_starts(self) -> list[int]:
        return [start for start, _ in self.buckets]

    @cached_property
    def _by_name(self) -> dict[str, Placement]:
        return {p.spec.name: p for p in self.placements}


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def dtype_itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class FileSpan:
    """A file's size and its tensors at their byte offsets in it."""

    size: int
    tensors: tuple[tuple[TensorSpec, int], ...]


def plan_buckets(
    specs: Iterable[TensorSpec], bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> BucketPlan:
    """Pack ``specs`` in the given order at aligned offsets into one region."""
    placements: list[Placement] = []
    offset = 0
    for spec in specs:
        offset = align_up(offset)
        placements.append(Placement(spec, offset))
        offset += spec.nbytes
    return _checked(placements, ((0, offset),) if offset else (), bucket_bytes)


def plan_files(files: Iterable[FileSpan], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> BucketPlan:
    """One region per file, at an aligned base, holding the file's bytes where the file has
    them: a tensor's alignment in the arena is its alignment in a buffer of the file."""
    placements: list[Placement] = []
    regions: list[tuple[int, int]] = []
    base = 0
    for f in files:
        for spec, offset in f.tensors:
            if offset < 0 or offset + spec.nbytes > f.size:
                raise ValueError(f"tensor {spec.name!r} lies outside its {f.size}-byte file")
            placements.append(Placement(spec, base + offset))
        if f.size:
            regions.append((base, base + f.size))
        base = align_up(base + f.size)
    return _checked(placements, tuple(regions), bucket_bytes)


def _checked(
    placements: list[Placement], regions: tuple[tuple[int, int], ...], bucket_bytes: int
) -> BucketPlan:
    if bucket_bytes <= 0 or bucket_bytes % ALIGN:
        raise ValueError(f"bucket_bytes must be a positive multiple of {ALIGN}, got {bucket_bytes}")
    placements.sort(key=lambda p: (p.offset, p.end))
    names = [p.spec.name for p in placements]
    if len(set(names)) != len(names):
        raise ValueError(f"a tensor name appears twice: {sorted(names)}")
    for before, after in itertools.pairwise(placements):
        if after.offset < before.end:
            raise ValueError(f"tensors {before.spec.name!r} and {after.spec.name!r} overlap")
    return BucketPlan(tuple(placements), regions, bucket_bytes)


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


def tensor_at(placement: Placement, arena: torch.Tensor) -> torch.Tensor:
    """The tensor with its dtype and shape: a view of ``arena``, or a copy when its offset
    is not a multiple of its element size (files may pack a 2-byte tensor at an odd byte)."""
    raw = arena[placement.offset : placement.end]
    if placement.offset % dtype_itemsize(placement.spec.dtype):
        raw = raw.clone()
    return raw.view(placement.spec.dtype).view(placement.spec.shape)


def unpack(plan: BucketPlan, arena: torch.Tensor) -> dict[str, torch.Tensor]:
    """Named tensors with their dtype and shape, as views of ``arena`` where aligned."""
    return {p.spec.name: tensor_at(p, arena) for p in plan.placements}


def region_views(plan: BucketPlan, tensors: Mapping[str, torch.Tensor]) -> dict[int, torch.Tensor]:
    """For each region whose tensors already sit in one buffer at the plan's relative
    offsets (a loader's per-file buffer), a flat uint8 view of that buffer's range: the
    root broadcasts slices of it without packing."""
    members: dict[int, list[Placement]] = {}
    for p in plan.placements:
        if p.spec.nbytes:
            members.setdefault(plan.region_of(p.offset), []).append(p)
    views = {}
    for index, placements in members.items():
        view = _buffer_view(placements, plan.regions[index], tensors)
        if view is not None:
            views[index] = view
    return views


def _buffer_view(
    placements: list[Placement], region: tuple[int, int], tensors: Mapping[str, torch.Tensor]
) -> torch.Tensor | None:
    start, end = region
    first = tensors[placements[0].spec.name]
    storage = first.untyped_storage()

    def base_of(p: Placement, t: torch.Tensor) -> int:
        """Where the region would start in the storage, going by this tensor."""
        return int(t.storage_offset()) * t.element_size() - (p.offset - start)

    base = base_of(placements[0], first)
    for p in placements:
        t = tensors[p.spec.name]
        if not t.is_contiguous() or t.untyped_storage().data_ptr() != storage.data_ptr():
            return None
        if base_of(p, t) != base:
            return None
    if base < 0 or base + (end - start) > storage.nbytes():
        return None
    flat = torch.empty(0, dtype=torch.uint8, device=first.device)
    return flat.set_(storage, base, (end - start,), (1,))


def pack_all(
    plan: BucketPlan, tensors: Mapping[str, torch.Tensor], device: str | torch.device = "cpu"
) -> torch.Tensor:
    """The whole arena for ``tensors`` (tests and benchmarks; the root packs per bucket)."""
    arena = torch.zeros(plan.total_bytes, dtype=torch.uint8, device=device)
    for i, (start, _) in enumerate(plan.buckets):
        pack_bucket(plan, i, tensors, arena[start:])
    return arena
