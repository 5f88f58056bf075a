"""The ChunkStore helpers the agent uses to report evictions before they happen."""

import os
from pathlib import Path

import pytest

from weightship.data.chunkstore import ChunkStore, InsufficientSpaceError
from weightship.data.modelstaging import ModelStaging
from weightship.weightformat.build import LocalFolder, build_manifest
from weightship.weightformat.manifest import Manifest

CHUNK = 4096


def staged(store: ChunkStore, folder: Path, size: int) -> Manifest:
    folder.mkdir(parents=True)
    (folder / "w.bin").write_bytes(os.urandom(size))
    manifest = build_manifest(LocalFolder(folder), chunk_size=CHUNK)
    with ModelStaging(store, manifest) as s:
        s.prepare()
        for c in manifest.chunks:
            s.put(c.key, LocalFolder(folder).read_range(c.file, c.offset, c.size))
        s.mark_staged()
    return manifest


def test_missing_bytes_and_eviction_plan(tmp_path: Path) -> None:
    store = ChunkStore(tmp_path / "cache", capacity_bytes=10 * CHUNK + 1000)
    old = staged(store, tmp_path / "old", 4 * CHUNK)
    pinned = staged(store, tmp_path / "pinned", 4 * CHUNK)
    os.utime(store.model_dir(old.digest) / "STAGED", (1, 1))  # least recently used
    assert store.missing_bytes(old) == 0

    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "w.bin").write_bytes(os.urandom(3 * CHUNK))
    new = build_manifest(LocalFolder(tmp_path / "new"), chunk_size=CHUNK)
    assert store.missing_bytes(new) == 3 * CHUNK  # each byte is stored once

    assert store.eviction_plan(CHUNK, {pinned.digest}) == []
    assert store.eviction_plan(store.missing_bytes(new), {pinned.digest}) == [old.digest]
    assert store.is_staged(old.digest), "a plan evicts nothing"
    with pytest.raises(InsufficientSpaceError):
        store.eviction_plan(100 * CHUNK, {pinned.digest})
