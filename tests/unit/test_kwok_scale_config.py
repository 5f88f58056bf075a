"""The local cluster's KWOK keeps 5,000 nodes alive: its settings file is found and
well-formed, and its lease renewals fit the controller manager's grace period."""

from __future__ import annotations

from pathlib import Path

import pytest
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


@pytest.mark.parametrize(
    ("lease", "grace"),
    [
        (components.KWOK_LEASE_SECONDS, components.NODE_MONITOR_GRACE_SECONDS),
        components.SCALE_LIVENESS,
    ],
)
def test_lease_renewals_fit_the_grace_period(lease: int, grace: int) -> None:
    kwok = components.kwok(PATHS, lease)
    assert int(flag(kwok, "node-lease-duration-seconds")) == lease
    manager = components.kube_controller_manager(PATHS, grace)
    assert flag(manager, "node-monitor-grace-period") == f"{grace}s"
    renewal = lease / 4 * 1.04  # KWOK renews at a quarter of the duration, 4 % jitter
    assert grace >= 3.5 * renewal or grace > 2 * renewal + 15  # room for a late renewal


def test_the_defaults_are_a_kubelet_s_and_the_scale_profile_writes_100_leases_a_second() -> None:
    # The lost-process-node e2e test waits for NotReady after 40 s.
    assert (components.KWOK_LEASE_SECONDS, components.NODE_MONITOR_GRACE_SECONDS) == (40, 40)
    lease, _grace = components.SCALE_LIVENESS
    assert 5000 / (lease / 4) <= 100
