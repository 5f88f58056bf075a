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
import logging
import re
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, Literal, Protocol

import blake3
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    model_serializer,
    model_validator,
)

from weightship.loader.checksum import CHECKSUM_HEX_LEN, FileChecksums
from weightship.loader.layout import (
    LENGTH_PREFIX,
    FileLayout,
    LayoutError,
    header_length,
    parse_header,
    tensor_nbytes,
)

MANIFEST_NAME = "weightship-manifest.json"
DEFAULT_CHUNK_SIZE = 16 * 1024 * 1024
# A piece is a 16th of a chunk, within [64 KiB, 1 MiB]: small enough that a chunk
# moves on a few milliseconds after its first bytes arrive, large enough that hashing it
# costs little per call and the piece layer stays 0.003-0.05 % of the model.
MIN_DEFAULT_PIECE, MAX_DEFAULT_PIECE = 64 * 1024, 1024 * 1024
PIECES_DIR = "weightship-pieces"  # the piece layer objects: <PIECES_DIR>/<blake3 hex>.bin
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
DIGEST_BYTES = 32  # sha256 and blake3 alike
CHECKSUM_HEX = re.compile(rf"[0-9a-f]{{{CHECKSUM_HEX_LEN}}}")

# Bounds on what a manifest may claim, checked before anything is built from it: the
# operator and every agent parse manifests read from S3, so one hostile document must
# fail fast with a ManifestError instead of taking the process's memory. They sit far
# above any real model (1M chunks is 16 TiB at the default chunk size).
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
SAFETENSORS_SUFFIX = ".safetensors"
_READ_BLOCK = 1024 * 1024

log = logging.getLogger(__name__)


class ManifestError(ValueError):
    """The manifest is missing, malformed or inconsistent."""


def validate_relative_path(path: str) -> str:
    """Accept only plain relative POSIX paths, so no entry can escape the model folder."""
    if len(path) > MAX_PATH_BYTES or len(path.encode("utf-8", "surrogatepass")) > MAX_PATH_BYTES:
        raise ValueError(f"invalid path {_excerpt(path)}: longer than {MAX_PATH_BYTES} bytes")
    problems = []
    if not path:
        problems.append("is empty")
    if "\0" in path:
        problems.append("contains NUL")
    elif any(ord(ch) < 0x20 or 0x7F <= ord(ch) < 0xA0 for ch in path):
        problems.append("contains a control character")
    if "\\" in path:
        problems.append("contains a backslash")
    if path.startswith("/"):
        problems.append("is absolute")
    segments = path.split("/")
    if ".." in segments:
        problems.append("contains '..'")
    if "." in segments:
        problems.append("contains '.'")
    if path and not path.startswith("/") and "" in segments:
        problems.append("has an empty segment")
    if any(len(s.encode("utf-8", "surrogatepass")) > MAX_SEGMENT_BYTES for s in segments):
        problems.append(f"has a segment longer than {MAX_SEGMENT_BYTES} bytes")
    if problems:
        raise ValueError(f"invalid path {path!r}: {', '.join(problems)}")
    return path


def _excerpt(value: str, limit: int = 80) -> str:
    """A value as an error quotes it: repr, cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 1]}… ({len(value)} characters)"


def _check_sha256(value: str) -> str:
    if not SHA256_HEX.fullmatch(value):
        raise ValueError(f"sha256 must be 64 lowercase hex characters, got {_excerpt(value)}")
    return value


def _check_blake3(value: str) -> str:
    if not SHA256_HEX.fullmatch(value):
        raise ValueError(f"blake3 must be 64 lowercase hex characters, got {_excerpt(value)}")
    return value


def _check_checksum(value: str) -> str:
    if not CHECKSUM_HEX.fullmatch(value):
        raise ValueError(
            f"checksum must be {CHECKSUM_HEX_LEN} lowercase hex characters, got {_excerpt(value)}"
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


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class FileEntry(_Strict):
    path: RelativePath
    size: ByteCount
    sha256: Sha256Hex


class ChunkEntry(_Strict):
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


class TensorEntry(_Strict):
    """One tensor of a safetensors file: its bytes are [offset, offset + size) of the file
    (header included), and ``checksum`` is their wsum64 (weightship.loader.checksum)."""

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


class Manifest(_Strict):
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
            raise ManifestError(f"{source} is invalid: {_describe(exc)}") from None


def _describe(exc: ValidationError) -> str:
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
            zip(got, _chunk_spans(f.size, chunk_size), strict=True)
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


def _chunk_spans(size: int, chunk_size: int) -> Iterator[tuple[int, int]]:
    """(offset, size) of each chunk of a ``size``-byte file, lazily."""
    return ((off, min(chunk_size, size - off)) for off in range(0, size, chunk_size))


def is_metadata_path(path: str) -> bool:
    """The manifest and the piece layer objects: next to the weights, not weights."""
    return path == MANIFEST_NAME or path.startswith(PIECES_DIR + "/")


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
        for index, (offset, length) in enumerate(_chunk_spans(size, chunk_size)):
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


def unique_chunks(chunks: Iterable[ChunkEntry]) -> dict[str, ChunkEntry]:
    """One chunk entry per key: identical chunks (zero pages, repeats) are fetched once."""
    seen: dict[str, ChunkEntry] = {}
    for c in chunks:
        seen.setdefault(c.key, c)
    return seen
