"""When a node stops relaying (slowrelay.py): the rule its fetcher, its peer server and
the fleet simulator share."""

from __future__ import annotations

from weightship.data.slowrelay import (
    LAG_NOTICES,
    LAG_S,
    LAG_SHARE,
    NOT_RELAYING_S,
    NOTICE_WINDOW_S,
    RelayStatus,
    lags,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_node_stops_relaying_after_lagging_its_parents_three_times_within_a_minute() -> None:
    clock = Clock()
    status = RelayStatus(clock)
    for _ in range(10):
        assert not status.parent_held(LAG_S, LAG_S + 1)  # at LAG_S: not behind enough
    assert status.relaying
    for k in range(LAG_NOTICES):
        clock.now += NOTICE_WINDOW_S / LAG_NOTICES
        assert status.parent_held(LAG_S + 0.5, LAG_S + 1) == (k == LAG_NOTICES - 1)
    assert not status.relaying
    assert not status.parent_held(LAG_S + 0.5, LAG_S + 1)  # already stopped: once a stop
    clock.now += NOT_RELAYING_S + 1
    assert status.relaying  # for NOT_RELAYING_S after its last notice


def test_notices_spread_over_more_than_the_window_never_stop_it() -> None:
    """A healthy node falls behind a parent now and then (its stream cut by a death, say):
    notices that far apart are not a slow link."""
    clock = Clock()
    status = RelayStatus(clock)
    for _ in range(5 * LAG_NOTICES):
        clock.now += NOTICE_WINDOW_S / (LAG_NOTICES - 1) + 1
        assert not status.parent_held(10 * LAG_S, 15 * LAG_S)
    assert status.relaying


def test_a_few_seconds_behind_late_in_a_stage_is_not_a_slow_link() -> None:
    """A node at a tenth of its link falls behind by nine tenths of the time it stages; a
    node held up by a death falls a few seconds behind, late in its stage."""
    assert lags(LAG_S + 1, staging_s=LAG_S + 1.5)  # early: past LAG_S is enough
    assert not lags(LAG_S + 1, staging_s=15.0)  # late: under half the time staged
    assert lags(0.9 * 15.0, staging_s=15.0)
    assert not lags(LAG_SHARE * 15.0, staging_s=15.0)


def test_a_chunk_held_since_before_this_nodes_stage_began_is_no_lag() -> None:
    """A node that begins its stage after its parents (a retry after an S3 error storm, a
    late joiner) finds their first chunks whole: that is no sign of a slow link, and
    three of them must not stop it relaying (it did, and its peers fetched its chunks
    from the origin a second time)."""
    clock = Clock()
    status = RelayStatus(clock)
    for _ in range(3 * LAG_NOTICES):
        clock.now += 0.01
        assert not status.parent_held(LAG_S + 1, staging_s=0.05)
    assert status.relaying
    assert not lags(LAG_S + 1, staging_s=LAG_S + 0.5)  # it landed there before this began
    assert lags(LAG_S + 1, staging_s=LAG_S + 1.5)  # it landed there while this staged
