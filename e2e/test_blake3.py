"""Version 2 manifests end to end (issue 15): BLAKE3 chunks with a piece layer staged
peer to peer by real agents on the process nodes and loaded verified by the reference
server; a corrupt piece served by a peer is caught at that piece, the peer is demoted,
and the chunk comes from another node."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from e2e.agent_fixtures import PROCESS, Agents, cache_root, damage_staged_piece
from e2e.operator_fixtures import (
    Rollouts,
    publish_models,
    rollout_body,
    tinyllm_models,
    tinyllm_rollout_body,
)
from weightship.data.cli import verify_files_command
from weightship.data.s3 import S3Location, S3Origin
from weightship.weightformat.manifest import Manifest
from weightship_dev import testkit

NAMESPACE_PREFIX = "b3-"
MiB = 1 << 20


def read_manifest(endpoint: str, uri: str) -> Manifest:
    return S3Origin(testkit.local_s3(endpoint), S3Location.parse(uri)).read_manifest()


@pytest.fixture(scope="module")
def tiny(cluster: Any) -> Iterator[dict[str, str]]:
    yield from tinyllm_models(cluster.s3_endpoint, "b3tiny", [("v1", "good", 0)])


@pytest.fixture(scope="module")
def plain(cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    s3 = testkit.s3_client(cluster.s3_endpoint)
    bucket = testkit.unique_name("b3plain")
    s3.create_bucket(Bucket=bucket)
    root = tmp_path_factory.mktemp("models")
    yield publish_models(cluster.s3_endpoint, bucket, root, ["late"], size=6 * MiB)
    testkit.empty_bucket(s3, bucket)
    s3.delete_bucket(Bucket=bucket)


def metric(agents: Agents, node: str, name: str, labels: str = "") -> float:
    pod = agents.pod_on(node)
    with urllib.request.urlopen(f"http://{pod.status.pod_ip}:9101/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + (f"{{{labels}}}" if labels else " ")):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def agent_log(cluster: Any, agents: Agents, node: str) -> str:
    folder = Path(cluster.paths.root) / "nodes" / node / "logs"
    return "\n".join(
        p.read_text(errors="replace") for p in folder.glob(f"{agents.namespace}*agent*")
    )


def test_a_version_2_model_stages_peer_to_peer_and_loads_verified(
    cluster: Any, agents: Agents, rollouts: Rollouts, tiny: dict[str, str]
) -> None:
    manifest = read_manifest(cluster.s3_endpoint, tiny["v1"])
    assert manifest.version == 2 and manifest.piece_layer_path
    assert {c.algorithm for c in manifest.chunks} == {"blake3"}
    body = tinyllm_rollout_body("llm", tiny["v1"], "v1", [{"setWeight": 100}], cluster.s3_endpoint)
    body["spec"]["prefetch"] = {"enabled": True, "nodeSelector": PROCESS, "minStagedPercent": 100}
    rollouts.create(body)
    entries = agents.wait_staged(manifest.digest)
    # The reference server loads the staged files with the verified loader (every chunk's
    # BLAKE3 checked) and the verifier checks what it loaded: Healthy means both held.
    final = rollouts.healthy_on("llm", "v1")
    assert final["status"]["stableRevision"]["manifestDigest"] == manifest.digest
    size, n = manifest.total_size, len(cluster.process_nodes)
    from_origin = sum(e["bytesFromOrigin"] for e in entries.values())
    from_peers = sum(e["bytesFromPeers"] for e in entries.values())
    print(f"\nv2 model of {size} B on {n} nodes: origin {from_origin} B, peers {from_peers} B")
    assert from_origin + from_peers == n * size and from_peers > 0
    for node in cluster.process_nodes:
        mdir = cache_root(cluster, node) / "models" / manifest.digest_hex
        # Staged with its piece layer: pieces were verified as they landed.
        assert (mdir / "pieces").stat().st_size == 32 * manifest.piece_count, node
        # The files' publish-time sha256s hold too, checked by the node-side command.
        result = CliRunner().invoke(
            verify_files_command, [str(cache_root(cluster, node)), manifest.digest]
        )
        assert result.exit_code == 0 and "all match" in result.output, result.output
        assert metric(agents, node, "weightship_agent_peer_demotions_total") == 0


def test_a_corrupt_piece_from_a_peer_is_caught_and_the_chunk_fetched_elsewhere(
    cluster: Any, agents: Agents, rollouts: Rollouts, plain: dict[str, str]
) -> None:
    manifest = read_manifest(cluster.s3_endpoint, plain["late"])
    assert manifest.piece_size and manifest.piece_size < manifest.chunk_size
    nodes = sorted(cluster.process_nodes)
    liar, honest, late = nodes[0], nodes[1], nodes[2]
    wave = "weightship-e2e/wave"

    def label(node: str, value: str | None) -> None:
        cluster.core.patch_node(node, {"metadata": {"labels": {wave: value}}})

    body = rollout_body("llm", plain["late"], "late", [{"setWeight": 100}], cluster.s3_endpoint)
    body["spec"]["prefetch"] = {
        "enabled": True,
        "nodeSelector": {**PROCESS, wave: "early"},
        "minStagedPercent": 100,
    }
    # The late node takes the view of the two early nodes once it finds they hold the
    # chunks it owns among all three (it joined late: fetcher.join_late). There it asks
    # the liar for the liar's chunks when the honest node (asked whole first, from spare
    # uplink: holder probes) is busy, and for the honest node's whole before their owner:
    # every chunk is damaged at the liar, and whichever the liar serves first is caught.
    piece = 1
    targets = [c for c in manifest.chunks if c.size > (piece + 1) * manifest.piece_size]
    assert targets
    try:
        for node in (liar, honest):
            label(node, "early")
        rollouts.create(body)
        agents.wait_staged(manifest.digest, nodes=[liar, honest])
        # Damage one byte of one piece in the liar's cached copy: its agent still lists
        # the chunk as verified and serves it from there.
        for target in targets:
            damage_staged_piece(cluster, liar, manifest, target, piece)
        rollouts.patch_spec("llm", {"prefetch": {"nodeSelector": {wave: None}}})
        entry = agents.wait_staged(manifest.digest, nodes=[late])[late]
    finally:
        for node in (liar, honest):
            label(node, None)
    log = agent_log(cluster, agents, late)
    print(
        f"\n{late}: {entry['bytesFromPeers']} B from peers, {entry['bytesFromOrigin']} B "
        f"from the origin; chunks {[t.index for t in targets]} corrupted at {liar}"
    )
    # Caught at the piece, on the late node, and the liar demoted.
    caught = [
        f"peer {liar} served a bad piece ({piece}) for chunk {t.key}: demoted" for t in targets
    ]
    assert any(line in log for line in caught), log[-2000:]
    assert metric(agents, late, "weightship_agent_peer_demotions_total") >= 1
    failures = metric(
        agents, late, "weightship_agent_chunk_verification_failures_total", 'source="peer"'
    )
    assert failures >= 1
    # The chunk came whole and verified from elsewhere: the late node's files are right.
    result = CliRunner().invoke(verify_files_command, [str(cache_root(cluster, late))])
    assert result.exit_code == 0 and "all match" in result.output, result.output
    assert entry["bytesDone"] == manifest.total_size
