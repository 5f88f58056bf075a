"""Pure reads of a pod's conditions (plain dicts from the API), shared by the observer,
the verifier, the seeding rendezvous and the trivial-gate opener."""

from __future__ import annotations

from typing import Any


def condition(pod: dict[str, Any], ctype: str) -> dict[str, Any] | None:
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == ctype:
            return dict(c)
    return None


def is_true(pod: dict[str, Any], ctype: str) -> bool:
    found = condition(pod, ctype)
    return bool(found and found.get("status") == "True")
