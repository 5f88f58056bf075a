import hashlib
import json
import random
from datetime import UTC, datetime
from pathlib import Path

import pytest

from weightship.data.manifest import (
    MANIFEST_NAME,
    LocalFolder,
    Manifest,
    ManifestError,
    build_manifest,
    validate_relative_path,
)

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
    assert big[3].sha256 == hashlib.sha256(data[3 * CHUNK :]).hexdigest()
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
