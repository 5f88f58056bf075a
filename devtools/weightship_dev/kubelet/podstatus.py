"""Pure pod status computation: container states + probe results + readiness gates.

Follows kubelet's rules (pkg/kubelet/status/generate.go): ContainersReady when every
container is ready; Ready when ContainersReady AND every readiness gate's condition is
True on the pod. Conditions are written with a strategic merge patch keyed by type, so
gate conditions that controllers own are never overwritten.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ContainerState:
    name: str
    image: str
    state: str = "waiting"  # waiting | running | terminated
    reason: str = "ContainerCreating"
    message: str = ""
    exit_code: int | None = None
    started_at: str | None = None
    finished_at: str | None = None
    restart_count: int = 0
    ready: bool = False
    started: bool = False
    will_restart: bool = True
    # The previous run's terminated state (Kubernetes' lastState), once restarted.
    last_terminated: dict[str, Any] | None = None

    def terminated_status(self) -> dict[str, Any]:
        return {
            "exitCode": self.exit_code if self.exit_code is not None else 0,
            "reason": self.reason,
            "message": self.message or None,
            "startedAt": self.started_at,
            "finishedAt": self.finished_at,
        }

    def to_status(self) -> dict[str, Any]:
        if self.state == "running":
            state: dict[str, Any] = {"running": {"startedAt": self.started_at}}
        elif self.state == "terminated":
            state = {"terminated": self.terminated_status()}
        else:
            state = {"waiting": {"reason": self.reason, "message": self.message or None}}
        return {
            "name": self.name,
            "image": self.image,
            "imageID": f"process://{self.image}",
            "containerID": f"process://{self.name}",
            "ready": self.ready,
            "started": self.started,
            "restartCount": self.restart_count,
            "state": state,
            "lastState": {"terminated": self.last_terminated} if self.last_terminated else {},
        }


@dataclass
class PodObservation:
    containers: list[ContainerState]
    init_containers: list[ContainerState] = field(default_factory=list)
    initialized: bool = True
    sandbox_ready: bool = True
    pod_ip: str | None = None
    host_ip: str | None = None
    start_time: str | None = None


def _condition(
    ctype: str,
    ok: bool,
    now: str,
    reason: str | None = None,
    message: str | None = None,
    previous: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    status = "True" if ok else "False"
    prev = (previous or {}).get(ctype)
    changed_at = prev.get("lastTransitionTime") if prev and prev.get("status") == status else now
    cond: dict[str, Any] = {
        "type": ctype,
        "status": status,
        "lastProbeTime": None,
        "lastTransitionTime": changed_at,
    }
    if not ok and reason:
        cond["reason"] = reason
        cond["message"] = message
    return cond


def gate_problems(pod: dict[str, Any]) -> list[str]:
    """Messages for each readiness gate whose condition is missing or not True."""
    conditions = {c["type"]: c for c in (pod.get("status") or {}).get("conditions") or []}
    problems = []
    for gate in (pod.get("spec") or {}).get("readinessGates") or []:
        ctype = gate["conditionType"]
        cond = conditions.get(ctype)
        if cond is None:
            problems.append(
                f'corresponding condition of pod readiness gate "{ctype}" does not exist.'
            )
        elif cond.get("status") != "True":
            problems.append(
                f'the status of pod readiness gate "{ctype}" is not "True", '
                f"but {cond.get('status')}"
            )
    return problems


def phase(obs: PodObservation) -> str:
    states = obs.containers
    if not obs.initialized or not states:
        return "Pending"
    if all(c.state == "terminated" and not c.will_restart for c in states):
        return "Succeeded" if all(c.exit_code == 0 for c in states) else "Failed"
    if any(
        c.state == "running" or (c.state == "terminated" and c.will_restart) or c.restart_count
        for c in states
    ):
        return "Running"
    return "Pending"


def compute_status(pod: dict[str, Any], obs: PodObservation, now: str) -> dict[str, Any]:
    previous = {c["type"]: c for c in (pod.get("status") or {}).get("conditions") or []}
    not_ready = [c.name for c in obs.containers if not c.ready]
    containers_ready = not not_ready and bool(obs.containers)
    gates = gate_problems(pod)
    pod_phase = phase(obs)
    ready = containers_ready and not gates and pod_phase == "Running"
    if not containers_ready:
        reason, message = (
            "ContainersNotReady",
            f"containers with unready status: [{' '.join(not_ready)}]",
        )
    elif gates:
        reason, message = "ReadinessGatesNotReady", "; ".join(gates)
    else:
        reason, message = "PodCompleted", ""
    conditions = [
        _condition("PodReadyToStartContainers", obs.sandbox_ready, now, previous=previous),
        _condition(
            "Initialized",
            obs.initialized,
            now,
            "ContainersNotInitialized",
            "containers with incomplete status",
            previous,
        ),
        _condition(
            "ContainersReady",
            containers_ready,
            now,
            "ContainersNotReady",
            message if not containers_ready else None,
            previous,
        ),
        _condition("Ready", ready, now, reason, message, previous),
    ]
    status: dict[str, Any] = {
        "phase": pod_phase,
        "conditions": conditions,
        "containerStatuses": [c.to_status() for c in obs.containers],
    }
    if obs.init_containers:
        status["initContainerStatuses"] = [c.to_status() for c in obs.init_containers]
    if obs.pod_ip:
        status["podIP"] = obs.pod_ip
        status["podIPs"] = [{"ip": obs.pod_ip}]
    if obs.host_ip:
        status["hostIP"] = obs.host_ip
        status["hostIPs"] = [{"ip": obs.host_ip}]
    if obs.start_time:
        status["startTime"] = obs.start_time
    return status


def restart_wanted(policy: str, exit_code: int) -> bool:
    return policy == "Always" or (policy == "OnFailure" and exit_code != 0)
