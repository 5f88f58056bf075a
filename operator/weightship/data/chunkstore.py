"""The node cache on disk, content addressed.

Layout under the cache root (a hostPath):

    chunks/<sha256-hex>            verified chunks only (temp file, fsync, rename)
    tmp/                           temp files; same filesystem, so renames are atomic
    models/<manifest-digest-hex>/
        manifest.json              the manifest, canonical bytes
        journal                    append-only verified chunk indexes (resume)
        files/<path>               a file appears here only once all its chunks verified
        STAGED                     completion marker, written by rename; mtime = last use

A chunk file exists under its digest only after its bytes matched that digest, so a
restarted stage, or another model sharing the chunk, never fetches it again.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import shutil
import uuid
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import BinaryIO

from weightship.data.manifest import SHA256_HEX, Manifest, validate_relative_path

STAGED_MARKER = "STAGED"
_COPY_BLOCK = 1024 * 1024


class ChunkVerificationError(ValueError):
    """Bytes did not match the digest they were fetched for."""


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


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def verify_chunk(data: bytes, sha256: str) -> bool:
    return sha256_hex(data) == sha256


def digest_hex(digest: str) -> str:
    """'sha256:<hex>' or '<hex>' -> '<hex>', rejecting anything else."""
    hex_part = digest.removeprefix("sha256:")
    if not SHA256_HEX.match(hex_part):
        raise ValueError(f"not a sha256 digest: {digest!r}")
    return hex_part


def _fsync_dir(path: Path) -> None:
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
        for sub in ("chunks", "tmp", "models"):
            (root / sub).mkdir(parents=True, exist_ok=True)

    # Chunks -----------------------------------------------------------------------------

    def chunk_path(self, sha256: str) -> Path:
        return self.root / "chunks" / digest_hex(sha256)

    def has_chunk(self, sha256: str) -> bool:
        return self.chunk_path(sha256).is_file()

    def put_chunk(self, sha256: str, data: bytes) -> Path:
        """Verify ``data`` and store it under its digest. Raises ChunkVerificationError."""
        if not verify_chunk(data, sha256):
            raise ChunkVerificationError(f"chunk bytes do not match sha256 {sha256}")
        final = self.chunk_path(sha256)
        if final.is_file():
            return final
        tmp = self._temp_path(final.name)
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(final)
        return final

    def read_chunk(self, sha256: str, start: int = 0, end: int | None = None) -> bytes | None:
        """Bytes [start, end) of a verified chunk, or None when the chunk is absent."""
        try:
            with open(self.chunk_path(sha256), "rb") as f:
                f.seek(start)
                return f.read(-1 if end is None else end - start)
        except FileNotFoundError:
            return None

    def discard_temp_files(self) -> None:
        """Remove temp files left by a crash. Call once at agent start, before staging."""
        for p in (self.root / "tmp").iterdir():
            p.unlink(missing_ok=True)

    def _temp_path(self, hint: str) -> Path:
        return self.root / "tmp" / f"{hint[:16]}.{uuid.uuid4().hex}"

    # Models -----------------------------------------------------------------------------

    def model_dir(self, digest: str) -> Path:
        return self.root / "models" / digest_hex(digest)

    def files_dir(self, digest: str) -> Path:
        return self.model_dir(digest) / "files"

    def is_staged(self, digest: str) -> bool:
        return (self.model_dir(digest) / STAGED_MARKER).is_file()

    def models(self) -> list[str]:
        return sorted("sha256:" + p.name for p in (self.root / "models").iterdir() if p.is_dir())

    def touch(self, digest: str) -> None:
        """Record a use of a staged model, for LRU eviction."""
        os.utime(self.model_dir(digest) / STAGED_MARKER)

    def begin(self, manifest: Manifest) -> ModelStaging:
        return ModelStaging(self, manifest)

    # Space ------------------------------------------------------------------------------

    def used_bytes(self) -> int:
        return sum(_tree_size(self.root / sub) for sub in ("chunks", "tmp", "models"))

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
        """What staging ``manifest`` still needs on disk: its unique chunks not in the
        store, plus its files not assembled yet (the same sum ``stage()`` checks)."""
        files_dir = self.files_dir(manifest.digest)
        chunks = {c.sha256: c.size for c in manifest.chunks if not self.has_chunk(c.sha256)}
        files = [f for f in manifest.files if not (files_dir / f.path).is_file()]
        return sum(chunks.values()) + sum(f.size for f in files)

    def evict(self, digest: str) -> bool:
        """Remove a model and the chunks no other model references.

        Returns False when the model is being staged right now.
        """
        mdir = self.model_dir(digest)
        try:
            lock = _ModelLock(mdir)
        except StageBusyError:
            return False
        try:
            # Unmark first: a half-deleted model must never look staged.
            (mdir / STAGED_MARKER).unlink(missing_ok=True)
            own = set(_manifest_chunk_digests(mdir))
            for sha in own - self._referenced_elsewhere(digest):
                self.chunk_path(sha).unlink(missing_ok=True)
            shutil.rmtree(mdir / "files", ignore_errors=True)
            for name in ("manifest.json", "journal"):
                (mdir / name).unlink(missing_ok=True)
        finally:
            lock.release()
        shutil.rmtree(mdir, ignore_errors=True)
        return True

    def _referenced_elsewhere(self, digest: str) -> set[str]:
        """Chunk digests that models other than ``digest`` (staged or staging) need."""
        me = digest_hex(digest)
        return {
            sha
            for d in self.models()
            if digest_hex(d) != me
            for sha in _manifest_chunk_digests(self.model_dir(d))
        }

    def _models_by_last_use(self) -> list[str]:
        def last_use(digest: str) -> float:
            mdir = self.model_dir(digest)
            for name in (STAGED_MARKER, "journal", "manifest.json"):
                try:
                    return (mdir / name).stat().st_mtime
                except FileNotFoundError:
                    continue
            return 0.0

        return sorted(self.models(), key=last_use)

    def _exclusive_bytes(self, digest: str) -> int:
        """What evicting ``digest`` alone would free."""
        mdir = self.model_dir(digest)
        exclusive = set(_manifest_chunk_digests(mdir)) - self._referenced_elsewhere(digest)
        chunk_bytes = sum(_size_or_zero(self.chunk_path(sha)) for sha in exclusive)
        return chunk_bytes + _tree_size(mdir / "files")


class ModelStaging:
    """One model being staged: holds its lock, journal, and file materialization."""

    def __init__(self, store: ChunkStore, manifest: Manifest) -> None:
        self.store = store
        self.manifest = manifest
        self.dir = store.model_dir(manifest.digest)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = _ModelLock(self.dir)
        manifest_path = self.dir / "manifest.json"
        if not manifest_path.is_file():
            tmp = store._temp_path("manifest")
            tmp.write_bytes(manifest.canonical_bytes())
            tmp.replace(manifest_path)
        (self.dir / "files").mkdir(exist_ok=True)
        self._journal = os.open(self.dir / "journal", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def close(self) -> None:
        os.close(self._journal)
        self._lock.release()

    def __enter__(self) -> ModelStaging:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def is_staged(self) -> bool:
        return (self.dir / STAGED_MARKER).is_file()

    def journaled(self) -> set[int]:
        """Chunk indexes the journal lists whose chunk is still in the store."""
        text = (self.dir / "journal").read_text()
        lines = text.split("\n")[:-1]  # a torn last line (crash mid-write) has no newline
        chunks = self.manifest.chunks
        indexes = {int(s) for s in lines if s.isdigit() and int(s) < len(chunks)}
        return {i for i in indexes if self.store.has_chunk(chunks[i].sha256)}

    def record(self, indexes: Iterable[int]) -> None:
        """Append verified chunk indexes; one write, so lines never interleave."""
        line = "".join(f"{i}\n" for i in indexes)
        if line:
            os.write(self._journal, line.encode())

    def file_path(self, path: str) -> Path:
        return self.dir / "files" / validate_relative_path(path)

    def is_materialized(self, path: str) -> bool:
        return self.file_path(path).is_file()

    def materialize(self, path: str) -> None:
        """Assemble a file from its verified chunks and move it under its final name."""
        tmp = self.store._temp_path("file")
        with open(tmp, "wb") as out:
            for chunk in self.manifest.chunks_of(path):
                with open(self.store.chunk_path(chunk.sha256), "rb") as src:
                    _copy_all(src, out, chunk.size)
            out.flush()
            os.fsync(out.fileno())
        final = self.file_path(path)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp.replace(final)

    def mark_staged(self) -> None:
        """Write the completion marker, after checking every file is in place."""
        for f in self.manifest.files:
            p = self.file_path(f.path)
            if not p.is_file() or p.stat().st_size != f.size:
                raise RuntimeError(
                    f"cannot mark {self.manifest.digest} staged: {f.path} incomplete"
                )
        _fsync_dir(self.dir / "files")
        tmp = self.store._temp_path("staged")
        tmp.write_text(self.manifest.digest + "\n")
        tmp.replace(self.dir / STAGED_MARKER)
        _fsync_dir(self.dir)


class _ModelLock:
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


def _copy_all(src: BinaryIO, dst: BinaryIO, size: int) -> None:
    """Append ``src`` to ``dst`` in the kernel (a reflink on XFS/btrfs) where possible."""
    copied = 0
    try:
        while copied < size:
            n = os.copy_file_range(src.fileno(), dst.fileno(), size - copied)
            if n == 0:
                break
            copied += n
    except OSError:
        pass  # filesystems without copy_file_range: copy in user space below
    if copied < size:
        src.seek(copied)
        dst.seek(0, os.SEEK_END)
        shutil.copyfileobj(src, dst, _COPY_BLOCK)


def _manifest_chunk_digests(model_dir: Path) -> list[str]:
    try:
        data = (model_dir / "manifest.json").read_bytes()
    except FileNotFoundError:
        return []
    return [c.sha256 for c in Manifest.parse(data, source=str(model_dir)).chunks]


def _size_or_zero(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _tree_size(root: Path) -> int:
    total = 0
    for dirpath, _, names in os.walk(root):
        total += sum(_size_or_zero(Path(dirpath) / n) for n in names)
    return total
