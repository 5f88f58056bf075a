"""ModelRollout end to end: a real operator process drives real pods on process nodes."""

from __future__ import annotations

import contextlib
import copy
import json
import socket
import threading
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from e2e.operator_fixtures import (
    OperatorProcess,
    Rollouts,
    publish_models,
    rollout_body,
)
from weightship import rollouts as user_actions
from weightship.controller.kube import Conflict, Kube
from weightship.httpserver import Server
from weightship_dev import testkit
from weightship_dev.layout import BRIDGE_IP
from weightship_dev.slackreceiver import SlackReceiver
from weightship_testing.samples import INVALID_MANIFESTS, VALID_MANIFEST

NAMESPACE_PREFIX = "ro-"


@pytest.fixture(scope="module")
def models(cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    s3 = testkit.s3_client(cluster.s3_endpoint)
    bucket = testkit.unique_name("models")
    s3.create_bucket(Bucket=bucket)
    yield publish_models(
        cluster.s3_endpoint, bucket, tmp_path_factory.mktemp("models"), ["v1", "v2"]
    )
    testkit.empty_bucket(s3, bucket)
    s3.delete_bucket(Bucket=bucket)


def test_rollout_walks_its_steps_to_healthy(
    cluster: Any, rollouts: Rollouts, models: dict[str, str]
) -> None:
    steps = [{"setWeight": 50}, {"pause": {"duration": "2s"}}, {"setWeight": 100}]
    rollouts.create(rollout_body("llm", models["v1"], "v1", steps, cluster.s3_endpoint))
    rollouts.healthy_on("llm", "v1")

    rollouts.set_model("llm", models["v2"], "v2")
    seen_steps = set()

    def track(status: dict[str, Any]) -> bool:
        if (status.get("canaryRevision") or {}).get("revision") == "v2":
            seen_steps.add((status.get("currentStepIndex"), status.get("canaryWeight")))
        return (
            status.get("phase") == "Healthy"
            and (status.get("stableRevision") or {}).get("revision") == "v2"
        )

    final = rollouts.wait("llm", "v2 promoted", track)
    assert (1, 50) in seen_steps, f"the 50% step was observed: {seen_steps}"
    status = final["status"]
    assert status["observedGeneration"] == final["metadata"]["generation"]
    assert [h["revision"] for h in status["history"] if h["outcome"] == "Promoted"][-1] == "v2"

    # The v2 pods really run, on process nodes, with the model wired in.
    v2_hash = status["stableRevision"]["podTemplateHash"]
    pods = cluster.core.list_namespaced_pod(
        rollouts.namespace, label_selector=f"weightship.io/revision-hash={v2_hash}"
    ).items
    assert len(pods) == 2
    for pod in pods:
        assert pod.spec.node_name in cluster.process_nodes
        assert pod.status.phase == "Running"
        env = {e.name: e.value for e in pod.spec.containers[0].env}
        assert env["WEIGHTSHIP_MODEL_REVISION"] == "v2"
        assert env["WEIGHTSHIP_MANIFEST_DIGEST"] == status["stableRevision"]["manifestDigest"]
        assert {g.condition_type for g in pod.spec.readiness_gates} == {
            "weightship.io/weights-verified"
        }
        with urllib.request.urlopen(f"http://{pod.status.pod_ip}:8080/", timeout=5) as resp:
            info = json.loads(resp.read())
        assert info["POD_NAME"] == pod.metadata.name
    reasons = [e.reason for e in rollouts.events("llm")]
    assert "StepCompleted" in reasons and "Promoted" in reasons


def test_abort_restores_stable_and_leaves_spec_alone(
    cluster: Any, rollouts: Rollouts, models: dict[str, str]
) -> None:
    steps = [{"setWeight": 50}, {"pause": {}}, {"setWeight": 100}]
    rollouts.create(
        rollout_body(
            "llm", models["v1"], "v1", steps, cluster.s3_endpoint, abortScaleDownDelaySeconds=2
        )
    )
    rollouts.healthy_on("llm", "v1")
    rollouts.set_model("llm", models["v2"], "v2")
    paused = rollouts.wait_phase("llm", "Paused")
    spec_before, generation = copy.deepcopy(paused["spec"]), paused["metadata"]["generation"]

    user_actions.abort(cluster.api, rollouts.namespace, "llm", reason="canary looks wrong")
    degraded = rollouts.wait_phase("llm", "Degraded")
    status = degraded["status"]
    assert "canary looks wrong" in status["message"]
    aborted = next(c for c in status["conditions"] if c["type"] == "Aborted")
    assert aborted["status"] == "True" and aborted["reason"] == "ManualAbort"

    def canary_gone(_: dict[str, Any]) -> bool:
        by_rev = {
            rs.metadata.labels["weightship.io/revision-hash"]: rs
            for rs in rollouts.replicasets("llm")
        }
        stable = by_rev[status["stableRevision"]["podTemplateHash"]]
        canary = by_rev[status["canaryRevision"]["podTemplateHash"]]
        return (
            stable.spec.replicas == 2
            and (stable.status.ready_replicas or 0) == 2
            and canary.spec.replicas == 0
        )

    rollouts.wait("llm", "stable full and canary scaled down", canary_gone, timeout=60)
    after = rollouts.get("llm")
    assert after["spec"] == spec_before, "abort never touches spec (no GitOps drift)"
    assert after["metadata"]["generation"] == generation


def test_operator_killed_at_every_phase_resumes_cleanly(
    cluster: Any, rollouts: Rollouts, models: dict[str, str], operator: OperatorProcess
) -> None:
    steps = [
        {"setWeight": 50},
        {"pause": {"duration": "3s"}},
        {"setWeight": 100},
        {"pause": {"duration": "3s"}},
    ]
    rollouts.create(rollout_body("llm", models["v1"], "v1", steps, cluster.s3_endpoint))
    operator.restart()  # killed right after the create, before any reconcile finished
    rollouts.healthy_on("llm", "v1")
    rollouts.set_model("llm", models["v2"], "v2")
    rollouts.wait("llm", "canary at 50%", lambda s: s.get("canaryWeight") == 50)
    operator.restart()  # killed mid-canary
    rollouts.wait("llm", "second pause", lambda s: s.get("currentStepIndex") == 3)
    operator.restart()  # killed during a timed pause
    rollouts.healthy_on("llm", "v2")
    operator.restart()  # killed after promotion: nothing must change
    rollouts.wait("llm", "still Healthy after restart", lambda s: s.get("phase") == "Healthy")

    replica_sets = rollouts.replicasets("llm")
    hashes = [rs.metadata.labels["weightship.io/revision-hash"] for rs in replica_sets]
    assert len(hashes) == len(set(hashes)) == 2, "one ReplicaSet per revision, no duplicates"
    history = rollouts.get("llm")["status"]["history"]
    assert [h["revision"] for h in history if h["outcome"] == "Promoted"] == ["v1", "v2"]
    completed = [e.message for e in rollouts.events("llm") if e.reason == "StepCompleted"]
    assert len(completed) == len(set(completed)), f"a step ran twice: {completed}"


def test_missing_manifest_is_an_invalid_spec_condition(
    cluster: Any, rollouts: Rollouts, models: dict[str, str]
) -> None:
    missing = models["v1"].replace("/v1/", "/does-not-exist/")
    rollouts.create(rollout_body("llm", missing, "v9", [{"setWeight": 100}], cluster.s3_endpoint))
    obj = rollouts.wait(
        "llm",
        "InvalidSpec",
        lambda s: any(
            c["type"] == "InvalidSpec" and c["status"] == "True" for c in s.get("conditions") or []
        ),
    )
    cond = next(c for c in obj["status"]["conditions"] if c["type"] == "InvalidSpec")
    assert cond["reason"] == "ManifestUnavailable"
    assert f"weightship manifest {missing}" in cond["message"]
    assert rollouts.replicasets("llm") == []


def test_invalid_manifests_are_rejected_by_the_api_server(
    cluster: Any, namespace: str, crds: None
) -> None:
    custom = client.CustomObjectsApi(cluster.api)

    def create(manifest: dict[str, Any], name: str) -> Any:
        body = copy.deepcopy(manifest)
        body["metadata"] = {"name": name, "namespace": namespace}
        return custom.create_namespaced_custom_object(
            "weightship.io", "v1alpha1", namespace, "modelrollouts", body
        )

    create(VALID_MANIFEST, "valid")
    assert len(INVALID_MANIFESTS) >= 10
    for i, (description, manifest, expected) in enumerate(INVALID_MANIFESTS):
        with pytest.raises(ApiException) as err:
            create(manifest, f"invalid-{i}")
        assert err.value.status == 422, description
        message = json.loads(err.value.body)["message"]
        assert expected in message, f"{description}: {message}"


def test_stale_status_writes_conflict(
    cluster: Any, rollouts: Rollouts, models: dict[str, str]
) -> None:
    rollouts.create(
        rollout_body("llm", models["v1"], "v1", [{"setWeight": 100}], cluster.s3_endpoint)
    )
    rollouts.healthy_on("llm", "v1")
    stale = rollouts.get("llm")["metadata"]["resourceVersion"]
    user_actions.promote(cluster.api, rollouts.namespace, "llm")  # moves resourceVersion
    with pytest.raises(Conflict):
        Kube(cluster.api).patch_rollout_status(
            rollouts.namespace, "llm", stale, {"message": "stale write"}
        )
    # The controller itself recovers from such conflicts: it acknowledges the request.
    rollouts.wait(
        "llm",
        "promote acknowledged",
        lambda s: (s.get("control") or {}).get("promote", {}).get("acknowledged") is not None,
    )
    assert rollouts.get("llm")["status"]["message"] != "stale write"


def test_gateway_api_weights_and_selectors_follow_the_canary(
    cluster: Any, rollouts: Rollouts, models: dict[str, str]
) -> None:
    ns = rollouts.namespace
    for service in ("llm-stable", "llm-canary"):
        cluster.core.create_namespaced_service(
            ns,
            {
                "metadata": {"name": service},
                "spec": {"selector": {"app": "llm"}, "ports": [{"port": 8080}]},
            },
        )
    routes = ("gateway.networking.k8s.io", "v1", ns, "httproutes")
    custom = client.CustomObjectsApi(cluster.api)
    custom.create_namespaced_custom_object(
        *routes,
        {
            "apiVersion": "gateway.networking.k8s.io/v1",
            "kind": "HTTPRoute",
            "metadata": {"name": "llm"},
            "spec": {
                "parentRefs": [{"name": "inference-gateway"}],
                "rules": [
                    {
                        "backendRefs": [
                            {"name": "llm-stable", "port": 8080, "weight": 100},
                            {"name": "llm-canary", "port": 8080, "weight": 0},
                        ]
                    }
                ],
            },
        },
    )
    routing = {
        "gatewayAPI": {
            "httpRoute": {"name": "llm"},
            "stableBackend": "llm-stable",
            "canaryBackend": "llm-canary",
        }
    }
    body = rollout_body(
        "llm",
        models["v1"],
        "v1",
        [{"setWeight": 30}, {"pause": {}}],
        cluster.s3_endpoint,
        trafficRouting=routing,
    )
    rollouts.create(body)
    rollouts.healthy_on("llm", "v1")
    rollouts.set_model("llm", models["v2"], "v2")
    status = rollouts.wait_phase("llm", "Paused")["status"]

    def weights() -> dict[str, int]:
        route = custom.get_namespaced_custom_object(*routes, "llm")
        return {r["name"]: r["weight"] for r in route["spec"]["rules"][0]["backendRefs"]}

    def selects(service: str) -> str:
        selector = cluster.core.read_namespaced_service(service, ns).spec.selector
        return str(selector.get("weightship.io/revision-hash"))

    assert weights() == {"llm-stable": 70, "llm-canary": 30}
    assert selects("llm-stable") == status["stableRevision"]["podTemplateHash"]
    assert selects("llm-canary") == status["canaryRevision"]["podTemplateHash"]

    user_actions.promote(cluster.api, ns, "llm", full=True)
    promoted = rollouts.healthy_on("llm", "v2")["status"]
    testkit.wait_until(
        lambda: weights() == {"llm-stable": 100, "llm-canary": 0},
        timeout=30,
        what="all traffic on the new stable",
        detail=lambda: str(weights()),
    )
    assert selects("llm-stable") == promoted["stableRevision"]["podTemplateHash"]


def test_slack_hears_about_promotions_and_a_dead_webhook_blocks_nothing(
    cluster: Any, rollouts: Rollouts, models: dict[str, str]
) -> None:
    ns = rollouts.namespace
    with SlackReceiver(host=BRIDGE_IP) as slack:
        dead = slack.url.replace(f":{slack.server.server_address[1]}/", ":9/")
        for name, url in (("slack", slack.url), ("dead-slack", dead)):
            cluster.core.create_namespaced_secret(
                ns, {"metadata": {"name": name}, "stringData": {"url": url}}
            )
        for name, secret in (("llm", "slack"), ("quiet", "dead-slack")):
            body = rollout_body(name, models["v1"], "v1", [{"setWeight": 50}], cluster.s3_endpoint)
            body["spec"]["notifications"] = {
                "slack": {
                    "webhookSecretRef": {"name": secret},
                    "channel": "#ml-oncall",
                    "events": ["Promoted", "RolledBack"],
                }
            }
            rollouts.create(body)
        for name in ("llm", "quiet"):
            rollouts.healthy_on(name, "v1")
            rollouts.set_model(name, models["v2"], "v2")
        rollouts.healthy_on("llm", "v2")
        rollouts.healthy_on("quiet", "v2")  # the dead webhook held nothing up
        testkit.wait_until(
            lambda: len(slack.received) >= 2, timeout=30, what="two Slack messages for llm"
        )
    texts = [m["text"] for m in slack.received]
    assert any("llm: Promoted" in t and "v2" in t for t in texts), texts
    assert all(m["channel"] == "#ml-oncall" for m in slack.received)

    def failure_event() -> Any:
        return [e for e in rollouts.events("quiet") if e.reason == "NotificationFailed"]

    failed = testkit.wait_until(failure_event, timeout=90, what="a NotificationFailed event")
    assert "secret-token" not in failed[0].message


ERROR_RATIO = (
    '(sum(rate(weightship_echo_http_requests_total{{namespace="{{{{ namespace }}}}",'
    'weightship_io_revision_hash="{{{{ canaryHash }}}}",code="500"}}[{window}])) or vector(0))'
    ' / sum(rate(weightship_echo_http_requests_total{{namespace="{{{{ namespace }}}}",'
    'weightship_io_revision_hash="{{{{ canaryHash }}}}"}}[{window}]))'
)


def test_prometheus_analysis_passes_a_good_canary_and_rolls_back_a_bad_one(
    cluster: Any, rollouts: Rollouts, models: dict[str, str]
) -> None:
    steps = [
        {"setWeight": 50},
        {"pause": {"duration": "12s"}},
        {"analysis": {"metrics": ["error-rate"]}},
        {"setWeight": 100},
    ]
    analysis = {
        "prometheus": {"address": cluster.prometheus_url},
        "metrics": [
            {
                "name": "error-rate",
                "query": ERROR_RATIO.format(window="20s"),
                "max": 0.05,
                "interval": "4s",
                "count": 3,
                "failureLimit": 0,
                "inconclusiveLimit": 2,
            }
        ],
    }
    body = rollout_body(
        "llm",
        models["v1"],
        "v1",
        steps,
        cluster.s3_endpoint,
        analysis=analysis,
        abortScaleDownDelaySeconds=0,
    )
    body["spec"]["template"]["metadata"]["annotations"] = {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": "8080",
    }
    rollouts.create(body)
    rollouts.healthy_on("llm", "v1")

    stop = threading.Event()

    def traffic() -> None:
        """Steady completion requests to every pod of the rollout, both revisions."""
        while not stop.is_set():
            pods = cluster.core.list_namespaced_pod(
                rollouts.namespace, label_selector="weightship.io/rollout=llm"
            ).items
            for pod in pods:
                if pod.status.pod_ip:
                    request = urllib.request.Request(
                        f"http://{pod.status.pod_ip}:8080/v1/completions",
                        data=b'{"prompt": "hello"}',
                        method="POST",
                    )
                    with contextlib.suppress(OSError):
                        urllib.request.urlopen(request, timeout=2).close()
            stop.wait(0.1)

    load = threading.Thread(target=traffic, daemon=True)
    load.start()
    try:
        rollouts.set_model("llm", models["v2"], "v2")
        rollouts.healthy_on("llm", "v2")
        passed = [e.message for e in rollouts.events("llm") if e.reason == "AnalysisSuccessful"]
        assert passed, "the analysis step ran and passed"

        # Same weights, but the new pods answer half their requests with a 500.
        container = copy.deepcopy(body["spec"]["template"]["spec"]["containers"][0])
        container["env"] = [*container.get("env", []), {"name": "ECHO_ERROR_RATE", "value": "0.5"}]
        rollouts.patch_spec(
            "llm",
            {
                "model": {"source": {"uri": models["v1"]}, "revision": "v1-bad"},
                "template": {"spec": {"containers": [container]}},
            },
        )
        bad = rollouts.wait(
            "llm", "rolled back by analysis", lambda s: s.get("phase") == "Degraded", timeout=120
        )["status"]
    finally:
        stop.set()
        load.join(5)
    assert bad["abort"]["reason"] == "AnalysisFailed", bad["message"]
    assert "error-rate" in bad["message"]
    run = next(r for r in bad["analysis"]["runs"] if r["metric"] == "error-rate")
    assert run["failed"] >= 1 and run["measurements"][-1]["value"] > 0.05
    assert bad["stableRevision"]["revision"] == "v2"
    assert [h["outcome"] for h in bad["history"]][-1] == "RolledBack"


class SwitchableProxy:
    """An HTTP proxy to Prometheus that the test can take down and bring back."""

    def __init__(self, target: str) -> None:
        self.target = target
        with socket.socket() as s:
            s.bind((BRIDGE_IP, 0))
            self.port = s.getsockname()[1]
        self.server: Server | None = None

    @property
    def url(self) -> str:
        return f"http://{BRIDGE_IP}:{self.port}"

    def up(self) -> None:
        target = self.target

        class Forward(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: object) -> None:
                return

            def do_GET(self) -> None:
                with urllib.request.urlopen(target + self.path, timeout=10) as resp:
                    body = resp.read()
                self.send_response(resp.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = Server((BRIDGE_IP, self.port), Forward).start("prometheus-proxy")

    def down(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


def test_unreachable_prometheus_pauses_and_the_rollout_resumes_when_it_returns(
    cluster: Any, rollouts: Rollouts, models: dict[str, str]
) -> None:
    proxy = SwitchableProxy(cluster.prometheus_url)
    steps = [{"setWeight": 50}, {"analysis": {"metrics": ["always-fine"]}}, {"setWeight": 100}]
    analysis = {
        "prometheus": {"address": proxy.url},
        "metrics": [
            {
                "name": "always-fine",
                "query": "vector(0)",
                "max": 1,
                "interval": "2s",
                "count": 2,
                "consecutiveErrorLimit": 1,
            }
        ],
    }
    rollouts.create(
        rollout_body("llm", models["v1"], "v1", steps, cluster.s3_endpoint, analysis=analysis)
    )
    rollouts.healthy_on("llm", "v1")
    try:
        rollouts.set_model("llm", models["v2"], "v2")
        paused = rollouts.wait(
            "llm",
            "paused on an unreachable Prometheus",
            lambda s: s.get("phase") == "Paused" and "unreachable" in (s.get("message") or ""),
        )["status"]
        # Still blind, so still paused: two more failed queries written to status, each
        # by a reconcile that measured and decided (in the same status patch) to stay.
        errors = paused["analysis"]["runs"][0]["error"]
        still = rollouts.wait(
            "llm",
            "two more query errors recorded",
            lambda s: (
                ((s.get("analysis") or {}).get("runs") or [{}])[0].get("error", 0) >= errors + 2
            ),
            timeout=30,
        )["status"]
        assert still["phase"] == "Paused"
        assert still["stableRevision"]["revision"] == "v1"
        assert still["currentStepIndex"] == paused["currentStepIndex"] == 1
        proxy.up()
        rollouts.healthy_on("llm", "v2")
    finally:
        proxy.down()
    assert "AnalysisResumed" in [e.reason for e in rollouts.events("llm")]
