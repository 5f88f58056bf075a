"""The Kubernetes client as every weightship process loads it, and the one retry policy.

The controller's adapter (`weightship.controller.kube`), the agent's
(`weightship.agent.kube`), the CLI and devtools load their client with `load_client` and
wrap their API calls in `api_retry`: retries live here, nowhere else.
"""

from __future__ import annotations

import urllib3
from kubernetes import client, config
from kubernetes.client.rest import ApiException
from tenacity import (
    retry,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential_jitter,
)


def _transient(exc: BaseException) -> bool:
    """Retry throttling and server errors; never 4xx decisions like 404, 409 or 422."""
    return isinstance(exc, ApiException) and exc.status in (429, 500, 502, 503, 504)


def unreachable(exc: BaseException) -> bool:
    """The API server did not answer (refused, timed out, no route) or answered that it
    cannot serve now (429, 5xx): an outage to ride out, not a decision to act on."""
    return isinstance(exc, urllib3.exceptions.HTTPError | OSError) or _transient(exc)


api_retry = retry(
    retry=retry_if_exception(_transient),
    wait=wait_exponential_jitter(multiplier=0.2, max=5, jitter=0.2),
    stop=stop_after_attempt(5),
    reraise=True,
)


def load_client(*, kubeconfig_first: bool = False) -> client.ApiClient:
    """In a pod: its service account. Elsewhere: KUBECONFIG or ~/.kube/config.

    `kubeconfig_first` (the CLI): a kubeconfig wins over the pod's service account, so a
    user's own credentials are used wherever they run it. Neither there: ConfigException.
    """
    loaders = [_in_cluster, config.new_client_from_config]
    if kubeconfig_first:
        loaders.reverse()
    try:
        return loaders[0]()
    except config.ConfigException:
        return loaders[1]()


def _in_cluster() -> client.ApiClient:
    config.load_incluster_config()
    return client.ApiClient()
