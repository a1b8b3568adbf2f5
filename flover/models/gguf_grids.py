"""GGUF's quantized blocks as grids: w = scale * q + low per group of inputs, the codes q and the
scales read out of the blocks as they are (the native step runs them: `--quantization file`).

Each block type's layout follows ggml's (ggml-quants.c; the `gguf` package's dequantize_blocks
does the same unpacking, and tests compare the values both give). The scales are the products
ggml's own dequantization takes (d * sc, dmin * m: exact in float32), so scale * q + low is the
weight dequantize gives, bit for bit.

| type | q | group | scale | low |
|---|---|---|---|---|
| Q4_0 | 0..15 | 32 | d | -8 d |
| Q4_1 | 0..15 | 32 | d | m |
| Q4_K | 0..15 | 32 | d sc | -dmin m |
| Q5_0 | -16..15 | 32 | d | 0 |
| Q5_1 | 0..31 | 32 | d | m |
| Q5_K | 0..31 | 32 | d sc | -dmin m |
| Q6_K | -32..31 | 16 | d sc | 0 |
| Q2_K | 0..3 | 16 | d sc | -dmin m |
| Q3_K | -4..3 | 16 | d sc | 0 |
| IQ4_NL | the 16 values of IQ4_VALUES (-127..113) | 32 | d | 0 |
| IQ4_XS | the same | 32 | d sc | 0 |
| Q8_0 | -128..127 | 32 | d | 0 |
| MXFP4 | -12..12 (twice FP4's values, as bytes) | 32 | 2^(e - 128) | 0 |

4-bit codes run the int4 kernels; the others are bytes (int8 kernels with group scales), which
the native step may pack again (Q5_K's in 5 bits, Q6_K's in 6, Q2_K's in 2, Q3_K's in 3, the IQ4
types' values as their 4-bit indexes into IQ4_VALUES: native/grids.py). Q3_K's sc and IQ4_XS's
are the file's 6-bit scales less 32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class BlockGrid:
    codes: np.ndarray  # [rows, cols]: uint8 0..15 (bits 4) or int8
    scale: np.ndarray  # float32 [rows, cols / group]
    low: np.ndarray | None  # float32 [rows, cols / group]; None: every low is 0
    group: int
    bits: int  # 4 or 8
    code_range: tuple[int, int]  # the type's smallest and largest q
    # The factors of the K-quants' scales (the kernels read these, a quarter of the stored
    # scales' bytes or less), [rows, cols / 256] or [rows, cols / group]: Q4_K's and Q5_K's d, -dmin
    # (float32) and sc, m (uint8): scale = d sc, low = -dmin m; Q6_K's d (float32) and sc (int8): scale = d sc
    # (Q2_K's: as Q4_K's, a sc and m per 16 inputs; Q3_K's: as Q6_K's; IQ4_XS's: d, sc int8 per 32)
    supers: tuple[np.ndarray, ...] | None = None

    def values(self) -> np.ndarray:
        """The weights, float32 [rows, cols]."""
        rows, cols = self.codes.shape
        q = self.codes.astype(np.float32).reshape(rows, cols // self.group, self.group)
        w = self.scale[..., None] * q
        if self.low is not None:
            w = w + self.low[..., None]
        return w.reshape(rows, cols)

    def values_tensor(self):
        """values() as a torch tensor, in PyTorch's threads (the same two roundings: a product, a sum)."""
        import torch

        rows, cols = self.codes.shape
        q = torch.from_numpy(self.codes).to(torch.float32).view(rows, cols // self.group, self.group)
        w = torch.from_numpy(self.scale)[..., None] * q
        if self.low is not None:
            w = w + torch.from_numpy(self.low)[..., None]
        return w.view(rows, cols)


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    return blocks[:, at : at + 2].copy().view(np.float16).astype(np.float32)  # [blocks, 1]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[blocks, 16] bytes -> [blocks, 32]: the low nibbles are the first 16 values, the high the next."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """[blocks, 4] bytes -> [blocks, 32]: bit i is value i's fifth bit."""
    return np.unpackbits(qh, axis=1, bitorder="little")


def _crumbs(qs: np.ndarray) -> np.ndarray:
    """[blocks, 64] bytes -> [blocks, 256] 2-bit codes: value 128 h + 32 j + i is bits 2j of byte
    32 h + i (Q2_K's codes, Q3_K's low bits)."""
    n = qs.shape[0]
    return ((qs.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3).reshape(n, 256)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes -> 8 sub-block scales and 8 minimums of 6 bits each."""
    d, m, m_d = (scales[:, 4 * i : 4 * i + 4] for i in range(3))
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _q4_0(b):
    d = _f16(b, 0)
    return _nibbles(b[:, 2:]), d, np.float32(-8) * d


def _q4_1(b):
    return _nibbles(b[:, 4:]), _f16(b, 0), _f16(b, 2)


def _q5_0(b):
    q = _nibbles(b[:, 6:]) | (_high_bits(b[:, 2:6]) << 4)
    return q.astype(np.int8) - np.int8(16), _f16(b, 0), None


def _q5_1(b):
    q = _nibbles(b[:, 8:]) | (_high_bits(b[:, 4:8]) << 4)
    return q.astype(np.int8), _f16(b, 0), _f16(b, 2)


def _q8_0(b):
    return b[:, 2:].view(np.int8), _f16(b, 0), None


def _q4_k(b):
    n = b.shape[0]
    sc, mn = _k_scales(b[:, 4:16])
    qs = b[:, 16:].reshape(n, 4, 32)  # 64 values per 32 bytes: the low nibbles, then the high ones
    q = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(n, 256)
    return q, _f16(b, 0) * sc, -(_f16(b, 2) * mn), (_f16(b, 0), -_f16(b, 2), sc.astype(np.uint8), mn.astype(np.uint8))


def _q5_k(b):
    n = b.shape[0]
    sc, mn = _k_scales(b[:, 4:16])
    qh = b[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)  # bit i: sub-block i
    qs = b[:, 48:].reshape(n, 4, 32)
    ql = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(n, 8, 32)
    q = (ql | ((qh & 1) << 4)).reshape(n, 256)
    return (
        q.astype(np.int8),
        _f16(b, 0) * sc,
        -(_f16(b, 2) * mn),
        (_f16(b, 0), -_f16(b, 2), sc.astype(np.uint8), mn.astype(np.uint8)),
    )


def _q6_k(b):
    n = b.shape[0]
    ql = b[:, :128].reshape(n, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    qh = b[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    q = ((ql & 0x0F).reshape(n, 8, 32) | ((qh & 0x03).reshape(n, 8, 32) << 4)).astype(np.int8) - np.int8(32)
    sc = b[:, 192:208].view(np.int8)
    return q.reshape(n, 256), _f16(b, 208) * sc.astype(np.float32), None, (_f16(b, 208), sc)


def _q2_k(b):
    """Q2_K: 16 bytes of 4-bit sc (low nibble) and m (high), 64 of 2-bit codes, d, dmin. Value
    128 h + 32 j + i holds bits 2j of byte 32 h + i (ggml's dequantize_row_q2_K)."""
    sc, m = b[:, :16] & 0x0F, b[:, :16] >> 4
    d, dmin = _f16(b, 80), _f16(b, 82)
    scale, low = d * sc.astype(np.float32), -(dmin * m.astype(np.float32))
    return _crumbs(b[:, 16:80]).astype(np.int8), scale, low, (d, -dmin, sc, m)


def _q3_k(b):
    """Q3_K: 32 bytes of high bits, 64 of low 2-bit codes, 12 of 6-bit scales, d. Value 128 h +
    32 j + i: low bits 2j of byte 32 h + i, high bit 4 h + j of byte i; q = low - 4 where that bit
    is clear (ggml's dequantize_row_q3_K)."""
    n = b.shape[0]
    high = (b[:, :32].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1  # [n, 4 h + j, i]
    q = _crumbs(b[:, 32:96]).astype(np.int8) + (high.reshape(n, 256).astype(np.int8) << 2) - np.int8(4)
    packed = b[:, 96:108]
    lows = (packed[:, :8].reshape(n, 1, 8) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)).reshape(n, 16)
    highs = (packed[:, 8:].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)).reshape(n, 16)
    sc = ((lows & 0x0F) | ((highs & 0x03) << 4)).astype(np.int8) - np.int8(32)
    d = _f16(b, 108)
    return q, d * sc.astype(np.float32), None, (d, sc)


IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)


def _iq4_nl(b):
    """IQ4_NL: d, then 16 bytes of indexes into IQ4_VALUES (value i low nibble of byte i, 16 + i its high)."""
    return IQ4_VALUES[_nibbles(b[:, 2:])], _f16(b, 0), None


def _iq4_xs(b):
    """IQ4_XS: d, 2 bytes of the 6-bit scales' high bits, 4 of their low nibbles, then 8 sub-blocks
    of 32 values as IQ4_NL's (ggml's dequantize_row_iq4_xs)."""
    n = b.shape[0]
    high = (b[:, 2:4].copy().view(np.uint16) >> (2 * np.arange(8, dtype=np.uint16))) & 3  # [n, 8]
    low = (b[:, 4:8].reshape(n, 4, 1) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2)).reshape(n, 8) & 0x0F
    sc = (low | (high.astype(np.uint8) << 4)).astype(np.int8) - np.int8(32)
    qs = b[:, 8:].reshape(n * 8, 16)
    d = _f16(b, 0)
    return IQ4_VALUES[_nibbles(qs)].reshape(n, 256), d * sc.astype(np.float32), None, (d, sc)


MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int8)  # twice e2m1's


def _mxfp4(b):
    """gpt-oss's experts: a power-of-two scale (E8M0, halved as ggml's: the values above are twice
    FP4's) and 32 4-bit codes of FP4 values; read as bytes (the values), not as a linear 4-bit grid."""
    e = b[:, :1].astype(np.int32)
    scale = np.ldexp(np.float32(1), e - 128).astype(np.float32)  # [blocks, 1], exact
    scale[e == 255] = np.nan  # the OCP MX spec's E8M0 NaN (ggml reads it as 2^127): refused at load as not finite
    return MXFP4_VALUES[_nibbles(b[:, 1:])], scale, None


# type -> (bytes per block, values per block, inputs per scale, code bits, unpack)
BLOCK_TYPES = {
    "Q4_0": (18, 32, 32, 4, _q4_0),
    "Q4_1": (20, 32, 32, 4, _q4_1),
    "Q4_K": (144, 256, 32, 4, _q4_k),
    "Q5_0": (22, 32, 32, 8, _q5_0),
    "Q5_1": (24, 32, 32, 8, _q5_1),
    "Q5_K": (176, 256, 32, 8, _q5_k),
    "Q6_K": (210, 256, 16, 8, _q6_k),
    "Q8_0": (34, 32, 32, 8, _q8_0),
    "MXFP4": (17, 32, 32, 8, _mxfp4),
    "Q2_K": (84, 256, 16, 8, _q2_k),
    "Q3_K": (110, 256, 16, 8, _q3_k),
    "IQ4_NL": (18, 32, 32, 8, _iq4_nl),
    "IQ4_XS": (136, 256, 32, 8, _iq4_xs),
}
# type -> the smallest and the largest code q (the table above)
CODE_RANGES = {
    "Q4_0": (0, 15),
    "Q4_1": (0, 15),
    "Q4_K": (0, 15),
    "Q5_0": (-16, 15),
    "Q5_1": (0, 31),
    "Q5_K": (0, 31),
    "Q6_K": (-32, 31),
    "Q8_0": (-128, 127),
    "MXFP4": (-12, 12),
    "Q2_K": (0, 3),
    "Q3_K": (-4, 3),
    "IQ4_NL": (-127, 113),
    "IQ4_XS": (-127, 113),
}


def block_grid(type_name: str, data: np.ndarray, shape: tuple[int, int]) -> BlockGrid | None:
    """A 2-D tensor's raw bytes (uint8) -> its grid; None for types not in BLOCK_TYPES."""
    if type_name not in BLOCK_TYPES or len(shape) != 2:
        return None
    size, per_block, group, bits, unpack = BLOCK_TYPES[type_name]
    rows, cols = shape
    blocks = data.reshape(-1, size)
    codes, scale, low, *supers = unpack(blocks)
    groups = per_block // group
    scale = np.broadcast_to(scale, (blocks.shape[0], groups)).reshape(rows, cols // group)
    low = None if low is None else np.broadcast_to(low, (blocks.shape[0], groups)).reshape(rows, cols // group)
    own = lambda a, dtype=None: np.array(a, dtype=dtype, copy=True, order="C")  # noqa: E731 (not views of the file)
    if supers:  # per block: [blocks, 1] (d, -dmin) or [blocks, groups] (sc, m)
        supers = tuple(own(a.reshape(rows, -1)) for a in supers[0])
    return BlockGrid(
        own(codes.reshape(rows, cols)),
        own(scale, np.float32),
        None if low is None else own(low, np.float32),
        group,
        bits,
        CODE_RANGES[type_name],
        supers or None,
    )
