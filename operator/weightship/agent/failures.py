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
from dataclasses import dataclass, replace
from datetime import datetime

from botocore.exceptions import BotoCoreError, ClientError

from weightship.api.weightcache import FailureReason, StagingFailure
from weightship.data.chunkstore import InsufficientSpaceError
from weightship.data.fetcher import OriginMismatchError
from weightship.data.modelstaging import ChunkIncompleteError
from weightship.data.peer import PeerError

DETERMINISTIC: frozenset[FailureReason] = frozenset(
    {"OriginMismatch", "ManifestInvalid", "ManifestChanged"}
)
MAX_FILE = 1024  # the CRD's bound on failure.file
_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


class StageError(RuntimeError):
    """Staging cannot proceed; the message is what lastError shows, the reason what
    failure.reason shows."""

    def __init__(self, message: str, reason: FailureReason = "StageError") -> None:
        super().__init__(message)
        self.reason: FailureReason = reason


@dataclass(frozen=True)
class Failure:
    """One node's failed stage of one manifest."""

    reason: FailureReason
    file: str | None = None
    chunk: int | None = None
    offset: int | None = None
    bytes_needed: int | None = None
    bytes_available: int | None = None
    since: datetime | None = None

    def same_as(self, other: Failure | None) -> bool:
        """The same failure again (a retry that failed the same way)."""
        return other is not None and (self.reason, self.file, self.chunk) == (
            other.reason,
            other.file,
            other.chunk,
        )

    def to_api(self) -> StagingFailure:
        return StagingFailure(
            reason=self.reason,
            file=self.file if self.file is None else self.file[:MAX_FILE],
            chunk=self.chunk,
            offset=self.offset,
            bytes_needed=self.bytes_needed,
            bytes_available=self.bytes_available,
            since=self.since,
        )

    @classmethod
    def from_api(cls, f: StagingFailure) -> Failure:
        return cls(f.reason, f.file, f.chunk, f.offset, f.bytes_needed, f.bytes_available, f.since)


def classify(exc: BaseException, now: datetime, previous: Failure | None = None) -> Failure:
    """The failure ``exc`` means; ``since`` carries over from ``previous`` when it is the
    same failure again."""
    failure = _classify(exc)
    since = previous.since if failure.same_as(previous) and previous is not None else None
    return replace(failure, since=since or now)


def _classify(exc: BaseException) -> Failure:
    if isinstance(exc, OriginMismatchError):
        return Failure("OriginMismatch", file=exc.file, chunk=exc.index, offset=exc.offset)
    if isinstance(exc, InsufficientSpaceError):
        return Failure("DiskFull", bytes_needed=exc.needed, bytes_available=exc.available)
    if isinstance(exc, OSError) and exc.errno in _DISK_ERRNOS:
        return Failure("DiskFull")
    if isinstance(exc, StageError):
        return Failure(exc.reason)
    if isinstance(
        exc,
        (
            BotoCoreError,
            ClientError,
            ConnectionError,
            TimeoutError,
            ChunkIncompleteError,
            PeerError,
        ),
    ):
        return Failure("SourceUnavailable")  # S3 errors, timeouts, short reads: may pass
    return Failure("StageError")
