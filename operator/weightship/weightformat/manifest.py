"""The weights manifest: every file with its size and sha256, every chunk with its size
and digest.

Version 1 gives each chunk a sha256. Version 2 gives each chunk a BLAKE3 digest (several
times cheaper per core, and parallel inside one chunk) and names a piece layer: the
BLAKE3 digest of every ``pieceSize`` piece of every chunk, in one binary object next to
the weights (``weightship-pieces/<blake3>.bin``), authenticated by its own BLAKE3 digest
in the manifest, so pieces of a chunk can be verified on their own as they arrive
(chunkhash.PieceLayer). Files keep their whole-file sha256 in both versions.

The manifest's digest is the model's identity. It covers the content only (version,
chunk size, files, chunks, pieces) and not ``createdAt``, so re-running ``weightship
manifest`` over unchanged weights keeps the identity that rollouts pin.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from datetime import datetime
from typing import Any, Literal

from pydantic import (
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    model_serializer,
    model_validator,
)

from weightship.weightformat.bounds import (
    MAX_CHUNK_SIZE,
    MAX_CHUNKS,
    MAX_FILE_BYTES,
    MAX_FILES,
    MAX_MANIFEST_BYTES,
    MAX_PIECES,
    MAX_TENSORS,
    describe,
)
from weightship.weightformat.entries import (
    SHA256_HEX,
    Blake3Hex,
    ChunkAlgorithm,
    ChunkEntry,
    FileEntry,
    StrictModel,
    TensorEntry,
)
from weightship.weightformat.paths import PIECES_DIR


class ManifestError(ValueError):
    """The manifest is missing, malformed or inconsistent."""


class Manifest(StrictModel):
    version: Literal[1, 2] = 1
    chunk_size: int = Field(alias="chunkSize", gt=0, le=MAX_CHUNK_SIZE)
    # Version 2 only, both or neither: the size of a piece, and the blake3 of the piece
    # layer (every chunk's piece digests, chunks in manifest order; chunkhash.PieceLayer).
    piece_size: int | None = Field(None, alias="pieceSize", gt=0, le=MAX_CHUNK_SIZE)
    piece_layer: Blake3Hex | None = Field(None, alias="pieceLayer")
    files: tuple[FileEntry, ...] = Field(max_length=MAX_FILES)
    chunks: tuple[ChunkEntry, ...] = Field(max_length=MAX_CHUNKS)
    # Optional, and left out of the document (so out of the digest) when empty: every
    # manifest written before tensors were listed keeps its identity.
    tensors: tuple[TensorEntry, ...] = Field((), max_length=MAX_TENSORS)
    created_at: datetime | None = Field(default=None, alias="createdAt")

    @model_validator(mode="after")
    def _normalize_and_check(self) -> Manifest:
        files = tuple(sorted(self.files, key=lambda f: f.path))
        chunks = tuple(sorted(self.chunks, key=lambda c: (c.file, c.index)))
        tensors = tuple(sorted(self.tensors, key=lambda t: (t.file, t.offset, t.size, t.name)))
        _check_tiling(files, chunks, self.chunk_size)
        _check_tensors(files, tensors)
        self._check_version(chunks)
        # Canonical order makes the digest independent of how the lists were written.
        object.__setattr__(self, "files", files)
        object.__setattr__(self, "chunks", chunks)
        object.__setattr__(self, "tensors", tensors)
        return self

    def _check_version(self, chunks: tuple[ChunkEntry, ...]) -> None:
        want: ChunkAlgorithm = "sha256" if self.version == 1 else "blake3"
        wrong = next((c for c in chunks if c.algorithm != want), None)
        if wrong is not None:
            raise ValueError(
                f"a version {self.version} manifest has {want} chunks: chunk {wrong.index} of "
                f"{wrong.file!r} has a {wrong.algorithm}"
            )
        if (self.piece_size is None) != (self.piece_layer is None):
            raise ValueError("pieceSize and pieceLayer go together")
        if self.piece_size is not None:
            if self.version == 1:
                raise ValueError("a version 1 manifest has no piece layer")
            if self.piece_size > self.chunk_size:
                raise ValueError(
                    f"pieceSize {self.piece_size} is larger than chunkSize {self.chunk_size}"
                )
            pieces = self.piece_count
            if pieces > MAX_PIECES:
                raise ValueError(f"the chunks have {pieces} pieces, over {MAX_PIECES}")

    @property
    def piece_count(self) -> int:
        """Pieces in the piece layer (0 without one)."""
        if self.piece_size is None:
            return 0
        p = self.piece_size
        return sum(-(-c.size // p) for c in self.chunks)

    @property
    def piece_layer_path(self) -> str | None:
        """Where the piece layer lies next to the weights, if the manifest has one."""
        return f"{PIECES_DIR}/{self.piece_layer}.bin" if self.piece_layer else None

    @model_serializer(mode="wrap")
    def _omit_empty_tensors(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        doc: dict[str, Any] = handler(self)
        if not self.tensors:
            doc.pop("tensors", None)
        return doc

    @property
    def total_size(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def digest(self) -> str:
        return "sha256:" + self.digest_hex

    @property
    def digest_hex(self) -> str:
        return hashlib.sha256(self.canonical_bytes(include_created_at=False)).hexdigest()

    def canonical_bytes(self, *, include_created_at: bool = True) -> bytes:
        doc: dict[str, Any] = self.model_dump(mode="json", by_alias=True, exclude_none=True)
        if not include_created_at:
            doc.pop("createdAt", None)
        return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()

    @property
    def has_piece_layer(self) -> bool:
        return self.piece_layer is not None

    def chunks_of(self, path: str) -> list[ChunkEntry]:
        return [c for c in self.chunks if c.file == path]

    def tensors_of(self, path: str) -> list[TensorEntry]:
        return [t for t in self.tensors if t.file == path]

    @classmethod
    def parse(cls, data: bytes | str, *, source: str = "manifest") -> Manifest:
        if len(data) > MAX_MANIFEST_BYTES:
            raise ManifestError(
                f"{source} is invalid: {len(data)} bytes, over the {MAX_MANIFEST_BYTES} "
                "bytes a manifest may take"
            )
        try:
            return cls.model_validate_json(data)
        except ValidationError as exc:
            raise ManifestError(f"{source} is invalid: {describe(exc)}") from None


def _check_tiling(
    files: tuple[FileEntry, ...], chunks: tuple[ChunkEntry, ...], chunk_size: int
) -> None:
    """Each file's chunks tile it exactly. A file's chunk count (one division) is checked
    against the chunks listed before its spans are walked, lazily: a small document
    claiming a huge file in tiny chunks costs nothing but that division."""
    total = sum(f.size for f in files)
    if total > MAX_FILE_BYTES:
        raise ValueError(f"the files add up to {total} bytes, over {MAX_FILE_BYTES}")
    by_file: dict[str, list[ChunkEntry]] = {}
    for f in files:
        if f.path in by_file:
            raise ValueError(f"duplicate file path {f.path!r}")
        by_file[f.path] = []
    for c in chunks:
        if c.file not in by_file:
            raise ValueError(f"chunk {c.index} names unknown file {c.file!r}")
        by_file[c.file].append(c)
    for f in files:
        got = by_file[f.path]
        implied = -(-f.size // chunk_size)
        if implied != len(got):
            raise ValueError(
                f"chunks of {f.path!r} do not tile its {f.size} bytes at chunk size "
                f"{chunk_size}: that takes {implied} chunks, {len(got)} are listed"
            )
        for i, (c, (offset, size)) in enumerate(
            zip(got, chunk_spans(f.size, chunk_size), strict=True)
        ):
            if (c.index, c.offset, c.size) != (i, offset, size):
                raise ValueError(
                    f"chunks of {f.path!r} do not tile its {f.size} bytes at chunk size "
                    f"{chunk_size}: chunk {i} is (index, offset, size) "
                    f"{(c.index, c.offset, c.size)}, expected {(i, offset, size)}"
                )


def _check_tensors(files: tuple[FileEntry, ...], tensors: tuple[TensorEntry, ...]) -> None:
    """Each tensor lies inside a listed file, and tensors of a file neither overlap nor
    repeat a name. ``tensors`` is sorted by (file, offset)."""
    sizes = {f.path: f.size for f in files}
    names: set[tuple[str, str]] = set()
    end_of_previous: dict[str, int] = {}
    for t in tensors:
        if t.file not in sizes:
            raise ValueError(f"tensor {t.name!r} names unknown file {t.file!r}")
        if t.offset + t.size > sizes[t.file]:
            raise ValueError(
                f"tensor {t.name!r} at [{t.offset}, {t.offset + t.size}) lies outside "
                f"{t.file!r} ({sizes[t.file]} bytes)"
            )
        if (t.file, t.name) in names:
            raise ValueError(f"tensor {t.name!r} listed twice for {t.file!r}")
        names.add((t.file, t.name))
        if t.offset < end_of_previous.get(t.file, 0):
            raise ValueError(f"tensor {t.name!r} in {t.file!r} overlaps the one before")
        end_of_previous[t.file] = t.offset + t.size


def chunk_spans(size: int, chunk_size: int) -> Iterator[tuple[int, int]]:
    """(offset, size) of each chunk of a ``size``-byte file, lazily."""
    return ((off, min(chunk_size, size - off)) for off in range(0, size, chunk_size))


def digest_hex(digest: str) -> str:
    """'sha256:<hex>' or '<hex>' (a manifest digest) -> '<hex>', rejecting anything else."""
    hex_part = digest.removeprefix("sha256:")
    if not SHA256_HEX.fullmatch(hex_part):
        raise ValueError(f"not a sha256 digest: {digest!r}")
    return hex_part


def unique_chunks(chunks: Iterable[ChunkEntry]) -> dict[str, ChunkEntry]:
    """One chunk entry per key: identical chunks (zero pages, repeats) are fetched once."""
    seen: dict[str, ChunkEntry] = {}
    for c in chunks:
        seen.setdefault(c.key, c)
    return seen
