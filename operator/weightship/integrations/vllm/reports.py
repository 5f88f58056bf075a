"""What each vLLM rank loaded, and the one document GET /weightship/v1/loaded answers.

Every worker (one per tensor/pipeline-parallel rank) writes its own report into the
server's run directory; the API server's endpoint merges them. The document says Loaded
only once every rank has reported Loaded with the same manifest digest. Pure apart from
the small file reads and writes here (no vLLM, no torch).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weightship.api.inference import FailureReason, LoadReport

REPORT_GLOB = "rank-*.json"
MAX_REPORT_BYTES = 64 * 1024


@dataclass(frozen=True)
class RankReport:
    rank: int
    world_size: int
    report: LoadReport

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "worldSize": self.world_size, **self.report.to_json()}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> RankReport:
        rank, world = doc.get("rank"), doc.get("worldSize")
        if not isinstance(rank, int) or not isinstance(world, int) or not 0 <= rank < world:
            raise ValueError(f"bad rank {rank!r} of {world!r}")
        return cls(rank, world, LoadReport.from_json(doc))


def write_rank_report(run_dir: Path, rank: RankReport) -> None:
    """Atomically (write, then rename), so the endpoint never reads half a report."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / f"rank-{rank.rank}.json"
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(rank.to_json(), sort_keys=True))
    tmp.replace(path)


def read_rank_reports(run_dir: Path) -> list[RankReport]:
    """The reports there now; unreadable ones are skipped (they are rewritten whole)."""
    out = []
    for path in sorted(run_dir.glob(REPORT_GLOB)):
        try:
            with open(path, "rb") as f:
                out.append(RankReport.from_json(json.loads(f.read(MAX_REPORT_BYTES))))
        except (OSError, ValueError, TypeError):
            continue
    return out


def merge(reports: Sequence[RankReport]) -> LoadReport:
    """One report for the whole server: Failed if any rank failed, Loaded only when every
    rank of the world loaded and verified the same digest, else Loading."""
    if not reports:
        return LoadReport(state="Loading", message="vLLM is loading the weights")
    failed = next((r for r in sorted(reports, key=_rank) if r.report.state == "Failed"), None)
    if failed is not None:
        return LoadReport(
            state="Failed",
            manifest_digest=failed.report.manifest_digest,
            reason=failed.report.reason or FailureReason.LOAD_FAILED,
            message=_named(failed),
        )
    worlds = {r.world_size for r in reports}
    if len(worlds) != 1:
        return LoadReport(state="Loading", message=f"ranks disagree on the world size {worlds}")
    world = worlds.pop()
    loaded = {r.rank: r.report for r in reports if r.report.state == "Loaded"}
    first = reports[0].report
    if len(loaded) < world:
        return LoadReport(
            state="Loading",
            manifest_digest=first.manifest_digest,
            message=f"{len(loaded)}/{world} ranks loaded",
        )
    digests = {r.manifest_digest for r in loaded.values()}
    if len(digests) != 1:
        return LoadReport(
            state="Failed",
            reason=FailureReason.RANKS_DISAGREE,
            message=f"ranks loaded different weights: {sorted(map(str, digests))}",
        )
    lead = loaded[0]
    sources = {r.source for r in loaded.values()}
    seconds = [r.load_seconds for r in loaded.values() if r.load_seconds is not None]
    return LoadReport(
        state="Loaded",
        manifest_digest=lead.manifest_digest,
        verified=all(r.verified for r in loaded.values()),
        source=lead.source if len(sources) == 1 else None,
        seeded_from=lead.seeded_from,
        load_seconds=max(seconds) if seconds else None,
        message=lead.message if world == 1 else f"{world} ranks: {lead.message or 'loaded'}",
    )


def _rank(r: RankReport) -> int:
    return r.rank


def _named(failed: RankReport) -> str:
    """``rank <r>: <message>``; a message that already names the rank it comes from (every
    rank reports a swap that left mixed weights as the failing rank's) is kept as it is."""
    message = failed.report.message or "failed to load"
    return message if _RANK_PREFIX.match(message) else f"rank {failed.rank}: {message}"


_RANK_PREFIX = re.compile(r"^rank \d+: ")
