"""K and V rows in llama.cpp's blocks (--kv-dtype q8_0 / q4_0): 32 values a block behind their
float16 scale, byte for byte as ggml's block_q8_0 ({d, int8 qs[32]}) and block_q4_0 ({d, qs[16]}:
value j in the low nibble of byte j, value 16 + j in the high one), quantized as its reference
(ggml-quants.c: quantize_row_q8_0_ref, quantize_row_q4_0_ref; gguf-py's quants give the same
bytes). A head's row is head_dim / 32 blocks; a position keeps its K row then its V row in one run
of bytes, so that the slot buffer's copies (the shuffle, the prefix pool, the windows' slides) move
both as they move 16-bit rows.

Attention reads them as llama.cpp's q8_0 dot products do, the same in the PyTorch forward (below)
and the native step (attention.c, which writes them in llama_forward.c): each query head is
quantized to int8 blocks of 32 too (quantize_queries), a key's score is the sum over blocks of the
integer dot product times both scales (code_scores), and the weighted sum of values takes each
block's scale into the weights (code_values): codes are never widened to a copy of the cache.
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
    if kind == "q8_0":  # (the queries' rule: kv_codes.h q8_codes)
        codes, scale = quantize_queries(x.reshape(-1, d))
        codes, scale = codes.to(torch.int8).view(torch.uint8), scale[..., None]
    else:
        blocks = x.to(torch.float32).reshape(-1, d // BLOCK, BLOCK)
        largest = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))  # (its sign kept)
        scale = largest / -8
        inverse = torch.where(scale == 0, 0.0, 1 / scale)
        q = torch.trunc(blocks * inverse + 8.5).clamp(max=15).to(torch.uint8)
        codes = q[..., :16] | (q[..., 16:] << 4)
    head = scale.to(torch.float16).view(torch.uint8)  # [n, blocks, 2]
    return torch.cat((head, codes), dim=-1).reshape(*lead, row_bytes(kind, d))


def _blocks(rows: torch.Tensor, kind: str, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 [..., row_bytes] -> (codes as float32 values [..., blocks, 32] (q4_0: code - 8), their
    scales float32 [..., blocks])."""
    *lead, _ = rows.shape
    blocks = rows.reshape(*lead, head_dim // BLOCK, BLOCK_BYTES[kind])
    scale = blocks[..., :2].contiguous().view(torch.float16).to(torch.float32)[..., 0]
    if kind == "q8_0":
        return blocks[..., 2:].contiguous().view(torch.int8).to(torch.float32), scale
    packed = blocks[..., 2:]
    return torch.cat((packed & 15, packed >> 4), dim=-1).to(torch.float32) - 8, scale


def dequantize(rows: torch.Tensor, kind: str, head_dim: int) -> torch.Tensor:
    """uint8 [..., row_bytes] -> float32 [..., head_dim]: scale times code (q4_0: code - 8)."""
    codes, scale = _blocks(rows, kind, head_dim)
    return (codes * scale[..., None]).reshape(*rows.shape[:-1], head_dim)


def quantize_queries(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [..., head_dim] (the model dtype's values) -> (int8 codes as float32 [..., blocks, 32],
    scales float32 [..., blocks]): q8_0's rule with the scale kept in float32 (kv_codes.h's
    kv_quantize_query)."""
    *lead, d = q.shape
    blocks = q.to(torch.float32).reshape(*lead, d // BLOCK, BLOCK)
    scale = blocks.abs().amax(-1) / 127
    inverse = torch.where(scale == 0, 0.0, 1 / scale)
    return _roundf(blocks * inverse[..., None]), scale


def code_scores(q: torch.Tensor, keys: CodeRows) -> torch.Tensor:
    """q [..., queries, d] x keys (rows [..., keys, bytes]; leading dims broadcast) -> float32
    [..., queries, keys], unscaled: per block, in order, the integer dot product of the codes (exact
    in float32) times (key's scale x query's scale), summed."""
    qc, qs = quantize_queries(q)
    kc, ks = _blocks(keys.rows, keys.kind, keys.head_dim)
    scores = None
    for b in range(qc.shape[-2]):
        sums = torch.matmul(qc[..., b, :], kc[..., b, :].transpose(-1, -2))
        term = sums * (ks[..., None, :, b] * qs[..., :, b, None])
        scores = term if scores is None else scores + term
    return scores


def code_values(weights: torch.Tensor, values: CodeRows) -> torch.Tensor:
    """weights [..., queries, keys] x values (rows [..., keys, bytes]) -> float32 [..., queries, d]:
    each block's codes weighed by weight x the key's block scale."""
    vc, vs = _blocks(values.rows, values.kind, values.head_dim)
    weights = weights.to(torch.float32)
    parts = [torch.matmul(weights * vs[..., None, :, b], vc[..., b, :]) for b in range(vc.shape[-2])]
    return torch.cat(parts, dim=-1)


class CodeRows(NamedTuple):
    """A range of K (or V) rows of codes as attention reads them: rows uint8 [..., positions,
    row_bytes]. Keys meet queries in code_scores, values weights in code_values."""

    rows: torch.Tensor
    kind: str
    head_dim: int

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.rows.shape[:-1], self.head_dim))

    def __getitem__(self, index) -> CodeRows:  # (index: of the leading dims only)
        return CodeRows(self.rows[index], self.kind, self.head_dim)

    def unsqueeze(self, dim: int) -> CodeRows:  # (dim: of the leading dims, from the front)
        return CodeRows(self.rows.unsqueeze(dim), self.kind, self.head_dim)


class KVCodes:
    """One layer's K (or V) rows where the PyTorch attention takes a cache tensor [slots, kv_heads,
    positions, head_dim]: indexing gives the range's CodeRows, assignment quantizes. `rows`: the
    layer's bytes [slots, kv_heads, positions, K bytes + V bytes]; this one's are [start, start +
    row_bytes)."""

    def __init__(self, rows: torch.Tensor, start: int, kind: str, head_dim: int):
        self.rows, self.start, self.kind, self.head_dim = rows, start, kind, head_dim
        self.stop = start + row_bytes(kind, head_dim)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.rows.shape[:-1], self.head_dim))

    def _at(self, index) -> tuple:
        index = index if isinstance(index, tuple) else (index,)
        return (*index, *([slice(None)] * (3 - len(index))), slice(self.start, self.stop))

    def __getitem__(self, index) -> CodeRows:
        return CodeRows(self.rows[self._at(index)], self.kind, self.head_dim)

    def __setitem__(self, index, values: torch.Tensor) -> None:
        self.rows[self._at(index)] = quantize(values, self.kind)


class QuantizedKV(NamedTuple):
    """A layer's quantized KV (SlotBuffer.layers[n]): kv[0] / kv[1] as the PyTorch attention
    takes them, and the bytes [1, slots, kv_heads, positions, K bytes + V bytes] the native step
    reads (K's row first)."""

    k: KVCodes
    v: KVCodes
    rows: torch.Tensor


def quantized_kv(rows: torch.Tensor, kinds: tuple[str, str], head_dim: int) -> QuantizedKV:
    k_bytes = row_bytes(kinds[0], head_dim)
    return QuantizedKV(KVCodes(rows[0], 0, kinds[0], head_dim), KVCodes(rows[0], k_bytes, kinds[1], head_dim), rows)
