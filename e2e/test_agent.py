"""The node agent end to end: a real DaemonSet on the process nodes stages a rollout's
weights peer to peer, the operator waits for them, and an interrupted stage resumes."""

from __future__ import annotations

import hashlib
import shutil
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from e2e.operator_fixtures import (
    OperatorProcess,
    Rollouts,
    publish_models,
    rollout_body,
    s3_secret,
)
from weightship.controller.builders import GROUP, staged_node_label
from weightship.controller.kube import VERSION
from weightship.data.manifest import Manifest
from weightship.data.s3 import S3Location, S3Origin
from weightship.dev import testkit

NAMESPACE_PREFIX = "ag-"
CACHE_DIR = "/var/cache/weightship"
IMAGE = "ghcr.io/weightship/weightship:test"
PROCESS = {"weightship.io/node-kind": "process"}
MiB = 1 << 20


@pytest.fixture(scope="module")
def models(cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    s3 = testkit.s3_client(cluster.s3_endpoint)
    bucket = testkit.unique_name("agent")
    s3.create_bucket(Bucket=bucket)
    root = tmp_path_factory.mktemp("models")
    uris = publish_models(cluster.s3_endpoint, bucket, root, ["v1"], size=6 * MiB)
    uris |= publish_models(cluster.s3_endpoint, bucket, root, ["v2"], size=8 * MiB + 12345)
    yield uris
    testkit.empty_bucket(s3, bucket)
    s3.delete_bucket(Bucket=bucket)


def read_manifest(endpoint: str, uri: str) -> Manifest:
    s3 = testkit.local_s3(endpoint)
    return S3Origin(s3, S3Location.parse(uri)).read_manifest()


def cache_root(cluster: Any, node: str) -> Path:
    return Path(cluster.paths.root) / "nodes" / node / "root" / CACHE_DIR.lstrip("/")


def agent_objects(namespace: str) -> dict[str, Any]:
    def field(path: str) -> dict[str, Any]:
        return {"valueFrom": {"fieldRef": {"fieldPath": path}}}

    labels = {"app": "weightship-agent"}
    return {
        "service_account": {"metadata": {"name": "agent"}},
        "cluster_role": {
            "metadata": {"name": f"{namespace}-agent"},
            "rules": [
                {
                    "apiGroups": [GROUP],
                    "resources": ["weightcaches"],
                    "verbs": ["get", "list", "watch", "create", "patch", "update"],
                },
                {
                    "apiGroups": [GROUP],
                    "resources": ["weightcaches/status"],
                    "verbs": ["patch", "update"],
                },
                {
                    "apiGroups": [GROUP],
                    "resources": ["modelrollouts"],
                    "verbs": ["get", "list", "watch"],
                },
                {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list"]},
                {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]},
            ],
        },
        "cluster_role_binding": {
            "metadata": {"name": f"{namespace}-agent"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": f"{namespace}-agent",
            },
            "subjects": [{"kind": "ServiceAccount", "name": "agent", "namespace": namespace}],
        },
        "daemon_set": {
            "metadata": {"name": "agent", "labels": labels},
            "spec": {
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {
                        "labels": labels,
                        "annotations": {
                            "prometheus.io/scrape": "true",
                            "prometheus.io/port": "9101",
                        },
                    },
                    "spec": {
                        "serviceAccountName": "agent",
                        "nodeSelector": PROCESS,
                        "terminationGracePeriodSeconds": 5,
                        "containers": [
                            {
                                "name": "agent",
                                "image": IMAGE,
                                "args": ["agent"],
                                "env": [
                                    {"name": "NODE_NAME", **field("spec.nodeName")},
                                    {"name": "POD_IP", **field("status.podIP")},
                                    {"name": "POD_NAMESPACE", **field("metadata.namespace")},
                                    {"name": "WEIGHTSHIP_CACHE_DIR", "value": CACHE_DIR},
                                    {"name": "WEIGHTSHIP_PEER_PORT", "value": "8479"},
                                    # Only this test's rollouts: other modules share the cluster.
                                    {"name": "WEIGHTSHIP_WATCH_NAMESPACES", "value": namespace},
                                ],
                                "ports": [
                                    {"name": "peer", "containerPort": 8479},
                                    {"name": "metrics", "containerPort": 9101},
                                ],
                                "readinessProbe": {
                                    "httpGet": {"path": "/healthz", "port": "peer"},
                                    "periodSeconds": 1,
                                },
                                # hostPath is root-owned on process nodes; / stays read-only.
                                "securityContext": {
                                    "runAsUser": 0,
                                    "readOnlyRootFilesystem": True,
                                    "allowPrivilegeEscalation": False,
                                },
                                "volumeMounts": [
                                    {"name": "cache", "mountPath": CACHE_DIR},
                                    {"name": "tmp", "mountPath": "/tmp"},
                                ],
                            }
                        ],
                        "volumes": [
                            {
                                "name": "cache",
                                "hostPath": {"path": CACHE_DIR, "type": "DirectoryOrCreate"},
                            },
                            {"name": "tmp", "emptyDir": {}},
                        ],
                    },
                },
            },
        },
    }


class Agents:
    """The agent DaemonSet of one test, and reads of the WeightCaches it writes."""

    def __init__(self, cluster: Any, namespace: str) -> None:
        self.cluster = cluster
        self.namespace = namespace
        self.custom = client.CustomObjectsApi(cluster.api)

    def pods(self) -> list[Any]:
        return list(
            self.cluster.core.list_namespaced_pod(
                self.namespace, label_selector="app=weightship-agent"
            ).items
        )

    def pod_on(self, node: str) -> Any:
        return next(p for p in self.pods() if p.spec.node_name == node)

    def cache(self, node: str) -> dict[str, Any]:
        try:
            return dict(self.custom.get_cluster_custom_object(GROUP, VERSION, "weightcaches", node))
        except ApiException as e:
            if e.status == 404:
                return {}
            raise

    def entry(self, node: str, digest: str) -> dict[str, Any]:
        manifests = (self.cache(node).get("status") or {}).get("manifests") or []
        return next((m for m in manifests if m["digest"] == digest), {})

    def wait_staged(self, digest: str, timeout: float = 90) -> dict[str, dict[str, Any]]:
        nodes = self.cluster.process_nodes

        def all_staged() -> dict[str, dict[str, Any]] | None:
            entries = {n: self.entry(n, digest) for n in nodes}
            failed = {
                n: e.get("lastError") for n, e in entries.items() if e.get("state") == "Failed"
            }
            assert not failed, f"staging failed: {failed}"
            return entries if all(e.get("state") == "Staged" for e in entries.values()) else None

        return testkit.wait_until(
            all_staged,
            timeout=timeout,
            what=f"{digest} Staged on {nodes}",
            detail=lambda: str({n: self.entry(n, digest) for n in nodes}),
        )

    def logs(self, node: str) -> str:
        folder = Path(self.cluster.paths.root) / "nodes" / node / "logs"
        texts = [p.read_text(errors="replace") for p in folder.glob(f"{self.namespace}*agent*")]
        return "\n".join(texts)[-3000:]


def _delete(fn: Any, *args: Any) -> None:
    try:
        fn(*args)
    except ApiException as e:
        if e.status != 404:
            raise


@pytest.fixture
def agents(cluster: Any, namespace: str, crds: None) -> Iterator[Agents]:
    objs = agent_objects(namespace)
    rbac = client.RbacAuthorizationV1Api(cluster.api)
    for node in cluster.process_nodes:  # every test measures from an empty cache
        shutil.rmtree(cache_root(cluster, node), ignore_errors=True)
    cluster.core.create_namespaced_service_account(namespace, objs["service_account"])
    rbac.create_cluster_role(objs["cluster_role"])
    rbac.create_cluster_role_binding(objs["cluster_role_binding"])
    cluster.apps.create_namespaced_daemon_set(namespace, objs["daemon_set"])
    handle = Agents(cluster, namespace)
    try:

        def ready() -> bool:
            pods = handle.pods()
            up = {
                p.spec.node_name
                for p in pods
                if any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])
            }
            peers = {
                n
                for n in cluster.process_nodes
                if (handle.cache(n).get("status") or {}).get("peerEndpoint")
            }
            return up == peers == set(cluster.process_nodes)

        testkit.wait_until(
            ready,
            timeout=60,
            what="an agent Ready with a WeightCache on every process node",
            detail=lambda: handle.logs(cluster.process_nodes[0]),
        )
        yield handle
    finally:
        _delete(cluster.apps.delete_namespaced_daemon_set, "agent", namespace)
        testkit.wait_until(lambda: not handle.pods(), timeout=60, what="agent pods gone")
        for node in cluster.process_nodes:
            _delete(
                handle.custom.delete_cluster_custom_object, GROUP, VERSION, "weightcaches", node
            )
            labels = cluster.core.read_node(node).metadata.labels or {}
            staged = {k: None for k in labels if k.startswith(f"staged.{GROUP}/")}
            if staged:
                cluster.core.patch_node(node, {"metadata": {"labels": staged}})
            shutil.rmtree(cache_root(cluster, node), ignore_errors=True)
        _delete(rbac.delete_cluster_role_binding, f"{namespace}-agent")
        _delete(rbac.delete_cluster_role, f"{namespace}-agent")


@pytest.fixture
def rollouts(cluster: Any, namespace: str, operator: OperatorProcess) -> Rollouts:
    s3_secret(cluster.core, namespace)
    return Rollouts(cluster.api, namespace)


def prefetching_rollout(cluster: Any, uri: str, revision: str) -> dict[str, Any]:
    body = rollout_body("llm", uri, revision, [{"setWeight": 100}], cluster.s3_endpoint)
    body["spec"]["prefetch"] = {"enabled": True, "nodeSelector": PROCESS, "minStagedPercent": 100}
    return body


def healthy_on(rollouts: Rollouts, revision: str, timeout: float = 90) -> dict[str, Any]:
    return rollouts.wait(
        "llm",
        f"Healthy on {revision}",
        lambda s: (
            s.get("phase") == "Healthy"
            and (s.get("stableRevision") or {}).get("revision") == revision
        ),
        timeout=timeout,
    )


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
    final = healthy_on(rollouts, "v1")
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


def journaled_bytes(cluster: Any, node: str, manifest: Manifest) -> int:
    journal = cache_root(cluster, node) / "models" / manifest.digest_hex / "journal"
    try:
        lines = journal.read_text().split("\n")[:-1]
    except FileNotFoundError:
        return 0
    indexes = {int(s) for s in lines if s.isdigit()}
    return sum(manifest.chunks[i].size for i in indexes if i < len(manifest.chunks))


def test_restarted_agent_resumes_without_refetching(
    cluster: Any, agents: Agents, rollouts: Rollouts, models: dict[str, str]
) -> None:
    rollouts.create(prefetching_rollout(cluster, models["v1"], "v1"))
    healthy_on(rollouts, "v1")

    manifest = read_manifest(cluster.s3_endpoint, models["v2"])
    total = manifest.total_size
    victim = cluster.process_nodes[1]
    old_pod = agents.pod_on(victim)
    # 1 MiB/s per node: the ~8 MiB stage takes long enough to interrupt mid-way.
    rollouts.set_model("llm", models["v2"], "v2")
    rollouts.custom.patch_namespaced_custom_object(
        GROUP,
        VERSION,
        rollouts.namespace,
        "modelrollouts",
        "llm",
        {"spec": {"prefetch": {"bandwidthLimit": "1Mi"}}},
    )
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
    healthy_on(rollouts, "v2")
