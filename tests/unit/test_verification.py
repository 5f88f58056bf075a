"""The readiness-gate verifier: pure verdicts, the seeding plan, and one real HTTP round.

The Verifier test runs a real HTTP server on loopback (what an inference server answers)
and records the pod writes it makes: the Kubernetes side is covered by the e2e tests.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from prometheus_client import REGISTRY

from weightship.api.models import ModelRollout
from weightship.api.names import (
    DIGEST_ANNOTATION,
    FAILED_PROMPT_ANNOTATION,
    LOADED_ANNOTATION,
    RESTARTS_ANNOTATION,
    REVISION_LABEL,
    VERIFIED_GATE,
)
from weightship.api.spec import GoldenPrompt
from weightship.controller.builders import gate_condition
from weightship.controller.snapshot import observed_pods, replica_set_observations
from weightship.controller.verifier import Verifier, needs_check
from weightship.core.observed import ReplicaSetObservation
from weightship.core.pod_gates import pod_gates
from weightship.core.seeding import scale_up_seed, seed_root
from weightship.core.verification import (
    GateVerdict,
    LoadReport,
    gate_changed,
    judge_prompt,
    load_verdict,
    prompts_verdict,
)
from weightship.httpserver import QuietHandler, Server
from weightship_testing.samples import VALID_MANIFEST

DIGEST = "sha256:" + "ab" * 32


def prompt(name: str = "capital", **expect: str) -> GoldenPrompt:
    return GoldenPrompt.model_validate(
        {
            "name": name,
            "prompt": "The capital of France is",
            "expect": expect or {"prefix": " Paris"},
        }
    )


@pytest.mark.parametrize(
    ("expect", "text", "passed"),
    [
        ({"equals": " Paris."}, " Paris.", True),
        ({"equals": " Paris."}, " Paris. ", False),
        ({"prefix": " Paris"}, " Paris is big", True),
        ({"prefix": " Paris"}, " Lyon", False),
        ({"contains": "Paris"}, "it is Paris", True),
        ({"contains": "Paris"}, "it is Lyon", False),
        ({"regex": r"^ P\w+\.$"}, " Paris.", True),
        ({"regex": r"^ P\w+\.$"}, " Lyon.", False),
    ],
)
def test_golden_prompt_expectations(expect: dict[str, str], text: str, passed: bool) -> None:
    assert judge_prompt(prompt(**expect), text).passed is passed


def test_a_failed_prompt_reads_as_expected_against_got() -> None:
    outcome = judge_prompt(prompt(prefix=" Paris"), " Lyon.")
    assert outcome.diff() == 'golden prompt \'capital\': expected prefix " Paris", got " Lyon."'


def report(**kw: Any) -> LoadReport:
    doc = {"state": "Loaded", "manifestDigest": DIGEST, "verified": True, "source": "cache"}
    return LoadReport.from_json(doc | kw)


def test_load_report_round_trips_through_its_wire_format() -> None:
    sent = report(source="broadcast", seededFrom="llm-abc-1", loadSeconds=1.5)
    assert LoadReport.from_json(sent.to_json()) == sent
    assert set(sent.to_json()) == {
        "manifestDigest",
        "verified",
        "state",
        "reason",
        "message",
        "source",
        "seededFrom",
        "loadSeconds",
    }


def test_load_report_decides_before_prompts() -> None:
    assert load_verdict(report(state="Loading"), DIGEST, True) == GateVerdict(
        "False", "Loading", "the server is loading weights"
    )
    failed = load_verdict(
        report(state="Failed", reason="ChecksumMismatch", message="chunk 3"), DIGEST, True
    )
    assert failed is not None and (failed.reason, failed.final) == ("ChecksumMismatch", True)
    wrong = load_verdict(report(manifestDigest="sha256:" + "cd" * 32), DIGEST, True)
    assert wrong is not None and wrong.reason == "DigestMismatch" and DIGEST in wrong.message
    unverified = load_verdict(report(verified=False), DIGEST, True)
    assert unverified is not None and unverified.reason == "NotVerified"
    # With checksum off, the digest is not compared: golden prompts decide.
    assert load_verdict(report(manifestDigest="sha256:" + "cd" * 32), DIGEST, False) is None
    assert load_verdict(report(), DIGEST, True) is None


def test_prompts_verdict_names_the_first_failure_and_describes_the_load() -> None:
    good = judge_prompt(prompt("a"), " Paris.")
    bad = judge_prompt(prompt("b"), " Lyon.")
    verdict = prompts_verdict(report(), [good, bad], True)
    assert (verdict.status, verdict.reason, verdict.failed_prompt) == (
        "False",
        "GoldenPromptFailed",
        bad,
    )
    seeded = report(source="broadcast", seededFrom="llm-abc-1", loadSeconds=1.5)
    ok = prompts_verdict(seeded, [good], True)
    assert ok.status == "True" and ok.final
    assert "broadcast (seeded by llm-abc-1) in 1.50 s" in ok.message
    assert "1/1 golden prompts" in ok.message


def test_gate_changed_only_when_the_condition_would() -> None:
    verdict = GateVerdict("False", "Loading", "loading")
    assert gate_changed(None, verdict)
    assert not gate_changed({"status": "False", "reason": "Loading", "message": "loading"}, verdict)
    assert gate_changed({"status": "False", "reason": "Pending", "message": "x"}, verdict)


def pod(
    name: str,
    *,
    gate: tuple[str, str] | None = None,
    ready: bool = False,
    ip: str | None = "127.0.0.1",
    revision: str = "abc",
    annotations: dict[str, str] | None = None,
    created: str = "2026-11-30T00:00:00Z",
) -> dict[str, Any]:
    conditions = [{"type": "Ready", "status": "True" if ready else "False"}]
    if gate:
        conditions.append({"type": VERIFIED_GATE, "status": gate[0], "reason": gate[1]})
    return {
        "metadata": {
            "name": name,
            "namespace": "ns",
            "uid": f"uid-{name}",
            "creationTimestamp": created,
            "labels": {REVISION_LABEL: revision},
            "annotations": {DIGEST_ANNOTATION: DIGEST, **(annotations or {})},
        },
        "spec": {"containers": [{"name": "server"}]},
        "status": {"phase": "Running", "podIP": ip, "conditions": conditions},
    }


def test_needs_check_only_for_running_pods_without_a_verdict() -> None:
    assert needs_check(pod("new"))
    assert needs_check(pod("loading", gate=("False", "Loading")))
    assert not needs_check(pod("done", gate=("True", "Verified")))
    assert not needs_check(pod("failed", gate=("False", "GoldenPromptFailed")))
    assert not needs_check(pod("no-ip", ip=None))


def test_a_restarted_container_is_verified_again() -> None:
    verified = pod("p", gate=("True", "Verified"), annotations={RESTARTS_ANNOTATION: "0"})
    assert not needs_check(verified)
    verified["status"]["containerStatuses"] = [{"name": "server", "restartCount": 1}]
    assert needs_check(verified)


def test_a_draining_pod_is_never_verified_again() -> None:
    """About to be deleted (core.drain): even a restart does not reopen its gate."""
    draining = pod("p", gate=("False", "Draining"), annotations={RESTARTS_ANNOTATION: "0"})
    draining["status"]["containerStatuses"] = [{"name": "server", "restartCount": 1}]
    assert not needs_check(draining)


def test_observation_carries_failing_prompt_and_who_seeded_whom() -> None:
    rs = [{"metadata": {"name": "llm-abc", "labels": {REVISION_LABEL: "abc"}}, "spec": {}}]
    failing = {"name": "capital", "expected": 'prefix " Paris"', "got": " Lyon."}
    loaded = {"source": "broadcast", "seededFrom": "llm-abc-1", "seconds": 2.5}
    pods = [
        pod(
            "p2",
            gate=("False", "GoldenPromptFailed"),
            annotations={FAILED_PROMPT_ANNOTATION: json.dumps(failing)},
        ),
        pod(
            "p1",
            gate=("True", "Verified"),
            annotations={LOADED_ANNOTATION: json.dumps(loaded)},
        ),
    ]
    (obs,) = replica_set_observations(rs, pods)
    (failure,) = obs.failed
    assert (failure.prompt, failure.expected, failure.got) == (
        "capital",
        'prefix " Paris"',
        " Lyon.",
    )
    (load,) = obs.loads
    assert (load.pod, load.source, load.seeded_from, load.seconds) == (
        "p1",
        "broadcast",
        "llm-abc-1",
        2.5,
    )
    assert obs.seeded == 1


def rollout(**validation: Any) -> ModelRollout:
    spec = {**VALID_MANIFEST["spec"], "validation": validation}
    body = {**VALID_MANIFEST, "spec": spec, "metadata": {"name": "llm", "namespace": "ns"}}
    return ModelRollout.from_body(body)


def test_scale_up_seeds_from_the_oldest_verified_ready_pod() -> None:
    """Raw pods through snapshot.observed_pods into the core's seed-root choice."""
    pods = observed_pods(
        [
            pod(
                "young",
                gate=("True", "Verified"),
                ready=True,
                ip="10.0.0.2",
                created="2026-11-30T01:00:00Z",
            ),
            pod("old", gate=("True", "Verified"), ready=True, ip="10.0.0.1"),
            pod("unverified", ready=True, ip="10.0.0.3", created="2026-11-29T00:00:00Z"),
            pod(
                "other-rev",
                gate=("True", "Verified"),
                ready=True,
                revision="zzz",
                created="2026-11-01T00:00:00Z",
            ),
        ]
    )
    root = seed_root(pods, "abc")
    assert root is not None and root.name == "old"
    rs = ReplicaSetObservation("llm-abc", "abc", replicas=1)
    planned = scale_up_seed(rollout().spec, pods, rs, 3)
    assert planned is not None
    values = {e.name: e.value for e in planned.env}
    assert planned.containers == ("server",)
    assert values["WEIGHTSHIP_SEED_ROOT"] == "http://10.0.0.1:8000"
    assert values["WEIGHTSHIP_SEED_WORLD_SIZE"] == "3"
    assert values["WEIGHTSHIP_SEED_GROUP"] == "llm-abc-1to3-uid-old"
    assert scale_up_seed(rollout().spec, pods, rs, 1) is None


def test_scale_up_without_a_verified_root_switches_broadcast_off() -> None:
    pods = observed_pods([pod("loading", gate=("False", "Loading"))])
    rs = ReplicaSetObservation("llm-abc", "abc", replicas=1, containers=("server",))
    planned = scale_up_seed(rollout().spec, pods, rs, 3)
    assert planned is not None and planned.containers == ("server",)
    values = {e.name: e.value for e in planned.env}
    assert values["WEIGHTSHIP_SEED_ROOT"] == "" and values["WEIGHTSHIP_SEED_GROUP"] == ""


# --- the Verifier against a real HTTP server -------------------------------------------------


class FakeServerState:
    def __init__(self) -> None:
        self.loaded: dict[str, Any] = {}
        self.completion = " Paris."
        self.errors_left = 0


class Handler(QuietHandler):
    state = FakeServerState()

    def do_GET(self) -> None:
        self.send_json(200, self.state.loaded)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["temperature"] == 0 and body["max_tokens"] == 16
        if self.state.errors_left > 0:
            self.state.errors_left -= 1
            self.send_json(500, {"error": "injected"})
            return
        self.send_json(200, {"choices": [{"text": self.state.completion}]})


class Verdicts:
    """What a verifier reports, carried to the gate as the controller does: its pending
    verdict, the snapshot, the core's gate decision (core.pod_gates), apply's rendering."""

    def __init__(self) -> None:
        self.woken: list[tuple[str, str]] = []
        self.done = threading.Event()

    def on_verdict(self, namespace: str, name: str) -> None:
        self.woken.append((namespace, name))
        self.done.set()

    def written(
        self, verifier: Verifier, rollout: ModelRollout, raw: dict[str, Any]
    ) -> tuple[str, dict[str, Any], dict[str, str | None] | None]:
        pods = observed_pods([raw], verifier.pending([raw]))
        (gate,) = pod_gates(rollout.spec, pods, datetime.now(UTC))
        return gate.pod, gate_condition(gate), dict(gate.annotations) or None


@pytest.fixture
def server() -> Iterator[tuple[int, FakeServerState]]:
    state = FakeServerState()
    state.loaded = {
        "state": "Loaded",
        "manifestDigest": DIGEST,
        "verified": True,
        "source": "cache",
        "loadSeconds": 0.5,
    }
    handler = type("H", (Handler,), {"state": state})
    with Server(("127.0.0.1", 0), handler).start("plugin") as httpd:
        yield httpd.server_port, state


def verify_once(
    port: int, golden: str = " Paris"
) -> tuple[str, dict[str, Any], dict[str, str | None] | None]:
    verdicts = Verdicts()
    verifier = Verifier(None, workers=2, on_verdict=verdicts.on_verdict)  # type: ignore[arg-type]
    r = rollout(
        goldenPrompts=[
            {"name": "capital", "prompt": "The capital of France is", "expect": {"prefix": golden}}
        ],
        endpoint={"port": port},
        timeoutSeconds=5,
    )
    assert verifier.submit(r, [pod("p1")]) is True
    assert verdicts.done.wait(30)
    verifier.pool.shutdown(wait=True)
    assert verdicts.woken == [("ns", r.metadata.name)]
    return verdicts.written(verifier, r, pod("p1"))


def test_verifier_opens_the_gate_after_digest_and_prompts(
    server: tuple[int, FakeServerState],
) -> None:
    port, state = server
    state.errors_left = 2  # transient 500s are retried, not a verdict
    name, condition, annotations = verify_once(port)
    assert (name, condition["type"], condition["status"], condition["reason"]) == (
        "p1",
        VERIFIED_GATE,
        "True",
        "Verified",
    )
    assert (
        annotations is not None
        and json.loads(annotations[LOADED_ANNOTATION] or "")["source"] == "cache"
    )


def test_verifier_fails_the_gate_with_the_prompt_diff(server: tuple[int, FakeServerState]) -> None:
    port, state = server
    state.completion = " Lyon."
    _, condition, annotations = verify_once(port)
    assert (condition["status"], condition["reason"]) == ("False", "GoldenPromptFailed")
    assert 'expected prefix " Paris", got " Lyon."' in condition["message"]
    assert annotations is not None
    assert json.loads(annotations[FAILED_PROMPT_ANNOTATION] or "")["got"] == " Lyon."
    counted = REGISTRY.get_sample_value(
        "weightship_pod_verifications_total",
        {"namespace": "ns", "status": "False", "reason": "GoldenPromptFailed"},
    )
    assert counted is not None and counted >= 1


def test_verifier_reports_a_checksum_failure_from_the_server(
    server: tuple[int, FakeServerState],
) -> None:
    port, state = server
    state.loaded = {
        "state": "Failed",
        "reason": "ChecksumMismatch",
        "message": "model.safetensors chunk 2",
    }
    _, condition, _ = verify_once(port)
    assert (condition["status"], condition["reason"]) == ("False", "ChecksumMismatch")


def test_verifier_waits_while_the_server_is_unreachable() -> None:
    verdicts = Verdicts()
    verifier = Verifier(None, workers=1, on_verdict=verdicts.on_verdict)  # type: ignore[arg-type]
    r = rollout(goldenPrompts=[], endpoint={"port": 9}, timeoutSeconds=1)
    verifier.submit(r, [pod("p1")])
    assert verdicts.done.wait(30)
    _, condition, _ = verdicts.written(verifier, r, pod("p1"))
    assert (condition["status"], condition["reason"]) == ("False", "Pending")


def test_a_verdict_waits_for_its_gate_then_is_dropped(server: tuple[int, FakeServerState]) -> None:
    """The verifier never writes the gate: its verdict waits (no second check meanwhile)
    until the pod's gate shows it, as apply writes it."""
    port, _ = server
    verdicts = Verdicts()
    verifier = Verifier(None, workers=1, on_verdict=verdicts.on_verdict)  # type: ignore[arg-type]
    r = rollout(
        goldenPrompts=[
            {
                "name": "capital",
                "prompt": "The capital of France is",
                "expect": {"prefix": " Paris"},
            }
        ],
        endpoint={"port": port},
        timeoutSeconds=5,
    )
    verifier.submit(r, [pod("p1")])
    assert verdicts.done.wait(30)
    verifier.pool.shutdown(wait=True)
    verdicts.done.clear()
    # Not on the gate yet: still waiting, and not checked again.
    assert verifier.submit(r, [pod("p1")]) is True and set(verifier.pending([pod("p1")]))
    _, condition, annotations = verdicts.written(verifier, r, pod("p1"))
    applied = pod("p1", gate=(condition["status"], condition["reason"]), annotations={})
    applied["status"]["conditions"][-1]["message"] = condition["message"]
    applied["metadata"]["annotations"].update({k: v for k, v in (annotations or {}).items() if v})
    now = datetime.now(UTC)
    assert not pod_gates(r.spec, observed_pods([applied], verifier.pending([applied])), now)
    assert verifier.submit(r, [applied]) is False  # shown: dropped, nothing to check
    assert verifier.pending([applied]) == {} and not verdicts.done.is_set()
