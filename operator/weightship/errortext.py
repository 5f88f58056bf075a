"""Error text fit to leave the process: credentials removed and length capped.

Anything an error says may end in a rollout's status.message, an Event, a Slack post or a
WeightCache's lastError, where every reader of the object sees it. botocore quotes a
header value it refuses (a session token with a trailing newline, say), and a presigned
URL carries its signature in the query, so every such text passes through ``error_text``
(or ``redact`` and ``bounded``) first.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from urllib.parse import quote

MAX_ERROR_TEXT = 1024
REDACTED = "[redacted]"
_MIN_SECRET = 4  # shorter values are too common to replace (and too weak to matter)

# Credentials that can appear whatever their values: signed query parameters, an
# Authorization header, and the value botocore quotes when it refuses a header.
_PATTERNS = (
    re.compile(r"(?i)(X-Amz-(?:Signature|Credential|Security-Token)=)[^&\s'\"]+"),
    re.compile(r"(?i)(Authorization['\"]?\s*[:=]\s*['\"]?)[^'\"\r\n]+"),
    re.compile(r"(?i)(Invalid header value )b?(['\"]).*?(?<!\\)\2"),
)


def _forms(secret: str) -> set[str]:
    """The ways a secret's text shows in an error: as is, trimmed, as repr() escapes it
    (a newline as ``\\n``), and URL-quoted."""
    forms = set()
    for value in {secret, secret.strip()}:
        if len(value.strip()) < _MIN_SECRET:
            continue
        forms.update({value, repr(value)[1:-1], quote(value, safe=""), quote(value)})
        forms.add(repr(value.encode("utf-8", "replace"))[2:-1])
    return forms


def redact(text: str, secrets: Iterable[str | None] = ()) -> str:
    """``text`` with each of ``secrets`` and every credential-shaped field replaced."""
    forms = set()
    for secret in secrets:
        if secret:
            forms |= _forms(secret)
    for form in sorted(forms, key=len, reverse=True):  # a longer form may contain a shorter
        text = text.replace(form, REDACTED)
    for pattern in _PATTERNS:
        text = pattern.sub(lambda m: m.group(1) + REDACTED, text)
    return text


def bounded(text: str, limit: int = MAX_ERROR_TEXT) -> str:
    """``text`` cut to ``limit`` characters, marked where it was cut."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def error_text(
    exc: BaseException, secrets: Iterable[str | None] = (), limit: int = MAX_ERROR_TEXT
) -> str:
    """What may be said of ``exc``: redacted, then bounded."""
    return bounded(redact(str(exc) or type(exc).__name__, secrets), limit)
