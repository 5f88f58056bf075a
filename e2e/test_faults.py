"""The fault matrix on the real cluster (issue 13): a process node lost mid-canary, and an
S3 error storm mid-staging.

Both touch what every module shares (a process node; agents on every process node), so
run this module under `flock /work/coord/agents.lock`. The node test restores the node
whether it passes or fails.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from e2e.agent_fixtures import PROCESS, Agents, cache_root, damage_staged_piece
from e2e.operator_fixtures import (
    OperatorProcess,
    Rollouts,
    publish_models,
    rollout_body,
    tinyllm_models,
    tinyllm_rollout_body,
    wait_reconciled,
)
from weightship import rollouts as user_actions
from weightship.api.names import REVISION_LABEL, VERIFIED_GATE
from weightship.data.cli import verify_files_command
from weightship.data.s3 import S3Location, S3Origin
from weightship_dev import components, nodes, processes, testkit
from weightship_dev.faultproxy import FaultProxy
from weightship_dev.layout import BRIDGE_IP

NAMESPACE_PREFIX = "fx-"
MiB = 1 << 20


@pytest.fixture(scope="module")
def models(cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    s3 = testkit.s3_client(cluster.s3_endpoint)
    bucket = testkit.unique_name("faults")
    s3.create_bucket(Bucket=bucket)
    root = tmp_path_factory.mktemp("models")
    yield publish_models(cluster.s3_endpoint, bucket, root, ["v1", "v2"], size=16 * MiB)
    testkit.empty_bucket(s3, bucket)
    s3.delete_bucket(Bucket=bucket)


def is_ready(pod: Any) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])


def ready_since(pod: Any) -> datetime | None:
    cond = next((c for c in pod.status.conditions or [] if c.type == "Ready"), None)
    return cond.last_transition_time if cond is not None and cond.status == "True" else None


def node_ready(cluster: Any, node: str) -> bool:
    conditions = cluster.core.read_node(node).status.conditions or []
    return any(c.type == "Ready" and c.status == "True" for c in conditions)


def only_these_agents(cluster: Any, agents: Agents) -> None:
    """Each process node runs one node agent, this test's: another agent on the node (the
    demo's, say) writes the same cluster-scoped WeightCache (its own peer endpoint, its
    own staging states), and what peers and the operator read is then not this test's."""
    others = [
        f"{p.metadata.namespace}/{p.metadata.name}"
        for p in cluster.core.list_pod_for_all_namespaces().items
        if p.spec.node_name in cluster.process_nodes
        and p.metadata.namespace != agents.namespace
        and p.status.phase in ("Pending", "Running")
        and any((c.args or [])[:1] == ["agent"] for c in p.spec.containers)
    ]
    assert not others, (
        f"other node agents run on the process nodes: {others}; they share the WeightCaches "
        "(tear the demo down: kubectl delete ns demo weightship-system)"
    )


# ---- an S3 error storm mid-staging ------------------------------------------------------

STORM_S = 30.0
# Staging failures that abort a rollout at once (core/staging_failure.py); a 5xx storm is
# none of them.
DETERMINISTIC = {"OriginMismatch", "ManifestInvalid", "ManifestChanged"}


def test_an_s3_error_storm_mid_staging_is_ridden_out_without_fetching_a_range_twice(
    cluster: Any, agents: Agents, rollouts: Rollouts, models: dict[str, str]
) -> None:
    only_these_agents(cluster, agents)
    proxy = FaultProxy(cluster.s3_endpoint, host=BRIDGE_IP).start()
    try:
        s3 = testkit.local_s3(cluster.s3_endpoint)
        manifests = {
            v: S3Origin(s3, S3Location.parse(models[v])).read_manifest() for v in ("v1", "v2")
        }
        # The rollout's source, for the operator and the agents alike, is the proxy.
        body = rollout_body("llm", models["v1"], "v1", [{"setWeight": 50}], proxy.url)
        body["spec"]["prefetch"] = {
            "enabled": True,
            "nodeSelector": PROCESS,
            "minStagedPercent": 100,
        }
        rollouts.create(body)
        agents.wait_staged(manifests["v1"].digest)
        rollouts.healthy_on("llm", "v1")

        # v2's staging starts, and after its first few chunks the origin answers only
        # 503 SlowDown / 500 InternalError for STORM_S seconds.
        digest = manifests["v2"].digest
        proxy.storm(seconds=STORM_S, after_ranged_gets=3)
        rollouts.set_model("llm", models["v2"], "v2")
        seen: dict[str, set[str]] = {n: set() for n in cluster.process_nodes}
        errors: set[str] = set()
        phases: set[str] = set()

        def look() -> dict[str, dict[str, Any]] | None:
            status = rollouts.get("llm").get("status") or {}
            phases.add(str(status.get("phase")))
            assert not status.get("abort"), f"the storm aborted the rollout: {status}"
            entries = {n: agents.entry(n, digest) for n in cluster.process_nodes}
            for node, entry in entries.items():
                seen[node].add(str(entry.get("state")))
                if entry.get("lastError"):
                    errors.add(entry["lastError"])
                reason = (entry.get("failure") or {}).get("reason")
                assert reason not in DETERMINISTIC, f"{node}: a storm reported as {reason}"
            done = all(e.get("state") == "Staged" for e in entries.values())
            return entries if done else None

        entries = testkit.wait_until(
            look,
            timeout=STORM_S + 150,
            what=f"{digest} Staged on every node after the storm",
            detail=lambda: f"{seen} {errors}",
        )
        window = proxy.storm_window()
        assert window is not None, "the storm began"
        final = rollouts.healthy_on("llm", "v2")["status"]
    finally:
        proxy.stop()
    where = S3Location.parse(models["v2"])
    files = {f"/{where.bucket}/{where.key(f.path)}" for f in manifests["v2"].files}
    stormed = [a for a in proxy.answers() if a.injected]
    data = [a for a in proxy.ranged_gets(ok=True) if a.key in files]  # the weights' chunks
    twice = {k: n for k, n in proxy.served_twice().items() if k[0] in files}
    after = [a for a in data if a.at >= window[1]]
    from_origin = sum(a.body_bytes for a in data)
    print(
        f"\nstorm of {STORM_S:.0f}s: {len(stormed)} requests answered 5xx "
        f"({sorted({a.status for a in stormed})}); v2 ranges served: {len(data)} "
        f"({len(after)} after the storm), {from_origin} B for a {manifests['v2'].total_size} B "
        f"model; states seen {seen}; errors reported {sorted(errors)[:3]}"
    )
    assert len(stormed) >= 10 and {a.status for a in stormed} == {500, 503}
    assert after, "staging was still going when the storm ended (it rode it out)"
    # Nothing left the origin twice: each range once, and no byte in two ranges.
    to: dict[tuple[str, str], list[str]] = {}
    for a in data:
        to.setdefault((a.key, a.range or ""), []).append(a.client)
    assert not twice, f"{len(twice)} ranges served twice: {[(k, to[k]) for k in sorted(twice)]}"
    assert from_origin == manifests["v2"].total_size
    assert final["stableRevision"]["manifestDigest"] == digest
    assert "Degraded" not in phases
    assert all(e["bytesDone"] == manifests["v2"].total_size for e in entries.values())


# ---- a corrupt peer in a live fleet -----------------------------------------------------

WAVE = "weightship-e2e/wave"
SERVING = "weightship-e2e/serving"


@pytest.fixture(scope="module")
def tiny(cluster: Any) -> Iterator[dict[str, str]]:
    yield from tinyllm_models(
        cluster.s3_endpoint, "fxtiny", [("v1", "good", 11), ("v2", "good", 12)]
    )


def test_a_corrupt_peer_in_a_live_fleet_is_demoted_and_every_pod_loads_verified_bytes(
    cluster: Any, agents: Agents, rollouts: Rollouts, tiny: dict[str, str]
) -> None:
    """v1 serves on two nodes; v2 is staged on the liar and an honest node, then one piece
    of every v2 chunk in the liar's copy is damaged (its agent still lists them as verified
    and serves them), and v2 goes on to the late node while the canary runs: whatever the
    late node asks the liar for (as its relay parent, as the owner, or as a holder), it
    catches the piece, demotes the liar, takes the chunk elsewhere, and every
    canary pod loads only verified bytes (the reference server's verified loader and
    golden prompts). The liar stages and serves chunks but runs no inference pod."""
    only_these_agents(cluster, agents)
    s3 = testkit.local_s3(cluster.s3_endpoint)
    manifest = S3Origin(s3, S3Location.parse(tiny["v2"])).read_manifest()
    assert manifest.piece_size and manifest.piece_layer_path
    # Chunks v1 has too are on every node already (staged locally, never asked of a peer).
    in_v1 = {c.key for c in S3Origin(s3, S3Location.parse(tiny["v1"])).read_manifest().chunks}
    # With three nodes every tree is a star (docs/data-plane.md, the relay trees): the
    # late node asks each chunk's owner first, and the liar owns about half of them in
    # any view; its own chunks it takes from the two holders in rendezvous order: the
    # liar, when ranked first, is caught there too.
    honest, liar, late = sorted(cluster.process_nodes)
    piece = 1
    # Every chunk the late node will ask of a peer: whichever the liar serves first is
    # caught.
    targets = [
        c
        for c in manifest.chunks
        if c.key not in in_v1 and c.size > (piece + 1) * manifest.piece_size
    ]
    assert targets
    labels = {
        liar: {WAVE: "early"},
        honest: {WAVE: "early", SERVING: "yes"},
        late: {SERVING: "yes"},
    }

    def label(node: str, values: dict[str, str | None]) -> None:
        cluster.core.patch_node(node, {"metadata": {"labels": values}})

    steps: list[dict[str, Any]] = [{"setWeight": 50}, {"pause": {}}]
    body = tinyllm_rollout_body("llm", tiny["v1"], "v1", steps, cluster.s3_endpoint)
    body["spec"]["template"]["spec"]["nodeSelector"] = {**PROCESS, SERVING: "yes"}
    body["spec"]["prefetch"] = {"enabled": True, "nodeSelector": PROCESS, "minStagedPercent": 100}
    # Each pod loads from its own node's cache (no GPU-to-GPU seeding): the late node's
    # pod reads the copy it staged past the liar.
    body["spec"]["seeding"] = {"broadcast": False}
    try:
        for node, values in labels.items():
            label(node, dict(values))
        rollouts.create(body)
        rollouts.healthy_on("llm", "v1", timeout=150)
        # v2 first on the early wave (the liar and the honest node); the canary starts.
        rollouts.patch_spec("llm", {"prefetch": {"nodeSelector": {WAVE: "early"}}})
        rollouts.set_model("llm", tiny["v2"], "v2")
        agents.wait_staged(manifest.digest, nodes=[liar, honest])
        for target in targets:
            damage_staged_piece(cluster, liar, manifest, target, piece)
        # Now every process node: the late node stages v2 from its peers, the liar first
        # for the chunks it owns; the promote sends the second canary pod there.
        rollouts.patch_spec("llm", {"prefetch": {"nodeSelector": {WAVE: None}}})
        entry = agents.wait_staged(manifest.digest, nodes=[late])[late]
        rollouts.wait(
            "llm",
            "paused at step 2 with the honest node's canary pod verified",
            lambda s: s.get("phase") == "Paused" and s.get("currentStepIndex") == 1,
            timeout=120,
        )
        user_actions.promote(cluster.api, rollouts.namespace, "llm")
        final = rollouts.healthy_on("llm", "v2", timeout=150)["status"]
    finally:
        for node, values in labels.items():
            label(node, dict.fromkeys(values))
    log = all_agent_logs(cluster, agents, late)
    print(
        f"\n{late}: {entry['bytesFromPeers']} B from peers, {entry['bytesFromOrigin']} B from "
        f"the origin; chunks {[t.index for t in targets]} corrupted at {liar}; "
        f"loads {final.get('verification', {}).get('loads')}"
    )
    caught = [
        f"peer {liar} served a bad piece ({piece}) for chunk {t.key}: demoted" for t in targets
    ]
    assert any(line in log for line in caught), log[-2000:]
    # Nothing corrupt staged on the late node: its files match their publish-time sha256.
    result = CliRunner().invoke(
        verify_files_command, [str(cache_root(cluster, late)), manifest.digest]
    )
    assert result.exit_code == 0 and "all match" in result.output, result.output
    # Every v2 pod, the late node's included, loaded and verified its weights.
    assert final["stableRevision"]["manifestDigest"] == manifest.digest
    pods = cluster.core.list_namespaced_pod(
        rollouts.namespace,
        label_selector=f"{REVISION_LABEL}={final['stableRevision']['podTemplateHash']}",
    ).items
    assert sorted(p.spec.node_name for p in pods) == sorted([honest, late])
    for pod in pods:
        gate = next(c for c in pod.status.conditions or [] if c.type == VERIFIED_GATE)
        assert gate.status == "True" and is_ready(pod), (pod.metadata.name, gate.message)
    loads = {load["pod"]: load for load in final["verification"]["loads"]}
    assert {loads[p.metadata.name]["source"] for p in pods} == {"cache"}, loads


def all_agent_logs(cluster: Any, agents: Agents, node: str) -> str:
    folder = Path(cluster.paths.root) / "nodes" / node / "logs"
    return "\n".join(
        p.read_text(errors="replace") for p in folder.glob(f"{agents.namespace}*agent*")
    )


# ---- a process node lost mid-canary -----------------------------------------------------


class LostNode:
    """A process node whose kubelet is SIGKILLed (no more lease renewals: the controller
    manager marks it NotReady after its grace period, and its pods not Ready), then
    started again the way `weightship-dev cluster up` starts it."""

    def __init__(self, cluster: Any, node: str) -> None:
        self.cluster = cluster
        self.node = node
        self.name = f"kubelet-{node}"
        self.index = nodes.process_node_index(node)

    def kill(self) -> None:
        pid = processes.running(self.cluster.paths.pids / f"{self.name}.pid")
        assert pid is not None, f"{self.name} is not running"
        os.kill(pid, signal.SIGKILL)
        testkit.wait_until(lambda: not processes.pid_alive(pid), timeout=10, what="kubelet gone")

    def restore(self) -> None:
        paths = self.cluster.paths
        processes.start_daemon(
            self.name,
            components.kubelet(paths, self.node, self.index),
            pids=paths.pids,
            logs=paths.logs,
        )
        testkit.wait_until(
            lambda: node_ready(self.cluster, self.node),
            timeout=60,
            what=f"{self.node} Ready again",
        )


class Sampler:
    """Polls the rollout, its ReplicaSets and pods in the background: what each decision
    looked like while it was made."""

    def __init__(self, rollouts: Rollouts, name: str, probe: Callable[[], Any]) -> None:
        self.rollouts, self.name, self.probe = rollouts, name, probe
        self.samples: list[dict[str, Any]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        self.thread.join(timeout=10)
        self.sample()  # the state the test ended on

    def _run(self) -> None:
        while not self.stop.wait(0.5):
            self.sample()

    def sample(self) -> None:
        try:
            status = self.rollouts.get(self.name).get("status") or {}
            sets = {
                rs.metadata.labels[REVISION_LABEL]: rs.spec.replicas or 0
                for rs in self.rollouts.replicasets(self.name)
            }
            # Read after the status: what it shows was decided before this.
            self.samples.append({"status": status, "replicas": sets, "probe": self.probe()})
        except Exception:  # a missed sample is no evidence either way
            return


def test_a_process_node_lost_mid_canary_neither_promotes_on_missing_pods_nor_drops_stable(
    cluster: Any, rollouts: Rollouts, models: dict[str, str], operator: OperatorProcess
) -> None:
    steps: list[dict[str, Any]] = [{"setWeight": 60}, {"pause": {}}]  # 2 of 3 pods
    body = rollout_body(
        "llm",
        models["v1"],
        "v1",
        steps,
        cluster.s3_endpoint,
        replicas=3,
        progressDeadlineSeconds=600,
    )
    # One pod of each revision per process node, so the lost node takes a stable pod and
    # a canary pod with it.
    body["spec"]["template"]["spec"]["topologySpreadConstraints"] = [
        {
            "maxSkew": 1,
            "topologyKey": "kubernetes.io/hostname",
            "whenUnsatisfiable": "DoNotSchedule",
            "labelSelector": {"matchLabels": {"app": "llm"}},
            "matchLabelKeys": [REVISION_LABEL],
        }
    ]
    rollouts.create(body)
    stable = rollouts.healthy_on("llm", "v1")["status"]["stableRevision"]["podTemplateHash"]
    ns = rollouts.namespace

    def pods(revision: str) -> list[Any]:
        return list(
            cluster.core.list_namespaced_pod(
                ns, label_selector=f"{REVISION_LABEL}={revision}"
            ).items
        )

    assert sorted(p.spec.node_name for p in pods(stable)) == sorted(cluster.process_nodes)
    rollouts.set_model("llm", models["v2"], "v2")
    paused = rollouts.wait(
        "llm",
        "paused at step 2 with 2 canary pods",
        lambda s: s.get("phase") == "Paused" and s.get("currentStepIndex") == 1,
    )["status"]
    canary = paused["canaryRevision"]["podTemplateHash"]
    canary_nodes = sorted(p.spec.node_name for p in pods(canary))
    assert len(canary_nodes) == 2 and len(set(canary_nodes)) == 2, canary_nodes
    lost = LostNode(cluster, canary_nodes[0])
    stable_pods = {p.metadata.uid for p in pods(stable)}

    def lost_pod_ready() -> bool:
        return any(is_ready(p) for p in pods(canary) if p.spec.node_name == lost.node)

    with Sampler(rollouts, "llm", lost_pod_ready) as sampler:
        try:
            lost.kill()
            # Lease renewals stop: after node-monitor-grace-period (40 s) the node is
            # NotReady and the node lifecycle controller marks its pods not Ready.
            testkit.wait_until(
                lambda: (
                    not node_ready(cluster, lost.node)
                    and not any(is_ready(p) for p in pods(canary) if p.spec.node_name == lost.node)
                ),
                timeout=90,
                what=f"{lost.node} NotReady and its canary pod not Ready",
            )
            # The pause ends (promote): the canary scales to 3, its third pod goes to the
            # node without one, and the promotion must wait for the lost node's pod.
            user_actions.promote(cluster.api, ns, "llm")
            rollouts.wait(
                "llm",
                "2 of 3 canary pods counted after the promote",
                lambda s: (
                    s.get("currentStepIndex") == 2
                    and "2/3 canary pods available" in (s.get("message") or "")
                ),
                timeout=60,
            )
            # Reconciles that began with the lost node's pod not Ready ran to the end;
            # none promoted.
            wait_reconciled(rollouts, operator, "llm")
            held = rollouts.get("llm")["status"]
            print(f"\nwith {lost.node} lost: {held['phase']}: {held['message']}")
            assert held["stableRevision"]["revision"] == "v1", held["message"]
            assert held["phase"] == "Progressing", held["message"]
            assert "2/3 canary pods available" in held["message"]
            assert not node_ready(cluster, lost.node)
            assert {p.metadata.uid for p in pods(stable)} == stable_pods, "stable pods kept"
        finally:
            lost.restore()
        final = rollouts.healthy_on("llm", "v2", timeout=150)["status"]
    # Promoted only once the lost node's canary pod was back and Ready: no sample shows the
    # canary promoted while that pod, read just after, was still not Ready; and the
    # promotion is no older than the pod's Ready (a time kept to the second).
    promoted = [
        s
        for s in sampler.samples
        if (s["status"].get("stableRevision") or {}).get("podTemplateHash") == canary
    ]
    assert promoted and all(s["probe"] for s in promoted), "promoted on a missing pod"
    promoted_at = next(h["at"] for h in reversed(final["history"]) if h["outcome"] == "Promoted")
    back = [ready_since(p) for p in pods(canary) if p.spec.node_name == lost.node]
    assert back and back[0] is not None
    assert datetime.fromisoformat(promoted_at.replace("Z", "+00:00")) >= back[0]
    # Stable kept its full size while the canary missed its pod on the lost node. (The
    # promotion itself scales the old stable down before its status patch says so: a
    # sample may catch that, once the canary has all its pods.)
    while_stable = [
        s
        for s in sampler.samples
        if (s["status"].get("stableRevision") or {}).get("podTemplateHash") == stable
    ]
    missing = [s for s in while_stable if not s["probe"]]
    assert missing and all(s["replicas"].get(stable) == 3 for s in missing)
    assert not any(s["status"].get("abort") for s in sampler.samples), "nothing aborted"
    print(
        f"{len(sampler.samples)} samples; the canary not Ready on {lost.node} in "
        f"{len(missing)}, stable {stable} at 3 replicas in all of them; promoted at {promoted_at}, "
        f"{lost.node}'s canary pod Ready again at {back[0].isoformat()}"
    )
