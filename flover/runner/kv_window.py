"""Sliding-window layers keep only their window (docs/models.md, "Sliding-window layers keep about their window").

A layer that attends to its last W keys never reads a key again once W newer ones exist, so its
part of the slot buffer need not span max_seq_len positions: each slot keeps `capacity`
positions for those layers, starting at its *window base* (a block-aligned position; the slot's
position p lies at row p - base). When an iteration would write past base + capacity, the slot's
window slides first: the rows its next queries still need are copied down to row 0 and the base
moves up (a `WindowShift`). With capacity = the window rounded up + one block + the most
positions one iteration writes for one slot, a slot slides at most once every `chunk` positions,
copying under W rows per windowed layer: for a decode stream about one row a position.

Attention itself does not change: positions and lengths relative to the base keep the causal and
window masks as they were, and the keys a query reads are the same rows in the same order, so
the native step's results are bit for bit those of an unbounded cache.

Pure arithmetic (the scheduler plans the shifts, the slot buffer copies the rows).
"""

from __future__ import annotations

from dataclasses import dataclass

WINDOW_CHUNK = 512  # most positions one slot writes in one iteration when it has windowed layers


@dataclass(frozen=True)
class WindowShift:
    slot: int
    start: int  # first row (relative to the old base) that stays
    count: int  # rows that stay: they move to rows [0, count)
    base: int  # the slot's new window base


@dataclass(frozen=True)
class WindowedKV:
    window: int  # W: the widest window among the windowed layers
    capacity: int  # positions each slot keeps for them (a multiple of block_tokens)
    chunk: int  # most positions one slot writes in one iteration
    block_tokens: int
    layers: frozenset[int]  # the windowed layers

    @classmethod
    def plan(
        cls, windows: tuple[int | None, ...], max_seq_len: int, max_batch_tokens: int, block_tokens: int
    ) -> WindowedKV | None:
        """The windowed layers' bound, or None where it would not save memory (no window, or
        one about as long as max_seq_len)."""
        sized = [w for w in windows if w is not None]
        if not sized:
            return None
        t = block_tokens
        window = max(sized)
        chunk = -(-min(max_batch_tokens, WINDOW_CHUNK) // t) * t
        capacity = -(-window // t) * t + t + chunk
        if capacity >= max_seq_len:
            return None
        layers = frozenset(n for n, w in enumerate(windows) if w is not None)
        return cls(window, capacity, chunk, t, layers)

    def base_for(self, first_query: int) -> int:
        """The base that keeps every key a query at `first_query` (or later) reads: the block
        holding its first key of the window."""
        return max(0, first_query - self.window + 1) // self.block_tokens * self.block_tokens

    def shift(self, slot: int, base: int, start: int, end: int) -> WindowShift | None:
        """Where slot's iteration writes positions [start, end) (its keys so far are [base, start)):
        the slide that makes room, or None when they fit."""
        assert end - start <= self.chunk, "a slot writes at most `chunk` positions an iteration"
        if end - base <= self.capacity:
            return None
        new = self.base_for(start)
        return WindowShift(slot, new - base, start - new, new)
