"""Broadcast seeding rendezvous: who seeds the pods a scale-up creates (pure).

When a ReplicaSet grows and one of its pods already has verified weights, that pod is
the root: the new pods get its address, a group id unique to this scale-up and the group
size in their env. They join the root's torch.distributed group (weightship.seeding) and
receive one broadcast; anything that goes wrong makes them load from the node cache.
The env names are weightship.api.env's, which weightship.seeding.config reads.
"""

from __future__ import annotations

from collections.abc import Sequence

from weightship.api.env import (
    SEED_BACKEND_ENV,
    SEED_GROUP_ENV,
    SEED_ROOT_ENV,
    SEED_TIMEOUT_ENV,
    SEED_WORLD_SIZE_ENV,
)
from weightship.api.spec import ModelRolloutSpec
from weightship.core.decision import EnvVar, SeedEnv
from weightship.core.observed import ObservedPod, ReplicaSetObservation


def seed_root(pods: Sequence[ObservedPod], revision_hash: str) -> ObservedPod | None:
    """The oldest Ready pod of the revision whose weights passed verification."""
    candidates = [
        p
        for p in pods
        if p.revision_hash == revision_hash
        and not p.deleting
        and p.pod_ip
        and p.weights_verified
        and p.ready
    ]
    return min(candidates, key=lambda p: (p.created, p.name), default=None)


def seed_env(
    spec: ModelRolloutSpec, root_url: str | None, group: str, world_size: int
) -> tuple[EnvVar, ...]:
    """Empty root, group and size switch broadcast off: the pods load from the node cache."""
    seeding = spec.seeding
    on = root_url is not None and seeding.broadcast
    values = {
        SEED_ROOT_ENV: root_url if on and root_url else "",
        SEED_GROUP_ENV: group if on else "",
        SEED_WORLD_SIZE_ENV: str(world_size) if on else "",
        SEED_BACKEND_ENV: seeding.backend,
        SEED_TIMEOUT_ENV: str(seeding.timeout_seconds),
    }
    return tuple(EnvVar(k, v) for k, v in values.items())


def scale_up_seed(
    spec: ModelRolloutSpec,
    pods: Sequence[ObservedPod],
    replica_set: ReplicaSetObservation,
    target: int,
) -> SeedEnv | None:
    """The seed env for growing `replica_set` to `target`; None when it does not grow.
    It goes on the containers of the ReplicaSet's pods (the root's when none is seen),
    so a root-less scale-up also clears the root an earlier scale-up set."""
    current = replica_set.replicas
    if target <= current:
        return None
    root = seed_root(pods, replica_set.revision_hash)
    containers = replica_set.containers or (root.containers if root is not None else ())
    if root is None or not spec.seeding.broadcast:
        return SeedEnv(containers, seed_env(spec, None, "", 0))
    url = f"http://{root.pod_ip}:{spec.validation.endpoint.port}"
    group = f"{replica_set.name}-{current}to{target}-{root.uid[:8]}"
    return SeedEnv(containers, seed_env(spec, url, group, 1 + target - current))
