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

from flover.models.kv_codes import position_bytes, quantized_kv
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
    num_layers: int,
    max_slots: int,
    kv_heads: int,
    max_seq_len: int,
    head_dim: int,
    dtype: torch.dtype,
    kinds: tuple[str, str] | None = None,
) -> int:
    """`kinds`: --kv-dtype's K and V blocks (models/kv_codes.py; None: rows of `dtype`)."""
    return num_layers * max_slots * kv_heads * max_seq_len * position_bytes(head_dim, dtype, kinds)


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


@dataclass
class KVGroup:
    """Layers whose KV lie in one tensor: the same kind (full length, or windowed) and the same
    head shape. kv [layers, 2, slots, kv_heads, positions, head_dim]; its prefix pool [layers, 2,
    blocks, kv_heads, block_tokens, head_dim] (None without one)."""

    layers: list[int]
    windowed: bool
    kv: torch.Tensor
    pool: torch.Tensor | None
    head_dim: int = 0


class SlotBuffer:
    """KV cache `[layers, 2, max_slots, kv_heads, max_seq_len, head_dim]` plus per-slot state.

    Recurrent layers (Gated DeltaNet) keep no KV: their per-slot conv and recurrent states lie in
    `conv` [layers, slots, channels, K - 1] and `recurrent_state` [layers, slots, heads, dk, dv],
    `layers[n]` is the pair of layer n's, and the shuffle moves them with the KV rows.

    With --kv-dtype's codes (`kv_kinds`, models/kv_codes.py) a group's tensor holds bytes, `[layers,
    1, slots, kv_heads, positions, K row + V row]`, and `layers[n]` is a QuantizedKV (kv[0], kv[1]
    quantize what attention writes and give the codes it reads; `.rows` the bytes); the copies
    below move bytes alike.

    With windowed KV (kv_window.py) the sliding-window layers live apart, `[windowed layers, 2,
    max_slots, kv_heads, capacity, head_dim]`, and the per-slot state `window_base` says which
    position each slot's row 0 holds there. Layers of another head shape (Gemma 4's full-attention
    layers) lie in a tensor of their own too: one `KVGroup` per kind and shape; `layers[n]` is
    layer n's `[2, slots, kv_heads, positions, head_dim]` in its group's. A layer reading another
    layer's KV (Gemma 4's shared KV) keeps none: `layers[n]` is that layer's.

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
        shapes: Sequence[tuple[int, int]] | None = None,
        kv_sources: Sequence[int] | None = None,
        kv_kinds: tuple[str, str] | None = None,
    ):
        """`prefix_blocks`: rows of the prefix pool, each `block_tokens` positions (0: none).
        `scratch_slots`: KV slots past the last real one that padding rows may write (CUDA graphs).
        `prefault_pool`: write the pool once now, so that its host memory is taken at start-up.
        `window`: the sliding-window layers' bound (None: every layer keeps max_seq_len positions).
        `recurrent`: the layers that keep a recurrent state per slot instead of KV (None: none).
        `shapes`: per layer (kv_heads, head_dim) where they differ between layers (None: all alike).
        `kv_sources`: per layer, the layer whose KV it reads (None: each its own).
        `kv_kinds`: K's and V's blocks (None: rows of `dtype`)."""
        if prefix_blocks or window:  # whole blocks per slot, so that a slot's blocks are one view away
            max_seq_len = -(-max_seq_len // block_tokens) * block_tokens
        stateful = sorted(recurrent.layers) if recurrent else []
        sources = list(kv_sources) if kv_sources is not None else list(range(num_layers))
        shapes = list(shapes) if shapes is not None else [(kv_heads, head_dim)] * num_layers
        keeping = [n for n in range(num_layers) if n not in set(stateful) and sources[n] == n]
        kinds = _kinds(keeping, shapes, window, max_seq_len)
        slots = max_slots + scratch_slots
        state = recurrent.slot_bytes(dtype) * (slots + recurrent.snapshots) if recurrent else 0  # (with snapshots)
        sized = [(len(layers), heads, dim, positions) for (_, heads, dim, positions), layers in kinds.items()]
        need, pool = _fitting_bytes(
            sized, max_slots, slots, (dtype, kv_kinds), block_tokens, prefix_blocks, device, state
        )
        self.groups = _groups(kinds, slots, (prefix_blocks, block_tokens), (dtype, kv_kinds), device, prefault_pool)
        self.kv = self.groups[0].kv if self.groups else None  # (the first group's: what most models have)
        self.kv_kinds = kv_kinds
        self.layers = _layer_views(self.groups, sources, kv_kinds)  # per layer [2, slots, kv_heads, ...]
        self.recurrent, self.state_nbytes = recurrent, state
        self._recurrent_buffers(recurrent, stateful, slots, dtype, device)
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
        return [g.kv for g in self.groups]

    # -- windowed layers: a slot's rows slide down as its window moves on ----------------------
    def apply_shifts(self, shifts: Sequence[WindowShift]) -> None:
        """Rows [start, start + count) of each shifted slot's windowed layers move to [0, count)
        (through a copy: the ranges may overlap), and the slot's window base follows."""
        for shift in shifts:
            for group in self.groups:
                if group.windowed:
                    rows = group.kv[:, :, shift.slot, :]  # [layers, 2, heads, capacity, dim]
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

    # -- the prefix pool's rows as bytes (the prefix cache on disk: engine/prefix_disk.py) -------
    @property
    def block_nbytes(self) -> int:
        """One pool row's bytes: every group's [layers, 2, heads, block_tokens, dim]."""
        return sum(v.numel() * v.element_size() for v in self._pool_row(0))

    @property
    def snapshot_nbytes(self) -> int:
        """One snapshot row's bytes: every recurrent layer's conv and recurrent state."""
        if self.snapshot_conv is None:
            return 0
        return sum(v.numel() * v.element_size() for v in self._snapshot_row(0))

    def _pool_row(self, row: int) -> list[torch.Tensor]:
        """Pool row `row` of every group: [layers, 2, heads, block_tokens, dim] views."""
        return [g.pool[:, :, row] for g in self.groups if g.pool is not None]

    def _snapshot_row(self, row: int) -> list[torch.Tensor]:
        """Snapshot row `row`: every recurrent layer's conv, then its recurrent state."""
        return [self.snapshot_conv[:, row], self.snapshot_state[:, row]]

    def block_bytes(self, row: int) -> bytes:
        return _as_bytes(self._pool_row(row))

    def snapshot_bytes(self, row: int) -> bytes:
        return _as_bytes(self._snapshot_row(row))

    def fill_blocks(self, fills: Sequence[tuple[int, bytes]]) -> None:
        """Pool rows <- bytes block_bytes gave (checked by the reader: as many as block_nbytes)."""
        for row, payload in fills:
            _from_bytes(self._pool_row(row), payload)

    def fill_snapshots(self, fills: Sequence[tuple[int, bytes]]) -> None:
        for row, payload in fills:
            _from_bytes(self._snapshot_row(row), payload)

    def _pairs(
        self, copies: Sequence[BlockCopy]
    ) -> list[tuple[torch.Tensor, torch.Tensor, list[tuple[int, int, int]]]]:
        """(KV, pool, [(slot, row in the slot, pool row)]) for the full layers, then the windowed ones."""
        if not copies:
            return []
        full = [(c.slot, c.position, c.block) for c in copies]
        windowed = [(c.slot, c.window_row, c.block) for c in copies if c.window_row is not None]
        pairs = [(g.kv, g.pool, windowed if g.windowed else full) for g in self.groups if g.pool is not None]
        return [(kv, pool, picked) for kv, pool, picked in pairs if picked]


def _as_bytes(views: list[torch.Tensor]) -> bytes:
    """The views' elements, one after another, as bytes (on the host)."""
    return b"".join(v.contiguous().cpu().view(torch.uint8).numpy().tobytes() for v in views)


def _from_bytes(views: list[torch.Tensor], payload: bytes) -> None:
    """The views <- their elements from payload, one after another (_as_bytes' inverse)."""
    data, at = torch.frombuffer(bytearray(payload), dtype=torch.uint8), 0
    for view in views:
        n = view.numel() * view.element_size()
        view.copy_(data[at : at + n].view(view.dtype).view(view.shape))
        at += n


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


def _groups(kinds: dict, slots: int, blocks: tuple[int, int], dtypes: tuple, device, prefault: bool) -> list[KVGroup]:
    """One KV tensor (and prefix pool: `blocks` of `block_tokens`) per kind of layers. Zeros, not
    empty: masked-out positions are multiplied by 0 in attention and must not be NaN (codes: a
    zero scale). dtypes: (the model's, --kv-dtype's kinds or None)."""
    (count, tokens), (dtype, kv_kinds) = blocks, dtypes

    def shape(layers: list[int], rows: int, heads: int, positions: int, dim: int) -> tuple[int, ...]:
        if kv_kinds is None:
            return (len(layers), 2, rows, heads, positions, dim)
        return (len(layers), 1, rows, heads, positions, position_bytes(dim, dtype, kv_kinds))

    kind = dtype if kv_kinds is None else torch.uint8
    return [
        KVGroup(
            layers,
            windowed,
            zeroed_tensor(shape(layers, slots, heads, positions, dim), kind, device),
            _prefix_pool(shape(layers, count, heads, tokens, dim), kind, device, prefault),
            dim,
        )
        for (windowed, heads, dim, positions), layers in kinds.items()
    ]


def _layer_views(groups: list[KVGroup], sources: list[int], kv_kinds) -> list:
    """Per layer its [2, slots, kv_heads, positions, head_dim] in its group's tensor (codes: its
    QuantizedKV), or the layer's it reads (Gemma 4's shared KV); None for a layer keeping none
    (recurrent: set after)."""
    views: list = [None] * len(sources)
    for group in groups:
        for i, n in enumerate(group.layers):
            views[n] = group.kv[i] if kv_kinds is None else quantized_kv(group.kv[i], kv_kinds, group.head_dim)
    for n, source in enumerate(sources):
        if source != n:
            views[n] = views[source]
    return views


def _kinds(keeping: list[int], shapes: list[tuple[int, int]], window, max_seq_len: int) -> dict[tuple, list[int]]:
    """The layers that keep KV by (windowed, kv_heads, head_dim, positions): one tensor each,
    the full-length layers' first."""
    windowed = set(window.layers) if window else set()
    kinds: dict[tuple, list[int]] = {}
    for n in sorted(keeping, key=lambda n: n in windowed):
        positions = window.capacity if n in windowed else max_seq_len
        kinds.setdefault((n in windowed, *shapes[n], positions), []).append(n)
    return kinds


def _fitting_bytes(
    sized: list[tuple[int, int, int, int]],
    max_slots: int,
    slots: int,
    dtypes: tuple,
    block_tokens: int,
    prefix_blocks: int,
    device,
    state: int,
):
    """(the KV's bytes, the prefix pool's) where they fit the device's memory beside `state` bytes
    of recurrent layers' states and snapshots, else MemoryError naming the sizes and the flags
    that lower them. sized: per KV group (layers, kv heads, head_dim, positions); dtypes: (the
    model's, --kv-dtype's kinds or None)."""
    dtype, kinds = dtypes
    need = sum(kv_cache_bytes(n, slots, heads, positions, dim, dtype, kinds) for n, heads, dim, positions in sized)
    pool = sum(kv_cache_bytes(n, prefix_blocks, heads, block_tokens, dim, dtype, kinds) for n, heads, dim, _ in sized)
    dtype = dtype if kinds is None else "/".join(kinds)
    have = available_memory_bytes(device)
    if need + pool + state > have:
        groups = " + ".join(
            f"{layers} layers x 2 x {max_slots} slots x {heads} kv heads x {positions} positions x {dim}"
            for layers, heads, dim, positions in sized
        )
        raise MemoryError(
            f"KV cache needs {need / 2**20:.1f} MiB ({groups or 'no layers'} x {dtype})"
            f"{f' + {pool / 2**20:.1f} MiB of prefix cache' if pool else ''}"
            f"{f' + {state / 2**20:.1f} MiB of recurrent state' if state else ''} but only "
            f"{have / 2**20:.1f} MiB is available on {device}; lower --max-slots, --max-seq-len or --prefix-cache"
        )
    return need, pool


def _prefix_pool(shape: tuple, dtype: torch.dtype, device, prefault: bool) -> torch.Tensor | None:
    """A KV group's prefix pool [layers, 2, blocks, kv_heads, block_tokens, head_dim], or None
    without blocks. Pool rows are only read after a store wrote them: empty is safe, and its
    pages are taken by the stores that first touch them, inside iterations; a server takes them
    now instead (`prefault`; docs/design_notes.md, "prefix pool")."""
    if not shape[2]:
        return None
    pool = torch.empty(shape, dtype=dtype, device=device)
    if prefault:
        pool.zero_()
    return pool
