"""Where a staged model lies in the node cache: what the agent writes
(``data.chunkstore``, which documents the whole layout) and what inference pods read
(``loader.load.locate_staged``) without opening a ChunkStore.

    <cache root>/models/<manifest digest hex>/files/<path>   the model's files
    <cache root>/models/<manifest digest hex>/STAGED         written last, by rename
"""

from __future__ import annotations

from pathlib import Path

from weightship.weightformat.manifest import digest_hex

MODELS_DIR = "models"
FILES_DIR = "files"
STAGED_MARKER = "STAGED"


def model_dir(cache_root: Path, digest: str) -> Path:
    """The folder of the model with manifest ``digest`` ('sha256:<hex>' or '<hex>')."""
    return cache_root / MODELS_DIR / digest_hex(digest)
