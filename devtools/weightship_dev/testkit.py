"""Helpers shared by the e2e tests and the demo: waiting, namespaces, S3, Prometheus."""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from kubernetes import client
from kubernetes.client.rest import ApiException

from weightship_dev.layout import S3_ACCESS_KEY, S3_SECRET_KEY

T = TypeVar("T")


class WaitTimeout(AssertionError):
    pass


# The Secret e2e tests and the demo put in each namespace (a name, not a password).
S3_SECRET_NAME = "s3-credentials"  # noqa: S105


def local_model(uri: str, endpoint: str, revision: str) -> dict[str, Any]:
    """spec.model for weights on the local S3 server, read with that namespace's Secret."""
    return {
        "source": {
            "uri": uri,
            "endpoint": endpoint,
            "region": "us-east-1",
            "credentialsSecretRef": {"name": S3_SECRET_NAME},
        },
        "revision": revision,
    }


def wait_until(
    check: Callable[[], T | None],
    *,
    timeout: float,
    what: str,
    interval: float = 0.5,
    detail: Callable[[], str] | None = None,
) -> T:
    """Poll `check` until it returns something truthy; fail with `what` (and `detail`)."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while True:
        try:
            value = check()
            if value:
                return value
        except ApiException as e:
            last_error = e
        if time.monotonic() >= deadline:
            extra = f"\n{detail()}" if detail else ""
            err = f" (last error: {last_error})" if last_error else ""
            raise WaitTimeout(f"timed out after {timeout:.0f}s waiting for {what}{err}{extra}")
        time.sleep(interval)


def unique_name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def create_namespace(api: client.ApiClient, prefix: str = "t") -> str:
    core = client.CoreV1Api(api)
    name = unique_name(re.sub(r"[^a-z0-9-]+", "-", prefix.lower())[:40].strip("-") or "t")
    core.create_namespace({"metadata": {"name": name, "labels": {"weightship.io/test": "true"}}})

    def default_sa() -> bool:
        # Pods are rejected until the ServiceAccount controller made "default".
        try:
            core.read_namespaced_service_account("default", name)
        except ApiException as e:
            if e.status == 404:
                return False
            raise
        return True

    wait_until(default_sa, timeout=30, what=f"default ServiceAccount in {name}")
    return name


def delete_namespace(api: client.ApiClient, name: str) -> None:
    try:
        client.CoreV1Api(api).delete_namespace(name)
    except ApiException as e:
        if e.status != 404:
            raise


def s3_client(endpoint: str) -> Any:
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id=S3_ACCESS_KEY,
        aws_secret_access_key=S3_SECRET_KEY,
        config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 3}),
    )


def local_s3(endpoint: str) -> Any:
    """The project's S3 client (`weightship.data.s3.make_client`) for the local server."""
    from weightship.data.s3 import S3Settings, make_client

    return make_client(
        S3Settings(
            endpoint_url=endpoint,
            region="us-east-1",
            access_key_id=S3_ACCESS_KEY,
            secret_access_key=S3_SECRET_KEY,
        )
    )


def empty_bucket(s3: Any, bucket: str) -> None:
    paginator = s3.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=bucket):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            s3.delete_objects(Bucket=bucket, Delete={"Objects": keys})


def pod_dict(api: client.ApiClient, pod: Any) -> dict[str, Any]:
    return dict(api.sanitize_for_serialization(pod))


def condition(obj: dict[str, Any], ctype: str) -> dict[str, Any] | None:
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c.get("type") == ctype:
            return dict(c)
    return None
