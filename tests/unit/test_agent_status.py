"""WeightCache status building and the write-rate decision (weightship.agent.status)."""

import random
from collections import Counter
from datetime import UTC, datetime

import pytest

from weightship.agent.config import AgentConfig, ConfigError
from weightship.agent.status import (
    DiskModel,
    Entry,
    WriteClock,
    build_status,
    mark_urgent,
    mark_written,
    progress_interval_s,
    reconcile,
    recover,
    report_wait_s,
    state_write_delay_s,
    state_write_window_s,
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


@pytest.mark.parametrize(
    ("nodes", "window"), [(1, 0.01), (3, 0.03), (1000, 10.0), (5000, 50.0), (10_000, 60.0)]
)
def test_state_write_window_fits_the_fleet_under_its_budget(nodes: int, window: float) -> None:
    assert state_write_window_s(nodes) == pytest.approx(window)  # 100 writes/s, 60 s cap
    assert state_write_delay_s(nodes, 0.0) == 0.0
    assert state_write_delay_s(nodes, 0.5) == pytest.approx(window / 2)
    assert state_write_delay_s(nodes, 1.5) == pytest.approx(window)  # a draw is clamped
    assert state_write_window_s(nodes, cluster_budget_per_s=10, max_spread_s=5) == min(
        5, nodes / 10
    )


def test_one_event_on_5000_nodes_stays_near_the_budget_every_second() -> None:
    """Every agent's state changes at the same instant (a new rollout): their writes, at
    each agent's own draw, arrive at about 100 a second instead of 5,000 at once."""
    draws = random.Random(42)
    delays = [state_write_delay_s(5000, draws.random()) for _ in range(5000)]
    per_second = Counter(int(d) for d in delays)
    print(f"5,000 agents: busiest second {max(per_second.values())} writes, last at "
          f"{max(delays):.1f} s")  # fmt: skip
    assert max(delays) < 50.0 and len(per_second) == 50
    assert max(per_second.values()) < 150  # 100/s on average; the draw's noise on top


def test_a_waiting_state_change_keeps_its_turn_and_wakes_the_reporter_then() -> None:
    clock = WriteClock(last_write=0.0)
    mark_urgent(clock, now=10.0, delay_s=3.0)
    mark_urgent(clock, now=11.0, delay_s=0.0)  # a second change joins the first's write
    assert clock.urgent_at == 13.0
    assert not write_due(clock, 12.9, interval_s=10.0, heartbeat_s=60.0)
    assert write_due(clock, 13.0, interval_s=10.0, heartbeat_s=60.0)
    assert report_wait_s(clock, 12.0, poll_s=0.5) == 0.5
    assert report_wait_s(clock, 12.8, poll_s=0.5) == pytest.approx(0.2)
    assert report_wait_s(clock, 14.0, poll_s=0.5) == 0.0
    clock.dirty = True  # progress due before the turn carries the change with it
    assert write_due(clock, 12.0, interval_s=2.0, heartbeat_s=60.0)
    mark_written(clock, 12.0)
    assert report_wait_s(clock, 12.0, poll_s=0.5) == 0.5
    mark_urgent(clock, now=20.0, delay_s=1.0)  # the next change draws a new turn
    assert clock.urgent_at == 21.0


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
    assert failed["pinnedBy"] == ["serving/llm"] and "pinnedByOmitted" not in failed
    assert body["stagedManifests"] == 63
    assert body["manifestsOmitted"] == 71 - 64


def test_build_status_cuts_pins_to_the_crd_and_counts_the_rest() -> None:
    pins = tuple(f"ns-{i:02}/{'r' * 250}" for i in range(11, -1, -1))  # 12, unsorted
    body = build_status(
        peer_endpoint="10.0.0.1:8479",
        capacity_bytes=10,
        free_bytes=5,
        entries=[Entry(A, "Staged", 1, 1, pinned_by=pins)],
        now=NOW,
    )
    WeightCacheStatus.model_validate(body)
    (entry,) = body["manifests"]
    assert entry["pinnedBy"] == sorted(pins)[:8]  # the first by name
    assert entry["pinnedByOmitted"] == 4
    assert "manifestsOmitted" not in body


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
    assert (cfg.cluster_write_budget_per_s, cfg.max_write_spread_s) == (100.0, 60.0)


def test_write_spreading_settings_from_env() -> None:
    base = {"NODE_NAME": "gpu-1", "POD_IP": "10.0.0.7"}
    cfg = AgentConfig.from_env(
        {
            **base,
            "WEIGHTSHIP_STATUS_WRITE_BUDGET": "250",
            "WEIGHTSHIP_STATUS_WRITE_SPREAD_S": "2.5",
        }
    )
    assert (cfg.cluster_write_budget_per_s, cfg.max_write_spread_s) == (250.0, 2.5)
    for name in ("WEIGHTSHIP_STATUS_WRITE_BUDGET", "WEIGHTSHIP_STATUS_WRITE_SPREAD_S"):
        for bad in ("0", "-1", "fast", "inf", "nan"):
            with pytest.raises(ConfigError, match=name):
                AgentConfig.from_env({**base, name: bad})


def test_peer_group_is_a_label_value_or_nothing() -> None:
    base = {"NODE_NAME": "gpu-1", "POD_IP": "10.0.0.7"}
    assert AgentConfig.from_env(base).peer_group == ""
    assert AgentConfig.from_env({**base, "WEIGHTSHIP_PEER_GROUP": " zone-a "}).peer_group == (
        "zone-a"
    )
    for bad in ("-a", "a b", "x" * 64, "a/b"):
        with pytest.raises(ConfigError, match="WEIGHTSHIP_PEER_GROUP"):
            AgentConfig.from_env({**base, "WEIGHTSHIP_PEER_GROUP": bad})
