"""In-place weight swaps on real vLLM pods (updatePolicy InPlaceIfPossible), end to end:
node agents stage each revision, the operator swaps it into running vLLM replicas through
the weightship plugin (out of traffic, drain, verified load on every rank, verify again),
canaries and rolls back without one pod restart, while a client sends steady load through
the Service to its ready endpoints the whole time.

One namespace, one agent fleet and one rollout of vLLM pods for the module (a vLLM
replica starts in 40-75 s here; a swap takes seconds). A tensor-parallel pod first, on a
rollout of its own, gone when its test ends. Then the fleet: v1 starts on two pods; v2
swaps in through 50 % and 100 %; the subtly bad v3 is swapped into one canary, fails its
golden prompt and is swapped back; v4's origin is corrupt, so the agents refuse it and
no pod swaps; v5's staged bytes rot after the agents verified them, so the swap finds
them bad and nothing of v5 is ever served. Under the load: 0 failed requests, each answer
stamped with a revision that was stable or canary. The last test scales the same rollout
to three pods with inPlace.maxUnavailable 2 (one vLLM start, not three): two swap to v6
at once while the third serves the load. The last scales it down to one pod (no vLLM
start): v7 swaps in traffic (never dark: the Service keeps its one ready endpoint while
the server holds the requests until v7 is verified), then the subtly bad v3 is held,
fails its golden prompt and is swapped back, every request answered by verified weights.
Run under `flock /work/coord/heavy.lock` next to other heavy work on a 2-core machine."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from e2e.agent_fixtures import PROCESS, Agents, cache_root
from e2e.operator_fixtures import PROCESS_NODES, Rollouts, rollout_body
from weightship import rollouts as user_actions
from weightship.api.names import REVISION_LABEL, ROLLOUT_LABEL, VERIFIED_GATE
from weightship.weightformat.manifest import digest_hex
from weightship_dev import testkit
from weightship_dev.layout import BRIDGE_IP
from weightship_dev.loadgen import RevisionTimeline, ServiceLoad, app_service, chat_load
from weightship_dev.slackreceiver import SlackReceiver
from weightship_testing.tinyvllm import deploy
from weightship_testing.tinyvllm.build import CHAT_ANSWER, publish_versions

NAMESPACE_PREFIX = "ip-"
VLLM_START_S = 480
SWAP_S = 240  # a swap and its verification, with margin for a loaded 2-core machine
REPLICAS = 2


@pytest.fixture(scope="module")
def models(cluster: Any) -> Iterator[dict[str, str]]:
    s3 = testkit.local_s3(cluster.s3_endpoint)
    bucket = testkit.unique_name("inplace")
    s3.create_bucket(Bucket=bucket)
    uris = publish_versions(
        s3,
        bucket,
        "models",
        [
            ("v1", "good", 0),
            ("v2", "good", 1),
            ("v3", "subtly-bad", 0),
            ("v4", "good", 2),
            ("v5", "good", 3),
            ("v6", "good", 4),
            ("v7", "good", 5),
        ],
    )
    # v4's origin rots after its manifest was written: the agents refuse it.
    key = "models/v4/model.safetensors"
    data = bytearray(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    middle = len(data) // 2
    data[middle] ^= 0xFF
    s3.put_object(Bucket=bucket, Key=key, Body=bytes(data))
    yield uris
    testkit.empty_bucket(s3, bucket)
    s3.delete_bucket(Bucket=bucket)


def in_place_rollout(cluster: Any, uri: str, name: str = "llm") -> dict[str, Any]:
    body = rollout_body(
        name, uri, "v1", [{"setWeight": 50}, {"pause": {}}], cluster.s3_endpoint, REPLICAS
    )
    spec = body["spec"]
    spec["template"] = deploy.pod_template(name, node_selector=PROCESS_NODES, in_place=True)
    spec["validation"] = deploy.validation()
    spec["prefetch"] = {"enabled": True, "nodeSelector": PROCESS, "minStagedPercent": 100}
    spec["seeding"] = {"broadcast": False}
    spec["strategy"]["canary"]["updatePolicy"] = "InPlaceIfPossible"
    spec["strategy"]["canary"]["inPlace"] = {"drainTimeoutSeconds": 10, "swapTimeoutSeconds": 120}
    return body


@pytest.fixture(scope="module")
def fleet(
    cluster: Any, module_agents: Agents, module_rollouts: Rollouts, models: dict[str, str]
) -> Rollouts:
    """The module's rollout "llm" Healthy on v1, its two vLLM pods ready, and the Service
    over them."""
    rollouts, ns = module_rollouts, module_rollouts.namespace
    app_service(cluster.core, ns, "llm", deploy.PORT)
    rollouts.create(in_place_rollout(cluster, models["v1"]))
    rollouts.healthy_on("llm", "v1", timeout=VLLM_START_S)
    ready_pods(cluster, ns, REPLICAS, "v1", VLLM_START_S)
    return rollouts


def rollout_pods(cluster: Any, namespace: str, name: str = "llm") -> list[Any]:
    return list(
        cluster.core.list_namespaced_pod(namespace, label_selector=f"{ROLLOUT_LABEL}={name}").items
    )


def ready_pods(cluster: Any, namespace: str, count: int, what: str, timeout: float) -> None:
    testkit.wait_until(
        lambda: len([p for p in rollout_pods(cluster, namespace) if _ready(p)]) == count,
        timeout=timeout,
        what=f"{count} pods ready on {what}",
    )


def fleet_load(cluster: Any, namespace: str) -> ServiceLoad:
    """Steady chat requests to the ready endpoints of the Service over the fleet."""
    return chat_load(cluster.api, namespace, "llm", max_tokens=8, rate=4.0, timeout_s=30.0)


def identity(cluster: Any, namespace: str, name: str = "llm") -> dict[str, tuple[str, int]]:
    """Each pod's uid and container restarts: an in-place rollout changes neither."""
    return {
        p.metadata.name: (
            p.metadata.uid,
            sum(c.restart_count for c in p.status.container_statuses or []),
        )
        for p in rollout_pods(cluster, namespace, name)
    }


def holding(cluster: Any, namespace: str) -> dict[str, str]:
    return {
        p.metadata.name: p.metadata.labels.get(REVISION_LABEL)
        for p in rollout_pods(cluster, namespace)
    }


def gate(pod: Any) -> Any:
    return next((c for c in pod.status.conditions or [] if c.type == VERIFIED_GATE), None)


def rot_staged(cluster: Any, digest: str) -> None:
    """Bit rot in every node's staged copy after its agent verified it (the rollout's view
    links the same files)."""
    for node in cluster.process_nodes:
        shard = cache_root(cluster, node) / "models" / digest_hex(digest) / "files"
        path = shard / "model.safetensors"
        data = bytearray(path.read_bytes())
        start = 8 + int.from_bytes(data[:8], "little")
        middle = start + (len(data) - start) // 2
        with open(path, "r+b") as f:  # the cache's own inode
            f.seek(middle)
            f.write(bytes(b ^ 0xFF for b in data[middle : middle + 4]))


def test_tensor_parallel_pod_is_gated_on_every_rank_and_swaps_on_every_rank(
    cluster: Any, module_agents: Agents, module_rollouts: Rollouts, models: dict[str, str]
) -> None:
    """A TP=2 vLLM pod (two worker ranks over gloo): the gate needs both ranks' loaded
    digest, a swap runs on both ranks, and a damaged read on rank 1 fails the swap naming
    that rank, without a restart. Its rollout goes when it ends, before the fleet starts."""
    rollouts, ns, name = module_rollouts, module_rollouts.namespace, "tp"
    body = in_place_rollout(cluster, models["v1"], name)
    spec = body["spec"]
    spec["replicas"] = 1
    spec["strategy"]["canary"]["steps"] = [{"setWeight": 100}]
    container = spec["template"]["spec"]["containers"][0]
    container["args"] += ["--tensor-parallel-size", "2"]
    # Test-only fault injection of the plugin, read at each swap from the pod's scratch.
    container["env"].append({"name": "WEIGHTSHIP_VLLM_SWAP_FAULT", "value": "@/tmp/fault"})
    rollouts.create(body)
    v1 = rollouts.healthy_on(name, "v1", timeout=VLLM_START_S)["status"]
    (pod,) = rollout_pods(cluster, ns, name)
    report = loaded(pod)
    assert [r["rank"] for r in report["ranks"]] == [0, 1], report
    assert {r["manifestDigest"] for r in report["ranks"]} == {
        v1["stableRevision"]["manifestDigest"]
    }
    assert gate(pod).status == "True"
    started = identity(cluster, ns, name)

    rollouts.set_model(name, models["v2"], "v2")
    v2 = rollouts.healthy_on(name, "v2", timeout=SWAP_S)["status"]
    (pod,) = rollout_pods(cluster, ns, name)
    report = loaded(pod)
    assert len(report["ranks"]) == 2 and {r["manifestDigest"] for r in report["ranks"]} == {
        v2["stableRevision"]["manifestDigest"]
    }, report
    assert {r["source"] for r in report["ranks"]} == {"swap"}, report
    assert identity(cluster, ns, name) == started

    scratch = cluster.paths.root / "nodes" / pod.spec.node_name / "pods" / pod.metadata.uid
    (scratch / "volumes" / "scratch" / "fault").write_text("damage-rank=1")
    rollouts.set_model(name, models["v3"], "v3")
    status = rollouts.wait(
        name,
        "the TP swap refused on rank 1",
        lambda s: (
            s.get("phase") == "Degraded"
            and (s.get("canaryRevision") or {}).get("revision") == "v3"
            and (s.get("replicas") or {}).get("ready") == 1
        ),
        timeout=SWAP_S,
    )["status"]
    assert status["abort"]["reason"] == "SwapFailed", status["abort"]
    assert "rank 1" in status["abort"]["message"], status["abort"]
    (pod,) = rollout_pods(cluster, ns, name)
    assert {r["manifestDigest"] for r in loaded(pod)["ranks"]} == {
        v2["stableRevision"]["manifestDigest"]
    }
    assert identity(cluster, ns, name) == started
    rollouts.delete(name)
    testkit.wait_until(
        lambda: not rollout_pods(cluster, ns, name), timeout=120, what="the TP pod gone"
    )


def test_vllm_weights_swap_in_place_canaried_gated_and_rolled_back_under_load(
    cluster: Any, module_agents: Agents, fleet: Rollouts, models: dict[str, str]
) -> None:
    rollouts, ns, agents = fleet, fleet.namespace, module_agents
    with SlackReceiver(host=BRIDGE_IP) as slack:
        cluster.core.create_namespaced_secret(
            ns, {"metadata": {"name": "slack"}, "stringData": {"url": slack.url}}
        )
        events = ["RolledBack", "Promoted"]
        rollouts.patch_spec(
            "llm",
            {"notifications": {"slack": {"webhookSecretRef": {"name": "slack"}, "events": events}}},
        )
        v1 = rollouts.healthy_on("llm", "v1")["status"]
        assert v1["stableRevision"]["templateHash"]
        started = identity(cluster, ns)
        assert len(started) == REPLICAS

        load = fleet_load(cluster, ns)
        timeline = RevisionTimeline(cluster.api, ns, "llm")
        with timeline, load:
            # v2: one pod swapped at setWeight 50, then the pause; the promotion swaps
            # the other. Nobody restarts.
            rollouts.set_model("llm", models["v2"], "v2")
            paused = rollouts.wait(
                "llm", "v2 at 50 %", lambda s: s.get("phase") == "Paused", timeout=SWAP_S
            )["status"]
            canary = paused["canaryRevision"]
            assert canary["update"] == "InPlace", canary
            assert sorted(holding(cluster, ns).values()).count(canary["podTemplateHash"]) == 1
            assert identity(cluster, ns) == started
            user_actions.promote(cluster.api, ns, "llm")
            v2 = rollouts.healthy_on("llm", "v2", timeout=SWAP_S)["status"]
            ready_pods(cluster, ns, REPLICAS, "v2", SWAP_S)
            assert identity(cluster, ns) == started, "an in-place update restarted a pod"
            assert set(holding(cluster, ns).values()) == {v2["stableRevision"]["podTemplateHash"]}
            pods = {p["pod"]: p for p in v2["inPlace"]["pods"]}
            assert set(pods) == set(started)
            for pod in pods.values():
                assert pod["arrival"] == "Swapped" and pod["swapTo"] == "v2", pod
                assert pod["swapSeconds"] > 0, pod
            for p in rollout_pods(cluster, ns):
                condition = gate(p)
                assert condition.status == "True", condition
                assert f"digest {v2['stableRevision']['manifestDigest']} verified" in (
                    condition.message
                )
            swap_seconds = sorted(p["swapSeconds"] for p in pods.values())
            paused_seconds = sorted(p.get("pausedSeconds") or 0.0 for p in pods.values())

            # v3: right checksums, a wrong answer. Swapped into one canary pod, its gate
            # fails, it is swapped back; it never takes traffic. Not even from a router
            # with a stale endpoint view: a request sent straight to the canary while it
            # holds v3 waits at its gate, and v2 answers it once back and verified.
            with ThreadPoolExecutor(1) as pool:
                stale = pool.submit(send_when_swapped, cluster, ns, "v3", SWAP_S)
                rollouts.set_model("llm", models["v3"], "v3")
                sent_during, stale_status, stale_revision = stale.result(timeout=2 * SWAP_S)
            assert (stale_status, stale_revision) == (200, "v2"), sent_during
            status = rollouts.wait(
                "llm",
                "v3 rolled back in place",
                lambda s: (
                    s.get("phase") == "Degraded"
                    and (s.get("canaryRevision") or {}).get("revision") == "v3"
                    and (s.get("replicas") or {}).get("ready") == REPLICAS
                    and not (s.get("inPlace") or {}).get("swapping")
                ),
                timeout=SWAP_S,
            )["status"]
            assert status["abort"]["reason"] == "VerificationFailed", status["abort"]
            failure = status["verification"]["failures"][0]
            assert failure["reason"] == "GoldenPromptFailed", failure
            assert failure["got"] == CHAT_ANSWER["subtly-bad"], failure
            assert "Paris." in failure["expected"], failure
            assert set(holding(cluster, ns).values()) == {v2["stableRevision"]["podTemplateHash"]}
            swapped_to = [p.get("swapTo") for p in status["inPlace"]["pods"]]
            assert swapped_to.count("v2") == REPLICAS, status["inPlace"]  # the last swaps
            message = testkit.wait_until(
                lambda: next(
                    (m for m in slack.received if "RolledBack" in m["text"] and "v3" in m["text"]),
                    None,
                ),
                timeout=60,
                what="the rollback on Slack",
            )
            assert "Lyon." in str(message["blocks"]) and deploy.GOLDEN_PROMPT in str(
                message["blocks"]
            )

            # v4: a corrupt origin. The agents refuse it; no pod is ever swapped.
            rollouts.set_model("llm", models["v4"], "v4")
            status = rollouts.wait(
                "llm",
                "v4 aborted by the agents",
                lambda s: (
                    s.get("phase") == "Degraded"
                    and (s.get("canaryRevision") or {}).get("revision") == "v4"
                ),
                timeout=SWAP_S,
            )["status"]
            assert status["abort"]["reason"] == "OriginMismatch", status["abort"]
            assert all(p.get("swapTo") != "v4" for p in status["inPlace"]["pods"]), status

            # v5: staged and verified, then its bytes rot before the swap (the first step
            # is a pause). The swap verifies every chunk before it touches a weight: it
            # fails, the canary aborts, and the pod is swapped back to v2.
            rollouts.set_model("llm", models["v5"], "v5", steps=[{"pause": {}}, {"setWeight": 50}])
            status = rollouts.wait(
                "llm",
                "v5 paused",
                lambda s: (
                    (s.get("canaryRevision") or {}).get("revision") == "v5"
                    and s.get("phase") == "Paused"
                ),
                timeout=SWAP_S,
            )["status"]
            digest = status["canaryRevision"]["manifestDigest"]
            agents.wait_staged(digest)
            rot_staged(cluster, digest)
            user_actions.promote(cluster.api, ns, "llm")
            status = rollouts.wait(
                "llm",
                "v5 aborted and its pod back on v2",
                lambda s: (
                    s.get("phase") == "Degraded"
                    and (s.get("canaryRevision") or {}).get("revision") == "v5"
                    and (s.get("replicas") or {}).get("ready") == REPLICAS
                    and not (s.get("inPlace") or {}).get("swapping")
                ),
                timeout=SWAP_S,
            )["status"]
            assert status["abort"]["reason"] == "SwapFailed", status["abort"]
            assert "ChecksumMismatch" in status["abort"]["message"], status["abort"]
            assert set(holding(cluster, ns).values()) == {v2["stableRevision"]["podTemplateHash"]}
            assert identity(cluster, ns) == started, "a failed swap restarted a pod"
        answers = load.stop()
    rollouts.patch_spec("llm", {"notifications": None})

    failed = [a for a in answers if not a.ok]
    print(
        f"in place under load: {len(answers)} requests, {len(failed)} failed, "
        f"swaps {swap_seconds} s, engine paused {paused_seconds} s"
    )
    assert len(answers) > 50, len(answers)
    assert not failed, failed[:5]
    revisions = {a.revision for a in answers}
    assert "v3" not in revisions and "v4" not in revisions and "v5" not in revisions, revisions
    assert {"v1", "v2"} <= revisions, revisions
    for answer in answers:
        assert answer.revision in timeline.allowed(answer.started, answer.finished), answer
        assert answer.text == CHAT_ANSWER["good"], answer


def test_three_vllm_pods_swap_two_at_once_within_max_unavailable_under_load(
    cluster: Any, fleet: Rollouts, models: dict[str, str]
) -> None:
    """The fleet scaled to three replicas with inPlace.maxUnavailable 2: v6 at setWeight
    100 swaps two pods at once (the SwapsStarted Event says so), then the third, while the
    one left serves the load. The scale-up's pod starts on the stable revision."""
    rollouts, ns, replicas = fleet, fleet.namespace, 3
    stable = rollouts.get("llm")["status"]["stableRevision"]["revision"]
    rollouts.patch_spec(
        "llm",
        {
            "replicas": replicas,
            "strategy": {
                "canary": {"steps": [{"setWeight": 100}], "inPlace": {"maxUnavailable": 2}}
            },
        },
    )
    ready_pods(cluster, ns, replicas, stable, VLLM_START_S)
    started = identity(cluster, ns)
    assert len(started) == replicas
    with fleet_load(cluster, ns) as load:
        rollouts.set_model("llm", models["v6"], "v6")
        v6 = rollouts.healthy_on("llm", "v6", timeout=SWAP_S)["status"]
        ready_pods(cluster, ns, replicas, "v6", SWAP_S)
        answers = load.stop()
    assert identity(cluster, ns) == started, "an in-place update restarted a pod"
    assert set(holding(cluster, ns).values()) == {v6["stableRevision"]["podTemplateHash"]}
    assert v6["inPlace"]["maxUnavailable"] == 2, v6["inPlace"]

    def batches() -> list[str] | None:  # Events are posted off the reconcile: may land late
        found = [
            e.message
            for e in rollouts.events("llm")
            if e.reason == "SwapsStarted" and " to v6" in e.message
        ]
        started = sum(int(m.split("started ")[1].split(" ")[0]) for m in found)
        return found if started >= replicas else None

    swaps = testkit.wait_until(batches, timeout=60, what="SwapsStarted to v6 for every pod")
    assert any("started 2 swap(s)" in m and "2 pod(s) swapping at once" in m for m in swaps), swaps
    failed = [a for a in answers if not a.ok]
    print(f"two at once under load: {len(answers)} requests, {len(failed)} failed; {swaps}")
    assert len(answers) > 10 and not failed, failed[:5]
    assert {a.revision for a in answers} <= {stable, "v6"}


def send_when_swapped(
    cluster: Any, namespace: str, revision: str, timeout_s: float
) -> tuple[dict[str, Any], int, str | None]:
    """Watch the pods' swap state; once one has swapped to ``revision``, send it a chat
    request straight to its IP, as a router that has not seen it leave would. Returns the
    state it was sent in, and the answer's status and X-Weightship-Revision."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for pod in rollout_pods(cluster, namespace):
            url = f"http://{pod.status.pod_ip}:{deploy.PORT}"
            try:
                with urllib.request.urlopen(url + "/weightship/v1/swap", timeout=5) as answer:
                    state = dict(json.loads(answer.read()))
            except (OSError, ValueError):
                continue
            if state.get("state") != "Swapped" or state.get("revision") != revision:
                continue
            request = urllib.request.Request(
                url + deploy.CHAT_PATH,
                data=json.dumps(deploy.chat_request(max_tokens=8)).encode(),
                headers={"Content-Type": "application/json"},
            )
            try:
                with urllib.request.urlopen(request, timeout=timeout_s) as answer:
                    return state, answer.status, answer.headers.get("X-Weightship-Revision")
            except urllib.error.HTTPError as err:
                return state, err.code, err.headers.get("X-Weightship-Revision")
        time.sleep(0.05)
    raise TimeoutError(f"no pod swapped to {revision} within {timeout_s} s")


def _ready(pod: Any) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])


def loaded(pod: Any) -> dict[str, Any]:
    with urllib.request.urlopen(
        f"http://{pod.status.pod_ip}:{deploy.PORT}/weightship/v1/loaded", timeout=10
    ) as answer:
        return dict(json.loads(answer.read()))


def test_one_vllm_pod_swaps_in_traffic_and_the_service_is_never_dark_under_load(
    cluster: Any, fleet: Rollouts, models: dict[str, str]
) -> None:
    """The fleet scaled down to one pod (no vLLM start): taking it out of traffic would
    leave none serving, so it swaps in traffic. The Service keeps its one ready endpoint
    throughout (sampled every 0.2 s); requests that arrive during the swap and the checks
    wait at the server and are answered by the verified new weights. The subtly bad v3
    in the same setting is held, fails its golden prompt, is swapped back, and the
    requests held meanwhile are answered by the old weights: 0 refused, 0 failed."""
    rollouts, ns = fleet, fleet.namespace
    rollouts.patch_spec(
        "llm",
        {
            "replicas": 1,
            "strategy": {"canary": {"steps": [{"setWeight": 100}], "inPlace": None}},
        },
    )
    testkit.wait_until(
        lambda: len(rollout_pods(cluster, ns)) == 1, timeout=120, what="the fleet down to one pod"
    )
    stable = rollouts.wait(
        "llm",
        "one ready replica",
        lambda s: (s.get("replicas") or {}).get("ready") == 1 and s.get("phase") == "Healthy",
        timeout=120,
    )["status"]["stableRevision"]
    ready_pods(cluster, ns, 1, stable["revision"], 60)
    started = identity(cluster, ns)
    (pod_name,) = started
    load = chat_load(cluster.api, ns, "llm", max_tokens=8, rate=6.0, timeout_s=60.0)
    timeline = RevisionTimeline(cluster.api, ns, "llm")
    with timeline, load:
        swap_began = time.monotonic()
        rollouts.set_model("llm", models["v7"], "v7")
        v7 = rollouts.healthy_on("llm", "v7", timeout=SWAP_S)["status"]
        good_done = time.monotonic()
        # The verdict's note (held seconds) may reach the status a reconcile after the gate.
        v7 = rollouts.wait(
            "llm",
            "v7's held seconds in status",
            lambda s: ((s.get("inPlace") or {}).get("pods") or [{}])[0].get("heldSeconds"),
            timeout=60,
        )["status"]
        ((pod_status,),) = [v7["inPlace"]["pods"]]
        assert pod_status["inTraffic"] is True and pod_status["swapTo"] == "v7", pod_status

        rollouts.set_model("llm", models["v3"], "v3")
        status = rollouts.wait(
            "llm",
            "v3 held, failed and swapped back",
            lambda s: (
                s.get("phase") == "Degraded"
                and (s.get("canaryRevision") or {}).get("revision") == "v3"
                and (s.get("replicas") or {}).get("ready") == 1
                and not (s.get("inPlace") or {}).get("swapping")
                and ((s.get("inPlace") or {}).get("pods") or [{}])[0].get("swapTo") == "v7"
            ),
            timeout=SWAP_S,
        )["status"]
        # Requests after the swap back, on the old weights, then the load stops.
        testkit.wait_until(
            lambda: any(a.started > time.monotonic() - 1 for a in load.answers[-5:]),
            timeout=30,
            what="answers after the swap back",
        )
        answers = load.stop()
    assert status["abort"]["reason"] == "VerificationFailed", status["abort"]
    failure = status["verification"]["failures"][0]
    assert failure["got"] == CHAT_ANSWER["subtly-bad"], failure
    assert identity(cluster, ns) == started, "an in-place swap restarted the pod"
    assert set(holding(cluster, ns).values()) == {v7["stableRevision"]["podTemplateHash"]}
    (pod,) = rollout_pods(cluster, ns)
    assert gate(pod).status == "True" and gate(pod).reason == "Verified", gate(pod)

    # Never dark: every read of the EndpointSlices had the pod, no sender ever waited.
    during = [n for at, n in load.endpoint_samples if at >= swap_began]
    assert during and min(during) == 1, sorted(set(during))
    assert load.no_endpoint_waits == 0, load.no_endpoint_waits
    # 0 refused, 0 failed; each answer stamped with a verified revision, v3 never.
    failed = [a for a in answers if not a.ok]
    slowest = sorted(answers, key=lambda a: a.finished - a.started)[-3:]
    held = [
        (round(a.finished - a.started, 2), a.revision) for a in slowest if a.started < good_done
    ]
    # Sent while v3 was the canary (before its abort): answered by v7, held or not.
    under_v3 = [a for a in answers if "v3" in timeline.allowed(a.started, a.started)]
    print(
        f"one pod in traffic: {len(answers)} requests, {len(failed)} failed, "
        f"{len(during)} endpoint reads during the swaps (min {min(during)} ready), "
        f"held {pod_status.get('heldSeconds')} s for v7, "
        f"{(status['inPlace']['pods'][0]).get('heldSeconds')} s for v3 and its swap back; "
        f"{len(under_v3)} sent while v3 was the canary; slowest answers {held}"
    )
    assert len(answers) > 20 and not failed, failed[:5]
    assert under_v3 and {a.revision for a in under_v3} == {"v7"}, under_v3[:5]
    revisions = {a.revision for a in answers}
    assert revisions <= {stable["revision"], "v7"} and "v7" in revisions, revisions
    for answer in answers:
        assert answer.text == CHAT_ANSWER["good"], answer
        assert answer.revision in timeline.allowed(answer.started, answer.finished), answer

    # Reported: held seconds in status, a SwapHeld Event, SwapsStarted says in traffic.
    assert pod_status["heldSeconds"] > 0, pod_status
    events = rollouts.events("llm")
    assert any(
        e.reason == "SwapsStarted" and f"{pod_name} to v7 in traffic" in e.message for e in events
    ), [e.message for e in events if e.reason == "SwapsStarted"]
    assert any(
        e.reason == "SwapHeld" and pod_name in e.message and "to v7" in e.message for e in events
    ), [e.message for e in events if e.reason == "SwapHeld"]
