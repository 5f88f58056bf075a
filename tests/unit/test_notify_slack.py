"""Slack messages: payload shape, sending over real HTTP, retries, and secrecy of the URL."""

from __future__ import annotations

import logging
import socket
import threading

import pytest

from weightship.core.decision import Notification
from weightship.notify.blocks import payload
from weightship.notify.slack import SlackSender, redact
from weightship_dev.slackreceiver import SlackReceiver, payload_problem

NOTE = Notification(
    "RolledBack",
    "GoldenPromptFailed",
    "pod llm-x: prompt 'capital' expected contains 'Paris', got 'Lyon'",
    (("rollout", "serving/llm"), ("canary", "v3"), ("stable", "v2"), ("weight", "10%")),
)


def test_payload_is_block_kit_slack_accepts_and_names_the_failure() -> None:
    body = payload(NOTE, "#ml-oncall")
    assert payload_problem(body) is None
    assert body["channel"] == "#ml-oncall"
    assert "serving/llm: RolledBack" in body["blocks"][0]["text"]["text"]
    assert "expected contains 'Paris', got 'Lyon'" in body["blocks"][1]["text"]["text"]
    fields = [f["text"] for f in body["blocks"][2]["fields"]]
    assert "*canary*\nv3" in fields and "*weight*\n10%" in fields


def test_sender_delivers_to_the_webhook() -> None:
    with SlackReceiver() as slack:
        sender = SlackSender()
        sender.submit(slack.url, payload(NOTE))
        sender.close()
    assert len(slack.received) == 1
    assert slack.paths == ["/services/T000/B000/secret-token"]


def test_unreachable_webhook_is_reported_without_its_secret(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/services/T000/B000/secret-token"
    failures: list[str] = []
    done = threading.Event()

    def on_failure(error: str) -> None:
        failures.append(error)
        done.set()

    sender = SlackSender(attempts=2)
    sender.submit(url, payload(NOTE), on_failure=on_failure)
    assert done.wait(30)
    sender.close()
    assert failures and "secret-token" not in failures[0]
    assert "127.0.0.1/…" in failures[0]
    assert "secret-token" not in caplog.text, "the webhook URL was logged"


def test_rejected_payload_is_retried_then_reported() -> None:
    failures: list[str] = []
    with SlackReceiver() as slack:
        sender = SlackSender(attempts=2)
        sender.submit(slack.url, {"blocks": [{"type": "bogus"}]}, on_failure=failures.append)
        sender.close(timeout=30)
    assert slack.received == []
    assert failures and "HTTP 400" in failures[0] and "secret-token" not in failures[0]


def test_redact_keeps_only_the_host() -> None:
    assert redact("https://hooks.slack.com/services/T/B/xyz") == "hooks.slack.com/…"
