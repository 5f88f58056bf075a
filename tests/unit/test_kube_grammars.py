"""weightship.kube: one parser per Kubernetes grammar, table by table from Kubernetes.

Quantities: k8s.io/apimachinery/pkg/api/resource/quantity_test.go (TestQuantityParse: the
valid table, its negated and `+`-prefixed forms, and the `invalid` list), and
ParseQuantity's exponent handling (strconv.ParseInt, then int32). Times: metav1.Time's
UnmarshalJSON is time.Parse(time.RFC3339, ...) (Go's time/format_test.go rfc3339 cases).
Selectors: k8s.io/apimachinery/pkg/apis/meta/v1/helpers_test.go
(TestLabelSelectorAsSelector) and pkg/labels/selector_test.go (TestRequirementMatches).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal
from typing import Any

import pytest

from weightship.kube.quantity import MAX_BINARY, QUANTITY_PATTERN, parse_quantity, quantity_value
from weightship.kube.rfc3339 import parse_time, time_or_none
from weightship.kube.selector import labels_match, selector_matches

KI, MI, GI, TI, PI, EI = (2 ** (10 * i) for i in range(1, 7))


def dec(unscaled: int, exponent: int) -> Decimal:
    """apimachinery's decQuantity(unscaled, exponent, _): unscaled * 10^exponent."""
    return Decimal(unscaled).scaleb(exponent)


# TestQuantityParse's table (k8s.io/apimachinery/pkg/api/resource/quantity_test.go).
VALID = [
    ("0", dec(0, 0)), ("0n", dec(0, 0)), ("0u", dec(0, 0)), ("0m", dec(0, 0)),
    ("0Ki", dec(0, 0)), ("0k", dec(0, 0)), ("0Mi", dec(0, 0)), ("0M", dec(0, 0)),
    ("0e0", dec(0, 0)), ("0e-10", dec(0, 0)), ("0e-1000", dec(0, 0)),
    ("1Ki", dec(KI, 0)), ("8Ki", dec(8 * KI, 0)), ("7Mi", dec(7 * MI, 0)),
    ("6Gi", dec(6 * GI, 0)), ("5Ti", dec(5 * TI, 0)), ("4Pi", dec(4 * PI, 0)),
    ("3Ei", dec(3 * EI, 0)), ("10Ti", dec(10 * TI, 0)), ("100Ti", dec(100 * TI, 0)),
    ("5n", dec(5, -9)), ("4u", dec(4, -6)), ("3m", dec(3, -3)), ("9", dec(9, 0)),
    ("8k", dec(8, 3)), ("50k", dec(5, 4)), ("7M", dec(7, 6)), ("6G", dec(6, 9)),
    ("5T", dec(5, 12)), ("40T", dec(4, 13)), ("300T", dec(3, 14)), ("2P", dec(2, 15)),
    ("1E", dec(1, 18)),
    ("1e-3", dec(1, -3)), ("1e-2", dec(1, -2)), ("1e-1", dec(1, -1)), ("1e0", dec(1, 0)),
    ("1e1", dec(1, 1)), ("1e2", dec(1, 2)), ("1e3", dec(1, 3)), ("1e6", dec(1, 6)),
    ("1e9", dec(1, 9)), ("1E12", dec(1, 12)), ("1e15", dec(1, 15)), ("1e18", dec(1, 18)),
    ("1e14", dec(1, 14)), ("1e13", dec(1, 13)), ("100.035k", dec(100035, 0)),
    ("0.001", dec(1, -3)), ("0.0005k", dec(5, -1)), ("0.005", dec(5, -3)),
    ("0.05", dec(5, -2)), ("0.5", dec(5, -1)), ("0.00050k", dec(5, -1)),
    ("0.00500", dec(5, -3)), ("0.05000", dec(5, -2)), ("0.50000", dec(5, -1)),
    ("0.5e0", dec(5, -1)), ("0.5e-1", dec(5, -2)), ("0.5e-2", dec(5, -3)),
    ("10.035M", dec(10035, 3)), ("1.2e3", dec(12, 2)), ("1.3E+6", dec(13, 5)),
    ("1.40e9", dec(14, 8)), ("1.53E12", dec(153, 10)), ("1.6e15", dec(16, 14)),
    ("1.7E18", dec(17, 17)), ("9.01", dec(901, -2)), ("8.1k", dec(81, 2)),
    ("7.123456M", dec(7123456, 0)), ("6.987654321G", dec(6987654321, 0)),
    ("5.444T", dec(5444, 9)), ("40.1T", dec(401, 11)), ("300.2T", dec(3002, 11)),
    ("2.5P", dec(25, 14)), ("1.01E", dec(101, 16)),
    # Things that saturate/round
    ("3.001n", dec(4, -9)), ("1.1E-9", dec(2, -9)), ("0.0000000001", dec(1, -9)),
    ("0.0000000005", dec(1, -9)), ("0.00000000050", dec(1, -9)), ("0.5e-9", dec(1, -9)),
    ("0.9n", dec(1, -9)), ("0.00000012345", dec(124, -9)), ("0.00000012354", dec(124, -9)),
    ("9Ei", MAX_BINARY), ("9223372036854775807Ki", MAX_BINARY), ("12E", dec(12, 18)),
    # We'll accept fractional binary stuff, too.
    ("100.035Ki", dec(10243584, -2)), ("0.5Mi", dec(MI // 2, 0)),
    ("0.05Gi", dec(536870912, -1)), ("0.025Ti", dec(274877906944, -1)),
    # Things written by trolls
    ("0.000000000001Ki", dec(2, -9)), (".001", dec(1, -3)), (".0001k", dec(100, -3)),
    ("1.", dec(1, 0)), ("1.G", dec(1, 9)),
]  # fmt: skip
INVALID = ["1.1.M", "1+1.0M", "0.1mi", "0.1am", "aoeu", ".5i", "1i", "-3.01i", "-3.01e-",
           " 1", "1 ",  # trailing (and leading) whitespace is forbidden
           # and where the old agent parser was looser than ParseQuantity:
           "", ".", "+", "1e3Ki", "1K", "1ki", "1e1.5", "1e", "1Mi ", "\uff11",
           "1e99999999999999999999"]  # fmt: skip


@pytest.mark.parametrize(("text", "value"), VALID)
def test_quantities_parse_as_apimachinery_parses_them(text: str, value: Decimal) -> None:
    assert parse_quantity(text) == value
    assert parse_quantity("+" + text) == value
    assert parse_quantity("-" + text) == -value


@pytest.mark.parametrize("text", INVALID)
def test_what_apimachinery_refuses_is_no_quantity(text: str) -> None:
    with pytest.raises(ValueError):
        parse_quantity(text)


def test_the_pattern_and_the_parser_agree() -> None:
    """The OpenAPI pattern is the grammar; ParseQuantity refuses a few more (an exponent
    with a fraction), which the CRD's CEL quantity() rule refuses with it."""
    import re

    for text, _ in VALID:
        assert re.fullmatch(QUANTITY_PATTERN[1:-1], text), text
    for text in ("1e1.5", "1e.5"):
        assert re.fullmatch(QUANTITY_PATTERN[1:-1], text)
        with pytest.raises(ValueError):
            parse_quantity(text)


def test_exponents_are_whole_int64s_taken_as_int32_as_go_does() -> None:
    assert parse_quantity("1e308") == dec(1, 308) and parse_quantity("1e-308") == dec(1, -9)
    assert parse_quantity("1e2147483647") == Decimal("1e2147483647")
    assert parse_quantity("1e4294967296") == 1  # int32(2^32) == 0
    assert parse_quantity("1e4294967297") == 10


def test_int_or_string_fields() -> None:
    assert quantity_value(1048576) == MI and quantity_value("1Mi") == MI
    for bad in (True, 1.5, None, [1]):
        with pytest.raises(ValueError):
            quantity_value(bad)  # type: ignore[arg-type]


# Go's time.Parse(time.RFC3339, ...), as metav1.Time.UnmarshalJSON calls it.
TIMES = [
    ("2006-01-02T15:04:05Z", datetime(2006, 1, 2, 15, 4, 5, tzinfo=UTC)),
    ("2006-01-02T15:04:05+07:00", datetime(2006, 1, 2, 8, 4, 5, tzinfo=UTC)),
    ("2006-01-02T15:04:05-07:30", datetime(2006, 1, 2, 22, 34, 5, tzinfo=UTC)),
    ("2006-01-02T15:04:05.123456789Z", datetime(2006, 1, 2, 15, 4, 5, 123456, tzinfo=UTC)),
    ("2006-01-02T15:04:05,5Z", datetime(2006, 1, 2, 15, 4, 5, 500000, tzinfo=UTC)),
    ("2024-02-29T23:59:59Z", datetime(2024, 2, 29, 23, 59, 59, tzinfo=UTC)),
]
NOT_TIMES = [
    "2006-01-02T15:04:05",  # no zone: an error, not UTC and not local
    "2006-01-02T15:04:05.5",
    "2006-01-02",
    "2006-01-02 15:04:05Z",
    "2006-01-02t15:04:05Z",
    "2006-01-02T15:04:05z",
    "20060102T150405Z",
    "2006-01-02T15:04Z",
    "2006-01-02T15:04:05+0700",
    "2006-01-02T15:04:05+24:00",
    "2006-13-02T15:04:05Z",
    "2023-02-29T15:04:05Z",
    "2006-01-02T24:00:00Z",
    "2006-01-02T15:04:60Z",
    "2006-01-02T15:04:05.Z",
    " 2006-01-02T15:04:05Z",
    "",
]


@pytest.mark.parametrize(("text", "when"), TIMES)
def test_rfc3339_times(text: str, when: datetime) -> None:
    assert parse_time(text) == when and time_or_none(text) == when
    assert parse_time(text).utcoffset() is not None


@pytest.mark.parametrize("text", NOT_TIMES)
def test_what_go_refuses_is_no_time(text: str) -> None:
    with pytest.raises(ValueError):
        parse_time(text)
    assert time_or_none(text) is None


def test_absent_times_are_none() -> None:
    assert time_or_none(None) is None and time_or_none(1700000000) is None
    assert parse_time("2006-01-02T15:04:05+01:00").utcoffset() == timedelta(hours=1)
    assert parse_time("2006-01-02T15:04:05-01:00").tzinfo == timezone(timedelta(hours=-1))


LABELS = {"foo": "bar", "baz": "blah"}
# (selector, labels, matches): TestLabelSelectorAsSelector and TestRequirementMatches.
SELECTORS: list[tuple[dict[str, Any] | None, dict[str, str], bool]] = [
    (None, LABELS, False),  # nil selects nothing
    ({}, LABELS, True),  # empty selects everything
    ({}, {}, True),
    ({"matchLabels": {"foo": "bar"}}, LABELS, True),
    ({"matchLabels": {"foo": "bar"}}, {"foo": "baz"}, False),
    ({"matchLabels": {"foo": "bar"}}, {}, False),
    ({"matchExpressions": [{"key": "foo", "operator": "In", "values": ["bar", "x"]}]}, LABELS,
     True),
    ({"matchExpressions": [{"key": "foo", "operator": "In", "values": ["x"]}]}, LABELS, False),
    ({"matchExpressions": [{"key": "nope", "operator": "In", "values": ["x"]}]}, LABELS, False),
    ({"matchExpressions": [{"key": "foo", "operator": "NotIn", "values": ["bar"]}]}, LABELS, False),
    ({"matchExpressions": [{"key": "foo", "operator": "NotIn", "values": ["x"]}]}, LABELS, True),
    ({"matchExpressions": [{"key": "nope", "operator": "NotIn", "values": ["x"]}]}, LABELS, True),
    ({"matchExpressions": [{"key": "foo", "operator": "Exists"}]}, LABELS, True),
    ({"matchExpressions": [{"key": "nope", "operator": "Exists"}]}, LABELS, False),
    ({"matchExpressions": [{"key": "foo", "operator": "DoesNotExist"}]}, LABELS, False),
    ({"matchExpressions": [{"key": "nope", "operator": "DoesNotExist"}]}, LABELS, True),
    (
        {
            "matchLabels": {"foo": "bar"},
            "matchExpressions": [{"key": "baz", "operator": "In", "values": ["blah"]}],
        },
        LABELS,
        True,
    ),
    (
        {
            "matchLabels": {"foo": "bar"},
            "matchExpressions": [{"key": "baz", "operator": "NotIn", "values": ["blah"]}],
        },
        LABELS,
        False,
    ),
]  # fmt: skip
BAD_SELECTORS = [
    {"matchExpressions": [{"key": "foo", "operator": "In", "values": []}]},
    {"matchExpressions": [{"key": "foo", "operator": "NotIn"}]},
    {"matchExpressions": [{"key": "foo", "operator": "Exists", "values": ["bar"]}]},
    {"matchExpressions": [{"key": "foo", "operator": "DoesNotExist", "values": ["x"]}]},
    {"matchExpressions": [{"key": "foo", "operator": "Gt", "values": ["1"]}]},
    {"matchExpressions": [{"operator": "Exists"}]},
    # checked before matching: a later bad requirement fails even if an earlier one doesn't match
    {"matchLabels": {"no": "match"}, "matchExpressions": [{"key": "a", "operator": "In"}]},
]


@pytest.mark.parametrize(("selector", "labels", "expected"), SELECTORS)
def test_label_selectors(
    selector: dict[str, Any] | None, labels: dict[str, str], expected: bool
) -> None:
    assert selector_matches(selector, labels) is expected


@pytest.mark.parametrize("selector", BAD_SELECTORS)
def test_invalid_label_selectors_are_errors(selector: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        selector_matches(selector, LABELS)


def test_map_selectors() -> None:
    """nodeSelector and matchLabels: every pair present; an empty or absent map selects all."""
    assert labels_match({}, {}) and labels_match(None, LABELS) and labels_match({}, LABELS)
    assert labels_match({"foo": "bar"}, LABELS)
    assert not labels_match({"foo": "baz"}, LABELS)
    assert not labels_match({"missing": "x"}, LABELS)
    assert not labels_match({"foo": ""}, LABELS)
