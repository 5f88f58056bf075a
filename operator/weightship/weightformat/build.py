"""Building a manifest: every file of a ``ByteSource`` (a local folder, or S3) hashed
once, into its file sha256, chunk digests, piece layer and tensor checksums."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any, Literal, Protocol

import blake3

from weightship.weightformat.checksum import FileChecksums
from weightship.weightformat.entries import ChunkEntry, FileEntry, TensorEntry
from weightship.weightformat.layout import (
    LENGTH_PREFIX,
    FileLayout,
    LayoutError,
    header_length,
    parse_header,
)
from weightship.weightformat.manifest import Manifest, ManifestError, chunk_spans
from weightship.weightformat.paths import (
    SAFETENSORS_SUFFIX,
    is_metadata_path,
    validate_relative_path,
)

DEFAULT_CHUNK_SIZE = 16 * 1024 * 1024
# A piece is a 16th of a chunk, within [64 KiB, 1 MiB]: small enough that a chunk
# moves on a few milliseconds after its first bytes arrive, large enough that hashing it
# costs little per call and the piece layer stays 0.003-0.05 % of the model.
MIN_DEFAULT_PIECE, MAX_DEFAULT_PIECE = 64 * 1024, 1024 * 1024

log = logging.getLogger(__name__)


class ByteSource(Protocol):
    """Where weights are read from when building a manifest: a local folder or S3."""

    def list_files(self) -> list[tuple[str, int]]: ...

    def read_range(self, path: str, offset: int, size: int) -> bytes | bytearray: ...


class LocalFolder:
    """A folder of weights on local disk."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def list_files(self) -> list[tuple[str, int]]:
        found = []
        for p in sorted(self.root.rglob("*")):
            rel = p.relative_to(self.root).as_posix()
            if p.is_file() and not p.is_symlink() and not is_metadata_path(rel):
                found.append((rel, p.stat().st_size))
        return found

    def read_range(self, path: str, offset: int, size: int) -> bytes:
        with open(self.root / validate_relative_path(path), "rb") as f:
            f.seek(offset)
            data = f.read(size)
        if len(data) != size:
            raise ManifestError(f"{path}: short read at offset {offset}")
        return data


ProgressFn = Callable[[int], None]


def default_piece_size(chunk_size: int) -> int:
    return min(chunk_size, max(MIN_DEFAULT_PIECE, min(MAX_DEFAULT_PIECE, chunk_size // 16)))


def build_manifest(
    source: ByteSource,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    workers: int = 4,
    created_at: datetime | None = None,
    on_bytes: ProgressFn | None = None,
    version: Literal[1, 2] = 2,
    piece_size: int | None = None,
) -> Manifest:
    """The manifest of ``source`` (``build_manifest_with_pieces`` without the piece layer
    bytes: for a manifest that is checked or loaded, not staged from an origin)."""
    return build_manifest_with_pieces(
        source,
        chunk_size=chunk_size,
        workers=workers,
        created_at=created_at,
        on_bytes=on_bytes,
        version=version,
        piece_size=piece_size,
    )[0]


def build_manifest_with_pieces(
    source: ByteSource,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    workers: int = 4,
    created_at: datetime | None = None,
    on_bytes: ProgressFn | None = None,
    version: Literal[1, 2] = 2,
    piece_size: int | None = None,
) -> tuple[Manifest, bytes]:
    """Hash every file of ``source``: files in parallel, each streamed once in chunk order.
    Returns the manifest and its piece layer (empty for version 1), which goes next to
    the weights at ``manifest.piece_layer_path``.

    One pass per file feeds the file's sha256, the chunk digests (sha256 in version 1;
    blake3 and each piece's blake3 in version 2) and, for ``*.safetensors`` files, each
    tensor's wsum64, so the data is read once. hashlib and blake3 release the GIL, so
    threads hash on several cores. A ``.safetensors`` file whose header does not parse
    is listed with its chunks but no tensors (with a warning): the bytes are still
    verified, and the loader rejects the file when it is loaded.
    """
    piece_size = min(piece_size or default_piece_size(chunk_size), chunk_size)
    listing = source.list_files()
    for path, _ in listing:
        try:
            validate_relative_path(path)
        except ValueError as exc:
            raise ManifestError(str(exc)) from exc

    def hash_file(
        entry: tuple[str, int],
    ) -> tuple[FileEntry, list[ChunkEntry], list[TensorEntry], bytes]:
        path, size = entry
        file_hash = hashlib.sha256()
        chunks = []
        pieces = bytearray()
        layout: FileLayout | None = None
        sums: FileChecksums | None = None
        for index, (offset, length) in enumerate(chunk_spans(size, chunk_size)):
            data = source.read_range(path, offset, length)
            file_hash.update(data)
            if version == 1:
                digests = {"sha256": hashlib.sha256(data).hexdigest()}
            else:
                digests = {"blake3": blake3.blake3(data).hexdigest()}
                view = memoryview(data)
                for start in range(0, length, piece_size):
                    pieces += blake3.blake3(view[start : start + piece_size]).digest()
            chunks.append(ChunkEntry(file=path, index=index, offset=offset, size=length, **digests))
            if index == 0 and path.endswith(SAFETENSORS_SUFFIX):
                layout = _safetensors_layout(source, path, size, data)
                sums = FileChecksums(layout) if layout else None
            if sums:
                sums.feed(offset, data)
            if on_bytes:
                on_bytes(length)
        tensors = _tensor_entries(path, layout, sums.result()) if layout and sums else []
        file = FileEntry(path=path, size=size, sha256=file_hash.hexdigest())
        return file, chunks, tensors, bytes(pieces)

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        results = list(pool.map(hash_file, listing))
    # The piece layer follows the manifest's canonical chunk order: files by path.
    layer = b"".join(p for f, _, _, p in sorted(results, key=lambda r: r[0].path))
    pieces: dict[str, Any] = {}
    if version == 2:
        pieces = {"piece_size": piece_size, "piece_layer": blake3.blake3(layer).hexdigest()}
    manifest = Manifest(
        version=version,
        chunk_size=chunk_size,
        files=tuple(f for f, _, _, _ in results),
        chunks=tuple(c for _, cs, _, _ in results for c in cs),
        tensors=tuple(t for _, _, ts, _ in results for t in ts),
        created_at=created_at,
        **pieces,
    )
    return manifest, layer


def _safetensors_layout(
    source: ByteSource, path: str, size: int, first_chunk: bytes | bytearray
) -> FileLayout | None:
    """The file's tensor layout, from its first chunk when the header fits in it (it
    nearly always does: headers are kilobytes, chunks megabytes)."""
    try:
        prefix = first_chunk
        end = LENGTH_PREFIX + header_length(prefix)
        if end > len(prefix) and end <= size:
            prefix = source.read_range(path, 0, end)
        return parse_header(prefix, size)
    except LayoutError as exc:
        log.warning("%s: not a valid safetensors file, no tensors listed: %s", path, exc)
        return None


def _tensor_entries(path: str, layout: FileLayout, checksums: dict[str, str]) -> list[TensorEntry]:
    return [
        TensorEntry(
            file=path,
            name=t.name,
            dtype=t.dtype,
            shape=t.shape,
            offset=t.start,
            size=t.size,
            checksum=checksums[t.name],
        )
        for t in layout.tensors
    ]
