"""User-side client for ModelRollouts: read them and send imperative requests.

Requests (promote, abort, retry) are written to `status.control` through the status
subresource, never to spec, so GitOps tools see no drift. The controller acknowledges each
request by copying its `requestedAt` into `acknowledged`.
"""

from __future__ import annotations

import getpass
from datetime import UTC, datetime
from typing import Any

from kubernetes import client

from weightship.api.names import GROUP, ROLLOUT_PLURAL, VERSION


def _token() -> str:
    # Microseconds make two quick requests distinct; the controller compares for equality.
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _requester() -> str:
    try:
        return f"cli:{getpass.getuser()}"
    except OSError:
        return "cli"


def get_rollout(api: client.ApiClient, namespace: str, name: str) -> dict[str, Any]:
    return dict(
        client.CustomObjectsApi(api).get_namespaced_custom_object(
            GROUP, VERSION, namespace, ROLLOUT_PLURAL, name
        )
    )


def request(
    api: client.ApiClient, namespace: str, name: str, action: str, **fields: str
) -> dict[str, Any]:
    """Write one control request (promote/abort/retry) and return it."""
    body = {"requestedAt": _token(), "requestedBy": _requester(), **fields}
    client.CustomObjectsApi(api).patch_namespaced_custom_object_status(
        GROUP, VERSION, namespace, ROLLOUT_PLURAL, name, {"status": {"control": {action: body}}}
    )
    return body


def promote(api: client.ApiClient, namespace: str, name: str, full: bool = False) -> dict[str, Any]:
    return request(api, namespace, name, "promote", mode="Full" if full else "Step")


def abort(
    api: client.ApiClient, namespace: str, name: str, reason: str | None = None
) -> dict[str, Any]:
    extra = {"reason": reason} if reason else {}
    return request(api, namespace, name, "abort", **extra)


def retry(api: client.ApiClient, namespace: str, name: str) -> dict[str, Any]:
    return request(api, namespace, name, "retry")


def acknowledged(rollout: dict[str, Any], action: str, token: str) -> bool:
    control = ((rollout.get("status") or {}).get("control") or {}).get(action) or {}
    return bool(control.get("acknowledged") == token)
