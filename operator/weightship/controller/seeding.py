"""Broadcast seeding rendezvous, decided by the operator (pure; no I/O).

When a ReplicaSet grows and one of its pods already has verified weights, that pod is
the root: the pods the scale-up creates get its address, a group id unique to this
scale-up and the group size in their env (weightship.builders.seed_env). They join the
root's torch.distributed group (weightship.seeding) and receive one broadcast; anything
that goes wrong makes them load from the node cache instead.
"""

from __future__ import annotations

from typing import Any

from weightship.api.models import ModelRollout
from weightship.controller.builders import REVISION_LABEL, VERIFIED_GATE, seed_env
from weightship.controller.pods import is_true


def seed_root(pods: list[dict[str, Any]], revision_hash: str) -> dict[str, Any] | None:
    """The oldest Ready pod of the revision whose weights passed verification."""
    candidates = [
        p
        for p in pods
        if (p["metadata"].get("labels") or {}).get(REVISION_LABEL) == revision_hash
        and not p["metadata"].get("deletionTimestamp")
        and (p.get("status") or {}).get("podIP")
        and is_true(p, VERIFIED_GATE)
        and is_true(p, "Ready")
    ]
    if not candidates:
        return None
    return min(
        candidates,
        key=lambda p: (p["metadata"].get("creationTimestamp") or "", p["metadata"]["name"]),
    )


def scale_up_env(
    rollout: ModelRollout,
    pods: list[dict[str, Any]],
    replica_set: str,
    revision_hash: str,
    current: int,
    target: int,
) -> tuple[list[dict[str, Any]], list[str]] | None:
    """Env for the pods a scale-up from `current` to `target` creates, and the containers
    to set it on; None when nothing is to change (no scale-up)."""
    if target <= current:
        return None
    root = seed_root(pods, revision_hash)
    containers = [c["name"] for c in ((root or {}).get("spec") or {}).get("containers") or []]
    if root is None or not rollout.spec.seeding.broadcast:
        return seed_env(rollout, None, "", 0), containers
    port = rollout.spec.validation.endpoint.port
    url = f"http://{root['status']['podIP']}:{port}"
    group = f"{replica_set}-{current}to{target}-{root['metadata'].get('uid', '')[:8]}"
    return seed_env(rollout, url, group, 1 + target - current), containers
