"""Before SGLang reads a model from the node cache: every chunk of every file checked
against the manifest, with the loader's own code (``weightship.loader.load``).

SGLang reads the folder itself (``update_weights_from_disk(model_path=...)`` or
``--model-path``): it loads every ``*.safetensors`` it finds there. So the folder must
hold the manifest's files and nothing else, and every chunk of each must match. The files
are read one at a time (``load_model(..., paths=[file])``), so host memory holds one file
at most, and dropped once checked.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from weightship.api.inference import FailureReason
from weightship.weightformat.cachedir import MANIFEST_FILE
from weightship.weightformat.manifest import Manifest, ManifestError


class VerifyFailure(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message[:1000]


@dataclass(frozen=True)
class VerifiedModel:
    """A staged model whose every chunk matched its manifest, just now."""

    digest: str
    files: Path  # the folder SGLang is given
    manifest: Manifest
    file_count: int
    bytes: int
    seconds: float
    algorithm: str  # the chunk hash: blake3 (manifest v2) or sha256 (v1)


def staged_manifest(cache_dir: Path | None, digest: str) -> tuple[Path, Manifest]:
    """The staged folder of ``digest`` and its manifest, trusted only once its digest is
    ``digest``."""
    from weightship.loader.load import locate_staged

    if cache_dir is None:
        raise VerifyFailure(FailureReason.NOT_STAGED, "WEIGHTSHIP_CACHE_DIR is not set")
    files = locate_staged(cache_dir, digest)
    if files is None:
        raise VerifyFailure(FailureReason.NOT_STAGED, f"{digest} is not staged in {cache_dir}")
    try:
        manifest = Manifest.parse((files.parent / MANIFEST_FILE).read_bytes())
    except (OSError, ManifestError) as exc:
        raise VerifyFailure(
            FailureReason.MANIFEST_MISMATCH, f"cannot read the manifest of {digest}: {exc}"
        ) from None
    if manifest.digest != digest:
        raise VerifyFailure(
            FailureReason.MANIFEST_MISMATCH, f"the manifest staged as {digest} is {manifest.digest}"
        )
    return files, manifest


def verify_staged(cache_dir: Path | None, digest: str, *, workers: int = 4) -> VerifiedModel:
    """Check every chunk of the staged ``digest``; VerifyFailure names what did not match."""
    from weightship.loader.load import LoaderError, WeightsVerificationError, load_model

    started = time.perf_counter()
    files, manifest = staged_manifest(cache_dir, digest)
    listed = {f.path for f in manifest.files}
    extra = sorted(
        str(p.relative_to(files))
        for p in files.rglob("*")
        if (p.is_file() or p.is_symlink()) and str(p.relative_to(files)) not in listed
    )
    if extra:
        raise VerifyFailure(
            FailureReason.CHECKSUM_MISMATCH,
            f"{files} holds files its manifest does not list: {', '.join(extra[:5])}",
        )
    total = 0
    for entry in manifest.files:
        try:
            loaded = load_model(
                files, manifest, expected_digest=digest, paths=[entry.path], workers=workers
            )
        except WeightsVerificationError as exc:
            raise VerifyFailure(FailureReason.CHECKSUM_MISMATCH, str(exc)) from None
        except LoaderError as exc:
            raise VerifyFailure(FailureReason.LOAD_ERROR, str(exc)) from None
        total += loaded.bytes
        del loaded
    return VerifiedModel(
        digest=digest,
        files=files,
        manifest=manifest,
        file_count=len(manifest.files),
        bytes=total,
        seconds=time.perf_counter() - started,
        algorithm="blake3" if manifest.version >= 2 else "sha256",
    )


def same_folder(reported: str | None, files: Path) -> bool:
    """Whether the model path SGLang reports is ``files``."""
    if not reported:
        return False
    try:
        return os.path.realpath(reported) == os.path.realpath(files)
    except (OSError, ValueError):
        return False
