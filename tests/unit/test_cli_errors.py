"""Unit tests of the CLI's one-line errors for answers a test cluster cannot easily give."""

from __future__ import annotations

import json

import click
import pytest
from kubernetes.client.rest import ApiException

from weightship.clierrors import MAX_DETAIL, api_errors, describe_api_error

WHAT = "modelrollout serving/llm"


def status_error(code: int, message: str) -> ApiException:
    error = ApiException(status=code, reason="Reason")
    error.body = json.dumps({"kind": "Status", "message": message, "code": code})
    return error


def test_conflict_names_the_object_and_says_try_again() -> None:
    line = describe_api_error(status_error(409, "the object has been modified"), WHAT)
    assert line == f"{WHAT} changed while this request was written (409 Conflict): try again"


def test_missing_crd_says_how_to_install_it() -> None:
    line = describe_api_error(
        status_error(404, "the server could not find the requested resource"), WHAT
    )
    assert "not installed" in line and "crds/" in line


def test_server_message_is_bounded_and_body_never_dumped() -> None:
    line = describe_api_error(status_error(500, "x" * 10_000), WHAT)
    assert len(line) < MAX_DETAIL + 100
    error = ApiException(status=502, reason="Bad Gateway")
    error.body = "<html>" + "y" * 5000
    assert describe_api_error(error, WHAT) == f"the API server answered 502 for {WHAT}: Bad Gateway"


def test_api_errors_raises_click_exception_without_chaining() -> None:
    with pytest.raises(click.ClickException) as caught, api_errors(WHAT, "https://h"):
        raise status_error(404, 'modelrollouts.weightship.io "llm" not found')
    assert caught.value.message == f"{WHAT} not found"
    assert caught.value.__cause__ is None
