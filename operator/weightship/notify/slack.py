"""Send Slack messages through an incoming webhook, without ever blocking a rollout.

Messages go on a bounded queue that one background thread drains with slack_sdk's
WebhookClient, retrying with backoff. The webhook URL is a secret: it is never logged, and
failures are reported without it. Queued messages are best effort: an operator restart
drops what was not sent yet (status and events keep the record).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from slack_sdk.webhook import WebhookClient
from tenacity import RetryError, retry, stop_after_attempt, wait_exponential_jitter

log = logging.getLogger(__name__)
# slack_sdk logs request URLs, and a webhook URL is a secret: give it a silenced logger.
_sdk_log = logging.getLogger(f"{__name__}.sdk")
_sdk_log.disabled = True

OnFailure = Callable[[str], None]


def redact(url: str) -> str:
    """What may be shown of a webhook URL: its host, never the path that is the secret."""
    host = urlsplit(url).hostname or "webhook"
    return f"{host}/…"


class SendError(Exception):
    pass


@dataclass
class Message:
    url: str
    payload: dict[str, Any]
    on_failure: OnFailure | None = None


class SlackSender:
    def __init__(self, attempts: int = 4, timeout: float = 5.0, max_queue: int = 1000) -> None:
        self.attempts = attempts
        self.timeout = timeout
        self.queue: queue.Queue[Message | None] = queue.Queue(maxsize=max_queue)
        self.thread = threading.Thread(target=self._drain, name="slack-sender", daemon=True)
        self.thread.start()

    def submit(
        self,
        url: str,
        payload: dict[str, Any],
        on_failure: OnFailure | None = None,
    ) -> None:
        try:
            self.queue.put_nowait(Message(url, payload, on_failure))
        except queue.Full:
            log.warning("slack queue full; dropping a message for %s", redact(url))

    def close(self, timeout: float = 10.0) -> None:
        self.queue.put(None)
        self.thread.join(timeout)

    def _drain(self) -> None:
        while (message := self.queue.get()) is not None:
            try:
                self.send(message.url, message.payload)
            except Exception as e:  # report, never raise: the rollout must go on
                error = f"Slack webhook {redact(message.url)} failed: {e}"
                log.warning("%s", error)
                if message.on_failure is not None:
                    message.on_failure(error)

    def send(self, url: str, payload: dict[str, Any]) -> None:
        # Retries are ours (tenacity), so slack_sdk's own retry handlers stay off.
        client = WebhookClient(url, timeout=int(self.timeout), logger=_sdk_log, retry_handlers=[])

        @retry(
            stop=stop_after_attempt(self.attempts),
            wait=wait_exponential_jitter(multiplier=0.5, max=5, jitter=0.5),
            reraise=False,
        )
        def attempt() -> None:
            try:
                response = client.send_dict(payload)
            except Exception as e:
                # slack_sdk's errors may quote the URL: keep only the exception's kind.
                raise SendError(type(e).__name__) from None
            if response.status_code != 200:
                raise SendError(f"HTTP {response.status_code}")

        try:
            attempt()
        except RetryError as e:
            cause = e.last_attempt.exception()
            raise SendError(f"{cause} after {self.attempts} attempts") from None
