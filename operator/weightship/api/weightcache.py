"""WeightCache: one per node, written by that node's agent; the operator only reads it."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AwareDatetime, Field

from weightship.api.base import (
    MAX_NAME,
    MAX_NAMESPACED_NAME,
    MAX_SHORT_TEXT,
    SHA256_DIGEST_PATTERN,
    ApiModel,
)

# A node rarely holds more than a few models, and one model is rarely pinned by more than
# a few rollouts; past these the agent reports the rest as counts (agent.status).
MAX_CACHED_MANIFESTS = 64
MAX_PINS = 8
CacheState = Literal["Staging", "Staged", "Failed", "Evicting"]
# Why a stage failed. OriginMismatch, ManifestInvalid and ManifestChanged are
# deterministic (every node reading the same objects fails the same way: the operator
# aborts the rollout once two nodes say so); DiskFull is this node's own problem;
# SourceUnavailable (S3 errors, timeouts, credentials) and StageError may pass.
FailureReason = Literal[
    "OriginMismatch",
    "ManifestInvalid",
    "ManifestChanged",
    "DiskFull",
    "SourceUnavailable",
    "StageError",
]


class WeightCacheSpec(ApiModel):
    """Which node this cache describes."""

    node_name: str = Field(description="Name of the node.", min_length=1, max_length=MAX_NAME)


class StagingFailure(ApiModel):
    """Why the last stage of a manifest failed, machine-readable."""

    reason: FailureReason = Field(
        description="OriginMismatch, ManifestInvalid, ManifestChanged, DiskFull, "
        "SourceUnavailable or StageError."
    )
    file: str | None = Field(
        None, description="The model file whose chunk failed (OriginMismatch).", max_length=1024
    )
    chunk: int | None = Field(None, description="The chunk's index in its file.", ge=0)
    offset: int | None = Field(None, description="The chunk's offset in its file.", ge=0)
    bytes_needed: int | None = Field(None, description="Bytes the stage needs (DiskFull).", ge=0)
    bytes_available: int | None = Field(
        None, description="Bytes the cache could make available (DiskFull).", ge=0
    )
    since: AwareDatetime | None = Field(
        None, description="When this node first failed this way, in a row of attempts."
    )


class CachedManifest(ApiModel):
    """One manifest's weights in the node cache."""

    digest: str = Field(
        description="sha256 of the manifest.", pattern=SHA256_DIGEST_PATTERN, max_length=71
    )
    state: CacheState = Field(description="Staging, Staged, Failed or Evicting.")
    bytes_done: int = Field(0, description="Bytes staged and verified.", ge=0)
    bytes_total: int = Field(0, description="Bytes in the manifest.", ge=0)
    bytes_from_peers: int = Field(0, description="Bytes fetched from peer nodes.", ge=0)
    bytes_from_origin: int = Field(0, description="Bytes fetched from the origin (S3).", ge=0)
    started_at: AwareDatetime | None = Field(None, description="When staging started.")
    completed_at: AwareDatetime | None = Field(None, description="When staging finished.")
    last_error: str | None = Field(
        None, description="Last staging error.", max_length=MAX_SHORT_TEXT
    )
    failure: StagingFailure | None = Field(
        None, description="Why the last stage failed; kept while a retry runs."
    )
    pinned_by: list[Annotated[str, Field(max_length=MAX_NAMESPACED_NAME)]] = Field(
        default_factory=list,
        description=f"Rollouts (namespace/name) that pin it: never evicted while pinned. "
        f"The first {MAX_PINS} by name; pinnedByOmitted counts the others.",
        max_length=MAX_PINS,
        json_schema_extra={"x-kubernetes-list-type": "set"},
    )
    pinned_by_omitted: int | None = Field(
        None, description="Rollouts that pin it beyond those pinnedBy lists (unset: none).", ge=1
    )


class WeightCacheStatus(ApiModel):
    """Cache state reported by the node agent."""

    peer_endpoint: str | None = Field(
        None, description="host:port where peers fetch chunks from this node.", max_length=253
    )
    capacity_bytes: int = Field(0, description="Size of the cache volume.", ge=0)
    free_bytes: int = Field(0, description="Free bytes on the cache volume.", ge=0)
    staged_manifests: int = Field(0, description="Manifests in state Staged.", ge=0)
    updated_at: AwareDatetime | None = Field(None, description="Last report from the agent.")
    manifests: list[CachedManifest] = Field(
        default_factory=list,
        description=f"Manifests in the cache: up to {MAX_CACHED_MANIFESTS}, live work "
        "first (Staging, Evicting, Failed, then Staged; pinned before unpinned).",
        max_length=MAX_CACHED_MANIFESTS,
        json_schema_extra={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["digest"],
        },
    )
    manifests_omitted: int | None = Field(
        None,
        description="Manifests in the cache beyond those manifests lists (unset: none).",
        ge=1,
    )
