"""Fault injection for tests only (``WEIGHTSHIP_SEED_FAULT``); off unless the variable is set.

- ``tamper``: a receiver flips one byte of the first tensor after the broadcast and
  before verification, as corruption in flight would.
- ``root-exit-after-buckets=N``: the root process exits (``os._exit(1)``) once it has
  sent N buckets, as a root that dies mid-broadcast would.

Several faults may be given, comma-separated.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

FAULT_ENV = "WEIGHTSHIP_SEED_FAULT"


@dataclass(frozen=True)
class Faults:
    tamper: bool = False
    root_exit_after_buckets: int | None = None

    @classmethod
    def parse(cls, value: str) -> Faults:
        tamper, exit_after = False, None
        for item in filter(None, (part.strip() for part in value.split(","))):
            key, _, arg = item.partition("=")
            if key == "tamper" and not arg:
                tamper = True
            elif key == "root-exit-after-buckets" and arg.isdigit():
                exit_after = int(arg)
            else:
                raise ValueError(f"unknown {FAULT_ENV} item {item!r}")
        return cls(tamper, exit_after)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Faults:
        return cls.parse((os.environ if env is None else env).get(FAULT_ENV, ""))
