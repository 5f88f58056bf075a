"""The inference server's answer on GET /weightship/v1/loaded: what it loaded (pure).

Kept apart from core.verification, which needs the API models: servers and the vLLM plugin
import this module alone (the stdlib only).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

LoadState = Literal["Loading", "Loaded", "Failed"]
# "swap": swapped in place into a running server, from the node cache (every byte checked).
LoadSource = Literal["cache", "origin", "broadcast", "swap"]


@dataclass(frozen=True)
class LoadReport:
    """The inference server's answer on GET /weightship/v1/loaded: what it loaded.
    Servers build their answer with ``to_json``, the verifier reads it with ``from_json``."""

    state: LoadState
    manifest_digest: str | None = None
    verified: bool = False
    reason: str | None = None
    message: str | None = None
    source: LoadSource | None = None
    seeded_from: str | None = None
    load_seconds: float | None = None

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> LoadReport:
        state = doc.get("state")
        if state not in ("Loading", "Loaded", "Failed"):
            raise ValueError(f"state must be Loading, Loaded or Failed, got {state!r}")
        source = doc.get("source")
        seconds = doc.get("loadSeconds")
        return cls(
            state=state,
            manifest_digest=_opt_str(doc.get("manifestDigest")),
            verified=doc.get("verified") is True,
            reason=_opt_str(doc.get("reason")),
            message=_opt_str(doc.get("message")),
            source=source if source in ("cache", "origin", "broadcast", "swap") else None,
            seeded_from=_opt_str(doc.get("seededFrom")),
            load_seconds=float(seconds) if isinstance(seconds, int | float) else None,
        )

    def to_json(self) -> dict[str, Any]:
        """The document the inference server answers (the inverse of ``from_json``)."""
        return {
            "manifestDigest": self.manifest_digest,
            "verified": self.verified,
            "state": self.state,
            "reason": self.reason,
            "message": self.message,
            "source": self.source,
            "seededFrom": self.seeded_from,
            "loadSeconds": self.load_seconds,
        }


# A server that refuses its weights may exit (vLLM does) rather than stay up to say why:
# it writes this document as its container's termination message, which the kubelet
# puts in the pod's status, where the verifier reads it.
TERMINATION_KEY = "weightshipLoadReport"


def termination_message(report: LoadReport) -> str:
    return json.dumps({TERMINATION_KEY: report.to_json()}, sort_keys=True)


def report_from_termination(message: str | None) -> LoadReport | None:
    """The failed load a container reported on its way out, if it reported one."""
    if not message or TERMINATION_KEY not in message:
        return None
    for line in reversed(message.splitlines()):
        try:
            report = LoadReport.from_json(json.loads(line)[TERMINATION_KEY])
        except (ValueError, KeyError, TypeError):
            continue
        return report if report.state == "Failed" else None
    return None


def _opt_str(value: object) -> str | None:
    return str(value) if value not in (None, "") else None
