"""The operator's settings (controller/settings.py): defaults, each variable, the errors a
bad value gives, and how `weightship operator` and kopf's startup hook take them."""

from __future__ import annotations

import os
import socket

import kopf
import pytest
from click.testing import CliRunner

from weightship.api.env import (
    CACHE_DIR_ENV,
    KOPF_MAX_WORKERS_ENV,
    LEADER_ELECT_ENV,
    LEADER_ELECT_NAMESPACE_ENV,
    LEASE_DURATION_ENV,
    LEASE_NAME_ENV,
    METRICS_PORT_ENV,
    PEERING_PRIORITY_ENV,
    POD_ID_ENV,
    POD_NAMESPACE_ENV,
    RECONCILE_WORKERS_ENV,
    RENEW_DEADLINE_ENV,
    RETRY_PERIOD_ENV,
    VERIFY_WORKERS_ENV,
)
from weightship.cli import main
from weightship.controller.handlers import configure
from weightship.controller.leader import LeaseConfig
from weightship.controller.settings import ControllerSettings, SettingsError


def test_defaults() -> None:
    settings = ControllerSettings.from_env({})
    assert settings.model_dump() == {
        "reconcile_workers": 16,
        "verify_workers": 8,
        "kopf_max_workers": 4,
        "peering_priority": 0,
        "cache_dir": "/var/cache/weightship",
        "metrics_port": 9100,
        "leader_elect": False,
        "leader_elect_namespace": None,
        "lease_name": "weightship-operator",
        "lease_duration_s": 15.0,  # controller-runtime's
        "renew_deadline_s": 10.0,
        "retry_period_s": 2.0,
        "pod_namespace": None,
        "pod_id": None,
    }
    assert settings.lease() == LeaseConfig(
        namespace="default", identity=f"{socket.gethostname()}_{os.getpid()}"
    )


@pytest.mark.parametrize(
    ("name", "value", "field", "expected"),
    [
        (RECONCILE_WORKERS_ENV, "32", "reconcile_workers", 32),
        (VERIFY_WORKERS_ENV, " 2 ", "verify_workers", 2),
        (KOPF_MAX_WORKERS_ENV, "32", "kopf_max_workers", 32),
        (PEERING_PRIORITY_ENV, "-5", "peering_priority", -5),
        (CACHE_DIR_ENV, "/mnt/nvme/weights", "cache_dir", "/mnt/nvme/weights"),
        (METRICS_PORT_ENV, "0", "metrics_port", 0),  # no /metrics
        (LEADER_ELECT_ENV, "true", "leader_elect", True),
        (LEADER_ELECT_ENV, "0", "leader_elect", False),
        (LEADER_ELECT_NAMESPACE_ENV, "ops", "leader_elect_namespace", "ops"),
        (LEASE_NAME_ENV, "ws-weightship-operator", "lease_name", "ws-weightship-operator"),
        (LEASE_DURATION_ENV, "30", "lease_duration_s", 30.0),
        (RENEW_DEADLINE_ENV, "5.5", "renew_deadline_s", 5.5),
        (RETRY_PERIOD_ENV, "1", "retry_period_s", 1.0),
        (POD_NAMESPACE_ENV, "weightship-system", "pod_namespace", "weightship-system"),
        (POD_ID_ENV, "ws-operator-abc", "pod_id", "ws-operator-abc"),
    ],
)
def test_each_variable_overrides_its_default(
    name: str, value: str, field: str, expected: object
) -> None:
    settings = ControllerSettings.from_env({name: value})
    assert getattr(settings, field) == expected
    others = ControllerSettings.from_env({}).model_dump()
    assert settings.model_dump() == {**others, field: expected}


def test_an_empty_variable_takes_the_default() -> None:
    empty = {RECONCILE_WORKERS_ENV: "", CACHE_DIR_ENV: " ", LEASE_NAME_ENV: ""}
    assert ControllerSettings.from_env(empty) == ControllerSettings.from_env({})


def test_the_lease_as_the_chart_sets_it() -> None:
    env = {
        POD_NAMESPACE_ENV: "weightship-system",
        POD_ID_ENV: "ws-operator-abc",
        LEASE_NAME_ENV: "ws-weightship-operator",
        LEASE_DURATION_ENV: "8",
        RENEW_DEADLINE_ENV: "5",
        RETRY_PERIOD_ENV: "1",
    }
    assert ControllerSettings.from_env(env).lease() == LeaseConfig(
        namespace="weightship-system",
        identity="ws-operator-abc",
        name="ws-weightship-operator",
        lease_duration_s=8,
        renew_deadline_s=5,
        retry_period_s=1,
    )
    # Its own namespace variable, then the option, win over the pod's namespace.
    named = ControllerSettings.from_env({**env, LEADER_ELECT_NAMESPACE_ENV: "ops"})
    assert named.lease().namespace == "ops"
    assert named.with_options(leader_elect_namespace="other").lease().namespace == "other"


def test_an_option_given_wins_over_its_variable() -> None:
    env = {PEERING_PRIORITY_ENV: "100", LEADER_ELECT_ENV: "true"}
    settings = ControllerSettings.from_env(env)
    assert settings.with_options() == settings
    assert settings.with_options(peering_priority=None, leader_elect=None) == settings
    overridden = settings.with_options(peering_priority=7, leader_elect=False)
    assert (overridden.peering_priority, overridden.leader_elect) == (7, False)


@pytest.mark.parametrize(
    ("name", "value", "reason"),
    [
        (RECONCILE_WORKERS_ENV, "lots", "valid integer"),
        (VERIFY_WORKERS_ENV, "0", "greater than or equal to 1"),
        (KOPF_MAX_WORKERS_ENV, "2.5", "valid integer"),
        (PEERING_PRIORITY_ENV, "high", "valid integer"),
        (METRICS_PORT_ENV, "70000", "less than or equal to 65535"),
        (METRICS_PORT_ENV, "-1", "greater than or equal to 0"),
        (LEADER_ELECT_ENV, "maybe", "valid boolean"),
        (LEASE_DURATION_ENV, "15s", "valid number"),
        (RETRY_PERIOD_ENV, "nan", "finite number"),
        (RENEW_DEADLINE_ENV, "-1", "greater than 0"),
    ],
)
def test_a_bad_value_names_its_variable(name: str, value: str, reason: str) -> None:
    with pytest.raises(SettingsError) as caught:
        ControllerSettings.from_env({name: value})
    assert str(caught.value).startswith(f"{name}={value!r}: ")
    assert reason in str(caught.value)


def test_every_bad_value_is_named_at_once() -> None:
    with pytest.raises(SettingsError) as caught:
        ControllerSettings.from_env({RECONCILE_WORKERS_ENV: "x", METRICS_PORT_ENV: "y"})
    assert f"{RECONCILE_WORKERS_ENV}='x'" in str(caught.value)
    assert f"{METRICS_PORT_ENV}='y'" in str(caught.value)


def test_lease_timings_that_leave_the_leader_no_time_to_stop_name_all_three() -> None:
    with pytest.raises(SettingsError) as caught:
        ControllerSettings.from_env({RENEW_DEADLINE_ENV: "20"})  # past the 15 s lease
    message = str(caught.value)
    assert all(name in message for name in (RETRY_PERIOD_ENV, RENEW_DEADLINE_ENV))
    assert LEASE_DURATION_ENV in message
    assert "retry period < renew deadline < lease duration" in message


def test_the_operator_command_stops_at_a_bad_value_before_it_starts() -> None:
    result = CliRunner().invoke(
        main,
        ["operator", "--standalone", "--liveness", ""],
        env={RECONCILE_WORKERS_ENV: "lots", "KUBECONFIG": "/nonexistent"},
    )
    assert result.exit_code == 1
    assert f"Error: {RECONCILE_WORKERS_ENV}='lots': " in result.output


def test_the_startup_hook_takes_the_settings_from_kopfs_memo() -> None:
    given = ControllerSettings.from_env({PEERING_PRIORITY_ENV: "100", KOPF_MAX_WORKERS_ENV: "32"})
    settings = kopf.OperatorSettings()
    configure(settings=settings, memo=kopf.Memo(controller_settings=given))
    assert (settings.peering.priority, settings.execution.max_workers) == (100, 32)


def test_the_startup_hook_reads_the_variables_when_kopf_runs_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`kopf run` passes an empty memo: the hook reads the same variables itself."""
    monkeypatch.setenv(KOPF_MAX_WORKERS_ENV, "12")
    settings, memo = kopf.OperatorSettings(), kopf.Memo()
    configure(settings=settings, memo=memo)
    assert settings.execution.max_workers == 12
    assert memo.controller_settings == ControllerSettings.from_env(os.environ)
    monkeypatch.setenv(KOPF_MAX_WORKERS_ENV, "many")
    with pytest.raises(kopf.PermanentError, match=f"{KOPF_MAX_WORKERS_ENV}='many'"):
        configure(settings=kopf.OperatorSettings(), memo=kopf.Memo())
