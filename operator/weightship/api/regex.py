"""The one regular-expression dialect of golden prompts: RE2, as the API server's CEL
compiles it (Go's regexp) and as the verifier must match it (google-re2).

Python's ``re`` refuses valid RE2 (``\\z``, ``\\pL``, ``\\Q…\\E``) and accepts what RE2
refuses (lookaround, backreferences), so admission and run time disagreed. Admission
checks a pattern with CEL (``RE2_VALID_RULE``), the model with ``check_re2``, and the
verifier matches with ``compile_re2``: the same engine decides everywhere.
"""

from __future__ import annotations

import re2

# CEL: matching compiles the pattern; an invalid one is an error, so the rule fails.
RE2_VALID_RULE = "''.matches(self) || !''.matches(self)"
_OPTIONS = re2.Options()
_OPTIONS.log_errors = False  # the error is raised; RE2 need not also print it


def compile_re2(pattern: str) -> re2._Regexp[str]:
    """``pattern`` compiled by RE2; ValueError naming the problem when it is not RE2."""
    try:
        return re2.compile(pattern, _OPTIONS)
    except re2.error as exc:
        detail = exc.args[0] if exc.args else exc
        text = detail.decode(errors="replace") if isinstance(detail, bytes) else str(detail)
        raise ValueError(f"not a valid RE2 regular expression: {text}") from None


def check_re2(pattern: str) -> str:
    compile_re2(pattern)
    return pattern


def search(pattern: str, text: str) -> bool:
    """Whether ``pattern`` (RE2) matches anywhere in ``text``."""
    return compile_re2(pattern).search(text) is not None
