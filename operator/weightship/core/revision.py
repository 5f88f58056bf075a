"""The revision hash that names a canary ReplicaSet: pod template plus weights identity."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

HASH_LENGTH = 10


def revision_hash(
    template: Mapping[str, Any], *, model_uri: str, model_revision: str, manifest_digest: str
) -> str:
    """Stable across processes and dict orderings; changes when the pods would differ."""
    identity = {
        "template": template,
        "model": {"uri": model_uri, "revision": model_revision, "digest": manifest_digest},
    }
    canonical = json.dumps(identity, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:HASH_LENGTH]


def template_hash(template: Mapping[str, Any]) -> str:
    """The pod template alone: two revisions with the same one differ only in their
    weights, so running pods can swap from one to the other in place."""
    canonical = json.dumps({"template": template}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:HASH_LENGTH]
