import ctypes
import gc
import hashlib
import json
import mmap
import os
import struct
from pathlib import Path

import blake3
import pytest
import torch
from safetensors.torch import save_file

import weightship.loader.load as load_module
from weightship.data.chunkstore import ChunkStore
from weightship.data.modelstaging import ModelStaging
from weightship.linux import populate_write
from weightship.loader.load import (
    LoaderError,
    WeightsVerificationError,
    load_model,
    load_staged,
    locate_staged,
)
from weightship.weightformat.build import LocalFolder, build_manifest
from weightship.weightformat.entries import ChunkEntry
from weightship.weightformat.manifest import Manifest

CHUNK = 64 * 1024


def write_model(root: Path) -> dict[str, torch.Tensor]:
    """Two shards with tensors of several dtypes, some spanning chunks, and a config."""
    g = torch.Generator().manual_seed(0)
    shards = [
        {
            "embed.weight": torch.randn(300, 128, generator=g).to(torch.bfloat16),  # 75 KiB
            "layers.0.weight": torch.randn(64, 64, generator=g),
            "layers.0.codes": torch.randint(-128, 127, (1001,), generator=g, dtype=torch.int8),
        },
        {
            "layers.1.weight": torch.randn(200, 100, generator=g).to(torch.float16),
            "layers.1.mask": torch.rand(17, generator=g) > 0.5,
            "step": torch.tensor(12345, dtype=torch.int64),
            "empty": torch.empty(0, 8),
        },
    ]
    for i, tensors in enumerate(shards, 1):
        save_file(tensors, str(root / f"model-{i}-of-2.safetensors"))
    (root / "config.json").write_text('{"layers": 2}')
    return {k: v for shard in shards for k, v in shard.items()}


@pytest.fixture
def model(tmp_path: Path) -> tuple[Path, Manifest, dict[str, torch.Tensor]]:
    root = tmp_path / "model"
    root.mkdir()
    tensors = write_model(root)
    return root, build_manifest(LocalFolder(root), chunk_size=CHUNK, workers=2), tensors


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(got[name], t), name


@pytest.mark.parametrize("workers", [1, 4])
def test_loads_verified_tensors_as_views_into_one_buffer_per_file(
    model: tuple[Path, Manifest, dict[str, torch.Tensor]], workers: int
) -> None:
    root, manifest, want = model
    loaded = load_model(root, manifest, workers=workers)

    assert_same_tensors(loaded.tensors, want)
    assert loaded.verified and loaded.digest == manifest.digest
    assert loaded.bytes == manifest.total_size and loaded.seconds > 0
    assert loaded.files == {"config.json": b'{"layers": 2}'}
    # Views, not copies: the tensors of a shard share that shard's buffer.
    shard1 = {"embed.weight", "layers.0.weight", "layers.0.codes"}
    storages = {loaded.tensors[n].untyped_storage().data_ptr() for n in shard1}
    assert len(storages) == 1
    size = (root / "model-1-of-2.safetensors").stat().st_size
    assert loaded.tensors["embed.weight"].untyped_storage().nbytes() == size


def test_a_version_2_manifest_is_verified_with_blake3(
    model: tuple[Path, Manifest, dict[str, torch.Tensor]],
) -> None:
    root, manifest, want = model
    assert manifest.version == 2
    assert {c.algorithm for c in manifest.chunks} == {"blake3"}
    for hash_threads in (1, 2):
        loaded = load_model(root, manifest, workers=2, hash_threads=hash_threads)
        assert loaded.verified and loaded.digest == manifest.digest
        assert_same_tensors(loaded.tensors, want)


@pytest.mark.parametrize("piece", [4096, 5000])
def test_chunks_read_in_pieces_are_hashed_whole(
    model: tuple[Path, Manifest, dict[str, torch.Tensor]],
    monkeypatch: pytest.MonkeyPatch,
    piece: int,
) -> None:
    # Pieces smaller than a chunk, one of them not dividing it: every byte of every chunk
    # is hashed once, in order (a skipped or repeated piece would change the digest).
    root, manifest, want = model
    monkeypatch.setattr(load_module, "READ_PIECE", piece)
    assert_same_tensors(load_model(root, manifest, workers=2).tensors, want)


def test_a_flipped_bit_is_named_and_nothing_is_returned(
    model: tuple[Path, Manifest, dict[str, torch.Tensor]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    root, manifest, want = model
    monkeypatch.setattr(load_module, "READ_PIECE", 4096)  # caught inside a later piece
    path = root / "model-1-of-2.safetensors"
    data = bytearray(path.read_bytes())
    at = CHUNK + 10_000  # inside embed.weight, in chunk 1
    data[at] ^= 0x01
    path.write_bytes(data)

    with pytest.raises(WeightsVerificationError) as caught:
        load_model(root, manifest, workers=2)
    err = caught.value
    chunk = manifest.chunks_of("model-1-of-2.safetensors")[1]
    assert chunk.blake3 is not None
    assert (err.path, err.chunk_index, err.algorithm) == (path.name, 1, "blake3")
    assert err.expected == chunk.blake3
    assert err.got == blake3.blake3(data[CHUNK : 2 * CHUNK]).hexdigest()
    assert str(err) == (
        f"{path.name}: chunk 1 does not match the manifest: expected blake3 {chunk.blake3}, "
        f"got blake3 {err.got}"
    )

    # Without verification (the caller's explicit choice) the corrupt bytes come through.
    unverified = load_model(root, manifest, verify=False)
    assert not unverified.verified
    assert not torch.equal(unverified.tensors["embed.weight"], want["embed.weight"])
    assert torch.equal(unverified.tensors["layers.1.weight"], want["layers.1.weight"])


def test_a_version_1_manifest_still_loads_verified_with_sha256(tmp_path: Path) -> None:
    root = tmp_path / "model"
    root.mkdir()
    want = write_model(root)
    manifest = build_manifest(LocalFolder(root), chunk_size=CHUNK, workers=2, version=1)
    assert {c.algorithm for c in manifest.chunks} == {"sha256"}
    loaded = load_model(root, manifest, workers=2)
    assert loaded.verified and loaded.digest == manifest.digest
    assert_same_tensors(loaded.tensors, want)

    path = root / "model-2-of-2.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x80  # the last byte of the last chunk
    path.write_bytes(data)
    last = manifest.chunks_of(path.name)[-1]
    with pytest.raises(WeightsVerificationError) as caught:
        load_model(root, manifest)
    err = caught.value
    assert (err.path, err.chunk_index, err.algorithm) == (path.name, last.index, "sha256")
    assert (err.expected, err.got) == (last.sha256, hashlib.sha256(data[last.offset :]).hexdigest())
    assert f"expected sha256 {last.sha256}" in str(err)


def test_a_file_of_the_wrong_size_is_rejected(
    model: tuple[Path, Manifest, dict[str, torch.Tensor]],
) -> None:
    root, manifest, _ = model
    path = root / "model-2-of-2.safetensors"
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(WeightsVerificationError, match=r"model-2-of-2\.safetensors: size"):
        load_model(root, manifest)
    path.unlink()
    with pytest.raises(LoaderError, match=r"cannot open model-2-of-2\.safetensors"):
        load_model(root, manifest)


def test_expected_digest_and_selected_paths(
    model: tuple[Path, Manifest, dict[str, torch.Tensor]],
) -> None:
    root, manifest, _ = model
    with pytest.raises(LoaderError, match="not the expected sha256:0000"):
        load_model(root, manifest, expected_digest="sha256:" + "0" * 64)
    part = load_model(
        root, manifest, expected_digest=manifest.digest, paths=["model-2-of-2.safetensors"]
    )
    assert set(part.tensors) == {"layers.1.weight", "layers.1.mask", "step", "empty"}
    assert part.files == {}
    with pytest.raises(LoaderError, match="not in the manifest"):
        load_model(root, manifest, paths=["nope.safetensors"])


def test_manifest_without_tensor_list_loads_by_header(
    model: tuple[Path, Manifest, dict[str, torch.Tensor]],
) -> None:
    root, manifest, want = model
    doc = json.loads(manifest.canonical_bytes())
    del doc["tensors"]
    old_style = Manifest.parse(json.dumps(doc))
    assert old_style.tensors == ()
    assert_same_tensors(load_model(root, old_style).tensors, want)


def test_manifest_tensor_list_must_agree_with_the_header(
    model: tuple[Path, Manifest, dict[str, torch.Tensor]],
) -> None:
    root, manifest, _ = model
    doc = json.loads(manifest.canonical_bytes())
    entry = next(t for t in doc["tensors"] if t["name"] == "layers.0.weight")
    entry["name"] = "layers.0.renamed"
    with pytest.raises(LoaderError, match="disagree on tensors"):
        load_model(root, Manifest.parse(json.dumps(doc)))


def test_unaligned_tensors_still_load(tmp_path: Path) -> None:
    # A hand-written file whose F32 data starts at an odd offset (the format allows it).
    values = torch.arange(5, dtype=torch.float32)
    header = json.dumps({"x": {"dtype": "F32", "shape": [5], "data_offsets": [0, 20]}}).encode()
    header += b" " * (1 - len(header) % 2)  # odd length -> data starts at an odd offset
    assert (8 + len(header)) % 4
    (tmp_path / "odd.safetensors").write_bytes(
        struct.pack("<Q", len(header)) + header + values.numpy().tobytes()
    )
    manifest = build_manifest(LocalFolder(tmp_path), chunk_size=16)
    assert torch.equal(load_model(tmp_path, manifest).tensors["x"], values)


def test_no_cuda_no_gpu_load(model: tuple[Path, Manifest, dict[str, torch.Tensor]]) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: bench/gpu_check_loader.py covers it")
    root, manifest, _ = model
    with pytest.raises(LoaderError, match="CUDA is not available"):
        load_model(root, manifest, device="cuda:0")


def test_load_staged_from_the_node_cache(
    tmp_path: Path, model: tuple[Path, Manifest, dict[str, torch.Tensor]]
) -> None:
    root, manifest, want = model
    cache = tmp_path / "cache"
    store = ChunkStore(cache)
    assert locate_staged(cache, manifest.digest) is None
    with ModelStaging(store, manifest) as staging:
        staging.prepare()
        for c in manifest.chunks:
            staging.put(c.key, LocalFolder(root).read_range(c.file, c.offset, c.size))
        assert locate_staged(cache, manifest.digest) is None  # not before STAGED
        staging.mark_staged()

    assert locate_staged(cache, manifest.digest) == store.files_dir(manifest.digest)
    loaded = load_staged(cache, manifest.digest)
    assert_same_tensors(loaded.tensors, want)
    assert loaded.digest == manifest.digest

    with pytest.raises(LoaderError, match="is not staged"):
        load_staged(cache, "sha256:" + "1" * 64)


def test_a_private_mapping_is_writable_and_outlives_every_name_but_its_views(
    tmp_path: Path,
) -> None:
    path = tmp_path / "blob"
    data = bytes(range(256)) * 12_289  # not a whole number of pages
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    buffer = load_module.private_mapping(fd, len(data))
    os.close(fd)
    assert buffer.dtype == torch.uint8 and bytes(buffer.numpy()) == data
    buffer.numpy().data[-5:] = b"abcde"  # writable, and the file never sees it
    tail = buffer[-5:].view(torch.uint8)
    del buffer
    gc.collect()
    assert bytes(tail.numpy()) == b"abcde"  # the mapping lives as long as a view does
    assert path.read_bytes() == data
    assert load_module.private_mapping(-1, 0).numel() == 0


@pytest.mark.parametrize("populate", [True, False], ids=["populated", "read"])
def test_loaded_tensors_are_private_copies_that_later_writes_to_the_file_never_reach(
    model: tuple[Path, Manifest, dict[str, torch.Tensor]],
    monkeypatch: pytest.MonkeyPatch,
    populate: bool,
) -> None:
    # A verified tensor must stay the bytes that were hashed: a page of the private mapping
    # only read (hashed) and never copied would still show the file's page, and so a write
    # to the file after the check. Without the kernel's populate (before Linux 5.14) the
    # loader reads each piece into the mapping, which copies it too.
    root, manifest, want = model
    if not populate:
        monkeypatch.setattr(load_module, "populate_write", lambda address, length: False)
    loaded = load_model(root, manifest, workers=2)
    path = root / "model-1-of-2.safetensors"
    with open(path, "r+b") as f:
        f.write(b"\xff" * path.stat().st_size)  # in place: the same inode and page cache
    assert_same_tensors(loaded.tensors, want)


def test_a_file_that_shrinks_after_its_size_check_is_named_not_a_sigbus(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(bytes(range(256)) * 1024)  # 64 pages
    fd = os.open(path, os.O_RDONLY)
    dest = load_module.private_mapping(fd, 256 * 1024)
    os.truncate(path, 100 * 1024)  # the tail's pages now lie past the end of the file
    data = bytes(range(256)) * 1024
    chunk = ChunkEntry(
        file=path.name, index=0, offset=0, size=len(data), blake3=blake3.blake3(data).hexdigest()
    )
    hashing = load_module._Hashing(verify=True, threads=1)
    with pytest.raises(WeightsVerificationError, match="expected 262144 bytes, got 102400 bytes"):
        load_module._copy_chunk(chunk, fd, dest, hashing=hashing)
    os.close(fd)


def test_populate_write_copies_what_the_file_holds_and_refuses_past_its_end(
    tmp_path: Path,
) -> None:
    path = tmp_path / "blob"
    page = mmap.PAGESIZE
    path.write_bytes(b"a" * 4 * page)
    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), 4 * page, access=mmap.ACCESS_COPY)
    address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    assert populate_write(address + 10, page)  # not page-aligned: its pages are rounded out
    with open(path, "r+b") as f:
        f.write(b"b" * 4 * page)  # in place
    os.truncate(path, 2 * page)
    assert mapping[:page] == b"a" * page  # copied: the write did not reach it
    assert not populate_write(address + 3 * page, page)  # past the new end: no SIGBUS
