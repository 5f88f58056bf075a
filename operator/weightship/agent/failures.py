"""Why a stage failed, as the WeightCache reports it (``status.manifests[].failure``). Pure.

The reason tells the operator what the failure means for the rollout: OriginMismatch,
ManifestInvalid and ManifestChanged are deterministic (the origin's bytes or manifest are
wrong for every node, so retrying cannot help, and the operator aborts once two nodes
agree); DiskFull is this node's own problem; SourceUnavailable (S3 errors, timeouts,
credentials) and StageError may pass with a retry. A peer's bad bytes are never a
failure: the peer is demoted and the chunk fetched elsewhere (data/fetcher.py).
"""

from __future__ import annotations

import errno
from datetime import datetime

from botocore.exceptions import BotoCoreError, ClientError

from weightship.api.weightcache import FailureReason, StagingFailure
from weightship.data.chunkstore import InsufficientSpaceError
from weightship.data.fetcher import OriginMismatchError
from weightship.data.modelstaging import ChunkIncompleteError
from weightship.data.peer import PeerError

MAX_FILE = 1024  # the CRD's bound on failure.file
_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# S3 errors after the retries, timeouts, short reads, peers gone: may pass.
_TRANSIENT = (
    BotoCoreError,
    ClientError,
    ConnectionError,
    TimeoutError,
    ChunkIncompleteError,
    PeerError,
)


class StageError(RuntimeError):
    """Staging cannot proceed; the message is what lastError shows, the reason what
    failure.reason shows."""

    def __init__(self, message: str, reason: FailureReason = "StageError") -> None:
        super().__init__(message)
        self.reason: FailureReason = reason


def classify(
    exc: BaseException, now: datetime, previous: StagingFailure | None = None
) -> StagingFailure:
    """The failure ``exc`` means; ``since`` carries over from ``previous`` when it is the
    same failure again (same reason, file and chunk)."""
    failure = _classify(exc)
    same = previous is not None and _key(previous) == _key(failure)
    return failure.model_copy(update={"since": previous.since if same and previous else now})


def _key(f: StagingFailure) -> tuple[str, str | None, int | None]:
    return f.reason, f.file, f.chunk


def _classify(exc: BaseException) -> StagingFailure:
    if isinstance(exc, OriginMismatchError):
        return StagingFailure(
            reason="OriginMismatch", file=exc.file[:MAX_FILE], chunk=exc.index, offset=exc.offset
        )
    if isinstance(exc, InsufficientSpaceError):
        return StagingFailure(
            reason="DiskFull", bytes_needed=exc.needed, bytes_available=exc.available
        )
    if isinstance(exc, OSError) and exc.errno in _DISK_ERRNOS:
        return StagingFailure(reason="DiskFull")
    if isinstance(exc, StageError):
        return StagingFailure(reason=exc.reason)
    if isinstance(exc, _TRANSIENT):
        return StagingFailure(reason="SourceUnavailable")
    return StagingFailure(reason="StageError")
