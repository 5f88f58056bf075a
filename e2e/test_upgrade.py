"""`helm upgrade` with rollouts in flight (issue 23, item 4).

The previous release (weightship_dev.release.PREVIOUS_RELEASE: an earlier commit of this
repository, its tree and a venv built from it; the process kubelet runs its image tag
from that venv) is installed with its own CRDs, operator and agents. Two rollouts are
left in flight: `canary` paused mid-canary at a pause without duration, `staging`
part-way through prefetching (capped bandwidth). Then the upgrade as docs/helm.md says
users do it: the working tree's CRDs first (`kubectl apply --server-side`), then
`helm upgrade` to the working tree's chart. Every rollout completes on its revision, the
new agents keep the chunks the old ones staged (each node fetches at most what was still
missing, and each chunk is journaled once), no step runs twice, and the objects stored
under the old CRD validate under the new one.

    flock /work/coord/heavy.lock .venv/bin/pytest e2e/test_upgrade.py -s

Run it under the heavy lock only: it applies the previous release's CRDs to the shared
cluster for the time of the test (the working tree's are applied again after), and its
agents write the process nodes' WeightCaches.
"""

from __future__ import annotations

import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from prometheus_client.parser import text_string_to_metric_families

from e2e.agent_fixtures import PROCESS, Agents, cache_root, delete_if_present, forget_staging
from e2e.operator_fixtures import (
    Rollouts,
    publish_models,
    rollout_body,
    s3_secret,
    wait_reconciled,
)
from e2e.test_agent import journaled_bytes, read_manifest
from e2e.test_standby import Recorder, step_runs
from weightship import rollouts as user_actions
from weightship.api.names import GROUP, ROLLOUT_PLURAL, VERSION
from weightship.data.s3 import S3Location, S3Origin, publish
from weightship_dev import release as releases
from weightship_dev import testkit
from weightship_dev.install import CRDS, apply_crds, helm, install_chart, prepare_cache_dirs
from weightship_dev.layout import S3_ACCESS_KEY, S3_SECRET_KEY, bin_dir

NAMESPACE_PREFIX = "up-"
KiB, MiB = 1 << 10, 1 << 20
# The staging model: 12 MiB in 256 KiB chunks at 64 KiB/s per node (about 190 s for the
# old agents), so every node is still part-way when they are replaced, however slowly the
# canary before it gets to its pause (in CI 256 KiB/s let the old agents finish first,
# and then the new agents' counters were the old ones'); the cap is lifted before the
# upgrade, which the old agents' running stages never see (a stage keeps the cap it
# began with) and the new agents' do.
STAGING_SIZE, STAGING_CHUNK, STAGING_CAP = 12 * MiB, 256 * KiB, "64Ki"
OPERATOR_METRICS_PORT = 9100  # the chart's operator.metricsPort
CANARY_STEPS: list[dict[str, Any]] = [{"setWeight": 50}, {"pause": {}}, {"setWeight": 100}]


def agent_sets(namespace: str) -> list[str]:
    return [
        "agent.s3.existingSecret=agent-s3",
        "agent.extraEnv[0].name=WEIGHTSHIP_WATCH_NAMESPACES",
        f"agent.extraEnv[0].value={namespace}",
    ]


def kubectl(cluster: Any, *args: str) -> str:
    proc = subprocess.run(
        [str(bin_dir() / "kubectl"), "--kubeconfig", str(cluster.paths.admin_kubeconfig), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, f"kubectl {' '.join(args)}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def apply_crds_as_users_do(cluster: Any, crds: Path) -> None:
    """docs/helm.md's upgrade step: server-side apply of the chart version's crds/.
    --force-conflicts: the CRDs' fields belong to whoever wrote them before (helm, when it
    installed crds/; another test's replace here)."""
    kubectl(cluster, "apply", "--server-side", "--force-conflicts", "-f", str(crds))
    kubectl(cluster, "wait", "--for=condition=Established", "--timeout=30s", "-f", str(crds))


class ChartOperator:
    """The chart's operator pod, as `wait_reconciled` reads an operator: when it last
    finished a reconcile of a rollout (its /metrics, on the pod's IP)."""

    def __init__(self, cluster: Any, namespace: str) -> None:
        self.cluster, self.namespace = cluster, namespace

    def reconciled_at(self, namespace: str, name: str) -> float | None:
        pods = self.cluster.core.list_namespaced_pod(
            self.namespace, label_selector="app.kubernetes.io/component=operator"
        ).items
        for pod in pods:
            if not pod.status.pod_ip or pod.metadata.deletion_timestamp:
                continue
            url = f"http://{pod.status.pod_ip}:{OPERATOR_METRICS_PORT}/metrics"
            try:
                with urllib.request.urlopen(url, timeout=2) as resp:
                    text = resp.read().decode()
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                continue
            for family in text_string_to_metric_families(text):
                if family.name == "weightship_rollout_last_reconcile_timestamp_seconds":
                    for sample in family.samples:
                        if sample.labels == {"namespace": namespace, "name": name}:
                            return float(sample.value)
        return None

    def tail(self) -> str:
        return ""


def release_processes(release: releases.Release) -> list[int]:
    """The processes running the release's `weightship` (its venv's script)."""
    script = str(release.weightship).encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if script in argv:
            found.append(int(entry))
    return found


def pods_of(cluster: Any, namespace: str, rollout: str) -> list[Any]:
    return list(
        cluster.core.list_namespaced_pod(
            namespace, label_selector=f"{GROUP}/rollout={rollout}"
        ).items
    )


def namespace_lister(namespace: str, service_account: str) -> tuple[dict[str, Any], ...]:
    """What the previous release's chart did not grant its scoped operator: list and watch
    namespaces. Without it kopf retries that list for about 54 s before its first
    reconcile; the test gives the old operator this much so as not to wait, and takes it
    away before the upgrade (the chart grants it since)."""
    name = f"{namespace}-namespace-lister"
    return (
        {
            "kind": "ClusterRole",
            "metadata": {"name": name},
            "rules": [{"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]}],
        },
        {
            "kind": "ClusterRoleBinding",
            "metadata": {"name": name},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": name,
            },
            "subjects": [
                {"kind": "ServiceAccount", "name": service_account, "namespace": namespace}
            ],
        },
    )


def drop_namespace_lister(rbac: client.RbacAuthorizationV1Api, namespace: str) -> None:
    name = f"{namespace}-namespace-lister"
    delete_if_present(rbac.delete_cluster_role_binding, name)
    delete_if_present(rbac.delete_cluster_role, name)


@pytest.fixture
def previous() -> releases.Release:
    return releases.build()


@pytest.fixture
def old_release(cluster: Any, namespace: str, previous: releases.Release) -> Iterator[str]:
    """The previous release's chart with its agents, installed with its own CRDs; the
    working tree's CRDs are back when the test ends, whatever happened."""
    forget_staging(cluster)
    prepare_cache_dirs(cluster.paths, nodes=cluster.process_nodes)
    cluster.core.create_namespaced_secret(
        namespace,
        {
            "metadata": {"name": "agent-s3"},
            "stringData": {
                "AWS_ACCESS_KEY_ID": S3_ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": S3_SECRET_KEY,
            },
        },
    )
    name = testkit.unique_name("ws")
    rbac = client.RbacAuthorizationV1Api(cluster.api)
    role, binding = namespace_lister(namespace, f"{name}-weightship-operator")
    try:
        rbac.create_cluster_role(role)
        rbac.create_cluster_role_binding(binding)
        began = time.monotonic()
        apply_crds_as_users_do(cluster, previous.crds)
        install_chart(
            cluster.paths, name, namespace, [namespace],
            *agent_sets(namespace), f"image.tag={previous.tag}",
            agent=True, chart=previous.chart, node_selector=PROCESS,
        )  # fmt: skip
        print(f"\n{previous.tag} installed in {time.monotonic() - began:.1f} s")
        yield name
    finally:
        helm(cluster.paths, "uninstall", name, "-n", namespace, "--wait", "--timeout", "60s",
             "--ignore-not-found")  # fmt: skip
        testkit.wait_until(
            lambda: (
                not cluster.core.list_namespaced_pod(
                    namespace, label_selector="app.kubernetes.io/component=agent"
                ).items
            ),
            timeout=60,
            what="the chart's agents gone",
        )
        forget_staging(cluster)
        apply_crds(cluster.api)
        drop_namespace_lister(rbac, namespace)


def staging_model(cluster: Any, bucket: str, root: Path) -> str:
    folder = root / "big"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(os.urandom(STAGING_SIZE))
    uri = f"s3://{bucket}/models/big/"
    publish(folder, S3Origin(testkit.local_s3(cluster.s3_endpoint), S3Location.parse(uri)),
            chunk_size=STAGING_CHUNK)  # fmt: skip
    return uri


@pytest.fixture
def models(cluster: Any, tmp_path: Path) -> Iterator[dict[str, str]]:
    s3 = testkit.s3_client(cluster.s3_endpoint)
    bucket = testkit.unique_name("upgrade")
    s3.create_bucket(Bucket=bucket)
    try:
        uris = publish_models(cluster.s3_endpoint, bucket, tmp_path, ["v1", "v2"])
        uris["big"] = staging_model(cluster, bucket, tmp_path)
        yield uris
    finally:
        testkit.empty_bucket(s3, bucket)
        s3.delete_bucket(Bucket=bucket)


def test_helm_upgrade_with_rollouts_mid_canary_and_mid_staging(
    cluster: Any,
    namespace: str,
    previous: releases.Release,
    old_release: str,
    models: dict[str, str],
) -> None:
    started = time.monotonic()
    marks: dict[str, float] = {}

    def mark(what: str) -> None:
        marks[what] = time.monotonic() - started

    # The old release runs the old code: its operator and its three agents.
    testkit.wait_until(
        lambda: len(release_processes(previous)) >= 1 + len(cluster.process_nodes),
        timeout=30,
        what=f"the operator and agents of {previous.tag} running {previous.weightship}",
        detail=lambda: (
            "none: do the process kubelets predate weightship_dev.kubelet.images' release "
            "tags? (restart the local cluster)"
        ),
    )
    s3_secret(cluster.core, namespace)
    rollouts = Rollouts(cluster.api, namespace)
    agents = Agents(cluster, namespace)
    custom = client.CustomObjectsApi(cluster.api)
    recorder = Recorder(
        custom.list_namespaced_custom_object, (GROUP, VERSION, namespace, ROLLOUT_PLURAL), "canary"
    ).start()
    try:
        rollouts.create(
            rollout_body("canary", models["v1"], "v1", CANARY_STEPS, cluster.s3_endpoint)
        )
        big = read_manifest(cluster.s3_endpoint, models["big"])
        body = rollout_body("staging", models["big"], "big", [{"setWeight": 100}],
                            cluster.s3_endpoint, replicas=1)  # fmt: skip
        body["spec"]["prefetch"] = {
            "enabled": True,
            "nodeSelector": PROCESS,
            "minStagedPercent": 100,
            "bandwidthLimit": STAGING_CAP,
        }
        rollouts.create(body)
        rollouts.healthy_on("canary", "v1")
        mark("canary on v1")
        rollouts.set_model("canary", models["v2"], "v2")
        paused = rollouts.wait(
            "canary",
            "paused mid-canary (the pause without duration)",
            lambda s: (
                (s.get("canaryRevision") or {}).get("revision") == "v2"
                and s.get("currentStepIndex") == 1
                and s.get("canaryWeight") == 50
                and s.get("phase") == "Paused"
            ),
        )
        pause_started = paused["status"]["pauseStartTime"]
        mark("canary paused")
        serving = {p.metadata.uid for p in pods_of(cluster, namespace, "canary")}
        # Every node part-way: at least two chunks verified and journaled.
        testkit.wait_until(
            lambda: all(
                journaled_bytes(cluster, n, big) >= 2 * STAGING_CHUNK for n in cluster.process_nodes
            ),
            timeout=60,
            what="every node part-way through staging",
            interval=0.2,
        )
        rollouts.patch_spec("staging", {"prefetch": {"bandwidthLimit": None}})
        done_before = {n: journaled_bytes(cluster, n, big) for n in cluster.process_nodes}
        assert all(b < big.total_size for b in done_before.values()), done_before
        assert rollouts.get("staging")["status"].get("phase") != "Healthy"
        mark("in flight")

        # The upgrade, as docs/helm.md says: CRDs first, then the chart (whose own RBAC
        # lets its operator list namespaces).
        drop_namespace_lister(client.RbacAuthorizationV1Api(cluster.api), namespace)
        apply_crds_as_users_do(cluster, CRDS)
        mark("new CRDs")
        upgrade_began = datetime.now(UTC).replace(microsecond=0)
        install_chart(cluster.paths, old_release, namespace, [namespace],
                      *agent_sets(namespace), agent=True, node_selector=PROCESS)  # fmt: skip
        mark("upgraded")
        assert not release_processes(previous), "a pod of the old release still runs"
        for pod in cluster.core.list_namespaced_pod(
            namespace, label_selector="app.kubernetes.io/name=weightship"
        ).items:
            assert pod.spec.containers[0].image.endswith(":local"), pod.metadata.name

        # Objects stored under the old CRD validate under the new one: a whole-object
        # write (PUT) of each, a dry-run create of its spec (no ratcheting: every field
        # checked), and a status write (the promote request).
        for name in ("canary", "staging"):
            stored = rollouts.get(name)
            custom.replace_namespaced_custom_object(
                GROUP, VERSION, namespace, ROLLOUT_PLURAL, name, stored
            )
            copy = {
                "apiVersion": stored["apiVersion"],
                "kind": stored["kind"],
                "metadata": {"name": f"{name}-copy"},
                "spec": stored["spec"],
            }
            custom.create_namespaced_custom_object(
                GROUP, VERSION, namespace, ROLLOUT_PLURAL, copy, dry_run="All"
            )

        # The staging rollout: the new agents finish what the old ones began.
        entries = agents.wait_staged(big.digest, timeout=60)
        mark("staged")
        fetched = {
            n: e["bytesFromOrigin"] + e["bytesFromPeers"] for n, e in entries.items()
        }  # by the new agents, since they started
        print(
            f"\nstaging {big.total_size} B: verified before the upgrade {done_before}; "
            f"fetched by the new agents {fetched}"
        )
        for node, entry in entries.items():
            assert entry["bytesDone"] == big.total_size, node
            # The counters are the new agent's only if it ran the stage (an entry staged
            # before the upgrade keeps the old agent's counters).
            began = datetime.fromisoformat(entry["startedAt"])
            assert began >= upgrade_began, (
                f"{node}: the old agent finished staging before the upgrade "
                f"(started {began}, upgrade at {upgrade_began}): lower STAGING_CAP"
            )
            assert fetched[node] <= big.total_size - done_before[node], (
                f"{node}: verified chunks were fetched again"
            )
            journal = cache_root(cluster, node) / "models" / big.digest_hex / "journal"
            lines = [s for s in journal.read_text().split("\n") if s.isdigit()]
            assert sorted(map(int, lines)) == list(range(len(big.chunks))), node
        assert any(fetched.values()), "no new agent had anything left to stage"
        rollouts.healthy_on("staging", "big")
        mark("staging Healthy")

        # The canary: after whole reconciles by the new operator, still paused where the
        # old one left it, on the same pods; then promoted.
        wait_reconciled(rollouts, ChartOperator(cluster, namespace), "canary")
        status = rollouts.get("canary")["status"]
        assert (status["phase"], status["currentStepIndex"], status["canaryWeight"]) == (
            "Paused", 1, 50,
        ), status  # fmt: skip
        assert status["pauseStartTime"] == pause_started
        assert {p.metadata.uid for p in pods_of(cluster, namespace, "canary")} == serving
        mark("canary reconciled")
        user_actions.promote(cluster.api, namespace, "canary")
        final = rollouts.healthy_on("canary", "v2")
        mark("done")
    finally:
        recorder.stop.set()
    print(
        "upgrade with rollouts in flight: "
        + ", ".join(f"{what} {at:.1f} s" for what, at in marks.items())
    )

    # No step ran twice: across both operators the canary's steps were written in order,
    # each once; the pause kept its start; each StepCompleted event once.
    assert step_runs(recorder.seen, "v2") == [0, 1, 2], step_runs(recorder.seen, "v2")
    pause_starts = {
        (s.obj.get("status") or {}).get("pauseStartTime")
        for s in recorder.seen
        if (s.obj.get("status") or {}).get("currentStepIndex") == 1
        and ((s.obj.get("status") or {}).get("canaryRevision") or {}).get("revision") == "v2"
    }
    assert pause_starts == {pause_started}, pause_starts
    completed = [e.message for e in rollouts.events("canary") if e.reason == "StepCompleted"]
    assert len(completed) == len(set(completed)), f"a step ran twice: {completed}"
    # One ReplicaSet per revision.
    for name, count in (("canary", 2), ("staging", 1)):
        hashes = [rs.metadata.labels[f"{GROUP}/revision-hash"] for rs in rollouts.replicasets(name)]
        assert len(hashes) == len(set(hashes)) == count, (name, hashes)
    promoted = [h["revision"] for h in final["status"]["history"] if h["outcome"] == "Promoted"]
    assert promoted == ["v1", "v2"], promoted
