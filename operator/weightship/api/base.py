"""Shared pieces of the API models: the base class, CEL rule helpers and string formats.

The pydantic models are the single source of truth: `weightship.api.crdgen` turns them into
the CRD YAML, so every field carries a description (`kubectl explain` shows it) and every CEL
rule that the apiserver enforces is mirrored by a pydantic validator, so the operator rejects
the same objects when it parses them.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel

# Go-style durations as accepted by time.ParseDuration, minus the sign and the µ alias.
DURATION_PATTERN = r"^([0-9]+(\.[0-9]+)?(ns|us|ms|s|m|h))+$"
SHA256_DIGEST_PATTERN = r"^sha256:[0-9a-f]{64}$"
# Printable ASCII only: `\s` means ASCII space in the API server (RE2) and Unicode space
# in Python, so `[^\s]` let U+00A0 or U+2028 through one and not the other.
URL_PATTERN = r"^https?://[!-~]+$"
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
# Label keys and values as Kubernetes checks them (a qualified name: an optional DNS
# subdomain prefix and a name of at most 63 characters; values at most 63, alphanumeric
# at both ends).
_NAME_PART = r"([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9]"
_PREFIX_PART = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
LABEL_KEY_PATTERN = rf"^({_PREFIX_PART}/)?{_NAME_PART}$"
LABEL_VALUE_PATTERN = rf"^({_NAME_PART})?$"

# Bounds keep CEL cost estimates small: the apiserver multiplies a rule's cost by the
# maxItems/maxLength of everything it iterates over.
MAX_NAME = 253
MAX_LABEL_VALUE = 63
MAX_MESSAGE = 32768
MAX_SHORT_TEXT = 1024
# Bounds that keep the largest object far below etcd's 1.5 MiB (docs/api.md, "Object
# size"), from Kubernetes' own name lengths so that no real value reaches them:
# "namespace/name" of a rollout: a namespace is a DNS label (63), a custom resource's
# name a DNS subdomain (253).
MAX_NAMESPACED_NAME = MAX_LABEL_VALUE + 1 + MAX_NAME
# A label key: an optional DNS subdomain prefix (253), '/', a name of at most 63.
MAX_LABEL_KEY = MAX_NAME + 1 + MAX_LABEL_VALUE
# A timestamp: RFC 3339 with nanoseconds and an offset is 35 characters; the API server's
# date-time format alone admits any number of fractional digits.
MAX_DATE_TIME = 64


def cel(
    rule: str, message: str, *, field_path: str | None = None, reason: str | None = None
) -> dict[str, str]:
    """One `x-kubernetes-validations` entry."""
    entry = {"rule": rule, "message": message}
    if field_path is not None:
        entry["fieldPath"] = field_path
    if reason is not None:
        entry["reason"] = reason
    return entry


def validations(*rules: dict[str, str]) -> dict[str, Any]:
    """json_schema_extra that attaches CEL rules to a model or a field."""
    return {"x-kubernetes-validations": list(rules)}


def matches(pattern: str, value: str) -> bool:
    return re.fullmatch(pattern.removeprefix("^").removesuffix("$"), value) is not None


class ApiModel(BaseModel):
    """Base for every API object: camelCase on the wire, snake_case in Python.

    Unknown fields are ignored rather than rejected: the apiserver prunes them before the
    operator sees an object, and older operators must survive newer status fields.
    """

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="ignore",
        validate_default=False,
    )

    def to_k8s(self) -> dict[str, Any]:
        """The object as the apiserver stores it: camelCase keys, unset optionals left out."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)
