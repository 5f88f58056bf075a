"""Safetensors headers, parsed in pure Python: where each tensor's bytes lie in its file.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON, then the
data area. The JSON maps tensor names to ``{"dtype", "shape", "data_offsets": [b, e]}``
with offsets relative to the data area, plus an optional ``__metadata__`` of strings.
We turn those into offsets relative to the start of the file, so a tensor's bytes can be
read, hashed or sent without knowing about the header.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LENGTH_PREFIX = 8
# The reference implementation refuses headers over 100 MB; so do we, before reading one.
MAX_HEADER_BYTES = 100_000_000
METADATA_KEY = "__metadata__"
Buffer = bytes | bytearray | memoryview

# Bits per element. Sub-byte types (F4, F6_*) pack elements, so a tensor's size is its
# element count times these bits, which must be a whole number of bytes.
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E5M2FNUZ": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E8M0": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "I64": 64,
    "U64": 64,
    "F64": 64,
    "C64": 64,
}


class LayoutError(ValueError):
    """A safetensors header is malformed or does not fit its file."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor: its bytes are ``[start, end)`` of the file (header included)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class FileLayout:
    """A parsed header: tensors in file order, the data area's start, the file's size."""

    tensors: tuple[TensorInfo, ...]
    data_start: int
    file_size: int
    metadata: dict[str, str] = field(default_factory=dict)

    def by_name(self) -> dict[str, TensorInfo]:
        return {t.name: t for t in self.tensors}


def tensor_nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    """Bytes taken by a tensor of ``dtype`` and ``shape``; LayoutError when impossible."""
    bits = DTYPE_BITS.get(dtype)
    if bits is None:
        raise LayoutError(f"unknown dtype {dtype!r}")
    total_bits = math.prod(shape) * bits
    if total_bits % 8:
        raise LayoutError(f"{dtype} tensor of shape {list(shape)} is not a whole number of bytes")
    return total_bits // 8


def header_length(prefix: Buffer) -> int:
    """The JSON header's length from the first 8 bytes of a file."""
    if len(prefix) < LENGTH_PREFIX:
        raise LayoutError(f"file is {len(prefix)} bytes, too short for a safetensors header")
    (n,) = struct.unpack_from("<Q", prefix)
    if n > MAX_HEADER_BYTES:
        raise LayoutError(f"header length {n} exceeds the {MAX_HEADER_BYTES} byte limit")
    return int(n)


def parse_header(prefix: Buffer, file_size: int | None = None) -> FileLayout:
    """Parse the header at the start of ``prefix``.

    ``prefix`` holds at least the first 8 + N bytes of the file. ``file_size`` is the
    whole file's size; by default ``prefix`` is taken to be the whole file.
    """
    size = len(prefix) if file_size is None else file_size
    n = header_length(prefix)
    data_start = LENGTH_PREFIX + n
    if data_start > size:
        raise LayoutError(f"header length {n} runs past the end of the {size} byte file")
    if len(prefix) < data_start:
        raise LayoutError(f"need the first {data_start} bytes to parse the header")
    try:
        raw = bytes(prefix[LENGTH_PREFIX:data_start]).decode("utf-8")
        doc = json.loads(raw, object_pairs_hook=_no_duplicate_keys)
    except (UnicodeDecodeError, ValueError) as exc:
        raise LayoutError(f"header is not valid UTF-8 JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise LayoutError("header is not a JSON object")
    metadata = _metadata(doc.pop(METADATA_KEY, None))
    tensors = sorted(
        (_tensor(name, entry, data_start) for name, entry in doc.items()),
        key=lambda t: (t.start, t.end),
    )
    _check_tiling(tensors, data_start, size)
    return FileLayout(tuple(tensors), data_start, size, metadata)


def read_layout(path: Path) -> FileLayout:
    """Read and parse the header of the safetensors file at ``path``."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        prefix = f.read(LENGTH_PREFIX)
        try:
            prefix += f.read(min(header_length(prefix), size))
            return parse_header(prefix, size)
        except LayoutError as exc:
            raise LayoutError(f"{path}: {exc}") from exc


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise LayoutError(f"duplicate key {key!r} in header")
        out[key] = value
    return out


def _metadata(value: object) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise LayoutError(f"{METADATA_KEY} must map strings to strings")
    return dict(value)


def _tensor(name: str, entry: object, data_start: int) -> TensorInfo:
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise LayoutError(f"tensor {name!r}: expected exactly dtype, shape and data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str):
        raise LayoutError(f"tensor {name!r}: dtype must be a string")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise LayoutError(f"tensor {name!r}: shape must be a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets))):
        raise LayoutError(f"tensor {name!r}: data_offsets must be two non-negative integers")
    begin, end = offsets
    if end < begin:
        raise LayoutError(f"tensor {name!r}: data_offsets end {end} is before begin {begin}")
    try:
        want = tensor_nbytes(dtype, tuple(shape))
    except LayoutError as exc:
        raise LayoutError(f"tensor {name!r}: {exc}") from exc
    if end - begin != want:
        raise LayoutError(
            f"tensor {name!r}: {dtype} {shape} needs {want} bytes, data_offsets span {end - begin}"
        )
    return TensorInfo(name, dtype, tuple(shape), data_start + begin, data_start + end)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_tiling(tensors: list[TensorInfo], data_start: int, file_size: int) -> None:
    """Tensors must cover the data area exactly: no overlap, no gap, nothing past the end.

    A gap would be bytes no tensor accounts for (the format forbids them, so that a file
    cannot hide a second payload); an overlap would let two tensors alias one another.
    """
    at = data_start
    for t in tensors:
        if t.start < at:
            raise LayoutError(f"tensor {t.name!r} at [{t.start}, {t.end}) overlaps the one before")
        if t.start > at:
            raise LayoutError(f"bytes [{at}, {t.start}) before tensor {t.name!r} belong to none")
        at = t.end
    if at > file_size:
        raise LayoutError(f"tensors end at byte {at}, past the end of the {file_size} byte file")
    if at < file_size:
        raise LayoutError(f"bytes [{at}, {file_size}) after the last tensor belong to none")
