"""Status projection: what the observations say about replicas, verification and staging,
written into status for users and `weightship status` (no rollout decisions here)."""

from __future__ import annotations

from weightship.api.status import (
    MAX_POD_LOADS,
    MAX_PREFETCH_NODES,
    MAX_VERIFICATION_FAILURES,
    PodLoad,
    PodVerificationFailure,
    PrefetchNodeStatus,
    PrefetchStatus,
    ReplicaStatus,
    VerificationStatus,
)
from weightship.core.context import RolloutContext


def project_observations(ctx: RolloutContext) -> None:
    status = ctx.status
    stable = ctx.observed.replica_set(
        status.stable_revision.pod_template_hash if status.stable_revision else None
    )
    canary = ctx.observed.replica_set(
        status.canary_revision.pod_template_hash if status.canary_revision else None
    )
    present = [rs for rs in (stable, canary) if rs is not None]
    status.replicas = ReplicaStatus(
        stable=stable.replicas if stable else 0,
        canary=canary.replicas if canary else 0,
        ready=sum(rs.ready for rs in present),
        verified=sum(rs.verified for rs in present),
    )
    _project_verification(ctx)
    _project_prefetch(ctx)


def _project_verification(ctx: RolloutContext) -> None:
    """Failures and loads of the canary's pods, or of the stable's when there is no
    canary (so who seeded whom stays visible after a promotion). Pods come and go (an
    abort deletes them): records of the same revision are kept until another starts."""
    status = ctx.status
    canary = status.canary_revision or status.stable_revision
    if canary is None:
        status.verification = None
        return
    replica_set = ctx.observed.replica_set(canary.pod_template_hash)
    old = status.verification
    if old is None or old.pod_template_hash != canary.pod_template_hash:
        old = VerificationStatus(pod_template_hash=canary.pod_template_hash)
    failures = {f.pod: f for f in old.failures}
    loads = {load.pod: load for load in old.loads}
    if replica_set is not None:
        for f in replica_set.failed:
            failures[f.pod] = PodVerificationFailure(
                pod=f.pod,
                reason=f.reason,
                message=f.message[:1024],
                prompt=f.prompt,
                expected=f.expected and f.expected[:1024],
                got=f.got and f.got[:1024],
            )
        for load in replica_set.loads:
            loads[load.pod] = PodLoad(
                pod=load.pod,
                source=load.source,
                seeded_from=load.seeded_from,
                seconds=load.seconds,
                mode=load.mode,
            )
    status.verification = VerificationStatus(
        pod_template_hash=canary.pod_template_hash,
        verified=replica_set.verified if replica_set is not None else 0,
        failures=[failures[k] for k in sorted(failures)][:MAX_VERIFICATION_FAILURES],
        loads=[loads[k] for k in sorted(loads)][-MAX_POD_LOADS:],
    )


def _project_prefetch(ctx: RolloutContext) -> None:
    status = ctx.status
    seen = ctx.observed.prefetch
    prefetch = status.prefetch
    if seen is None or prefetch is None or seen.digest != prefetch.manifest_digest:
        return
    pending = sorted(
        (n for n in seen.nodes if n.state != "Staged"),
        key=lambda n: (n.state != "Failed", n.name),
    )[:MAX_PREFETCH_NODES]
    status.prefetch = PrefetchStatus(
        manifest_digest=seen.digest,
        staged_nodes=seen.staged_nodes,
        target_nodes=seen.target_nodes,
        bytes_staged=seen.bytes_staged,
        bytes_total=seen.bytes_total,
        nodes=[
            PrefetchNodeStatus(
                name=n.name,
                state=n.state,
                bytes_done=n.bytes_done,
                bytes_total=n.bytes_total,
                message=n.message,
                failure=n.failure,
            )
            for n in pending
        ],
    )
