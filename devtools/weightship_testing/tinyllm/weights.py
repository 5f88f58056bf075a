"""Obtaining verified weights at startup: from the node cache, else staged from S3.

``obtain_weights`` is the one place that decides where weights come from. Broadcast
seeding (weightship.seeding: receive from an already-loaded, verified replica) slots in
at the top of it, before the node cache, returning source "broadcast" and the peer.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from prometheus_client import CollectorRegistry

from weightship.api.inference import FailureReason
from weightship.data.chunkstore import ChunkStore
from weightship.data.metrics import DataPlaneMetrics
from weightship.data.s3 import S3Location, S3Origin, make_client
from weightship.data.stage import stage
from weightship.loader.load import WeightsVerificationError, load_model, locate_staged
from weightship.seeding.errors import SeedingError
from weightship.weightformat.cachedir import MANIFEST_FILE
from weightship.weightformat.chunkhash import ChunkVerificationError
from weightship.weightformat.manifest import Manifest
from weightship_testing.tinyllm.build import CONFIG_NAME
from weightship_testing.tinyllm.model import ModelConfig
from weightship_testing.tinyllm.settings import Settings

Source = Literal["cache", "origin", "broadcast"]
log = logging.getLogger("tinyllm")


class LoadFailure(Exception):
    """Weights that must not be served, with the reason the server reports."""

    def __init__(self, reason: FailureReason, message: str, digest: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.digest = digest


@dataclass(frozen=True)
class Obtained:
    tensors: dict[str, torch.Tensor]
    config: ModelConfig
    manifest: Manifest
    source: Source
    seeded_from: str | None
    verified: bool
    seconds: float


def obtain_weights(settings: Settings) -> Obtained:
    """Verified weights of the manifest the rollout wants, or LoadFailure."""
    started = time.monotonic()
    staged = _staged_files(settings)
    manifest = _find_manifest(settings, staged)
    if settings.seed is not None:
        received = _receive(settings, manifest, staged, started)
        if received is not None:
            return received
    try:
        source: Source = "cache"
        if staged is None:
            staged, source = _stage_from_origin(settings, manifest), "origin"
        loaded = load_model(staged, manifest, device=settings.device)
        config = _config(loaded.files, manifest)
    except (ChunkVerificationError, WeightsVerificationError) as exc:
        raise LoadFailure(FailureReason.CHECKSUM_MISMATCH, str(exc), manifest.digest) from exc
    except LoadFailure:
        raise
    except Exception as exc:
        raise LoadFailure(
            FailureReason.LOAD_ERROR, f"{type(exc).__name__}: {exc}", manifest.digest
        ) from exc
    return Obtained(
        tensors=loaded.tensors,
        config=config,
        manifest=manifest,
        source=source,
        seeded_from=None,
        verified=loaded.verified,
        seconds=time.monotonic() - started,
    )


def _receive(
    settings: Settings, manifest: Manifest, staged: Path | None, started: float
) -> Obtained | None:
    """Weights by broadcast from a verified replica (weightship.seeding), or None to load
    from the node cache instead. Bytes that fail their checksums on the way are never
    served, and never replaced by the cache's copy: something is badly wrong."""
    assert settings.seed is not None
    try:
        received = settings.seed.receive(manifest, device=settings.device)
    except SeedingError as exc:
        if not exc.fall_back:
            raise LoadFailure(
                FailureReason.BROADCAST_CHECKSUM_MISMATCH, exc.message, manifest.digest
            ) from exc
        log.warning("broadcast seeding failed (%s); loading from the node cache", exc)
        return None
    config = ModelConfig.from_json(_verified_file(settings, manifest, staged, CONFIG_NAME))
    return Obtained(
        tensors=received.tensors,
        config=config,
        manifest=manifest,
        source="broadcast",
        seeded_from=received.seeded_from,
        verified=True,
        seconds=time.monotonic() - started,
    )


def _verified_file(settings: Settings, manifest: Manifest, staged: Path | None, name: str) -> bytes:
    """A small non-tensor file (config.json), from the cache or S3, checked by sha256."""
    entry = next((f for f in manifest.files if f.path == name), None)
    if entry is None:
        raise LoadFailure(
            FailureReason.LOAD_ERROR, f"the manifest lists no {name}", manifest.digest
        )
    data = (
        (staged / name).read_bytes() if staged is not None else _origin(settings).read_bytes(name)
    )
    if hashlib.sha256(data).hexdigest() != entry.sha256:
        raise LoadFailure(
            FailureReason.CHECKSUM_MISMATCH, f"{name} does not match the manifest", manifest.digest
        )
    return data


def _staged_files(settings: Settings) -> Path | None:
    """The wanted model's files in the node cache, if staged there (read only)."""
    if settings.cache_dir is None or settings.manifest_digest is None:
        return None
    return locate_staged(settings.cache_dir, settings.manifest_digest)


def _origin(settings: Settings) -> S3Origin:
    if not settings.model_uri:
        raise LoadFailure(
            FailureReason.LOAD_ERROR, "the model is not in the node cache and no S3 URI is set"
        )
    return S3Origin(make_client(settings.s3), S3Location.parse(settings.model_uri))


def _find_manifest(settings: Settings, staged: Path | None) -> Manifest:
    try:
        if staged is not None:
            path = staged.parent / MANIFEST_FILE
            manifest = Manifest.parse(path.read_bytes(), source=str(path))
        else:
            manifest = _origin(settings).read_manifest()
    except LoadFailure:
        raise
    except Exception as exc:
        raise LoadFailure(FailureReason.LOAD_ERROR, f"cannot read the manifest: {exc}") from exc
    want = settings.manifest_digest
    if want is not None and manifest.digest != want:
        where = staged.parent if staged else settings.model_uri
        raise LoadFailure(
            FailureReason.MANIFEST_MISMATCH,
            f"the manifest at {where} is {manifest.digest}, the rollout wants {want}",
            manifest.digest,
        )
    return manifest


def _stage_from_origin(settings: Settings, manifest: Manifest) -> Path:
    """Stage into SCRATCH_DIR with the data plane's verified path (chunk by chunk)."""
    store = ChunkStore(settings.scratch_dir / "weights")
    result = stage(
        manifest,
        store,
        _origin(settings),
        [],
        node=settings.node,
        metrics=DataPlaneMetrics.create(CollectorRegistry()),
    )
    return result.path


def _config(files: Mapping[str, bytes], manifest: Manifest) -> ModelConfig:
    """config.json, verified by the loader along with the weights."""
    if CONFIG_NAME not in files:
        raise LoadFailure(
            FailureReason.LOAD_ERROR, f"the manifest lists no {CONFIG_NAME}", manifest.digest
        )
    return ModelConfig.from_json(files[CONFIG_NAME])
