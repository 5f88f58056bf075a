"""Go-style durations (time.ParseDuration): 30s, 5m, 1h30m, 1.5h, 250ms. The CRD's
``DURATION_PATTERN`` (api.base) admits the same strings; the spec and the core parse
them here."""

from __future__ import annotations

import re
from datetime import timedelta

_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_TOKEN = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ns|us|ms|s|m|h)")


def parse_duration(text: str) -> timedelta:
    """Parse a Go duration. Signs, bare numbers and the µ alias are rejected, as in the CRD."""
    position = 0
    seconds = 0.0
    for match in _TOKEN.finditer(text):
        if match.start() != position:
            break
        seconds += float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
        position = match.end()
    if position == 0 or position != len(text):
        raise ValueError(f"invalid duration {text!r}: use Go syntax such as 30s, 5m or 1h30m")
    return timedelta(seconds=seconds)
