"""Weight-only quantization of the projection weights (`--quantization int8|int4`, CPU, bfloat16).

One request decoding alone is bound by reading the weights: every token streams all of them
through the cores once. Stored in fewer bits they stream faster:

* int8: one scale per output row (symmetric, scale = max |w| / 127), PyTorch's
  `_weight_int8pack_mm`;
* int4: groups of 32 inputs with a scale and a minimum each (w = scale * q + min, q in 0..15: the
  grid of GGUF's Q4_1), PyTorch's `_weight_int4pack_mm_for_cpu`. Weights read from a Q4_1 file
  keep their 4-bit codes; the scales round to bfloat16 as every bfloat16 weight does. The LM head
  gets int8 in this mode, as llama.cpp's 4-bit files keep their token embedding in 8 bits (int4
  there cost 10 points of top-1 agreement with float32 on SmolLM2).
* file: a GGUF file's projections keep the codes and scales of their own blocks (`Grid`s, read by
  models/gguf_grids.py: Q4_0 ... Q8_0, Q2_K ... Q6_K, IQ4_NL, IQ4_XS, MXFP4), for the native step only; PyTorch runs
  their dequantized values.

These kernels win only for a few rows (docs/design_notes.md, "PyTorch's quantized kernels"). So a
quantized `Linear`
keeps its 16-bit packed GEMM too, on the *dequantized* weights, for iterations with more rows:
the model is the same (up to rounding) at every batch size, and a fused batch of 32 runs at the
16-bit speed. The price is memory: the quantized copy comes on top (int4: +25%, int8: +50%).

On CPU the native step (flover/native/forward.py) runs int4 and int8 with kernels of its
own on the same codes and scales (int4's `codes` keeps them unpacked until it has blocked them),
at every row count, and PyTorch's copies are released.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from flover.models.gguf_grids import CODE_RANGES

INT4_GROUP = 32
# Iterations with at most this many rows use the quantized kernel (crossovers measured above).
MAX_ROWS = {"int8": 2, "int4": 8}


@dataclass
class QuantizedWeight:
    mode: str  # "int8", "int4" or "file"
    data: torch.Tensor | None  # int8 [out, in], or int4 packed by PyTorch for its CPU kernel (file: None)
    scales: torch.Tensor | None  # int8: [out]; int4: [in / 32, out, 2] (scale, zero point) in x's dtype
    max_rows: int  # iterations of up to this many rows use matmul (file: none)
    codes: torch.Tensor | None = None  # int4, when asked: uint8 [out, in] of q in 0..15 (the native step's copy)
    # ... with float32 [in / 32, out, 2] (scale, zero point) unrounded: the native step's, so that a
    # GGUF file's scales stay its own (bfloat16 would keep 8 of their 11 bits)
    exact_scales: torch.Tensor | None = None
    parts: list["Grid"] | None = None  # file: the output rows' grids, in order (the native step's)
    # file, codes the native step's integer kernels take (Grid.takes_int8_inputs): inputs are
    # quantized to int8 first (int8_inputs), as those kernels take them, in blocks of this many
    # inputs (32, or 256 where every run is a K-quant with a super-block tile: int8_block); 0: not quantized
    int8_inputs: int = 0

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in] -> [T, out] (no bias)."""
        if self.mode == "int8":
            return torch._weight_int8pack_mm(x, self.data, self.scales)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.data, INT4_GROUP, self.scales)


def quantize(
    weight: torch.Tensor, mode: str, keep_codes: bool = False, dtype: torch.dtype | None = None
) -> tuple[QuantizedWeight, torch.Tensor]:
    """weight: [out, in] -> (the quantized weight, the dequantized weight in `dtype`, the model's:
    weight's own by default; a float32 weight of a bfloat16 model is quantized from its unrounded
    values). `keep_codes`: also keep int4's codes unpacked (the native step blocks them its own way)."""
    w = weight.detach().to(torch.float32)
    dtype = weight.dtype if dtype is None else dtype
    if mode == "int8":
        scale = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)  # [out]
        scale = scale.to(dtype).to(torch.float32)  # the kernel scales in x's dtype
        q = torch.round(w / scale[:, None]).clamp(-127, 127)
        packed = QuantizedWeight(mode, q.to(torch.int8), scale.to(dtype), MAX_ROWS[mode])
        return packed, (q * scale[:, None]).to(dtype)
    if mode != "int4":
        raise ValueError(f"quantization {mode!r}: choose one of {', '.join(MAX_ROWS)}")
    out, inp = w.shape
    groups = w.view(out, inp // INT4_GROUP, INT4_GROUP)  # [out, in / 32, 32]
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15)
    return int4_weight(q.view(out, inp).to(torch.uint8), scale, low, dtype, keep_codes)


def int4_weight(
    codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, dtype: torch.dtype, keep_codes: bool = False
) -> tuple[QuantizedWeight, torch.Tensor]:
    """A 4-bit grid, w = scale * q + low (codes uint8 [out, in] in 0..15; scale, low float32
    [out, in / 32]: a GGUF file's own, or quantize()'s) -> (the quantized weight, the dequantized
    weight in `dtype`)."""
    mode, codes = "int4", codes.contiguous()
    out, inp = codes.shape
    q = codes.view(out, inp // INT4_GROUP, INT4_GROUP).to(torch.float32)
    # PyTorch's kernel computes (q - 8) * scale + zero: zero = low + 8 * scale, both in x's dtype.
    scale16 = scale.to(dtype)
    zero16 = (low + 8 * scale16.to(torch.float32)).to(dtype)
    scales = torch.stack((scale16.t(), zero16.t()), dim=-1).contiguous()  # [in / 32, out, 2]
    data = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
    if keep_codes:  # the native step's model: unrounded scales (its 16-bit copy dequantizes them)
        scale32, zero32 = scale, low + 8 * scale
        dequantized = (q - 8) * scale32[..., None] + zero32[..., None]
        exact = torch.stack((scale32.t(), zero32.t()), dim=-1).contiguous()
        return (QuantizedWeight(mode, data, scales, MAX_ROWS[mode], codes, exact), dequantized.view(out, inp).to(dtype))
    dequantized = (q - 8) * scale16.to(torch.float32)[..., None] + zero16.to(torch.float32)[..., None]
    return QuantizedWeight(mode, data, scales, MAX_ROWS[mode]), dequantized.view(out, inp).to(dtype)


@dataclass
class Grid:
    """A run of a projection's output rows on a quantized file's own grid: w = scale * q + low per
    group of `group` inputs (models/gguf_grids.py)."""

    codes: torch.Tensor  # [rows, in]: uint8 0..15 (bits 4) or int8
    scale: torch.Tensor  # float32 [rows, in / group]
    low: torch.Tensor | None  # float32 [rows, in / group]; None: every low is 0
    group: int
    bits: int  # 4 (the int4 kernels) or 8
    code_range: tuple[int, int]  # the block type's smallest and largest q
    # the K-quants' factors of scale and low (gguf_grids.BlockGrid.supers): Q4_K's and Q5_K's d,
    # -dmin [rows, in / 256] float32, sc, m [rows, in / 32] uint8; Q6_K's d, sc [rows, in / 16] int8
    supers: tuple[torch.Tensor, ...] | None = None

    def kernel(self) -> tuple:
        """What the native step's kernel for these codes depends on: neighbours equal here run as one."""
        return self.bits, self.group, self.low is None, self.supers is None, self.code_range

    def small_codes(self) -> bool:
        """Codes of up to 6 bits (tiles_int8.c stores them below 64)."""
        return self.code_range[1] - self.code_range[0] < 64

    def takes_int8_inputs(self) -> bool:
        """The int8-input kernels take these codes: up to 6 bits, or bytes (int8, so any 8-bit
        codes) in groups of 32 without minimums (Q8_0's)."""
        return self.small_codes() or (self.bits == 8 and self.group == 32 and self.low is None)

    @staticmethod
    def cat(grids: list["Grid"]) -> "Grid":
        """Runs of the same kernel, their rows one after another."""
        first = grids[0]
        low = None if first.low is None else torch.cat([g.low for g in grids])
        supers = None if first.supers is None else tuple(torch.cat(parts) for parts in zip(*(g.supers for g in grids)))
        return Grid(
            torch.cat([g.codes for g in grids]),
            torch.cat([g.scale for g in grids]),
            low,
            first.group,
            first.bits,
            first.code_range,
            supers,
        )


def file_weight(grids: list[Grid], values: torch.Tensor, dtype: torch.dtype) -> tuple[QuantizedWeight, torch.Tensor]:
    """A projection's sources' grids, rows one after another (q, k, v), and the values the file
    gives for them (float32 [out, in]: scale * q + low, bit for bit) -> (the quantized weight,
    neighbours of the same kernel merged into one run; the values in `dtype`)."""
    runs = [Grid.cat(list(same)) for _, same in itertools.groupby(grids, key=Grid.kernel)]
    x8 = all(run.takes_int8_inputs() for run in runs)
    return QuantizedWeight("file", None, None, 0, parts=runs, int8_inputs=int8_block(runs) if x8 else 0), values.to(
        dtype
    )


def int8_block(runs: list[Grid]) -> int:
    """The block of inputs int8 rows are quantized in for these runs: 256 (as llama.cpp's Q8_K
    rows) where every run is Q4_K's, Q5_K's or Q6_K's, whose native tiles sum a super-block in
    integers, else 32 (as its Q8_0 rows). The native step decides the same from its runs' kinds
    (x8_block)."""
    super_tiles = (CODE_RANGES["Q4_K"], CODE_RANGES["Q5_K"], CODE_RANGES["Q6_K"])
    k256 = all(r.supers is not None and r.code_range in super_tiles and r.codes.shape[1] % 256 == 0 for r in runs)
    return 256 if k256 else 32


def int8_inputs(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """x [T, in] -> its values quantized to int8 per `block` inputs, as llama.cpp's Q8_0 (32) or
    Q8_K (256) rows and the native step's int8_rows (tiles_int8.c) do, step for step in float32:
    d = max |x| / 127, q = round-to-even(x / d) (x * (1 / d)), x ~ q d; in x's dtype."""
    t, n = x.shape
    blocks = x.to(torch.float32).view(t, n // block, block)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127
    inverse = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    return (torch.round(blocks * inverse) * d).view(t, n).to(x.dtype)


def can_quantize(weight: torch.Tensor, mode: str) -> str | None:
    """Why `weight`'s shape does not fit `mode`, or None (the Engine has checked CPU + bfloat16)."""
    if mode == "int4" and weight.shape[1] % INT4_GROUP:
        return f"int4 needs input sizes divisible by {INT4_GROUP}, this weight has {weight.shape[1]}"
    return None
