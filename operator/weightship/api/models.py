"""The two custom resources, ModelRollout and WeightCache, as parsed by the operator.

Handlers parse the body first (`ModelRollout.model_validate(body)`); a ValidationError means
the object slipped past the CRD schema (e.g. an older CRD) and becomes InvalidSpec.
"""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field

from weightship.api.base import ApiModel
from weightship.api.names import API_VERSION, CACHE_KIND, ROLLOUT_KIND
from weightship.api.spec import ModelRolloutSpec
from weightship.api.status import ModelRolloutStatus
from weightship.api.weightcache import WeightCacheSpec, WeightCacheStatus


class ObjectMeta(ApiModel):
    """The parts of metav1.ObjectMeta the operator reads; the rest is kept as is."""

    model_config = ConfigDict(extra="allow")

    name: str = ""
    namespace: str | None = None
    uid: str | None = None
    generation: int = 0
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)


class ModelRollout(ApiModel):
    """A rollout of model weights to one inference fleet."""

    api_version: str = API_VERSION
    kind: str = ROLLOUT_KIND
    metadata: ObjectMeta = Field(default_factory=ObjectMeta)
    spec: ModelRolloutSpec
    status: ModelRolloutStatus = Field(default_factory=ModelRolloutStatus)

    @classmethod
    def from_body(cls, body: Any) -> ModelRollout:
        """Parse a kopf body or any mapping; raises pydantic.ValidationError."""
        return cls.model_validate(dict(body))


class WeightCache(ApiModel):
    """The weight cache of one node."""

    api_version: str = API_VERSION
    kind: str = CACHE_KIND
    metadata: ObjectMeta = Field(default_factory=ObjectMeta)
    spec: WeightCacheSpec
    status: WeightCacheStatus = Field(default_factory=WeightCacheStatus)
