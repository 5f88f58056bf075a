import hashlib
import json
import os

import blake3
import pytest

from weightship.weightformat.chunkhash import (
    PieceLayer,
    PieceVerificationError,
    chunk_matches,
    new_chunk_hasher,
    piece_spans,
)
from weightship.weightformat.entries import ChunkEntry
from weightship.weightformat.manifest import Manifest, ManifestError

DATA = os.urandom(100_000)


def _chunk(**digest: str) -> ChunkEntry:
    return ChunkEntry(file="w.bin", index=0, offset=0, size=len(DATA), **digest)


SHA = _chunk(sha256=hashlib.sha256(DATA).hexdigest())
B3 = _chunk(blake3=blake3.blake3(DATA).hexdigest())


@pytest.mark.parametrize("threads", [1, 2, blake3.blake3.AUTO])
def test_the_hasher_follows_the_chunks_algorithm(threads: int) -> None:
    for chunk in (SHA, B3):
        h = new_chunk_hasher(chunk, max_threads=threads)
        h.update(DATA[:777])
        h.update(memoryview(DATA)[777:])
        assert h.hexdigest() == chunk.hexdigest
    assert (SHA.algorithm, B3.algorithm) == ("sha256", "blake3")


@pytest.mark.parametrize("chunk", [SHA, B3])
def test_chunk_matches_only_its_own_bytes(chunk: ChunkEntry) -> None:
    assert chunk_matches(chunk, DATA) and chunk_matches(chunk, memoryview(DATA), max_threads=2)
    bad = bytearray(DATA)
    bad[5000] ^= 1
    assert not chunk_matches(chunk, bad)
    assert not chunk_matches(chunk, DATA[:-1])


def test_a_sha256_digest_is_not_taken_for_a_blake3_one() -> None:
    # the same hex under the other algorithm is another chunk, and does not verify
    swapped = _chunk(blake3=SHA.hexdigest)
    assert swapped.key != SHA.key and not chunk_matches(swapped, DATA)


def _manifest(piece: int) -> tuple[Manifest, bytes]:
    chunks = [(0, 60_000), (60_000, 40_000)]
    layer = b"".join(
        blake3.blake3(DATA[off + s : off + e]).digest()
        for off, size in chunks
        for s, e in piece_spans(size, piece)
    )
    doc = {
        "chunkSize": 60_000,
        "files": [{"path": "w.bin", "size": len(DATA), "sha256": "b" * 64}],
        "chunks": [
            {
                "file": "w.bin",
                "index": i,
                "offset": off,
                "size": size,
                "blake3": blake3.blake3(DATA[off : off + size]).hexdigest(),
            }
            for i, (off, size) in enumerate(chunks)
        ],
        "version": 2,
        "pieceSize": piece,
        "pieceLayer": blake3.blake3(layer).hexdigest(),
    }
    return Manifest.parse(json.dumps(doc)), layer


def test_pieces_verify_as_they_land_and_a_bad_one_stops_at_its_index() -> None:
    m, layer = _manifest(16_384)
    pieces = PieceLayer(m, layer)
    c = m.chunks[1]
    data = bytearray(DATA[c.offset : c.offset + c.size])
    check = pieces.checker(c)
    assert check.landed(data, 10_000) == 0  # no whole piece yet
    assert check.landed(data, 20_000) == 16_384
    assert check.landed(data, c.size) == c.size  # the short last piece too
    data[33_000] ^= 1  # in piece 2
    again = pieces.checker(c)
    with pytest.raises(PieceVerificationError) as err:
        again.landed(data, c.size)
    assert err.value.piece == 2 and again.verified == 2 * 16_384
    resumed = pieces.checker(c)
    resumed.start_at(2 * 16_384)
    data[33_000] ^= 1
    assert resumed.landed(data, c.size) == c.size


@pytest.mark.parametrize("damage", ["flip", "short", "long"])
def test_a_piece_layer_that_does_not_match_the_manifest_is_refused(damage: str) -> None:
    m, layer = _manifest(16_384)
    bad = {
        "flip": bytes([layer[0] ^ 1]) + layer[1:],
        "short": layer[:-32],
        "long": layer + bytes(32),
    }[damage]
    with pytest.raises(ManifestError, match="piece layer"):
        PieceLayer(m, bad)
