"""The node agent end to end: a real DaemonSet on the process nodes stages a rollout's
weights peer to peer, the operator waits for them, and an interrupted stage resumes."""

from __future__ import annotations

import hashlib
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from e2e.agent_fixtures import CACHE_DIR, PROCESS, Agents, cache_root, journaled_bytes
from e2e.operator_fixtures import (
    Rollouts,
    publish_models,
    rollout_body,
)
from weightship.api.names import GROUP, staged_node_label
from weightship.data.s3 import S3Location, S3Origin
from weightship.weightformat.manifest import Manifest
from weightship_dev import testkit

NAMESPACE_PREFIX = "ag-"
MiB = 1 << 20


@pytest.fixture(scope="module")
def models(cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    s3 = testkit.s3_client(cluster.s3_endpoint)
    bucket = testkit.unique_name("agent")
    s3.create_bucket(Bucket=bucket)
    root = tmp_path_factory.mktemp("models")
    uris = publish_models(cluster.s3_endpoint, bucket, root, ["v1"], size=6 * MiB)
    uris |= publish_models(cluster.s3_endpoint, bucket, root, ["v2"], size=8 * MiB + 12345)
    uris |= publish_models(cluster.s3_endpoint, bucket, root, ["late"], size=6 * MiB)
    yield uris
    testkit.empty_bucket(s3, bucket)
    s3.delete_bucket(Bucket=bucket)


def read_manifest(endpoint: str, uri: str) -> Manifest:
    s3 = testkit.local_s3(endpoint)
    return S3Origin(s3, S3Location.parse(uri)).read_manifest()


def prefetching_rollout(cluster: Any, uri: str, revision: str) -> dict[str, Any]:
    body = rollout_body("llm", uri, revision, [{"setWeight": 100}], cluster.s3_endpoint)
    body["spec"]["prefetch"] = {"enabled": True, "nodeSelector": PROCESS, "minStagedPercent": 100}
    return body


def assert_files_match(cluster: Any, manifest: Manifest) -> None:
    for node in cluster.process_nodes:
        files = cache_root(cluster, node) / "models" / manifest.digest_hex / "files"
        for f in manifest.files:
            data = (files / f.path).read_bytes()
            assert len(data) == f.size and hashlib.sha256(data).hexdigest() == f.sha256, (
                f"{node}: {f.path} does not hash to the manifest's sha256"
            )


def test_agents_stage_peer_to_peer_before_the_canary(
    cluster: Any, agents: Agents, rollouts: Rollouts, models: dict[str, str]
) -> None:
    manifest = read_manifest(cluster.s3_endpoint, models["v1"])
    size, digest = manifest.total_size, manifest.digest
    # The agents stage with their mounted credential: they may read no Secret at all.
    for namespace in (agents.namespace, "kube-system"):
        review = client.AuthorizationV1Api(cluster.api).create_subject_access_review(
            {
                "spec": {
                    "user": f"system:serviceaccount:{agents.namespace}:agent",
                    "resourceAttributes": {
                        "verb": "get",
                        "resource": "secrets",
                        "namespace": namespace,
                    },
                }
            }
        )
        assert not review.status.allowed, namespace
    started = time.monotonic()
    rollouts.create(prefetching_rollout(cluster, models["v1"], "v1"))

    entries = agents.wait_staged(digest)
    staged_after = time.monotonic() - started
    label = staged_node_label(digest)
    testkit.wait_until(
        lambda: all(
            (cluster.core.read_node(n).metadata.labels or {}).get(label) == "true"
            for n in cluster.process_nodes
        ),
        timeout=30,
        what=f"nodes labelled {label}",
    )
    final = rollouts.healthy_on("llm", "v1")
    assert final["status"]["stableRevision"]["manifestDigest"] == digest

    # Canary pods ran only on staged nodes, and were required to.
    pods = cluster.core.list_namespaced_pod(
        rollouts.namespace, label_selector=f"{GROUP}/rollout=llm"
    ).items
    assert pods
    for pod in pods:
        node_labels = cluster.core.read_node(pod.spec.node_name).metadata.labels or {}
        assert node_labels.get(label) == "true", f"{pod.metadata.name} on unstaged node"
        terms = pod.spec.affinity.node_affinity.required_during_scheduling_ignored_during_execution
        keys = {e.key for t in terms.node_selector_terms for e in t.match_expressions or []}
        assert label in keys
        # Nothing of the node but this model's files, manifest and marker, read-only.
        host = {v.name: v.host_path.path for v in pod.spec.volumes if v.host_path}
        model_root = f"{CACHE_DIR}/models/{manifest.digest_hex}/"
        assert sorted(host.values()) == [
            model_root + name for name in ("STAGED", "files", "manifest.json")
        ], host
        for container in pod.spec.containers:
            mounts = [m for m in container.volume_mounts or [] if m.name in host]
            assert len(mounts) == 3 and all(m.read_only for m in mounts), mounts

    # The bytes on disk are the manifest's, on every node.
    assert_files_match(cluster, manifest)
    for node, e in entries.items():
        assert e["bytesDone"] == e["bytesTotal"] == size, node
        assert e["pinnedBy"] == [f"{rollouts.namespace}/llm"]
        assert e.get("startedAt") and e.get("completedAt") and not e.get("lastError")
        st = agents.cache(node)["status"]
        assert st["capacityBytes"] > 0 and st["freeBytes"] > 0 and st["stagedManifests"] == 1

    # Peer to peer: the origin served each byte about once for the whole cluster.
    from_origin = sum(e["bytesFromOrigin"] for e in entries.values())
    from_peers = sum(e["bytesFromPeers"] for e in entries.values())
    n = len(cluster.process_nodes)
    print(
        f"\nstaged {size} B on {n} nodes in {staged_after:.1f}s: origin {from_origin} B "
        f"({from_origin / size:.2f}x S), peers {from_peers} B"
    )
    assert from_origin + from_peers == n * size
    assert from_origin <= 1.5 * size, f"origin served {from_origin / size:.2f}x S"

    # Metrics, scrapeable by annotation: summed over the agents they match the status.
    metric_bytes = 0.0
    for node in cluster.process_nodes:
        pod = agents.pod_on(node)
        with urllib.request.urlopen(f"http://{pod.status.pod_ip}:9101/metrics", timeout=5) as r:
            text = r.read().decode()
            for line in text.splitlines():
                if line.startswith("weightship_agent_chunk_bytes_total{") and (
                    'source="origin"' in line or 'source="peer"' in line
                ):
                    metric_bytes += float(line.rsplit(" ", 1)[1])
    assert metric_bytes == from_origin + from_peers
    assert "weightship_agent_cache_free_bytes" in text
    assert 'weightship_agent_models{state="Staged"} 1.0' in text


def test_restarted_agent_resumes_without_refetching(
    cluster: Any, agents: Agents, rollouts: Rollouts, models: dict[str, str]
) -> None:
    rollouts.create(prefetching_rollout(cluster, models["v1"], "v1"))
    rollouts.healthy_on("llm", "v1")

    manifest = read_manifest(cluster.s3_endpoint, models["v2"])
    total = manifest.total_size
    victim = cluster.process_nodes[1]
    old_pod = agents.pod_on(victim)
    # 1 MiB/s per node: the ~8 MiB stage takes long enough to interrupt mid-way.
    rollouts.set_model("llm", models["v2"], "v2")
    rollouts.patch_spec("llm", {"prefetch": {"bandwidthLimit": "1Mi"}})
    done_before = testkit.wait_until(
        lambda: (b := journaled_bytes(cluster, victim, manifest)) >= 2 * MiB and b,
        timeout=60,
        what=f"{victim} part-way through staging v2",
        interval=0.2,
    )
    # Grace period 0: SIGKILL, as in a node crash; nothing gets a chance to clean up.
    cluster.core.delete_namespaced_pod(
        old_pod.metadata.name, rollouts.namespace, grace_period_seconds=0
    )
    assert done_before < total, "the stage finished before the agent could be interrupted"

    entries = agents.wait_staged(manifest.digest, timeout=90)
    new_pod = agents.pod_on(victim)
    assert new_pod.metadata.uid != old_pod.metadata.uid
    after = entries[victim]
    fetched = after["bytesFromOrigin"] + after["bytesFromPeers"]
    remaining = total - done_before
    print(
        f"\n{victim}: {done_before} of {total} B verified before the restart; the new agent "
        f"fetched {fetched} B ({after['bytesFromOrigin']} origin, {after['bytesFromPeers']} "
        f"peers), remaining was <= {remaining} B"
    )
    assert after["bytesDone"] == total
    assert 0 < fetched <= remaining, "verified chunks were fetched again"
    # Each chunk is journaled once when verified: a refetched chunk would appear twice.
    journal = cache_root(cluster, victim) / "models" / manifest.digest_hex / "journal"
    lines = [s for s in journal.read_text().split("\n") if s.isdigit()]
    assert sorted(map(int, lines)) == list(range(len(manifest.chunks)))
    assert_files_match(cluster, manifest)
    rollouts.healthy_on("llm", "v2")


def test_a_node_joining_late_takes_the_model_from_peers_not_the_origin(
    cluster: Any, agents: Agents, rollouts: Rollouts, models: dict[str, str]
) -> None:
    manifest = read_manifest(cluster.s3_endpoint, models["late"])
    *early, late = cluster.process_nodes
    wave = "weightship-e2e/wave"

    def label(node: str, value: str | None) -> None:
        cluster.core.patch_node(node, {"metadata": {"labels": {wave: value}}})

    body = prefetching_rollout(cluster, models["late"], "late")
    body["spec"]["prefetch"]["nodeSelector"] = {**PROCESS, wave: "early"}
    try:
        for node in early:
            label(node, "early")
        rollouts.create(body)
        agents.wait_staged(manifest.digest, nodes=early)
        assert agents.entry(late, manifest.digest) == {}, "the late node staged it too early"
        # The late node joins: the rollout now selects every process node.
        rollouts.patch_spec("llm", {"prefetch": {"nodeSelector": {wave: None}}})
        entry = agents.wait_staged(manifest.digest, nodes=[late])[late]
    finally:
        for node in early:
            label(node, None)
    print(
        f"\n{late} joined late: {entry['bytesFromPeers']} B from peers, "
        f"{entry['bytesFromOrigin']} B from the origin"
    )
    # Its own share of the chunks came from the nodes that had the model: the origin
    # served it nothing.
    assert entry["bytesFromOrigin"] == 0
    assert entry["bytesFromPeers"] == entry["bytesTotal"] == manifest.total_size
    assert_files_match(cluster, manifest)
