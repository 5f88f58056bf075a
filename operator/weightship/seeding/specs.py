"""The manifest's tensor entries as bucket-plan specs, and the root's tensors checked
against them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from weightship.api.inference import FailureReason
from weightship.loader.load import TORCH_DTYPES
from weightship.seeding.buckets import BucketPlan, FileSpan, TensorSpec, plan_files
from weightship.seeding.errors import SeedingError
from weightship.weightformat.entries import TensorEntry
from weightship.weightformat.manifest import Manifest


def tensor_entries(manifest: Manifest) -> Sequence[TensorEntry]:
    """The manifest's tensors (each has a checksum); ``NoTensorChecksums`` when it lists
    none, as a manifest written before tensors were listed does."""
    if not manifest.tensors:
        raise SeedingError(
            FailureReason.NO_TENSOR_CHECKSUMS, "the manifest lists no tensors to verify"
        )
    return manifest.tensors


def spec_of(entry: TensorEntry) -> TensorSpec:
    dtype = TORCH_DTYPES.get(entry.dtype)
    if dtype is None:
        raise ValueError(f"tensor {entry.name!r}: dtype {entry.dtype} cannot be broadcast")
    spec = TensorSpec(entry.name, dtype, tuple(entry.shape))
    if spec.nbytes != entry.size:
        raise ValueError(f"tensor {entry.name!r}: {entry.size} bytes, shape says {spec.nbytes}")
    return spec


def specs_of(entries: Sequence[TensorEntry]) -> list[TensorSpec]:
    return [spec_of(e) for e in entries]


def plan_for(manifest: Manifest, bucket_bytes: int) -> BucketPlan:
    """The broadcast plan of a model: each file that holds tensors is one region, laid out
    as the file (raises ``NoTensorChecksums`` when the manifest lists no tensors)."""
    entries = tensor_entries(manifest)
    return plan_files(
        (
            FileSpan(f.size, tuple((spec_of(e), e.offset) for e in manifest.tensors_of(f.path)))
            for f in manifest.files
            if any(e.file == f.path for e in entries)
        ),
        bucket_bytes,
    )


def check_tensors(specs: Sequence[TensorSpec], tensors: Mapping[str, torch.Tensor]) -> None:
    """Raise ValueError unless ``tensors`` holds every spec with its dtype and shape."""
    for spec in specs:
        t = tensors.get(spec.name)
        if t is None:
            raise ValueError(f"tensor {spec.name!r} of the manifest is not loaded")
        if t.dtype != spec.dtype or tuple(t.shape) != spec.shape:
            raise ValueError(
                f"tensor {spec.name!r} is {t.dtype}{tuple(t.shape)}, "
                f"the manifest says {spec.dtype}{spec.shape}"
            )
