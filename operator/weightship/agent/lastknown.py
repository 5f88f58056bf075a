"""What this agent last knew from the API server, kept on disk so that an agent that
restarts while the API server is down can go on staging.

An agent learns what to stage (the rollouts that target its node) and who its peers are
(the other agents' WeightCaches) from the API server. Without it, a restarted agent would
know neither, and would sit idle beside a cache full of verified chunks. So it keeps, in
one file under its cache directory (`FILE_NAME`), its wants (digest, pins, the S3 source
and transfer settings: no credential, agents read S3 with their own), its last peer list
with addresses and which of its wants each peer has staged, the node count (the write
window's size) and its last WeightCache status (so what it reports after the outage
keeps its start and completion times).

Bounded and never trusted blindly: the file is at most `MAX_BYTES`; one that is larger,
unreadable, malformed, or names a digest or node that is not one, is refused as a whole
(`LastKnownError`) and the agent waits for the API server as before.

`encode` and `decode` are pure; `read` and `write` are the file's edge.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from weightship.agent.desired import ROLE_ORDER, ModelSource, Wanted
from weightship.data.peer import NODE_NAME
from weightship.kube.rfc3339 import time_or_none
from weightship.weightformat.cachedir import MANIFEST_DIGEST

log = logging.getLogger(__name__)

FILE_NAME = "last-known.json"
FORMAT = 1
MAX_BYTES = 8 << 20  # 10,000 peers and 64 wants with long pins fit in a few MiB
MAX_WANTS = 256
MAX_PEERS = 10_000
MAX_TEXT = 2048  # a URI, an endpoint, a pin: far longer than any the API admits
_ADDRESS = re.compile(r"[A-Za-z0-9.:\[\]-]{1,300}")  # host:port, IPv6 in brackets


class LastKnownError(ValueError):
    """The file cannot be used (too large, unreadable, malformed)."""


@dataclass(frozen=True)
class KnownPeer:
    """Another agent as its WeightCache showed it: where it serves chunks, and which of
    this node's wanted digests it had staged (a holder)."""

    node: str
    address: str
    staged: tuple[str, ...] = ()


@dataclass(frozen=True)
class LastKnown:
    wants: tuple[Wanted, ...] = ()
    peers: tuple[KnownPeer, ...] = ()
    node_count: int = 1
    status: Mapping[str, Any] | None = None  # the last WeightCache status body built
    saved_at: datetime | None = None

    def same_as(self, other: LastKnown) -> bool:
        """The same knowledge, whenever it was saved."""
        return replace(self, saved_at=other.saved_at) == other


def known_peers(
    found: Iterable[tuple[str, str]], holders: Mapping[str, Iterable[str]]
) -> tuple[KnownPeer, ...]:
    """The live peers (node, address), each with the digests it holds staged
    (``holders``: digest -> nodes)."""
    staged: dict[str, list[str]] = {}
    for digest, nodes in holders.items():
        for node in nodes:
            staged.setdefault(node, []).append(digest)
    return tuple(
        KnownPeer(node, address, tuple(sorted(staged.get(node, ())))) for node, address in found
    )


def encode(known: LastKnown) -> bytes:
    """The file's bytes; wants and peers past their bounds are left out."""
    body = {
        "format": FORMAT,
        "savedAt": known.saved_at.isoformat() if known.saved_at else None,
        "nodeCount": known.node_count,
        "wants": [_want(w) for w in known.wants[:MAX_WANTS]],
        "peers": [
            {"node": p.node, "address": p.address, "staged": list(p.staged)}
            for p in known.peers[:MAX_PEERS]
        ],
        "status": known.status,
    }
    return json.dumps(body, separators=(",", ":"), sort_keys=True).encode()


def decode(raw: bytes) -> LastKnown:
    """What ``encode`` wrote. LastKnownError when it is anything else."""
    if len(raw) > MAX_BYTES:
        raise LastKnownError(f"{len(raw)} bytes, more than the {MAX_BYTES} allowed")
    try:
        body = json.loads(raw)
        if not isinstance(body, dict) or body.get("format") != FORMAT:
            raise LastKnownError(f"not format {FORMAT}")
        wants = _bounded_list(body, "wants", MAX_WANTS)
        peers = _bounded_list(body, "peers", MAX_PEERS)
        node_count = body.get("nodeCount")
        status = body.get("status")
        if not isinstance(node_count, int) or node_count < 1:
            raise LastKnownError(f"nodeCount {node_count!r} is not a positive count")
        if status is not None and not isinstance(status, dict):
            raise LastKnownError("status is not an object")
        saved = body.get("savedAt")
        return LastKnown(
            wants=tuple(_parse_want(w) for w in wants),
            peers=tuple(_parse_peer(p) for p in peers),
            node_count=node_count,
            status=status,
            saved_at=time_or_none(saved) if isinstance(saved, str) else None,
        )
    except LastKnownError:
        raise
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise LastKnownError(f"malformed: {type(e).__name__}: {str(e)[:200]}") from None


def read(path: Path) -> LastKnown | None:
    """The file, or None (with a warning) when it is missing, too large or unusable."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as e:
        log.warning("ignoring %s: cannot read it: %s", path, e)
        return None
    try:
        return decode(raw)
    except LastKnownError as e:
        log.warning("ignoring %s: %s", path, e)
        return None


def write(path: Path, temp: Path, known: LastKnown) -> None:
    """Replace the file at once (``temp`` is on the same filesystem): a crash leaves the
    old file or the new one, never half of one."""
    with open(temp, "wb") as f:
        f.write(encode(known))
        f.flush()
        os.fsync(f.fileno())
    temp.replace(path)


# ---- the parts ----------------------------------------------------------------------------


def _want(w: Wanted) -> dict[str, Any]:
    return {
        "digest": w.digest,
        "role": w.role,
        "pinnedBy": list(w.pinned_by),
        "sources": [
            {"namespace": s.namespace, "uri": s.uri, "endpoint": s.endpoint, "region": s.region}
            for s in w.sources
        ],
        "peerToPeer": w.peer_to_peer,
        "bandwidthLimit": w.bandwidth_limit,
        "attempt": w.attempt,
    }


def _parse_want(raw: Any) -> Wanted:
    digest = raw["digest"]
    if not isinstance(digest, str) or not MANIFEST_DIGEST.fullmatch(digest):
        raise LastKnownError(f"{str(digest)[:80]!r} is not a manifest digest")
    role = raw["role"]
    if role not in ROLE_ORDER:
        raise LastKnownError(f"{str(role)[:80]!r} is not a role")
    limit = raw.get("bandwidthLimit")
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 0):
        raise LastKnownError(f"bandwidthLimit {limit!r} is not a byte rate")
    return Wanted(
        digest=digest,
        role=role,
        pinned_by=tuple(_text(p) for p in raw["pinnedBy"]),
        sources=tuple(
            ModelSource(
                namespace=_text(s["namespace"]),
                uri=_text(s["uri"]),
                endpoint=_text_or_none(s.get("endpoint")),
                region=_text_or_none(s.get("region")),
            )
            for s in raw["sources"]
        ),
        peer_to_peer=_flag(raw["peerToPeer"]),
        bandwidth_limit=limit,
        attempt=_text(raw.get("attempt", "")),
    )


def _parse_peer(raw: Any) -> KnownPeer:
    node, address = raw["node"], raw["address"]
    if not isinstance(node, str) or not NODE_NAME.fullmatch(node):
        raise LastKnownError(f"{str(node)[:80]!r} is not a node name")
    if not isinstance(address, str) or not _ADDRESS.fullmatch(address):
        raise LastKnownError(f"{str(address)[:80]!r} is not a peer address")
    staged = tuple(raw.get("staged") or ())
    if not all(isinstance(d, str) and MANIFEST_DIGEST.fullmatch(d) for d in staged):
        raise LastKnownError(f"peer {node}: a staged digest is not a manifest digest")
    return KnownPeer(node, address, staged)


def _bounded_list(body: Mapping[str, Any], key: str, most: int) -> list[Any]:
    value = body.get(key) or []
    if not isinstance(value, list) or len(value) > most:
        raise LastKnownError(f"{key} is not a list of at most {most}")
    return value


def _text(value: Any) -> str:
    if not isinstance(value, str) or len(value) > MAX_TEXT:
        raise LastKnownError(f"{str(value)[:80]!r} is not a string of at most {MAX_TEXT}")
    return value


def _text_or_none(value: Any) -> str | None:
    return None if value is None else _text(value)


def _flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise LastKnownError(f"{value!r} is not true or false")
    return value
