"""The revision the spec asks for, or why the spec (or its manifest) is unusable."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from weightship.api.status import ModelRolloutStatus, RevisionStatus
from weightship.core.conditions import set_condition
from weightship.core.context import RolloutContext
from weightship.core.decision import Event
from weightship.core.revision import revision_hash, template_hash

INVALID_SPEC_RETRY_SECONDS = 60.0
"""S3 is not watched: look for a missing manifest again this often."""


def spec_template(ctx: RolloutContext) -> Any:
    """The pod template of the spec's revision: spec.template, or spec.workloadRef's
    Deployment template as observed (None when that Deployment was not found)."""
    if ctx.spec.template is not None:
        return ctx.spec.template.to_k8s()
    return ctx.observed.workload_template


def desired_revision(ctx: RolloutContext) -> RevisionStatus | None:
    model = ctx.spec.model
    uri = model.source.uri
    manifest = ctx.observed.manifest
    if manifest.digest is None:
        detail = manifest.error or "not found"
        invalid(
            ctx,
            "ManifestUnavailable",
            f"weights manifest for {uri} is unavailable ({detail}); write it with "
            f"`weightship manifest {uri}`",
        )
        return None
    if model.manifest_digest is not None and model.manifest_digest != manifest.digest:
        invalid(
            ctx,
            "ManifestDigestMismatch",
            f"manifest at {uri} has digest {manifest.digest} but spec.model.manifestDigest "
            f"pins {model.manifest_digest}; re-run `weightship manifest {uri}` or update "
            "the pin",
        )
        return None
    template = spec_template(ctx)
    if template is None:
        ref = ctx.spec.workload_ref
        name = ref.name if ref is not None else "?"
        invalid(ctx, "WorkloadNotFound", f"Deployment {name} named by spec.workloadRef not found")
        return None
    return RevisionStatus(
        revision=model.revision,
        manifest_digest=manifest.digest,
        pod_template_hash=revision_hash(
            template,
            model_uri=uri,
            model_revision=model.revision,
            manifest_digest=manifest.digest,
        ),
        template_hash=template_hash(template),
    )


def invalid(ctx: RolloutContext, reason: str, message: str) -> None:
    ctx.invalid = True
    events = mark_invalid(ctx.status, ctx.generation, reason, message, ctx.now)
    if events:
        ctx.events += events
        ctx.notify("Failed", reason, message)
    ctx.timers.append(INVALID_SPEC_RETRY_SECONDS)


def mark_invalid(
    status: ModelRolloutStatus, generation: int, reason: str, message: str, now: datetime
) -> list[Event]:
    previous = status.condition("InvalidSpec")
    status.observed_generation = generation
    status.phase = "Degraded"
    status.message = message
    status.conditions = set_condition(
        status.conditions, "InvalidSpec", "True", reason, message, now=now, generation=generation
    )
    status.conditions = set_condition(
        status.conditions,
        "Progressing",
        "False",
        "InvalidSpec",
        message,
        now=now,
        generation=generation,
    )
    if previous is not None and previous.status == "True" and previous.message == message:
        return []
    return [Event("Warning", "InvalidSpec", message)]
