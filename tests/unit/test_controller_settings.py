"""The operator's settings (controller/settings.py): defaults, each variable, the errors a
bad value gives, and how `weightship operator` and kopf's startup hook take them."""

from __future__ import annotations

import os
import socket

import kopf
import pytest
from click.testing import CliRunner

from weightship.api import env as envnames
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
        (envnames.RECONCILE_WORKERS_ENV, "32", "reconcile_workers", 32),
        (envnames.VERIFY_WORKERS_ENV, " 2 ", "verify_workers", 2),
        (envnames.KOPF_MAX_WORKERS_ENV, "32", "kopf_max_workers", 32),
        (envnames.PEERING_PRIORITY_ENV, "-5", "peering_priority", -5),
        (envnames.CACHE_DIR_ENV, "/mnt/nvme/weights", "cache_dir", "/mnt/nvme/weights"),
        (envnames.METRICS_PORT_ENV, "0", "metrics_port", 0),  # no /metrics
        (envnames.LEADER_ELECT_ENV, "true", "leader_elect", True),
        (envnames.LEADER_ELECT_ENV, "0", "leader_elect", False),
        (envnames.LEADER_ELECT_NAMESPACE_ENV, "ops", "leader_elect_namespace", "ops"),
        (envnames.LEASE_NAME_ENV, "ws-weightship-operator", "lease_name", "ws-weightship-operator"),
        (envnames.LEASE_DURATION_ENV, "30", "lease_duration_s", 30.0),
        (envnames.RENEW_DEADLINE_ENV, "5.5", "renew_deadline_s", 5.5),
        (envnames.RETRY_PERIOD_ENV, "1", "retry_period_s", 1.0),
        (envnames.POD_NAMESPACE_ENV, "weightship-system", "pod_namespace", "weightship-system"),
        (envnames.POD_ID_ENV, "ws-operator-abc", "pod_id", "ws-operator-abc"),
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
    empty = {
        envnames.RECONCILE_WORKERS_ENV: "",
        envnames.CACHE_DIR_ENV: " ",
        envnames.LEASE_NAME_ENV: "",
    }
    assert ControllerSettings.from_env(empty) == ControllerSettings.from_env({})


def test_the_lease_as_the_chart_sets_it() -> None:
    env = {
        envnames.POD_NAMESPACE_ENV: "weightship-system",
        envnames.POD_ID_ENV: "ws-operator-abc",
        envnames.LEASE_NAME_ENV: "ws-weightship-operator",
        envnames.LEASE_DURATION_ENV: "8",
        envnames.RENEW_DEADLINE_ENV: "5",
        envnames.RETRY_PERIOD_ENV: "1",
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
    named = ControllerSettings.from_env({**env, envnames.LEADER_ELECT_NAMESPACE_ENV: "ops"})
    assert named.lease().namespace == "ops"
    assert named.with_options(leader_elect_namespace="other").lease().namespace == "other"


def test_an_option_given_wins_over_its_variable() -> None:
    env = {envnames.PEERING_PRIORITY_ENV: "100", envnames.LEADER_ELECT_ENV: "true"}
    settings = ControllerSettings.from_env(env)
    assert settings.with_options() == settings
    assert settings.with_options(peering_priority=None, leader_elect=None) == settings
    overridden = settings.with_options(peering_priority=7, leader_elect=False)
    assert (overridden.peering_priority, overridden.leader_elect) == (7, False)


@pytest.mark.parametrize(
    ("name", "value", "reason"),
    [
        (envnames.RECONCILE_WORKERS_ENV, "lots", "valid integer"),
        (envnames.VERIFY_WORKERS_ENV, "0", "greater than or equal to 1"),
        (envnames.KOPF_MAX_WORKERS_ENV, "2.5", "valid integer"),
        (envnames.PEERING_PRIORITY_ENV, "high", "valid integer"),
        (envnames.METRICS_PORT_ENV, "70000", "less than or equal to 65535"),
        (envnames.METRICS_PORT_ENV, "-1", "greater than or equal to 0"),
        (envnames.LEADER_ELECT_ENV, "maybe", "valid boolean"),
        (envnames.LEASE_DURATION_ENV, "15s", "valid number"),
        (envnames.RETRY_PERIOD_ENV, "nan", "finite number"),
        (envnames.RENEW_DEADLINE_ENV, "-1", "greater than 0"),
    ],
)
def test_a_bad_value_names_its_variable(name: str, value: str, reason: str) -> None:
    with pytest.raises(SettingsError) as caught:
        ControllerSettings.from_env({name: value})
    assert str(caught.value).startswith(f"{name}={value!r}: ")
    assert reason in str(caught.value)


def test_every_bad_value_is_named_at_once() -> None:
    with pytest.raises(SettingsError) as caught:
        ControllerSettings.from_env(
            {envnames.RECONCILE_WORKERS_ENV: "x", envnames.METRICS_PORT_ENV: "y"}
        )
    assert f"{envnames.RECONCILE_WORKERS_ENV}='x'" in str(caught.value)
    assert f"{envnames.METRICS_PORT_ENV}='y'" in str(caught.value)


def test_lease_timings_that_leave_the_leader_no_time_to_stop_name_all_three() -> None:
    with pytest.raises(SettingsError) as caught:
        ControllerSettings.from_env({envnames.RENEW_DEADLINE_ENV: "20"})  # past the 15 s lease
    message = str(caught.value)
    assert all(name in message for name in (envnames.RETRY_PERIOD_ENV, envnames.RENEW_DEADLINE_ENV))
    assert envnames.LEASE_DURATION_ENV in message
    assert "retry period < renew deadline < lease duration" in message


def test_the_operator_command_stops_at_a_bad_value_before_it_starts() -> None:
    result = CliRunner().invoke(
        main,
        ["operator", "--standalone", "--liveness", ""],
        env={envnames.RECONCILE_WORKERS_ENV: "lots", "KUBECONFIG": "/nonexistent"},
    )
    assert result.exit_code == 1
    assert f"Error: {envnames.RECONCILE_WORKERS_ENV}='lots': " in result.output


def test_the_startup_hook_takes_the_settings_from_kopfs_memo() -> None:
    given = ControllerSettings.from_env(
        {envnames.PEERING_PRIORITY_ENV: "100", envnames.KOPF_MAX_WORKERS_ENV: "32"}
    )
    settings = kopf.OperatorSettings()
    configure(settings=settings, memo=kopf.Memo(controller_settings=given))
    assert (settings.peering.priority, settings.execution.max_workers) == (100, 32)


def test_the_startup_hook_reads_the_variables_when_kopf_runs_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`kopf run` passes an empty memo: the hook reads the same variables itself."""
    monkeypatch.setenv(envnames.KOPF_MAX_WORKERS_ENV, "12")
    settings, memo = kopf.OperatorSettings(), kopf.Memo()
    configure(settings=settings, memo=memo)
    assert settings.execution.max_workers == 12
    assert memo.controller_settings == ControllerSettings.from_env(os.environ)
    monkeypatch.setenv(envnames.KOPF_MAX_WORKERS_ENV, "many")
    with pytest.raises(kopf.PermanentError, match=f"{envnames.KOPF_MAX_WORKERS_ENV}='many'"):
        configure(settings=kopf.OperatorSettings(), memo=kopf.Memo())
