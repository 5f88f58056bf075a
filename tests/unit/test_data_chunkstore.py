import hashlib
import logging
import mmap
import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from weightship.data import modelstaging
from weightship.data.chunkstore import (
    CACHE_FORMAT,
    ChunkStore,
    StageBusyError,
    allocated,
    partial_path,
)
from weightship.data.modelstaging import ChunkIncompleteError, Fill, ModelStaging
from weightship.weightformat.build import LocalFolder, build_manifest
from weightship.weightformat.chunkhash import ChunkVerificationError, chunk_key
from weightship.weightformat.manifest import Manifest


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_chunk_keys_name_the_algorithm() -> None:
    hex_digest = sha(b"abc")
    assert chunk_key(hex_digest) == "sha256:" + hex_digest  # a bare digest: version 1
    assert chunk_key("blake3:" + hex_digest) == "blake3:" + hex_digest
    for bad in ("md5:" + hex_digest, "blake3:" + hex_digest.upper(), hex_digest + "\n"):
        with pytest.raises(ValueError, match="not a chunk key"):
            chunk_key(bad)


_BLOCKS = {"sha256:" + sha(bytes([c]) * 1024): bytes([c]) * 1024 for c in b"sabxyz"}


def _bytes_of(digest: str) -> bytes:
    return _BLOCKS[digest]


def _manifest(folder: Path, files: dict[str, bytes]) -> Manifest:
    folder.mkdir()
    for name, data in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return build_manifest(LocalFolder(folder), chunk_size=1024, version=1)


def _stage_all(store: ChunkStore, m: Manifest) -> None:
    with ModelStaging(store, m) as staging:
        staging.prepare()
        for c in m.chunks:
            staging.put(c.key, _bytes_of(c.key))
        staging.mark_staged()


def test_put_writes_only_verified_bytes_once_at_their_offsets(tmp_path: Path) -> None:
    m = _manifest(tmp_path / "m", {"w": b"s" * 1024 + b"a" * 1024 + b"s" * 1024, "d/e": b""})
    store = ChunkStore(tmp_path / "cache")
    s_sha, a_sha = sha(b"s" * 1024), sha(b"a" * 1024)
    with ModelStaging(store, m) as staging:
        staging.prepare()
        assert staging.is_materialized("d/e")  # an empty file needs no chunk
        with pytest.raises(ChunkVerificationError):
            staging.put(s_sha, b"y" * 1024)
        assert not store.has_chunk(s_sha)
        assert staging.put(s_sha, b"s" * 1024) == 2  # both positions with that digest
        assert staging.put(s_sha, b"s" * 1024) == 0  # nothing left to write
        assert store.read_chunk(s_sha) == b"s" * 1024  # served from the partial file
        assert store.read_chunk(s_sha, 10, 20) == b"s" * 10
        assert not (staging.dir / "files" / "w").exists()  # not visible before complete
        assert staging.put(a_sha, b"a" * 1024) == 1
        assert (staging.dir / "files" / "w").read_bytes() == (tmp_path / "m" / "w").read_bytes()
        staging.mark_staged()
        assert (staging.dir / "journal").read_text().split() == ["0", "2", "1"]
    assert store.read_chunk(sha(b"absent")) is None
    assert not (store.model_dir(m.digest) / "partial").exists()
    assert store.used_bytes() < 3 * 1024 + 2048  # one copy: no chunk files beside the files
    # A new store (agent restart) finds the chunks in the finished files.
    again = ChunkStore(tmp_path / "cache")
    assert again.read_chunk(a_sha) == b"a" * 1024


def _filler(data: bytes, seen: list[type]) -> Fill:
    """A fill that writes ``data`` into the slot it is given (from where it is told),
    noting what holds the slot."""

    def fill(view: memoryview, start: int, landed: Callable[[int], None]) -> int:
        seen.append(type(view.obj))
        view[start:] = data[start:]
        landed(len(view))
        return len(view)

    return fill


@pytest.mark.parametrize("mapped", [True, False])
def test_receive_lands_bytes_in_place_and_journals_only_verified_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mapped: bool
) -> None:
    monkeypatch.setattr(ModelStaging, "map_partial_files", mapped)
    m = _manifest(tmp_path / "m", {"w": b"s" * 1024 + b"a" * 1024 + b"s" * 1024})
    store = ChunkStore(tmp_path / "cache")
    s_sha, a_sha = sha(b"s" * 1024), sha(b"a" * 1024)
    seen: list[type] = []
    with ModelStaging(store, m) as staging:
        staging.prepare()
        staging.wait_reserved()  # mapped only once its blocks are allocated
        with pytest.raises(ChunkVerificationError):
            staging.receive(a_sha, _filler(b"y" * 1024, seen))  # bad bytes from the origin
        assert (seen[0] is mmap.mmap) == mapped  # in the file's mapping, or a buffer
        assert not store.has_chunk(a_sha)
        assert staging.receive(s_sha, _filler(b"s" * 1024, seen)) == 2  # fetched once
        assert len(seen) == 2
        assert staging.receive(s_sha, _filler(b"s" * 1024, seen)) == 0
        assert len(seen) == 2  # nothing needed it: nothing fetched
        assert not (staging.dir / "files" / "w").exists()
        assert (staging.dir / "journal").read_text().split() == ["0", "2"]
    # Resume: the bad bytes still sit in the partial file, unjournaled, so they are
    # fetched again, and the file appears only once every chunk verified.
    with ModelStaging(store, m) as staging:
        assert staging.journaled() == {0, 2}
        staging.prepare()
        assert staging.receive(a_sha, _filler(b"a" * 1024, seen)) == 1
        assert (staging.dir / "files" / "w").read_bytes() == (tmp_path / "m" / "w").read_bytes()
        staging.mark_staged()
    assert store.is_staged(m.digest)


def test_the_buffer_path_reuses_one_buffer_and_never_writes_its_stale_bytes(
    tmp_path: Path,
) -> None:
    """A fresh 16 MiB buffer per chunk faults in every page (docs/benchmarks.md, P1), so
    receives reuse the last one's; what a short fill leaves in it is never written."""
    assert ModelStaging.map_partial_files is False  # the default path
    m = _manifest(tmp_path / "m", {"w": b"s" * 1024 + b"a" * 1024})
    store = ChunkStore(tmp_path / "cache")
    s_sha, a_sha = sha(b"s" * 1024), sha(b"a" * 1024)
    holders: list[object] = []  # kept alive, so identity means the same buffer

    def short(view: memoryview, start: int, landed: Callable[[int], None]) -> int:
        holders.append(view.obj)
        view[:512] = b"a" * 512  # the rest of the buffer still holds the "s" chunk
        return 512

    def whole(data: bytes) -> Fill:
        def fill(view: memoryview, start: int, landed: Callable[[int], None]) -> int:
            holders.append(view.obj)
            view[start:] = data[start:]
            return len(view)

        return fill

    with ModelStaging(store, m) as staging:
        staging.prepare()
        assert staging.receive(s_sha, whole(b"s" * 1024)) == 1
        with pytest.raises(ChunkIncompleteError):
            staging.receive(a_sha, short)
        assert not store.has_chunk(a_sha)
        assert staging.receive(a_sha, whole(b"a" * 1024)) == 1
        assert len(holders) == 3 and all(h is holders[0] for h in holders)  # one buffer
        staging.mark_staged()
    assert (store.files_dir(m.digest) / "w").read_bytes() == b"s" * 1024 + b"a" * 1024


def test_a_fill_that_fails_leaves_the_chunk_to_fetch_again(tmp_path: Path) -> None:
    m = _manifest(tmp_path / "m", {"w": b"s" * 1024 + b"a" * 1024})
    store = ChunkStore(tmp_path / "cache")
    s_sha = sha(b"s" * 1024)

    def cut_short(view: memoryview, start: int, landed: Callable[[int], None]) -> int:
        view[:10] = b"s" * 10
        raise ConnectionResetError("the origin went away mid-body")

    with ModelStaging(store, m) as staging:
        staging.prepare()
        with pytest.raises(ConnectionResetError):
            staging.receive(s_sha, cut_short)
        assert staging.journaled() == set()
        assert staging.receive(s_sha, _filler(b"s" * 1024, [])) == 1  # claimable again
        assert staging.journaled() == {0}


@pytest.mark.parametrize(
    "bad", ["../../etc/passwd", "A" * 64, "sha256:xyz", "0" * 63, "0" * 64 + "\n", "0" * 65]
)
def test_chunk_lookups_accept_only_hex_digests(tmp_path: Path, bad: str) -> None:
    with pytest.raises(ValueError, match="not a chunk key"):
        ChunkStore(tmp_path).has_chunk(bad)


def test_evict_keeps_other_models_chunks(tmp_path: Path) -> None:
    shared, only_a, only_b = b"s" * 1024, b"a" * 1024, b"b" * 1024
    a = _manifest(tmp_path / "a", {"w": shared + only_a})
    b = _manifest(tmp_path / "b", {"w": shared + only_b})
    store = ChunkStore(tmp_path / "cache")
    for m in (a, b):
        _stage_all(store, m)
    assert store.is_staged(a.digest) and store.is_staged(b.digest)

    assert store.evict(a.digest)
    assert not store.is_staged(a.digest)
    assert not store.model_dir(a.digest).exists()
    assert store.has_chunk(sha(shared)) and store.has_chunk(sha(only_b))
    assert store.read_chunk(sha(shared)) == shared  # now from b's file
    assert not store.has_chunk(sha(only_a))
    assert (store.files_dir(b.digest) / "w").read_bytes() == shared + only_b


def test_a_model_has_one_stager_at_a_time(tmp_path: Path) -> None:
    m = _manifest(tmp_path / "m", {"w": b"s" * 1024})
    store = ChunkStore(tmp_path / "cache")
    with ModelStaging(store, m):
        with pytest.raises(StageBusyError):
            ModelStaging(store, m)
        assert not store.evict(m.digest)  # never evict what is being staged
    with ModelStaging(store, m):
        pass


def test_journal_ignores_torn_lines_and_unverified_bytes(tmp_path: Path) -> None:
    m = _manifest(tmp_path / "m", {"w": b"s" * 1024 + b"a" * 1024 + b"b" * 1024})
    store = ChunkStore(tmp_path / "cache")
    with ModelStaging(store, m) as staging:
        staging.prepare()
        staging.put(m.chunks[0].key, _bytes_of(m.chunks[0].key))
        staging.record([1])  # journaled, but the write was lost (power cut before writeback)
        (staging.dir / "journal").open("a").write("2")  # torn line, no newline
    with ModelStaging(store, m) as staging:  # resume: journaled bytes are verified again
        assert staging.journaled() == {0}
        assert store.has_chunk(m.chunks[0].key)
        assert not store.has_chunk(m.chunks[1].key)


def test_preallocated_space_counts_as_used(tmp_path: Path) -> None:
    m = _manifest(tmp_path / "m", {"w": os.urandom(4096)})
    store = ChunkStore(tmp_path / "cache")
    assert store.missing_bytes(m) == 4096
    with ModelStaging(store, m) as staging:
        staging.prepare()
        staging.wait_reserved()  # allocated by a thread of its own
        assert staging.missing_bytes() == 0  # the partial file holds its space already


def test_old_cache_format_is_discarded_with_a_log_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "cache"
    (root / "chunks").mkdir(parents=True)
    (root / "chunks" / ("0" * 64)).write_bytes(b"old")
    (root / "models" / ("1" * 64) / "files").mkdir(parents=True)
    (root / "unrelated").write_text("kept")
    with caplog.at_level(logging.WARNING):
        store = ChunkStore(root)
    assert "discarding the node cache" in caplog.text
    assert not (root / "chunks").exists()
    assert store.models() == []
    assert (root / "unrelated").read_text() == "kept"
    assert (root / "FORMAT").read_text().strip() == CACHE_FORMAT
    caplog.clear()
    ChunkStore(root)
    assert "discarding" not in caplog.text


def test_prepare_allocates_the_partial_files_in_the_background(tmp_path: Path) -> None:
    """prepare() sizes the partial files; wait_reserved() returns once their blocks are
    allocated; the model then stages as ever."""
    files = {"w": b"s" * 1024 + b"a" * 1024, "d/x": b"b" * 1024}
    m = _manifest(tmp_path / "m", files)
    store = ChunkStore(tmp_path / "cache")
    with ModelStaging(store, m) as staging:
        staging.prepare()
        staging.wait_reserved()
        for f in m.files:
            partial = partial_path(staging.dir, f.path)
            assert partial.stat().st_size == f.size
            assert allocated(partial) >= f.size  # every block allocated, not a sparse file
        for c in m.chunks:
            staging.put(c.key, _bytes_of(c.key))
        staging.mark_staged()
    assert store.is_staged(m.digest)
    assert all((store.files_dir(m.digest) / p).read_bytes() == d for p, d in files.items())


def test_close_right_after_prepare_stops_and_joins_the_reserving_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """close() while prepare's thread still allocates: no error, no thread left behind,
    and no file allocated after the close began."""
    gate, sizes = threading.Event(), []
    real = modelstaging._preallocate

    def slow(fd: int, size: int, stop: threading.Event) -> bool:  # held until the gate opens
        sizes.append(size)
        gate.wait(5)
        return real(fd, size, stop)

    monkeypatch.setattr(modelstaging, "_preallocate", slow)
    m = _manifest(tmp_path / "m", {"a": b"s" * 1024, "b": b"a" * 1024, "c": b"b" * 1024})
    staging = ModelStaging(ChunkStore(tmp_path / "cache"), m)
    staging.prepare()
    threading.Timer(0.2, gate.set).start()  # a close that did not wait returns before this
    staging.close()
    assert not [t for t in threading.enumerate() if t.name == "weightship-reserve"]
    assert len(sizes) <= 1  # the file being allocated at most: the others were skipped


def test_a_file_is_allocated_a_step_at_a_time_and_a_stop_ends_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """close() waits for one step of the allocation at most, not a whole (large) file."""
    monkeypatch.setattr(modelstaging, "RESERVE_STEP", 64 * 1024)
    path = tmp_path / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        size = 3 * modelstaging.RESERVE_STEP // 2
        os.ftruncate(fd, size)
        stop = threading.Event()
        stop.set()
        assert not modelstaging._preallocate(fd, size, stop)  # stopped before the first step
        assert allocated(path) == 0
        assert modelstaging._preallocate(fd, size, threading.Event())
        assert allocated(path) >= size
    finally:
        os.close(fd)


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
def test_the_reserving_thread_runs_idle_until_someone_waits_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Allocating runs only on CPU nothing else wants (SCHED_IDLE), so it never delays the
    node's peer server or fetches; a caller that waits for it (wait_reserved, close) puts
    it back at normal priority, so the wait is not starved."""
    started, gate, seen = threading.Event(), threading.Event(), []

    def held(fd: int, size: int, stop: threading.Event) -> bool:
        seen.append(os.sched_getscheduler(0))
        started.set()
        gate.wait(5)
        seen.append(os.sched_getscheduler(0))
        return False

    monkeypatch.setattr(modelstaging, "_preallocate", held)
    m = _manifest(tmp_path / "m", {"a": b"s" * 1024})
    with ModelStaging(ChunkStore(tmp_path / "cache"), m) as staging:
        staging.prepare()
        assert started.wait(5)
        threading.Timer(0.2, gate.set).start()
        staging.wait_reserved()
    assert seen == [os.SCHED_IDLE, os.SCHED_OTHER]
