"""Staging failures: how an agent classifies them, how they reach the WeightCache, and
when the operator aborts on them at once (deterministic, two nodes agreeing) or waits
(one node, a full disk, a transient error). Table tests of pure functions, plus the data
plane's origin check on a real chunk store."""

from __future__ import annotations

import dataclasses
import errno
import random
import threading
from contextlib import ExitStack
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import ClientError, EndpointConnectionError
from prometheus_client import CollectorRegistry
from rich.console import Console

from weightship.agent.desired import restarted, wanted
from weightship.agent.failures import StageError, classify
from weightship.agent.status import Entry, build_status, recover
from weightship.api.status import ControlRequest, ControlStatus
from weightship.api.weightcache import StagingFailure, WeightCacheStatus
from weightship.controller.snapshot import prefetch_observation
from weightship.core.decide import decide
from weightship.core.observed import NodeStaging, PrefetchObservation
from weightship.core.staging_failure import deterministic_failure, failed_nodes
from weightship.data.chunkstore import ChunkStore, InsufficientSpaceError
from weightship.data.fetcher import FetchPolicy, OriginMismatchError, Peer
from weightship.data.metrics import DataPlaneMetrics
from weightship.data.modelstaging import ChunkIncompleteError
from weightship.data.peer import PeerServer, PeerUnavailableError
from weightship.data.stage import stage
from weightship.statusview import render
from weightship.weightformat.build import LocalFolder, build_manifest
from weightship.weightformat.entries import ChunkEntry
from weightship_testing.core import (
    DIGEST_B,
    at,
    healthy_rollout,
    observe,
    replica_set,
    with_model_revision,
    with_status,
)

NOW = datetime(2026, 1, 1, 12, tzinfo=UTC)


def Failure(
    reason: Any,
    file: str | None = None,
    chunk: int | None = None,
    offset: int | None = None,
    *,
    bytes_needed: int | None = None,
    bytes_available: int | None = None,
    since: datetime | None = None,
) -> StagingFailure:
    return StagingFailure(
        reason=reason,
        file=file,
        chunk=chunk,
        offset=offset,
        bytes_needed=bytes_needed,
        bytes_available=bytes_available,
        since=since,
    )


CHUNK = ChunkEntry(file="model.safetensors", index=3, offset=3 << 20, size=1 << 20, sha256="a" * 64)


# --- the agent's classification ------------------------------------------------------


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (OriginMismatchError(CHUNK), Failure("OriginMismatch", "model.safetensors", 3, 3 << 20)),
        (
            InsufficientSpaceError(6 << 20, 1234, Path("/cache")),
            Failure("DiskFull", bytes_needed=6 << 20, bytes_available=1234),
        ),
        (OSError(errno.ENOSPC, "No space left on device"), Failure("DiskFull")),
        (OSError(errno.EDQUOT, "Disk quota exceeded"), Failure("DiskFull")),
        (
            StageError("the manifest at s3://m is invalid", "ManifestInvalid"),
            Failure("ManifestInvalid"),
        ),
        (StageError("republished", "ManifestChanged"), Failure("ManifestChanged")),
        (StageError("cannot read the manifest", "SourceUnavailable"), Failure("SourceUnavailable")),
        # transient: S3 5xx after the retries, no route, timeouts, short reads, a dead peer
        (
            ClientError(
                {"Error": {"Code": "SlowDown"}, "ResponseMetadata": {"HTTPStatusCode": 503}},
                "GetObject",
            ),
            Failure("SourceUnavailable"),
        ),
        (EndpointConnectionError(endpoint_url="http://s3"), Failure("SourceUnavailable")),
        (TimeoutError("read timed out"), Failure("SourceUnavailable")),
        (ConnectionResetError("reset"), Failure("SourceUnavailable")),
        (ChunkIncompleteError("stopped at 5 of 10"), Failure("SourceUnavailable")),
        (PeerUnavailableError("10.0.0.2:8479"), Failure("SourceUnavailable")),
        (OSError(errno.EIO, "I/O error"), Failure("StageError")),
        (RuntimeError("bug"), Failure("StageError")),
    ],
)
def test_an_agent_classifies_its_stage_failures(exc: BaseException, expected: Failure) -> None:
    assert classify(exc, NOW) == expected.model_copy(update={"since": NOW})


def test_since_is_kept_while_a_node_fails_the_same_way_and_reset_when_it_fails_otherwise() -> None:
    first = classify(OriginMismatchError(CHUNK), NOW)
    again = classify(OriginMismatchError(CHUNK), NOW + timedelta(seconds=20), first)
    assert again.since == NOW
    other = CHUNK.model_copy(update={"index": 4})
    moved = classify(OriginMismatchError(other), NOW + timedelta(seconds=40), again)
    assert moved.since == NOW + timedelta(seconds=40)
    disk = classify(OSError(errno.ENOSPC, "full"), NOW + timedelta(seconds=60), moved)
    assert disk.since == NOW + timedelta(seconds=60)


def test_the_failure_survives_the_weightcache_round_trip_and_an_agent_restart() -> None:
    failure = Failure("OriginMismatch", "model.safetensors", 3, 3 << 20, since=NOW)
    disk = Failure("DiskFull", bytes_needed=100, bytes_available=7, since=NOW)
    a, b = "sha256:" + "a" * 64, "sha256:" + "b" * 64
    body = build_status(
        peer_endpoint="10.0.0.1:8479",
        capacity_bytes=10,
        free_bytes=7,
        entries=[
            Entry(a, "Failed", last_error="origin bytes …", failure=failure, pinned_by=("ns/llm",)),
            Entry(b, "Failed", last_error="not enough space", failure=disk, pinned_by=("ns/x",)),
        ],
        now=NOW,
    )
    by_digest = {m["digest"]: m for m in body["manifests"]}
    assert by_digest[a]["failure"] == {
        "reason": "OriginMismatch",
        "file": "model.safetensors",
        "chunk": 3,
        "offset": 3 << 20,
        "since": "2026-01-01T12:00:00Z",
    }
    assert by_digest[b]["failure"] == {
        "reason": "DiskFull",
        "bytesNeeded": 100,
        "bytesAvailable": 7,
        "since": "2026-01-01T12:00:00Z",
    }
    WeightCacheStatus.model_validate(body)  # the CRD's shape
    recovered = recover(body)
    assert recovered[a].failure == failure and recovered[b].failure == disk


def test_a_long_file_name_is_clipped_to_the_crd_bound() -> None:
    long = CHUNK.model_copy(update={"file": "d/" * 800 + "w.bin"})
    failure = classify(OriginMismatchError(long), NOW)
    body = build_status(
        peer_endpoint="x:1",
        capacity_bytes=1,
        free_bytes=1,
        entries=[Entry("sha256:" + "a" * 64, "Failed", failure=failure)],
        now=NOW,
    )
    assert len(body["manifests"][0]["failure"]["file"]) == 1024


# --- the data plane: which origin failures are a verdict on the bytes ------------------


def _model(tmp_path: Path) -> tuple[Any, Path]:
    src = tmp_path / "src"
    src.mkdir()
    (src / "w.bin").write_bytes(random.Random(1).randbytes(3 * 16384))
    return build_manifest(LocalFolder(src), chunk_size=16384), src


class TruncatingOrigin:
    """An origin that answers one chunk short, every time (a transient cut, not bad bytes)."""

    def __init__(self, folder: Path) -> None:
        self.local = LocalFolder(folder)

    def read_range(self, path: str, offset: int, size: int) -> bytes:
        return self.local.read_range(path, offset, size)[: size // 2]


def test_origin_bytes_that_changed_raise_an_origin_mismatch_naming_file_and_chunk(
    tmp_path: Path,
) -> None:
    manifest, src = _model(tmp_path)
    data = bytearray((src / "w.bin").read_bytes())
    data[16384 + 5] ^= 0xFF  # chunk 1 changed after the manifest was written
    (src / "w.bin").write_bytes(bytes(data))
    store = ChunkStore(tmp_path / "cache")
    dp = DataPlaneMetrics.create(CollectorRegistry())
    with pytest.raises(OriginMismatchError) as caught:
        stage(manifest, store, LocalFolder(src), [], node="n1", metrics=dp, workers=1)
    assert (caught.value.file, caught.value.index, caught.value.offset) == ("w.bin", 1, 16384)
    assert classify(caught.value, NOW).reason == "OriginMismatch"
    assert not store.is_staged(manifest.digest)


def test_a_short_origin_read_is_not_an_origin_mismatch(tmp_path: Path) -> None:
    manifest, src = _model(tmp_path)
    store = ChunkStore(tmp_path / "cache")
    dp = DataPlaneMetrics.create(CollectorRegistry())
    with pytest.raises(Exception) as caught:
        stage(manifest, store, TruncatingOrigin(src), [], node="n1", metrics=dp, workers=1)
    assert not isinstance(caught.value, OriginMismatchError)
    assert classify(caught.value, NOW).reason != "OriginMismatch"


# --- the operator: abort at once, or wait ----------------------------------------------


def node(
    name: str, reason: str | None, state: str = "Failed", file: str = "w.bin", chunk: int = 3
) -> NodeStaging:
    failure = None
    if reason is not None:
        failure = Failure(
            reason,
            file if reason == "OriginMismatch" else None,
            chunk if reason == "OriginMismatch" else None,
            chunk << 20 if reason == "OriginMismatch" else None,
        )
    return NodeStaging(name, state, message=f"{name}: {reason}", failure=failure)


def seen(*nodes: NodeStaging, targets: int | None = None) -> PrefetchObservation:
    return PrefetchObservation(
        digest=DIGEST_B,
        target_nodes=len(nodes) if targets is None else targets,
        staged_nodes=sum(n.state == "Staged" for n in nodes),
        nodes=nodes,
    )


@pytest.mark.parametrize(
    ("observation", "abort_reason"),
    [
        # two nodes agree on the same chunk: abort
        (
            seen(
                node("a", "OriginMismatch"), node("b", "OriginMismatch"), node("c", None, "Staging")
            ),
            "OriginMismatch",
        ),
        # one retrying (Staging) with the failure kept still counts
        (
            seen(
                node("a", "OriginMismatch"),
                node("b", "OriginMismatch", "Staging"),
                node("c", None, "Pending"),
            ),
            "OriginMismatch",
        ),
        # a single target node: its word is all there is
        (seen(node("a", "ManifestInvalid")), "ManifestInvalid"),
        (seen(node("a", "ManifestChanged"), node("b", "ManifestChanged")), "ManifestChanged"),
        # one node alone never aborts: its disk, network or agent may be what is wrong
        (
            seen(
                node("a", "OriginMismatch"), node("b", None, "Staging"), node("c", None, "Pending")
            ),
            None,
        ),
        (seen(node("a", "ManifestInvalid"), node("b", None, "Staging")), None),
        # two nodes, different chunks: not the same failure
        (seen(node("a", "OriginMismatch", chunk=1), node("b", "OriginMismatch", chunk=2)), None),
        # transient and per-node failures never abort, however many nodes
        (
            seen(
                node("a", "SourceUnavailable"),
                node("b", "SourceUnavailable"),
                node("c", "SourceUnavailable"),
            ),
            None,
        ),
        (seen(node("a", "DiskFull"), node("b", "DiskFull"), node("c", None, "Staged")), None),
        (seen(node("a", "StageError"), node("b", "StageError")), None),
        # a staged node's stale failure is not a failure
        (seen(node("a", "OriginMismatch", "Staged"), node("b", "OriginMismatch")), None),
        # mixed reasons do not add up
        (seen(node("a", "OriginMismatch"), node("b", "ManifestInvalid")), None),
        (seen(), None),
    ],
)
def test_deterministic_failure_needs_two_agreeing_nodes(
    observation: PrefetchObservation, abort_reason: str | None
) -> None:
    verdict = deterministic_failure(observation)
    assert (verdict.reason if verdict else None) == abort_reason


def test_the_verdict_names_file_chunk_and_nodes() -> None:
    verdict = deterministic_failure(
        seen(
            node("n2", "OriginMismatch"), node("n1", "OriginMismatch"), node("n3", None, "Staging")
        )
    )
    assert verdict is not None
    assert verdict.nodes == ("n1", "n2")
    assert "w.bin chunk 3 (offset 3145728)" in verdict.message
    assert "on 2 of 3 nodes (n1, n2)" in verdict.message
    assert dict(verdict.details) == {
        "staging failure": "OriginMismatch",
        "nodes": "n1, n2",
        "file": "w.bin",
        "chunk": "3 (offset 3145728)",
    }


def test_failed_nodes_names_a_full_disk_with_its_bytes() -> None:
    full = NodeStaging(
        "n3",
        "Failed",
        failure=Failure("DiskFull", bytes_needed=6 << 20, bytes_available=0),
    )
    text = failed_nodes(seen(NodeStaging("n1", "Staged"), full))
    assert text == "failed on 1: n3: DiskFull (needs 6291456 B, 0 B available)"
    assert failed_nodes(seen(NodeStaging("n1", "Staged"))) == ""


def prefetching(observation: PrefetchObservation) -> tuple[Any, Any]:
    """A Healthy v1 whose v2 (DIGEST_B) is prefetching, then one decide on ``observation``."""
    rollout, stable = healthy_rollout([{"setWeight": 25}, {"pause": {}}])
    rollout = with_model_revision(rollout, "v2")
    waiting = observe(
        replica_set(stable, 4), digest=DIGEST_B, prefetch=seen(node("a", None, "Staging"))
    )
    rollout = with_status(rollout, decide(rollout, waiting, at(60)))
    assert rollout.status.phase == "Prefetching"
    decision = decide(
        rollout, observe(replica_set(stable, 4), digest=DIGEST_B, prefetch=observation), at(61)
    )
    return with_status(rollout, decision), decision


def test_two_nodes_with_the_same_origin_mismatch_abort_the_rollout_at_once() -> None:
    rollout, decision = prefetching(
        seen(
            node("n1", "OriginMismatch"), node("n2", "OriginMismatch"), node("n3", None, "Staging")
        )
    )
    status = rollout.status
    assert status.phase == "Degraded"
    assert status.abort is not None and status.abort.reason == "OriginMismatch"
    assert "w.bin chunk 3" in status.abort.message
    aborted = status.condition("Aborted")
    assert aborted is not None and aborted.reason == "OriginMismatch"
    assert "w.bin chunk 3" in aborted.message
    prefetched = status.condition("Prefetched")
    assert prefetched is not None and (prefetched.status, prefetched.reason) == (
        "False",
        "OriginMismatch",
    )
    events = [e for e in decision.events if e.reason == "OriginMismatch"]
    assert len(events) == 1 and "w.bin chunk 3" in events[0].message
    assert status.history[-1].reason == "OriginMismatch"
    # Slack: the sample rollout notifies RolledBack; the message and fields name it.
    notes = [n for n in decision.notifications if n.event == "RolledBack"]
    assert len(notes) == 1
    details = dict(notes[0].details)
    assert "w.bin chunk 3" in notes[0].message
    assert details["file"] == "w.bin" and details["chunk"].startswith("3")


@pytest.mark.parametrize(
    "observation",
    [
        seen(
            node("n1", "OriginMismatch"), node("n2", None, "Staging"), node("n3", None, "Staging")
        ),
        seen(node("n1", "DiskFull"), NodeStaging("n2", "Staged"), NodeStaging("n3", "Staged")),
        seen(
            node("n1", "SourceUnavailable"),
            node("n2", "SourceUnavailable"),
            node("n3", "SourceUnavailable"),
        ),
    ],
    ids=["one-node-mismatch", "disk-full", "s3-errors"],
)
def test_other_failures_wait_within_the_deadline_and_say_why(
    observation: PrefetchObservation,
) -> None:
    rollout, _ = prefetching(observation)
    assert rollout.status.phase == "Prefetching"
    assert rollout.status.abort is None
    prefetched = rollout.status.condition("Prefetched")
    assert prefetched is not None and prefetched.status == "False"
    assert "failed on" in prefetched.message and "n1:" in prefetched.message


def test_a_full_disk_on_one_node_shows_in_the_rollouts_status() -> None:
    full = NodeStaging(
        "n3",
        "Failed",
        0,
        6 << 20,
        "not enough space",
        failure=Failure("DiskFull", bytes_needed=6 << 20, bytes_available=0),
    )
    rollout, _ = prefetching(seen(NodeStaging("n1", "Staged"), NodeStaging("n2", "Staged"), full))
    assert rollout.status.prefetch is not None
    (shown,) = rollout.status.prefetch.nodes
    assert shown.name == "n3" and shown.failure is not None
    assert (shown.failure.reason, shown.failure.bytes_needed) == ("DiskFull", 6 << 20)


def test_the_operator_reads_the_failure_from_the_weightcache() -> None:
    def cache(name: str, failure: dict[str, Any] | None) -> dict[str, Any]:
        entry: dict[str, Any] = {"digest": DIGEST_B, "state": "Failed", "lastError": "x"}
        if failure is not None:
            entry["failure"] = failure
        return {
            "metadata": {"name": name},
            "spec": {"nodeName": name},
            "status": {"manifests": [entry]},
        }

    mismatch = {
        "reason": "OriginMismatch",
        "file": "w.bin",
        "chunk": 3,
        "offset": 3 << 20,
        "since": "2026-01-01T12:00:00Z",
    }
    observation = prefetch_observation(
        DIGEST_B,
        ["n1", "n2", "n3", "n4"],
        [
            cache("n1", mismatch),
            cache("n2", mismatch),
            cache("n3", {"reason": "NotAReason"}),  # not the CRD's shape: no failure
            cache("n4", None),  # an old agent: no failure field
        ],
    )
    failures = {n.name: n.failure for n in observation.nodes}
    assert failures["n1"] == Failure("OriginMismatch", "w.bin", 3, 3 << 20, since=NOW)
    assert failures["n3"] is None and failures["n4"] is None
    verdict = deterministic_failure(observation)
    assert verdict is not None and verdict.nodes == ("n1", "n2")


def test_weightship_status_shows_each_failing_nodes_reason() -> None:
    rollout = {
        "metadata": {"name": "llm", "namespace": "serving"},
        "spec": {"replicas": 2, "strategy": {"canary": {"steps": [{"setWeight": 100}]}}},
        "status": {
            "phase": "Prefetching",
            "prefetch": {
                "stagedNodes": 1,
                "targetNodes": 3,
                "nodes": [
                    {
                        "name": "proc-2",
                        "state": "Failed",
                        "failure": {"reason": "DiskFull", "bytesNeeded": 100, "bytesAvailable": 7},
                    },
                    {
                        "name": "proc-1",
                        "state": "Staging",
                        "failure": {"reason": "OriginMismatch", "file": "w.bin", "chunk": 3},
                    },
                    {"name": "proc-0", "state": "Staging", "bytesDone": 1, "bytesTotal": 2},
                ],
            },
        },
    }
    console = Console(width=200, record=True)
    console.print(render(rollout))
    lines = console.export_text().splitlines()
    assert any("proc-2" in ln and "DiskFull (needs 100 B, 7 B available)" in ln for ln in lines)
    assert any("proc-1" in ln and "OriginMismatch (w.bin chunk 3)" in ln for ln in lines)


def test_every_node_finds_a_bad_origin_chunk_at_once_not_after_the_owner_wait(
    tmp_path: Path,
) -> None:
    """The chunk's owner fails it at the origin and its peer server says so (410): the
    others fetch it from the origin themselves at once and fail alike, instead of
    waiting ``owner_wait_s`` for an owner that will never have it (claims off, and a wait
    far past the join below: without the 410 this test fails)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "w.bin").write_bytes(random.Random(2).randbytes(6 * 16384))
    manifest = build_manifest(LocalFolder(src), chunk_size=16384)
    data = bytearray((src / "w.bin").read_bytes())
    data[4 * 16384 + 7] ^= 0xFF  # chunk 4 changed after the manifest was written
    (src / "w.bin").write_bytes(bytes(data))
    nodes = ["node-a", "node-b", "node-c"]
    stores = {n: ChunkStore(tmp_path / n) for n in nodes}
    dp = DataPlaneMetrics.create(CollectorRegistry())
    policy = FetchPolicy(peer_timeout_s=2, owner_wait_s=600, poll_interval_s=0.01, claims=False)
    errors: dict[str, BaseException] = {}
    with ExitStack() as stack:
        servers = {n: stack.enter_context(PeerServer(stores[n], "127.0.0.1")) for n in nodes}
        peers = [Peer(n, servers[n].address) for n in nodes]

        def run(n: str) -> None:
            try:
                stage(
                    manifest,
                    stores[n],
                    LocalFolder(src),
                    peers,
                    node=n,
                    metrics=dp,
                    policy=policy,
                    workers=2,
                )
            except BaseException as exc:
                errors[n] = exc

        threads = [threading.Thread(target=run, args=(n,), daemon=True) for n in nodes]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        cancel_waits = [t for t in threads if t.is_alive()]
        assert not cancel_waits, "a node kept waiting for the owner of the bad chunk"
    assert set(errors) == set(nodes), errors
    for n, exc in errors.items():
        assert isinstance(exc, OriginMismatchError), (n, exc)
        assert (exc.file, exc.index) == ("w.bin", 4)
        assert not stores[n].is_staged(manifest.digest)


def test_after_a_retry_only_failures_of_new_attempts_abort_again() -> None:
    """The user restores the bytes and retries: the failures reported before the retry
    are what was fixed and never abort it again; a failure of an attempt started after
    it does."""

    def failed_at(name: str, started: float) -> NodeStaging:
        return dataclasses.replace(node(name, "OriginMismatch"), started_at=at(started))

    rollout, _ = prefetching(seen(failed_at("n1", 60.5), failed_at("n2", 60.6)))
    assert rollout.status.abort is not None and rollout.status.abort.reason == "OriginMismatch"
    stable = rollout.status.stable_revision
    assert stable is not None
    stale = observe(
        replica_set(stable.pod_template_hash, 4),
        digest=DIGEST_B,
        prefetch=seen(failed_at("n1", 60.5), failed_at("n2", 60.6)),
    )
    control = ControlStatus(retry=ControlRequest(requested_at="r1"))
    retried = rollout.model_copy(
        update={"status": rollout.status.model_copy(update={"control": control})}
    )
    retried = with_status(retried, decide(retried, stale, at(100)))
    assert retried.status.abort is None and retried.status.phase == "Prefetching"
    retried = with_status(retried, decide(retried, stale, at(101)))
    assert retried.status.abort is None  # still the old attempts' word

    # The agents start again at once: Staging, the last attempt's failure kept beside it
    # (a row of failures that began before the retry): not a new attempt's word either.
    def restaged(name: str, started: float) -> NodeStaging:
        kept = dataclasses.replace(failed_at(name, started), state="Staging")
        assert kept.failure is not None
        return dataclasses.replace(kept, failure=kept.failure.model_copy(update={"since": at(60)}))

    restarted = observe(
        replica_set(stable.pod_template_hash, 4),
        digest=DIGEST_B,
        prefetch=seen(restaged("n1", 102), restaged("n2", 102)),
    )
    retried = with_status(retried, decide(retried, restarted, at(103)))
    assert retried.status.abort is None, retried.status.message
    fresh = observe(
        replica_set(stable.pod_template_hash, 4),
        digest=DIGEST_B,
        prefetch=seen(failed_at("n1", 105), failed_at("n2", 106)),
    )
    again = with_status(retried, decide(retried, fresh, at(107)))
    assert again.status.abort is not None and again.status.abort.reason == "OriginMismatch"


def test_the_operator_reads_when_each_attempt_started() -> None:
    entry = {"digest": DIGEST_B, "state": "Failed", "startedAt": "2026-01-01T12:00:00Z"}
    cache = {"metadata": {"name": "n1"}, "status": {"manifests": [entry]}}
    (n1,) = prefetch_observation(DIGEST_B, ["n1"], [cache]).nodes
    assert n1.started_at == NOW
    entry["startedAt"] = "yesterday"
    (n1,) = prefetch_observation(DIGEST_B, ["n1"], [cache]).nodes
    assert n1.started_at is None


def test_a_retried_rollout_restarts_the_agents_back_off() -> None:
    def rollout(started: str, role: str = "canaryRevision") -> dict[str, Any]:
        return {
            "metadata": {"namespace": "ns", "name": "llm"},
            "spec": {"prefetch": {"enabled": True}},
            "status": {role: {"manifestDigest": DIGEST_B}, "stepStartTime": started},
        }

    seen: dict[str, str] = {}
    first = wanted([rollout("2026-01-01T12:00:00Z")], {})
    assert first[0].attempt == "2026-01-01T12:00:00Z"
    assert restarted(first, seen) == set()  # first sight: nothing to restart
    assert restarted(first, seen) == set()
    retried = wanted([rollout("2026-01-01T12:05:00Z")], {})
    assert restarted(retried, seen) == {DIGEST_B}
    assert restarted(retried, seen) == set()
    # A stable's digest has no attempt: its step times say nothing about staging it.
    stable = wanted([rollout("2026-01-01T12:09:00Z", "stableRevision")], {})
    assert stable[0].attempt == "" and restarted(stable, seen) == set()
    assert restarted([], seen) == set() and seen == {}
