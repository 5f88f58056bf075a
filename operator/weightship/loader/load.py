"""Load a staged model into memory, every byte checked against the manifest on the way in.

Each file is read once, chunk by chunk, by a pool of threads. A chunk is read in pieces
(``READ_PIECE``) with ``os.preadv`` straight into the file's destination (no
intermediate copy), and each piece is fed to the chunk's hasher (BLAKE3 for a version 2
manifest, sha256 for a version 1 one) right after it lands, while it is still in the
core's cache, so the hash costs no second trip through memory. preadv, blake3 and
hashlib release the GIL, so reads and hashes of different chunks run on every core.
Nothing is returned until every chunk matched, so no tensor is ever built on bytes that
were not verified.

On the CPU each file lands in one buffer and tensors are views into it. On a GPU, each
worker reads a chunk into a pinned host slot, hashes it, and queues its copy into the
file's device buffer on a side stream, then goes on to the next chunk while the copy
runs: reads, hashes and host-to-device copies overlap, and host memory stays at a few
chunks however large the model. Tensors are views into the device buffers.
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
# Bytes read (and then hashed) at a time: small enough to still be in the core's L2 cache
# (1 MiB here) when the hasher reads them, large enough that a syscall per piece is noise.
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
    manifest_path = files.parent / "manifest.json"
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
        host_bytes = sum(f.size for f in entries if not _on_device(f, target))
        huge = huge_blocks_cover(host_bytes, *_kernel_memory())
        buffers = {f.path: _destination(f, target, huge) for f in entries}
        jobs = [(c, opened[c.file], buffers[c.file]) for c in manifest.chunks if c.file in opened]
        hashing = _Hashing(verify, max(1, hash_threads))
        if target.type == "cuda":
            _read_to_device(jobs, target, manifest.chunk_size, hashing, workers)
        else:
            _run(jobs, lambda job: _read_chunk(*job, hashing=hashing), workers)

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


def _destination(entry: FileEntry, target: torch.device, huge: bool) -> torch.Tensor:
    """Where a file's bytes go: device memory for a GPU's tensors, host memory otherwise."""
    if _on_device(entry, target):
        return torch.empty(entry.size, dtype=torch.uint8, device=target)
    return host_buffer(entry.size, huge=huge)


def host_buffer(size: int, *, huge: bool) -> torch.Tensor:
    """``size`` bytes of fresh host memory, advised into transparent huge pages if
    ``huge`` (see ``huge_blocks_cover``). The first write to each 4 KiB page of a plain
    allocation takes a page fault, a third of a verified load's CPU (docs/loader.md); a
    huge page takes one fault for 512 of them. Advised memory may also make the fault
    path compact memory (THP ``defrag=madvise``), which once made loads 3x slower on a
    fragmented host: so a load advises only when free huge blocks already cover all its
    buffers. The tensor keeps the mapping alive."""
    if size == 0:
        return torch.empty(0, dtype=torch.uint8)
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only
    if huge and advice is not None:
        mapping.madvise(advice)
    return torch.frombuffer(mapping, dtype=torch.uint8)


def huge_blocks_cover(size: int, buddyinfo: str, huge_page: int) -> bool:
    """Whether /proc/buddyinfo's free blocks of ``huge_page`` bytes or larger (the
    buddy allocator's counts per order, from ``mmap.PAGESIZE`` up) hold ``size`` bytes."""
    if huge_page <= 0:
        return False
    free = 0
    for line in buddyinfo.splitlines():
        counts = line.split()[4:]  # "Node 0, zone Normal" then one count per order
        for order, count in enumerate(counts):
            if count.isdigit() and mmap.PAGESIZE << order >= huge_page:
                free += int(count) * (mmap.PAGESIZE << order)
    return free >= size


def _kernel_memory() -> tuple[str, int]:
    """The kernel's free-block counts and its huge page size, or ("", 0) without THP."""
    try:
        buddyinfo = Path("/proc/buddyinfo").read_text()
        huge = Path("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size").read_text()
        return buddyinfo, int(huge)
    except (OSError, ValueError):
        return "", 0


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


def _read_chunk(chunk: ChunkEntry, fd: int, dest: torch.Tensor, *, hashing: _Hashing) -> None:
    """Read a chunk into its place in a host buffer, hashing it there as it lands."""
    view = dest.numpy().data[chunk.offset : chunk.offset + chunk.size]
    _read_verified(fd, view, chunk, hashing.hasher(chunk))


def _read_verified(
    fd: int, view: memoryview, chunk: ChunkEntry, hasher: ChunkHasher | None
) -> None:
    """Fill ``view`` with the chunk's bytes from the file, piece by piece, each piece fed
    to ``hasher`` while it is hot in cache; then the digest must be the manifest's."""
    done = 0
    while done < chunk.size:
        n = os.preadv(fd, [view[done : min(chunk.size, done + READ_PIECE)]], chunk.offset + done)
        if n == 0:  # the file shrank since its size was checked
            got = f"{done} bytes"
            raise WeightsVerificationError(chunk.file, chunk.index, f"{chunk.size} bytes", got)
        if hasher is not None:
            hasher.update(view[done : done + n])
        done += n
    if hasher is not None and (got := hasher.hexdigest()) != chunk.hexdigest:
        raise WeightsVerificationError(
            chunk.file, chunk.index, chunk.hexdigest, got, algorithm=chunk.algorithm
        )


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
