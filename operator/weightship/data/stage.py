"""Stage one model onto this node: plan, check space, fetch chunks, materialize, mark.

Idempotent and resumable: what the journal and the chunk store already hold is never
fetched again, and the model is marked staged only after every file is in place.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from weightship.data.chunkstore import ChunkStore, ModelStaging
from weightship.data.fetcher import (
    ChunkFetcher,
    ChunkOrigin,
    FetchPolicy,
    Peer,
    Source,
    TokenBucket,
    fetch_order,
)
from weightship.data.manifest import ChunkEntry, Manifest
from weightship.data.metrics import DataPlaneMetrics
from weightship.data.peer import PeerClient


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
    bandwidth: TokenBucket | None = None,
    client: PeerClient | None = None,
    progress: ProgressCallback | None = None,
    cancel: threading.Event | None = None,
) -> StageResult:
    """Stage ``manifest`` into ``store``; return where its files are and where bytes came from.

    ``peers`` are the live agents (this node may be among them), ``pinned`` the models
    that must not be evicted to make room. Raises InsufficientSpaceError before fetching
    anything when the model cannot fit.
    """
    started = time.monotonic()
    tally = _Tally(manifest.total_size, progress)
    with store.begin(manifest) as staging:
        if not staging.is_staged:
            fetcher = ChunkFetcher(
                node=node,
                peers=peers,
                origin=origin,
                store=store,
                metrics=metrics,
                policy=policy,
                client=client,
                bandwidth=bandwidth,
            )
            _stage(staging, fetcher, tally, pinned, workers, cancel or threading.Event())
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


def _stage(
    staging: ModelStaging,
    fetcher: ChunkFetcher,
    tally: _Tally,
    pinned: Collection[str],
    workers: int,
    cancel: threading.Event,
) -> None:
    manifest, store = staging.manifest, staging.store
    chunks = manifest.chunks
    journaled = staging.journaled()
    # Chunks already in the store (another model's, or journal lines lost in a crash)
    # are verified already: record them, fetch nothing.
    present = [i for i, c in enumerate(chunks) if i not in journaled and store.has_chunk(c.sha256)]
    staging.record(present)
    done = journaled.union(present)
    tally.add("local", sum(chunks[i].size for i in done))

    todo: dict[str, list[int]] = defaultdict(list)  # digest -> chunk indexes needing it
    for i, c in enumerate(chunks):
        if i not in done:
            todo[c.sha256].append(i)
    remaining: dict[str, int] = defaultdict(int)  # file -> chunks still missing
    for indexes in todo.values():
        for i in indexes:
            remaining[chunks[i].file] += 1

    unmaterialized = [f for f in manifest.files if not staging.is_materialized(f.path)]
    needed = sum(chunks[ix[0]].size for ix in todo.values()) + sum(f.size for f in unmaterialized)
    store.ensure_space(needed, {*pinned, manifest.digest})

    for f in unmaterialized:
        if remaining[f.path] == 0:
            staging.materialize(f.path)

    lock = threading.Lock()

    def fetch_one(chunk: ChunkEntry) -> None:
        if cancel.is_set():
            raise StageCancelledError(f"staging {manifest.digest} cancelled")
        indexes = todo[chunk.sha256]
        source = fetcher.fetch(chunk)
        staging.record(indexes)
        tally.add(source, chunk.size)
        tally.add("local", chunk.size * (len(indexes) - 1))
        with lock:
            completed = []
            for i in indexes:
                remaining[chunks[i].file] -= 1
                if remaining[chunks[i].file] == 0:
                    completed.append(chunks[i].file)
        for path in completed:
            staging.materialize(path)

    unique = [chunks[ix[0]] for ix in todo.values()]
    order = fetch_order(unique, fetcher.node, fetcher.nodes, lag=workers)
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        futures = [pool.submit(fetch_one, c) for c in order]
        finished, _ = wait(futures, return_when=FIRST_EXCEPTION)
        failed = [f for f in finished if f.exception()]
        if failed:
            cancel.set()  # queued chunks stop at once; running ones finish and are kept
            pool.shutdown(cancel_futures=True)
            raise failed[0].exception()  # type: ignore[misc]
    staging.mark_staged()
