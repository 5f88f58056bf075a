"""What root and receivers agree on: the HTTP path, the join answer, the store keys.

One TCPStore runs on the root for all its groups. A group's generation ``g`` lives under
``weightship/seed/<group>/<g>/``: ``ctl/`` holds the control keys below and ``pg/`` the
process group's own rendezvous keys.

- ``ctl/start``: set by the root when it starts the broadcast, JSON ``{"worldSize": n}``;
  or ``{"abandon": "<why>"}`` when it will not.
- ``ctl/result/<rank>``: set by each receiver after verifying, JSON
  ``{"member", "ok", "reason", "seconds"}``, so the root's history says who got what.
"""

from __future__ import annotations

import re

JOIN_PATH = "/weightship/v1/seed/join"
STATUS_PATH = "/weightship/v1/seed/status"
GROUP_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
START_KEY = "start"


def store_prefix(group: str, generation: int) -> str:
    return f"weightship/seed/{group}/{generation}/"


def result_key(rank: int) -> str:
    return f"result/{rank}"
