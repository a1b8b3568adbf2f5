"""Building blocks shared by the architectures. Precision choices mirror transformers (RMSNorm
and the rotary tables computed in float32) so that our logits match the reference bit for bit in
spirit: a float64 run differs from transformers' float64 run only by summation order."""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from flover.models.model_config import CheckpointError, ModelConfig
from flover.models.quant import QuantizedWeight, file_weight, int4_weight, int8_inputs, quantize
from flover.models.safetensors_reader import Source


def new_param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, hidden]. Normalised in float32 (also for float64 and 16-bit inputs), cast back, then
    scaled by the weight, as LlamaRMSNorm does; PyTorch's fused kernel does the normalisation in one
    operation instead of six (bit for bit the same values, tested against transformers). A 16-bit
    input goes into the kernel as it is: the kernel widens it to float32 itself, so the explicit
    casts (two more operations; on a GPU two more kernel launches) give the same bits."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    if x.dtype in (torch.bfloat16, torch.float16):
        return weight * F.rms_norm(x, (x.shape[-1],), None, eps)
    return weight * F.rms_norm(x.to(torch.float32), (x.shape[-1],), None, eps).to(x.dtype)


def wide_weight_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """An RMSNorm with its weight in float32 (OLMo 2's): normalised in float32, times the weight
    in float32, rounded to x's dtype once (Olmo2RMSNorm; LlamaRMSNorm rounds before the weight
    too). Float32 and float64 inputs as rms_norm (the same values: a float64 weight times the
    float32 normalisation, in float64)."""
    if x.dtype in (torch.bfloat16, torch.float16):
        return (F.rms_norm(x.float(), (x.shape[-1],), None, eps) * weight.float()).to(x.dtype)
    return rms_norm(x, weight, eps)


def offset_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 1.0) -> torch.Tensor:
    """An RMSNorm whose weights are stored minus `offset`: normalised in float32, times (offset +
    weight) in float32, rounded to x's dtype once (Gemma3RMSNorm; also for float64 inputs, as it does)."""
    return (F.rms_norm(x.float(), (x.shape[-1],), None, eps) * (offset + weight.float())).to(x.dtype)


def float32_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """(Gemma 4) normalised as x * (mean(x^2) + eps)^-0.5 in float32, times the weight in float32
    (none: 1), rounded to x's dtype once, whatever x's dtype (float64 too, as Gemma4RMSNorm)."""
    x32 = x.float()
    normed = x32 * torch.pow(x32.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    return (normed if weight is None else normed * weight.float()).to(x.dtype)


def activation(name: str):
    if name == "silu":
        return F.silu
    if name in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    if name == "relu":
        return F.relu
    raise CheckpointError(f"config.json: activation {name!r} is not supported")


def longrope_factors(scaling: dict, max_len: int) -> list[float]:
    """LongRoPE's divisors of the frequencies: the long ones where this engine's sequences may run
    past the original training length, else the short ones. (transformers switches per forward by
    the longest position in it; a fixed choice keeps a row's numbers independent of the others'.)"""
    return scaling["long_factor" if max_len > scaling["original_max_position_embeddings"] else "short_factor"]


def longrope_attention_factor(scaling: dict) -> float:
    """The factor LongRoPE scales cos and sin by (transformers' default from the length ratio)."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or (scaling["max_position_embeddings"] or original) / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def _inv_freq(config: ModelConfig, max_len: int = 0) -> torch.Tensor:
    """[rotary_dim / 2] float32 inverse frequencies (transformers' default/linear/llama3 RoPE; a GGUF
    file's rope_freqs.weight divides them, as llama.cpp's rope does)."""
    dim = config.rotary_dim
    base = config.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    if scaling["rope_type"] == "proportional":  # (Gemma 4) the first pairs turn, the rest not (frequency 0)
        turned = int(scaling.get("partial_rotary_factor", 1.0) * dim // 2)
        return torch.cat((inv_freq[:turned], torch.zeros(dim // 2 - turned))) / scaling.get("factor", 1.0)
    if scaling["rope_type"] == "freq_factors":
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    if scaling["rope_type"] == "yarn":
        return _yarn_inv_freq(scaling, base, dim)
    if scaling["rope_type"] == "longrope":  # (its own order of operations, as transformers')
        return 1.0 / (
            torch.tensor(longrope_factors(scaling, max_len), dtype=torch.float32)
            * base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
        )
    # llama3: low frequencies are scaled by `factor`, high ones kept, the band between smoothed.
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def yarn_attention_factor(scaling: dict) -> float:
    """The factor YaRN scales cos and sin by (transformers' default: 0.1 ln(factor) + 1)."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = scaling["factor"]
    mscale = lambda scale, m=1.0: 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0  # noqa: E731
    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return float(mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"]))
    return mscale(factor)


def _yarn_inv_freq(scaling: dict, base: float, dim: int) -> torch.Tensor:
    """YaRN's frequencies (gpt-oss): interpolated by `factor` below the band the original length
    rotates through beta_slow .. beta_fast times, kept above it, a linear ramp between (as
    transformers' _compute_yarn_parameters, step for step)."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1
    correction = lambda rotations: dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))  # noqa: E731
    low, high = correction(fast), correction(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    return interpolation * (1 - keep) + extrapolation * keep


class Rotary(nn.Module):
    """Rotary position embedding with tables for every position up to `max_len`.

    style "half": Llama's rotate_half over the first `rotary_dim` dims of each head (all of it but
    for Phi-4-mini). style "interleaved": GPT-J's rotate_every_two over the first `rotary_dim`.
    """

    def __init__(
        self, config: ModelConfig, max_len: int, dtype: torch.dtype, device: torch.device, local: bool = False
    ):
        """`local`: the sliding-window layers' tables (their own base, local_rope_theta; no scaling)."""
        super().__init__()
        if local:
            config = dataclasses.replace(config, rope_theta=config.local_rope_theta, rope_scaling=None)
        self.interleaved = config.rope_interleaved
        self.rotary_dim = config.rotary_dim
        positions = torch.arange(max_len, dtype=torch.int64).float()
        freqs = positions[:, None] * _inv_freq(config, max_len)[None, :]  # [max_len, rot / 2] float32
        if self.interleaved:
            emb = freqs.repeat_interleave(2, dim=-1)  # [max_len, rot]: f0 f0 f1 f1 ...
        else:
            emb = torch.cat((freqs, freqs), dim=-1)  # [max_len, rot]: f0 f1 ... f0 f1 ...
        cos, sin = emb.cos(), emb.sin()
        rope_type = config.rope_scaling["rope_type"] if config.rope_scaling is not None else None
        if rope_type in ("longrope", "yarn"):
            scaling = config.rope_scaling
            scale = longrope_attention_factor(scaling) if rope_type == "longrope" else yarn_attention_factor(scaling)
            cos, sin = cos * scale, sin * scale
        self.cos = cos.to(dtype=dtype, device=device)
        self.sin = sin.to(dtype=dtype, device=device)
        if not self.interleaved:
            # rotate_half(x) * sin == roll(x, half) * [-sin, sin]: the sign lives in the table, so
            # that a rotation is three operations (mul, roll, addcmul) instead of six.
            half = self.rotary_dim // 2
            self.sin = torch.cat((-self.sin[:, :half], self.sin[:, half:]), dim=-1)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for the iteration's positions: [T, 1, rot] each (looked up once per forward)."""
        return self.cos[positions][:, None, :], self.sin[positions][:, None, :]

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """x: [T, heads, head_dim]; positions: [T] -> rotated copy of x."""
        cos, sin = tables if tables is not None else self.tables(positions)
        if not self.interleaved and self.rotary_dim == x.shape[-1]:  # x cos + rotate_half(x) sin, sign in `sin`
            return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)
        if not self.interleaved:  # the same over the first rotary_dim dims (Phi-4-mini), the rest as they are
            rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
            return torch.cat((torch.addcmul(rot * cos, rot.roll(self.rotary_dim // 2, dims=-1), sin), rest), dim=-1)
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        pairs = rot.unflatten(-1, (-1, 2))  # [..., rot / 2, 2]
        turned = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
        return torch.cat((rot * cos + turned * sin, rest), dim=-1)


class Linear(nn.Module):
    """y = x W^T + b over the whole token matrix.

    On CPU in float32/bfloat16 the weight is repacked once, after loading, into oneDNN's blocked
    layout (`pack`): small-M GEMMs such as a decode iteration's then run several times faster than
    with the plain row-major weight (docs/design_notes.md, "measured choices"). The dense weight is
    dropped after packing to keep one copy in memory.
    """

    def __init__(self, out_features: int, in_features: int, bias: bool, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weight = new_param(out_features, in_features, dtype=dtype, device=device)
        self.bias = new_param(out_features, dtype=dtype, device=device) if bias else None
        self.packed: torch.Tensor | None = None
        self.quantized: QuantizedWeight | None = None  # used for iterations of few rows
        self.int8_inputs = 0  # a file's codes: inputs quantized as the native step's, in blocks of this many (quant.py)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape) if self.weight is not None else self._shape

    def quantize(
        self, mode: str, keep_codes: bool = False, values: torch.Tensor | None = None, grids: list | None = None
    ) -> None:
        """Keep a quantized copy for iterations of few rows; the 16-bit weight becomes its
        dequantized values, so both kernels compute the same model (models/quant.py). `values`:
        the checkpoint's float32 values of the weight, quantized before any rounding to 16 bits.
        `grids`: a GGUF file's own (quant.Grid per source, their rows one after another), kept as
        they are (int4: 4-bit ones; file: `values` are theirs)."""
        if grids is not None and mode == "file":
            self.quantized, dequantized = file_weight(grids, values, self.weight.dtype)
            self.int8_inputs = self.quantized.int8_inputs
        elif grids is not None:
            if any(g.bits != 4 or g.low is None for g in grids):
                raise ValueError("int4 takes 4-bit grids with minimums (Q4_0, Q4_1, Q4_K)")
            codes, scale, low = (torch.cat([getattr(g, f) for g in grids]) for f in ("codes", "scale", "low"))
            self.quantized, dequantized = int4_weight(codes, scale, low, self.weight.dtype, keep_codes)
        else:
            source = self.weight if values is None else values
            self.quantized, dequantized = quantize(source, mode, keep_codes, dtype=self.weight.dtype)
        self.weight.data = dequantized

    def pack(self, batch_hint: int) -> bool:
        """Repack the weight for oneDNN's GEMM (the row-major one is released)."""
        w = self.weight
        if w.device.type != "cpu" or w.dtype not in (torch.float32, torch.bfloat16):
            return False
        if not torch.backends.mkldnn.is_available():
            return False
        try:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), batch_hint)
        except (RuntimeError, AttributeError):  # a build without these ops: keep F.linear
            return False
        self._shape = tuple(w.shape)
        self.weight = None
        return True

    def release(self) -> None:
        """Drop every copy of the weight (the native step keeps its own); forward then fails."""
        if self.packed is None and self.weight is not None:
            self._shape = tuple(self.weight.shape)
        self.weight = self.packed = self.quantized = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is None and self.packed is None and self.quantized is None:
            raise RuntimeError("this projection's weights were released: the native step runs every iteration")
        if self.int8_inputs:
            x = int8_inputs(x, self.int8_inputs)
        if self.quantized is not None and x.shape[0] <= self.quantized.max_rows:
            y = self.quantized.matmul(x)
            return y if self.bias is None else y + self.bias
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def all_reduce(x: torch.Tensor, comm) -> torch.Tensor:
    """Sum the partial results of a row-parallel projection over the ranks (no-op at TP=1)."""
    if comm is not None:
        comm.all_reduce(x)
    return x


def vocab_embedding(ids: torch.Tensor, weight: torch.Tensor, layout, comm) -> torch.Tensor:
    """ids: [T] -> [T, hidden]. With TP each rank owns a block of the vocabulary: it looks up the
    ids in its block, zeros the others, and the all-reduce assembles the full rows."""
    if comm is None:
        return F.embedding(ids, weight)
    local = ids - layout.vocab_start
    outside = (local < 0) | (local >= layout.vocab)
    out = F.embedding(local.clamp(0, layout.vocab - 1), weight)
    out.masked_fill_(outside[:, None], 0)
    comm.all_reduce(out)
    return out


def rows(name: str, shape: tuple[int, ...], start: int, count: int) -> Source:
    """This rank's rows [start, start + count) of a checkpoint tensor (column parallelism)."""
    return Source(name, shape, 0, start, start + count)


def cols(name: str, shape: tuple[int, int], start: int, count: int) -> Source:
    """This rank's input columns (row parallelism)."""
    return Source(name, shape, 1, start, start + count)


def whole(name: str, shape: tuple[int, ...]) -> Source:
    return Source(name, shape)
