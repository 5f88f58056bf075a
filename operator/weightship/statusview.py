"""Render a ModelRollout for people (rich) or machines (JSON)."""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from weightship.core.staging_failure import failure_summary, parse_failure

PHASE_STYLE = {
    "Healthy": "green",
    "Progressing": "cyan",
    "Prefetching": "cyan",
    "Paused": "yellow",
    "Degraded": "red",
    "Pending": "dim",
}


def _step_text(step: dict[str, Any]) -> str:
    if "setWeight" in step:
        return f"setWeight {step['setWeight']}"
    if "pause" in step:
        duration = (step.get("pause") or {}).get("duration")
        return f"pause {duration}" if duration else "pause (until promoted)"
    if "analysis" in step:
        metrics = (step.get("analysis") or {}).get("metrics") or []
        return "analysis " + ", ".join(metrics) if metrics else "analysis"
    return str(step)


def summary(rollout: dict[str, Any]) -> dict[str, Any]:
    """The machine-readable view (`-o json`): spec essentials and the whole status."""
    spec, status = rollout.get("spec") or {}, rollout.get("status") or {}
    return {
        "name": rollout["metadata"]["name"],
        "namespace": rollout["metadata"]["namespace"],
        "generation": rollout["metadata"].get("generation"),
        "model": (spec.get("model") or {}),
        "replicas": spec.get("replicas"),
        "steps": ((spec.get("strategy") or {}).get("canary") or {}).get("steps") or [],
        "status": status,
    }


def render(rollout: dict[str, Any]) -> Group:
    spec, status = rollout.get("spec") or {}, rollout.get("status") or {}
    parts: list[Any] = [
        _head_table(rollout, spec, status),
        _steps_table(spec, status),
        _conditions_table(status),
    ]
    prefetch = _prefetch_table(status.get("prefetch") or {})
    if prefetch is not None:
        parts.append(prefetch)
    parts.extend(_verification_tables(status.get("verification") or {}))
    in_place = _in_place_table(status.get("inPlace") or {})
    if in_place is not None:
        parts.append(in_place)
    history = _history_table(status.get("history") or [])
    if history is not None:
        parts.append(history)
    return Group(*parts)


def _head_table(rollout: dict[str, Any], spec: dict[str, Any], status: dict[str, Any]) -> Table:
    """Name, phase, revisions, weight, replicas and the adopted workload."""
    phase = status.get("phase", "Pending")
    head = Table.grid(padding=(0, 2))
    head.add_row("Name", f"{rollout['metadata']['namespace']}/{rollout['metadata']['name']}")
    head.add_row("Phase", Text(phase, style=PHASE_STYLE.get(phase, "")))
    head.add_row("Message", status.get("message", ""))
    stable = status.get("stableRevision") or {}
    canary = status.get("canaryRevision") or {}
    head.add_row("Stable", f"{stable.get('revision', '-')} {stable.get('manifestDigest', '')}")
    head.add_row("Canary", f"{canary.get('revision', '-')} {canary.get('manifestDigest', '')}")
    if canary.get("update"):
        head.add_row("Update", f"{canary['update']}: {canary.get('updateReason', '')}")
    head.add_row("Weight", f"{status.get('canaryWeight', 0)}%")
    replicas = status.get("replicas") or {}
    head.add_row(
        "Replicas",
        f"desired {spec.get('replicas')}, stable {replicas.get('stable', 0)}"
        f", canary {replicas.get('canary', 0)}, ready {replicas.get('ready', 0)}"
        f", verified {replicas.get('verified', 0)}",
    )
    workload = _workload_text(spec, status)
    if workload:
        head.add_row("Workload", workload)
    return head


def _steps_table(spec: dict[str, Any], status: dict[str, Any]) -> Table:
    """The canary steps: done, in progress, to come."""
    phase = status.get("phase", "Pending")
    steps = Table("#", "step", "", title="Steps", title_justify="left")
    current = status.get("currentStepIndex")
    for i, step in enumerate(((spec.get("strategy") or {}).get("canary") or {}).get("steps") or []):
        mark = (
            "✔"
            if current is not None and i < current
            else "▶"
            if i == current and phase != "Healthy"
            else ""
        )
        steps.add_row(str(i), _step_text(step), mark)
    return steps


def _conditions_table(status: dict[str, Any]) -> Table:
    gates = Table(
        "condition", "status", "reason", "message", title="Conditions", title_justify="left"
    )
    for c in status.get("conditions") or []:
        gates.add_row(c["type"], c["status"], c.get("reason", ""), c.get("message", ""))
    return gates


def _prefetch_table(prefetch: dict[str, Any]) -> Table | None:
    """Each node's staging progress; None before any node is counted."""
    if not prefetch.get("nodes"):
        return None
    nodes = Table(
        "node",
        "state",
        "progress",
        "reason",
        title=f"Prefetch {prefetch.get('stagedNodes', 0)}/{prefetch.get('targetNodes', 0)} staged",
        title_justify="left",
    )
    for n in prefetch["nodes"]:
        total = n.get("bytesTotal") or 0
        pct = f"{100 * (n.get('bytesDone') or 0) / total:.0f}%" if total else "-"
        nodes.add_row(n["name"], n["state"], pct, _staging_reason(n))
    return nodes


def _history_table(history: list[dict[str, Any]]) -> Table | None:
    """The last five promotions and rollbacks; None when there are none."""
    if not history:
        return None
    hist = Table("at", "revision", "outcome", "reason", title="History", title_justify="left")
    for h in history[-5:]:
        hist.add_row(
            h.get("at", ""), h.get("revision", ""), h.get("outcome", ""), h.get("reason", "")
        )
    return hist


def _in_place_table(in_place: dict[str, Any]) -> Table | None:
    """updatePolicy InPlaceIfPossible: what each pod holds, how it got it, its last swap."""
    pods = in_place.get("pods") or []
    if not pods:
        return None
    title = "Pods"
    bound = in_place.get("maxUnavailable")
    if bound is not None:
        out = f"at most {bound} out of traffic at once" if bound else "each in traffic"
        title += f" ({in_place.get('swappingPods') or 0} swapping, {out})"
    table = Table(
        "pod",
        "revision",
        "arrived",
        "last swap",
        "seconds",
        "paused",
        "held",
        "reason",
        title=title,
    )
    table.title_justify = "left"
    for pod in pods:
        seconds, paused = pod.get("swapSeconds"), pod.get("pausedSeconds")
        last = f"{pod.get('swapState')} to {pod.get('swapTo')}" if pod.get("swapState") else "-"
        if pod.get("inTraffic"):
            last += " in traffic"
        held = pod.get("heldSeconds")
        table.add_row(
            pod["pod"],
            pod.get("revision") or pod.get("podTemplateHash") or "-",
            pod.get("arrival", "Started"),
            last,
            f"{seconds:.2f}" if seconds is not None else "-",
            f"{paused:.2f}" if paused is not None else "-",
            f"{held:.2f}" if held is not None else "-",
            pod.get("reason") or "",
        )
    return table


def _workload_text(spec: dict[str, Any], status: dict[str, Any]) -> str:
    """spec.workloadRef's Deployment: handed over (status.workload) or still serving."""
    record = status.get("workload") or {}
    if record:
        return (
            f"Deployment {record.get('name')} scaled to 0 by this rollout; gets "
            f"{record.get('replicas')} replicas back when it is deleted or no longer named"
        )
    ref = spec.get("workloadRef") or {}
    if ref:
        return f"Deployment {ref.get('name')} keeps its replicas until the stable serves"
    return ""


def _staging_reason(node: dict[str, Any]) -> str:
    """Why a node's stage failed, e.g. ``DiskFull (needs 6291456 B, 0 B available)``."""
    failure = parse_failure(node.get("failure"))
    return failure_summary(failure) if failure is not None else ""


# status.verification.loads[].mode: how the verifier checked the pod's weights.
VERIFIED_BY = {
    "loaded": "server's load report",
    "staged": "verified node cache",
    "none": "no checksum",
}


def _verification_tables(verification: dict[str, Any]) -> list[Table]:
    """Canary pods: how each got its weights (who seeded whom), and why any failed."""
    tables = []
    loads = verification.get("loads") or []
    if loads:
        table = Table(
            "pod", "verified by", "loaded from", "seeded by", "seconds", title="Canary pods"
        )
        table.title_justify = "left"
        for load in loads:
            seconds = load.get("seconds")
            table.add_row(
                load["pod"],
                VERIFIED_BY.get(load.get("mode") or "", "-"),
                load.get("source") or "-",
                load.get("seededFrom") or "",
                f"{seconds:.2f}" if seconds is not None else "-",
            )
        tables.append(table)
    failures = verification.get("failures") or []
    if failures:
        table = Table("pod", "reason", "prompt", "expected", "got", title="Failed verification")
        table.title_justify = "left"
        for f in failures:
            table.add_row(
                f["pod"],
                f["reason"],
                f.get("prompt") or "",
                f.get("expected") or "",
                f.get("got") if f.get("got") is not None else (f.get("message") or ""),
            )
        tables.append(table)
    return tables
