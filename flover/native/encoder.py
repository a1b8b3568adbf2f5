"""A BERT-family encoder's fused iteration in one native call (CPU, models/bert.py's graph: all-MiniLM,
BGE, E5, GTE, XLM-RoBERTa and their cross-encoders; float32 / bfloat16 weights and a GGUF file's codes).

`native/encoder_forward.c` runs it: the decoder's projection kernels on blocked weights or codes,
LayerNorm and GELU as row loops, and attention both ways within each input through the blocked
prompt kernel. Every row's numbers are summed in the same order whatever else shares the
iteration, so a vector is the same bits alone and fused on every CPU (PyTorch's GEMMs pick their
blocking by the row count and promise nothing). Pooling, Dense modules and a cross-encoder's head
stay in PyTorch (runner/pooling.py), on the rows this returns.
"""

from __future__ import annotations

import torch

from flover.models.attention import ForwardBatch
from flover.models.bert import BertEncoder
from flover.native import abi
from flover.native.abi import kernels_of, load_library
from flover.native.build import NativeUnavailable
from flover.native.forward import DTYPE_CODES, PlacedWeights, WeightPlan

GELU_FORMS = {"gelu": abi.ENC_GELU, "gelu_pytorch_tanh": abi.ENC_GELU_TANH, "gelu_new": abi.ENC_GELU_TANH}
PROJECTIONS = ("qkv", "o", "up", "down")

# flover_check_encoder's codes
ENCODER_CHECKS = {
    1: "every size must be positive",
    2: "hidden size must be heads x head_dim",
    3: "head_dim must be even and at most 512, hidden and intermediate sizes even",
    4: "the position table is shorter than the positions served (or RoPE lacks its tables), an embedding table "
    "or norm is missing, or the activation code is unknown",
    5: "a layer lacks a projection or a LayerNorm",
}


def encoder_unsupported(model: torch.nn.Module, dtype: torch.dtype) -> str | None:
    """Why `model` cannot take the encoder's native step, or None."""
    if not isinstance(model, BertEncoder):
        return f"{type(model).__name__} is not models/bert.py's encoder"
    if dtype not in DTYPE_CODES:
        return f"dtype {dtype} (float32 and bfloat16 only)"
    cfg = model.cfg
    if cfg.gated_mlp and cfg.hidden_act != "silu" or not cfg.gated_mlp and cfg.hidden_act not in GELU_FORMS:
        return f"activation {cfg.hidden_act!r} (SwiGLU's silu, or {', '.join(GELU_FORMS)})"
    if model.rotary is not None and (model.rotary.interleaved or model.rotary.rotary_dim != cfg.head_dim):
        return "RoPE other than rotate-half over whole heads"
    if any(getattr(layer, name).weight is None for layer in model.layers for name in PROJECTIONS):
        return "dense weights were not kept"
    return None


class NativeEncoder:
    def __init__(
        self,
        model: BertEncoder,
        dtype: torch.dtype,
        threads: int,
        max_rows: int,
        max_len: int,
        release: bool = False,
        kernels: str = "auto",
    ):
        """Copies the layers' projections once (blocked, or a GGUF file's codes as runs);
        `release`: PyTorch's copies are released as each is made. `max_rows`: the most tokens an
        iteration has; `max_len`: the longest input."""
        why = encoder_unsupported(model, dtype)
        if why is not None:
            raise NativeUnavailable(why)
        self.lib = load_library(kernels)
        self.kernels = kernels_of(self.lib)
        self.model, self.dtype, self.threads, self.max_rows = model, dtype, threads, max_rows
        self.sampler = None  # (an encoder samples nothing)
        linears = [getattr(layer, name) for layer in model.layers for name in PROJECTIONS]
        plan = WeightPlan.of_projections(linears, bool(self.lib.flover_packed_codes()))
        self.quantized_projections = len(plan.quantized)
        self._weights = PlacedWeights(plan, dtype)
        cfg = model.cfg
        self._model_struct = abi.Model(
            layers=len(model.layers),
            hidden=cfg.hidden_size,
            heads=cfg.num_heads,
            kv_heads=cfg.num_heads,
            head_dim=cfg.head_dim,
            inter=cfg.intermediate_size,
            vocab=cfg.vocab_size,
            dtype=DTYPE_CODES[dtype],
            max_seq=max_len,
            kv_pos=cfg.head_dim,  # (this iteration's keys, rows of head_dim)
            embed=model.embed.data_ptr(),
        )
        table, rotary = model.positions, model.rotary  # (one of them: absolute positions, or RoPE's tables)
        self._encoder_struct = abi.Encoder(
            positions=table.data_ptr() if table is not None else 0,
            position_rows=table.shape[0] if table is not None else 0,
            position_offset=cfg.position_offset,
            cos=rotary.cos.data_ptr() if rotary is not None else 0,
            sin=rotary.sin.data_ptr() if rotary is not None else 0,
            token_types=model.token_type.data_ptr(),
            type_rows=model.token_type.shape[0],
            norm=model.embed_norm_weight.data_ptr(),
            norm_bias=model.embed_norm_bias.data_ptr(),
            act=abi.ENC_SWIGLU if cfg.gated_mlp else GELU_FORMS[cfg.hidden_act],
        )
        self._layer_structs = (abi.EncoderLayer * len(model.layers))()
        for i, layer in enumerate(model.layers):
            self._layer_structs[i] = self._layer_struct(layer, release)
        failed = self.lib.flover_check_encoder(self._model_struct, self._encoder_struct, self._layer_structs)
        if failed:
            raise ValueError(f"native step: the encoder's shape breaks its assumptions: {ENCODER_CHECKS[failed]}")
        self._work = torch.empty(self.lib.flover_encode_floats(self._model_struct, max_rows, threads))
        self.eps = float(cfg.norm_eps)
        self.iterations = 0  # iterations run natively (stats, tests)

    def _layer_struct(self, layer, release: bool) -> abi.EncoderLayer:
        fields = {}
        for name in PROJECTIONS:
            lin = getattr(layer, name)
            fields[name], fields[f"{name}_grid"] = self._weights.projection(lin)
            fields[f"{name}_bias"] = self._weights.address(lin.bias)
            if release:
                lin.release()  # (the bias stays: its address is read)
        norms = (layer.attn_norm_weight, layer.attn_norm_bias, layer.mlp_norm_weight, layer.mlp_norm_bias)
        names = ("attn_norm", "attn_norm_bias", "mlp_norm", "mlp_norm_bias")
        return abi.EncoderLayer(**fields, **{n: self._weights.address(w) for n, w in zip(names, norms)})

    def describe(self) -> str:
        """What runs, for the start-up line."""
        if self.quantized_projections:
            weights = "the file's own codes"
        else:
            weights = "float32 weights" if self.dtype == torch.float32 else "bfloat16 weights"
        return f"{self.kernels} kernels, {weights}, attention both ways"

    def run(self, batch: ForwardBatch, greedy: bool = False) -> torch.Tensor | None:
        """The iteration's pooled rows into batch.pooled (the model dtype), and the head's [B, 0]
        (no token is sampled from an encoder); None when it has more tokens than max_rows."""
        rows = batch.input_ids.shape[0]
        if not 0 < rows <= self.max_rows:
            return None
        hidden = torch.empty(rows, self.model.cfg.hidden_size, dtype=torch.float32)
        spans = torch.tensor([(s.token_start, s.length) for s in batch.prefills], dtype=torch.int64)
        if any(s.start_pos != 0 for s in batch.prefills):  # (the scheduler admits encoder inputs whole)
            raise RuntimeError("an encoder input came cut into chunks")
        # named: contiguous copies live until the call returns
        tokens, positions = batch.input_ids.contiguous(), batch.positions.contiguous()
        types = batch.token_types.contiguous() if batch.token_types is not None else None
        failed = self.lib.flover_encode(
            self._model_struct,
            self._encoder_struct,
            self._layer_structs,
            rows,
            tokens.data_ptr(),
            positions.data_ptr(),
            types.data_ptr() if types is not None else None,
            spans.data_ptr(),
            spans.shape[0],
            hidden.data_ptr(),
            self._work.data_ptr(),
            self.eps,
            self.threads,
        )
        if failed:
            raise RuntimeError("native step: a row's token id, position, token type or input is out of range")
        self.iterations += 1
        if batch.pool_rows is not None:
            batch.pooled = hidden[batch.pool_rows].to(self.dtype)  # (exact: model-dtype values)
        return hidden.new_zeros(batch.sample_rows.shape[0], 0)
