"""The largest object a CRD schema admits, built by walking the schema (issue 42).

Every array at maxItems, every string at maxLength, every map at maxProperties, every
number at its largest, so the object measures the worst case the API server can be asked
to store. A node without its bound raises `UnboundedError`: removing a bound from the
models makes the tests that use this fail, instead of quietly measuring a smaller object.

List items are made distinct (the API server refuses duplicate keys of a `map` list and
duplicate `set` elements): every string under item i ends in i, and an enum key takes
each of its values once.
"""

from __future__ import annotations

import re
from typing import Any

Schema = dict[str, Any]

# Structural schemas cannot bound a map's keys (no propertyNames): a CEL rule of this
# form does, and is the only key bound this walker accepts.
_KEY_BOUND = re.compile(r"^self\.all\(k, k\.size\(\) <= (\d+)\)$")
# The longest date-time: RFC 3339 with every fractional digit its maxLength leaves room for.
_DATE_TIME_HEAD, _DATE_TIME_TAIL = "2026-12-31T23:59:59.", "Z"
_INT64_MAX = 2**63 - 1
_LARGEST_FLOAT = 1.7976931348623157e308  # the largest float, and about the longest JSON text


class UnboundedError(ValueError):
    """A node of the schema has no bound, so no largest object exists."""


def largest(schema: Schema, path: str = "", tag: int = 0) -> Any:
    """The largest value ``schema`` admits; ``tag`` tells apart the items of a list."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        raise UnboundedError(f"{path}: x-kubernetes-preserve-unknown-fields is unbounded")
    if schema.get("x-kubernetes-int-or-string"):
        return _string({**schema, "type": "string"}, path, tag)
    kind = schema.get("type")
    if kind == "object":
        return _object(schema, path, tag)
    if kind == "array":
        return _array(schema, path)
    if kind == "string":
        return _string(schema, path, tag)
    if kind == "integer":
        return min(schema.get("maximum", _INT64_MAX), _INT64_MAX)
    if kind == "number":
        return schema.get("maximum", _LARGEST_FLOAT)
    if kind == "boolean":
        return False  # "false" is longer than "true"
    raise UnboundedError(f"{path}: no type")


def _object(schema: Schema, path: str, tag: int) -> dict[str, Any]:
    out = {
        name: largest(child, f"{path}.{name}", tag)
        for name, child in schema.get("properties", {}).items()
    }
    values = schema.get("additionalProperties")
    if isinstance(values, dict):
        if "maxProperties" not in schema:
            raise UnboundedError(f"{path}: a map without maxProperties")
        key_length = _key_bound(schema, path)
        for i in range(schema["maxProperties"]):
            key = _tagged("k" * key_length, i)
            out[key] = largest(values, f"{path}{{}}", i)
    return out


def _key_bound(schema: Schema, path: str) -> int:
    for rule in schema.get("x-kubernetes-validations", []):
        found = _KEY_BOUND.match(rule["rule"])
        if found:
            return int(found.group(1))
    raise UnboundedError(f"{path}: a map without a CEL rule 'self.all(k, k.size() <= N)'")


def _array(schema: Schema, path: str) -> list[Any]:
    if "maxItems" not in schema:
        raise UnboundedError(f"{path}: an array without maxItems")
    items = schema["items"]
    out = [largest(items, f"{path}[]", i) for i in range(schema["maxItems"])]
    for key in schema.get("x-kubernetes-list-map-keys", []):
        enum = items["properties"][key].get("enum")
        if enum is not None:  # an enum key admits one item per value
            out = out[: len(enum)]
            for item, value in zip(out, enum, strict=False):
                item[key] = value
    return out


def _string(schema: Schema, path: str, tag: int) -> str:
    if "enum" in schema:
        return max((str(v) for v in schema["enum"]), key=len)
    if "maxLength" not in schema:
        raise UnboundedError(f"{path}: a string without maxLength")
    length: int = schema["maxLength"]
    if schema.get("format") == "date-time":
        digits = length - len(_DATE_TIME_HEAD) - len(_DATE_TIME_TAIL)
        return _DATE_TIME_HEAD + "9" * max(1, digits) + _DATE_TIME_TAIL
    pattern = schema.get("pattern")
    if pattern is None:
        return _tagged("x" * length, tag)
    prefix = _literal_prefix(pattern)
    value = prefix + _tagged("a" * (length - len(prefix)), tag)
    if re.fullmatch(pattern.removeprefix("^").removesuffix("$"), value) is None:
        raise UnboundedError(f"{path}: no string of {length} characters found for {pattern}")
    return value


def _tagged(filler: str, tag: int) -> str:
    """filler with its end replaced by tag's digits (same length), so items differ."""
    if not tag:
        return filler
    digits = str(tag)
    return filler[: len(filler) - len(digits)] + digits


def _literal_prefix(pattern: str) -> str:
    """The characters every match starts with (``sha256:`` of a digest), up to the first
    regex syntax."""
    body = pattern.removeprefix("^")
    found = re.match(r"[A-Za-z0-9:_/-]*", body)
    literal = found.group(0) if found else ""
    # A quantifier after the last literal character applies to it alone.
    if body[len(literal) : len(literal) + 1] in ("*", "+", "?", "{"):
        literal = literal[:-1]
    return literal
