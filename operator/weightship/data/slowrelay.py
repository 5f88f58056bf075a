"""Slow relays: a node whose link cannot keep up stops relaying, and the nodes below it in
the relay trees take their chunks from above it.

A relay streams a chunk on as it lands (cut-through), so every node below a slow one in
a chunk's tree receives no faster than it does: with 5 % of a fleet's nodes at a tenth of
their link, every node staged at 10x S/B (the simulator, 200 and 1,000 nodes), each tree
having a slow node above most of the others. A node's children cannot tell a slow parent
from a slow grandparent (each stream is as slow as the slowest hop above it). The slow
node can tell, from its own parents: a node that keeps up takes each chunk from its
parent in the chunk's tree as a stream while it lands there, and a slow one falls behind
and finds it whole there, landed a while ago. A peer server says how long it has held
a chunk it sends whole (``peer.HELD_HEADER``); a node whose tree parent (never an
ancestor asked in a dead or shunned parent's place: the nodes below a slow node are
behind it without being slow) had held one over ``LAG_S`` takes a notice, and at
``LAG_NOTICES`` stops relaying for ``NOT_RELAYING_S``. Its peer server then answers
every chunk request 503 saying so (``peer.RELAYING_HEADER``), and the asker avoids it
for the rest of its stage (``PeerHealth.shun``): its children ask their nearest live
ancestor (``schedule.live_parent``), and where it is a chunk's origin fetcher, the first
live node after it stands in (``schedule.stand_in``), as for a death.

Tried first: the parent judging its children, two streams of one chunk at once (one
ending whole while the other had delivered under a quarter as much). At 1,000 nodes it
missed 4 of the 50 slow nodes: early in the stage each stream runs at the pace of the
chunk landing at the parent, under a slow link's share, and once behind, a slow node
asks for chunks its parents hold whole, never beside a sibling's stream.

The rules here are shared by the peer server, the fetcher and the fleet simulator.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

# A relay parent that had held a chunk whole this long when its child asked for it is that
# far ahead: the child's link is the slower (a node keeping up takes each chunk as a
# stream while it lands there).
LAG_S = 3.0
# ... and over this share of the time the node has been staging: a node at a tenth of its
# link lags by nine tenths of it, while a node held up for a while by a death lags by a few
# seconds late in its stage (the simulator, 1,000 nodes with 10 % killed: one such node
# took notices at 15 s of a 17 s stage, and stopped relaying, at 3 s alone).
LAG_SHARE = 0.5
# Notices of lagging a node takes, within NOTICE_WINDOW_S, before it stops relaying: a
# node can fall behind one parent for a while (its stream cut by a death, say); a slow
# link lags in every tree, chunk after chunk.
LAG_NOTICES = 3
NOTICE_WINDOW_S = 60.0
NOT_RELAYING_S = 600.0  # how long a node found lagging stops relaying

log = logging.getLogger(__name__)


def lags(held_s: float, staging_s: float) -> bool:
    """Whether a node staging for ``staging_s`` lags its relay parent, which had held the
    chunk it asked for whole for ``held_s``.

    A chunk the parent held since before this node's stage began says nothing of this
    node's link: it was not staging then, to take it as a stream. Counted, a node that
    began its stage seconds after its parents (retrying a stage an S3 error storm failed,
    five seconds after them; a late joiner) stopped relaying at its first chunks, and its
    peers stood in for it at the origin: chunks fetched twice (e2e test_faults' storm)."""
    return max(LAG_S, LAG_SHARE * staging_s) < held_s <= staging_s


def stops_relaying(notices: Sequence[float], now: float) -> bool:
    """Whether a node that took notices of lagging at times ``notices`` (oldest first)
    stops relaying at ``now``."""
    return len(notices) >= LAG_NOTICES and now - notices[-LAG_NOTICES] <= NOTICE_WINDOW_S


class RelayStatus:
    """Whether this node relays: not for ``NOT_RELAYING_S`` once it took ``LAG_NOTICES``
    notices of lagging its tree parents. Thread-safe."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._notices: deque[float] = deque(maxlen=LAG_NOTICES)
        self._until = -math.inf

    def parent_held(self, held_s: float, staging_s: float) -> bool:
        """This node's relay parent in a chunk's tree sent it the chunk whole, having held
        it ``held_s``, while this node has been staging for ``staging_s``: a notice of
        lagging when it ``lags``. Whether this node stopped relaying just now."""
        if not lags(held_s, staging_s):
            return False
        with self._lock:
            now = self._clock()
            self._notices.append(now)
            if not stops_relaying(self._notices, now):
                return False
            was_relaying = self._relaying()
            self._until = now + NOT_RELAYING_S
        if was_relaying:
            log.warning(
                "this node's relay parents had held %d of the chunks it asked them for whole "
                "for over %.0f s (and half the time it has been staging), within %.0f s: its "
                "link lags, so it stops relaying chunks for %.0f s, and the nodes below it "
                "take them from above it",
                LAG_NOTICES,
                LAG_S,
                NOTICE_WINDOW_S,
                NOT_RELAYING_S,
            )
        return was_relaying

    @property
    def relaying(self) -> bool:
        with self._lock:
            return self._relaying()

    def _relaying(self) -> bool:
        return self._clock() >= self._until
