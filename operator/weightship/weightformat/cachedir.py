"""Where a staged model lies in the node cache: what the agent writes
(``data.chunkstore``, which documents the whole layout) and what inference pods read
(``loader.load.locate_staged``) without opening a ChunkStore.

    <cache root>/models/<manifest digest hex>/files/<path>   the model's files
    <cache root>/models/<manifest digest hex>/manifest.json  its manifest
    <cache root>/models/<manifest digest hex>/STAGED         written last, by rename
"""

from __future__ import annotations

import re
from pathlib import Path

from weightship.weightformat.manifest import digest_hex

MODELS_DIR = "models"
FILES_DIR = "files"
MANIFEST_FILE = "manifest.json"  # beside files/
STAGED_MARKER = "STAGED"
MANIFEST_DIGEST = re.compile(r"sha256:([0-9a-f]{64})")
"""A manifest digest as rollouts and pods carry it: the only rollout-derived part of a
host path (the node cache's, a view's), so it is checked to the letter."""


def manifest_digest_hex(digest: object) -> str:
    """The 64 hex characters of ``sha256:<hex>``; ValueError for anything else (a bare hex
    too: a host path is built only from a digest in its one written form)."""
    found = MANIFEST_DIGEST.fullmatch(digest) if isinstance(digest, str) else None
    if found is None:
        raise ValueError(f"not a sha256 manifest digest: {str(digest)[:80]!r}")
    return found.group(1)


def host_model_root(cache_dir: str, digest: str) -> str:
    """``<cacheDir>/models/<hex>`` as a host path (a pod's hostPath volume)."""
    return f"{cache_dir.rstrip('/')}/{MODELS_DIR}/{manifest_digest_hex(digest)}"


def model_dir(cache_root: Path, digest: str) -> Path:
    """The folder of the model with manifest ``digest`` ('sha256:<hex>' or '<hex>')."""
    return cache_root / MODELS_DIR / digest_hex(digest)
