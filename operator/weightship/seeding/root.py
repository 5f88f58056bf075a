"""The root side: a loaded, verified replica that broadcasts its weights to new replicas.

Joins arrive over the root's HTTP server (see ``endpoints.handle_join``). Receivers of one
group id are gathered into a *generation*: it starts when as many receivers as the group
still expects have joined, or when ``join_window_s`` has passed since its first join, with
whoever is there. A join that finds the group's generation already broadcasting opens the
next one. So a replica set scaled 1 -> 3 and later 3 -> 5 may keep one group id (an env
var in the pod template cannot change per scale-up without a new template).

Each generation gets its own process group (built over a PrefixStore of the root's one
TCPStore) and its own thread, and is torn down when its broadcast ends.

Only the rollout's own pods may join: a join carries a token made with the rollout's
seeding key (core.seedtoken), checked before anything else. A generation's store keys sit
under a random prefix that only its accepted joiners learn, so a process that reaches the
store's port but was never admitted cannot read the start signal nor write a rank's
address (which the others, and the root, would connect to). Open generations count against
``max_concurrent`` as running ones do, and each starts or ends ``join_window_s`` after its
first join, so joins for many groups cannot start more broadcasts than the limit.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from weightship.api.inference import FailureReason
from weightship.core.seedtoken import check_token
from weightship.seeding import transport
from weightship.seeding.buckets import DEFAULT_BUCKET_BYTES, region_views
from weightship.seeding.config import RootSettings
from weightship.seeding.faults import Faults
from weightship.seeding.protocol import GROUP_ID, START_KEY, result_key, store_prefix
from weightship.seeding.specs import check_tensors, plan_for
from weightship.seeding.stream import send_buckets
from weightship.weightformat.manifest import Manifest

log = logging.getLogger(__name__)

# How long the root waits, after its last bucket, for receivers to report verification.
RESULT_WAIT_S = 60.0
MAX_WORLD_SIZE = 1025  # the root and 1,024 receivers: bounds a generation's member list
MAX_MEMBER_CHARS = 253  # a pod name


@dataclass(frozen=True)
class SeedRecord:
    """One finished broadcast, for status: who seeded whom, how much, how long."""

    group: str
    generation: int
    root: str
    backend: str
    receivers: tuple[str, ...]
    bytes: int  # tensor bytes each receiver got
    seconds: float  # from the group's start to the last bucket sent
    started_at: float  # epoch seconds
    ok: bool
    error: str | None = None
    # member -> "Verified", a SeedingError reason, or "Unknown" (no report in time)
    results: Mapping[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "group": self.group,
            "generation": self.generation,
            "root": self.root,
            "backend": self.backend,
            "receivers": list(self.receivers),
            "bytes": self.bytes,
            "seconds": round(self.seconds, 3),
            "startedAt": self.started_at,
            "ok": self.ok,
            "error": self.error,
            "results": dict(self.results),
        }


@dataclass
class _Generation:
    group: str
    number: int
    expected: int  # receivers that start it without waiting for the window
    # Its store keys' prefix, with a random part only its accepted joiners are told.
    prefix: str = ""
    members: list[str] = field(default_factory=list)
    state: Literal["open", "running", "done"] = "open"
    timer: threading.Timer | None = None


def refusal(reason: str, message: str, status: int = 409) -> dict[str, Any]:
    """A join answer that tells the receiver to fall back to its node cache now; ``status``
    is the HTTP status the endpoint answers it with."""
    return {"accepted": False, "reason": reason, "message": message, "status": status}


class SeedRoot:
    """Broadcasts ``tensors`` (loaded and verified against ``manifest``) to joining replicas.

    ``host`` is the address receivers reach this process at (its pod IP); ``name`` names it
    in status. ``backend`` "auto" is NCCL for CUDA tensors, gloo otherwise. ``timeout_s``
    bounds the group rendezvous and each bucket's broadcast. ``key`` (the rollout's seeding
    key) and ``rollout_uid`` check each join's token; a root without a key admits no one.
    """

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        manifest: Manifest,
        *,
        host: str,
        name: str,
        backend: str = "auto",
        timeout_s: float = 300,
        join_window_s: float = 10,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        max_concurrent: int = 2,
        faults: Faults | None = None,
        key: bytes | None = None,
        rollout_uid: str = "",
    ) -> None:
        self.plan = plan_for(manifest, bucket_bytes)
        check_tensors([p.spec for p in self.plan.placements], tensors)
        devices = {t.device for t in tensors.values()}
        if len(devices) != 1:
            raise ValueError(f"tensors must be on one device, found {sorted(map(str, devices))}")
        self.device = devices.pop()
        self.tensors = dict(tensors)
        self.digest = manifest.digest
        # Regions already laid out as the files (a loader's buffers) are sent without a copy.
        self.sources = region_views(self.plan, self.tensors)
        self.backend = transport.resolve_backend(backend, self.device)
        self.host, self.name = host, name
        self.timeout_s, self.join_window_s = timeout_s, join_window_s
        self.max_concurrent = max_concurrent
        self._key, self.rollout_uid = key, rollout_uid
        self.faults = faults if faults is not None else Faults.from_env()
        self._lock = threading.Lock()
        self._store: transport.TCPStore | None = None
        self._current: dict[str, _Generation] = {}  # each group's latest generation
        self._live: list[_Generation] = []  # open or running, any group: the slots in use
        self._seeded: dict[str, int] = {}  # group -> receivers seeded, for later generations
        self._history: list[SeedRecord] = []
        self._closed = False

    @classmethod
    def from_settings(
        cls, tensors: Mapping[str, torch.Tensor], manifest: Manifest, settings: RootSettings
    ) -> SeedRoot:
        """The root a verified replica becomes, configured from its pod's env."""
        if settings.host is None:
            raise ValueError("a seed root needs its pod IP (WEIGHTSHIP_POD_IP)")
        return cls(
            tensors,
            manifest,
            host=settings.host,
            name=settings.name,
            backend=settings.backend,
            timeout_s=settings.timeout_s,
            bucket_bytes=settings.bucket_bytes,
            key=settings.key,
            rollout_uid=settings.rollout_uid,
        )

    # -- joining ---------------------------------------------------------------------

    def join(
        self,
        group_id: str,
        world_size: int,
        member: str,
        *,
        digest: str | None = None,
        backend: str = "auto",
        token: str | None = None,
    ) -> dict[str, Any]:
        """Admit ``member`` to ``group_id``; a JSON-able answer for the HTTP handler.

        ``world_size`` counts the root: 3 means the root and two receivers. ``token`` must
        be the rollout's token for this group (core.seedtoken). An answer with ``accepted``
        false means "load from your node cache".
        """
        if not GROUP_ID.fullmatch(group_id):
            return refusal(FailureReason.BAD_REQUEST, f"invalid group id {group_id!r}", 400)
        refused = check_token(
            self._key, self.rollout_uid, self.digest, group_id, token, time.time()
        )
        if refused is not None:  # before anything else: strangers learn nothing more
            return refusal(refused.reason, refused.message, refused.status)
        if not 2 <= world_size <= MAX_WORLD_SIZE or not 0 < len(member) <= MAX_MEMBER_CHARS:
            return refusal(
                FailureReason.BAD_REQUEST,
                f"worldSize must be 2 to {MAX_WORLD_SIZE}, member 1 to {MAX_MEMBER_CHARS} chars",
                400,
            )
        if digest is not None and digest != self.digest:
            return refusal("DigestMismatch", f"root holds {self.digest}, not {digest}")
        if backend not in ("auto", self.backend):
            return refusal("BackendMismatch", f"root broadcasts with {self.backend}")
        with self._lock:
            if self._closed:
                return refusal("RootClosed", "this root no longer seeds")
            gen = self._current.get(group_id)
            if gen is None or gen.state != "open":
                if self._active() >= self.max_concurrent:
                    return refusal("Busy", f"{self.max_concurrent} groups already open or running")
                gen = self._open(group_id, world_size, gen)
            if member not in gen.members:  # a retried join keeps its rank
                gen.members.append(member)
            rank = gen.members.index(member) + 1
            if len(gen.members) >= gen.expected:
                self._start(gen)
            port = self._ensure_store().port
        return {
            "accepted": True,
            "group": group_id,
            "generation": gen.number,
            "storeHost": self.host,
            "storePort": port,
            "storePrefix": gen.prefix,
            "rank": rank,
            "worldSize": gen.expected + 1,  # planned; ctl/start has the final size
            "backend": self.backend,
            "root": self.name,
            "digest": self.digest,
            "bucketBytes": self.plan.bucket_bytes,
        }

    def _active(self) -> int:
        """Generations that hold a slot: open (joined, not started) or running; a group's
        running generation and its next, open one hold two."""
        return len(self._live)

    def _done(self, gen: _Generation) -> None:
        gen.state = "done"
        if gen in self._live:
            self._live.remove(gen)

    def _open(self, group: str, world_size: int, previous: _Generation | None) -> _Generation:
        # The receivers not seeded yet; once all were, a new wave of the same size.
        remaining = world_size - 1 - self._seeded.get(group, 0)
        expected = remaining if remaining > 0 else world_size - 1
        number = previous.number + 1 if previous else 1
        prefix = store_prefix(group, number) + secrets.token_hex(16) + "/"
        gen = _Generation(group, number, expected, prefix)
        gen.timer = threading.Timer(self.join_window_s, self._window_closed, (gen,))
        gen.timer.daemon = True
        gen.timer.start()
        self._current[group] = gen
        self._live.append(gen)
        return gen

    def _window_closed(self, gen: _Generation) -> None:
        with self._lock:
            if gen.state == "open":
                self._start(gen)

    def _start(self, gen: _Generation) -> None:
        gen.state = "running"
        if gen.timer is not None:
            gen.timer.cancel()
        threading.Thread(
            target=self._run, args=(gen,), name=f"seed-{gen.group}-{gen.number}", daemon=True
        ).start()

    def _ensure_store(self) -> transport.TCPStore:
        if self._store is None:
            self._store = transport.master_store(self.host, self.timeout_s)
        return self._store

    # -- broadcasting ----------------------------------------------------------------

    def _run(self, gen: _Generation) -> None:
        started = time.time()
        members = tuple(gen.members)
        with self._lock:
            store = self._ensure_store()
        prefix = gen.prefix
        ctl = transport.prefixed(prefix + "ctl/", store)
        seconds, error = self._broadcast(
            len(members) + 1, ctl, transport.prefixed(prefix + "pg/", store)
        )
        if error is not None:  # store errors name keys: keep the secret prefix out of status
            error = error.replace(prefix, store_prefix(gen.group, gen.number) + "…/")
        with self._lock:  # the slot is free for the next group from here on
            self._done(gen)
            if error is None:
                self._seeded[gen.group] = self._seeded.get(gen.group, 0) + len(members)
        results = dict.fromkeys(members, "Unknown")
        if error is None:
            try:
                results = _collect_results(ctl, members, RESULT_WAIT_S)
            except RuntimeError as exc:  # the store failed: results stay Unknown
                log.warning("seeding %s/%d: no receiver results: %s", gen.group, gen.number, exc)
        else:
            log.warning("seeding %s/%d failed: %s", gen.group, gen.number, error)
        record = SeedRecord(
            group=gen.group,
            generation=gen.number,
            root=self.name,
            backend=self.backend,
            receivers=members,
            bytes=self.plan.payload_bytes,
            seconds=seconds,
            started_at=started,
            ok=error is None,
            error=error,
            results=results,
        )
        log.info("seeded %s/%d: %s", gen.group, gen.number, record.to_json())
        with self._lock:
            self._history.append(record)

    def _broadcast(
        self, size: int, ctl: transport.Store, pg_store: transport.Store
    ) -> tuple[float, str | None]:
        """Start the group, send every bucket, tear the group down: (seconds, error)."""
        t0 = time.monotonic()
        pg = None
        try:
            ctl.set(START_KEY, json.dumps({"worldSize": size}))
            pg = transport.new_group(
                self.backend,
                pg_store,
                0,
                size,
                bind_address=self.host,
                timeout_s=self.timeout_s,
                device=self.device,
            )
            send_buckets(
                pg,
                self.plan,
                self.tensors,
                device=self.device,
                timeout_s=self.timeout_s,
                sources=self.sources,
                on_sent=self._after_bucket,
                # A root told to die after N buckets sends one at a time, so that it dies
                # with the broadcast unfinished (e2e test_seeding once saw a receiver get
                # every bucket: all were on the wire before the first one's callback).
                window=1 if self.faults.root_exit_after_buckets is not None else None,
            )
            return time.monotonic() - t0, None
        except Exception as exc:  # any failure ends this broadcast, never the server
            return time.monotonic() - t0, f"{type(exc).__name__}: {exc}"
        finally:
            transport.close_group(pg)

    def _after_bucket(self, sent: int) -> None:
        exit_after = self.faults.root_exit_after_buckets
        if exit_after is not None and sent >= exit_after:
            log.warning("fault injection: root exits after %d buckets", sent)
            os._exit(1)

    # -- status ----------------------------------------------------------------------

    def history(self) -> list[SeedRecord]:
        """Finished broadcasts, oldest first."""
        with self._lock:
            return list(self._history)

    def status_json(self) -> dict[str, Any]:
        with self._lock:
            active = [
                {"group": g.group, "generation": g.number, "state": g.state, "members": g.members}
                for g in self._live
            ]
            history = [r.to_json() for r in self._history]
        return {"root": self.name, "digest": self.digest, "active": active, "history": history}

    def close(self) -> None:
        """Refuse further joins; running broadcasts finish on their own threads."""
        with self._lock:
            self._closed = True
            for gen in list(self._live):
                if gen.state == "open":
                    self._done(gen)
                    if gen.timer is not None:
                        gen.timer.cancel()
                    self._abandon(gen, "the root closed")

    def _abandon(self, gen: _Generation, why: str) -> None:
        if self._store is not None:
            ctl = transport.prefixed(gen.prefix + "ctl/", self._store)
            ctl.set(START_KEY, json.dumps({"abandon": why}))


def _collect_results(
    ctl: transport.Store, members: tuple[str, ...], wait_s: float
) -> dict[str, str]:
    """Each receiver's verification outcome, as far as they report within ``wait_s``."""
    results = dict.fromkeys(members, "Unknown")
    pending = {result_key(rank): member for rank, member in enumerate(members, 1)}
    deadline = time.monotonic() + wait_s
    while pending and time.monotonic() < deadline:
        for key in [k for k in pending if ctl.check([k])]:
            report = json.loads(ctl.get(key))
            results[pending.pop(key)] = "Verified" if report.get("ok") else str(report["reason"])
        if pending:
            time.sleep(0.05)
    return results
