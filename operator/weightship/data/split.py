"""A slow whole-chunk transfer, split: the rest fetched from a second peer at once.

A node that fell behind on an owner takes that owner's chunks whole, and when the
owner's uplink is full each such transfer runs at a few % of its link (the fleet
benchmark's traces: one 4 MiB chunk took 9 s) while other peers hold the chunk and have
room. Once a transfer has run ``after_s`` and would need more than ``eta_s`` more at its
rate so far, the part of the chunk past a cut point is asked of another peer, in a
thread of its own. The first stream keeps what it would bring in ``eta_s`` at its rate so
far, a third of what is left at most: a trickle at 8 KiB/s keeps 40 KiB (in 5 s) rounded
up to a piece boundary, not a third of the chunk (of 4 MiB: three minutes). The first
stream goes on meanwhile: if it reaches the chunk's end first, the other part is
dropped; once the other part is in, the first stream stops at the cut (or the next piece
boundary past it) and the rest is copied from the other part.

The cut is a piece boundary, so the sink, which verifies pieces in order as they land,
knows whose bytes a bad piece was: before the cut the first peer's, from it on the
second's (``SplitPieceError`` names it).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from weightship.weightformat.chunkhash import PieceVerificationError

# (start, end) -> (the peer that sent them, the chunk's bytes [start, end)), or None.
FetchRest = Callable[[int, int], "tuple[str, bytes] | None"]

MAIN_SHARE = 3  # the first stream keeps at most a third of what it has left at the split


class SplitPieceError(PieceVerificationError):
    """A piece past the cut, which came from the second peer (``node``), is bad."""

    def __init__(self, exc: PieceVerificationError, node: str) -> None:
        super().__init__(exc.chunk, exc.piece)
        self.node = node


class SplitTransfer:
    """One whole-chunk stream of ``size`` bytes from ``begin`` on, split when slow.

    The stream's reader calls ``landed(pos)`` as bytes land, reads no further than
    ``stop_at(pos)``, and once it stopped calls ``finish``."""

    def __init__(
        self,
        size: int,
        piece_size: int,
        begin: int,
        fetch_rest: FetchRest,
        *,
        after_s: float,
        eta_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.size, self.piece_size, self.begin = size, piece_size, begin
        self._fetch_rest = fetch_rest
        self._after_s, self._eta_s = after_s, eta_s
        self._clock = clock
        self._opened = clock()
        self.cut: int | None = None  # where the second peer's part starts, once split
        self._rest: tuple[str, bytes] | None = None  # set once, by the second fetch
        self.used = False  # the second part finished the chunk

    def landed(self, pos: int) -> None:
        """Bytes up to ``pos`` are in: split once the stream turns out slow."""
        if self.cut is not None:
            return
        elapsed = self._clock() - self._opened
        left = self.size - pos
        if elapsed < self._after_s or pos <= self.begin or left < 2 * self.piece_size:
            return
        rate = (pos - self.begin) / elapsed
        if left <= rate * self._eta_s:
            return
        keep = min(left // MAIN_SHARE, int(rate * self._eta_s))
        cut = self._piece_end(pos + keep)
        if cut >= self.size:
            return
        self.cut = cut
        threading.Thread(
            target=self._fetch, args=(cut,), name="weightship-split", daemon=True
        ).start()

    def _fetch(self, cut: int) -> None:
        rest = self._fetch_rest(cut, self.size)
        if rest is not None and len(rest[1]) == self.size - cut:
            self._rest = rest  # one assignment: the reader sees it whole or not at all

    def stop_at(self, pos: int) -> int:
        """Where the stream stops reading: the chunk's end, or, once the second part is
        in, the cut (or the first piece boundary at or past ``pos`` beyond it)."""
        if self._rest is None or self.cut is None:
            return self.size
        return max(self.cut, self._piece_end(pos))

    def finish(self, view: memoryview, pos: int, landed: Callable[[int], None]) -> int:
        """The stream stopped at ``pos``: copy the second part from there on into
        ``view`` when it is in and reaches back that far, say it landed, and return the
        end reached. A bad piece past ``pos`` raises SplitPieceError."""
        rest, cut = self._rest, self.cut
        if rest is None or cut is None or pos >= self.size or pos < cut:
            return pos
        node, data = rest
        view[pos : self.size] = data[pos - cut :]
        try:
            landed(self.size)
        except PieceVerificationError as exc:
            if exc.piece * self.piece_size >= pos:
                raise SplitPieceError(exc, node) from exc
            raise
        self.used = True
        return self.size

    def _piece_end(self, pos: int) -> int:
        """The first piece boundary at or after ``pos`` (the chunk's end at most)."""
        return min(self.size, -(-pos // self.piece_size) * self.piece_size)
