"""The weights manifest: every file and every chunk with its size and sha256.

The manifest's digest is the model's identity. It covers the content only (version,
chunk size, files, chunks) and not ``createdAt``, so re-running ``weightship manifest``
over unchanged weights keeps the identity that rollouts pin.
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
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
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
ChecksumHex = Annotated[str, Field(max_length=CHECKSUM_HEX_LEN), AfterValidator(_check_checksum)]
ByteCount = Annotated[int, Field(ge=0, le=MAX_FILE_BYTES)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class FileEntry(_Strict):
    path: RelativePath
    size: ByteCount
    sha256: Sha256Hex


class ChunkEntry(_Strict):
    file: RelativePath
    index: int = Field(ge=0, lt=MAX_CHUNKS)
    offset: ByteCount
    size: int = Field(gt=0, le=MAX_CHUNK_SIZE)
    sha256: Sha256Hex


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
    version: Literal[1] = 1
    chunk_size: int = Field(alias="chunkSize", gt=0, le=MAX_CHUNK_SIZE)
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
        # Canonical order makes the digest independent of how the lists were written.
        object.__setattr__(self, "files", files)
        object.__setattr__(self, "chunks", chunks)
        object.__setattr__(self, "tensors", tensors)
        return self

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
            if p.is_file() and not p.is_symlink() and rel != MANIFEST_NAME:
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


def build_manifest(
    source: ByteSource,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    workers: int = 4,
    created_at: datetime | None = None,
    on_bytes: ProgressFn | None = None,
) -> Manifest:
    """Hash every file of ``source``: files in parallel, each streamed once in chunk order.

    One pass per file feeds the file hash, the chunk hashes and, for ``*.safetensors``
    files, each tensor's wsum64, so the data is read once. hashlib releases the GIL, so
    threads hash on several cores. A ``.safetensors`` file whose header does not parse
    is listed with its chunks but no tensors (with a warning): the bytes are still
    verified, and the loader rejects the file when it is loaded.
    """
    listing = source.list_files()
    for path, _ in listing:
        try:
            validate_relative_path(path)
        except ValueError as exc:
            raise ManifestError(str(exc)) from exc

    def hash_file(entry: tuple[str, int]) -> tuple[FileEntry, list[ChunkEntry], list[TensorEntry]]:
        path, size = entry
        file_hash = hashlib.sha256()
        chunks = []
        layout: FileLayout | None = None
        sums: FileChecksums | None = None
        for index, (offset, length) in enumerate(_chunk_spans(size, chunk_size)):
            data = source.read_range(path, offset, length)
            file_hash.update(data)
            digest = hashlib.sha256(data).hexdigest()
            chunks.append(
                ChunkEntry(file=path, index=index, offset=offset, size=length, sha256=digest)
            )
            if index == 0 and path.endswith(SAFETENSORS_SUFFIX):
                layout = _safetensors_layout(source, path, size, data)
                sums = FileChecksums(layout) if layout else None
            if sums:
                sums.feed(offset, data)
            if on_bytes:
                on_bytes(length)
        tensors = _tensor_entries(path, layout, sums.result()) if layout and sums else []
        return FileEntry(path=path, size=size, sha256=file_hash.hexdigest()), chunks, tensors

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        results = list(pool.map(hash_file, listing))
    return Manifest(
        chunk_size=chunk_size,
        files=tuple(f for f, _, _ in results),
        chunks=tuple(c for _, cs, _ in results for c in cs),
        tensors=tuple(t for _, _, ts in results for t in ts),
        created_at=created_at,
    )


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
    """One chunk entry per digest: identical chunks (zero pages, repeats) are fetched once."""
    seen: dict[str, ChunkEntry] = {}
    for c in chunks:
        seen.setdefault(c.sha256, c)
    return seen
