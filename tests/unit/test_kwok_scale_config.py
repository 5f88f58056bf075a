"""The local cluster's KWOK keeps 5,000 nodes alive: its settings file is found and
well-formed, and its lease renewals fit the controller manager's grace period."""

from __future__ import annotations

from pathlib import Path

import yaml

from weightship_dev import components
from weightship_dev.layout import ClusterPaths

PATHS = ClusterPaths(Path("/s"))


def flag(argv: list[str], name: str) -> str:
    (value,) = [a.split("=", 1)[1] for a in argv if a.startswith(f"--{name}=")]
    return value


def test_kwok_loads_its_settings_with_more_workers_than_the_default_four() -> None:
    configs = flag(components.kwok(PATHS), "config").split(",")
    assert str(components.KWOK_CONFIG) in configs and components.KWOK_CONFIG.is_file()
    (doc,) = list(yaml.safe_load_all(components.KWOK_CONFIG.read_text()))
    assert (doc["apiVersion"], doc["kind"]) == (
        "config.kwok.x-k8s.io/v1alpha1",
        "KwokConfiguration",
    )
    options = doc["options"]
    for key in ("nodeLeaseParallelism", "nodePlayStageParallelism", "podPlayStageParallelism"):
        assert options[key] > 4, key
    assert flag(components.kwok(PATHS), "v") == "WARN"


def test_lease_renewals_fit_the_grace_period_with_room_for_one_late_one() -> None:
    lease = int(flag(components.kwok(PATHS), "node-lease-duration-seconds"))
    assert lease == components.KWOK_LEASE_SECONDS
    renewal = lease / 4  # KWOK renews at a quarter of the duration (4 % jitter)
    grace = flag(components.kube_controller_manager(PATHS), "node-monitor-grace-period")
    assert grace == f"{components.NODE_MONITOR_GRACE_SECONDS}s"
    assert 2 * renewal * 1.04 < components.NODE_MONITOR_GRACE_SECONDS
    assert 5000 / renewal <= 100  # lease writes per second at 5,000 nodes


def test_an_earlier_lease_duration_can_be_asked_for() -> None:
    assert flag(components.kwok(PATHS, 40), "node-lease-duration-seconds") == "40"
