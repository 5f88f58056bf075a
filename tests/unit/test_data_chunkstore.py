import hashlib
from pathlib import Path

import pytest

from weightship.data.chunkstore import (
    ChunkStore,
    ChunkVerificationError,
    StageBusyError,
    verify_chunk,
)
from weightship.data.manifest import LocalFolder, Manifest, build_manifest


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_verify_chunk() -> None:
    assert verify_chunk(b"abc", sha(b"abc"))
    assert not verify_chunk(b"abd", sha(b"abc"))


def test_put_chunk_stores_only_verified_bytes(tmp_path: Path) -> None:
    store = ChunkStore(tmp_path)
    good = b"x" * 1000
    with pytest.raises(ChunkVerificationError):
        store.put_chunk(sha(good), b"y" * 1000)
    assert not store.has_chunk(sha(good))
    assert list((tmp_path / "tmp").iterdir()) == []

    path = store.put_chunk(sha(good), good)
    assert path == tmp_path / "chunks" / sha(good)
    assert store.read_chunk(sha(good)) == good
    assert store.read_chunk(sha(good), 10, 20) == good[10:20]
    assert store.read_chunk(sha(b"absent")) is None


@pytest.mark.parametrize("bad", ["../../etc/passwd", "A" * 64, "sha256:xyz", "0" * 63])
def test_chunk_paths_accept_only_hex_digests(tmp_path: Path, bad: str) -> None:
    with pytest.raises(ValueError, match="not a sha256 digest"):
        ChunkStore(tmp_path).chunk_path(bad)


_BLOCKS = {sha(bytes([c]) * 1024): bytes([c]) * 1024 for c in b"sab"}


def _bytes_of(digest: str) -> bytes:
    return _BLOCKS[digest]


def _manifest(folder: Path, files: dict[str, bytes]) -> Manifest:
    folder.mkdir()
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return build_manifest(LocalFolder(folder), chunk_size=1024)


def test_evict_keeps_chunks_other_models_share(tmp_path: Path) -> None:
    shared, only_a, only_b = b"s" * 1024, b"a" * 1024, b"b" * 1024
    a = _manifest(tmp_path / "a", {"w": shared + only_a})
    b = _manifest(tmp_path / "b", {"w": shared + only_b})
    store = ChunkStore(tmp_path / "cache")
    for m in (a, b):
        with store.begin(m) as staging:
            for c in m.chunks:
                store.put_chunk(c.sha256, _bytes_of(c.sha256))
            staging.record(range(len(m.chunks)))
            staging.materialize("w")
            staging.mark_staged()
    assert store.is_staged(a.digest) and store.is_staged(b.digest)

    assert store.evict(a.digest)
    assert not store.is_staged(a.digest)
    assert not store.model_dir(a.digest).exists()
    assert store.has_chunk(sha(shared)) and store.has_chunk(sha(only_b))
    assert not store.has_chunk(sha(only_a))
    assert (store.files_dir(b.digest) / "w").read_bytes() == shared + only_b


def test_a_model_has_one_stager_at_a_time(tmp_path: Path) -> None:
    m = _manifest(tmp_path / "m", {"w": b"s" * 1024})
    store = ChunkStore(tmp_path / "cache")
    with store.begin(m):
        with pytest.raises(StageBusyError):
            store.begin(m)
        assert not store.evict(m.digest)  # never evict what is being staged
    with store.begin(m):
        pass


def test_journal_ignores_torn_lines_and_missing_chunks(tmp_path: Path) -> None:
    m = _manifest(tmp_path / "m", {"w": b"s" * 1024 + b"a" * 1024 + b"b" * 1024})
    store = ChunkStore(tmp_path / "cache")
    with store.begin(m) as staging:
        store.put_chunk(m.chunks[0].sha256, _bytes_of(m.chunks[0].sha256))
        staging.record([0, 1])  # chunk 1 never reached the store (crash before rename)
        (staging.dir / "journal").open("a").write("2")  # torn line, no newline
        assert staging.journaled() == {0}
