"""Hashing chunks and pieces with the algorithm their manifest names.

A version 1 chunk carries a sha256, a version 2 chunk a BLAKE3 digest
(``ChunkEntry.algorithm``). Every verifier (staging, resume, dedupe, the loader) asks
this module for the hasher, so none of them branches on the manifest version.

A version 2 manifest also names a piece layer: the BLAKE3 digest of every
``pieceSize`` piece of every chunk, 32 bytes each, chunks in manifest order, pieces in
order. ``PieceLayer`` checks the object against the manifest's digest and size before
anything uses it, and then verifies single pieces as they arrive.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator, Sequence
from typing import Protocol

import blake3

from weightship.weightformat.entries import DIGEST_BYTES, SHA256_HEX, ChunkEntry
from weightship.weightformat.manifest import Manifest, ManifestError

Buffer = bytes | bytearray | memoryview

CHUNK_KEY = re.compile(r"(sha256|blake3):[0-9a-f]{64}")

# blake3's own threads pay off only on large inputs: below this, one thread.
MIN_BYTES_PER_THREAD = 4 * 1024 * 1024


def chunk_key(key: str) -> str:
    """A chunk's key, ``<sha256|blake3>:<64 lowercase hex>`` (``ChunkEntry.key``); a bare
    hex digest is a version 1 (sha256) chunk. Anything else is refused (ValueError)."""
    if SHA256_HEX.fullmatch(key):
        return "sha256:" + key
    if not CHUNK_KEY.fullmatch(key):
        raise ValueError(f"not a chunk key: {key[:80]!r}")
    return key


class ChunkVerificationError(ValueError):
    """Bytes did not match the digest they were fetched for."""


class ChunkHasher(Protocol):
    def update(self, data: Buffer, /) -> object: ...

    def hexdigest(self) -> str: ...


def new_chunk_hasher(chunk: ChunkEntry, *, max_threads: int = 1) -> ChunkHasher:
    """A hashlib-like hasher for ``chunk``'s algorithm. ``max_threads`` > 1 lets BLAKE3
    hash one large input on several threads (``blake3.blake3.AUTO``: as many as cores);
    sha256 is serial."""
    if chunk.algorithm == "sha256":
        return hashlib.sha256()
    return blake3.blake3(max_threads=max_threads)


def chunk_digest(chunk: ChunkEntry, data: Buffer, *, max_threads: int = 1) -> str:
    """The hex digest of ``data`` in ``chunk``'s algorithm."""
    if chunk.algorithm == "sha256":
        return hashlib.sha256(data).hexdigest()
    threads = max_threads if len(data) >= 2 * MIN_BYTES_PER_THREAD else 1
    return blake3.blake3(data, max_threads=threads).hexdigest()


def chunk_matches(chunk: ChunkEntry, data: Buffer, *, max_threads: int = 1) -> bool:
    """Whether ``data`` is exactly ``chunk``'s bytes."""
    return len(data) == chunk.size and chunk_digest(chunk, data, max_threads=max_threads) == (
        chunk.hexdigest
    )


def piece_spans(size: int, piece_size: int) -> Iterator[tuple[int, int]]:
    """[start, end) of each piece of a ``size``-byte chunk."""
    return ((s, min(size, s + piece_size)) for s in range(0, size, piece_size))


class PieceVerificationError(ChunkVerificationError):
    """A piece's bytes do not match the piece layer."""

    def __init__(self, chunk: ChunkEntry, piece: int) -> None:
        super().__init__(
            f"piece {piece} of chunk {chunk.key} ({chunk.file} chunk {chunk.index}) does not "
            "match the piece layer"
        )
        self.chunk, self.piece = chunk, piece


class PieceLayer:
    """The piece digests of a version 2 manifest, checked against the manifest.

    ``data`` must be exactly ``32 · manifest.piece_count`` bytes with the manifest's
    ``pieceLayer`` BLAKE3 digest (ManifestError otherwise), so a hostile object costs at
    most its bounded size (the manifest caps the piece count at MAX_PIECES)."""

    def __init__(self, manifest: Manifest, data: Buffer) -> None:
        if manifest.piece_size is None or manifest.piece_layer is None:
            raise ManifestError(f"manifest {manifest.digest} has no piece layer")
        want = DIGEST_BYTES * manifest.piece_count
        if len(data) != want:
            raise ManifestError(
                f"the piece layer of {manifest.digest} is {len(data)} bytes, expected {want}"
            )
        if blake3.blake3(data).hexdigest() != manifest.piece_layer:
            raise ManifestError(
                f"the piece layer of {manifest.digest} does not match its blake3 "
                f"{manifest.piece_layer}"
            )
        self.piece_size = manifest.piece_size
        self._data = self.raw = bytes(data)
        self._first: dict[tuple[str, int], int] = {}  # (file, chunk index) -> first piece
        n = 0
        for c in manifest.chunks:
            self._first[(c.file, c.index)] = n
            n += -(-c.size // self.piece_size)

    def digests(self, chunk: ChunkEntry) -> Sequence[bytes]:
        """The 32-byte digest of each piece of ``chunk``."""
        first = self._first[(chunk.file, chunk.index)]
        count = -(-chunk.size // self.piece_size)
        raw = self._data
        return [
            raw[(first + i) * DIGEST_BYTES : (first + i + 1) * DIGEST_BYTES] for i in range(count)
        ]

    def checker(self, chunk: ChunkEntry) -> PieceChecker:
        return PieceChecker(chunk, self.piece_size, self.digests(chunk))


class PieceChecker:
    """Verifies one chunk's pieces in order, as its bytes land: ``landed(view, end)`` says
    bytes [0, end) of the chunk are in ``view``; it hashes every piece completed since
    and returns the verified prefix (piece aligned, or the whole chunk). Raises
    PieceVerificationError at the first bad piece; the prefix stays as it was."""

    def __init__(self, chunk: ChunkEntry, piece_size: int, digests: Sequence[bytes]) -> None:
        self.chunk = chunk
        self.piece_size = piece_size
        self._digests = digests
        self.verified = 0

    def start_at(self, verified: int) -> None:
        """Resume after a prefix verified earlier (by another attempt)."""
        self.verified = verified

    def landed(self, view: Buffer, end: int) -> int:
        size, p = self.chunk.size, self.piece_size
        while self.verified < size:
            stop = min(size, self.verified + p)
            if stop > end:
                break
            piece = self.verified // p
            if blake3.blake3(view[self.verified : stop]).digest() != self._digests[piece]:
                raise PieceVerificationError(self.chunk, piece)
            self.verified = stop
        return self.verified
