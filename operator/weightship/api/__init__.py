"""weightship.io/v1alpha1 API: pydantic models that are the single source of truth for the CRDs."""

from weightship.api.models import ModelRollout, ObjectMeta, WeightCache
from weightship.api.names import API_VERSION, GROUP, VERSION
from weightship.api.spec import ModelRolloutSpec
from weightship.api.status import Condition, ModelRolloutStatus
from weightship.api.weightcache import WeightCacheSpec, WeightCacheStatus

__all__ = [
    "API_VERSION",
    "GROUP",
    "VERSION",
    "Condition",
    "ModelRollout",
    "ModelRolloutSpec",
    "ModelRolloutStatus",
    "ObjectMeta",
    "WeightCache",
    "WeightCacheSpec",
    "WeightCacheStatus",
]
