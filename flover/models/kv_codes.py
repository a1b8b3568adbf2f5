"""K and V rows in llama.cpp's blocks (--kv-dtype q8_0 / q4_0): 32 values a block behind their
float16 scale, byte for byte as ggml's block_q8_0 ({d, int8 qs[32]}) and block_q4_0 ({d, qs[16]}:
value j in the low nibble of byte j, value 16 + j in the high one), quantized as its reference
(ggml-quants.c: quantize_row_q8_0_ref, quantize_row_q4_0_ref; gguf-py's quants give the same
bytes). A head's row is head_dim / 32 blocks; a position keeps its K row then its V row in one run
of bytes, so that the slot buffer's copies (the shuffle, the prefix pool, the windows' slides) move
both as they move 16-bit rows.

The PyTorch forward reads a range of them dequantized to the model's dtype (KVCodes); the native
step reads the codes themselves (attention.c) and writes them (llama_forward.c), the same values.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

BLOCK = 32
BLOCK_BYTES = {"q8_0": 2 + 32, "q4_0": 2 + 16}


def row_bytes(kind: str, head_dim: int) -> int:
    return head_dim // BLOCK * BLOCK_BYTES[kind]


def position_bytes(head_dim: int, dtype: torch.dtype, kinds: tuple[str, str] | None) -> int:
    """One position's K and V of one head: two rows of the dtype, or of codes."""
    if kinds is None:
        return 2 * head_dim * torch.empty((), dtype=dtype).element_size()
    return row_bytes(kinds[0], head_dim) + row_bytes(kinds[1], head_dim)


def _roundf(x: torch.Tensor) -> torch.Tensor:
    """C's roundf (halves away from zero), exactly: gguf-py's np_roundf."""
    a = x.abs()
    floor = torch.floor(a)
    return torch.sign(x) * (floor + torch.floor(2 * (a - floor)))


def quantize(x: torch.Tensor, kind: str) -> torch.Tensor:
    """x [..., head_dim] (any float dtype; rounded as float32) -> uint8 [..., row_bytes]."""
    *lead, d = x.shape
    blocks = x.to(torch.float32).reshape(-1, d // BLOCK, BLOCK)
    if kind == "q8_0":
        scale = blocks.abs().amax(-1, keepdim=True) / 127
        inverse = torch.where(scale == 0, 0.0, 1 / scale)
        codes = _roundf(blocks * inverse).to(torch.int8).view(torch.uint8)
    else:
        largest = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))  # (its sign kept)
        scale = largest / -8
        inverse = torch.where(scale == 0, 0.0, 1 / scale)
        q = torch.trunc(blocks * inverse + 8.5).clamp(max=15).to(torch.uint8)
        codes = q[..., :16] | (q[..., 16:] << 4)
    head = scale.to(torch.float16).view(torch.uint8)  # [n, blocks, 2]
    return torch.cat((head, codes), dim=-1).reshape(*lead, row_bytes(kind, d))


def dequantize(rows: torch.Tensor, kind: str, head_dim: int) -> torch.Tensor:
    """uint8 [..., row_bytes] -> float32 [..., head_dim]: scale times code (q4_0: code - 8)."""
    *lead, _ = rows.shape
    blocks = rows.reshape(-1, head_dim // BLOCK, BLOCK_BYTES[kind])
    scale = blocks[..., :2].contiguous().view(torch.float16).to(torch.float32)  # [n, blocks, 1]
    if kind == "q8_0":
        values = blocks[..., 2:].contiguous().view(torch.int8).to(torch.float32)
    else:
        packed = blocks[..., 2:]
        values = torch.cat((packed & 15, packed >> 4), dim=-1).to(torch.float32) - 8
    return (values * scale).reshape(*lead, head_dim)


class KVCodes:
    """One layer's K (or V) rows as the PyTorch attention reads and writes a cache tensor
    [slots, kv_heads, positions, head_dim] of the model's dtype: indexing gives the values
    (dequantized, rounded to `dtype`), assignment quantizes. `rows`: the layer's bytes [slots,
    kv_heads, positions, K bytes + V bytes]; this one's are [start, start + row_bytes)."""

    def __init__(self, rows: torch.Tensor, start: int, kind: str, head_dim: int, dtype: torch.dtype):
        self.rows, self.start, self.kind, self.head_dim, self.dtype = rows, start, kind, head_dim, dtype
        self.stop = start + row_bytes(kind, head_dim)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.rows.shape[:-1], self.head_dim))

    def _at(self, index) -> tuple:
        index = index if isinstance(index, tuple) else (index,)
        return (*index, *([slice(None)] * (3 - len(index))), slice(self.start, self.stop))

    def __getitem__(self, index) -> torch.Tensor:
        return dequantize(self.rows[self._at(index)], self.kind, self.head_dim).to(self.dtype)

    def __setitem__(self, index, values: torch.Tensor) -> None:
        self.rows[self._at(index)] = quantize(values, self.kind)


class QuantizedKV(NamedTuple):
    """A layer's quantized KV (SlotBuffer.layers[n]): kv[0] / kv[1] as the PyTorch attention
    takes them, and the bytes [1, slots, kv_heads, positions, K bytes + V bytes] the native step
    reads (K's row first)."""

    k: KVCodes
    v: KVCodes
    rows: torch.Tensor


def quantized_kv(rows: torch.Tensor, kinds: tuple[str, str], head_dim: int, dtype: torch.dtype) -> QuantizedKV:
    k_bytes = row_bytes(kinds[0], head_dim)
    return QuantizedKV(
        KVCodes(rows[0], 0, kinds[0], head_dim, dtype), KVCodes(rows[0], k_bytes, kinds[1], head_dim, dtype), rows
    )
