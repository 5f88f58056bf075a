"""Why a seeding attempt failed, and what the replica must do about it."""

from __future__ import annotations

from typing import Literal

from weightship.api.inference import FailureReason

# The two the inference-server contract names too: what reaches a pod's load report.
Reason = (
    Literal["RootUnavailable", "Timeout", "RootDied"]
    | Literal[FailureReason.CHECKSUM_MISMATCH, FailureReason.NO_TENSOR_CHECKSUMS]
)


class SeedingError(RuntimeError):
    """Seeding failed. On every reason but ``ChecksumMismatch`` the replica loads from its
    node cache instead. ``ChecksumMismatch`` means bytes were corrupted on the way (or the
    root holds other weights than its manifest says): the replica must not serve what it
    received, and must not turn Ready on it.
    """

    def __init__(self, reason: Reason, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason: Reason = reason
        self.message = message

    @property
    def fall_back(self) -> bool:
        """True when loading from the node cache is the right next step."""
        return self.reason != FailureReason.CHECKSUM_MISMATCH
