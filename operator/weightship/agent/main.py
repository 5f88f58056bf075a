"""The agent loop: watch rollouts, stage what this node wants one model at a time, serve
chunks to peers, report the cache in this node's WeightCache.

Level-triggered and restart-safe: every tick recomputes what is wanted from the
rollouts, and what is staged from the disk. The cache on disk (journal, chunks, STAGED
markers) and the WeightCache status are the only memory, so a restarted agent resumes
an interrupted stage without fetching a verified chunk again. What it last learnt from the
API server (its wants, its peers, its status) is kept on disk too (`lastknown`): an agent
that starts while the API server is down stages from that until the API server answers.
"""

from __future__ import annotations

import contextlib
import logging
import random
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

from kubernetes.client.rest import ApiException

from weightship.agent import desired, lastknown, status
from weightship.agent.config import AgentConfig
from weightship.agent.credentials import CredentialsError, read_credentials
from weightship.agent.desired import ModelSource, Wanted
from weightship.agent.failures import StageError, classify
from weightship.agent.kube import AgentKube, rollout_informer
from weightship.agent.lastknown import LastKnown
from weightship.agent.metrics import AgentMetrics
from weightship.api.weightcache import FailureReason
from weightship.core.staging_failure import DETERMINISTIC
from weightship.data.chunkstore import ChunkStore, InsufficientSpaceError, StageBusyError
from weightship.data.fetcher import ChunkOrigin, Peer, TokenBucket
from weightship.data.peer import PeerServer
from weightship.data.s3 import RetryPolicy, S3Location, S3Origin, S3Settings, make_client
from weightship.data.stage import StageCancelledError, StageProgress, StageResult, stage
from weightship.data.views import Views
from weightship.kube.client import unreachable
from weightship.weightformat.cachedir import MANIFEST_FILE
from weightship.weightformat.manifest import Manifest, ManifestError
from weightship.weightformat.paths import MANIFEST_NAME

log = logging.getLogger(__name__)

MIN_TICK_GAP_S = 0.5  # debounce: a burst of watch events makes one tick
PEER_MAX_AGE_S = 180.0
# Agents never read a rollout's credentialsSecretRef: they have no Secret access.
NO_CREDENTIALS_HINT = (
    " (agents read S3 with their own install-time credential, the chart's "
    "agent.s3.existingSecret, and none is mounted)"
)
BUSY_RETRY_S = 2.0  # three heartbeats without a write: the peer is presumed dead


class NoOrigin:
    """The origin when no rollout's source holds this digest any more (an old stable
    pinned for rollback): chunks can only come from peers."""

    def __init__(self, digest: str, why: str) -> None:
        self.digest, self.why = digest, why

    def read_range(self, path: str, offset: int, size: int) -> bytes:
        raise StageError(
            f"no peer has {path} at offset {offset} of {self.digest}, and no origin holds "
            f"it: {self.why}",
            "SourceUnavailable",
        )


@dataclass
class _Job:
    want: Wanted
    cancel: threading.Event
    thread: threading.Thread


class Agent:
    def __init__(
        self,
        config: AgentConfig,
        kube: AgentKube,
        metrics: AgentMetrics,
        *,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.cfg = config
        self.kube = kube
        self.metrics = metrics
        self.now = now
        self.store = ChunkStore(
            config.cache_dir,
            capacity_bytes=config.capacity_bytes,
            reserve_bytes=config.reserve_bytes,
        )
        self.stop = threading.Event()
        self.wake = threading.Event()
        self.report = threading.Event()
        self.lock = threading.Lock()  # guards entries, clock, wants, node_count
        self.entries: dict[str, status.Entry] = {}
        self.clock = status.WriteClock()
        self.wants: list[Wanted] = []
        self.node_count = 1
        self.job: _Job | None = None
        self.failures: dict[str, int] = {}
        self.retry_at: dict[str, float] = {}
        self.informer = rollout_informer(kube, self.wake.set, stop=self.stop)
        self.peer_server: PeerServer | None = None
        self._labels: dict[str, str] = {}
        self._labels_at = float("-inf")
        self._totals: dict[str, int] = {}  # digest -> manifest size (manifests are immutable)
        self._attempts: dict[str, str] = {}  # digest -> its Wanted.attempt last tick
        # Per-rollout views of the cache (data.views), and the digests they link: never
        # evicted, since a link would keep the bytes alive behind the cache's accounting.
        self.views = Views(self.store)
        self.view_digests: set[str] = self.views.linked_digests()
        self._refused_views: set[str] = set()  # rollouts already logged as having no view
        # What this agent last learnt from the API server, as on disk (lastknown.py).
        self.known_path = config.cache_dir / lastknown.FILE_NAME
        self.known = LastKnown()
        self._known_lock = threading.Lock()  # one writer of the file at a time
        # The node read and the WeightCache ensured: until then (a start without the API
        # server) the agent stages what it last knew.
        self.joined = False

    # ---- lifecycle --------------------------------------------------------------------
    def run(self) -> None:
        """Serve and stage until `stop` is set."""
        self.store.discard_temp_files()
        self.peer_server = PeerServer(self.store, self.cfg.pod_ip, self.cfg.peer_port).start()
        self.known = lastknown.read(self.known_path) or LastKnown()
        if self._join(wait_s=self.cfg.api_wait_s, recover=True):
            source = "its WeightCache"
        else:
            # The API server is down: resume from what this agent knew before it stopped.
            self.entries = status.recover(self.known.status)
            self.node_count = self.known.node_count
            source = f"{self.known_path} (saved {self.known.saved_at or 'never'})"
            log.warning(
                "the API server did not answer within %.0fs: staging the %d models and "
                "trading with the %d peers this agent last knew, until it answers",
                self.cfg.api_wait_s,
                len(self.known.wants),
                len(self.known.peers),
            )
        log.info(
            "agent for node %s: cache %s, peers at %s, %d manifests recovered from %s",
            self.cfg.node_name,
            self.cfg.cache_dir,
            self.peer_server.address,
            len(self.entries),
            source,
        )
        self._changed(urgent=True)
        reporter = threading.Thread(target=self._report_loop, name="status", daemon=True)
        reporter.start()
        self.informer.start()
        try:
            while not self.stop.is_set():
                try:
                    self.tick()
                except Exception:
                    log.exception("tick failed; retrying")
                self.wake.wait(timeout=self._next_wait_s())
                self.wake.clear()
                self.stop.wait(MIN_TICK_GAP_S)
        finally:
            self._shutdown(reporter)

    def _join(self, *, wait_s: float = 0.0, recover: bool = False) -> bool:
        """Read the node and ensure its WeightCache (``recover``: and take the entries
        from its status). Tried for up to ``wait_s`` while the API server does not answer;
        False if it never did (an answer that is a refusal, RBAC say, raises)."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                node = self.kube.node(self.cfg.node_name)
                cache = self.kube.ensure_weight_cache(node)
                break
            except Exception as e:
                if not unreachable(e):
                    raise
                if time.monotonic() >= deadline or self.stop.is_set():
                    log.info("the API server does not answer: %s", _short(e))
                    return False
                self.stop.wait(1.0)
        self._labels, self._labels_at = dict(node["metadata"].get("labels") or {}), time.monotonic()
        if recover:
            self.entries = status.recover(cache.get("status"))
        try:
            self.node_count = max(1, len(self.kube.weight_caches()))
        except Exception as e:
            log.warning("cannot list WeightCaches: %s", e)
        self.joined = True
        return True

    def _next_wait_s(self) -> float:
        """Until the next resync, or the next retry of a failed or busy stage if sooner."""
        retries = [t - time.monotonic() for t in self.retry_at.values()]
        return max(0.0, min([self.cfg.resync_s, *retries]))

    def _shutdown(self, reporter: threading.Thread) -> None:
        job = self.job
        if job is not None:
            job.cancel.set()
            job.thread.join(timeout=20)
        self.stop.set()
        reporter.join(timeout=10)
        self._write_status()  # the last word: what is staged and what is left
        if self.peer_server is not None:
            self.peer_server.stop()

    # ---- one evaluation ---------------------------------------------------------------
    def tick(self) -> None:
        wants = self._live_wants()
        if wants is None:  # the API server has not answered since this agent started
            if not self.known.wants:
                return
            wants = list(self.known.wants)
        else:
            self._remember(wants=tuple(wants))
        pins = {w.digest: w.pinned_by for w in wants}
        disk = self._scan_disk()
        job = self.job
        running = job is not None and job.thread.is_alive()
        with self.lock:
            self.wants = wants
            before = self.entries
            self.entries = status.reconcile(
                before, disk, pins, job.want.digest if job and running else None, self.now()
            )
            if _shape(before) != _shape(self.entries):
                self._changed_locked(urgent=True)
        for digest in list(self.failures):
            if digest not in pins:
                self.failures.pop(digest, None)
                self.retry_at.pop(digest, None)
        for digest in desired.restarted(wants, self._attempts):
            if self.retry_at.pop(digest, None) is not None:
                log.info("%s: its rollout's prefetch began again; retrying now", digest)
            self.failures.pop(digest, None)
        if job is not None and running:
            if job.want.digest not in pins and not job.cancel.is_set():
                log.info("%s is no longer wanted: cancelling its stage", job.want.digest)
                job.cancel.set()
            return
        self.job = None
        staged = {m.digest for m in disk if m.staged}
        nxt = desired.next_to_stage(wants, staged, self.retry_at, time.monotonic())
        if nxt is not None:
            cancel = threading.Event()
            thread = threading.Thread(
                target=self._stage, args=(nxt, cancel), name="stage", daemon=True
            )
            self.job = _Job(nxt, cancel, thread)
            thread.start()

    def _live_wants(self) -> list[Wanted] | None:
        """What the rollouts want of this node, and their views brought in line; None
        until the API server has answered (the rollouts listed, the node read) since this
        agent started. During an outage after that, the rollouts and labels last seen."""
        if not self.informer.synced.is_set():
            return None
        if not self.joined:
            if not self._join():
                return None
            log.info("the API server answers: following the live rollouts again")
        elif time.monotonic() - self._labels_at >= self.cfg.resync_s:
            try:
                node = self.kube.node(self.cfg.node_name)
                self._labels = dict(node["metadata"].get("labels") or {})
            except Exception as e:
                if not unreachable(e):
                    raise
                log.info("cannot read node %s, keeping its labels: %s", self.cfg.node_name, e)
            self._labels_at = time.monotonic()
        rollouts = self.informer.snapshot()
        try:
            self._sync_views(rollouts)
        except Exception:  # a view must never hold up staging
            log.exception("maintaining the rollouts' views failed; retrying next tick")
            self.metrics.view_errors.inc()
        return desired.wanted(rollouts, self._labels, self.cfg.namespaces)

    def _remember(self, **changes: Any) -> None:
        """Update what this agent knows, on disk too when it changed (lastknown.py). A
        failure to save costs only the memory of a restart during an outage."""
        with self._known_lock:
            known = replace(self.known, **changes)
            if known.same_as(self.known):
                return
            self.known = known = replace(known, saved_at=self.now())
            try:
                lastknown.write(self.known_path, self.store.temp_path("last-known"), known)
            except OSError as e:
                log.warning("cannot save what this agent knows to %s: %s", self.known_path, e)

    def _sync_views(self, rollouts: list[dict[str, Any]]) -> None:
        """One bounded pass over the per-rollout views (data.views): each in-place
        rollout's view shows what it pins here, once staged; another pass follows soon
        when work is left. The views' digests join the pinned set before any unpinned
        one leaves a view, so no eviction ever races a link."""
        plan = desired.view_pins(
            rollouts, self._labels, self.cfg.namespaces, existing=self.views.uids()
        )
        for name in set(plan.refused) - self._refused_views:
            log.warning("rollout %s has no view of the cache: its uid is not a UUID", name)
        self._refused_views = set(plan.refused)
        with self.lock:
            self.view_digests |= {d for ds in plan.pins.values() for d in ds}
        try:
            report = self.views.sync(plan.pins, budget=self.cfg.view_budget)
        finally:
            linked = self.views.linked_digests()
            with self.lock:
                self.view_digests = linked
        for uid, digest in report.linked:
            log.info("view %s shows %s", uid, digest)
        for uid, hex_ in report.removed:
            log.info("view %s no longer shows sha256:%s", uid, hex_)
        for uid in report.views_removed:
            log.info("view %s removed: its rollout pins nothing here", uid)
        for error in report.errors:
            log.warning("%s", error)
        self.metrics.view_errors.inc(len(report.errors))
        self.metrics.view_models.set(sum(len(v) for v in self.views.contents().values()))
        if report.pending:
            self.wake.set()  # bounded work per pass: the rest in the next one

    def _scan_disk(self) -> list[status.DiskModel]:
        out = []
        for digest in self.store.models():
            total = self._totals.get(digest)
            if total is None:
                try:
                    raw = (self.store.model_dir(digest) / MANIFEST_FILE).read_bytes()
                    total = Manifest.parse(raw).total_size
                    self._totals[digest] = total
                except (OSError, ManifestError):
                    total = 0
            out.append(status.DiskModel(digest, self.store.is_staged(digest), total))
        return out

    # ---- staging one model ------------------------------------------------------------
    def _stage(self, want: Wanted, cancel: threading.Event) -> None:
        digest, started = want.digest, time.monotonic()
        self._update(
            digest,
            state="Staging",
            started_at=self.now(),
            completed_at=None,
            bytes_done=0,
            bytes_from_peers=0,
            bytes_from_origin=0,
            pinned_by=want.pinned_by,
        )
        try:
            result = self._fetch(want, cancel)
        except StageBusyError:
            # Another process holds the model's lock: a previous agent on this node that
            # is still dying (a force-deleted pod). Not a failure; try again shortly.
            log.info("%s is locked by another stager; retrying in %.0fs", digest, BUSY_RETRY_S)
            self.retry_at[digest] = time.monotonic() + BUSY_RETRY_S
        except StageCancelledError:
            log.info("staging %s cancelled; verified chunks are kept", digest)
            self.metrics.stages.labels("cancelled").inc()
        except Exception as e:
            self._failed(digest, e)
        else:
            self._staged(digest, result, time.monotonic() - started)
        finally:
            self.wake.set()

    def _fetch(self, want: Wanted, cancel: threading.Event) -> StageResult:
        """Resolve the manifest, make room, and stage every chunk (peers first)."""
        digest = want.digest
        manifest, origin = self._resolve(want)
        self._update(digest, bytes_total=manifest.total_size)
        with self.lock:
            pinned = {w.digest for w in self.wants} | {digest} | self.view_digests
        self._make_room(manifest, pinned)
        peers, holders = self._peers(digest) if want.peer_to_peer else ([], set())
        log.info(
            "staging %s (%d bytes) with %d peers (%d have it staged)%s",
            digest,
            manifest.total_size,
            len(peers),
            len(holders),
            f", capped at {want.bandwidth_limit} B/s" if want.bandwidth_limit else "",
        )
        return stage(
            manifest,
            self.store,
            origin,
            peers,
            node=self.cfg.node_name,
            metrics=self.metrics.data,
            pinned=pinned,
            workers=self.cfg.workers,
            bandwidth=TokenBucket(want.bandwidth_limit) if want.bandwidth_limit else None,
            progress=lambda p: self._progress(digest, p),
            cancel=cancel,
            holders=holders,
        )

    def _failed(self, digest: str, e: Exception) -> None:
        """A failed stage: retried after a back-off, its failure classified in status."""
        message = _describe(e, digest)
        failures = self.failures.get(digest, 0) + 1
        self.failures[digest] = failures
        delay = desired.retry_delay_s(failures)
        self.retry_at[digest] = time.monotonic() + delay
        log.warning("staging %s failed (retry in %.0fs): %s", digest, delay, message)
        self.metrics.stages.labels("failed").inc()
        with self.lock:
            previous = self.entries[digest].failure if digest in self.entries else None
        failure = classify(e, self.now(), previous)
        self.metrics.stage_failures.labels(failure.reason).inc()
        self._update(digest, state="Failed", last_error=status.clip(message), failure=failure)

    def _staged(self, digest: str, result: StageResult, seconds: float) -> None:
        self.failures.pop(digest, None)
        self.retry_at.pop(digest, None)
        self.metrics.stages.labels("staged").inc()
        self.metrics.stage_seconds.observe(seconds)
        log.info(
            "staged %s in %.1fs: %d bytes from origin, %d from peers, %d local",
            digest,
            seconds,
            result.from_origin,
            result.from_peers,
            result.from_local,
        )
        self._update(
            digest,
            state="Staged",
            bytes_done=result.done_bytes,
            bytes_total=result.total_bytes,
            bytes_from_origin=result.from_origin,
            bytes_from_peers=result.from_peers,
            completed_at=self.now(),
            last_error=None,
            failure=None,
        )

    def _resolve(self, want: Wanted) -> tuple[Manifest, ChunkOrigin]:
        """The manifest of ``want.digest`` and an origin holding its weights.

        The rollouts' S3 sources come first (the manifest read there must hash to the
        wanted digest); then the manifest this node saved when it began staging it, with
        peers as the only source of chunks.
        """
        problems: list[str] = []
        reasons: list[FailureReason] = []
        for source in want.sources:
            location = f"{source.uri.rstrip('/')}/{MANIFEST_NAME}"
            try:
                origin = self._origin(source)
                manifest = S3Origin(
                    origin.client, origin.location, RetryPolicy(attempts=3, max_backoff_s=2.0)
                ).read_manifest()
            except ManifestError as e:
                problems.append(f"the manifest at {location} is invalid: {e}")
                reasons.append("ManifestInvalid")
                continue
            except Exception as e:
                hint = "" if self.cfg.s3_credentials_dir else NO_CREDENTIALS_HINT
                problems.append(f"cannot read the manifest at {location}: {_short(e)}{hint}")
                reasons.append("SourceUnavailable")
                continue
            if manifest.digest == want.digest:
                return manifest, origin
            reasons.append("ManifestChanged")
            problems.append(
                f"the manifest at {location} has digest {manifest.digest}, not {want.digest} "
                "(the weights there were republished after the rollout recorded its digest)"
            )
        saved = self.store.model_dir(want.digest) / MANIFEST_FILE
        kept: Manifest | None = None
        with contextlib.suppress(OSError, ManifestError):
            kept = Manifest.parse(saved.read_bytes(), source=str(saved))
        if kept is not None and kept.digest == want.digest:
            return kept, NoOrigin(want.digest, "; ".join(problems) or "no source")
        detail = "; ".join(problems) or "no rollout that wants it names an S3 source"
        # Deterministic only when every source failed deterministically: one that could
        # not be read may yet hold it.
        deterministic = bool(reasons) and all(r in DETERMINISTIC for r in reasons)
        raise StageError(
            f"cannot get the manifest {want.digest}: {detail}",
            reasons[0] if deterministic else "SourceUnavailable",
        )

    def _origin(self, source: ModelSource) -> S3Origin:
        """The rollout's S3 source, read with the agents' own credential: the operator read
        its manifest with the rollout's credentialsSecretRef before any digest reached an
        agent, and agents stage only the digests rollouts' status records."""
        try:
            creds = read_credentials(self.cfg.s3_credentials_dir)
        except CredentialsError as e:
            raise StageError(
                f"cannot read the agent's S3 credentials: {e}", "SourceUnavailable"
            ) from None
        client = make_client(S3Settings.from_secret(source.endpoint, source.region, creds))
        return S3Origin(client, S3Location.parse(source.uri))

    def _peers(self, digest: str) -> tuple[list[Peer], set[str]]:
        """The live agents, and those of them that have ``digest`` staged already. While
        the API server does not answer, the agents it showed last (a dead one among them
        is dropped by the stage after its refusals: fetcher.PeerHealth)."""
        try:
            caches = self.kube.weight_caches()
        except Exception as e:
            if not unreachable(e):
                raise
            known = self.known
            log.warning(
                "cannot list WeightCaches (%s): staging with the %d peers known at %s",
                _short(e, 200),
                len(known.peers),
                known.saved_at,
            )
            peers = [Peer(p.node, p.address) for p in known.peers]
            return peers, {p.node for p in known.peers if digest in p.staged}
        with self.lock:
            self.node_count = max(1, len(caches))
            wanted = {w.digest for w in self.wants} | {digest}
        found = desired.live_peers(caches, self.cfg.node_name, self.now(), PEER_MAX_AGE_S)
        alive = {node for node, _ in found}
        holding = {d: desired.staged_on(caches, d) & alive for d in wanted}
        self._remember(peers=lastknown.known_peers(found, holding), node_count=max(1, len(caches)))
        return [Peer(node, address) for node, address in found], holding[digest]

    def _make_room(self, manifest: Manifest, pinned: set[str]) -> None:
        """Evict unpinned models (LRU) before staging, reporting them as Evicting first."""
        plan = self.store.eviction_plan(self.store.missing_bytes(manifest), pinned)
        if not plan:
            return
        for digest in plan:
            self._update(digest, state="Evicting")
        for digest in plan:
            log.info("evicting %s to make room for %s", digest, manifest.digest)
            if self.store.evict(digest):
                self.metrics.evictions.inc()
                with self.lock:
                    self.entries.pop(digest, None)
                    self._changed_locked(urgent=True)

    # ---- status -----------------------------------------------------------------------
    def _update(self, digest: str, **changes: Any) -> None:
        with self.lock:
            is_new = digest not in self.entries
            old = self.entries.get(digest) or status.Entry(digest, "Staging")
            new = replace(old, **changes)
            self.entries[digest] = new
            self._changed_locked(urgent=is_new or new.state != old.state)

    def _progress(self, digest: str, p: StageProgress) -> None:
        with self.lock:
            old = self.entries.get(digest)
            if old is None or old.state != "Staging":
                return
            self.entries[digest] = replace(
                old,
                bytes_done=p.done_bytes,
                bytes_total=p.total_bytes,
                bytes_from_origin=p.from_origin,
                bytes_from_peers=p.from_peers,
            )
            self.clock.dirty = True

    def _changed(self, *, urgent: bool) -> None:
        with self.lock:
            self._changed_locked(urgent=urgent)

    def _changed_locked(self, *, urgent: bool) -> None:
        if urgent:
            self._mark_urgent_locked()
            self.report.set()
        else:
            self.clock.dirty = True

    def _mark_urgent_locked(self) -> None:
        """A state change to write at this agent's random turn in the fleet's window."""
        delay = status.state_write_delay_s(
            self.node_count,
            random.random(),  # noqa: S311 (jitter, not a secret)
            cluster_budget_per_s=self.cfg.cluster_write_budget_per_s,
            max_spread_s=self.cfg.max_write_spread_s,
        )
        status.mark_urgent(self.clock, time.monotonic(), delay)

    def _report_loop(self) -> None:
        wait_s = 0.5
        while not self.stop.is_set():
            self.report.wait(timeout=wait_s)
            self.report.clear()
            with self.lock:
                interval = status.progress_interval_s(
                    self.node_count,
                    min_interval_s=self.cfg.min_progress_interval_s,
                    cluster_budget_per_s=self.cfg.cluster_write_budget_per_s,
                )
                now = time.monotonic()
                due = status.write_due(self.clock, now, interval, self.cfg.heartbeat_s)
                wait_s = status.report_wait_s(self.clock, now, poll_s=0.5)
            if due:
                self._write_status()
                with self.lock:
                    wait_s = status.report_wait_s(self.clock, time.monotonic(), poll_s=0.5)

    def _write_status(self) -> None:
        with self.lock:
            entries = list(self.entries.values())
            status.mark_written(self.clock, time.monotonic())
        usage = shutil.disk_usage(self.cfg.cache_dir)
        capacity = usage.total
        if self.cfg.capacity_bytes is not None:
            capacity = min(capacity, self.cfg.capacity_bytes)
        free = self.store.available_bytes()
        body = status.build_status(
            peer_endpoint=self.cfg.peer_endpoint,
            capacity_bytes=capacity,
            free_bytes=free,
            entries=entries,
            now=self.now(),
        )
        self._remember(status=body)
        try:
            try:
                self.kube.patch_weight_cache_status(self.cfg.node_name, body)
            except ApiException as e:
                if e.status != 404:
                    raise
                # Someone deleted this node's WeightCache: it is recreated, not given up.
                self.kube.ensure_weight_cache(self.kube.node(self.cfg.node_name))
                self.kube.patch_weight_cache_status(self.cfg.node_name, body)
            self.metrics.status_writes.labels("ok").inc()
            self.metrics.last_report.set_to_current_time()
        except Exception as e:
            log.warning("writing WeightCache %s status failed: %s", self.cfg.node_name, e)
            self.metrics.status_writes.labels("error").inc()
            with self.lock:
                # Retried at a new turn: after an outage every agent's write fails, and
                # their retries must not arrive together when the API server returns.
                self._mark_urgent_locked()
            self.stop.wait(1.0)
        self.metrics.cache_capacity.set(capacity)
        self.metrics.cache_free.set(free)
        self.metrics.cache_used.set(self.store.used_bytes())
        self.metrics.observe_entries(entries)


def _shape(entries: dict[str, status.Entry]) -> dict[str, tuple[str, tuple[str, ...]]]:
    """What makes a status change urgent: the set of entries, their states and pins."""
    return {d: (e.state, e.pinned_by) for d, e in entries.items()}


def _short(e: BaseException, limit: int = 300) -> str:
    text = str(e) or type(e).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _describe(e: BaseException, digest: str) -> str:
    if isinstance(e, StageError):
        return str(e)
    if isinstance(e, InsufficientSpaceError):
        return f"cannot stage {digest}: {e}"
    return f"staging {digest} failed: {type(e).__name__}: {_short(e, 700)}"
