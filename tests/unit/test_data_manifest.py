import hashlib
import json
import random
from datetime import UTC, datetime
from pathlib import Path

import blake3
import pytest
import torch
from safetensors.torch import load_file, save_file

from weightship.weightformat.build import LocalFolder, build_manifest, build_manifest_with_pieces
from weightship.weightformat.checksum import checksum_tensor
from weightship.weightformat.layout import read_layout
from weightship.weightformat.manifest import Manifest, ManifestError
from weightship.weightformat.paths import MANIFEST_NAME, validate_relative_path

CHUNK = 64 * 1024


def write_model(root: Path, seed: int = 0) -> dict[str, bytes]:
    rng = random.Random(seed)
    files = {
        "config.json": b'{"layers": 2}',
        "model-00001.safetensors": rng.randbytes(3 * CHUNK + 123),
        "sub/dir/model-00002.safetensors": rng.randbytes(2 * CHUNK),
        "empty.txt": b"",
    }
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return files


def test_build_lists_files_and_tiles_chunks(tmp_path: Path) -> None:
    files = write_model(tmp_path)
    (tmp_path / MANIFEST_NAME).write_text("{}")  # an old manifest is not part of the model
    m = build_manifest(LocalFolder(tmp_path), chunk_size=CHUNK, workers=2)

    assert [f.path for f in m.files] == sorted(files)
    for f in m.files:
        assert f.size == len(files[f.path])
        assert f.sha256 == hashlib.sha256(files[f.path]).hexdigest()
    big = m.chunks_of("model-00001.safetensors")
    assert [(c.index, c.offset, c.size) for c in big] == [
        (0, 0, CHUNK),
        (1, CHUNK, CHUNK),
        (2, 2 * CHUNK, CHUNK),
        (3, 3 * CHUNK, 123),
    ]
    data = files["model-00001.safetensors"]
    assert m.version == 2 and big[3].algorithm == "blake3" and big[3].sha256 is None
    assert big[3].hexdigest == blake3.blake3(data[3 * CHUNK :]).hexdigest()
    assert big[3].key == "blake3:" + big[3].hexdigest
    assert m.chunks_of("empty.txt") == []
    assert m.total_size == sum(len(d) for d in files.values())


def test_digest_is_stable_and_content_only(tmp_path: Path) -> None:
    write_model(tmp_path)
    a = build_manifest(LocalFolder(tmp_path), chunk_size=CHUNK, workers=1)
    b = build_manifest(
        LocalFolder(tmp_path), chunk_size=CHUNK, workers=4, created_at=datetime.now(UTC)
    )
    assert a.digest == b.digest
    assert a.digest.startswith("sha256:") and len(a.digest_hex) == 64
    assert a.digest_hex == hashlib.sha256(a.canonical_bytes()).hexdigest()

    # Round trip and list order do not change identity.
    doc = json.loads(b.canonical_bytes())
    doc["files"].reverse()
    doc["chunks"].reverse()
    assert Manifest.parse(json.dumps(doc)).digest == a.digest

    # Changing one byte of content does.
    (tmp_path / "config.json").write_bytes(b'{"layers": 3}')
    assert build_manifest(LocalFolder(tmp_path), chunk_size=CHUNK).digest != a.digest
    # And so does the chunk size.
    assert build_manifest(LocalFolder(tmp_path), chunk_size=CHUNK * 2).digest != a.digest


@pytest.mark.parametrize(
    ("path", "reason"),
    [
        ("/etc/passwd", "absolute"),
        ("../secret", r"'\.\.'"),
        ("a/../../b", r"'\.\.'"),
        ("a\\b", "backslash"),
        ("a//b", "empty segment"),
        ("a/", "empty segment"),
        ("", "empty"),
        ("a\0b", "NUL"),
        ("./a", r"'\.'"),
    ],
)
def test_bad_paths_rejected_by_name(path: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        validate_relative_path(path)
    doc = _doc([{"path": path, "size": 0, "sha256": "0" * 64}], [])
    with pytest.raises(ManifestError, match=reason):
        Manifest.parse(json.dumps(doc))


def _doc(files: list[dict[str, object]], chunks: list[dict[str, object]]) -> dict[str, object]:
    return {"version": 1, "chunkSize": 4, "files": files, "chunks": chunks}


def _chunk(file: str, index: int, offset: int, size: int) -> dict[str, object]:
    return {"file": file, "index": index, "offset": offset, "size": size, "sha256": "a" * 64}


def test_valid_document_parses() -> None:
    doc = _doc(
        [{"path": "w.bin", "size": 6, "sha256": "b" * 64}],
        [_chunk("w.bin", 0, 0, 4), _chunk("w.bin", 1, 4, 2)],
    )
    assert len(Manifest.parse(json.dumps(doc)).chunks) == 2


@pytest.mark.parametrize(
    ("files", "chunks", "message"),
    [
        (
            [{"path": "w.bin", "size": 1, "sha256": "b" * 64}] * 2,
            [],
            "duplicate file path 'w.bin'",
        ),
        ([{"path": "w.bin", "size": 6, "sha256": "b" * 64}], [_chunk("w.bin", 0, 0, 4)], "w.bin"),
        (
            [{"path": "w.bin", "size": 6, "sha256": "b" * 64}],
            [_chunk("w.bin", 0, 0, 4), _chunk("w.bin", 1, 3, 3)],
            "do not tile",
        ),
        (
            [{"path": "w.bin", "size": 4, "sha256": "b" * 64}],
            [_chunk("w.bin", 0, 0, 4), _chunk("other.bin", 0, 0, 4)],
            "unknown file 'other.bin'",
        ),
        ([{"path": "w.bin", "size": 4, "sha256": "B" * 64}], [], "sha256"),
    ],
)
def test_inconsistent_manifests_rejected(
    files: list[dict[str, object]], chunks: list[dict[str, object]], message: str
) -> None:
    with pytest.raises(ManifestError, match=message):
        Manifest.parse(json.dumps(_doc(files, chunks)))


def test_unknown_fields_rejected() -> None:
    doc = _doc([], [])
    doc["extra"] = 1
    with pytest.raises(ManifestError, match="extra"):
        Manifest.parse(json.dumps(doc))


# Computed by the manifest code before tensors were listed: a manifest without tensors
# must keep this identity (and its canonical document) forever.
PINNED_DOC = {
    "version": 1,
    "chunkSize": 4,
    "createdAt": "2026-01-02T03:04:05Z",
    "files": [
        {"path": "w.bin", "size": 6, "sha256": "b" * 64},
        {"path": "model.safetensors", "size": 4, "sha256": "c" * 64},
    ],
    "chunks": [
        {"file": "w.bin", "index": 0, "offset": 0, "size": 4, "sha256": "a" * 64},
        {"file": "w.bin", "index": 1, "offset": 4, "size": 2, "sha256": "d" * 64},
        {"file": "model.safetensors", "index": 0, "offset": 0, "size": 4, "sha256": "e" * 64},
    ],
}
PINNED_DIGEST_HEX = "b5f93c7fcddcb69ae843fe9cb97bcde5e65ba57f3e67e9564b1cd3f5ec4c9721"


def test_digest_of_a_manifest_without_tensors_is_pinned() -> None:
    m = Manifest.parse(json.dumps(PINNED_DOC))
    assert m.tensors == ()
    assert m.digest_hex == PINNED_DIGEST_HEX
    assert b'"tensors"' not in m.canonical_bytes()
    assert "tensors" not in m.model_dump(by_alias=True)


def save_shard(path: Path, seed: int, count: int = 6) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tensors = {
        f"layers.{i}.weight": torch.randn(37, 19 + i, generator=g).to(torch.bfloat16)
        for i in range(count)
    }
    tensors["scale"] = torch.tensor([seed], dtype=torch.int8)  # 1 byte: not word-sized
    tensors["empty"] = torch.empty(0, 3)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))
    return tensors


@pytest.mark.parametrize("chunk_size", [64 * 1024, 1000, 96])  # header alone spans chunks at 96
def test_build_lists_every_tensor_of_safetensors_files(tmp_path: Path, chunk_size: int) -> None:
    save_shard(tmp_path / "model-1.safetensors", 1)
    save_shard(tmp_path / "sub/model-2.safetensors", 2, count=3)
    (tmp_path / "config.json").write_text("{}")

    m = build_manifest(LocalFolder(tmp_path), chunk_size=chunk_size, workers=2)

    assert {t.file for t in m.tensors} == {"model-1.safetensors", "sub/model-2.safetensors"}
    for path in ("model-1.safetensors", "sub/model-2.safetensors"):
        layout = read_layout(tmp_path / path).by_name()
        loaded = load_file(str(tmp_path / path))
        entries = m.tensors_of(path)
        assert sorted(e.name for e in entries) == sorted(loaded)
        for e in entries:
            info = layout[e.name]
            assert (e.dtype, e.shape, e.offset, e.size) == (
                info.dtype,
                info.shape,
                info.start,
                info.size,
            )
            assert e.checksum == checksum_tensor(loaded[e.name])
    assert m.tensors_of("config.json") == []

    again = Manifest.parse(m.canonical_bytes())
    assert again == m and again.digest == m.digest
    doc = json.loads(m.canonical_bytes())
    biggest = max(doc["tensors"], key=lambda t: t["size"])
    biggest["checksum"] = "0" * 32
    assert Manifest.parse(json.dumps(doc)).digest != m.digest


def test_file_named_safetensors_that_is_not_one_gets_no_tensors(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "model.safetensors").write_bytes(random.Random(0).randbytes(3000))
    m = build_manifest(LocalFolder(tmp_path), chunk_size=1024)
    assert m.tensors == () and len(m.chunks) == 3
    assert "model.safetensors: not a valid safetensors file" in caplog.text


def _tensor(file: str = "w.safetensors", **over: object) -> dict[str, object]:
    entry: dict[str, object] = {
        "file": file,
        "name": "a",
        "dtype": "F32",
        "shape": [2],
        "offset": 8,
        "size": 8,
        "checksum": "f" * 32,
    }
    return {**entry, **over}


def _doc_with(*tensors: dict[str, object]) -> dict[str, object]:
    doc = _doc(
        [{"path": "w.safetensors", "size": 16, "sha256": "b" * 64}],
        [_chunk("w.safetensors", i, 4 * i, 4) for i in range(4)],
    )
    doc["tensors"] = list(tensors)
    return doc


def test_valid_tensors_parse_in_canonical_order() -> None:
    doc = _doc_with(_tensor(name="b", offset=12, shape=[1], size=4), _tensor(shape=[1], size=4))
    m = Manifest.parse(json.dumps(doc))
    assert [t.name for t in m.tensors] == ["a", "b"]
    doc["tensors"].reverse()  # type: ignore[attr-defined]
    assert Manifest.parse(json.dumps(doc)).digest == m.digest


@pytest.mark.parametrize(
    ("tensors", "message"),
    [
        ([_tensor(file="other.safetensors")], "unknown file 'other.safetensors'"),
        ([_tensor(offset=12)], r"lies outside 'w.safetensors' \(16 bytes\)"),
        ([_tensor(), _tensor(name="b", offset=12, shape=[1], size=4)], "overlaps"),
        ([_tensor(shape=[1], size=4), _tensor(offset=12, shape=[1], size=4)], "listed twice"),
        ([_tensor(size=4)], "takes 8 bytes, size says 4"),
        ([_tensor(dtype="Q7")], "unknown dtype"),
        ([_tensor(checksum="F" * 32)], "checksum"),
        ([_tensor(shape=[-1])], "shape"),
    ],
)
def test_inconsistent_tensors_rejected(tensors: list[dict[str, object]], message: str) -> None:
    with pytest.raises(ManifestError, match=message):
        Manifest.parse(json.dumps(_doc_with(*tensors)))


# A 171-byte document claiming a 10^12-byte file in 1-byte chunks. Parsed in a child
# process capped at 2 GiB of address space, so the check also holds when parsing would
# try to build the trillion expected chunks (it must fail fast with a ManifestError).
HOSTILE_PARSE = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (2 * 1024**3, 2 * 1024**3))
from weightship.weightformat.manifest import Manifest, ManifestError
try:
    Manifest.parse(sys.stdin.buffer.read())
except ManifestError as exc:
    print("ManifestError:", exc)
"""


def _huge_claim(chunk_size: int = 1, size: int = 10**12) -> bytes:
    doc = _doc([{"path": "weights.bin", "size": size, "sha256": "a" * 64}], [])
    doc["chunkSize"] = chunk_size
    return json.dumps(doc).encode()


def test_small_manifest_claiming_a_huge_file_fails_fast_in_bounded_memory() -> None:
    import subprocess
    import sys

    data = _huge_claim()
    assert len(data) < 200
    done = subprocess.run(
        [sys.executable, "-c", HOSTILE_PARSE], input=data, capture_output=True, timeout=60
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    out = done.stdout.decode()
    assert out.startswith("ManifestError:"), out
    assert "10000000000000 chunks" not in out and "1000000000000 chunks" in out


def test_parsing_a_huge_claim_allocates_almost_nothing() -> None:
    import tracemalloc

    tracemalloc.start()
    try:
        with pytest.raises(ManifestError, match="takes 1000000000000 chunks, 0 are listed"):
            Manifest.parse(_huge_claim())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1024 * 1024


def test_claims_beyond_the_bounds_are_refused_by_name() -> None:
    with pytest.raises(ManifestError, match="size"):
        Manifest.parse(_huge_claim(size=2**60))
    with pytest.raises(ManifestError, match="chunkSize"):
        Manifest.parse(_huge_claim(chunk_size=2**40))
    too_long = json.dumps(_doc([], [])).encode() + b" " * (256 * 1024 * 1024)
    with pytest.raises(ManifestError, match="over the 268435456 bytes"):
        Manifest.parse(too_long)


@pytest.mark.parametrize("field", ["path", "sha256"])
def test_a_10_mb_field_gives_a_short_error_naming_it(field: str) -> None:
    entry: dict[str, object] = {"path": "w.bin", "size": 0, "sha256": "a" * 64}
    entry[field] = "a" * (10 * 1024 * 1024)
    with pytest.raises(ManifestError) as caught:
        Manifest.parse(json.dumps(_doc([entry], [])))
    assert f"files.0.{field}" in str(caught.value)
    assert len(str(caught.value)) < 4096


def test_a_million_bad_entries_give_a_bounded_error() -> None:
    chunk = _chunk("w.bin", 0, 0, 4)
    chunk["sha256"] = "x"
    doc = _doc([{"path": "w.bin", "size": 4, "sha256": "b" * 64}], [chunk] * 200_000)
    with pytest.raises(ManifestError, match="and 199995 more") as caught:
        Manifest.parse(json.dumps(doc))
    assert len(str(caught.value)) < 4096


@pytest.mark.parametrize("value", ["a" * 64 + "\n", "a" * 63 + "\n"])
def test_a_digest_with_a_trailing_newline_is_refused(value: str) -> None:
    with pytest.raises(ManifestError, match="sha256"):
        Manifest.parse(json.dumps(_doc([{"path": "w.bin", "size": 0, "sha256": value}], [])))


@pytest.mark.parametrize(
    ("path", "reason"),
    [
        ("a\nb", "control character"),
        ("a\x1bb", "control character"),
        ("a\x85b", "control character"),
        ("d/" + "x" * 256, "segment longer than 255 bytes"),
        ("é" * 128, "segment longer than 255 bytes"),  # 256 bytes in UTF-8
        ("a/" * 600 + "b", "longer than 1024 bytes"),
    ],
)
def test_paths_with_control_characters_or_too_long_are_refused(path: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        validate_relative_path(path)
    doc = _doc([{"path": path, "size": 0, "sha256": "0" * 64}], [])
    with pytest.raises(ManifestError):
        Manifest.parse(json.dumps(doc))
    assert validate_relative_path("d/" + "x" * 255) == "d/" + "x" * 255


# An old (version 1, sha256 chunks) manifest keeps its identity: its digest is pinned to
# the value the code before version 2 computed for this very document.
OLD_DOC = {
    "chunkSize": 4,
    "createdAt": "2026-01-01T00:00:00Z",
    "files": [
        {"path": "w.bin", "size": 6, "sha256": "b" * 64},
        {"path": "model.safetensors", "size": 4, "sha256": "c" * 64},
    ],
    "chunks": [
        {"file": "w.bin", "index": 0, "offset": 0, "size": 4, "sha256": "a" * 64},
        {"file": "w.bin", "index": 1, "offset": 4, "size": 2, "sha256": "d" * 64},
        {"file": "model.safetensors", "index": 0, "offset": 0, "size": 4, "sha256": "e" * 64},
    ],
    "version": 1,
}
OLD_DIGEST = "sha256:b5f93c7fcddcb69ae843fe9cb97bcde5e65ba57f3e67e9564b1cd3f5ec4c9721"


def test_an_old_manifest_keeps_its_digest() -> None:
    m = Manifest.parse(json.dumps(OLD_DOC))
    assert m.version == 1 and m.digest == OLD_DIGEST
    assert all(c.algorithm == "sha256" and c.blake3 is None for c in m.chunks)
    assert b"blake3" not in m.canonical_bytes() and b"piece" not in m.canonical_bytes()
    assert m.piece_layer_path is None and m.piece_count == 0


def test_version_1_built_from_bytes_is_what_it_was(tmp_path: Path) -> None:
    files = write_model(tmp_path)
    m = build_manifest(LocalFolder(tmp_path), chunk_size=CHUNK, version=1)
    assert m.version == 1 and "pieceSize" not in m.canonical_bytes().decode()
    big = m.chunks_of("model-00001.safetensors")
    data = files["model-00001.safetensors"]
    assert big[3].sha256 == hashlib.sha256(data[3 * CHUNK :]).hexdigest()
    assert big[3].key == "sha256:" + big[3].hexdigest


def test_version_2_has_a_piece_layer_of_every_piece(tmp_path: Path) -> None:
    files = write_model(tmp_path)
    piece = 16 * 1024
    m, layer = build_manifest_with_pieces(LocalFolder(tmp_path), chunk_size=CHUNK, piece_size=piece)
    assert (m.version, m.piece_size) == (2, piece)
    assert m.piece_layer == blake3.blake3(layer).hexdigest()
    assert m.piece_layer_path == f"weightship-pieces/{m.piece_layer}.bin"
    want = b""
    for c in m.chunks:
        data = files[c.file][c.offset : c.offset + c.size]
        want += b"".join(
            blake3.blake3(data[s : s + piece]).digest() for s in range(0, c.size, piece)
        )
    assert layer == want and len(layer) == 32 * m.piece_count
    again = Manifest.parse(m.canonical_bytes())
    assert again == m and again.digest == m.digest
    # the piece layer in the folder is not a model file
    (tmp_path / "weightship-pieces").mkdir()
    (tmp_path / m.piece_layer_path).write_bytes(layer)
    assert build_manifest(LocalFolder(tmp_path), chunk_size=CHUNK, piece_size=piece) == m


def _v2_doc(**extra: object) -> dict[str, object]:
    return {
        "chunkSize": 4,
        "files": [{"path": "w.bin", "size": 6, "sha256": "b" * 64}],
        "chunks": [
            {"file": "w.bin", "index": 0, "offset": 0, "size": 4, "blake3": "a" * 64},
            {"file": "w.bin", "index": 1, "offset": 4, "size": 2, "blake3": "d" * 64},
        ],
        "version": 2,
        "pieceSize": 2,
        "pieceLayer": "f" * 64,
        **extra,
    }


def test_a_version_2_document_parses() -> None:
    m = Manifest.parse(json.dumps(_v2_doc()))
    assert m.piece_count == 3 and [c.algorithm for c in m.chunks] == ["blake3", "blake3"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"version": 1}, "version 1 manifest has sha256 chunks"),
        ({"pieceLayer": None}, "pieceSize and pieceLayer go together"),
        ({"pieceSize": 8}, "larger than chunkSize"),
        ({"pieceSize": 0}, "pieceSize"),
        ({"pieceLayer": "F" * 64}, "blake3 must be 64 lowercase hex"),
    ],
)
def test_bad_version_2_documents_are_refused(change: dict[str, object], message: str) -> None:
    doc = _v2_doc(**change)
    doc = {k: v for k, v in doc.items() if v is not None}
    with pytest.raises(ManifestError, match=message):
        Manifest.parse(json.dumps(doc))


@pytest.mark.parametrize(
    "digests",
    [{}, {"sha256": "a" * 64, "blake3": "a" * 64}],
)
def test_a_chunk_has_exactly_one_digest(digests: dict[str, str]) -> None:
    doc = _v2_doc()
    chunks = doc["chunks"]
    assert isinstance(chunks, list)
    chunk = {k: v for k, v in chunks[0].items() if k not in ("sha256", "blake3")}
    chunks[0] = {**chunk, **digests}
    with pytest.raises(ManifestError, match="exactly one of sha256 and blake3"):
        Manifest.parse(json.dumps(doc))


def test_a_version_1_chunk_in_a_version_2_manifest_is_refused() -> None:
    doc = _v2_doc()
    chunks = doc["chunks"]
    assert isinstance(chunks, list)
    chunks[1] = {**{k: v for k, v in chunks[1].items() if k != "blake3"}, "sha256": "d" * 64}
    with pytest.raises(ManifestError, match="version 2 manifest has blake3 chunks"):
        Manifest.parse(json.dumps(doc))


def test_a_hostile_piece_count_is_refused_from_the_document_alone() -> None:
    size = 2**40  # 1 TiB in 1-byte pieces: the count is refused before anything is built
    doc = {
        "chunkSize": 2**32,
        "files": [{"path": "w.bin", "size": size, "sha256": "b" * 64}],
        "chunks": [
            {"file": "w.bin", "index": i, "offset": i * 2**32, "size": 2**32, "blake3": "a" * 64}
            for i in range(size // 2**32)
        ],
        "version": 2,
        "pieceSize": 1,
        "pieceLayer": "f" * 64,
    }
    with pytest.raises(ManifestError, match="pieces, over"):
        Manifest.parse(json.dumps(doc))
