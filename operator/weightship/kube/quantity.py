"""Kubernetes resource quantities, as apimachinery's `resource.ParseQuantity` reads them.

The grammar (k8s.io/apimachinery/pkg/api/resource/quantity.go)::

    <quantity>        ::= <signedNumber><suffix>
    <signedNumber>    ::= <sign><numericValue> | <numericValue>
    <numericValue>    ::= <digits> | <digits>.<digits> | <digits>. | .<digits>
    <suffix>          ::= <binarySI> | <decimalExponent> | <decimalSI>
    <binarySI>        ::= Ki | Mi | Gi | Ti | Pi | Ei
    <decimalSI>       ::= n | u | m | "" | k | M | G | T | P | E
    <decimalExponent> ::= "e" <signedNumber> | "E" <signedNumber>

and ParseQuantity's semantics on top: an exponent must be a whole int64 (it is then
truncated to int32, as Go's `int32(parsed)` does), a value that is not zero is rounded
away from zero to a whole nano (1e-9), and a binary-SI value is capped at 2^63-1.
`QUANTITY_PATTERN` is the grammar as an OpenAPI pattern (what controller-gen writes);
the API server's CEL `quantity()` is ParseQuantity itself, so a CRD field with both
admits exactly what `parse_quantity` accepts.
"""

from __future__ import annotations

import re
from decimal import MAX_EMAX, MIN_EMIN, ROUND_UP, Context, Decimal

QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
_BINARY = {s: 10 * (i + 1) for i, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
# ASCII digits only ([0-9], never \d, which takes any Unicode digit as Go does not).
_QUANTITY = re.compile(
    r"([+-]?)([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?[0-9]+)?"
)
_NANO = Decimal("1e-9")
MAX_BINARY = Decimal(2**63 - 1)  # resource.maxAllowed


def _int32(value: int) -> int:
    return (value + 2**31) % 2**32 - 2**31


def parse_quantity(text: str) -> Decimal:
    """The value of a quantity string ("100Mi" -> 104857600); ValueError when it is none."""
    m = _QUANTITY.fullmatch(text)
    if m is None:
        raise ValueError(f"{text[:64]!r} is not a Kubernetes quantity such as 100Mi")
    sign, number, suffix = m.group(1), m.group(2), m.group(3) or ""
    if suffix in _BINARY:
        base, power = 2, _BINARY[suffix]
    elif suffix in _DECIMAL:
        base, power = 10, _DECIMAL[suffix]
    else:  # e/E and a whole number ("1E" alone is an exa above)
        exponent = int(suffix[1:])
        if not -(2**63) <= exponent < 2**63:  # strconv.ParseInt fails: ErrSuffix
            raise ValueError(f"{text[:64]!r}: the exponent is out of range")
        base, power = 10, _int32(exponent)
    # Exact arithmetic: enough digits for the number, a 2^60 factor and the nano rounding;
    # an exponent only moves the decimal point (10^2147483647 is one digit here).
    context = Context(prec=len(text) + 40, Emax=MAX_EMAX, Emin=MIN_EMIN)
    amount = Decimal(number)
    amount = amount.scaleb(power, context) if base == 10 else context.multiply(amount, 2**power)
    exp = amount.as_tuple().exponent
    if amount and isinstance(exp, int) and exp < -9:
        amount = amount.quantize(_NANO, rounding=ROUND_UP, context=context)
    if base == 2 and amount > MAX_BINARY:
        amount = MAX_BINARY
    return -amount if sign == "-" else amount


def quantity_value(value: int | str) -> Decimal:
    """An int-or-string quantity field's value: a JSON integer is itself (Quantity's
    UnmarshalJSON reads the number's digits with ParseQuantity), a string is parsed."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"{value!r} is not a Kubernetes quantity such as 100Mi")
    return Decimal(value) if isinstance(value, int) else parse_quantity(value)
