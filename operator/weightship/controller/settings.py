"""The operator's settings: every variable the controller reads, typed and checked in one
place.

`weightship operator` reads them once, before leader election and kopf start, so a bad
value stops the process at once with the variable's name; kopf's startup hooks take them
from kopf's memo (`memo.controller_settings`). Nothing else in the controller reads the
environment. The names are the API layer's (api/env.py); docs/controller.md lists them.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

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
from weightship.controller.builders import DEFAULT_CACHE_DIR
from weightship.controller.leader import (
    DEFAULT_LEASE,
    LEASE_DURATION_S,
    RENEW_DEADLINE_S,
    RETRY_PERIOD_S,
    LeaseConfig,
)

DEFAULT_METRICS_PORT = 9100


class SettingsError(ValueError):
    """A variable's value is malformed; the message names the variable."""


class ControllerSettings(BaseModel):
    """Each field is read from the variable its alias names; unset or empty: the default."""

    model_config = ConfigDict(frozen=True, extra="ignore", allow_inf_nan=False)

    # Worker threads: reconciles, the readiness gates' checks, and kopf's own executor
    # (which runs only sync handlers: reconciles have their pool).
    reconcile_workers: int = Field(16, ge=1, alias=RECONCILE_WORKERS_ENV)
    verify_workers: int = Field(8, ge=1, alias=VERIFY_WORKERS_ENV)
    kopf_max_workers: int = Field(4, ge=1, alias=KOPF_MAX_WORKERS_ENV)
    peering_priority: int = Field(0, alias=PEERING_PRIORITY_ENV)
    # The node cache the agents stage into, as rollout pods mount it (the chart gives the
    # operator and the agents the same agent.cacheDir).
    cache_dir: str = Field(DEFAULT_CACHE_DIR, alias=CACHE_DIR_ENV)
    metrics_port: int = Field(DEFAULT_METRICS_PORT, ge=0, le=65535, alias=METRICS_PORT_ENV)
    leader_elect: bool = Field(False, alias=LEADER_ELECT_ENV)
    leader_elect_namespace: str | None = Field(None, alias=LEADER_ELECT_NAMESPACE_ENV)
    lease_name: str = Field(DEFAULT_LEASE, alias=LEASE_NAME_ENV)
    lease_duration_s: float = Field(LEASE_DURATION_S, gt=0, alias=LEASE_DURATION_ENV)
    renew_deadline_s: float = Field(RENEW_DEADLINE_S, gt=0, alias=RENEW_DEADLINE_ENV)
    retry_period_s: float = Field(RETRY_PERIOD_S, gt=0, alias=RETRY_PERIOD_ENV)
    # The operator pod's own namespace and name (the chart's downward API).
    pod_namespace: str | None = Field(None, alias=POD_NAMESPACE_ENV)
    pod_id: str | None = Field(None, alias=POD_ID_ENV)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> ControllerSettings:
        given = {
            name: value
            for name in (field.alias for field in cls.model_fields.values())
            if name and (value := env.get(name, "").strip())
        }
        try:
            return cls.model_validate(given)
        except ValidationError as error:
            raise SettingsError(_explain(error, given)) from None

    def with_options(
        self,
        *,
        peering_priority: int | None = None,
        leader_elect: bool | None = None,
        leader_elect_namespace: str | None = None,
    ) -> ControllerSettings:
        """`weightship operator`'s options over the variables: an option given wins."""
        options = {
            "peering_priority": peering_priority,
            "leader_elect": leader_elect,
            "leader_elect_namespace": leader_elect_namespace,
        }
        return self.model_copy(update={k: v for k, v in options.items() if v is not None})

    @property
    def identity(self) -> str:
        """This replica's name in the Lease: the pod's (POD_ID, as kopf uses it), else
        host and process."""
        return self.pod_id or f"{socket.gethostname()}_{os.getpid()}"

    def lease(self) -> LeaseConfig:
        return LeaseConfig(
            namespace=self.leader_elect_namespace or self.pod_namespace or "default",
            identity=self.identity,
            name=self.lease_name,
            lease_duration_s=self.lease_duration_s,
            renew_deadline_s=self.renew_deadline_s,
            retry_period_s=self.retry_period_s,
        )

    @model_validator(mode="after")
    def _lease_timings_agree(self) -> ControllerSettings:
        try:
            self.lease()
        except ValueError as error:
            raise ValueError(
                f"{RETRY_PERIOD_ENV}, {RENEW_DEADLINE_ENV} and {LEASE_DURATION_ENV}: {error}"
            ) from None
        return self


def _explain(error: ValidationError, given: Mapping[str, str]) -> str:
    """One line per bad value, each starting with its variable and what it was set to."""
    reasons = []
    for problem in error.errors():
        reason = problem["msg"].removeprefix("Value error, ")
        name = str(problem["loc"][0]) if problem["loc"] else ""
        reasons.append(f"{name}={given[name]!r}: {reason}" if name in given else reason)
    return "; ".join(reasons)
