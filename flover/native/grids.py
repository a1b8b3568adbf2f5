"""Quantized projections in the native step's layouts (native.h: Grid, GridPart; tiles.c: the
tiles that read them). A projection's output rows are one run or a few, each in its own codes:
int4 (4-bit codes, a scale and a zero per 32 inputs), Q2_K's 2-bit, Q3_K's 3-bit, Q5_K's 5-bit
and Q6_K's 6-bit codes with their super-blocks' scales (Q5_K's and Q6_K's packed, or as bytes
where unpacking costs more than it saves), the IQ4 types' 4-bit indexes into their table, int8
with a scale per row, or int8 with a scale (and a minimum) per group of 16 or 32 inputs (a GGUF
file's Q5_0 / Q5_1 / Q8_0 blocks)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from flover.models.gguf_grids import CODE_RANGES, IQ4_VALUES, MXFP4_VALUES
from flover.models.quant import Grid, QuantizedWeight
from flover.native import abi
from flover.native.abi import (
    G_INT4,
    G_INT4_K,
    G_INT5_K,
    G_INT6_K,
    G_INT8_GROUPS,
    G_INT8_K5,
    G_INT8_K6,
    G_INT8_ROWS,
    G_IQ4_NL,
    G_IQ4_XS,
    G_MXFP4,
    G_Q2_K,
    G_Q3_K,
    IQ4XS_SUPER_BYTES,
    MAX_PARTS,
    Q2K_SUPER_BYTES,
    Q4K_SUPER_BYTES,
    Q6K_SUPER_BYTES,
    X8_NONE,
    X8_SIGNED,
    X8_SMALL,
)

# the kinds whose int8 tiles take inputs in blocks of 256 (tiles_int8.c's x8_block; quant.int8_block)
SUPER_BLOCK_TILES = (G_INT4_K, G_INT5_K, G_INT8_K5, G_INT6_K, G_INT8_K6)


@dataclass
class Run:
    """One run of output rows: its kind, the arena tensors it takes and how to fill them."""

    kind: int
    rows: int
    group: int
    lows: int
    shapes: list[tuple[tuple[int, ...], torch.dtype]]  # codes, scales
    fill: Callable[[torch.Tensor, torch.Tensor], None]
    x8: int = X8_NONE  # takes int8 inputs (tiles_int8.c's layouts): codes below 64, or signed bytes
    offset: int = 0  # x8 bytes: the stored code that means 0

    def fill_once(self, codes: torch.Tensor, scales: torch.Tensor) -> None:
        """Fill the arena's tensors, then let go of `fill`: it holds the source grids (a GGUF
        file's codes as bytes, 1 GB for a 1B model), which the arena's copy replaces."""
        fill, self.fill = self.fill, _filled
        fill(codes, scales)


def _filled(codes: torch.Tensor, scales: torch.Tensor) -> None:
    raise RuntimeError("this run's arena tensors were filled already")


def rows_last(per_row: torch.Tensor, blocks: int, fill: int = 0) -> torch.Tensor:
    """[n, *rest] -> [blocks, *rest, 16]: rows padded with `fill` to whole blocks of 16, a block's
    16 rows innermost (one load holds a value of each)."""
    padded = torch.full((blocks * 16, *per_row.shape[1:]), fill, dtype=per_row.dtype)
    padded[: per_row.shape[0]] = per_row
    return padded.view(blocks, 16, *per_row.shape[1:]).movedim(1, -1)


def block_pairs(codes: torch.Tensor, out: torch.Tensor) -> None:
    """int8 codes [n, k] -> out [n / 16, k / 2, 16, 2] (bfloat16's blocked pairs, a byte each;
    zero rows pad the last block)."""
    n, k = codes.shape
    padded = torch.zeros(out.shape[0] * 16, k, dtype=torch.int8)
    padded[:n] = codes
    out.copy_(padded.view(-1, 16, k // 2, 2).permute(0, 2, 1, 3))


def block_nibbles(codes: torch.Tensor, codes_out: torch.Tensor) -> None:
    """4-bit codes uint8 [n, k] in 0..15 -> codes_out [n / 16, k / 32, 16 input pairs, 16 rows]
    (low nibble the even input; padded rows q = 8, weight 0 whatever the zero)."""
    n, k = codes.shape
    pairs = codes.view(n, k // 32, 16, 2)
    codes_out.copy_(rows_last(pairs[..., 0] | (pairs[..., 1] << 4), codes_out.shape[0], fill=0x88))


def lanes_of_four(per_row: torch.Tensor, blocks: int, fill: int) -> torch.Tensor:
    """[n, *rest, 4] bytes -> [blocks, *rest, 16, 4]: tiles_int8.c's 64-byte loads, a block's 16
    rows as lanes of 4 bytes (rows padded with `fill`)."""
    return rows_last(per_row, blocks, fill).movedim(-1, -2)


def block_nibble_quads(codes: torch.Tensor, codes_out: torch.Tensor) -> None:
    """4-bit codes uint8 [n, k] -> codes_out [n / 16, k / 32, 4, 16, 4] (tiles_int8.c): the c-th
    64 bytes of a group hold inputs 4c..4c+3 in the low nibbles, 16 + 4c.. in the high ones."""
    n, k = codes.shape
    halves = codes.view(n, k // 32, 2, 4, 4)  # [n, group, half, c, j]
    quads = lanes_of_four(halves[:, :, 0] | (halves[:, :, 1] << 4), codes_out.shape[0], fill=0x88)
    codes_out.view(quads.shape).copy_(quads)


def crumb_planes(u: torch.Tensor, blocks: int) -> torch.Tensor:
    """Codes u [n, k] -> their low 2 bits as [blocks, k / 32, 2, 64] (tiles_int8.c's 2-bit layout,
    and Q6_K's planes of high bits: in the h-th 64 bytes of a group, lane r's byte j holds input
    16h + 4c + j at bits 2c)."""
    n, k = u.shape
    low = (u & 3).view(n, k // 32, 2, 4, 4)  # [n, group, half, c, j]
    packed = low[:, :, :, 0] | (low[:, :, :, 1] << 2) | (low[:, :, :, 2] << 4) | (low[:, :, :, 3] << 6)
    return lanes_of_four(packed, blocks, fill=0).reshape(blocks, k // 32, 2, 64)


def bit_plane(u: torch.Tensor, blocks: int) -> torch.Tensor:
    """Codes u [n, k] -> their lowest bit as [blocks, k / 32, 64] (Q5_K's fifth bits, Q3_K's third:
    lane r's byte j holds that of input 16h + 4c + j at bit 4h + c)."""
    n, k = u.shape
    bit = (u & 1).view(n, k // 32, 2, 4, 4)  # [n, group, half, c, j]
    packed = sum(bit[:, :, half, c] << (4 * half + c) for half in range(2) for c in range(4))  # [n, group, j]
    return lanes_of_four(packed, blocks, fill=0).reshape(blocks, k // 32, 64)


def _int4_run(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, x8: bool) -> Run:
    """w = scale * (q - 8) + zero, scale / zero float32 [n, k / 32]: scales [n / 16, k / 32, 2, 16]."""
    n, k = codes.shape
    blocks = -(-n // 16)

    def fill(codes_out: torch.Tensor, scales_out: torch.Tensor) -> None:
        (block_nibble_quads if x8 else block_nibbles)(codes, codes_out)
        scales_out.copy_(rows_last(torch.stack((scale, zero), dim=-1), blocks))

    return Run(
        G_INT4,
        n,
        32,
        1,
        [((blocks, k // 32, 16, 16), torch.uint8), ((blocks, k // 32, 2, 16), torch.float32)],
        fill,
        X8_SMALL if x8 else X8_NONE,
        8,
    )


def _mxfp4_code_of() -> torch.Tensor:
    """MXFP4's values + 12 (0..24) -> the 4-bit code that gives them (native.h's MXFP4_U maps code
    c to MXFP4_VALUES[c] + 12; 0 has two codes: 0 is taken)."""
    table = torch.zeros(25, dtype=torch.uint8)
    for code, value in reversed(list(enumerate(MXFP4_VALUES.tolist()))):
        table[value + 12] = code
    return table


MXFP4_CODE_OF = _mxfp4_code_of()


def _mxfp4_run(grid: Grid) -> Run:
    """MXFP4 (int8 inputs only): its 4-bit codes in G_INT4's layout, scales [n / 16, k / 32, 2, 16]
    (scale, and the zero form -4 scale: the kernel's low is zero - 8 scale = -12 scale)."""
    n, k = grid.codes.shape
    blocks = -(-n // 16)

    def fill(codes_out: torch.Tensor, scales_out: torch.Tensor) -> None:
        codes = MXFP4_CODE_OF[grid.codes.to(torch.int64) + 12]  # [n, k] 4-bit codes
        block_nibble_quads(codes, codes_out)
        scales_out.copy_(rows_last(torch.stack((grid.scale, -4 * grid.scale), dim=-1), blocks))

    return Run(
        G_MXFP4,
        n,
        32,
        1,
        [((blocks, k // 32, 16, 16), torch.uint8), ((blocks, k // 32, 2, 16), torch.float32)],
        fill,
        X8_SMALL,
        12,
    )


def k_super_scales(grid: Grid, scales_out: torch.Tensor) -> None:
    """Q4_K's / Q5_K's scale factors -> scales_out uint8 [n / 16, k / 256, 384]: per block of 16
    rows and super-block, d[16] and -dmin[16] in float32, then sc[8][16] and m[8][16] bytes."""
    (n, k), blocks = grid.codes.shape, scales_out.shape[0]
    supers = k // 256
    d, neg_dmin, sc, m = grid.supers
    factors = rows_last(torch.stack((d, neg_dmin), dim=-1), blocks)  # [blocks, supers, 2, 16]
    bytes_ = rows_last(torch.stack((sc.view(n, supers, 8), m.view(n, supers, 8)), dim=2), blocks)
    scales_out.copy_(
        torch.cat(
            (
                factors.contiguous().view(torch.uint8).view(blocks, supers, 128),
                bytes_.contiguous().view(blocks, supers, 256),
            ),
            dim=-1,
        )
    )


def _int4_k_run(grid: Grid, x8: bool) -> Run:
    """Q4_K: 4-bit codes, scales as k_super_scales."""
    n, k = grid.codes.shape
    blocks, supers = -(-n // 16), k // 256

    def fill(codes_out: torch.Tensor, scales_out: torch.Tensor) -> None:
        (block_nibble_quads if x8 else block_nibbles)(grid.codes, codes_out)
        k_super_scales(grid, scales_out)

    return Run(
        G_INT4_K,
        n,
        32,
        1,
        [((blocks, k // 32, 16, 16), torch.uint8), ((blocks, supers, Q4K_SUPER_BYTES), torch.uint8)],
        fill,
        X8_SMALL if x8 else X8_NONE,
        8,
    )


def _int5_k_run(grid: Grid) -> Run:
    """Q5_K on int8 inputs: codes u (0..31) [n / 16, k / 32, 5, 64] (the low 4 bits as
    block_nibble_quads, then one byte per lane and input j holding the fifth bits of inputs
    4c + j at bit c and of 16 + 4c + j at bit 4 + c: tiles_int8.c), scales as k_super_scales.
    5.75 bits a weight (the file: 5.5)."""
    n, k = grid.codes.shape
    blocks, supers = -(-n // 16), k // 256

    def fill(codes_out: torch.Tensor, scales_out: torch.Tensor) -> None:
        u = grid.codes.to(torch.uint8)  # [n, k]: 0..31
        out = codes_out.view(blocks, k // 32, 5, 64)
        nibbles = torch.empty(blocks, k // 32, 4, 16, 4, dtype=torch.uint8)
        block_nibble_quads(u & 15, nibbles)
        out[:, :, :4].copy_(nibbles.view(blocks, k // 32, 4, 64))
        out[:, :, 4].copy_(bit_plane(u >> 4, blocks))
        k_super_scales(grid, scales_out)

    return Run(
        G_INT5_K,
        n,
        32,
        1,
        [((blocks, k // 32, 5, 64), torch.uint8), ((blocks, supers, Q4K_SUPER_BYTES), torch.uint8)],
        fill,
        X8_SMALL,
        0,
    )


def q6k_super_scales(grid: Grid, scales_out: torch.Tensor) -> None:
    """Q6_K's scale factors -> scales_out uint8 [n / 16, k / 256, 320]: per block of 16 rows and
    super-block d[16] float32, then sc[16][16] int8."""
    (n, k), blocks = grid.codes.shape, scales_out.shape[0]
    supers = k // 256
    d, sc = grid.supers
    factors = rows_last(d, blocks).contiguous().view(torch.uint8).view(blocks, supers, 64)
    bytes_ = rows_last(sc.view(n, supers, 16), blocks).contiguous().view(torch.uint8).view(blocks, supers, 256)
    scales_out.copy_(torch.cat((factors, bytes_), dim=-1))


def _int6_k_run(grid: Grid) -> Run:
    """Q6_K on int8 inputs: u = q + 32 as codes [n / 16, k / 32, 6, 64] (the low 4 bits as
    block_nibble_quads, then the high 2 bits of inputs 4c + j and of 16 + 4c + j at bits 2c of
    lane r's byte j: tiles_int8.c), scales as q6k_super_scales. 6.6 bits a weight (the file: 6.56)."""
    n, k = grid.codes.shape
    blocks, supers = -(-n // 16), k // 256

    def fill(codes_out: torch.Tensor, scales_out: torch.Tensor) -> None:
        u = (grid.codes.to(torch.int16) + 32).to(torch.uint8)  # [n, k]: 0..63
        out = codes_out.view(blocks, k // 32, 6, 64)
        nibbles = torch.empty(blocks, k // 32, 4, 16, 4, dtype=torch.uint8)
        block_nibble_quads(u & 15, nibbles)
        out[:, :, :4].copy_(nibbles.view(blocks, k // 32, 4, 64))
        out[:, :, 4:].copy_(crumb_planes(u >> 4, blocks))
        q6k_super_scales(grid, scales_out)

    return Run(
        G_INT6_K,
        n,
        16,
        0,
        [((blocks, k // 32, 6, 64), torch.uint8), ((blocks, supers, Q6K_SUPER_BYTES), torch.uint8)],
        fill,
        X8_SMALL,
        32,
    )


def q2k_super_scales(grid: Grid, scales_out: torch.Tensor) -> None:
    """Q2_K's scale factors -> scales_out uint8 [n / 16, k / 256, 384]: per block of 16 rows and
    super-block, d[16] and -dmin[16] in float32, then sc | m << 4 [16][16] bytes."""
    (n, k), blocks = grid.codes.shape, scales_out.shape[0]
    supers = k // 256
    d, neg_dmin, sc, m = grid.supers
    factors = rows_last(torch.stack((d, neg_dmin), dim=-1), blocks)  # [blocks, supers, 2, 16]
    both = rows_last((sc | (m << 4)).view(n, supers, 16), blocks)  # [blocks, supers, 16, 16]
    scales_out.copy_(
        torch.cat(
            (
                factors.contiguous().view(torch.uint8).view(blocks, supers, 128),
                both.contiguous().view(blocks, supers, 256),
            ),
            dim=-1,
        )
    )


def _crumbs_run(grid: Grid) -> Run:
    """Q2_K (u = q, 0..3: 2 bits, scales as q2k_super_scales) or Q3_K (u = q + 4, 0..7: the 2-bit
    layout of the low 2 bits, then a plane of third bits: lane r's byte j holds that of input
    16h + 4c + j at bit 4h + c; scales as q6k_super_scales): 2.75 and 3.6 bits a weight (the
    file: 2.63, 3.44)."""
    n, k = grid.codes.shape
    blocks, supers = -(-n // 16), k // 256
    q3 = grid.code_range == CODE_RANGES["Q3_K"]
    planes = 3 if q3 else 2

    def fill(codes_out: torch.Tensor, scales_out: torch.Tensor) -> None:
        u = (grid.codes.to(torch.int16) + (4 if q3 else 0)).to(torch.uint8)  # [n, k]
        out = codes_out.view(blocks, k // 32, planes, 64)
        out[:, :, :2].copy_(crumb_planes(u, blocks))
        if q3:
            out[:, :, 2].copy_(bit_plane(u >> 2, blocks))
        (q6k_super_scales if q3 else q2k_super_scales)(grid, scales_out)

    return Run(
        G_Q3_K if q3 else G_Q2_K,
        n,
        16,
        0 if q3 else 1,
        [
            ((blocks, k // 32, planes, 64), torch.uint8),
            ((blocks, supers, Q6K_SUPER_BYTES if q3 else Q2K_SUPER_BYTES), torch.uint8),
        ],
        fill,
        X8_SMALL,
        4 if q3 else 0,
    )


def _iq4_index_of() -> torch.Tensor:
    """IQ4's values + 128 -> their 4-bit index into IQ4_VALUES."""
    table = torch.zeros(256, dtype=torch.uint8)
    for index, value in enumerate(IQ4_VALUES.tolist()):
        table[value + 128] = index
    return table


IQ4_INDEX_OF = _iq4_index_of()


def _iq4_run(grid: Grid) -> Run:
    """IQ4_NL / IQ4_XS: the values' indexes into IQ4_VALUES in the 4-bit layout (block_nibble_quads),
    scales stored [n / 16, k / 32, 1, 16] (IQ4_NL) or from IQ4_XS's super-blocks: d[16] float32,
    then sc[8][16] int8 per 256 inputs (4.4 bits a weight; the file: 4.25)."""
    n, k = grid.codes.shape
    blocks = -(-n // 16)
    xs = grid.supers is not None

    def fill(codes_out: torch.Tensor, scales_out: torch.Tensor) -> None:
        block_nibble_quads(IQ4_INDEX_OF[grid.codes.to(torch.int64) + 128], codes_out)
        if not xs:
            scales_out.copy_(rows_last(grid.scale[..., None], blocks))
            return
        d, sc = grid.supers
        supers = k // 256
        factors = rows_last(d, blocks).contiguous().view(torch.uint8).view(blocks, supers, 64)
        bytes_ = rows_last(sc.view(n, supers, 8), blocks).contiguous().view(torch.uint8).view(blocks, supers, 128)
        scales_out.copy_(torch.cat((factors, bytes_), dim=-1))

    scales = ((blocks, k // 256, IQ4XS_SUPER_BYTES), torch.uint8) if xs else ((blocks, k // 32, 1, 16), torch.float32)
    return Run(
        G_IQ4_XS if xs else G_IQ4_NL,
        n,
        32,
        0,
        [((blocks, k // 32, 16, 16), torch.uint8), scales],
        fill,
        X8_SIGNED,
        0,
    )


def int8_rows_run(quantized: QuantizedWeight) -> Run:
    """--quantization int8: codes as block_pairs, a float32 scale per row (padded to the blocks)."""
    n, k = quantized.data.shape
    blocks = -(-n // 16)

    def fill(codes_out: torch.Tensor, scales_out: torch.Tensor) -> None:
        block_pairs(quantized.data, codes_out)
        scales_out.copy_(rows_last(quantized.scales.to(torch.float32), blocks).reshape(-1))

    return Run(G_INT8_ROWS, n, k, 0, [((blocks, k // 2, 16, 2), torch.int8), ((blocks * 16,), torch.float32)], fill)


def byte_quads(codes: torch.Tensor, offset: int, codes_out: torch.Tensor) -> None:
    """int8 codes [n, k] -> codes_out [n / 16, k / 4, 16, 4] as q + offset (tiles_int8.c's lanes
    of four bytes; padded rows hold the offset: q = 0)."""
    n, k = codes.shape
    stored = (codes.to(torch.int16) + offset).to(torch.uint8).view(n, k // 4, 4)
    quads = lanes_of_four(stored, codes_out.shape[0], fill=offset).view(torch.int8)
    codes_out.view(quads.shape).copy_(quads)


def _bytes_k_run(grid: Grid) -> Run:
    """Q5_K's or Q6_K's codes as bytes (byte_quads, u = q + 32 for Q6_K's signed ones) with their
    super-blocks' scales (k_super_scales, q6k_super_scales): 8.75 / 8.6 bits a weight where the
    stored float32 scales take 10; for CPUs that read bytes faster than they unpack bits."""
    n, k = grid.codes.shape
    blocks, supers = -(-n // 16), k // 256
    q6 = grid.code_range == (-32, 31)

    def fill(codes_out: torch.Tensor, scales_out: torch.Tensor) -> None:
        byte_quads(grid.codes, 32 if q6 else 0, codes_out)
        (q6k_super_scales if q6 else k_super_scales)(grid, scales_out)

    return Run(
        G_INT8_K6 if q6 else G_INT8_K5,
        n,
        16 if q6 else 32,
        0 if q6 else 1,
        [
            ((blocks, k // 4, 16, 4), torch.int8),
            ((blocks, supers, Q6K_SUPER_BYTES if q6 else Q4K_SUPER_BYTES), torch.uint8),
        ],
        fill,
        X8_SMALL,
        32 if q6 else 0,
    )


def _groups_run(grid: Grid, x8: bool) -> Run:
    """8-bit codes with group scales: codes as block_pairs (x8: lanes of four bytes [n / 16, k / 4,
    16, 4], q + offset where the codes are below 64, else q itself), scales [n / 16, k / group,
    1 or 2, 16] (the scales, then the minimums)."""
    n, k = grid.codes.shape
    blocks, lows = -(-n // 16), int(grid.low is not None)
    mode = X8_NONE if not x8 else X8_SMALL if grid.small_codes() else X8_SIGNED
    offset = max(0, -grid.code_range[0]) if mode == X8_SMALL else 0

    def fill(codes_out: torch.Tensor, scales_out: torch.Tensor) -> None:
        if mode == X8_NONE:
            block_pairs(grid.codes, codes_out)
        else:
            byte_quads(grid.codes, offset, codes_out)
        scales_out.copy_(rows_last(torch.stack([grid.scale] + ([grid.low] if lows else []), dim=-1), blocks))

    return Run(
        G_INT8_GROUPS,
        n,
        grid.group,
        lows,
        [((blocks, k // 2, 16, 2), torch.int8), ((blocks, k // grid.group, 1 + lows, 16), torch.float32)],
        fill,
        mode,
        offset,
    )


def runs_of(quantized: QuantizedWeight, packed: bool = False) -> list[Run]:
    """A quantized projection's runs of output rows, in order. On int8 inputs Q5_K's and Q6_K's
    codes are in 5 and 6 bits (`packed`) or bytes, with their super-blocks' scales either way."""
    if quantized.mode == "int8":
        return [int8_rows_run(quantized)]
    if quantized.mode == "int4":  # its codes and unrounded scales, kept for us
        exact = quantized.exact_scales.permute(1, 0, 2)  # [in / 32, n, 2] -> [n, in / 32, 2]
        return [_int4_run(quantized.codes, exact[..., 0], exact[..., 1], x8=False)]
    runs, x8 = [], quantized.int8_inputs
    for grid in quantized.parts:
        k_quant = grid.supers is not None and grid.codes.shape[1] % 256 == 0
        if x8 and k_quant and grid.code_range == (0, 31):  # Q5_K's
            runs.append(_int5_k_run(grid) if packed else _bytes_k_run(grid))
        elif x8 and k_quant and grid.code_range == (-32, 31):  # Q6_K's
            runs.append(_int6_k_run(grid) if packed else _bytes_k_run(grid))
        elif x8 and grid.code_range == (-12, 12):  # MXFP4's, in 4 bits
            runs.append(_mxfp4_run(grid))
        elif x8 and k_quant and grid.code_range in (CODE_RANGES["Q2_K"], CODE_RANGES["Q3_K"]):
            runs.append(_crumbs_run(grid))
        elif x8 and grid.code_range == CODE_RANGES["IQ4_NL"] and (k_quant or grid.supers is None):
            runs.append(_iq4_run(grid))
        elif grid.bits == 8:
            runs.append(_groups_run(grid, x8))
        elif k_quant:
            runs.append(_int4_k_run(grid, x8))
        else:  # the int4 kernel's zero is the value at q = 8
            low = grid.low if grid.low is not None else torch.zeros_like(grid.scale)
            runs.append(_int4_run(grid.codes, grid.scale, low + 8 * grid.scale, x8))
    # the PyTorch forward quantizes the inputs in the blocks tiles_int8.c's x8_block takes for these runs
    if x8 and (quantized.int8_inputs == 256) != all(run.kind in SUPER_BLOCK_TILES for run in runs):
        raise ValueError(f"int8 inputs in blocks of {quantized.int8_inputs} for runs of kinds {[r.kind for r in runs]}")
    return runs


def grid_struct(runs: list[Run], tensors: list[tuple[torch.Tensor, torch.Tensor]]) -> abi.Grid:
    """native.h's Grid for the runs, placed (codes, scales) in the arena and filled."""
    grid = abi.Grid(parts=len(runs))
    for i, (run, (codes, scales)) in enumerate(zip(runs, tensors)):
        run.fill_once(codes, scales)
        grid.part[i] = abi.GridPart(
            kind=run.kind,
            rows=run.rows,
            group=run.group,
            lows=run.lows,
            codes=codes.data_ptr(),
            scales=scales.data_ptr(),
            x8=run.x8,
            offset=run.offset,
        )
    return grid


def check_runs(runs: list[Run]) -> str | None:
    """Why the kernels cannot take these runs, or None."""
    if len(runs) > MAX_PARTS:
        return f"a projection in {len(runs)} runs of different codes (at most {MAX_PARTS})"
    if any(run.rows % 16 for run in runs[:-1]):
        return "a run of codes that ends inside a block of 16 output rows"
    return None
