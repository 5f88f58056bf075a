"""Builders for tests of the decision core and of the handlers that call it."""

from __future__ import annotations

import copy
from datetime import UTC, datetime, timedelta
from typing import Any

from weightship.api.models import ModelRollout
from weightship.core.decision import Decision
from weightship.core.observed import (
    ManifestResolution,
    Observed,
    PrefetchObservation,
    ReplicaSetObservation,
)
from weightship_testing.samples import VALID_MANIFEST

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
DIGEST_A = "sha256:" + "a" * 64
DIGEST_B = "sha256:" + "b" * 64


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def make_rollout(
    steps: list[dict[str, Any]] | None = None, *, generation: int = 1, **spec_changes: Any
) -> ModelRollout:
    """VALID_MANIFEST with the given canary steps and top-level spec fields replaced."""
    manifest = copy.deepcopy(VALID_MANIFEST)
    manifest["metadata"]["generation"] = generation
    spec = manifest["spec"]
    if steps is not None:
        spec["strategy"]["canary"]["steps"] = steps
    spec.update(spec_changes)
    return ModelRollout.model_validate(manifest)


def with_status(rollout: ModelRollout, decision: Decision) -> ModelRollout:
    """The rollout as the apiserver returns it after the decision's status patch."""
    return rollout.model_copy(update={"status": decision.status})


def replica_set(
    revision_hash: str,
    replicas: int,
    *,
    ready: int | None = None,
    verified: int | None = None,
    **extra: Any,
) -> ReplicaSetObservation:
    """A ReplicaSet that is fully ready and verified unless told otherwise."""
    ready = replicas if ready is None else ready
    verified = ready if verified is None else verified
    return ReplicaSetObservation(
        name=f"llm-{revision_hash}",
        revision_hash=revision_hash,
        replicas=replicas,
        ready=ready,
        available=ready,
        seeded=verified,
        verified=verified,
        **extra,
    )


def staged(digest: str, staged_nodes: int = 10, target_nodes: int = 10) -> PrefetchObservation:
    return PrefetchObservation(digest=digest, target_nodes=target_nodes, staged_nodes=staged_nodes)


def observe(
    *replica_sets: ReplicaSetObservation,
    digest: str | None = DIGEST_A,
    error: str | None = None,
    prefetch: PrefetchObservation | None = None,
    **extra: Any,
) -> Observed:
    return Observed(
        manifest=ManifestResolution(digest=digest, error=error),
        replica_sets=tuple(replica_sets),
        prefetch=prefetch,
        **extra,
    )


def healthy_rollout(
    steps: list[dict[str, Any]] | None = None, **spec_changes: Any
) -> tuple[ModelRollout, str]:
    """A rollout whose first revision (DIGEST_A) is stable and Healthy, and its hash."""
    from weightship.core.decide import decide

    rollout = make_rollout(steps, **spec_changes)
    first = decide(rollout, observe(prefetch=staged(DIGEST_A)), T0)
    assert first.status.canary_revision is not None
    stable_hash = first.status.canary_revision.pod_template_hash
    rollout = with_status(rollout, first)
    ready = observe(replica_set(stable_hash, rollout.spec.replicas), prefetch=staged(DIGEST_A))
    rollout = with_status(rollout, decide(rollout, ready, T0))
    assert rollout.status.phase == "Healthy", rollout.status.message
    return rollout, stable_hash


def with_model_revision(rollout: ModelRollout, revision: str) -> ModelRollout:
    """The user applied a new spec.model.revision (generation bumped)."""
    model = rollout.spec.model.model_copy(update={"revision": revision})
    spec = rollout.spec.model_copy(update={"model": model})
    metadata = rollout.metadata.model_copy(update={"generation": rollout.metadata.generation + 1})
    return rollout.model_copy(update={"spec": spec, "metadata": metadata})
