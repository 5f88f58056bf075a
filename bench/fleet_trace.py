"""Where a fleet round's time went, chunk by chunk: reads the per-node traces that
`WSBENCH_TRACE=1 bench/bench_fleet.py` leaves in fleet-run/nI.json (the last round run).

    WSBENCH_TRACE=1 sudo .venv/bin/python bench/bench_fleet.py --modes p2p --rounds 1
    .venv/bin/python bench/fleet_trace.py

It prints when the origin's last chunk and the fleet's last node were done, each node's
last three transfers (the tail: which chunk, from whom, and when its owner had it), and
the peer transfers by kind: from the node that fetched the chunk from the origin while it
landed there (cut-through) or after, from another node still receiving it (a relay) or
holding it whole.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from benchlib import WORK

Event = tuple[str, str, str, str, float, float]  # node, kind, chunk, peer, start, end


def load(run_dir: Path) -> tuple[list[Event], dict[str, float]]:
    events: list[Event] = []
    done: dict[str, float] = {}
    for path in sorted(run_dir.glob("n*.json")):
        if path.name.endswith(".verified.json"):
            continue
        doc: dict[str, Any] = json.loads(path.read_text())
        node = doc["node"]
        done[node] = doc["seconds"]
        events += [(node, *e) for e in doc.get("trace") or []]
    return events, done


def kind_of(event: Event, origin: dict[str, Event], landed: dict[tuple[str, str], float]) -> str:
    _, _, chunk, peer, start, _ = event
    fetched = origin.get(chunk)
    if fetched is not None and peer == fetched[0]:
        return "origin fetcher, landing" if start < fetched[5] else "origin fetcher, whole"
    return "relay" if start < landed.get((peer, chunk), float("inf")) else "holder, whole"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", type=Path, default=WORK / "fleet-run")
    args = p.parse_args()
    events, done = load(args.run_dir)
    if not events:
        raise SystemExit(f"no trace in {args.run_dir}: run bench_fleet.py with WSBENCH_TRACE=1")
    origin = {e[2]: e for e in events if e[1] == "origin"}
    landed = {(e[0], e[2]): e[5] for e in events if e[1] in ("origin", "peer")}
    print(
        f"origin's last chunk done at {max(e[5] for e in origin.values()):.2f} s, "
        f"the fleet at {max(done.values()):.2f} s"
    )
    for node in sorted(done):
        tail = sorted(
            (e for e in events if e[0] == node and e[1] != "peer-miss"), key=lambda e: e[5]
        )
        shown = [
            f"{e[2]} from {e[3] or 'origin'} {e[4]:.1f}-{e[5]:.1f}"
            + (f" (at {origin[e[2]][0]} {origin[e[2]][5]:.1f})" if e[3] and e[2] in origin else "")
            for e in tail[-3:]
        ]
        print(f"{node} done {done[node]:.2f} s: " + "; ".join(shown))
    by_kind: dict[str, list[float]] = defaultdict(list)
    for e in events:
        if e[1] == "peer":
            by_kind[kind_of(e, origin, landed)].append(e[5] - e[4])
    print("\n| peer transfers | count | median s | over 3 s |\n|---|---|---|---|")
    for kind, seconds in sorted(by_kind.items()):
        over = sum(s > 3 for s in seconds)
        print(f"| {kind} | {len(seconds)} | {statistics.median(seconds):.2f} | {over} |")
    misses = [e[5] - e[4] for e in events if e[1] == "peer-miss"]
    print(
        f"\nasked and not sent (404, 503, a stream cut short): {len(misses)}, {sum(misses):.1f} s"
    )


if __name__ == "__main__":
    main()
