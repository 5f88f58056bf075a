"""Where a rollout's view of the node cache lives (weightship.data.views). Pure, and
importing only the weight format's node-cache names, so the controller (which builds the
pods that mount a view) and the node agent (which maintains it) share one definition.

    <cacheDir>/views/<rollout-uid>/models/<hex>/{files/, manifest.json, STAGED}
    <cacheDir>/views/<rollout-uid>/ready/<hex>

The uid and the hex are the only variable path elements, and each is checked first: a
lowercase UUID (what Kubernetes gives every object) and 64 hex characters.
"""

from __future__ import annotations

import re

from weightship.weightformat.cachedir import FILES_DIR, MODELS_DIR, manifest_digest_hex

VIEWS_DIR = "views"
READY_DIR = "ready"
UID_PATTERN = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
HEX_PATTERN = re.compile(r"[0-9a-f]{64}")


def check_uid(uid: object) -> str:
    """``uid`` when it is a lowercase UUID (a Kubernetes UID); ValueError otherwise."""
    if not isinstance(uid, str) or not UID_PATTERN.fullmatch(uid):
        raise ValueError(f"not a rollout uid: {str(uid)[:80]!r}")
    return uid


def view_root(cache_dir: str, uid: str) -> str:
    """``<cacheDir>/views/<uid>``: the folder a pod of the rollout mounts."""
    return f"{cache_dir.rstrip('/')}/{VIEWS_DIR}/{check_uid(uid)}"


def view_model_dir(cache_dir: str, uid: str, digest: str) -> str:
    """``<cacheDir>/views/<uid>/models/<hex>/files``: a model's files in the view."""
    return f"{view_root(cache_dir, uid)}/{MODELS_DIR}/{manifest_digest_hex(digest)}/{FILES_DIR}"


def ready_marker(cache_dir: str, uid: str, digest: str) -> str:
    """``<cacheDir>/views/<uid>/ready/<hex>``: exists once the view showed the model;
    the start gate of the pods created for it."""
    return f"{view_root(cache_dir, uid)}/{READY_DIR}/{manifest_digest_hex(digest)}"
