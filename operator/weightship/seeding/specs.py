"""The manifest's tensor entries as bucket-plan specs, and the root's tensors checked
against them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from weightship.data.manifest import Manifest, TensorEntry
from weightship.seeding.buckets import TensorSpec
from weightship.seeding.errors import SeedingError

# safetensors dtype names (as the manifest records them) that torch can hold.
TORCH_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "F32": torch.float32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F64": torch.float64,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
}


def tensor_entries(manifest: Manifest) -> Sequence[TensorEntry]:
    """The manifest's tensors (each has a checksum); ``NoTensorChecksums`` when it lists
    none, as a manifest written before tensors were listed does."""
    if not manifest.tensors:
        raise SeedingError("NoTensorChecksums", "the manifest lists no tensors to verify")
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
