"""RFC 3339 times as Kubernetes writes and reads them (metav1.Time).

metav1.Time's UnmarshalJSON is Go's `time.Parse(time.RFC3339, s)`: a full date, an
upper-case `T`, hours, minutes and seconds, an optional fraction (after `.` or `,`), and a
zone that is `Z` or `±hh:mm`. A time without a zone is an error, never taken as UTC or
local; so are a date alone, a space for the `T`, and out-of-range fields.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta, timezone

_RFC3339 = re.compile(
    r"([0-9]{4})-([0-9]{2})-([0-9]{2})T([0-9]{2}):([0-9]{2}):([0-9]{2})"
    r"(?:[.,]([0-9]+))?(Z|[+-][0-9]{2}:[0-9]{2})"
)


def parse_time(text: str) -> datetime:
    """An aware datetime (microseconds: the fraction's further digits are dropped, as Go
    keeps nanoseconds); ValueError when ``text`` is not an RFC 3339 time with a zone."""
    m = _RFC3339.fullmatch(text)
    if m is None:
        raise ValueError(f"{text[:64]!r} is not an RFC 3339 time such as 2006-01-02T15:04:05Z")
    year, month, day, hour, minute, second = (int(g) for g in m.groups()[:6])
    fraction, zone = m.group(7) or "", m.group(8)
    if zone == "Z":
        tz = UTC
    else:
        hours, minutes = int(zone[1:3]), int(zone[4:6])
        if hours > 23 or minutes > 59:
            raise ValueError(f"{text[:64]!r}: the zone offset is out of range")
        offset = timedelta(hours=hours, minutes=minutes)
        tz = timezone(-offset if zone[0] == "-" else offset)
    micro = int((fraction + "000000")[:6])
    # datetime refuses what Go refuses: month 13, February 30, hour 24, second 60.
    return datetime(year, month, day, hour, minute, second, micro, tzinfo=tz)


def time_or_none(value: object) -> datetime | None:
    """A time field of an object as the API served it: None when absent or not a time."""
    if not isinstance(value, str):
        return None
    try:
        return parse_time(value)
    except ValueError:
        return None
