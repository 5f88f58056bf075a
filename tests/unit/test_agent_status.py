"""WeightCache status building and the write-rate decision (weightship.agent.status)."""

from datetime import UTC, datetime

import pytest

from weightship.agent.config import AgentConfig, ConfigError
from weightship.agent.status import (
    DiskModel,
    Entry,
    WriteClock,
    build_status,
    mark_written,
    progress_interval_s,
    reconcile,
    recover,
    write_due,
)
from weightship.api.weightcache import WeightCacheStatus

A, B, C, D = ("sha256:" + c * 64 for c in "abcd")
NOW = datetime(2026, 1, 1, 12, tzinfo=UTC)
PIN = ("serving/llm",)


@pytest.mark.parametrize(
    ("nodes", "expected"),
    [(1, 2.0), (100, 2.0), (200, 2.0), (1000, 10.0), (5000, 50.0)],
)
def test_progress_interval_keeps_the_cluster_under_its_budget(nodes: int, expected: float) -> None:
    interval = progress_interval_s(nodes, min_interval_s=2.0, cluster_budget_per_s=100.0)
    assert interval == expected
    assert nodes / interval <= 100  # writes per second, all agents together


@pytest.mark.parametrize(
    ("last", "dirty", "urgent", "now", "due"),
    [
        (0.0, False, True, 0.1, True),  # state change: at once
        (0.0, True, False, 1.0, False),  # progress: not before the interval
        (0.0, True, False, 2.0, True),
        (0.0, False, False, 30.0, False),  # nothing new: only the heartbeat
        (0.0, False, False, 60.0, True),
        (float("-inf"), False, False, 0.0, True),  # never written
    ],
)
def test_write_due(last: float, dirty: bool, urgent: bool, now: float, due: bool) -> None:
    clock = WriteClock(last_write=last, dirty=dirty, urgent=urgent)
    assert write_due(clock, now, interval_s=2.0, heartbeat_s=60.0) is due


def test_mark_written_clears_pending() -> None:
    clock = WriteClock(dirty=True, urgent=True)
    mark_written(clock, 5.0)
    assert (clock.last_write, clock.dirty, clock.urgent) == (5.0, False, False)


def test_reconcile_follows_disk_and_pins() -> None:
    entries = {
        A: Entry(A, "Staging", 10, 100, started_at=NOW),  # became staged on disk
        B: Entry(B, "Staged", 100, 100),  # evicted: gone from disk
        C: Entry(C, "Failed", last_error="disk full", pinned_by=PIN),  # still wanted
        D: Entry(D, "Failed", last_error="old"),  # no longer wanted
    }
    disk = [DiskModel(A, True, 100), DiskModel("sha256:" + "e" * 64, False, 50)]
    out = reconcile(entries, disk, {A: PIN, C: PIN}, None, NOW)
    assert set(out) == {A, C}  # the unwanted partial model is not reported
    assert out[A].state == "Staged" and out[A].bytes_done == 100 and out[A].completed_at == NOW
    assert out[A].pinned_by == PIN
    assert out[C].state == "Failed" and out[C].last_error == "disk full"


def test_reconcile_reports_wanted_partial_and_active_models_as_staging() -> None:
    disk = [DiskModel(A, False, 100), DiskModel(B, True, 100)]
    out = reconcile({}, disk, {A: PIN, C: PIN}, C, NOW)
    assert out[A].state == "Staging" and out[A].bytes_total == 100  # waiting its turn
    assert out[C].state == "Staging" and out[C].started_at == NOW  # being staged
    assert out[B].state == "Staged" and out[B].pinned_by == ()  # kept, unpinned (LRU)
    # The active stage keeps its own state even when its marker appears first.
    active = {A: Entry(A, "Staging", 99, 100)}
    assert reconcile(active, [DiskModel(A, True, 100)], {A: PIN}, A, NOW)[A].state == "Staging"


def test_recover_restarts_counters_of_an_interrupted_stage() -> None:
    previous = build_status(
        peer_endpoint="10.0.0.1:8479",
        capacity_bytes=1000,
        free_bytes=500,
        entries=[
            Entry(A, "Staged", 100, 100, 10, 90, NOW, NOW, pinned_by=PIN),
            Entry(B, "Staging", 40, 100, 30, 10, NOW, pinned_by=PIN),
        ],
        now=NOW,
    )
    got = recover(previous)
    assert got[A] == Entry(A, "Staged", 100, 100, 10, 90, NOW, NOW, pinned_by=PIN)
    assert got[B] == Entry(B, "Staging", 0, 100, 0, 0, NOW, pinned_by=PIN)
    assert recover(None) == {}
    assert recover({"manifests": [{"digest": "bogus", "state": "Staged"}]}) == {}


def test_build_status_matches_the_crd_and_caps_the_list() -> None:
    entries = [Entry(f"sha256:{i:064x}", "Staged", 1, 1) for i in range(70)]
    entries.append(Entry(A, "Failed", last_error="x" * 5000, pinned_by=PIN))
    body = build_status(
        peer_endpoint="10.0.0.1:8479", capacity_bytes=10, free_bytes=-5, entries=entries, now=NOW
    )
    WeightCacheStatus.model_validate(body)
    assert body["peerEndpoint"] == "10.0.0.1:8479" and body["freeBytes"] == 0
    assert body["updatedAt"] == "2026-01-01T12:00:00Z"
    assert len(body["manifests"]) == 64
    failed = next(m for m in body["manifests"] if m["digest"] == A)  # kept before Staged ones
    assert failed["state"] == "Failed" and len(failed["lastError"]) == 1024
    assert failed["pinnedBy"] == ["serving/llm"]
    assert body["stagedManifests"] == 63


def test_config_from_env() -> None:
    cfg = AgentConfig.from_env(
        {
            "NODE_NAME": "gpu-1",
            "POD_IP": "10.0.0.7",
            "WEIGHTSHIP_PEER_PORT": "7070",
            "WEIGHTSHIP_WATCH_NAMESPACES": "ag-*, prod",
        }
    )
    assert cfg.peer_endpoint == "10.0.0.7:7070"
    assert str(cfg.cache_dir) == "/var/cache/weightship" and cfg.metrics_port == 9101
    assert cfg.namespaces == ("ag-*", "prod")
    with pytest.raises(ConfigError, match="NODE_NAME"):
        AgentConfig.from_env({"POD_IP": "10.0.0.7"})
    with pytest.raises(ConfigError, match="WEIGHTSHIP_PEER_PORT"):
        AgentConfig.from_env({"NODE_NAME": "n", "POD_IP": "i", "WEIGHTSHIP_PEER_PORT": "x"})


def test_peer_group_is_a_label_value_or_nothing() -> None:
    base = {"NODE_NAME": "gpu-1", "POD_IP": "10.0.0.7"}
    assert AgentConfig.from_env(base).peer_group == ""
    assert AgentConfig.from_env({**base, "WEIGHTSHIP_PEER_GROUP": " zone-a "}).peer_group == (
        "zone-a"
    )
    for bad in ("-a", "a b", "x" * 64, "a/b"):
        with pytest.raises(ConfigError, match="WEIGHTSHIP_PEER_GROUP"):
            AgentConfig.from_env({**base, "WEIGHTSHIP_PEER_GROUP": bad})
