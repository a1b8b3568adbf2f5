"""The contiguous slot buffer: one KV tensor for the whole model plus per-slot state, and the
two-step memory shuffle that keeps live requests in slots [0, n); beside it, the prefix pool
that keeps recent sequences' KV blocks (flover/engine/prefix_cache.py plans what goes where).

Step 1 (`plan_compaction`, pure Python): the fewest slot moves that make the live slots
contiguous again. Step 2 (`SlotBuffer.apply_moves`): the copies (one batched copy per buffer on
CUDA; on CPU the KV copies slot by slot, which is faster there).
"""

from __future__ import annotations

import logging
import math
import mmap
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

if TYPE_CHECKING:  # the copies the prefix index plans (a type only)
    from flover.engine.prefix_cache import BlockCopy

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Move:
    src: int  # a live slot at or beyond the new live count
    dst: int  # a hole below the new live count


def plan_compaction(occupied: Sequence[bool]) -> list[Move]:
    """Moves that pack the occupied slots into [0, live).

    Every live slot at index >= live must move and no other needs to, so the plan has exactly
    as many moves as there are live slots beyond the target range: the fewest possible. Sources
    all lie outside [0, live) and destinations inside it, so no copy reads a slot another writes.
    Holes are filled in order with the lowest sources first, which keeps admission order.
    """
    live = sum(1 for o in occupied if o)
    holes = [i for i in range(live) if not occupied[i]]
    sources = [i for i in range(live, len(occupied)) if occupied[i]]
    assert len(holes) == len(sources), "occupancy bookkeeping is inconsistent"
    return [Move(src, dst) for src, dst in zip(sources, holes)]


def kv_cache_bytes(
    num_layers: int, max_slots: int, kv_heads: int, max_seq_len: int, head_dim: int, dtype: torch.dtype
) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return num_layers * 2 * max_slots * kv_heads * max_seq_len * head_dim * elem


def zeroed_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of zeros. On the host it lies in an anonymous mapping: the kernel's zero pages,
    each taken only when first written, so resident memory follows the positions requests
    write instead of the whole capacity (torch.zeros writes every page at once)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    mapping = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # a 2 MiB page's first touch costs ~3 ms (docs/journal.md)
        mapping.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(mapping, dtype=torch.uint8)[:nbytes].view(dtype).view(shape)  # keeps the mapping


def available_memory_bytes(device: torch.device) -> int:
    """Memory this process can still take on `device`."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


class SlotBuffer:
    """KV cache `[layers, 2, max_slots, kv_heads, max_seq_len, head_dim]` plus per-slot state.

    Per-slot state tensors (`[max_slots]` each) are registered with `add_state` and move with
    the KV rows, so everything about slot i is always found at index i.
    """

    def __init__(
        self,
        num_layers: int,
        max_slots: int,
        kv_heads: int,
        max_seq_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        prefix_blocks: int = 0,
        block_tokens: int = 16,
        scratch_slots: int = 0,
        prefault_pool: bool = False,
    ):
        """`prefix_blocks`: rows of the prefix pool, each `block_tokens` positions (0: none).
        `scratch_slots`: KV slots past the last real one that padding rows may write (CUDA graphs).
        `prefault_pool`: write the pool once now, so that its host memory is taken at start-up."""
        if prefix_blocks:  # whole blocks per slot, so that a slot's blocks are one view away
            max_seq_len = -(-max_seq_len // block_tokens) * block_tokens
        need = kv_cache_bytes(num_layers, max_slots + scratch_slots, kv_heads, max_seq_len, head_dim, dtype)
        pool = kv_cache_bytes(num_layers, prefix_blocks, kv_heads, block_tokens, head_dim, dtype)
        have = available_memory_bytes(device)
        if need + pool > have:
            raise MemoryError(
                f"KV cache needs {need / 2**20:.1f} MiB ({num_layers} layers x 2 x {max_slots} slots x "
                f"{kv_heads} kv heads x {max_seq_len} positions x {head_dim} x {dtype})"
                f"{f' + {pool / 2**20:.1f} MiB of prefix cache' if pool else ''} but only "
                f"{have / 2**20:.1f} MiB is available on {device}; lower --max-slots, --max-seq-len or --prefix-cache"
            )
        # Zeros, not empty: masked-out positions are multiplied by 0 in attention and must not be NaN.
        self.kv = zeroed_tensor(
            (num_layers, 2, max_slots + scratch_slots, kv_heads, max_seq_len, head_dim), dtype, device
        )
        # Pool rows are only read after a store wrote them: empty is safe, and its pages are taken
        # by the stores that first touch them, inside iterations; a server takes them now instead
        # (docs/design_notes.md, "prefix pool").
        self.pool = (
            torch.empty(num_layers, 2, prefix_blocks, kv_heads, block_tokens, head_dim, dtype=dtype, device=device)
            if prefix_blocks
            else None
        )
        if self.pool is not None and prefault_pool:
            self.pool.zero_()
        self.block_tokens = block_tokens
        self.nbytes, self.pool_nbytes = need, pool
        self.max_slots = max_slots
        self.scratch_slot = max_slots if scratch_slots else None
        self.max_seq_len = max_seq_len
        self.device = device
        self.state: dict[str, torch.Tensor] = {}
        self.moves_done = 0  # slots moved by the shuffle so far (metrics)
        self.bytes_moved = 0  # KV bytes those moves copied
        self.move_seconds = 0.0  # and the time they took (on CUDA: to queue them)

    def add_state(self, name: str, dtype: torch.dtype, fill=0) -> torch.Tensor:
        tensor = torch.full((self.max_slots,), fill, dtype=dtype, device=self.device)
        self.state[name] = tensor
        return tensor

    def apply_moves(self, moves: Sequence[Move], positions: int | None = None) -> None:
        """Step 2 of the shuffle: one batched copy for the KV (all layers, K and V; on CPU a copy
        per moved slot) and one per state tensor. Safe because sources and destinations are
        disjoint (see plan_compaction).
        `positions`: only the first `positions` sequence positions hold data in the moved slots;
        copying just those (a view) saves copying the whole max_seq_len."""
        if not moves:
            return
        started = time.perf_counter()
        src = torch.tensor([m.src for m in moves], device=self.device)
        dst = torch.tensor([m.dst for m in moves], device=self.device)
        kv = self.kv if positions is None else self.kv[..., :positions, :]  # [layers, 2, slots, heads, pos, dim]
        if kv.device.type == "cpu":  # a strided copy per slot: faster than gather then scatter
            for m in moves:
                kv[:, :, m.dst].copy_(kv[:, :, m.src])
        else:
            kv.index_copy_(2, dst, kv.index_select(2, src))
        self.moves_done += len(moves)
        self.bytes_moved += len(moves) * kv[:, :, 0].numel() * kv.element_size()
        for tensor in self.state.values():
            tensor.index_copy_(0, dst, tensor.index_select(0, src))
        self.move_seconds += time.perf_counter() - started

    # -- the prefix pool: a copy per block on CPU, one batched copy each way on CUDA -----------
    def _slot_blocks(self) -> torch.Tensor:
        """The KV viewed as [layers, 2, slots, heads, blocks per slot, block_tokens, dim]."""
        L, two, S, H, P, D = self.kv.shape
        return self.kv.view(L, two, S, H, P // self.block_tokens, self.block_tokens, D)

    def save_blocks(self, copies: Sequence[BlockCopy]) -> None:
        """Slot positions -> pool rows (before the shuffle moves the slots)."""
        if not copies:
            return
        if self.kv.device.type == "cpu":  # a strided copy per block: faster than gathering them first
            for in_slot, in_pool in self._block_views(copies):
                in_pool.copy_(in_slot)
            return
        slots, blocks, rows = self._index(copies)
        picked = self._slot_blocks()[:, :, slots, :, blocks]  # [n, layers, 2, heads, block_tokens, dim]
        self.pool.index_copy_(2, rows, picked.permute(1, 2, 0, 3, 4, 5))

    def load_blocks(self, copies: Sequence[BlockCopy]) -> None:
        """Pool rows -> slot positions (into newly admitted slots, after the shuffle)."""
        if not copies:
            return
        if self.kv.device.type == "cpu":
            for in_slot, in_pool in self._block_views(copies):
                in_slot.copy_(in_pool)
            return
        slots, blocks, rows = self._index(copies)
        self._slot_blocks()[:, :, slots, :, blocks] = self.pool.index_select(2, rows).permute(2, 0, 1, 3, 4, 5)

    def _block_views(self, copies: Sequence[BlockCopy]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per copy, its block in the slot and its pool row: [layers, 2, heads, block_tokens, dim] views."""
        blocks = self._slot_blocks()
        return [(blocks[:, :, c.slot, :, c.position // self.block_tokens], self.pool[:, :, c.block]) for c in copies]

    def _index(self, copies: Sequence[BlockCopy]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        as_tensor = lambda values: torch.tensor(values, dtype=torch.int64, device=self.device)  # noqa: E731
        return (
            as_tensor([c.slot for c in copies]),
            as_tensor([c.position // self.block_tokens for c in copies]),
            as_tensor([c.block for c in copies]),
        )
