"""The node cache on disk: one copy of every staged byte, found by chunk digest.

Layout under the cache root (a hostPath):

    FORMAT                         cache format version ("weightship-cache 2")
    tmp/                           temp files; same filesystem, so renames are atomic
    models/<manifest-digest-hex>/
        manifest.json              the manifest, canonical bytes
        journal                    append-only chunk indexes verified and written (resume)
        partial/<path>.partial     preallocated; verified chunks are written at their offsets
        files/<path>               renamed from partial/ once every chunk verified (fsynced)
        STAGED                     completion marker, written by rename; mtime = last use

Each verified chunk is written once, with ``pwrite`` at its offset into its file's
``.partial``. When a file's last chunk is in, the file is fsynced once and renamed into
``files/``. There is no separate chunk store: a ``ChunkIndex`` (digest -> model, file,
offset, size) lets the peer server and dedupe find verified chunks inside the files.
Chunks are named by key, ``<algorithm>:<hex>`` (``sha256:`` for version 1 manifests,
``blake3:`` for version 2), so the two kinds of digest can never be confused.

Where a staged model's files lie is ``weightformat.cachedir`` (inference pods read it
without a ChunkStore). A model is staged through ``modelstaging.ModelStaging(store,
manifest)``, which builds on this module.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import shutil
import threading
import uuid
from collections.abc import Collection
from pathlib import Path
from typing import BinaryIO

from weightship.data.chunkindex import ChunkIndex, ChunkLocation
from weightship.data.claims import ClaimBoard
from weightship.data.slowrelay import RelayStatus
from weightship.linux import LIBC
from weightship.weightformat import cachedir
from weightship.weightformat.cachedir import MANIFEST_FILE, STAGED_MARKER
from weightship.weightformat.chunkhash import chunk_key, chunk_matches
from weightship.weightformat.entries import ChunkEntry
from weightship.weightformat.manifest import Manifest, digest_hex

log = logging.getLogger(__name__)

FORMAT_FILE = "FORMAT"
CACHE_FORMAT = "weightship-cache 2"
PARTIAL_SUFFIX = ".partial"
Buffer = bytes | bytearray | memoryview


class InsufficientSpaceError(RuntimeError):
    """The cache cannot hold a model even after evicting every unpinned model."""

    def __init__(self, needed: int, available: int, root: Path) -> None:
        super().__init__(
            f"not enough space in {root}: need {needed} bytes ({needed / 2**30:.2f} GiB), "
            f"{available} bytes ({available / 2**30:.2f} GiB) available after evicting "
            "every unpinned model"
        )
        self.needed = needed
        self.available = available


class StageBusyError(RuntimeError):
    """Another stager holds this model's lock."""


def verify_chunk(chunk: ChunkEntry, data: Buffer, *, max_threads: int = 1) -> bool:
    return chunk_matches(chunk, data, max_threads=max_threads)


_SYNC_FILE_RANGE_WRITE = 2
_sync_file_range = getattr(LIBC, "sync_file_range", None)
if _sync_file_range is not None:
    _sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
_fallocate = getattr(LIBC, "fallocate64", None) or getattr(LIBC, "fallocate", None)
if _fallocate is not None:
    _fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]


def allocate_blocks(fd: int, offset: int, length: int) -> bool:
    """Allocate the file's blocks in [offset, offset + length) (Linux ``fallocate``, mode
    0: sizes and data are untouched). False where the filesystem cannot. Not
    ``posix_fallocate``: where the filesystem cannot, glibc emulates it by writing a zero
    into every block that reads as zero, which races with chunks written meanwhile."""
    if _fallocate is None:
        return False
    if _fallocate(fd, 0, offset, length) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
        return False
    raise OSError(err, os.strerror(err))


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Start writing a range's dirty pages to disk without waiting (Linux
    ``sync_file_range``), so the fsync that finishes the file finds little left to write:
    the last file's fsync is on the stage's critical path. A no-op where unsupported;
    durability still comes from that fsync."""
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, length, _SYNC_FILE_RANGE_WRITE)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ChunkStore:
    def __init__(
        self, root: Path, *, capacity_bytes: int | None = None, reserve_bytes: int = 0
    ) -> None:
        """``capacity_bytes`` caps what the cache may use (the storage limit);
        ``reserve_bytes`` is disk space always left free for the node."""
        self.root = root
        self.capacity_bytes = capacity_bytes
        self.reserve_bytes = reserve_bytes
        root.mkdir(parents=True, exist_ok=True)
        self._check_format()
        for sub in ("tmp", "models"):
            (root / sub).mkdir(exist_ok=True)
        self.index = ChunkIndex()
        self.claims = ClaimBoard()  # this node's chunks handed to peers (claims.py)
        # Whole chunks the peer server is sending right now: peers that fell behind
        # (a stream of a chunk still landing is not counted). stage() reads it to hold
        # back its origin intake while this node's uplink is the bottleneck.
        self.uploads = InFlight()
        # Whether this node still relays: its peer server answers by it (slowrelay.py).
        self.relaying = RelayStatus()
        for digest in self.models():
            self._index_finished_files(digest)

    def _check_format(self) -> None:
        """Discard a cache written in another format (nothing is migrated)."""
        marker = self.root / FORMAT_FILE
        try:
            found = marker.read_text().strip()
        except FileNotFoundError:
            found = None
        if found == CACHE_FORMAT:
            return
        old = [self.root / s for s in ("chunks", "models", "tmp") if (self.root / s).is_dir()]
        if any(any(p.iterdir()) for p in old):
            log.warning(
                "discarding the node cache in %s: it is in format %r, this agent uses %r; "
                "its models will be fetched again",
                self.root,
                found or "weightship-cache 1",
                CACHE_FORMAT,
            )
        for p in old:
            shutil.rmtree(p, ignore_errors=True)
        (self.root / "tmp").mkdir(exist_ok=True)
        tmp = self.temp_path("format")
        tmp.write_text(CACHE_FORMAT + "\n")
        tmp.replace(marker)

    # Chunks -----------------------------------------------------------------------------

    def locate(self, key: str) -> ChunkLocation | None:
        return self.index.get(chunk_key(key))

    def has_chunk(self, key: str) -> bool:
        return self.locate(key) is not None

    def open_chunk(self, key: str, wait_s: float = 0.0) -> tuple[BinaryIO, ChunkLocation] | None:
        """An open file holding the verified chunk, and where in it; None when absent.

        ``wait_s`` > 0 waits that long for the chunk to land. The caller closes the file.
        """
        key = chunk_key(key)
        loc = self.index.wait(key, wait_s) if wait_s > 0 else self.index.get(key)
        if loc is None:
            return None
        return self.open_location(loc)

    def open_location(self, loc: ChunkLocation) -> tuple[BinaryIO, ChunkLocation] | None:
        """The file holding ``loc`` (final or still partial), open; None when evicted."""
        mdir = self.root / "models" / loc.model
        final, partial = final_path(mdir, loc.path), partial_path(mdir, loc.path)
        for path in (final, partial, final):  # the partial may be renamed in between
            try:
                return open(path, "rb"), loc  # the caller closes it
            except FileNotFoundError:
                continue
        return None  # evicted meanwhile

    def read_chunk(self, key: str, start: int = 0, end: int | None = None) -> bytes | None:
        """Bytes [start, end) of a verified chunk, or None when the chunk is absent."""
        found = self.open_chunk(key)
        if found is None:
            return None
        f, loc = found
        with f:
            stop = loc.size if end is None else min(end, loc.size)
            return os.pread(f.fileno(), max(0, stop - start), loc.offset + start)

    def discard_temp_files(self) -> None:
        """Remove temp files left by a crash. Call once at agent start, before staging."""
        for p in (self.root / "tmp").iterdir():
            p.unlink(missing_ok=True)

    def temp_path(self, hint: str) -> Path:
        """A fresh path under the cache's ``tmp/`` (nothing is created there), named after
        ``hint``. It is on the models' filesystem, so writing it and then renaming it into
        place (``Path.replace``) publishes a file atomically; a crash leaves only temp
        files, which ``discard_temp_files`` removes."""
        return self.root / "tmp" / f"{hint[:16]}.{uuid.uuid4().hex}"

    def _index_finished_files(self, digest: str) -> None:
        """Index the chunks of a model's finished (fsynced, renamed) files. Partial files
        are indexed when their stage resumes and re-verifies them."""
        mdir = self.model_dir(digest)
        manifest = _saved_manifest(mdir)
        if manifest is None:
            return
        sizes = {f.path: f.size for f in manifest.files}
        finished = {p for p, size in sizes.items() if size_or_none(final_path(mdir, p)) == size}
        for c in manifest.chunks:
            if c.file in finished:
                self.index.add(c.key, ChunkLocation(mdir.name, c.file, c.offset, c.size))

    # Models -----------------------------------------------------------------------------

    def model_dir(self, digest: str) -> Path:
        return cachedir.model_dir(self.root, digest)

    def files_dir(self, digest: str) -> Path:
        return self.model_dir(digest) / "files"

    def is_staged(self, digest: str) -> bool:
        return (self.model_dir(digest) / STAGED_MARKER).is_file()

    def models(self) -> list[str]:
        return sorted("sha256:" + p.name for p in (self.root / "models").iterdir() if p.is_dir())

    def touch(self, digest: str) -> None:
        """Record a use of a staged model, for LRU eviction."""
        os.utime(self.model_dir(digest) / STAGED_MARKER)

    # Space ------------------------------------------------------------------------------

    def used_bytes(self) -> int:
        return sum(_tree_size(self.root / sub) for sub in ("tmp", "models"))

    def available_bytes(self) -> int:
        free = shutil.disk_usage(self.root).free - self.reserve_bytes
        if self.capacity_bytes is not None:
            free = min(free, self.capacity_bytes - self.used_bytes())
        return max(0, free)

    def ensure_space(self, needed: int, pinned: Collection[str]) -> list[str]:
        """Evict least-recently-used unpinned models until ``needed`` bytes fit.

        Returns the evicted digests; raises InsufficientSpaceError (evicting nothing)
        when even evicting every unpinned model would not make room.
        """
        available = self.available_bytes()
        if needed <= available:
            return []
        keep = {digest_hex(d) for d in pinned}
        candidates = [d for d in self._models_by_last_use() if digest_hex(d) not in keep]
        reclaimable = available + sum(self._exclusive_bytes(d) for d in candidates)
        if needed > reclaimable:
            raise InsufficientSpaceError(needed, reclaimable, self.root)
        evicted = []
        for digest in candidates:
            if self.available_bytes() >= needed:
                break
            if self.evict(digest):
                evicted.append(digest)
        if self.available_bytes() < needed:
            raise InsufficientSpaceError(needed, self.available_bytes(), self.root)
        return evicted

    def eviction_plan(self, needed: int, pinned: Collection[str]) -> list[str]:
        """The unpinned models, least recently used first, that ``ensure_space`` would
        evict to fit ``needed`` bytes; evicts nothing. Lets a caller report them first.

        Raises InsufficientSpaceError when even evicting all of them would not do.
        """
        available = self.available_bytes()
        if needed <= available:
            return []
        keep = {digest_hex(d) for d in pinned}
        plan = []
        for digest in self._models_by_last_use():
            if digest_hex(digest) in keep:
                continue
            plan.append(digest)
            available += self._exclusive_bytes(digest)
            if available >= needed:
                return plan
        raise InsufficientSpaceError(needed, available, self.root)

    def missing_bytes(self, manifest: Manifest) -> int:
        """What staging ``manifest`` still needs on disk: its files not finished yet, less
        what their preallocated partial files already hold (the sum ``stage()`` checks).
        Each byte is stored once, so a staged model takes S."""
        mdir = self.model_dir(manifest.digest)
        needed = 0
        for f in manifest.files:
            if size_or_none(final_path(mdir, f.path)) == f.size:
                continue
            needed += f.size - min(f.size, allocated(partial_path(mdir, f.path)))
        return needed

    def evict(self, digest: str) -> bool:
        """Remove a model (its files are the only copy of its chunks).

        Returns False when the model is being staged right now.
        """
        mdir = self.model_dir(digest)
        try:
            lock = ModelLock(mdir)
        except StageBusyError:
            return False
        try:
            # Unmark first: a half-deleted model must never look staged.
            (mdir / STAGED_MARKER).unlink(missing_ok=True)
            self.index.drop_model(mdir.name)  # peers are no longer sent there
            for sub in ("files", "partial"):
                shutil.rmtree(mdir / sub, ignore_errors=True)
            for name in (MANIFEST_FILE, "journal"):
                (mdir / name).unlink(missing_ok=True)
        finally:
            lock.release()
        shutil.rmtree(mdir, ignore_errors=True)
        return True

    def _models_by_last_use(self) -> list[str]:
        def last_use(digest: str) -> float:
            mdir = self.model_dir(digest)
            for name in (STAGED_MARKER, "journal", MANIFEST_FILE):
                try:
                    return (mdir / name).stat().st_mtime
                except FileNotFoundError:
                    continue
            return 0.0

        return sorted(self.models(), key=last_use)

    def _exclusive_bytes(self, digest: str) -> int:
        """What evicting ``digest`` alone would free: models share no files."""
        return _tree_size(self.model_dir(digest))


class ModelLock:
    def __init__(self, model_dir: Path) -> None:
        model_dir.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(model_dir / "lock", os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(self._fd)
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                raise StageBusyError(f"{model_dir} is locked by another stager") from exc
            raise

    def release(self) -> None:
        os.close(self._fd)


def final_path(model_dir: Path, path: str) -> Path:
    return model_dir / "files" / path


def partial_path(model_dir: Path, path: str) -> Path:
    return model_dir / "partial" / (path + PARTIAL_SUFFIX)


def _saved_manifest(model_dir: Path) -> Manifest | None:
    try:
        data = (model_dir / MANIFEST_FILE).read_bytes()
    except FileNotFoundError:
        return None
    return Manifest.parse(data, source=str(model_dir))


class InFlight:
    """How many of something are under way (``with gauge:`` around each); thread-safe."""

    def __init__(self) -> None:
        self._count = 0
        self._lock = threading.Lock()

    @property
    def count(self) -> int:
        return self._count

    def __enter__(self) -> InFlight:
        with self._lock:
            self._count += 1
        return self

    def enter_below(self, limit: int) -> bool:
        """Count one more, if fewer than ``limit`` are under way (one step: concurrent
        callers never overshoot it); ``leave`` when done."""
        with self._lock:
            if self._count >= limit:
                return False
            self._count += 1
            return True

    def __exit__(self, *exc: object) -> None:
        self.leave()

    def leave(self) -> None:
        with self._lock:
            self._count -= 1


def allocated(path: Path) -> int:
    """Bytes of disk a file holds (a preallocated file holds its size)."""
    try:
        return path.stat().st_blocks * 512
    except FileNotFoundError:
        return 0


def size_or_none(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return None


def _tree_size(root: Path) -> int:
    total = 0
    for dirpath, _, names in os.walk(root):
        total += sum(size_or_none(Path(dirpath) / n) or 0 for n in names)
    return total
