"""Verified weights for vLLM: by broadcast from a verified replica, else from the node cache.

Every byte is checked against the manifest the operator pinned before vLLM sees it: the
node-cache path verifies each chunk's digest, BLAKE3 or sha256 as its manifest says
(weightship.loader), the broadcast path each tensor's checksum (weightship.seeding).
Then ``checked_tensors`` hashes each raw tensor once more as it is handed to
``model.load_weights``, before vLLM fuses or quantizes anything, so what entered vLLM is
what the manifest lists. No vLLM imports.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from weightship.api.inference import FailureReason, LoadSource
from weightship.loader.load import (
    LoadedModel,
    LoaderError,
    WeightsVerificationError,
    load_model,
    locate_staged,
)
from weightship.seeding.errors import SeedingError
from weightship.weightformat.cachedir import MANIFEST_FILE
from weightship.weightformat.checksum import checksum_tensor
from weightship.weightformat.manifest import Manifest, ManifestError

from .settings import PluginSettings

log = logging.getLogger("vllm.weightship")  # under vLLM's own log handlers


class LoadFailure(Exception):
    """Weights vLLM must not serve, with the reason the pod reports."""

    def __init__(self, reason: str, message: str, digest: str | None = None) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason, self.message, self.digest = reason, message, digest


@dataclass
class Obtained:
    tensors: dict[str, torch.Tensor]
    manifest: Manifest
    source: LoadSource
    seeded_from: str | None
    seconds: float
    files: dict[str, bytes] = field(default_factory=dict)


def staged_model(settings: PluginSettings, digest: str | None = None) -> tuple[Path, Manifest]:
    """The files folder in the node cache and the manifest of the pinned model (or of
    ``digest``, a swap's target)."""
    digest = digest or settings.manifest_digest
    if settings.cache_dir is None or digest is None:
        raise LoadFailure(
            FailureReason.NOT_CONFIGURED,
            "WEIGHTSHIP_CACHE_DIR and WEIGHTSHIP_MANIFEST_DIGEST must be set "
            "(the operator sets both on the pods of a ModelRollout)",
        )
    files = locate_staged(settings.cache_dir, digest)
    if files is None:
        raise LoadFailure(
            FailureReason.NOT_STAGED, f"{digest} is not staged in {settings.cache_dir}", digest
        )
    path = files.parent / MANIFEST_FILE
    try:
        manifest = Manifest.parse(path.read_bytes(), source=str(path))
    except (OSError, ManifestError) as exc:
        raise LoadFailure(FailureReason.LOAD_ERROR, f"cannot read the manifest: {exc}") from exc
    if manifest.digest != digest:
        raise LoadFailure(
            FailureReason.MANIFEST_MISMATCH,
            f"the manifest at {path} is {manifest.digest}, the rollout pins {digest}",
            manifest.digest,
        )
    return files, manifest


def check_model_dir(model_dir: Path, files: Path, manifest: Manifest) -> None:
    """vLLM read config and tokenizer from the folder it was given: it must be the pinned
    model's folder, or those files were not the manifest's."""
    if model_dir.resolve() != files.resolve():
        raise LoadFailure(
            FailureReason.MODEL_PATH_MISMATCH,
            f"vLLM serves {model_dir}, but the pinned model is staged at {files}: "
            "pass $(WEIGHTSHIP_MODEL_DIR) as the model",
            manifest.digest,
        )


def obtain(settings: PluginSettings, model_dir: Path, *, broadcast: bool = True) -> Obtained:
    """Verified tensors of the pinned model, or LoadFailure."""
    started = time.monotonic()
    files, manifest = staged_model(settings)
    check_model_dir(model_dir, files, manifest)
    others = [f.path for f in manifest.files if not f.path.endswith(".safetensors")]
    if broadcast and settings.seed is not None:
        try:
            received = settings.seed.receive(manifest, device="cpu")
        except SeedingError as exc:
            if not exc.fall_back:
                raise LoadFailure(
                    FailureReason.BROADCAST_CHECKSUM_MISMATCH, exc.message, manifest.digest
                ) from exc
            log.warning("broadcast seeding failed (%s); loading from the node cache", exc)
        else:
            small = _load(files, manifest, paths=others)  # config, tokenizer: verified too
            return Obtained(
                tensors=received.tensors,
                manifest=manifest,
                source="broadcast",
                seeded_from=received.seeded_from,
                seconds=time.monotonic() - started,
                files=small.files,
            )
    loaded = _load(files, manifest)
    return Obtained(
        tensors=loaded.tensors,
        manifest=manifest,
        source="cache",
        seeded_from=None,
        seconds=time.monotonic() - started,
        files=loaded.files,
    )


def read_verified(files: Path, manifest: Manifest) -> LoadedModel:
    """Every file of a staged model into host memory, every chunk checked (LoadFailure
    ChecksumMismatch or LoadError otherwise)."""
    return _load(files, manifest)


def _load(files: Path, manifest: Manifest, paths: list[str] | None = None) -> LoadedModel:
    try:
        return load_model(files, manifest, expected_digest=manifest.digest, paths=paths)
    except WeightsVerificationError as exc:
        raise LoadFailure(FailureReason.CHECKSUM_MISMATCH, str(exc), manifest.digest) from exc
    except LoaderError as exc:
        raise LoadFailure(FailureReason.LOAD_ERROR, str(exc), manifest.digest) from exc


def checked_tensors(
    tensors: Mapping[str, torch.Tensor], manifest: Manifest
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for ``model.load_weights``, each checked against the manifest's
    checksum as it goes in; a tensor the manifest does not list is refused."""
    entries = {t.name: t for t in manifest.tensors}
    if not entries:
        raise LoadFailure(
            FailureReason.NO_TENSOR_CHECKSUMS,
            "the manifest lists no tensors: rebuild it with `weightship manifest`",
            manifest.digest,
        )
    missing = sorted(set(entries) - set(tensors))
    if missing:
        raise LoadFailure(
            FailureReason.CHECKSUM_MISMATCH, f"tensors missing: {missing[:5]}", manifest.digest
        )
    for name, tensor in tensors.items():
        entry = entries.get(name)
        if entry is None:
            raise LoadFailure(
                FailureReason.CHECKSUM_MISMATCH, f"{name} is not in the manifest", manifest.digest
            )
        got = checksum_tensor(tensor)
        if got != entry.checksum:
            raise LoadFailure(
                FailureReason.CHECKSUM_MISMATCH,
                f"{name}: checksum {got}, the manifest says {entry.checksum}",
                manifest.digest,
            )
        yield name, tensor
