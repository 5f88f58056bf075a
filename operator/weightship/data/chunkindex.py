"""Where this node holds a verified copy of each chunk, by digest.

Chunks are not kept as separate files: they live at their offsets inside the models'
files (final or still partial). The index maps a chunk digest to one such place. An
entry is added only after the bytes were verified and written (and journaled), so
anything the index names can be served to peers and copied for dedupe. Waiters (the
peer server's long-poll) are woken when a chunk lands.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class ChunkLocation:
    model: str  # manifest digest, hex
    path: str  # the file inside the model
    offset: int
    size: int


class ChunkIndex:
    def __init__(self) -> None:
        self._where: dict[str, list[ChunkLocation]] = {}
        self._changed = threading.Condition()

    def add(self, sha256: str, location: ChunkLocation) -> None:
        with self._changed:
            places = self._where.setdefault(sha256, [])
            if location not in places:
                places.append(location)
            self._changed.notify_all()

    def get(self, sha256: str) -> ChunkLocation | None:
        with self._changed:
            places = self._where.get(sha256)
            return places[0] if places else None

    def wait(self, sha256: str, timeout_s: float) -> ChunkLocation | None:
        """The chunk's location, waiting up to ``timeout_s`` for it to land."""
        with self._changed:
            self._changed.wait_for(lambda: sha256 in self._where, timeout=timeout_s)
            places = self._where.get(sha256)
            return places[0] if places else None

    def drop_model(self, model: str) -> None:
        with self._changed:
            for sha in list(self._where):
                kept = [loc for loc in self._where[sha] if loc.model != model]
                if kept:
                    self._where[sha] = kept
                else:
                    del self._where[sha]

    def __len__(self) -> int:
        with self._changed:
            return len(self._where)
