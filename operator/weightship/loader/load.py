"""Load a staged model into memory, every byte checked against the manifest on the way in.

Each file is loaded once, chunk by chunk, by a pool of threads, in pieces (``READ_PIECE``)
that each go through the chunk's hasher (BLAKE3 for a version 2 manifest, sha256 for a
version 1 one) right after they land, while still in the core's cache, so the hash
costs no second trip through memory. Hashing, the kernel calls and hashlib release the
GIL, so the pieces of different chunks land and hash on every core. Nothing is returned
until every chunk matched, so no tensor is ever built on bytes that were not verified.

On the CPU each file is mapped privately and each piece's pages are made the process's
own copies of the file's pages (``populate_write``: one copy in the kernel, no zeroed
page first) before they are hashed; the tensors are views into that private memory,
which nothing outside the process can change. On a GPU, each worker reads a chunk into a
pinned host slot (``os.preadv``), hashes it, and queues its copy into the file's device
buffer on a side stream, then goes on to the next chunk while the copy runs: reads,
hashes and host-to-device copies overlap, and host memory stays at a few chunks however
large the model. Tensors are views into the device buffers.
"""

from __future__ import annotations

import builtins
import mmap
import os
import queue
import time
from collections.abc import Callable, Collection, Iterator
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from weightship.linux import populate_write
from weightship.weightformat import cachedir
from weightship.weightformat.chunkhash import ChunkHasher, new_chunk_hasher
from weightship.weightformat.entries import ChunkEntry, FileEntry
from weightship.weightformat.layout import (
    LENGTH_PREFIX,
    FileLayout,
    LayoutError,
    header_length,
    parse_header,
)
from weightship.weightformat.manifest import Manifest, ManifestError
from weightship.weightformat.paths import SAFETENSORS_SUFFIX

# safetensors dtype -> torch dtype. Sub-byte types (F4, F6_*) pack several values per
# byte, which torch shapes differently; they are refused by name rather than mis-shaped.
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
    "C64": torch.complex64,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E8M0": torch.float8_e8m0fnu,
}
# Pinned slots per worker: one being filled while the previous one's copy is in flight.
_SLOTS_PER_WORKER = 2
# Bytes copied (and then hashed) at a time: small enough to still be in the core's L2
# cache (1-2 MiB here) when the hasher reads them, large enough that a call per piece is
# noise.
READ_PIECE = 512 * 1024


class LoaderError(RuntimeError):
    """The model cannot be loaded as asked: a missing file, a bad header, no GPU."""


class WeightsVerificationError(LoaderError):
    """Bytes on disk do not match the manifest; nothing built from them was returned."""

    def __init__(
        self,
        path: str,
        chunk_index: int | None,
        expected: str,
        got: str,
        algorithm: str | None = None,
    ) -> None:
        where = f"chunk {chunk_index}" if chunk_index is not None else "size"
        named = f"{algorithm} " if algorithm else ""
        super().__init__(
            f"{path}: {where} does not match the manifest: expected {named}{expected}, "
            f"got {named}{got}"
        )
        self.path = path
        self.chunk_index = chunk_index
        self.expected = expected
        self.got = got
        # The chunk digest's algorithm ("blake3", "sha256"); None for a size mismatch.
        self.algorithm = algorithm


@dataclass
class LoadedModel:
    """Tensors by name (views into one buffer per file, on ``device``), the manifest
    digest they were checked against, and what the load cost."""

    tensors: dict[str, torch.Tensor]
    digest: str
    verified: bool
    bytes: int
    seconds: float
    # Verified contents of the other files (config.json, tokenizer files), by path.
    files: dict[str, builtins.bytes] = field(default_factory=dict)

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


def locate_staged(cache_root: Path, digest: str) -> Path | None:
    """The files folder of a model staged in the node cache at ``cache_root``, or None.

    Deliberately not a ChunkStore: opening one may rewrite the cache (format upgrades),
    and an inference pod must only read it, often through a read-only mount.
    """
    model_dir = cachedir.model_dir(cache_root, digest)
    staged = (model_dir / cachedir.STAGED_MARKER).is_file()
    return model_dir / cachedir.FILES_DIR if staged else None


def load_staged(cache_root: Path, digest: str, **options: object) -> LoadedModel:
    """Load the model staged under ``digest``, with the manifest the cache saved for it
    (trusted only once its digest is ``digest``). ``options`` go to ``load_model``."""
    files = locate_staged(cache_root, digest)
    if files is None:
        raise LoaderError(f"{digest} is not staged in {cache_root}")
    manifest_path = files.parent / cachedir.MANIFEST_FILE
    try:
        manifest = Manifest.parse(manifest_path.read_bytes(), source=str(manifest_path))
    except (OSError, ManifestError) as exc:
        raise LoaderError(f"cannot read the manifest of {digest}: {exc}") from exc
    return load_model(files, manifest, expected_digest=digest, **options)  # type: ignore[arg-type]


def load_model(
    model_dir: Path,
    manifest: Manifest,
    *,
    device: str | torch.device = "cpu",
    verify: bool = True,
    workers: int = 4,
    hash_threads: int = 1,
    expected_digest: str | None = None,
    paths: Collection[str] | None = None,
) -> LoadedModel:
    """Load the manifest's files from ``model_dir``: tensors of ``*.safetensors`` files
    onto ``device``, other files as bytes.

    With ``verify`` every chunk's digest (BLAKE3 or sha256, as the manifest says) must
    match (WeightsVerificationError names the file, chunk, algorithm, expected and actual
    digests). ``workers`` threads read and hash chunks; ``hash_threads`` > 1 also lets
    BLAKE3 split each piece across threads of its own (1 was fastest on 2 cores, see
    docs/loader.md). ``expected_digest`` (the digest a rollout pins) must equal the
    manifest's. ``paths`` limits the load to some of its files.
    """
    started = time.perf_counter()
    if expected_digest is not None and expected_digest != manifest.digest:
        raise LoaderError(f"the manifest is {manifest.digest}, not the expected {expected_digest}")
    target = torch.device(device)
    if target.type == "cuda" and not torch.cuda.is_available():
        raise LoaderError(f"device {target} asked for, but CUDA is not available")
    entries = [f for f in manifest.files if paths is None or f.path in paths]
    if paths is not None and len(entries) != len(set(paths)):
        unknown = sorted(set(paths) - {f.path for f in entries})
        raise LoaderError(f"not in the manifest: {unknown}")

    with ExitStack() as stack:
        opened = {f.path: stack.enter_context(_open_checked(model_dir, f)) for f in entries}
        buffers = {f.path: _destination(f, opened[f.path], target) for f in entries}
        jobs = [(c, opened[c.file], buffers[c.file]) for c in manifest.chunks if c.file in opened]
        hashing = _Hashing(verify, max(1, hash_threads))
        if target.type == "cuda":
            _read_to_device(jobs, target, manifest.chunk_size, hashing, workers)
        else:
            _run(jobs, lambda job: _copy_chunk(*job, hashing=hashing), workers)

    tensors: dict[str, torch.Tensor] = {}
    other_files: dict[str, bytes] = {}
    for f in entries:
        if not f.path.endswith(SAFETENSORS_SUFFIX):
            other_files[f.path] = buffers[f.path].numpy().tobytes()
            continue
        for name, tensor in _tensors(f.path, buffers[f.path], manifest).items():
            if name in tensors:
                raise LoaderError(f"tensor {name!r} of {f.path} is also in another file")
            tensors[name] = tensor
    return LoadedModel(
        tensors=tensors,
        digest=manifest.digest,
        verified=verify,
        bytes=sum(f.size for f in entries),
        seconds=time.perf_counter() - started,
        files=other_files,
    )


@contextmanager
def _open_checked(model_dir: Path, entry: FileEntry) -> Iterator[int]:
    try:
        fd = os.open(model_dir / entry.path, os.O_RDONLY)
    except OSError as exc:
        raise LoaderError(f"cannot open {entry.path} in {model_dir}: {exc}") from exc
    try:
        size = os.fstat(fd).st_size
        if size != entry.size:
            raise WeightsVerificationError(entry.path, None, f"{entry.size} bytes", f"{size} bytes")
        yield fd
    finally:
        os.close(fd)


def _on_device(entry: FileEntry, target: torch.device) -> bool:
    return target.type == "cuda" and entry.path.endswith(SAFETENSORS_SUFFIX)


def _destination(entry: FileEntry, fd: int, target: torch.device) -> torch.Tensor:
    """Where a file's bytes go: device memory for a GPU's tensors, a private mapping of
    the file otherwise."""
    if _on_device(entry, target):
        return torch.empty(entry.size, dtype=torch.uint8, device=target)
    return private_mapping(fd, entry.size)


def private_mapping(fd: int, size: int) -> torch.Tensor:
    """The file's first ``size`` bytes mapped copy-on-write (``MAP_PRIVATE``), nothing
    read yet: ``_copy_chunk`` makes each page the process's own copy before hashing it,
    after which writes to the file no longer reach it. Writable, as tensors expect. The
    tensor keeps the mapping alive. (A file truncated under a loaded model takes its
    pages away, private copies too, as POSIX says; staged files are never truncated.)

    Not a fresh buffer that the file is read into: the kernel zeroes each fresh page
    before the read overwrites it, and that costs about what hashing every byte does
    (docs/loader.md)."""
    if size == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(mmap.mmap(fd, size, access=mmap.ACCESS_COPY), dtype=torch.uint8)


Job = tuple[ChunkEntry, int, torch.Tensor]


def _run(jobs: list[Job], work: Callable[[Job], None], workers: int) -> None:
    """Run ``work`` on every job; the first failure stops the rest and is raised."""
    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="load") as pool:
        futures = [pool.submit(work, job) for job in jobs]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        failed = [f for f in futures if f in done and f.exception() is not None]
        if failed:
            pool.shutdown(cancel_futures=True)
            raise failed[0].exception()  # type: ignore[misc]


@dataclass(frozen=True)
class _Hashing:
    verify: bool
    threads: int

    def hasher(self, chunk: ChunkEntry) -> ChunkHasher | None:
        return new_chunk_hasher(chunk, max_threads=self.threads) if self.verify else None


def _copy_chunk(chunk: ChunkEntry, fd: int, dest: torch.Tensor, *, hashing: _Hashing) -> None:
    """Make a chunk's pages of a private mapping the process's own, piece by piece, each
    hashed as it lands; where the kernel cannot (or the file shrank), read the piece."""
    view = dest.numpy().data[chunk.offset : chunk.offset + chunk.size]
    address = dest.data_ptr() + chunk.offset

    def bring(piece: memoryview, at: int) -> None:
        if not populate_write(address + at, len(piece)):
            _read_all(fd, piece, chunk, at)

    _fill_verified(view, chunk, hashing.hasher(chunk), bring)


def _read_verified(
    fd: int, view: memoryview, chunk: ChunkEntry, hasher: ChunkHasher | None
) -> None:
    """Fill ``view`` with the chunk's bytes read from the file, verified as below."""
    _fill_verified(view, chunk, hasher, lambda piece, at: _read_all(fd, piece, chunk, at))


def _fill_verified(
    view: memoryview,
    chunk: ChunkEntry,
    hasher: ChunkHasher | None,
    bring: Callable[[memoryview, int], None],
) -> None:
    """Fill ``view`` piece by piece (``bring(piece, offset in the chunk)``), each piece fed
    to ``hasher`` while it is hot in cache; then the digest must be the manifest's."""
    done = 0
    while done < chunk.size:
        n = min(READ_PIECE, chunk.size - done)
        bring(view[done : done + n], done)
        if hasher is not None:
            hasher.update(view[done : done + n])
        done += n
    if hasher is not None and (got := hasher.hexdigest()) != chunk.hexdigest:
        raise WeightsVerificationError(
            chunk.file, chunk.index, chunk.hexdigest, got, algorithm=chunk.algorithm
        )


def _read_all(fd: int, piece: memoryview, chunk: ChunkEntry, at: int) -> None:
    """Read ``piece`` from the chunk's bytes at ``at``; a file that ends first is named."""
    got = 0
    while got < len(piece):
        n = os.preadv(fd, [piece[got:]], chunk.offset + at + got)
        if n == 0:  # the file shrank since its size was checked
            short = f"{at + got} bytes"
            raise WeightsVerificationError(chunk.file, chunk.index, f"{chunk.size} bytes", short)
        got += n


def _read_to_device(
    jobs: list[Job], device: torch.device, chunk_size: int, hashing: _Hashing, workers: int
) -> None:
    """Pinned slot -> hashed as it is read -> async copy into the device buffer, for
    every chunk."""
    workers = max(1, workers)
    side = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
    # The destination buffers were allocated on the current stream, possibly in memory
    # that stream's earlier work still uses: copies start after it.
    side.wait_stream(torch.cuda.current_stream(device))
    slots: queue.Queue[tuple[torch.Tensor, torch.cuda.Event]] = queue.Queue()
    for _ in range(workers * _SLOTS_PER_WORKER):
        pinned = torch.empty(chunk_size, dtype=torch.uint8, pin_memory=True)
        slots.put((pinned, torch.cuda.Event()))  # type: ignore[no-untyped-call]

    def work(job: Job) -> None:
        chunk, fd, dest = job
        pinned, copied = slots.get()
        try:
            copied.synchronize()  # the slot's previous copy has left it
            view = pinned.numpy().data[: chunk.size]
            _read_verified(fd, view, chunk, hashing.hasher(chunk))
            with torch.cuda.stream(side):
                end = chunk.offset + chunk.size
                dest[chunk.offset : end].copy_(pinned[: chunk.size], non_blocking=True)
                copied.record(side)
        finally:
            slots.put((pinned, copied))

    try:
        _run(jobs, work, workers)
    finally:
        side.synchronize()  # no copy may still read a slot once we return


def _tensors(path: str, buffer: torch.Tensor, manifest: Manifest) -> dict[str, torch.Tensor]:
    """The file's tensors as views into its verified buffer, laid out by its own header
    (which must agree with the manifest's tensor list when there is one)."""
    layout = _layout(path, buffer)
    listed = manifest.tensors_of(path)
    if listed:
        from_header = {(t.name, t.dtype, t.shape, t.start, t.size) for t in layout.tensors}
        from_manifest = {(t.name, t.dtype, t.shape, t.offset, t.size) for t in listed}
        if from_header != from_manifest:
            differ = sorted(n for n, *_ in from_header ^ from_manifest)
            raise LoaderError(f"{path}: header and manifest disagree on tensors {differ[:5]}")
    out = {}
    for t in layout.tensors:
        dtype = TORCH_DTYPES.get(t.dtype)
        if dtype is None:
            raise LoaderError(f"{path}: tensor {t.name!r} has dtype {t.dtype}, not loadable")
        raw = buffer[t.start : t.end]
        if raw.data_ptr() % dtype.itemsize:
            raw = raw.clone()  # reinterpreting needs aligned storage; the format does not
        out[t.name] = raw.view(dtype).reshape(t.shape)
    return out


def _layout(path: str, buffer: torch.Tensor) -> FileLayout:
    """Parse the header from the verified bytes (a small copy back when on a GPU)."""
    try:
        length = header_length(_host_bytes(buffer, LENGTH_PREFIX))
        end = min(LENGTH_PREFIX + length, buffer.numel())
        return parse_header(_host_bytes(buffer, end), buffer.numel())
    except LayoutError as exc:
        raise LoaderError(f"{path}: {exc}") from exc


def _host_bytes(buffer: torch.Tensor, n: int) -> bytes:
    return buffer[:n].cpu().numpy().tobytes()
