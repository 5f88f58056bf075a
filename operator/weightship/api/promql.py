"""{{ variable }} placeholders in PromQL queries: the spec checks the names a query uses
(`placeholders`), the analysis renders them (`render_query`)."""

from __future__ import annotations

import re
from collections.abc import Mapping

_PLACEHOLDER = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")


class TemplateError(ValueError):
    """A query names a variable that does not exist."""


def _escape(value: str) -> str:
    # Values land inside PromQL label matchers' double quotes.
    return value.replace("\\", "\\\\").replace('"', '\\"')


def render_query(query: str, variables: Mapping[str, str]) -> str:
    def substitute(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in variables:
            known = ", ".join(sorted(variables))
            raise TemplateError(f"unknown variable {{{{ {name} }}}} in query (known: {known})")
        return _escape(variables[name])

    return _PLACEHOLDER.sub(substitute, query)


def placeholders(query: str) -> set[str]:
    """Variable names used in a query."""
    return set(_PLACEHOLDER.findall(query))
