"""Bounds on what a manifest may claim, checked before anything is built from it, and on
how much of a bad document an error quotes.

The operator and every agent parse manifests read from S3, so one hostile document must
fail fast with a ManifestError instead of taking the process's memory. The bounds sit far
above any real model (1M chunks is 16 TiB at the default chunk size).
"""

from __future__ import annotations

from pydantic import ValidationError

MAX_MANIFEST_BYTES = 256 * 1024 * 1024
MAX_FILES = 100_000
MAX_CHUNKS = 1_000_000
MAX_TENSORS = 1_000_000
MAX_CHUNK_SIZE = 4 * 1024**3
MAX_PIECES = 8 * 1024 * 1024  # the piece layer is at most 256 MiB (32 bytes a piece)
MAX_FILE_BYTES = 2**50  # 1 PiB; the sum stays an exact int64 and float64 in status
MAX_PATH_BYTES = 1024
MAX_SEGMENT_BYTES = 255  # NAME_MAX of every common filesystem
MAX_TENSOR_NAME = 1024
MAX_DTYPE = 32
MAX_TENSOR_DIMS = 32
MAX_ERROR_DETAIL = 2048  # how much of a validation error a ManifestError quotes


def excerpt(value: str, limit: int = 80) -> str:
    """A value as an error quotes it: repr, cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 1]}… ({len(value)} characters)"


def describe(exc: ValidationError) -> str:
    """The first few problems, bounded: a document with a million bad entries (or one
    10 MB field) gets an error that fits in a status message."""
    lines = []
    for error in exc.errors(include_url=False, include_input=False)[:5]:
        where = ".".join(str(part) for part in error["loc"]) or "document"
        lines.append(f"{where}: {error['msg']}")
    more = exc.error_count() - len(lines)
    if more > 0:
        lines.append(f"and {more} more")
    text = "; ".join(lines)
    return text if len(text) <= MAX_ERROR_DETAIL else text[: MAX_ERROR_DETAIL - 1] + "…"
