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
from typing import NamedTuple, Sequence

import torch

from flover.runner.kv_window import WindowedKV, WindowShift
from flover.runner.plan import BlockCopy, Move, StateCopy

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RecurrentLayout:
    """The layers that keep a recurrent state instead of KV (Gated DeltaNet), in the buffer's
    numbering, and one slot's state of each: conv [channels, K - 1] in the model's dtype and the
    recurrent state [value heads, dk, dv] in `state_dtype` (models/gated_deltanet.py)."""

    layers: frozenset[int]
    conv_shape: tuple[int, ...]
    state_shape: tuple[int, ...]
    state_dtype: torch.dtype
    snapshots: int = 0  # rows of the prefix cache's state snapshots (engine/prefix_cache.py)

    def slot_bytes(self, dtype: torch.dtype) -> int:
        """One slot's state over all of these layers."""
        conv = math.prod(self.conv_shape) * torch.empty((), dtype=dtype).element_size()
        state = math.prod(self.state_shape) * torch.empty((), dtype=self.state_dtype).element_size()
        return len(self.layers) * (conv + state)


class RecurrentLayerState(NamedTuple):
    """One recurrent layer's share of the buffer: every slot's conv [slots, channels, K - 1] and
    recurrent state [slots, heads, dk, dv], and the prefix cache's snapshots of them [rows, ...]
    (None without a prefix cache)."""

    conv: torch.Tensor
    state: torch.Tensor
    snapshot_conv: torch.Tensor | None
    snapshot_state: torch.Tensor | None


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

    Recurrent layers (Gated DeltaNet) keep no KV: their per-slot conv and recurrent states lie in
    `conv` [layers, slots, channels, K - 1] and `recurrent_state` [layers, slots, heads, dk, dv],
    `layers[n]` is the pair of layer n's, and the shuffle moves them with the KV rows.

    With windowed KV (kv_window.py) the sliding-window layers live apart, in `kv_window`
    `[windowed layers, 2, max_slots, kv_heads, capacity, head_dim]`, and `kv` holds the others;
    `layers[n]` is layer n's `[2, slots, kv_heads, positions, head_dim]` in either, and the
    per-slot state `window_base` says which position each slot's row 0 holds there.

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
        window: WindowedKV | None = None,
        recurrent: RecurrentLayout | None = None,
    ):
        """`prefix_blocks`: rows of the prefix pool, each `block_tokens` positions (0: none).
        `scratch_slots`: KV slots past the last real one that padding rows may write (CUDA graphs).
        `prefault_pool`: write the pool once now, so that its host memory is taken at start-up.
        `window`: the sliding-window layers' bound (None: every layer keeps max_seq_len positions).
        `recurrent`: the layers that keep a recurrent state per slot instead of KV (None: none)."""
        if prefix_blocks or window:  # whole blocks per slot, so that a slot's blocks are one view away
            max_seq_len = -(-max_seq_len // block_tokens) * block_tokens
        windowed = sorted(window.layers) if window else []
        stateful = sorted(recurrent.layers) if recurrent else []
        full = [n for n in range(num_layers) if n not in set(windowed) | set(stateful)]
        slots = max_slots + scratch_slots
        shape = (kv_heads, max_seq_len, head_dim, dtype, block_tokens)
        state = recurrent.slot_bytes(dtype) * (slots + recurrent.snapshots) if recurrent else 0  # (with snapshots)
        need, pool = _fitting_bytes(
            len(full), len(windowed), max_slots, slots, shape, window, prefix_blocks, device, state
        )
        pool_shape = (prefix_blocks, kv_heads, block_tokens, head_dim)
        # Zeros, not empty: masked-out positions are multiplied by 0 in attention and must not be NaN.
        self.kv = zeroed_tensor((len(full), 2, slots, kv_heads, max_seq_len, head_dim), dtype, device)
        self.kv_window = (
            zeroed_tensor((len(windowed), 2, slots, kv_heads, window.capacity, head_dim), dtype, device)
            if window
            else None
        )
        self.layers: list[torch.Tensor] = [None] * num_layers  # [2, slots, kv_heads, positions, head_dim] each
        for i, n in enumerate(full):
            self.layers[n] = self.kv[i]
        for i, n in enumerate(windowed):
            self.layers[n] = self.kv_window[i]
        self.recurrent, self.state_nbytes = recurrent, state
        self._recurrent_buffers(recurrent, stateful, slots, dtype, device)
        self.pool, self.pool_window = _prefix_pools(len(full), len(windowed), pool_shape, dtype, device, prefault_pool)
        self.window = window
        self.block_tokens = block_tokens
        self.nbytes, self.pool_nbytes = need, pool
        self.max_slots = max_slots
        self.scratch_slot = max_slots if scratch_slots else None
        self.max_seq_len = max_seq_len
        self.device, self.dtype = device, dtype
        self.state: dict[str, torch.Tensor] = {}
        self.window_base = self.add_state("window_base", torch.int64) if window else None
        self.moves_done = 0  # slots moved by the shuffle so far (metrics)
        self.bytes_moved = 0  # KV bytes those moves copied
        self.move_seconds = 0.0  # and the time they took (on CUDA: to queue them)

    def _recurrent_buffers(self, recurrent, stateful: list[int], slots: int, dtype, device) -> None:
        """(Gated DeltaNet) per layer [slots, ...] conv and recurrent states, and the prefix
        cache's snapshots of them [rows, ...]: layers[n] = RecurrentLayerState."""
        self.conv = self.recurrent_state = self.snapshot_conv = self.snapshot_state = None
        if recurrent:
            r, count = recurrent, len(stateful)
            self.conv = zeroed_tensor((count, slots, *r.conv_shape), dtype, device)
            self.recurrent_state = zeroed_tensor((count, slots, *r.state_shape), r.state_dtype, device)
            if r.snapshots:
                self.snapshot_conv = zeroed_tensor((count, r.snapshots, *r.conv_shape), dtype, device)
                self.snapshot_state = zeroed_tensor((count, r.snapshots, *r.state_shape), r.state_dtype, device)
            for i, n in enumerate(stateful):
                snaps = (self.snapshot_conv[i], self.snapshot_state[i]) if r.snapshots else (None, None)
                self.layers[n] = RecurrentLayerState(self.conv[i], self.recurrent_state[i], *snaps)

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
        for kv in self._caches():
            if positions is not None:  # [layers, 2, slots, heads, pos, dim]
                kv = kv[..., : min(positions, kv.shape[4]), :]
            if kv.device.type == "cpu":  # a strided copy per slot: faster than gather then scatter
                for m in moves:
                    kv[:, :, m.dst].copy_(kv[:, :, m.src])
            else:
                kv.index_copy_(2, dst, kv.index_select(2, src))
            self.bytes_moved += len(moves) * kv[:, :, 0].numel() * kv.element_size()
        for states in (self.conv, self.recurrent_state) if self.recurrent else ():  # [layers, slots, ...]: whole
            for m in moves:
                states[:, m.dst].copy_(states[:, m.src])
            self.bytes_moved += len(moves) * states[:, 0].numel() * states.element_size()
        self.moves_done += len(moves)
        for tensor in self.state.values():
            tensor.index_copy_(0, dst, tensor.index_select(0, src))
        self.move_seconds += time.perf_counter() - started

    def load_states(self, copies: Sequence[StateCopy]) -> None:
        """Snapshot rows -> the recurrent layers' states of newly admitted slots (with the loads)."""
        for c in copies:
            self.conv[:, c.slot].copy_(self.snapshot_conv[:, c.row])
            self.recurrent_state[:, c.slot].copy_(self.snapshot_state[:, c.row])

    def _caches(self) -> list[torch.Tensor]:
        return [kv for kv in (self.kv, self.kv_window) if kv is not None and kv.shape[0]]

    # -- windowed layers: a slot's rows slide down as its window moves on ----------------------
    def apply_shifts(self, shifts: Sequence[WindowShift]) -> None:
        """Rows [start, start + count) of each shifted slot's windowed layers move to [0, count)
        (through a copy: the ranges may overlap), and the slot's window base follows."""
        for shift in shifts:
            rows = self.kv_window[:, :, shift.slot, :]  # [layers, 2, heads, capacity, dim]
            rows[:, :, :, : shift.count] = rows[:, :, :, shift.start : shift.start + shift.count].clone()
            self.window_base[shift.slot] = shift.base

    # -- the prefix pool: a copy per block on CPU, one batched copy each way on CUDA -----------
    def save_blocks(self, copies: Sequence[BlockCopy]) -> None:
        """Slot positions -> pool rows (before the shuffle moves the slots)."""
        for kv, pool, picked in self._pairs(copies):
            if kv.device.type == "cpu":  # a strided copy per block: faster than gathering them first
                for in_slot, in_pool in _block_views(kv, pool, picked):
                    in_pool.copy_(in_slot)
                continue
            slots, blocks, rows = _index(picked, pool.shape[4], kv.device)
            taken = _slot_blocks(kv, pool.shape[4])[:, :, slots, :, blocks]  # [n, layers, 2, heads, block_tokens, dim]
            pool.index_copy_(2, rows, taken.permute(1, 2, 0, 3, 4, 5))

    def load_blocks(self, copies: Sequence[BlockCopy]) -> None:
        """Pool rows -> slot positions (into newly admitted slots, after the shuffle)."""
        for kv, pool, picked in self._pairs(copies):
            if kv.device.type == "cpu":
                for in_slot, in_pool in _block_views(kv, pool, picked):
                    in_slot.copy_(in_pool)
                continue
            slots, blocks, rows = _index(picked, pool.shape[4], kv.device)
            _slot_blocks(kv, pool.shape[4])[:, :, slots, :, blocks] = pool.index_select(2, rows).permute(
                2, 0, 1, 3, 4, 5
            )

    def _pairs(
        self, copies: Sequence[BlockCopy]
    ) -> list[tuple[torch.Tensor, torch.Tensor, list[tuple[int, int, int]]]]:
        """(KV, pool, [(slot, row in the slot, pool row)]) for the full layers, then the windowed ones."""
        if not copies:
            return []
        pairs = [(self.kv, self.pool, [(c.slot, c.position, c.block) for c in copies])]
        if self.kv_window is not None:
            windowed = [(c.slot, c.window_row, c.block) for c in copies if c.window_row is not None]
            pairs.append((self.kv_window, self.pool_window, windowed))
        return [(kv, pool, picked) for kv, pool, picked in pairs if picked and kv.shape[0]]


def _slot_blocks(kv: torch.Tensor, block_tokens: int) -> torch.Tensor:
    """A KV tensor viewed as [layers, 2, slots, heads, blocks per slot, block_tokens, dim]."""
    L, two, S, H, P, D = kv.shape
    return kv.view(L, two, S, H, P // block_tokens, block_tokens, D)


def _block_views(
    kv: torch.Tensor, pool: torch.Tensor, picked: list[tuple[int, int, int]]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per copy, its block in the slot and its pool row: [layers, 2, heads, block_tokens, dim] views."""
    t = pool.shape[4]
    blocks = _slot_blocks(kv, t)
    return [(blocks[:, :, slot, :, row // t], pool[:, :, block]) for slot, row, block in picked]


def _index(picked: list[tuple[int, int, int]], block_tokens: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    t = torch.tensor(picked, dtype=torch.int64, device=device)  # [n, (slot, row, pool row)]
    return t[:, 0], t[:, 1] // block_tokens, t[:, 2]


def _fitting_bytes(
    full: int, windowed: int, max_slots: int, slots: int, shape: tuple, window, prefix_blocks: int, device, state: int
):
    """(the KV's bytes, the prefix pool's) where they fit the device's memory beside `state` bytes
    of recurrent layers' states and snapshots, else MemoryError naming the sizes and the flags
    that lower them. shape: (kv_heads, positions, head_dim, dtype, a block's positions)."""
    kv_heads, max_seq_len, head_dim, dtype, block_tokens = shape
    need = kv_cache_bytes(full, slots, kv_heads, max_seq_len, head_dim, dtype)
    if window:
        need += kv_cache_bytes(windowed, slots, kv_heads, window.capacity, head_dim, dtype)
    pool = kv_cache_bytes(full + windowed, prefix_blocks, kv_heads, block_tokens, head_dim, dtype)
    have = available_memory_bytes(device)
    if need + pool + state > have:
        raise MemoryError(
            f"KV cache needs {need / 2**20:.1f} MiB ({full + windowed} layers x 2 x {max_slots} slots x "
            f"{kv_heads} kv heads x {max_seq_len} positions x {head_dim} x {dtype}"
            f"{f', {windowed} sliding-window layers x {window.capacity} positions' if window else ''})"
            f"{f' + {pool / 2**20:.1f} MiB of prefix cache' if pool else ''}"
            f"{f' + {state / 2**20:.1f} MiB of recurrent state' if state else ''} but only "
            f"{have / 2**20:.1f} MiB is available on {device}; lower --max-slots, --max-seq-len or --prefix-cache"
        )
    return need, pool


def _prefix_pools(full: int, windowed: int, shape: tuple, dtype: torch.dtype, device, prefault: bool):
    """The prefix pool of the full layers and of the windowed ones: [layers, 2, blocks, kv_heads,
    block_tokens, head_dim] each, or (None, None) without blocks. Pool rows are only read after a
    store wrote them: empty is safe, and its pages are taken by the stores that first touch them,
    inside iterations; a server takes them now instead (`prefault`; docs/design_notes.md, "prefix
    pool"). Split as the KV is."""
    if not shape[0]:
        return None, None
    pools = tuple(torch.empty(layers, 2, *shape, dtype=dtype, device=device) for layers in (full, windowed))
    if prefault:
        for pool in pools:
            pool.zero_()
    return pools
