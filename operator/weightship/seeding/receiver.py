"""The receiver side: a new replica takes its weights from a root's broadcast.

Every step is bounded by what is left of ``timeout_s``: the HTTP join, the store
connection, the wait for the group to start, the group rendezvous and each bucket's wait.
A dead root closes its sockets, which fails the wait at once (``RootDied``); a hung one
runs into the deadline (``Timeout``).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from weightship.api.inference import FailureReason
from weightship.seeding import transport
from weightship.seeding.buckets import DEFAULT_BUCKET_BYTES, BucketPlan, new_arena, tensor_at
from weightship.seeding.errors import SeedingError
from weightship.seeding.faults import Faults
from weightship.seeding.protocol import JOIN_PATH, START_KEY, result_key
from weightship.seeding.specs import plan_for, tensor_entries
from weightship.seeding.stream import receive_buckets
from weightship.weightformat.checksum import checksum_tensor
from weightship.weightformat.entries import TensorEntry
from weightship.weightformat.manifest import Manifest

# An HTTP join is answered at once; a root that takes longer is not worth waiting for.
JOIN_HTTP_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Received:
    """Verified tensors (views of one arena on ``device``) and where they came from."""

    tensors: dict[str, torch.Tensor]
    seeded_from: str
    seconds: float  # join to verified
    bytes: int
    group: str = ""
    generation: int = 0
    transfer_seconds: float = 0.0  # first bucket to last, the group already formed
    verify_seconds: float = 0.0


class _Deadline:
    def __init__(self, timeout_s: float) -> None:
        self.end = time.monotonic() + timeout_s

    def left(self) -> float:
        """Seconds left; ``Timeout`` once none are."""
        left = self.end - time.monotonic()
        if left <= 0:
            raise SeedingError("Timeout", "the seeding deadline passed")
        return left

    @property
    def passed(self) -> bool:
        return time.monotonic() >= self.end


def receive(
    root_url: str,
    group_id: str,
    world_size: int,
    manifest: Manifest,
    *,
    member: str,
    device: str | torch.device = "cpu",
    timeout_s: float = 300,
    backend: str = "auto",
    faults: Faults | None = None,
    token: str | None = None,
) -> Received:
    """Join ``group_id`` at the root behind ``root_url``, receive every bucket, verify every
    tensor against the manifest's checksum, and return the tensors on ``device``.
    ``token`` is the join token (``SeedConfig.token``, core.seedtoken); without one the
    root refuses the join.

    Raises ``SeedingError``. On ``ChecksumMismatch`` the replica must refuse to serve (the
    bytes it got are not the manifest's, so it must never turn Ready on them); on every
    other reason it loads from its node cache instead (``SeedingError.fall_back``).
    """
    t0 = time.monotonic()
    deadline = _Deadline(timeout_s)
    entries = _verifiable_entries(manifest)
    device = torch.device(device)
    faults = faults if faults is not None else Faults.from_env()
    if backend == "auto" and device.type != "cuda":
        backend = "gloo"
    join = {
        "group": group_id,
        "worldSize": world_size,
        "member": member,
        "digest": manifest.digest,
        "backend": backend,
        "token": token,
    }
    answer = _join(root_url, join, min(JOIN_HTTP_TIMEOUT_S, deadline.left()))
    if answer.get("digest") != manifest.digest:
        raise SeedingError("RootUnavailable", f"root holds {answer.get('digest')}")
    plan = plan_for(manifest, int(answer["bucketBytes"]))
    rank = int(answer["rank"])
    store, ctl = _connect(answer, deadline)
    size = _wait_start(ctl, deadline)
    pg = None
    try:
        pg = _new_group(answer, store, rank, size, device, deadline)
        verifier, transfer_seconds = _receive_verified(pg, plan, entries, device, faults, deadline)
        if verifier.bad:
            _report(ctl, rank, member, FailureReason.CHECKSUM_MISMATCH, time.monotonic() - t0)
            raise SeedingError(
                FailureReason.CHECKSUM_MISMATCH,
                f"{len(verifier.bad)} of {len(entries)} tensors differ from the manifest, "
                f"first {verifier.bad[0]!r}; refusing to serve them",
            )
        seconds = time.monotonic() - t0
        _report(ctl, rank, member, None, seconds)
    finally:
        transport.close_group(pg)
    return Received(
        tensors=verifier.tensors,
        seeded_from=str(answer["root"]),
        seconds=seconds,
        bytes=plan.payload_bytes,
        group=group_id,
        generation=int(answer["generation"]),
        transfer_seconds=transfer_seconds,
        verify_seconds=verifier.seconds,
    )


def _new_group(
    answer: dict[str, Any],
    store: transport.Store,
    rank: int,
    size: int,
    device: torch.device,
    deadline: _Deadline,
) -> transport.Group:
    """This receiver's rank in the process group the root's answer names."""
    with _classified(deadline):
        return transport.new_group(
            answer["backend"],
            transport.prefixed(answer["storePrefix"] + "pg/", store),
            rank,
            size,
            bind_address=transport.local_address_towards(answer["storeHost"]),
            timeout_s=deadline.left(),
            device=device,
        )


def _verifiable_entries(manifest: Manifest) -> Sequence[TensorEntry]:
    """The manifest's tensor checksums, once its tensors are known to lay out: checked
    before joining, so a receiver that cannot verify or lay out the tensors takes no rank."""
    entries = tensor_entries(manifest)
    try:
        plan_for(manifest, DEFAULT_BUCKET_BYTES)
    except ValueError as exc:  # a dtype torch cannot hold, sizes that contradict shapes
        raise SeedingError(
            FailureReason.NO_TENSOR_CHECKSUMS, f"the tensors cannot be verified: {exc}"
        ) from exc
    return entries


def _receive_verified(
    pg: transport.Group,
    plan: BucketPlan,
    entries: Sequence[TensorEntry],
    device: torch.device,
    faults: Faults,
    deadline: _Deadline,
) -> tuple[_Verifier, float]:
    """Every bucket into one arena on ``device``, each tensor checked as its bucket lands;
    the verifier (its tensors and the bad ones) and the transfer's seconds."""
    arena = new_arena(plan, device)
    verifier = _Verifier(plan, entries, arena, tamper=faults.tamper)
    t_transfer = time.monotonic()
    with _classified(deadline):
        receive_buckets(pg, plan, arena, deadline.left, on_bucket=verifier.bucket_done)
    verifier.finish()
    return verifier, time.monotonic() - t_transfer


def _join(root_url: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    if not root_url.startswith(("http://", "https://")):
        raise SeedingError("RootUnavailable", f"root URL {root_url!r} is not http(s)")
    request = urllib.request.Request(  # noqa: S310 (scheme checked above)
        root_url.rstrip("/") + JOIN_PATH,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:  # noqa: S310
            answer: dict[str, Any] = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:500]
        raise SeedingError("RootUnavailable", f"join refused ({exc.code}): {detail}") from exc
    except (OSError, ValueError) as exc:  # URLError, timeouts and bad JSON are OSError/ValueError
        raise SeedingError("RootUnavailable", f"cannot join at {root_url}: {exc}") from exc
    if not answer.get("accepted"):
        raise SeedingError("RootUnavailable", f"join refused: {answer}")
    return answer


def _connect(
    answer: dict[str, Any], deadline: _Deadline
) -> tuple[transport.TCPStore, transport.Store]:
    try:
        store = transport.client_store(
            str(answer["storeHost"]), int(answer["storePort"]), deadline.left()
        )
    except (RuntimeError, OSError) as exc:  # the store refused or never answered
        raise SeedingError("RootUnavailable", f"cannot reach the root's store: {exc}") from exc
    return store, transport.prefixed(str(answer["storePrefix"]) + "ctl/", store)


def _wait_start(ctl: transport.Store, deadline: _Deadline) -> int:
    """The group's final world size, once the root starts it."""
    with _classified(deadline):
        ctl.wait([START_KEY], timedelta(seconds=deadline.left()))
        start: dict[str, Any] = json.loads(ctl.get(START_KEY))
    if "abandon" in start:
        raise SeedingError("RootUnavailable", f"the root abandoned the group: {start['abandon']}")
    return int(start["worldSize"])


@contextmanager
def _classified(deadline: _Deadline) -> Iterator[None]:
    """Turn a transport failure into Timeout or RootDied."""
    try:
        yield
    except SeedingError:
        raise
    except (RuntimeError, OSError) as exc:
        timed_out = deadline.passed or transport.looks_like_timeout(exc)
        raise SeedingError("Timeout" if timed_out else "RootDied", str(exc)[:500]) from exc


class _Verifier:
    """Checks each tensor against the manifest as soon as its last bucket is in, while the
    backend keeps receiving the buckets queued after it (on a GPU the checksum kernels run
    beside NCCL's stream)."""

    def __init__(
        self,
        plan: BucketPlan,
        entries: Sequence[TensorEntry],
        arena: torch.Tensor,
        *,
        tamper: bool,
    ) -> None:
        self.arena = arena
        self.tensors: dict[str, torch.Tensor] = {}  # filled as they complete, in arrival order
        self.placements = {p.spec.name: p for p in plan.placements}
        self.due: dict[int, list[TensorEntry]] = defaultdict(list)
        for entry in entries:
            self.due[plan.last_bucket_of(entry.name)].append(entry)
        self.bad: list[str] = []
        self.seconds = 0.0
        # Fault injection: corrupt a byte a tensor owns, in the bucket it arrives in.
        first = next((p for p in plan.placements if p.spec.nbytes), None)
        self.tamper_offset = first.offset if tamper and first else None
        self.tamper_bucket = (self.tamper_offset or 0) // plan.bucket_bytes

    def bucket_done(self, index: int) -> None:
        if self.tamper_offset is not None and index == self.tamper_bucket:
            self.arena[self.tamper_offset : self.tamper_offset + 1].bitwise_xor_(0xFF)
        self._check(self.due.pop(index, []))

    def finish(self) -> None:
        """Check what no bucket completed (zero-byte tensors of an empty plan)."""
        for index in sorted(self.due):
            self._check(self.due.pop(index))

    def _check(self, entries: list[TensorEntry]) -> None:
        started = time.monotonic()
        for e in entries:
            tensor = self.tensors[e.name] = tensor_at(self.placements[e.name], self.arena)
            if checksum_tensor(tensor) != e.checksum:
                self.bad.append(e.name)
        self.seconds += time.monotonic() - started


def _report(
    ctl: transport.Store, rank: int, member: str, reason: str | None, seconds: float
) -> None:
    """Tell the root how verification went; best effort, the root only records it."""
    report = {"member": member, "ok": reason is None, "reason": reason, "seconds": seconds}
    with suppress(RuntimeError):
        ctl.set(result_key(rank), json.dumps(report))
