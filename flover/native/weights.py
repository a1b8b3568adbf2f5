"""The native step's copies of the weights: the blocked layout its tiles read, the LM head's screen
for greedy rows, and the arena of 2 MiB pages that holds them all."""

from __future__ import annotations

import math
import mmap
from collections.abc import Callable
from dataclasses import dataclass

import torch

from flover.models.quant import QuantizedWeight, quantize
from flover.native.grids import int8_rows_run


def blocked_shape(weight: torch.Tensor) -> tuple[int, ...]:
    """The kernels' layout of an [n, k] weight (llama_forward.c, "projections"): output rows in
    blocks of 16 (zero rows pad the last), interleaved so that one 64-byte load holds the 16 rows'
    weights for the next input (float32: [n / 16, k, 16]) or input pair (bfloat16: [n / 16, k / 2, 16, 2])."""
    n, k = weight.shape
    blocks = -(-n // 16)
    return (blocks, k // 2, 16, 2) if weight.dtype == torch.bfloat16 else (blocks, k, 16)


def block_weight(weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Write `weight` [n, k] into `out` (of blocked_shape) in the blocked layout: input pairs where
    `out` has four dimensions, single inputs where it has three."""
    n, k = weight.shape
    padded = torch.zeros(out.shape[0] * 16, k, dtype=weight.dtype)
    padded[:n] = weight.detach()
    if out.dim() == 4:
        return out.copy_(padded.view(-1, 16, k // 2, 2).permute(0, 2, 1, 3))
    return out.copy_(padded.view(-1, 16, k).permute(0, 2, 1))


@dataclass
class HeadScreen:
    """A cheaper copy of a dense LM head that scores a greedy row's vocabulary first (llama_forward.c,
    "greedy through a screen of the LM head"), and per vocabulary row the factor of a bound on how
    far its score can be from the exact logit (the proof: docs/design_notes.md, "head screen")."""

    shapes: list[tuple[tuple[int, ...], torch.dtype]]  # in the arena: the copy's tensors, then the bounds
    fill: Callable[[list[torch.Tensor]], None]  # writes the copy's tensors (blocked)
    bounds: torch.Tensor  # float32 [vocab]

    @classmethod
    def of(cls, head: torch.Tensor) -> "HeadScreen":
        vocab, k = head.shape
        head = head.detach()
        gamma = k * 2.0**-24 / (1 - k * 2.0**-24)
        margin = 1 + 2.0**-12
        if head.dtype == torch.float32:
            copy = head.to(torch.bfloat16)
            factor = (2.0**-7 + 2.0**-16 + 2 * gamma * (1 + 2.0**-7)) * margin
            bounds = torch.linalg.vector_norm(head, dim=1) * factor
            return cls(
                [(blocked_shape(copy), torch.bfloat16), ((vocab,), torch.float32)],
                lambda out: block_weight(copy, out[0]),
                bounds,
            )
        codes, scales, bounds = [], [], []
        for part in head.split(2048):  # a part at a time: its float32 temporaries stay in cache (0.1 s, not 0.7)
            quantized, _ = quantize(part, "int8")
            w, scale = part.float(), quantized.scales.float()
            error = (w - quantized.data.float() * scale[:, None]).abs().amax(1)
            largest = torch.maximum(w.abs().amax(1), quantized.data.abs().amax(1).float() * scale)
            bounds.append((error + (2 * gamma + 2.0**-23) * largest) * margin)
            codes.append(quantized.data)
            scales.append(quantized.scales)
        run = int8_rows_run(QuantizedWeight("int8", torch.cat(codes), torch.cat(scales), 0))
        return cls(run.shapes + [((vocab,), torch.float32)], lambda out: run.fill_once(*out), torch.cat(bounds))

    def place(self, arena: "WeightArena") -> tuple[int, int, int]:
        """Into the arena: (copy, its row scales or 0, bounds) addresses."""
        tensors = [arena.take(shape, dtype) for shape, dtype in self.shapes]
        self.fill(tensors[:-1])
        tensors[-1].copy_(self.bounds)
        self.fill = self.bounds = None  # (they hold the screen's source: the arena has it now)
        scales = tensors[1].data_ptr() if len(tensors) == 3 else 0
        return tensors[0].data_ptr(), scales, tensors[-1].data_ptr()


class WeightArena:
    """One anonymous mapping for all blocked weights, advised to use 2 MiB pages: a token of one
    request streams every weight once, and 4 KiB pages cost a TLB miss every 4 KiB of it
    (docs/design_notes.md, "measured choices"). The native step's scratch is one too."""

    HUGE = 2 << 20

    def __init__(self, nbytes: int):
        # private: a shared anonymous mapping is shmem, which takes huge pages only if shmem does
        self._map = mmap.mmap(-1, nbytes + self.HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        whole = torch.frombuffer(self._map, dtype=torch.uint8)
        start = -whole.data_ptr() % self.HUGE  # the first 2 MiB boundary inside the mapping
        if hasattr(self._map, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
            self._map.madvise(mmap.MADV_HUGEPAGE, start, nbytes)
        self._bytes, self._used = whole[start : start + nbytes], 0

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        size = math.prod(shape) * dtype.itemsize
        chunk = self._bytes[self._used : self._used + size]
        self._used += self._pages(shape, dtype)
        return chunk.view(dtype).view(shape)

    @staticmethod
    def _pages(shape: tuple[int, ...], dtype: torch.dtype) -> int:
        """Bytes a tensor takes here: every one starts on a 4 KiB page."""
        return -(-math.prod(shape) * dtype.itemsize // 4096) * 4096

    @classmethod
    def size(cls, shapes: list[tuple[tuple[int, ...], torch.dtype]]) -> int:
        return sum(cls._pages(shape, dtype) for shape, dtype in shapes)
