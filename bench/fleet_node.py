"""One node of the fleet benchmark, run inside its network namespace by bench_fleet.py.

It starts its peer server, says it is ready, waits for the common start time, stages the
model, writes its result, keeps serving peers until the run is over, and then checks the
sha256 of every staged file. Files in --run-dir are the only channel to the orchestrator.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import time
import traceback
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from benchlib import settings, verify_files
from weightship.data.chunkstore import ChunkStore
from weightship.data.fetcher import ChunkFetcher, FetchPolicy, Peer
from weightship.data.metrics import DataPlaneMetrics
from weightship.data.peer import (
    WHOLE_UPLOADS,
    ChunkNotOnPeerError,
    PeerBusyError,
    PeerClient,
    PeerServer,
)
from weightship.data.s3 import S3Location, S3Origin, make_client
from weightship.data.stage import PER_OWNER, StageProgress, stage
from weightship.weightformat.manifest import Manifest


class CountingClient(PeerClient):
    """A PeerClient that counts answers, to show how often nodes poll too early."""

    def __init__(self) -> None:
        super().__init__()
        self.counts = {"ok": 0, "not_yet": 0, "busy": 0, "failed": 0}

    def fetch(
        self,
        address: str,
        sha256: str,
        *,
        start: int = 0,
        end: int | None = None,
        wait_s: float = 0.0,
    ) -> bytes:
        try:
            body = super().fetch(address, sha256, start=start, end=end, wait_s=wait_s)
        except ChunkNotOnPeerError:
            self.counts["not_yet"] += 1
            raise
        except PeerBusyError:
            self.counts["busy"] += 1
            raise
        except Exception:
            self.counts["failed"] += 1
            raise
        self.counts["ok"] += 1
        return body


def staged_with_pieces(store: ChunkStore, manifest: Manifest) -> bool:
    """Whether the stage verified pieces as they landed (its piece layer is kept)."""
    return (store.model_dir(manifest.digest) / "pieces").is_file()


def wait_for(path: Path, timeout_s: float) -> str:
    """Poll for ``path`` every 0.1 s: the go file names a start 0.5 s ahead, and the nodes
    that finished wait here for the rest (at 20 ms, 48 of them woke 2,400 times a second
    on the machine the others stage on)."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s}s")
        time.sleep(0.1)
    return path.read_text()


def write_json(path: Path, doc: object) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    tmp.replace(path)


def policy(args: argparse.Namespace) -> FetchPolicy | None:
    """The fetch policy the flags ask for; None: stage()'s default."""
    if not (
        args.no_claims
        or args.no_late_probes
        or args.no_holder_probes
        or args.no_uplink_hold
        or args.no_split
        or args.keep_origin_connections
        or args.relay_fanout is not None
        or args.origin_fetchers is not None
        or args.poll_interval_s is not None
    ):
        return None
    return FetchPolicy(
        **({"poll_interval_s": args.poll_interval_s} if args.poll_interval_s is not None else {}),
        **({"split_after_s": None} if args.no_split else {}),
        **({"relay_fanout": args.relay_fanout} if args.relay_fanout is not None else {}),
        **({"origin_fetchers": args.origin_fetchers} if args.origin_fetchers is not None else {}),
        **({"renew_origin_connections": False} if args.keep_origin_connections else {}),
        **({"claims": False} if args.no_claims else {}),
        **({"late_probes": 0} if args.no_late_probes else {}),
        **({"holder_probes": 0} if args.no_holder_probes else {}),
        **({"uplink_hold_s": 0.0} if args.no_uplink_hold else {}),
    )


def trace_transfers(start_at: float) -> list[tuple[str, str, str, float, float]]:
    """With WSBENCH_TRACE=1: every origin fetch and peer stream of this node, as
    (kind, chunk key, peer, started s, ended s) after the start, for the run's JSON (how a
    round spent its time, chunk by chunk). Wraps the fetcher's methods in this process."""
    events: list[tuple[str, str, str, float, float]] = []
    if os.environ.get("WSBENCH_TRACE") != "1":
        return events
    from_origin = ChunkFetcher._from_origin
    from_peer = ChunkFetcher._stream_from_peer

    def traced_origin(self: ChunkFetcher, chunk: Any) -> None:
        t0 = time.time() - start_at
        try:
            from_origin(self, chunk)
        finally:
            events.append(("origin", chunk.key[-8:], "", t0, time.time() - start_at))

    def traced_peer(self: ChunkFetcher, node: str, chunk: Any, *rest: Any) -> bool:
        t0 = time.time() - start_at
        ok = False
        try:
            ok = from_peer(self, node, chunk, *rest)
            return ok
        finally:
            kind = "peer" if ok else "peer-miss"
            events.append((kind, chunk.key[-8:], node, t0, time.time() - start_at))

    ChunkFetcher._from_origin = traced_origin  # type: ignore[method-assign]
    ChunkFetcher._stream_from_peer = traced_peer  # type: ignore[method-assign]
    return events


def record_relay_stop(store: ChunkStore, start_at: float) -> list[float]:
    """When (seconds from the start) this node stopped relaying, once it has."""
    stopped: list[float] = []
    status = store.relaying
    told = status.parent_held

    def parent_held(held_s: float, staging_s: float) -> bool:
        stops = told(held_s, staging_s)
        if stops:
            stopped.append(time.time() - start_at)
        return stops

    status.parent_held = parent_held  # type: ignore[method-assign]
    return stopped


def run(args: argparse.Namespace, run_dir: Path) -> None:
    manifest = Manifest.parse(Path(args.manifest).read_bytes())
    store = ChunkStore(Path(args.cache))
    client = make_client(settings(args.endpoint, connections=2 * args.workers))
    origin = S3Origin(client, S3Location(args.bucket, args.prefix))
    peers = [Peer(n, a) for n, _, a in (p.partition("=") for p in args.peers.split(",") if p)]
    host, _, port = args.listen.rpartition(":")
    whole_uploads = args.whole_uploads or 32  # 0: only the server's transfer limit (32)
    server = PeerServer(
        store, host, int(port), whole_uploads=whole_uploads, redirect_claimed=not args.no_redirect
    )
    with server:
        (run_dir / f"{args.node}.ready").touch()
        start_at = float(wait_for(run_dir / "go", args.timeout))
        time.sleep(max(0.0, start_at - time.time()))
        trace = trace_transfers(start_at)
        relay_stopped = record_relay_stop(store, start_at)
        client = CountingClient()
        registry = CollectorRegistry()
        last_origin = {"bytes": 0, "at": 0.0}  # when this node's last origin chunk came in
        timeline: list[tuple[float, int, int]] = []  # (s, origin bytes, peer bytes)

        def progress(p: StageProgress) -> None:
            now = time.time() - start_at
            if p.from_origin != last_origin["bytes"]:
                last_origin.update(bytes=p.from_origin, at=now)
            if not timeline or now - timeline[-1][0] >= 0.5 or p.done_bytes == p.total_bytes:
                timeline.append((round(now, 2), p.from_origin, p.from_peers))

        cpu_before, usage_before = time.process_time(), resource.getrusage(resource.RUSAGE_SELF)
        result = stage(
            manifest,
            store,
            origin,
            peers,
            node=args.node,
            metrics=DataPlaneMetrics.create(registry),
            workers=args.workers,
            client=client,
            progress=progress,
            policy=policy(args),
            per_owner=args.per_owner or None,
            origin_requests=args.origin_requests,
            pace_intake=False if args.no_pacing else (True if args.pace else None),
        )
        seconds = time.time() - start_at
        cpu_s = time.process_time() - cpu_before  # every thread of this node, peer server too
        usage = resource.getrusage(resource.RUSAGE_SELF)
        doc = {
            "node": args.node,
            "seconds": seconds,
            "digest": result.digest,
            "staged": store.is_staged(manifest.digest),
            "from_origin": result.from_origin,
            "from_peers": result.from_peers,
            "from_local": result.from_local,
            "origin_done_s": last_origin["at"],
            "peer_answers": client.counts,
            "cpu_s": cpu_s,
            # in the kernel (socket sends run the receiver's TCP too: one host here), and
            # the times a thread blocked (each a wakeup): where the CPU of a change went
            "cpu_sys_s": usage.ru_stime - usage_before.ru_stime,
            "wakeups": usage.ru_nvcsw - usage_before.ru_nvcsw,
            "claimed": registry.get_sample_value("weightship_agent_chunks_claimed_total") or 0,
            "origin_requests": registry.get_sample_value("weightship_agent_origin_requests") or 0,
            "origin_renewals": registry.get_sample_value(
                "weightship_agent_origin_connection_renewals_total"
            )
            or 0,
            "splits": {
                outcome: registry.get_sample_value(
                    "weightship_agent_chunk_splits_total", {"outcome": outcome}
                )
                or 0
                for outcome in ("used", "unused")
            },
            "peer_verification_failures": registry.get_sample_value(
                "weightship_agent_chunk_verification_failures_total", {"source": "peer"}
            )
            or 0,
            "demotions": registry.get_sample_value("weightship_agent_peer_demotions_total") or 0,
            # stopped relaying: its tree parents were ahead of it (slowrelay.py)
            "relay_stops": registry.get_sample_value("weightship_agent_relay_stops_total") or 0,
            "relay_stopped_s": relay_stopped[0] if relay_stopped else None,
            "piece_verified": staged_with_pieces(store, manifest),
            "timeline": timeline,
            "trace": trace,
        }
        write_json(run_dir / f"{args.node}.json", doc)
        wait_for(run_dir / "done", args.timeout)  # keep serving until everyone is staged
    bad = verify_files(store.files_dir(manifest.digest), manifest, threads=1)
    write_json(run_dir / f"{args.node}.verified.json", {"bad_files": bad})


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--node", required=True)
    p.add_argument("--listen", required=True, help="ip:port of this node's peer server")
    p.add_argument("--peers", default="", help="name=ip:port,... (all nodes, this one too)")
    p.add_argument("--endpoint", required=True)
    p.add_argument("--bucket", required=True)
    p.add_argument("--prefix", required=True)
    p.add_argument("--manifest", required=True)
    p.add_argument("--cache", required=True)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--no-claims", action="store_true", help="no tail claims (the baseline)")
    p.add_argument(
        "--per-owner", type=int, default=PER_OWNER, help="peer fetches per owner (0: FIFO lane)"
    )
    p.add_argument(
        "--poll-interval-s", type=float, help="between rounds of asks nobody held (FetchPolicy)"
    )
    p.add_argument("--no-pacing", action="store_true", help="peer intake not paced")
    p.add_argument("--pace", action="store_true", help="peer intake paced, whatever the manifest")
    p.add_argument(
        "--no-late-probes", action="store_true", help="never asks whether it joined late"
    )
    p.add_argument(
        "--no-holder-probes", action="store_true", help="asks the owner first, never a holder"
    )
    p.add_argument(
        "--no-uplink-hold", action="store_true", help="origin intake never waits for the uplink"
    )
    p.add_argument("--no-split", action="store_true", help="a slow whole transfer is never split")
    p.add_argument(
        "--relay-fanout", type=int, help="children per node in each owner's relay tree (1: a ring)"
    )
    p.add_argument("--origin-fetchers", type=int, help="nodes that fetch from the origin, at most")
    p.add_argument(
        "--origin-requests",
        type=int,
        help="origin fetches in flight per fetcher (default: stage's)",
    )
    p.add_argument(
        "--keep-origin-connections",
        action="store_true",
        help="one origin connection for the whole stage, not a new one per chunk",
    )
    p.add_argument(
        "--no-redirect", action="store_true", help="holds requests for chunks a peer claimed"
    )
    p.add_argument(
        "--whole-uploads",
        type=int,
        default=WHOLE_UPLOADS,
        help="whole chunks its peer server sends at once (0: no limit of its own)",
    )
    args = p.parse_args()
    if os.environ.get("WSBENCH_LOG") == "1":  # the data plane's INFO lines in nI.log
        logging.basicConfig(level=logging.INFO, format="%(relativeCreated)d %(message)s")
    run_dir = Path(args.run_dir)
    try:
        run(args, run_dir)
    except BaseException:
        (run_dir / f"{args.node}.error").write_text(traceback.format_exc())
        raise


if __name__ == "__main__":
    main()
