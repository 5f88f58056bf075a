"""Where this node holds a verified copy of each chunk, by digest.

Chunks are not kept as separate files: they live at their offsets inside the models'
files (final or still partial). The index maps a chunk digest to one such place. An
entry is added only after the bytes were verified and written (and journaled), so
anything the index names can be served to peers and copied for dedupe. Waiters (the
peer server's long-poll) are woken when a chunk lands.

A chunk still arriving, whose pieces are verified one by one (version 2), is listed as
``Receiving`` while it lands: its verified prefix only grows, and the bytes below it are
in place and never written again, so the peer server may stream them on (cut-through).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class ChunkLocation:
    model: str  # manifest digest, hex
    path: str  # the file inside the model
    offset: int
    size: int


class Receiving:
    """A chunk landing at ``location``: bytes [0, verified) are verified and in place."""

    def __init__(self, location: ChunkLocation, index_changed: threading.Condition) -> None:
        self.location = location
        self.verified = 0
        self.ended = False  # verified whole (then indexed) or given up
        self._cond = threading.Condition()
        self._index_changed = index_changed  # woken by the first verified piece

    def advance(self, verified: int) -> None:
        with self._cond:
            first = self.verified == 0 < verified
            if verified > self.verified:
                self.verified = verified
                self._cond.notify_all()
        if first:
            with self._index_changed:
                self._index_changed.notify_all()

    def end(self) -> None:
        with self._cond:
            self.ended = True
            self._cond.notify_all()

    def wait_past(self, sent: int, timeout_s: float) -> int:
        """The verified prefix, once it is past ``sent`` (or the wait timed out, or the
        receive ended)."""
        with self._cond:
            self._cond.wait_for(lambda: self.verified > sent or self.ended, timeout=timeout_s)
            return self.verified


class ChunkIndex:
    def __init__(self) -> None:
        self._where: dict[str, list[ChunkLocation]] = {}
        self._receiving: dict[str, Receiving] = {}
        self._landed: dict[str, float] = {}  # when each chunk a stage fetched landed here
        self._changed = threading.Condition()

    def start_receiving(self, key: str, location: ChunkLocation) -> Receiving:
        """List a chunk that starts landing at ``location`` (the one already listed for
        ``key``, if any, is returned)."""
        with self._changed:
            found = self._receiving.get(key)
            if found is None or found.ended:
                found = self._receiving[key] = Receiving(location, self._changed)
            return found

    def stop_receiving(self, key: str, receiving: Receiving) -> None:
        with self._changed:
            if self._receiving.get(key) is receiving:
                del self._receiving[key]
        receiving.end()

    def receiving(self, key: str) -> Receiving | None:
        with self._changed:
            return self._receiving.get(key)

    def wait_any(self, key: str, timeout_s: float) -> ChunkLocation | Receiving | None:
        """Where the whole verified chunk is, else the chunk's ``Receiving`` once it has
        a verified byte; waiting up to ``timeout_s`` for either."""

        def found() -> ChunkLocation | Receiving | None:
            places = self._where.get(key)
            if places:
                return places[0]
            r = self._receiving.get(key)
            return r if r is not None and r.verified > 0 else None

        deadline = time.monotonic() + timeout_s
        with self._changed:
            while (hit := found()) is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._changed.wait(left)
            return hit

    def add(self, key: str, location: ChunkLocation, *, landed: bool = False) -> None:
        """List a verified copy of ``key``; ``landed``: fetched by a stage just now (not
        found on disk), so its ``held_s`` counts from now."""
        with self._changed:
            if landed:
                self._landed.setdefault(key, time.monotonic())
            places = self._where.setdefault(key, [])
            if location not in places:
                places.append(location)
            self._changed.notify_all()

    def held_s(self, key: str) -> float | None:
        """How long ago ``key`` landed here in a stage; None when it was found on disk, or
        is not here."""
        with self._changed:
            landed = self._landed.get(key)
        return None if landed is None else time.monotonic() - landed

    def get(self, key: str) -> ChunkLocation | None:
        with self._changed:
            places = self._where.get(key)
            return places[0] if places else None

    def wait(self, key: str, timeout_s: float) -> ChunkLocation | None:
        """The chunk's location, waiting up to ``timeout_s`` for it to land."""
        with self._changed:
            self._changed.wait_for(lambda: key in self._where, timeout=timeout_s)
            places = self._where.get(key)
            return places[0] if places else None

    def drop_model(self, model: str) -> None:
        with self._changed:
            for key, r in list(self._receiving.items()):
                if r.location.model == model:
                    del self._receiving[key]
                    r.end()
            for sha in list(self._where):
                kept = [loc for loc in self._where[sha] if loc.model != model]
                if kept:
                    self._where[sha] = kept
                else:
                    del self._where[sha]
                    self._landed.pop(sha, None)

    def __len__(self) -> int:
        with self._changed:
            return len(self._where)
