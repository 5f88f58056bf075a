"""In-place weight swaps, the vLLM plugin's own parts (no vLLM, no HTTP framework and no
torch in them): whether this vLLM server can swap at all, and the per-rank outcome files
through which the workers answer the API server. The request, the state and the reasons
are the contract's (``weightship.api.inference``); what the vLLM plugin shares with the
SGLang adapter is ``weightship.integrations.serving``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from weightship.api.inference import FailureReason


def not_swappable(engine_client: Any, args: Any) -> str | None:
    """Why this vLLM server cannot swap in place, or None (``engine_client`` is vLLM's,
    ``args`` its parsed command line)."""
    config = getattr(engine_client, "vllm_config", None)
    if config is None:
        return "this server has no engine"
    transfer = getattr(config, "weight_transfer_config", None)
    if transfer is None or getattr(transfer, "backend", None) != "weightship":
        return 'vLLM runs without --weight-transfer-config \'{"backend": "weightship"}\''
    if getattr(config.load_config, "load_format", None) != "weightship":
        return "vLLM did not load its weights with --load-format weightship"
    if config.parallel_config.data_parallel_size > 1:
        return "in-place swaps support one engine (data parallel size 1)"
    if (getattr(args, "api_server_count", None) or 1) > 1:
        return "in-place swaps support one API server process (--api-server-count 1)"
    return None


# -- the workers' answers ------------------------------------------------------------------

OUTCOME_GLOB = "swap-rank-*.json"
MAX_OUTCOME_BYTES = 64 * 1024
OutcomeOp = Literal["stage", "apply", "commit", "discard", "poison"]


@dataclass(frozen=True)
class RankOutcome:
    """What one worker did with one step of one swap (``swap-rank-<rank>.json``)."""

    swap_id: str
    op: str
    rank: int
    ok: bool
    reason: str | None = None
    message: str | None = None
    seconds: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "swapId": self.swap_id,
            "op": self.op,
            "rank": self.rank,
            "ok": self.ok,
            "reason": self.reason,
            "message": self.message,
            "seconds": self.seconds,
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> RankOutcome:
        rank, seconds = doc.get("rank"), doc.get("seconds")
        if not isinstance(rank, int) or not isinstance(doc.get("ok"), bool):
            raise ValueError("an outcome needs an int rank and a bool ok")
        return cls(
            swap_id=str(doc.get("swapId")),
            op=str(doc.get("op")),
            rank=rank,
            ok=bool(doc["ok"]),
            reason=_opt(doc.get("reason")),
            message=_opt(doc.get("message")),
            seconds=float(seconds) if isinstance(seconds, int | float) else None,
        )


def _opt(value: object) -> str | None:
    return str(value) if value not in (None, "") else None


def outcome_path(run_dir: Path, rank: int) -> Path:
    return run_dir / f"swap-rank-{rank}.json"


def write_outcome(run_dir: Path, outcome: RankOutcome) -> None:
    """Atomically (write, then rename), as the rank reports are."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = outcome_path(run_dir, outcome.rank)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(outcome.to_json(), sort_keys=True))
    tmp.replace(path)


def read_outcomes(run_dir: Path, swap_id: str, op: str, world: int) -> list[RankOutcome]:
    """Every rank's answer to ``op`` of swap ``swap_id``; a rank that wrote none (or an
    older one) answers as failed, so silence is never taken for success."""
    out = []
    for rank in range(world):
        try:
            with open(outcome_path(run_dir, rank), "rb") as f:
                got = RankOutcome.from_json(json.loads(f.read(MAX_OUTCOME_BYTES)))
        except (OSError, ValueError, TypeError) as exc:
            got = RankOutcome(
                swap_id, op, rank, False, FailureReason.ENGINE_ERROR, f"no answer: {exc}"
            )
        if got.swap_id != swap_id or got.op != op or got.rank != rank:
            got = RankOutcome(
                swap_id, op, rank, False, FailureReason.ENGINE_ERROR, f"no answer to {op}"
            )
        out.append(got)
    return out


def first_failure(outcomes: list[RankOutcome]) -> RankOutcome | None:
    """The lowest rank that failed, preferring a rank's own failure over one that only
    says it did not answer."""
    failed = [o for o in outcomes if not o.ok]
    own = [o for o in failed if o.reason != FailureReason.ENGINE_ERROR]
    candidates = own or failed
    return candidates[0] if candidates else None


def ranked(outcome: RankOutcome) -> str:
    """``rank <r>: <message>``, as /weightship/v1/loaded names a failed rank."""
    return f"rank {outcome.rank}: {outcome.message or outcome.reason or 'failed'}"
