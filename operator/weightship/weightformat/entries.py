"""The entries of a manifest: a file with its sha256, a chunk with its digest (sha256 in
version 1, BLAKE3 in version 2), a tensor of a safetensors file with its wsum64. Each
field is bounded (``bounds``) and checked as it is parsed."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from weightship.weightformat.bounds import (
    MAX_CHUNK_SIZE,
    MAX_CHUNKS,
    MAX_DTYPE,
    MAX_FILE_BYTES,
    MAX_PATH_BYTES,
    MAX_TENSOR_DIMS,
    MAX_TENSOR_NAME,
    excerpt,
)
from weightship.weightformat.checksum import CHECKSUM_HEX_LEN
from weightship.weightformat.layout import tensor_nbytes
from weightship.weightformat.paths import validate_relative_path

SHA256_HEX = re.compile(r"[0-9a-f]{64}")
DIGEST_BYTES = 32  # sha256 and blake3 alike
CHECKSUM_HEX = re.compile(rf"[0-9a-f]{{{CHECKSUM_HEX_LEN}}}")


def _check_sha256(value: str) -> str:
    if not SHA256_HEX.fullmatch(value):
        raise ValueError(f"sha256 must be 64 lowercase hex characters, got {excerpt(value)}")
    return value


def _check_blake3(value: str) -> str:
    if not SHA256_HEX.fullmatch(value):
        raise ValueError(f"blake3 must be 64 lowercase hex characters, got {excerpt(value)}")
    return value


def _check_checksum(value: str) -> str:
    if not CHECKSUM_HEX.fullmatch(value):
        raise ValueError(
            f"checksum must be {CHECKSUM_HEX_LEN} lowercase hex characters, got {excerpt(value)}"
        )
    return value


# max_length is checked before the after-validators, so a 10 MB field costs one length
# check and an error of a few lines.
RelativePath = Annotated[
    str, Field(max_length=MAX_PATH_BYTES), AfterValidator(validate_relative_path)
]
Sha256Hex = Annotated[str, Field(max_length=64), AfterValidator(_check_sha256)]
Blake3Hex = Annotated[str, Field(max_length=64), AfterValidator(_check_blake3)]
ChunkAlgorithm = Literal["sha256", "blake3"]
ChecksumHex = Annotated[str, Field(max_length=CHECKSUM_HEX_LEN), AfterValidator(_check_checksum)]
ByteCount = Annotated[int, Field(ge=0, le=MAX_FILE_BYTES)]


class StrictModel(BaseModel):
    """Frozen, no unknown fields, fields by name or alias: every manifest model."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class FileEntry(StrictModel):
    path: RelativePath
    size: ByteCount
    sha256: Sha256Hex


class ChunkEntry(StrictModel):
    """One chunk of a file, with exactly one digest: ``sha256`` (version 1) or ``blake3``
    (version 2)."""

    file: RelativePath
    index: int = Field(ge=0, lt=MAX_CHUNKS)
    offset: ByteCount
    size: int = Field(gt=0, le=MAX_CHUNK_SIZE)
    sha256: Sha256Hex | None = None
    blake3: Blake3Hex | None = None

    @model_validator(mode="after")
    def _one_digest(self) -> ChunkEntry:
        if (self.sha256 is None) == (self.blake3 is None):
            raise ValueError(
                f"chunk {self.index} of {self.file!r} must have exactly one of sha256 and blake3"
            )
        return self

    @property
    def algorithm(self) -> ChunkAlgorithm:
        return "sha256" if self.sha256 is not None else "blake3"

    @property
    def hexdigest(self) -> str:
        digest = self.sha256 if self.sha256 is not None else self.blake3
        assert digest is not None  # _one_digest
        return digest

    @property
    def key(self) -> str:
        """``<algorithm>:<hex>``: how the node cache, peers and claims name this chunk, so
        a sha256 chunk and a blake3 chunk can never be taken for one another."""
        return f"{self.algorithm}:{self.hexdigest}"


class TensorEntry(StrictModel):
    """One tensor of a safetensors file: its bytes are [offset, offset + size) of the file
    (header included), and ``checksum`` is their wsum64 (weightformat.checksum)."""

    file: RelativePath
    name: str = Field(min_length=1, max_length=MAX_TENSOR_NAME)
    dtype: str = Field(max_length=MAX_DTYPE)
    shape: tuple[Annotated[int, Field(ge=0, le=MAX_FILE_BYTES)], ...] = Field(
        max_length=MAX_TENSOR_DIMS
    )
    offset: ByteCount
    size: ByteCount
    checksum: ChecksumHex

    @model_validator(mode="after")
    def _size_matches_type(self) -> TensorEntry:
        want = tensor_nbytes(self.dtype, self.shape)  # LayoutError is a ValueError
        if want != self.size:
            raise ValueError(
                f"tensor {self.name!r} in {self.file!r}: {self.dtype} {list(self.shape)} "
                f"takes {want} bytes, size says {self.size}"
            )
        return self
