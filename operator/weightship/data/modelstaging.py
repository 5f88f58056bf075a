"""One model being staged: verified chunks written once, in place, then files renamed.

Each chunk lands at its offset in its file's preallocated ``partial/<path>.partial``:
either received straight into a shared mapping of its slot (``receive``: the socket's
bytes are copied once, into the page cache) or written with ``pwrite`` (``put``). It is
journaled only once its digest matched; bytes that did not match stay in the partial
file unjournaled, so a resume fetches them again.

With a piece layer (version 2 manifests), ``receive`` verifies each piece as it lands
and publishes the verified prefix (``ChunkIndex.start_receiving``), so the peer server
streams those bytes on while the rest arrives. The prefix only grows: a failed attempt
(bad piece, source gone) keeps it, and the next attempt, from any source, starts there.

When a file's last chunk is in, the file is fsynced once (which also writes pages
dirtied through mappings) and renamed into ``files/``. No file appears under its final
name before every one of its chunks verified. See ``chunkstore`` for the layout.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import shutil
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from weightship.data.chunkindex import ChunkLocation, Receiving
from weightship.data.chunkstore import (
    Buffer,
    ChunkStore,
    ModelLock,
    allocate_blocks,
    allocated,
    final_path,
    fsync_dir,
    partial_path,
    size_or_none,
    start_writeback,
    verify_chunk,
)
from weightship.weightformat.cachedir import MANIFEST_FILE, STAGED_MARKER
from weightship.weightformat.chunkhash import (
    ChunkVerificationError,
    PieceLayer,
    chunk_digest,
    chunk_key,
)
from weightship.weightformat.entries import ChunkEntry
from weightship.weightformat.manifest import Manifest
from weightship.weightformat.paths import validate_relative_path

log = logging.getLogger(__name__)

Landed = Callable[[int], None]
# fill(view, start, landed): write the chunk's bytes [start, end) into view[start:end] in
# order, calling landed(n) whenever bytes [0, n) are in; return the end reached.
Fill = Callable[[memoryview, int, Landed], int]


class ChunkIncompleteError(RuntimeError):
    """The source stopped before the chunk's end (a stream that ended early): what was
    verified is kept, and the next attempt starts there. Not a verification failure."""


class ResumeMovedError(RuntimeError):
    """The attempt was set up to start at one offset, and the chunk's verified prefix is
    elsewhere now (another attempt moved it): ask again."""


_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14; Python 3.13


class ModelStaging:
    """One model being staged: holds its lock and journal, and writes verified chunks
    into preallocated partial files, renaming each file into place once complete.

    Thread-safe: workers call ``put`` and ``receive`` concurrently (distinct offsets)."""

    # False (the default): ``receive`` fills a buffer, reused from chunk to chunk, and
    # writes it with ``pwrite``. True: the bytes land in the file's shared mapping, which
    # saves that copy but faults in and zeroes 16 MiB of fresh page cache per chunk first:
    # slower on a quiet 2-core machine (docs/benchmarks.md, P1). The benchmark A/Bs both.
    map_partial_files = False

    def __init__(
        self,
        store: ChunkStore,
        manifest: Manifest,
        *,
        pieces: PieceLayer | None = None,
        hash_threads: int = 1,
    ) -> None:
        """Lock ``manifest``'s model in ``store`` for staging (StageBusyError when another
        stager holds it). ``pieces``: the manifest's piece layer, to verify pieces as they
        land (None: each chunk is verified whole). ``hash_threads``: BLAKE3 threads for a
        whole chunk."""
        self.store = store
        self.manifest = manifest
        self.pieces = pieces
        self.hash_threads = hash_threads
        self._receiving: dict[str, Receiving] = {}  # chunks landing piece by piece
        # Slot buffers of finished receives, reused: a fresh one faults in every page.
        # At most one per receive in flight (the stage's workers); freed with the stage.
        self._buffers: list[bytearray] = []
        self.dir = store.model_dir(manifest.digest)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = ModelLock(self.dir)
        manifest_path = self.dir / MANIFEST_FILE
        if not manifest_path.is_file():
            tmp = store.temp_path("manifest")
            tmp.write_bytes(manifest.canonical_bytes())
            tmp.replace(manifest_path)
        (self.dir / "files").mkdir(exist_ok=True)
        self._journal = os.open(self.dir / "journal", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._mutex = threading.Lock()
        self._fds: dict[str, int] = {}  # open partial files
        self._reserved: set[str] = set()  # partial files whose every block is allocated
        self._reserver: threading.Thread | None = None  # allocating them (prepare)
        self._closing = threading.Event()
        self._claimed: set[int] = set()  # chunk indexes being written right now
        self._indexes_of: dict[str, list[int]] = {}
        for i, c in enumerate(manifest.chunks):
            self._indexes_of.setdefault(c.key, []).append(i)
        self._sizes = {f.path: f.size for f in manifest.files}
        self._done = self._recover()
        self._remaining = {f.path: 0 for f in manifest.files}
        for i, c in enumerate(manifest.chunks):
            if i not in self._done:
                self._remaining[c.file] += 1

    def close(self) -> None:
        self._closing.set()
        self.wait_reserved()
        with self._mutex:
            fds, self._fds = list(self._fds.values()), {}
            receiving, self._receiving = dict(self._receiving), {}
        for key, r in receiving.items():
            self.store.index.stop_receiving(key, r)
        for fd in fds:
            os.close(fd)
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
        """Chunk indexes whose verified bytes are in place (journal checked at begin)."""
        with self._mutex:
            return set(self._done)

    def has(self, key: str) -> bool:
        """Every chunk of the model with this key is in place."""
        key = chunk_key(key)
        with self._mutex:
            return all(i in self._done for i in self._indexes_of.get(key, [-1]))

    @property
    def piece_size(self) -> int | None:
        """Pieces are verified as they land, this many bytes each (None: chunks whole)."""
        return self.pieces.piece_size if self.pieces is not None else None

    def resume_point(self, key: str) -> int:
        """Where the next attempt at this chunk starts: its verified prefix when its
        pieces are verified as they land, else 0."""
        with self._mutex:
            r = self._receiving.get(chunk_key(key))
            return r.verified if r is not None else 0

    def file_path(self, path: str) -> Path:
        return final_path(self.dir, validate_relative_path(path))

    def is_materialized(self, path: str) -> bool:
        return size_or_none(self.file_path(path)) == self._sizes[path]

    def missing_bytes(self) -> int:
        return self.store.missing_bytes(self.manifest)

    def prepare(self) -> None:
        """Size the partial file of every unfinished file and start allocating their
        blocks in the background, and finish the files that need no chunk (empty ones, or
        all chunks in place before a crash).

        The blocks are allocated by a thread of their own (``wait_reserved``), so the
        first chunks do not wait for it: on tmpfs, allocating is zeroing, and 512 MiB took
        0.5 s before the first byte was asked for (docs/benchmarks.md). Chunks land in a
        file's mapping only once its blocks are allocated (``receive``); before that,
        with ``pwrite``, which allocates what it writes."""
        paths = [f.path for f in self.manifest.files if not self.is_materialized(f.path)]
        for path in paths:
            self._open_partial(path)
        self.wait_reserved()  # prepared before: one thread at a time
        self._reserver = threading.Thread(
            target=self._reserve, args=(paths,), name="weightship-reserve", daemon=True
        )
        self._reserver.start()
        for path in [p for p, n in self._remaining.items() if n == 0]:
            if not self.is_materialized(path):
                self._finish_file(path)

    def wait_reserved(self) -> None:
        """Wait until the blocks of every partial file ``prepare`` sized are allocated
        (or found not allocatable)."""
        if self._reserver is not None:
            if self._reserver.native_id is not None and self._reserver.is_alive():
                _normal_priority(self._reserver.native_id)  # waited for now: not idle work
            self._reserver.join()

    def _reserve(self, paths: list[str]) -> None:
        _idle_priority()
        for path in paths:
            if self._closing.is_set():
                return
            with self._mutex:
                fd = self._fds.get(path)
                if fd is None or path in self._reserved:
                    continue
                # Its own descriptor: a file finished meanwhile closes the stage's.
                fd = os.dup(fd)
            try:
                reserved = _preallocate(fd, self._sizes[path], self._closing)
            except OSError as exc:  # a full disk: the writes that need the space say so
                log.warning("could not reserve the space of %s: %s", path, exc)
                reserved = False
            finally:
                os.close(fd)
            if reserved:
                with self._mutex:
                    self._reserved.add(path)

    def put(self, key: str, data: Buffer, *, verified_digest: str | None = None) -> int:
        """Verify ``data`` and write it at every not-yet-written chunk with this key;
        journal them; finish (fsync, rename) the files it completes. Returns how many
        chunk positions were written. ``verified_digest``: the hex digest the caller
        already computed over these exact bytes, in the chunk's algorithm.

        Raises ChunkVerificationError, writing nothing, when the bytes do not match."""
        key = chunk_key(key)
        chunk = self._entry(key)
        if chunk is None:
            return 0
        actual = verified_digest
        if actual is None and len(data) == chunk.size:
            actual = chunk_digest(chunk, data, max_threads=self.hash_threads)
        if actual != chunk.hexdigest or len(data) != chunk.size:
            raise ChunkVerificationError(f"chunk bytes do not match {key}")
        todo = self._claim(key)
        try:
            self._write_at(todo, data)
        except BaseException:
            self._unclaim(todo)
            raise
        return self._commit(key, todo)

    def receive(self, key: str, fill: Fill, *, start: int | None = None) -> int:
        """Like ``put``, with the bytes landing in place: ``fill`` writes the chunk into
        a shared mapping of its slot in the partial file (the first not-yet-written
        position with this key). Saves ``put``'s copy through a buffer. Fetches
        nothing, returning 0, when no position needs the chunk.

        With a piece layer each piece is verified as it lands and the verified prefix is
        published for the peer server; ``fill`` starts at that prefix (``start``, when
        given, must be it: ResumeMovedError otherwise). Without one the whole chunk is
        hashed once it is in. Raises ChunkVerificationError (PieceVerificationError for
        a bad piece) when bytes do not match: the slot keeps them but they are neither
        journaled nor served, and are fetched again; ChunkIncompleteError when the
        source stopped early. Partial files whose space could not be preallocated are
        filled through a buffer: a write fault on a mapped page with no disk block
        behind it is a SIGBUS."""
        key = chunk_key(key)
        todo = self._claim(key)
        if not todo:
            return 0
        first = self.manifest.chunks[todo[0]]
        receiving: Receiving | None = None
        try:
            fd = self._open_partial(first.file)
            checker = self.pieces.checker(first) if self.pieces is not None else None
            if checker is not None:
                receiving = self._receiving_for(key, first)
                checker.start_at(receiving.verified)
            begin = checker.verified if checker is not None else 0
            if start is not None and start != begin:
                raise ResumeMovedError(f"chunk {key}: verified to {begin}, not {start}")
            mapped = self.map_partial_files and first.file in self._reserved and first.size
            with self._slot(fd, first, mapped=bool(mapped), prefix=begin) as view:

                def landed(end: int) -> None:
                    if checker is None or receiving is None:
                        return
                    before = checker.verified
                    try:
                        checker.landed(view, end)
                    finally:  # at a bad piece too: the good pieces before it are kept
                        now = checker.verified
                        if now > before:
                            if not mapped:  # the peer server reads the file: write it first
                                _pwrite_all(fd, view[before:now], first.offset + before)
                            receiving.advance(now)

                # Every piece verified in an attempt that failed after (a peer gone while
                # ending its answer): nothing left to fetch.
                end = begin if begin == first.size else fill(view, begin, landed)
                if checker is not None:
                    landed(end)
                    if checker.verified != first.size:
                        raise ChunkIncompleteError(
                            f"chunk {key}: the source stopped at {end} of {first.size} bytes"
                        )
                else:
                    if end != first.size:
                        raise ChunkIncompleteError(
                            f"chunk {key}: the source stopped at {end} of {first.size} bytes"
                        )
                    if not verify_chunk(first, view, max_threads=self.hash_threads):
                        raise ChunkVerificationError(f"chunk bytes do not match {key}")
                    if not mapped:
                        _pwrite_all(fd, view, first.offset)
                self._write_at(todo[1:], view)
            # After the unmap: starting the writeback of mapped pages write-protects them,
            # a TLB shootdown per folio (4 % of the client's CPU in a profile).
            start_writeback(fd, first.offset, first.size)
        except BaseException:
            self._unclaim(todo)
            raise
        n = self._commit(key, todo)
        if receiving is not None:  # indexed whole now: the server serves it from there
            with self._mutex:
                self._receiving.pop(key, None)
            self.store.index.stop_receiving(key, receiving)
        return n

    @contextlib.contextmanager
    def _slot(
        self, fd: int, chunk: ChunkEntry, *, mapped: bool, prefix: int
    ) -> Iterator[memoryview]:
        """Where a chunk lands: its mapped slot in the partial file, or a buffer holding
        the ``prefix`` bytes already in the file (so the whole chunk can be copied
        elsewhere). Only the bytes the receive writes are ever read from a reused buffer:
        the prefix is read back, the rest is filled, and a short fill is never written."""
        if mapped:
            with _mapped(fd, chunk.offset, chunk.size) as view:
                yield view
            return
        with self._mutex:
            fits = next((b for b in self._buffers if len(b) >= chunk.size), None)
            if fits is not None:
                self._buffers.remove(fits)
        buf = fits if fits is not None else bytearray(chunk.size)
        try:
            with memoryview(buf)[: chunk.size] as view:
                if prefix:
                    os.preadv(fd, [view[:prefix]], chunk.offset)
                yield view
        finally:
            with self._mutex:
                self._buffers.append(buf)

    def _receiving_for(self, key: str, chunk: ChunkEntry) -> Receiving:
        """The chunk's published verified prefix, kept across attempts."""
        with self._mutex:
            r = self._receiving.get(key)
            if r is None:
                loc = ChunkLocation(self.dir.name, chunk.file, chunk.offset, chunk.size)
                r = self._receiving[key] = self.store.index.start_receiving(key, loc)
            return r

    def _entry(self, key: str) -> ChunkEntry | None:
        indexes = self._indexes_of.get(key)
        return self.manifest.chunks[indexes[0]] if indexes else None

    def record(self, indexes: Iterable[int]) -> None:
        """Append chunk indexes to the journal; one write, so lines never interleave."""
        line = "".join(f"{i}\n" for i in indexes)
        if line:
            os.write(self._journal, line.encode())

    def mark_staged(self) -> None:
        """Write the completion marker, after checking every file is in place."""
        dirs = {self.dir / "files"}
        for f in self.manifest.files:
            p = self.file_path(f.path)
            if size_or_none(p) != f.size:
                raise RuntimeError(
                    f"cannot mark {self.manifest.digest} staged: {f.path} incomplete"
                )
            dirs.add(p.parent)
        for d in dirs:
            fsync_dir(d)
        shutil.rmtree(self.dir / "partial", ignore_errors=True)
        tmp = self.store.temp_path("staged")
        tmp.write_text(self.manifest.digest + "\n")
        tmp.replace(self.dir / STAGED_MARKER)
        fsync_dir(self.dir)

    # ------------------------------------------------------------------------------------

    def _claim(self, key: str) -> list[int]:
        """The chunk positions with this key that nobody has written or is writing,
        now marked as being written by the caller."""
        with self._mutex:
            todo = [
                i
                for i in self._indexes_of.get(key, [])
                if i not in self._done and i not in self._claimed
            ]
            self._claimed.update(todo)
        return todo

    def _unclaim(self, todo: list[int]) -> None:
        with self._mutex:
            self._claimed.difference_update(todo)

    def _write_at(self, todo: list[int], data: Buffer) -> None:
        chunks = self.manifest.chunks
        for i in todo:
            if len(data) != chunks[i].size:
                raise ChunkVerificationError(f"chunk {chunks[i].key} has the wrong size")
            fd = self._open_partial(chunks[i].file)
            _pwrite_all(fd, data, chunks[i].offset)
            start_writeback(fd, chunks[i].offset, chunks[i].size)

    def _commit(self, key: str, todo: list[int]) -> int:
        """Journal the claimed positions, whose verified bytes are in place; finish the
        files they complete."""
        chunks = self.manifest.chunks
        self.record(todo)
        completed = []
        with self._mutex:
            self._claimed.difference_update(todo)
            self._done.update(todo)
            for i in todo:
                self._remaining[chunks[i].file] -= 1
                if self._remaining[chunks[i].file] == 0:
                    completed.append(chunks[i].file)
        for i in todo:
            c = chunks[i]
            location = ChunkLocation(self.dir.name, c.file, c.offset, c.size)
            self.store.index.add(key, location, landed=True)
        for path in completed:
            self._finish_file(path)
        return len(todo)

    def _open_partial(self, path: str) -> int:
        with self._mutex:
            fd = self._fds.get(path)
            if fd is not None:
                return fd
            partial = partial_path(self.dir, validate_relative_path(path))
            partial.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(partial, os.O_RDWR | os.O_CREAT, 0o644)
            size = self._sizes[path]
            if os.fstat(fd).st_size != size:
                os.ftruncate(fd, size)  # its blocks are allocated by prepare's thread
            elif allocated(partial) >= size:
                self._reserved.add(path)
            self._fds[path] = fd
            return fd

    def _finish_file(self, path: str) -> None:
        """fsync the complete partial file once and rename it into place."""
        fd = self._open_partial(path)
        os.fsync(fd)  # on Linux this writes pages dirtied through mappings too (no msync)
        with self._mutex:
            self._fds.pop(path, None)
        os.close(fd)
        final = self.file_path(path)
        final.parent.mkdir(parents=True, exist_ok=True)
        partial_path(self.dir, path).replace(final)

    def _recover(self) -> set[int]:
        """Chunk indexes already in place: every chunk of a finished file, and journaled
        chunks whose bytes in the partial file still verify (a power loss can lose
        unsynced writes but keep the journal line). Indexes them for peers and dedupe."""
        chunks = self.manifest.chunks
        finished = {f.path for f in self.manifest.files if self.is_materialized(f.path)}
        done = {i for i, c in enumerate(chunks) if c.file in finished}
        text = (self.dir / "journal").read_text()
        lines = text.split("\n")[:-1]  # a torn last line (crash mid-write) has no newline
        journaled = {int(s) for s in lines if s.isdigit() and int(s) < len(chunks)} - done
        by_file: dict[str, list[int]] = {}
        for i in sorted(journaled):
            by_file.setdefault(chunks[i].file, []).append(i)
        for path, indexes in by_file.items():
            try:
                fd = os.open(partial_path(self.dir, path), os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                for i in indexes:
                    c = chunks[i]
                    data = os.pread(fd, c.size, c.offset)
                    if verify_chunk(c, data, max_threads=self.hash_threads):
                        done.add(i)
            finally:
                os.close(fd)
        for i in sorted(done):
            c = chunks[i]
            self.store.index.add(c.key, ChunkLocation(self.dir.name, c.file, c.offset, c.size))
        return done


RESERVE_STEP = 256 * 1024 * 1024  # allocated per call, so closing waits for one step only


def _idle_priority() -> None:
    """Run the calling thread only on CPU nothing else wants (Linux SCHED_IDLE, which is
    per thread). Allocating on tmpfs is zeroing: 512 MiB at once took a core for a
    second, and the node's peer server and fetches waited behind it (a holder's 404 took
    1 s at the start of the fleet benchmark)."""
    with contextlib.suppress(AttributeError, OSError):  # not Linux: normal priority
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def _normal_priority(thread_id: int) -> None:
    with contextlib.suppress(AttributeError, OSError):  # gone meanwhile, or not Linux
        os.sched_setscheduler(thread_id, os.SCHED_OTHER, os.sched_param(0))


def _preallocate(fd: int, size: int, stop: threading.Event) -> bool:
    """Allocate the blocks of the file (sized already), a step at a time until ``stop``;
    False where the filesystem cannot (the space is then taken as chunks land) or when
    stopped first."""
    for offset in range(0, size, RESERVE_STEP):
        if stop.is_set() or not allocate_blocks(fd, offset, min(RESERVE_STEP, size - offset)):
            return False
    return True


@contextlib.contextmanager
def _mapped(fd: int, offset: int, size: int) -> Iterator[memoryview]:
    """A writable shared mapping of the file's ``size`` bytes at ``offset``, its pages
    faulted in with one call: page by page, as the socket's bytes land, cost more CPU
    (docs/benchmarks.md). Unmapped on leaving."""
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    mapping = mmap.mmap(fd, size + offset - start, mmap.MAP_SHARED, offset=start)
    try:
        with contextlib.suppress(OSError):  # before Linux 5.14: faulted in as written
            mapping.madvise(_MADV_POPULATE_WRITE)
        with memoryview(mapping)[offset - start :] as view:
            yield view
    finally:
        _unmap(mapping)


def _unmap(mapping: mmap.mmap) -> None:
    # A view still referenced (by an exception's traceback, say) keeps it mapped until
    # that view goes; nothing is lost, the pages are the file's.
    with contextlib.suppress(BufferError):
        mapping.close()


def _pwrite_all(fd: int, data: Buffer, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n
