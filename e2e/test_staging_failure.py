"""Staging failures on the real cluster: real agents on the process nodes, the real S3
server, the operator as a process.

- A corrupt origin (one object's bytes overwritten after its manifest was published)
  aborts the rollout as soon as two nodes report the same chunk, long before
  progressDeadlineSeconds, naming the file and chunk in status, the Event and Slack.
- A full disk on one node (a small tmpfs mounted at that node's cache folder) is that
  node's condition (DiskFull, bytes needed and available): the other nodes stage, the
  rollout waits instead of aborting, names the node in its status, and proceeds on the
  staged nodes once minStagedPercent allows; nothing partial is ever served.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from e2e.agent_fixtures import PROCESS, Agents, cache_root
from e2e.operator_fixtures import Rollouts, publish_models, rollout_body
from weightship import rollouts as user_actions
from weightship.api.names import GROUP, staged_node_label
from weightship.data.s3 import S3Location, S3Origin
from weightship.weightformat.manifest import Manifest
from weightship_dev import testkit
from weightship_dev.layout import BRIDGE_IP
from weightship_dev.slackreceiver import SlackReceiver

NAMESPACE_PREFIX = "sf-"
MiB = 1 << 20
DEADLINE_S = 600  # the default: what a deterministic failure no longer waits for
CORRUPT_CHUNK = 2
ORIGINALS: dict[str, tuple[str, str, Path]] = {}  # uri -> bucket, key, the published file
WEIGHTSHIP = shutil.which("weightship", path=str(Path(sys.executable).parent)) or "weightship"


@pytest.fixture(scope="module")
def models(cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """{"corrupt": uri, "good": uri, "restore": the corrupt one's object key}."""
    s3 = testkit.s3_client(cluster.s3_endpoint)
    bucket = testkit.unique_name("stagefail")
    s3.create_bucket(Bucket=bucket)
    root = tmp_path_factory.mktemp("models")
    uris = publish_models(cluster.s3_endpoint, bucket, root, ["corrupt", "good"], size=6 * MiB)
    # After publishing: one chunk's bytes change in the bucket, the manifest stays.
    key = "models/corrupt/model.safetensors"
    data = bytearray(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[CORRUPT_CHUNK * MiB + 1234] ^= 0xFF
    s3.put_object(Bucket=bucket, Key=key, Body=bytes(data))
    ORIGINALS[uris["corrupt"]] = (bucket, key, root / "corrupt" / "model.safetensors")
    yield uris
    testkit.empty_bucket(s3, bucket)
    s3.delete_bucket(Bucket=bucket)


def read_manifest(endpoint: str, uri: str) -> Manifest:
    return S3Origin(testkit.local_s3(endpoint), S3Location.parse(uri)).read_manifest()


def prefetching_rollout(
    cluster: Any, uri: str, revision: str, min_staged: int = 100
) -> dict[str, Any]:
    body = rollout_body(
        "llm",
        uri,
        revision,
        [{"setWeight": 100}],
        cluster.s3_endpoint,
        progressDeadlineSeconds=DEADLINE_S,
    )
    body["spec"]["prefetch"] = {
        "enabled": True,
        "nodeSelector": PROCESS,
        "minStagedPercent": min_staged,
    }
    return body


def parse_time(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def failures(agents: Agents, nodes: list[str], digest: str) -> dict[str, dict[str, Any]]:
    out = {}
    for node in nodes:
        failure = agents.entry(node, digest).get("failure")
        if failure:
            out[node] = failure
    return out


def test_a_corrupt_origin_aborts_once_two_nodes_agree_naming_file_and_chunk(
    cluster: Any, agents: Agents, rollouts: Rollouts, models: dict[str, str]
) -> None:
    manifest = read_manifest(cluster.s3_endpoint, models["corrupt"])
    digest, nodes = manifest.digest, cluster.process_nodes
    with SlackReceiver(host=BRIDGE_IP) as slack:
        cluster.core.create_namespaced_secret(
            rollouts.namespace, {"metadata": {"name": "slack"}, "stringData": {"url": slack.url}}
        )
        body = prefetching_rollout(cluster, models["corrupt"], "corrupt")
        body["spec"]["notifications"] = {
            "slack": {"webhookSecretRef": {"name": "slack"}, "events": ["RolledBack"]}
        }
        rollouts.create(body)
        created = time.monotonic()
        final = rollouts.wait(
            "llm",
            "aborted",
            lambda s: bool(s.get("abort")),
            timeout=180,
        )
        testkit.wait_until(lambda: slack.received, timeout=30, what="the rollback's Slack message")
    status = final["status"]
    abort = status["abort"]
    where = f"model.safetensors chunk {CORRUPT_CHUNK} (offset {CORRUPT_CHUNK * MiB})"
    assert abort["reason"] == "OriginMismatch", abort
    assert where in abort["message"], abort["message"]
    aborted = next(c for c in status["conditions"] if c["type"] == "Aborted")
    assert aborted["reason"] == "OriginMismatch" and where in aborted["message"]
    assert status["phase"] == "Degraded"

    # The agents that failed said so, with the file and chunk.
    seen = failures(agents, nodes, digest)
    agreeing = {
        n: f
        for n, f in seen.items()
        if f["reason"] == "OriginMismatch"
        and f.get("file") == "model.safetensors"
        and f.get("chunk") == CORRUPT_CHUNK
    }
    assert len(agreeing) >= 2, seen
    since = sorted(parse_time(f["since"]) for f in agreeing.values())
    aborted_at = parse_time(abort["abortedAt"])
    first_s = (since[0] - parse_time(final["metadata"]["creationTimestamp"])).total_seconds()
    after_second_s = (aborted_at - since[1]).total_seconds()
    print(
        f"\nfirst node failed {first_s:.1f}s after the rollout was created; "
        f"aborted {after_second_s:.1f}s after the second node's failure "
        f"(progressDeadlineSeconds {DEADLINE_S}); {len(agreeing)}/{len(nodes)} nodes reported it"
    )
    # Timestamps are the agents' and the operator's clocks on one host.
    assert -1.0 <= after_second_s <= 60.0, (since, aborted_at)

    # ... and count it by reason (weightship_agent_stage_failures_total).
    for node in agreeing:
        url = f"http://{agents.pod_on(node).status.pod_ip}:9101/metrics"
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
        assert 'weightship_agent_stage_failures_total{reason="OriginMismatch"}' in text, node

    events = [e for e in rollouts.events("llm") if e.reason == "OriginMismatch"]
    assert events and where in events[0].message
    texts = [m["text"] for m in slack.received]
    assert any("OriginMismatch" in t and where in t for t in texts), texts
    fields = str(slack.received[0].get("blocks"))
    assert "model.safetensors" in fields and "chunk" in fields

    # Nothing corrupt was staged or labelled anywhere, and no pod ran on it.
    for node in nodes:
        assert agents.entry(node, digest).get("state") != "Staged", node
        assert not (cache_root(cluster, node) / "models" / manifest.digest_hex / "STAGED").exists()
        labels = cluster.core.read_node(node).metadata.labels or {}
        assert staged_node_label(digest) not in labels, node
    pods = cluster.core.list_namespaced_pod(
        rollouts.namespace, label_selector=f"{GROUP}/rollout=llm"
    ).items
    assert all(p.spec.node_name is None for p in pods), [p.spec.node_name for p in pods]
    print(f"aborted {time.monotonic() - created:.1f}s after the rollout was created")

    # The bytes restored and the rollout retried: the failures from before the retry do
    # not abort it again, the agents try again at once (their back-off restarts), and it
    # becomes Healthy on the very manifest it recorded.
    bucket, key, published = ORIGINALS[models["corrupt"]]
    testkit.s3_client(cluster.s3_endpoint).put_object(
        Bucket=bucket, Key=key, Body=published.read_bytes()
    )
    retried = time.monotonic()
    user_actions.retry(cluster.api, rollouts.namespace, "llm")
    healthy = rollouts.healthy_on("llm", "corrupt", timeout=120)["status"]
    print(f"Healthy {time.monotonic() - retried:.1f}s after the retry")
    assert healthy["stableRevision"]["manifestDigest"] == digest
    assert not healthy.get("abort")
    for node in nodes:  # labelled once its WeightCache said Staged
        labels = cluster.core.read_node(node).metadata.labels or {}
        assert labels.get(staged_node_label(digest)) == "true", node


@pytest.fixture
def full_disk(cluster: Any) -> Iterator[str]:
    """The last process node's cache folder on a 4 MiB tmpfs: the agent there has less
    room than its reserve, so no model fits. Mounted before the agents start."""
    node = cluster.process_nodes[-1]
    folder = cache_root(cluster, node)
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(folder)], check=True)
    try:
        yield node
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def test_a_full_disk_on_one_node_is_its_condition_and_the_others_proceed(
    cluster: Any, full_disk: str, agents: Agents, rollouts: Rollouts, models: dict[str, str]
) -> None:
    manifest = read_manifest(cluster.s3_endpoint, models["good"])
    digest = manifest.digest
    others = [n for n in cluster.process_nodes if n != full_disk]
    rollouts.create(prefetching_rollout(cluster, models["good"], "good"))

    agents.wait_staged(digest, nodes=others)

    def disk_full() -> dict[str, Any] | None:
        entry = agents.entry(full_disk, digest)
        failure = entry.get("failure") or {}
        return entry if failure.get("reason") == "DiskFull" else None

    entry = testkit.wait_until(
        disk_full,
        timeout=60,
        what=f"{full_disk} reports DiskFull",
        detail=lambda: str(agents.entry(full_disk, digest)),
    )
    failure = entry["failure"]
    assert entry["state"] in ("Failed", "Staging"), entry  # Staging: a retry under way
    assert failure["bytesNeeded"] == manifest.total_size, failure
    assert failure["bytesAvailable"] < failure["bytesNeeded"], failure
    assert "not enough space" in (entry.get("lastError") or "")

    # The rollout waits (it does not abort): its status names the node and why.
    def waiting_on_the_full_node(s: dict[str, Any]) -> bool:
        nodes = {n["name"]: n for n in (s.get("prefetch") or {}).get("nodes") or []}
        reason = ((nodes.get(full_disk) or {}).get("failure") or {}).get("reason")
        staged = (s.get("prefetch") or {}).get("stagedNodes")
        return s.get("phase") == "Prefetching" and reason == "DiskFull" and staged == len(others)

    status = rollouts.wait("llm", "waiting on the full node", waiting_on_the_full_node)["status"]
    prefetched = next(c for c in status["conditions"] if c["type"] == "Prefetched")
    assert prefetched["status"] == "False"
    assert f"{full_disk}: DiskFull" in prefetched["message"], prefetched
    assert not status.get("abort")

    shown = subprocess.run(
        [WEIGHTSHIP, "status", "llm", "-n", rollouts.namespace],
        env={**os.environ, "KUBECONFIG": str(cluster.paths.admin_kubeconfig), "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr
    assert full_disk in shown.stdout and "DiskFull" in shown.stdout, shown.stdout

    # Nothing partial on the full node is served or labelled.
    full_model = cache_root(cluster, full_disk) / "models" / manifest.digest_hex
    assert not (full_model / "STAGED").exists()
    label = staged_node_label(digest)
    assert label not in (cluster.core.read_node(full_disk).metadata.labels or {})

    # With minStagedPercent met by the others, the rollout proceeds on the staged nodes.
    rollouts.patch_spec("llm", {"prefetch": {"minStagedPercent": 60}})
    rollouts.healthy_on("llm", "good", timeout=120)
    pods = cluster.core.list_namespaced_pod(
        rollouts.namespace, label_selector=f"{GROUP}/rollout=llm"
    ).items
    assert pods and all(p.spec.node_name in others for p in pods), [p.spec.node_name for p in pods]
    assert label not in (cluster.core.read_node(full_disk).metadata.labels or {})
    assert agents.entry(full_disk, digest).get("state") != "Staged"
