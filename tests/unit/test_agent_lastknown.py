"""What an agent keeps on disk of what the API server told it (weightship.agent.lastknown):
read back as written, bounded, and refused whole, never half-used, when it is anything else."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import pytest

from weightship.agent import lastknown
from weightship.agent.desired import ModelSource, Wanted
from weightship.agent.lastknown import KnownPeer, LastKnown, LastKnownError, decode, encode
from weightship.agent.status import Entry, build_status, recover

A, B = ("sha256:" + c * 64 for c in "ab")
NOW = datetime(2026, 1, 1, 12, tzinfo=UTC)
SOURCE = ModelSource("serving", "s3://models/llm/v2/", "http://s3.local:9000", "us-east-1")


def sample() -> LastKnown:
    wants = (
        Wanted(A, "canary", ("serving/llm",), (SOURCE,), True, 262144, "2026-01-01T11:00:00Z"),
        Wanted(B, "stable", ("serving/llm", "serving/other"), (), False, None),
    )
    status = build_status(
        peer_endpoint="10.0.0.1:8479",
        capacity_bytes=100,
        free_bytes=50,
        entries=[Entry(A, "Staging", started_at=NOW), Entry(B, "Staged", 7, 7, completed_at=NOW)],
        now=NOW,
    )
    peers = lastknown.known_peers(
        [("gpu-2", "10.0.0.2:8479"), ("gpu-3", "[fd00::3]:8479")], {B: {"gpu-2"}, A: set()}
    )
    return LastKnown(wants, peers, node_count=3, status=status, saved_at=NOW)


def test_what_was_written_is_read_back_whole(tmp_path: Path) -> None:
    known = sample()
    path = tmp_path / lastknown.FILE_NAME
    lastknown.write(path, tmp_path / "tmp.json", known)
    assert not (tmp_path / "tmp.json").exists()
    back = lastknown.read(path)
    assert back == known
    assert back.peers == (
        KnownPeer("gpu-2", "10.0.0.2:8479", (B,)),
        KnownPeer("gpu-3", "[fd00::3]:8479"),
    )
    # The status comes back as the entries the agent reports, start and completion included.
    entries = recover(back.status)
    assert entries[A].started_at == NOW and entries[B].completed_at == NOW
    # No credential travels with a source: only where the weights are.
    assert set(json.loads(encode(known))["wants"][0]["sources"][0]) == {
        "namespace",
        "uri",
        "endpoint",
        "region",
    }


def test_the_same_knowledge_saved_at_another_time_is_no_change() -> None:
    known = sample()
    assert known.same_as(replace(known, saved_at=None))
    assert not known.same_as(LastKnown(known.wants, (), 3, known.status, NOW))


def test_a_missing_file_is_nothing_known(tmp_path: Path) -> None:
    assert lastknown.read(tmp_path / "absent.json") is None


@pytest.mark.parametrize(
    ("what", "raw"),
    [
        ("cut short", encode(sample())[:-40]),
        ("not json", b"\x00\xff garbage"),
        ("another format", json.dumps({"format": 99}).encode()),
        ("a list", b"[]"),
        ("a digest that is a path", encode(sample()).replace(A.encode(), b"sha256:../../etc")),
        ("a node that is no name", encode(sample()).replace(b'"gpu-2"', b'"../gpu"')),
        ("a role unknown", encode(sample()).replace(b'"canary"', b'"leader"')),
        ("a negative rate", encode(sample()).replace(b"262144", b"-1")),
        ("no node count", encode(sample()).replace(b'"nodeCount":3', b'"nodeCount":0')),
    ],
)
def test_a_damaged_file_is_refused_whole_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, what: str, raw: bytes
) -> None:
    with pytest.raises(LastKnownError):
        decode(raw)
    path = tmp_path / lastknown.FILE_NAME
    path.write_bytes(raw)
    with caplog.at_level(logging.WARNING):
        assert lastknown.read(path) is None, what
    assert "ignoring" in caplog.text


def test_the_file_is_bounded(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    many = tuple(KnownPeer(f"gpu-{i}", f"10.1.{i // 250}.{i % 250}:8479") for i in range(12_000))
    known = LastKnown(sample().wants, many, node_count=12_000)
    back = decode(encode(known))
    assert len(back.peers) == lastknown.MAX_PEERS  # the rest is left out when written
    assert len(encode(known)) < lastknown.MAX_BYTES
    path = tmp_path / lastknown.FILE_NAME
    path.write_bytes(b" " * lastknown.MAX_BYTES + encode(known))  # valid JSON, but too large
    with caplog.at_level(logging.WARNING):
        assert lastknown.read(path) is None
    assert "more than" in caplog.text
