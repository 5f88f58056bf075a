"""Label selectors, matched as apimachinery matches them.

Two forms: a plain map (`nodeSelector`, `matchLabels`): every key present with an equal
value, and an empty or absent map matches everything; and a metav1.LabelSelector,
`matchLabels` and `matchExpressions` ANDed (`LabelSelectorAsSelector`): `In` and `NotIn`
need at least one value, `Exists` and `DoesNotExist` none; `NotIn` matches a missing key;
an empty selector ({}) matches everything and an absent one (nil) nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist")


def labels_match(match_labels: Mapping[str, str] | None, labels: Mapping[str, str]) -> bool:
    """A map selector: every pair of ``match_labels`` in ``labels``; empty matches all."""
    return all(labels.get(k) == v for k, v in (match_labels or {}).items())


def _requirement(expression: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    key, operator = expression.get("key"), expression.get("operator")
    values = list(expression.get("values") or [])
    if not isinstance(key, str) or not key:
        raise ValueError(f"matchExpressions: a key is required, got {key!r}")
    if operator in ("In", "NotIn") and not values:
        raise ValueError(f"matchExpressions {key}: {operator} needs at least one value")
    if operator in ("Exists", "DoesNotExist") and values:
        raise ValueError(f"matchExpressions {key}: {operator} takes no values")
    if operator == "In":
        return key in labels and labels[key] in values
    if operator == "NotIn":
        return key not in labels or labels[key] not in values
    if operator == "Exists":
        return key in labels
    if operator == "DoesNotExist":
        return key not in labels
    raise ValueError(f"matchExpressions {key}: {operator!r} is not one of {', '.join(OPERATORS)}")


def selector_matches(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """A metav1.LabelSelector against ``labels``; ValueError when it is not a valid one
    (every requirement is checked, as LabelSelectorAsSelector does before matching)."""
    if selector is None:
        return False
    results = [_requirement(e, labels) for e in selector.get("matchExpressions") or []]
    return labels_match(selector.get("matchLabels"), labels) and all(results)
