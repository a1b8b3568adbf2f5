"""Prompt-prefix reuse: the KV rows of recent sequences stay in a bounded pool of blocks after
their requests leave, indexed by token prefix (docs/prefix_cache.md).

A block is BLOCK_TOKENS consecutive positions of one sequence (every layer, K and V). It is
keyed by (its parent block's id, its own tokens): a chain from the sequence's start, as in vLLM's
block hashing, except that the tokens themselves are compared, so no hash collision can ever
serve another prompt's KV. A lookup walks a prompt's full blocks from the start until one is
missing; the request's slot receives the matched blocks (one batched copy) and only the rest of
the prompt is prefilled.

Partitions: a request may carry a `cache_salt`; its blocks then hang from a root of their own, so
that requests share cached prefixes (and the time to first token that reveals a hit) only with
requests of the same salt. The daemon uses the CURVE client key: authenticated clients never
learn from timing what another client's prompts began with.

Windowed KV (runner/kv_window.py): a slot keeps its sliding-window layers' rows only from its
window base on, so a block saved from before it holds the other layers' rows alone ("partial").
A prompt can start after m cached blocks only if the blocks its first query's window reaches back
into are whole; the lookup takes the longest such prefix.

Recurrent layers (Gated DeltaNet, `snapshots` > 0): a layer that keeps a state instead of KV
cannot rebuild it from cached blocks, so a block may carry a *snapshot* of every recurrent layer's
state after its last token, in a pool of its own; a lookup then takes the longest prefix whose
last block has one. The scheduler reserves a snapshot row when a sequence is about to reach a
block edge worth keeping (the last one of its prompt, the last one it generated) and attaches it
to that block when the block is stored; rows are evicted with their blocks, or alone (least
recently used first) when another is wanted.

On disk (`disk`, engine/prefix_disk.py): every block stored (and snapshot attached) is also
written to a directory, and a lookup that runs out of blocks in memory goes on from there: each
block found on disk takes a pool row as a stored one does and comes with the plan's copies (its
bytes: `take_fills`); the blocks to write after the plan ran: `take_writes`.

Pure bookkeeping, no tensors: the scheduler plans the copies, the slot buffer makes them. Every
rank of a tensor-parallel job keeps its own index over its own shard of the pool and, seeing the
same requests in the same order, makes the same decisions (the disk: one rank only, engine.py).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

from flover.engine.prefix_disk import STATE, PrefixDisk, chain_key
from flover.runner.kv_window import WindowedKV
from flover.runner.plan import BlockCopy

BLOCK_TOKENS = 16  # positions per block: the granularity (and the shortest prefix) reused


@dataclass(frozen=True)
class _Block:
    uid: int  # never reused: a child keyed by an evicted parent can never match again
    index: int  # row in the pool
    key: tuple  # (parent uid, or the root of its partition; the block's tokens)
    whole: bool = True  # holds the windowed layers' rows too
    disk_key: bytes = b""  # its key on disk (prefix_disk.chain_key), with one


@dataclass
class PrefixStats:
    lookups: int = 0  # admitted requests that looked for their prompt
    hits: int = 0  # ... and found at least one block
    queried_tokens: int = 0  # prompt tokens those lookups could have reused
    cached_tokens: int = 0  # prompt tokens they did reuse
    stored_blocks: int = 0
    evicted_blocks: int = 0
    disk_hits: int = 0  # lookups that took at least one block from disk
    disk_cached_tokens: int = 0  # prompt tokens those blocks held


@dataclass(frozen=True)
class BlockWrite:
    """A block just stored, for the disk: its pool row's bytes are its file's, once the plan ran."""

    row: int
    key: bytes
    previous: bytes
    tokens: tuple
    whole: bool


class PrefixCache:
    def __init__(
        self,
        num_blocks: int,
        block_tokens: int = BLOCK_TOKENS,
        window: WindowedKV | None = None,
        snapshots: int = 0,
        disk: PrefixDisk | None = None,
        nbytes: tuple[int, int] = (0, 0),
    ):
        """`window`: the model's windowed layers' bound (None: every layer keeps every position).
        `snapshots`: rows of recurrent state (0: the model has no recurrent layers). `disk`: the
        blocks' files, and `nbytes` the bytes of a block's and of a snapshot's (with a disk)."""
        self.num_blocks, self.block_tokens, self.window = num_blocks, block_tokens, window
        self._by_key: dict[tuple, _Block] = {}
        self._lru: OrderedDict[int, _Block] = OrderedDict()  # pool row -> block, least recently used first
        self._free = list(range(num_blocks - 1, -1, -1))
        self._uids = itertools.count(1)
        self.stats = PrefixStats()
        self.recurrent = snapshots > 0
        self._snapshot_of: OrderedDict[int, int] = OrderedDict()  # block uid -> snapshot row, LRU first
        self._free_snapshots = list(range(snapshots - 1, -1, -1))
        self.disk, (self.block_nbytes, self.state_nbytes) = disk, nbytes
        self._writes: dict[int, BlockWrite] = {}  # pool row -> its block, to write once the plan ran
        self._state_writes: dict[int, bytes] = {}  # snapshot row -> its block's disk key, likewise
        self._fills: list[tuple[int, bytes]] = []  # (pool row, a block's bytes read from disk)
        self._state_fills: list[tuple[int, bytes]] = []  # (snapshot row, states read from disk)
        # rows this plan's loads read (with a disk): a block read from disk must not take one, its
        # bytes land before the loads run
        self._pinned: set[int] = set()
        self._pinned_snapshots: set[int] = set()

    @property
    def used_blocks(self) -> int:
        return len(self._lru)

    def lookup(self, tokens: Sequence[int], limit: int, slot: int, salt: str | None = None) -> list[BlockCopy]:
        """The copies that put the longest cached prefix of tokens[:limit] into `slot`, from
        position 0 (full blocks only: len(copies) x block_tokens tokens). `salt`: the partition
        (requests share cached blocks only within one; None is the common one). With windowed
        layers, the slot's window base is then `window.base_for(len(copies) x block_tokens)`."""
        chain = self._chain(tokens, limit, salt)
        found = self._from_disk(tokens, limit, salt, chain) if self.disk is not None else []
        blocks = self._usable(chain + found)
        s = self.stats
        s.lookups += 1
        s.queried_tokens += limit - limit % self.block_tokens
        if blocks:
            s.hits += 1
            s.cached_tokens += len(blocks) * self.block_tokens
            self._touch(blocks)
        if len(blocks) > len(chain):
            s.disk_hits += 1
            s.disk_cached_tokens += (len(blocks) - len(chain)) * self.block_tokens
        if self.disk is not None:
            self._pinned.update(b.index for b in blocks)
        t = self.block_tokens
        base = self.window.base_for(len(blocks) * t) if self.window else None
        return [BlockCopy(slot, i * t, b.index, self._row(i * t, base)) for i, b in enumerate(blocks)]

    def snapshot_after(self, copies: list[BlockCopy]) -> int | None:
        """The snapshot row of the last block a lookup returned (recurrent models), or None."""
        if not copies:
            return None
        block = self._lru[copies[-1].block]
        self._snapshot_of.move_to_end(block.uid)
        if self.disk is not None:
            self._pinned_snapshots.add(self._snapshot_of[block.uid])
        return self._snapshot_of[block.uid]

    def _from_disk(self, tokens: Sequence[int], limit: int, salt: str | None, chain: list[_Block]) -> list[_Block]:
        """The blocks after `chain` that the disk holds, each put in a pool row as if stored (its
        bytes among the fills); recurrent models: up to the last one whose snapshot it holds."""
        t, found, last = self.block_tokens, [], chain[-1] if chain else None
        keep = {b.index for b in chain} | self._pinned
        for start in range(len(chain) * t, limit - t + 1, t):
            previous = last.disk_key if last is not None else self.disk.root(salt)
            own = tuple(tokens[start : start + t])
            key = chain_key(previous, own)
            got = self.disk.read_block(key, previous, own, self.block_nbytes)  # (None: no such file, or a bad one)
            index = self._take_row(keep) if got is not None else None
            if index is None:
                break
            block = _Block(next(self._uids), index, (last.uid if last else _root(salt), own), got.whole, key)
            self._by_key[block.key] = block
            self._lru[index] = block
            keep.add(index)
            found.append(block)
            self._fills.append((index, got.payload))
            last = block
        if self.recurrent:
            self._snapshot_from_disk(found)
        return found

    def _snapshot_from_disk(self, found: list[_Block]) -> None:
        """The deepest of `found` whose state snapshot the disk holds gets it (a snapshot row)."""
        for block in reversed(found):
            if not self.disk.has(block.disk_key, STATE):
                continue
            payload = self.disk.read_state(block.disk_key, self.state_nbytes)
            row = self._snapshot_row() if payload is not None else None
            if row is not None:
                self._snapshot_of[block.uid] = row
                self._state_fills.append((row, payload))
                self._pinned_snapshots.add(row)
            return

    def _snapshot_row(self) -> int | None:
        """reserve_snapshot's row for a state read from disk: never one this plan loads from."""
        if self._free_snapshots:
            return self._free_snapshots.pop()
        for uid, row in self._snapshot_of.items():  # least recently used first
            if row not in self._pinned_snapshots:
                del self._snapshot_of[uid]
                self._state_writes.pop(row, None)
                return row
        return None

    def take_fills(self) -> tuple[list[tuple[int, bytes]], list[tuple[int, bytes]]]:
        """(pool rows, snapshot rows) to fill with bytes read from disk before this plan's loads;
        the plan's lookups are over (its rows are free to take again)."""
        fills, self._fills, states, self._state_fills = self._fills, [], self._state_fills, []
        self._pinned.clear()
        self._pinned_snapshots.clear()
        return fills, states

    def take_writes(self) -> tuple[list[BlockWrite], list[tuple[int, bytes]]]:
        """The blocks stored (and snapshot rows attached: (row, block's key)) since the last call,
        for the disk: their rows hold them once the plan that stored them ran."""
        writes, self._writes = list(self._writes.values()), {}
        states, self._state_writes = list(self._state_writes.items()), {}
        return writes, states

    def _usable(self, chain: list[_Block]) -> list[_Block]:
        """The longest start of `chain` after which a query finds its window's rows in whole blocks
        (recurrent models: whose last block carries a state snapshot)."""
        if self.recurrent:
            while chain and chain[-1].uid not in self._snapshot_of:
                chain = chain[:-1]
            return chain
        if self.window is None:
            return chain
        for m in range(len(chain), 0, -1):
            if all(b.whole for b in chain[self.window.base_for(m * self.block_tokens) // self.block_tokens : m]):
                return chain[:m]
        return []

    def _row(self, position: int, base: int | None) -> int | None:
        """The windowed layers' row of a block at `position` in a slot whose window base is `base`."""
        return position - base if base is not None and position >= base else None

    def store(
        self, tokens: Sequence[int], length: int, slot: int, salt: str | None = None, window_base: int = 0
    ) -> list[BlockCopy]:
        """The copies that save the full blocks of tokens[:length] (their KV in `slot`) the pool
        lacks, evicting the least recently used blocks for room (never the sequence's own).
        `window_base`: the slot's (blocks before it are saved partial)."""
        t = self.block_tokens
        base = window_base if self.window else None
        chain = self._chain(tokens, length, salt)
        keep = {b.index for b in chain}
        copies = []
        for start in range(len(chain) * t, length - t + 1, t):
            index = self._take_row(keep)
            if index is None:
                break
            parent = chain[-1].uid if chain else _root(salt)
            whole = base is None or start >= base
            own = tuple(tokens[start : start + t])
            previous = key = b""
            if self.disk is not None:
                previous = chain[-1].disk_key if chain else self.disk.root(salt)
                key = chain_key(previous, own)
                if not self.disk.has(key):
                    self._writes[index] = BlockWrite(index, key, previous, own, whole)
            block = _Block(next(self._uids), index, (parent, own), whole, key)
            self._by_key[block.key] = block
            self._lru[index] = block
            keep.add(index)
            chain.append(block)
            copies.append(BlockCopy(slot, start, index, self._row(start, base)))
        self._touch(chain)
        self.stats.stored_blocks += len(copies)
        return copies

    def _chain(self, tokens: Sequence[int], length: int, salt: str | None) -> list[_Block]:
        """The cached blocks spelling tokens[:length] from the start, up to the first missing."""
        t, parent, found = self.block_tokens, _root(salt), []
        for start in range(0, length - t + 1, t):
            block = self._by_key.get((parent, tuple(tokens[start : start + t])))
            if block is None:
                break
            found.append(block)
            parent = block.uid
        return found

    def _touch(self, blocks: list[_Block]) -> None:
        for block in reversed(blocks):  # deepest first: a prefix stays fresher than its extensions
            self._lru.move_to_end(block.index)

    def _take_row(self, keep: set[int]) -> int | None:
        if self._free:
            return self._free.pop()
        for index, block in self._lru.items():  # least recently used first
            if index not in keep:
                del self._lru[index], self._by_key[block.key]
                self._writes.pop(index, None)  # (the row takes another block in this plan)
                if block.uid in self._snapshot_of:
                    self._free_snapshots.append(self._snapshot_of.pop(block.uid))
                self.stats.evicted_blocks += 1
                return index
        return None

    # -- recurrent layers' state snapshots -----------------------------------------------------
    def reserve_snapshot(self) -> int | None:
        """A snapshot row for a state about to be taken (the scheduler attaches or releases it):
        a free one, else the least recently used block's (that block stays, without it)."""
        if self._free_snapshots:
            return self._free_snapshots.pop()
        if self._snapshot_of:
            _uid, row = self._snapshot_of.popitem(last=False)
            self._state_writes.pop(row, None)  # (the row takes another state in this plan)
            return row
        return None

    def release_snapshot(self, row: int) -> None:
        self._state_writes.pop(row, None)
        self._free_snapshots.append(row)

    def attach_snapshot(self, tokens: Sequence[int], end: int, salt: str | None, row: int) -> bool:
        """Row `row` holds the state after tokens[:end] (`end` a block edge): it becomes the
        snapshot of the cached block ending there; False (the row released) where that block is
        not cached or already has one."""
        chain = self._chain(tokens, end, salt)
        if len(chain) * self.block_tokens != end or not chain or chain[-1].uid in self._snapshot_of:
            self.release_snapshot(row)
            return False
        self._snapshot_of[chain[-1].uid] = row
        if self.disk is not None and not self.disk.has(chain[-1].disk_key, STATE):
            self._state_writes[row] = chain[-1].disk_key
        return True


def _root(salt: str | None):
    """What a sequence's first block hangs from: 0, or its partition's own root."""
    return 0 if salt is None else ("salt", salt)
