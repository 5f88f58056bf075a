"""Pure helpers of the decision core: durations, replica math, conditions, PromQL, patches."""

from __future__ import annotations

from datetime import timedelta

import pytest

from weightship.api.durations import parse_duration
from weightship.api.promql import TemplateError, placeholders, render_query
from weightship.api.spec import CanaryStep
from weightship.api.status import MAX_CONDITION_MESSAGE
from weightship.core.conditions import set_condition
from weightship.core.patch import merge_patch
from weightship.core.phase import argocd_health, compute_phase
from weightship.core.replicas import canary_replicas, replica_counts, weight_at_step
from weightship.core.revision import revision_hash
from weightship_testing.core import at


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("30s", 30), ("5m", 300), ("1h30m", 5400), ("1.5h", 5400), ("250ms", 0.25), ("2h0m5s", 7205)],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == timedelta(seconds=seconds)


@pytest.mark.parametrize("text", ["", "5", "-5s", "5 m", "1d", "m5", "5m ", "1h-30m"])
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="Go syntax"):
        parse_duration(text)


@pytest.mark.parametrize(
    ("total", "weight", "canary"),
    [
        (10, 0, 0),
        (10, 1, 1),
        (10, 10, 1),
        (10, 11, 2),
        (4, 25, 1),
        (4, 26, 2),
        (7, 100, 7),
        (0, 50, 0),
    ],
)
def test_canary_replicas_round_up(total: int, weight: int, canary: int) -> None:
    assert canary_replicas(total, weight) == canary
    assert replica_counts(total, weight).stable == total


def test_canary_replicas_rejects_bad_weight() -> None:
    with pytest.raises(ValueError, match="outside"):
        canary_replicas(4, 101)


def test_weight_at_step_is_last_set_weight() -> None:
    steps = [
        CanaryStep(set_weight=10),
        CanaryStep.model_validate({"pause": {}}),
        CanaryStep(set_weight=40),
    ]
    assert [weight_at_step(steps, i) for i in range(4)] == [10, 10, 40, 100]
    assert weight_at_step([CanaryStep.model_validate({"pause": {}})], 0) == 0


def test_condition_transition_time_moves_only_on_status_change() -> None:
    conditions = set_condition([], "Verified", "False", "Waiting", "0/2", now=at(0))
    conditions = set_condition(conditions, "Verified", "False", "Waiting", "1/2", now=at(10))
    assert conditions[0].last_transition_time == at(0)
    assert conditions[0].message == "1/2"
    conditions = set_condition(conditions, "Verified", "True", "Verified", "2/2", now=at(20))
    assert conditions[0].last_transition_time == at(20)


def test_a_condition_message_is_cut_to_what_the_crd_admits() -> None:
    (condition,) = set_condition([], "InvalidSpec", "True", "Invalid", "x" * 40_000, now=at(0))
    assert len(condition.message) == MAX_CONDITION_MESSAGE and condition.message.endswith("…")


def test_conditions_keep_a_stable_order() -> None:
    conditions = set_condition([], "InvalidSpec", "False", "Valid", "", now=at(0))
    conditions = set_condition(conditions, "Prefetched", "True", "Staged", "", now=at(0))
    assert [c.type for c in conditions] == ["Prefetched", "InvalidSpec"]


def test_render_query_substitutes_and_escapes() -> None:
    query = 'rate(x{ns="{{ namespace }}",rev="{{canaryRevision}}"}[{{ interval }}])'
    rendered = render_query(query, {"namespace": "a", "canaryRevision": 'v"2', "interval": "1m"})
    assert rendered == 'rate(x{ns="a",rev="v\\"2"}[1m])'
    assert placeholders(query) == {"namespace", "canaryRevision", "interval"}


def test_render_query_rejects_unknown_variables() -> None:
    with pytest.raises(TemplateError, match="unknown variable"):
        render_query("x{a='{{ nope }}'}", {"namespace": "a"})


def test_merge_patch_sets_changes_and_nulls_removals() -> None:
    old = {"a": 1, "b": {"c": 1, "d": 2}, "e": [1], "gone": True}
    new = {"a": 1, "b": {"c": 1, "d": 3}, "e": [1, 2], "new": "x"}
    assert merge_patch(old, new) == {"b": {"d": 3}, "e": [1, 2], "gone": None, "new": "x"}
    assert merge_patch(new, new) == {}


def test_revision_hash_is_stable_and_sensitive() -> None:
    base = {"spec": {"containers": [{"name": "s"}]}}
    kwargs = {"model_uri": "s3://b/p/", "model_revision": "v1", "manifest_digest": "sha256:x"}
    assert revision_hash(base, **kwargs) == revision_hash(dict(reversed(base.items())), **kwargs)
    assert revision_hash(base, **kwargs) != revision_hash(
        base, **{**kwargs, "model_revision": "v2"}
    )
    assert len(revision_hash(base, **kwargs)) == 10


@pytest.mark.parametrize(
    ("flags", "phase"),
    [
        ({"invalid": True, "paused": True}, "Degraded"),
        ({"aborted": True}, "Degraded"),
        ({"paused": True, "prefetching": True}, "Paused"),
        ({"prefetching": True}, "Prefetching"),
        ({"settled": True}, "Healthy"),
        ({}, "Progressing"),
    ],
)
def test_compute_phase(flags: dict[str, bool], phase: str) -> None:
    base = {
        "invalid": False,
        "aborted": False,
        "paused": False,
        "prefetching": False,
        "settled": False,
    }
    assert compute_phase(**{**base, **flags}) == phase


def test_argocd_health() -> None:
    assert argocd_health("Paused", generation=2, observed_generation=2) == "Suspended"
    assert argocd_health("Healthy", generation=3, observed_generation=2) == "Progressing"
    assert argocd_health("Degraded", generation=3, observed_generation=3) == "Degraded"
