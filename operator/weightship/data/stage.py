"""Stage one model onto this node: plan, check space, fetch chunks into place, mark.

Idempotent and resumable: what the journal and the node's files already hold is never
fetched again, and the model is marked staged only after every file is in place.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weightship.data import schedule
from weightship.data.chunkstore import ChunkStore, InFlight
from weightship.data.fetcher import (
    ChunkFetcher,
    ChunkOrigin,
    FetchCancelledError,
    FetchPolicy,
    Peer,
    Source,
    TokenBucket,
    fetch_order,
)
from weightship.data.lanes import IntakePacer, KeyedLane, OriginReads
from weightship.data.metrics import DataPlaneMetrics
from weightship.data.modelstaging import ModelStaging
from weightship.data.peer import PeerClient
from weightship.errortext import error_text
from weightship.weightformat.chunkhash import PieceLayer
from weightship.weightformat.entries import DIGEST_BYTES, ChunkEntry
from weightship.weightformat.manifest import Manifest, ManifestError

log = logging.getLogger(__name__)

PEER_LANE_MAX = 16  # peer-lane workers at most (PER_OWNER per other owner below that)
PER_OWNER = 2  # peer-lane fetches in flight from one owner (lanes.py says why two)
# An own chunk is not asked of the origin while this many whole chunks are going up to
# peers that fell behind (ChunkStore.uploads), for FetchPolicy.uplink_hold_s at most: the
# node's uplink, not the origin, then holds the fleet back, and the origin's share is
# better spent on owners whose peers keep up (at a fair share of the origin an owner's
# fan-out is (N-1)/N of its uplink, so an owner whose origin flow runs faster than its
# share saturates its uplink: docs/benchmarks.md).
UPLINK_HOLD_UPLOADS = 2
ORIGIN = "origin"  # the origin lane's one key: its tasks run in submission order


class StageCancelledError(RuntimeError):
    """The caller asked the stage to stop; what is verified so far is kept."""


@dataclass(frozen=True)
class StageProgress:
    done_bytes: int
    total_bytes: int
    from_origin: int
    from_peers: int
    from_local: int


@dataclass(frozen=True)
class StageResult(StageProgress):
    digest: str
    path: Path  # the folder holding the model's files
    seconds: float


ProgressCallback = Callable[[StageProgress], None]


class _Tally:
    """Bytes done by source; thread-safe; reports each change to the callback."""

    def __init__(self, total: int, callback: ProgressCallback | None) -> None:
        self.total = total
        self.by_source: dict[Source, int] = {"origin": 0, "peer": 0, "local": 0}
        self._callback = callback
        self._lock = threading.Lock()

    def add(self, source: Source, n: int) -> None:
        with self._lock:
            self.by_source[source] += n
            snapshot = self.snapshot()
        if self._callback:
            self._callback(snapshot)

    def snapshot(self) -> StageProgress:
        s = self.by_source
        return StageProgress(
            done_bytes=sum(s.values()),
            total_bytes=self.total,
            from_origin=s["origin"],
            from_peers=s["peer"],
            from_local=s["local"],
        )


def stage(
    manifest: Manifest,
    store: ChunkStore,
    origin: ChunkOrigin,
    peers: Sequence[Peer],
    *,
    node: str,
    metrics: DataPlaneMetrics,
    pinned: Collection[str] = (),
    policy: FetchPolicy | None = None,
    workers: int = 4,
    per_owner: int | None = PER_OWNER,
    origin_requests: int | None = None,
    pace_intake: bool | None = None,
    bandwidth: TokenBucket | None = None,
    client: PeerClient | None = None,
    progress: ProgressCallback | None = None,
    cancel: threading.Event | None = None,
    holders: Collection[str] = (),
    hash_threads: int = 1,
) -> StageResult:
    """Stage ``manifest`` into ``store``; return where its files are and where bytes came from.

    ``peers`` are the live agents (this node may be among them), ``holders`` those of
    them known to have the whole model staged, ``pinned`` the models that must not be
    evicted to make room. ``origin_requests``: this node's own chunks fetched from the
    origin at once (None: ``schedule.origin_requests``). ``per_owner``: peer fetches in
    flight from one owner at most (None: no limit, a worker per other owner);
    ``pace_intake``: peer fetches keep pace with this node's own origin queue
    (lanes.IntakePacer). Both are on by default; the benchmark turns them off for its
    baseline. ``hash_threads``: BLAKE3 threads for a chunk verified whole (resume,
    dedupe, a manifest without pieces).
    Raises InsufficientSpaceError before fetching anything when the model cannot fit.
    """
    started = time.monotonic()
    tally = _Tally(manifest.total_size, progress)
    with ModelStaging(store, manifest, hash_threads=hash_threads) as staging:
        if not staging.is_staged:
            fetcher = ChunkFetcher(
                node=node,
                peers=peers,
                origin=origin,
                sink=staging,
                metrics=metrics,
                chunks=manifest.chunks,
                policy=policy,
                client=client,
                bandwidth=bandwidth,
                cancel=cancel,
                claims=store.claims,
                relaying=store.relaying,
                holders=holders,
            )
            # Peers may claim this model's chunks while it stages, and only they (claims.py).
            store.claims.open(
                (c.key for c in manifest.chunks), ((p.node, p.address) for p in peers)
            )
            try:
                # After the claims open: until then every claim would be granted.
                staging.pieces = load_piece_layer(staging, origin)
                pace = staging.pieces is None if pace_intake is None else pace_intake
                _stage(staging, fetcher, tally, pinned, workers, per_owner, pace, origin_requests)
            finally:
                store.claims.forget(c.key for c in manifest.chunks)
        else:
            tally.add("local", manifest.total_size)
        store.touch(manifest.digest)
    done = tally.snapshot()
    return StageResult(
        **vars(done),
        digest=manifest.digest,
        path=store.files_dir(manifest.digest),
        seconds=time.monotonic() - started,
    )


def load_piece_layer(staging: ModelStaging, origin: ChunkOrigin) -> PieceLayer | None:
    """The manifest's piece layer, from the model's folder or else from the origin (then
    kept there for a resume); checked against the manifest either way. None when the
    manifest has none, or when it cannot be had: chunks are then verified whole (no
    cut-through), which is as safe, with a warning."""
    manifest = staging.manifest
    path = manifest.piece_layer_path
    if path is None:
        return None
    saved = staging.dir / "pieces"
    with contextlib.suppress(FileNotFoundError, ManifestError):
        return PieceLayer(manifest, saved.read_bytes())
    try:
        pieces = PieceLayer(
            manifest, origin.read_range(path, 0, DIGEST_BYTES * manifest.piece_count)
        )
    except Exception as exc:  # any failure: verify whole chunks instead
        log.warning(
            "staging %s without piece verification (chunks verified whole): %s",
            manifest.digest,
            error_text(exc),
        )
        return None
    tmp = staging.store.temp_path("pieces")
    tmp.write_bytes(pieces.raw)
    tmp.replace(saved)
    return pieces


def hold_for_uplink(
    uploads: InFlight, cancel: threading.Event, *, max_s: float, limit: int = UPLINK_HOLD_UPLOADS
) -> None:
    """Wait, ``max_s`` at most, while ``limit`` or more whole chunks are going up to
    peers (see UPLINK_HOLD_UPLOADS)."""
    deadline = time.monotonic() + max_s
    while uploads.count >= limit and time.monotonic() < deadline and not cancel.is_set():
        cancel.wait(0.02)


def _stage(
    staging: ModelStaging,
    fetcher: ChunkFetcher,
    tally: _Tally,
    pinned: Collection[str],
    workers: int,
    per_owner: int | None,
    pace_intake: bool,
    origin_requests: int | None,
) -> None:
    manifest, store, cancel = staging.manifest, staging.store, fetcher.cancel
    chunks = manifest.chunks
    done = staging.journaled()  # verified on resume; never fetched again
    tally.add("local", sum(chunks[i].size for i in done))

    todo: dict[str, list[int]] = defaultdict(list)  # digest -> chunk indexes needing it
    for i, c in enumerate(chunks):
        if i not in done:
            todo[c.key].append(i)
    store.ensure_space(staging.missing_bytes(), {*pinned, manifest.digest})
    staging.prepare()

    # Chunks this node already holds (another model's, or this one's at another index)
    # are copied locally and verified again; nothing is fetched for them.
    for key, indexes in list(todo.items()):
        data = store.read_chunk(key)
        if data is not None and staging.put(key, data):
            tally.add("local", chunks[indexes[0]].size * len(indexes))
            del todo[key]

    def fetch_one(chunk: ChunkEntry) -> Source:
        if cancel.is_set():
            raise StageCancelledError(f"staging {manifest.digest} cancelled")
        try:
            source = fetcher.fetch(chunk)
        except FetchCancelledError as e:
            raise StageCancelledError(f"staging {manifest.digest} cancelled") from e
        n = len(todo[chunk.key])
        tally.add(source, chunk.size)
        tally.add("local", chunk.size * (n - 1))
        return source

    unique = [chunks[ix[0]] for ix in todo.values()]
    # A node the others did not count (it joined late) takes their view before it plans:
    # then it owns nothing and fetches nothing from the origin that a live peer gets.
    fetcher.join_late([c for c in unique if fetcher.owner_of(c.key) == fetcher.node])
    order = fetch_order(unique, fetcher.node, fetcher.owner_of, lag=workers)
    # Two lanes: the chunks this node owns (from the origin, the stream every other node
    # waits for) never queue behind peer fetches that are waiting for a chunk to land.
    owned = [c for c in order if fetcher.owner_of(c.key) == fetcher.node]
    others = [c for c in order if fetcher.owner_of(c.key) != fetcher.node]
    # The peer lane runs at most PER_OWNER fetches per owner, so the workers waiting on
    # a slow owner never hold up the chunks the others already have (lanes.py).
    other_owners = len({fetcher.owner_of(c.key) for c in others})
    # The origin lane widens where its reads wait for first bytes together (lanes.
    # OriginReads), unless the caller fixed its width or every node fetches (one each).
    few_fetch = len(fetcher.fetchers) < len(fetcher.nodes)
    widens = origin_requests is None and bool(others) and few_fetch
    if origin_requests is None:
        origin_requests = schedule.origin_requests(len(fetcher.nodes), len(fetcher.fetchers))
    origin_workers = max(1, origin_requests if others else workers)
    per_owner_workers = per_owner or 1  # None: a worker per other owner, one FIFO queue
    peer_workers = max(
        1, workers - origin_workers, min(PEER_LANE_MAX, per_owner_workers * other_owners)
    )
    pacer = IntakePacer(
        own_bytes=sum(c.size for c in owned),
        peer_bytes=sum(c.size for c in others),
        # one chunk from every other owner: the intake one own chunk pays for
        slack_bytes=max((c.size for c in others), default=0) * other_owners,
    )
    origin_reads = OriginReads()
    deferred: list[Future[Any]] = []  # claimed chunks' fetches, on the peer lane

    def fetch_own(chunk: ChunkEntry) -> None:
        try:
            if fetcher.claims.claimant(chunk.key):
                # A peer claimed it: it comes from that peer, on the peer lane, so this
                # node's origin stream goes on with its next chunk.
                claimant = fetcher.owner_of(chunk.key)
                deferred.append(peer_lane.submit(claimant, functools.partial(fetch_one, chunk)))
            else:
                hold_for_uplink(store.uploads, cancel, max_s=fetcher.policy.uplink_hold_s)
                if fetch_one(chunk) == "origin" and widens:
                    widen_origin_lane()
        finally:
            pacer.own_progress(chunk.size)

    def widen_origin_lane() -> None:
        if (timing := fetcher.last_origin_read()) is None:
            return
        width = origin_lane.workers
        want = origin_reads.read(*timing, in_flight=width)
        if want > width:
            log.info(
                "origin requests in flight %d -> %d: the last %d origin reads sat waiting "
                "for a first byte, none moving, %.0f%% of the time",
                width,
                want,
                2 * width,
                100 * origin_reads.idle_share(2 * width),
            )
            origin_lane.widen(want)
            fetcher.metrics.origin_requests.set(want)

    def fetch_other(chunk: ChunkEntry) -> None:
        if pace_intake:
            pacer.admit(chunk.size, cancel)
        fetch_one(chunk)

    with (
        KeyedLane(origin_workers, schedule.ORIGIN_REQUESTS_MAX, name="origin") as origin_lane,
        KeyedLane(peer_workers, per_owner or peer_workers, name="peer") as peer_lane,
    ):
        fetcher.metrics.origin_requests.set(origin_workers if owned else 0)
        futures: list[Future[Any]] = [
            origin_lane.submit(ORIGIN, functools.partial(fetch_own, c)) for c in owned
        ]
        if others:  # then the origin lane takes slow owners' tails (fetcher.claim_tails)
            futures.append(origin_lane.submit(ORIGIN, fetcher.claim_tails))
        futures += [
            peer_lane.submit(fetcher.owner_of(c.key), functools.partial(fetch_other, c))
            for c in others
        ]
        finished, _ = wait(futures, return_when=FIRST_EXCEPTION)
        if not any(f.exception() for f in finished):
            # Every origin-lane task is done, so every deferred chunk has been submitted.
            finished, _ = wait(deferred, return_when=FIRST_EXCEPTION)
        failed = [f for f in finished if f.exception()]
        if failed:
            cancel.set()  # queued chunks stop at once; running ones finish and are kept
            for lane in (origin_lane, peer_lane):
                lane.shutdown(wait=False, cancel_futures=True)
            raise failed[0].exception()  # type: ignore[misc]
    staging.mark_staged()
