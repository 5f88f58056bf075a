"""Kubernetes-style conditions: set one, keep lastTransitionTime unless the status flips."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from weightship.api.status import (
    CONDITION_TYPES,
    MAX_CONDITION_MESSAGE,
    Condition,
    ConditionStatus,
    ConditionType,
)
from weightship.errortext import bounded


def set_condition(
    conditions: Sequence[Condition],
    type_: ConditionType,
    status: ConditionStatus,
    reason: str,
    message: str,
    *,
    now: datetime,
    generation: int | None = None,
) -> list[Condition]:
    """Return conditions with type_ set. lastTransitionTime moves only when status changes,
    so tools can tell how long something has been true. The message is cut to what the
    schema admits (status.message carries it whole)."""
    previous = next((c for c in conditions if c.type == type_), None)
    transition = (
        previous.last_transition_time if previous is not None and previous.status == status else now
    )
    updated = Condition(
        type=type_,
        status=status,
        reason=reason,
        message=bounded(message, MAX_CONDITION_MESSAGE),
        last_transition_time=transition,
        observed_generation=generation,
    )
    others = [c for c in conditions if c.type != type_]
    return sorted([*others, updated], key=lambda c: CONDITION_TYPES.index(c.type))


def is_true(conditions: Sequence[Condition], type_: ConditionType) -> bool:
    return any(c.type == type_ and c.status == "True" for c in conditions)
