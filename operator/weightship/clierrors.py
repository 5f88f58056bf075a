"""One clear line for every way a CLI call to the API server fails, as a kubectl plugin
should: the object named, no traceback, no raw JSON, a non-zero exit."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager

import click
from kubernetes.client.rest import ApiException
from urllib3.exceptions import HTTPError as TransportError

MAX_DETAIL = 300  # a hostile or broken server's message is cut, never echoed whole


def _server_message(error: ApiException) -> str:
    """The Status object's `message`, when the body is one; else the HTTP reason."""
    try:
        body = json.loads(error.body or "")
    except (TypeError, ValueError):
        body = None
    message = body.get("message") if isinstance(body, dict) else None
    text = str(message or error.reason or "").strip()
    return text[:MAX_DETAIL]


def describe_api_error(error: ApiException, what: str) -> str:
    """`what` names the object, e.g. 'modelrollout serving/llm'."""
    detail = _server_message(error)
    if error.status == 404:
        if "could not find the requested resource" in detail:
            return (
                "the ModelRollout API is not installed in this cluster "
                "(kubectl apply -f crds/, or install the Helm chart)"
            )
        return f"{what} not found"
    if error.status == 403:
        return f"forbidden: {detail}" if detail else f"forbidden to access {what}"
    if error.status == 401:
        return "the API server refused the credentials (401 Unauthorized): check KUBECONFIG"
    if error.status == 409:
        return f"{what} changed while this request was written (409 Conflict): try again"
    if error.status == 422:
        return f"the API server rejected the request for {what}: {detail}"
    return f"the API server answered {error.status} for {what}: {detail}"


def describe_transport_error(error: Exception, host: str) -> str:
    reason = getattr(error, "reason", None) or error
    return f"cannot reach the API server at {host}: {str(reason)[:MAX_DETAIL]}"


@contextmanager
def api_errors(what: str, host: str) -> Iterator[None]:
    """Turn API and transport failures inside the block into one-line CLI errors."""
    try:
        yield
    except ApiException as e:
        raise click.ClickException(describe_api_error(e, what)) from None
    except (TransportError, OSError) as e:
        raise click.ClickException(describe_transport_error(e, host)) from None
