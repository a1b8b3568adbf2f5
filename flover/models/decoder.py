"""The decoder every family but GPT-J runs (families/*.py say which features a family has; this
file reads only the features, models/model_config.py): GQA, RoPE (per layer: none, the model's,
or the local layers' own base), optional QKV / o / MLP biases, q/k RMSNorms per head or over the
whole projection, norms before, after, or before and after attention and the MLP, sliding
windows, attention sinks, an output gate, Gated DeltaNet layers in place of attention
(models/gated_deltanet.py), a dense gated MLP or a mixture of experts (models/moe.py), and the
scales some families put on the embeddings, the residual adds, the scores and the logits.

Tensor parallelism (Megatron): QKV and gate/up are split by output columns, attention-out and
down by input rows followed by one all-reduce each; biases of the row-parallel projections are
added once, after the all-reduce; embedding and LM head are split by vocabulary.
A pipeline stage (models/stage_layout.py) holds its range of layers; the first stage also the
embedding, final norm and LM head (`embed_tokens`, `run_layers` and `head`: the forward in three parts).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import torch
from torch import nn

from flover.models.attention import AttentionOptions, ForwardBatch, attention, write_kv
from flover.models.gated_deltanet import GatedDeltaNet
from flover.models.layers import (
    Linear,
    Rotary,
    activation,
    all_reduce,
    cols,
    float32_rms_norm,
    new_param,
    offset_rms_norm,
    rms_norm,
    rows,
    vocab_embedding,
    whole,
    wide_weight_rms_norm,
)
from flover.models.model_config import ModelConfig
from flover.models.moe import ExpertsMLP
from flover.models.per_layer_inputs import PerLayerInputs
from flover.models.safetensors_reader import WeightSpec
from flover.models.stage_layout import StageLayout
from flover.models.tp_layout import TPLayout


class DecoderLayer(nn.Module):
    def __init__(
        self, cfg: ModelConfig, tp: TPLayout, index: int, window: int | None, dtype: torch.dtype, device: torch.device
    ):
        super().__init__()
        h, d = cfg.hidden_size, cfg.layer_head_dim(index)
        if cfg.layer_kv_heads(index) != cfg.num_kv_heads:  # (Gemma 4's full-attention layers) kv heads of their own
            tp = tp.with_kv_heads(cfg.layer_kv_heads(index))
        self.tp, self.index, self.head_dim = tp, index, d
        self.q_size, self.kv_size = tp.heads * d, tp.kv_heads * d
        # (Gemma 4) a layer reading an earlier layer's keys and values projects queries only;
        # a full-attention layer's values may be its keys' projection (no v_proj)
        self.reads_kv = cfg.kv_source(index) == index
        self.v_from_k = cfg.global_k_eq_v and cfg.is_global(index)
        p = lambda *shape: new_param(*shape, dtype=dtype, device=device)  # noqa: E731
        lin = lambda out, inp, bias: Linear(out, inp, bias, dtype, device)  # noqa: E731
        post, sandwich = cfg.norm_layout == "post", cfg.norm_layout == "sandwich"
        self.input_norm = None if post else p(h)  # (norms after attention and the MLP only: none before)
        # (Qwen3.5) a Gated DeltaNet layer in place of attention: a recurrent state instead of KV
        recurrent = cfg.linear_attention is not None and index in cfg.linear_attention.layers
        self.linear = GatedDeltaNet(cfg, tp, dtype, device) if recurrent else None
        # (Qwen3.5) each head's query followed by its output gate: q_proj twice as wide
        self.gate_size = self.q_size if cfg.attn_output_gate else 0
        q_width = self.q_size + self.gate_size
        kv_width = 0 if not self.reads_kv else self.kv_size if self.v_from_k else 2 * self.kv_size
        self.qkv = None if recurrent else lin(q_width + kv_width, h, cfg.qkv_bias)  # q, k, v fused: one GEMM
        # before RoPE: per head (Qwen3), or over the whole of q and of k (OLMo 2)
        norm_sizes = {"head": (d, d), "projection": (self.q_size, self.kv_size)}.get(cfg.qk_norm)
        self.q_norm, self.k_norm = (
            (p(norm_sizes[0]), p(norm_sizes[1]) if self.reads_kv else None)
            if norm_sizes and not recurrent
            else (None, None)
        )
        self.rope = index not in cfg.nope_layers  # (SmolLM3's NoPE layers: positions only through the causal mask)
        self.local_rope = cfg.local_rope_theta is not None and window is not None  # (Gemma 3's own base)
        self.o = None if recurrent else lin(h, self.q_size, False)
        self.o_bias = p(h) if cfg.o_bias and not recurrent else None
        self.post_norm = p(h)  # before the MLP; norms after only: after attention, before the residual add
        self.attn_norm_after = p(h) if sandwich else None  # (four norms a layer) after attention, before the add
        self.ffn_norm_after = p(h) if post or sandwich else None  # after the MLP, before the add
        # (Qwen3-MoE, Mixtral, gpt-oss) experts in place of the dense MLP, which such a layer then has not
        moe = cfg.moe is not None and index in cfg.moe.layers
        act = activation(cfg.hidden_act)
        self.experts = ExpertsMLP(cfg.moe, h, act, tp, dtype, device, cfg.norm_eps) if moe else None
        dense = not moe or cfg.moe.beside_mlp  # (Gemma 4: experts beside the dense MLP)
        self.wide = 2 if index in cfg.wide_mlp_layers else 1  # (Gemma 4) twice as wide an MLP
        self.gate_up = lin(2 * self.wide * tp.intermediate, h, cfg.mlp_bias) if dense else None  # gate and up fused
        self.down = lin(h, self.wide * tp.intermediate, False) if dense else None
        self.down_bias = p(h) if cfg.mlp_bias else None
        self.sinks = p(tp.heads) if cfg.attn_sinks else None  # (gpt-oss) this rank's heads' sink logits
        self._gemma4_parts(cfg, p, lin, moe)
        self.attn_opts = AttentionOptions(
            sinks=self.sinks,
            window=window,
            decode_in_float32=dtype in (torch.bfloat16, torch.float16) and torch.device(device).type == "cpu",
            scale=cfg.attn_scale,
            bidirectional=cfg.bidirectional,
        )

    def _gemma4_parts(self, cfg: ModelConfig, p, lin, moe: bool) -> None:
        """The experts' norms beside the MLP (before the experts, after the MLP, after the
        experts); the per-layer input's gate [width, hidden], projection [hidden, width] and norm;
        the layer's output scalar: None where the model has none."""
        h, pl = cfg.hidden_size, cfg.per_layer_input
        self.beside = (p(h), p(h), p(h)) if moe and cfg.moe.beside_mlp else None
        self.pl_gate = lin(pl.width, h, False) if pl else None
        self.pl_proj = lin(h, pl.width, False) if pl else None
        self.pl_norm = p(h) if pl else None
        self.scalar = p(1) if cfg.layer_scalar else None

    def weight_specs(self, cfg: ModelConfig, tp: TPLayout, prefix: str) -> list[WeightSpec]:
        tp = self.tp  # (its own kv heads where the layer's differ)
        h, d, inter = cfg.hidden_size, self.head_dim, cfg.intermediate_size
        att, mlp = f"{prefix}.self_attn", f"{prefix}.mlp"
        q_full = cfg.num_heads * d
        mlp_norm = "pre_feedforward" if cfg.norm_layout == "sandwich" else "post_attention"  # (transformers' names)

        specs = [WeightSpec(self.post_norm, (whole(f"{prefix}.{mlp_norm}_layernorm.weight", (h,)),))]
        if self.linear is not None:
            specs += self.linear.weight_specs(cfg, prefix)
        else:
            specs.append(WeightSpec(self.qkv.weight, self._qkv_sources(cfg, tp, att, "weight")))
            o_cols = cols(f"{att}.o_proj.weight", (h, q_full), tp.head_start * d, self.q_size)
            specs.append(WeightSpec(self.o.weight, (o_cols,)))
        if self.experts is not None:
            specs += self.experts.weight_specs(prefix, h)
        if self.gate_up is not None:
            specs.append(WeightSpec(self.gate_up.weight, self._gate_up_sources(cfg, tp, mlp, "weight")))
            wide = self.wide
            down_cols = cols(
                f"{mlp}.down_proj.weight", (h, wide * inter), wide * tp.intermediate_start, wide * tp.intermediate
            )
            specs.append(WeightSpec(self.down.weight, (down_cols,)))
        specs += self._gemma4_specs(cfg, prefix)
        if self.input_norm is not None:
            specs.append(WeightSpec(self.input_norm, (whole(f"{prefix}.input_layernorm.weight", (h,)),)))
        if self.attn_norm_after is not None:
            specs.append(WeightSpec(self.attn_norm_after, (whole(f"{prefix}.post_attention_layernorm.weight", (h,)),)))
        if self.ffn_norm_after is not None:
            specs.append(WeightSpec(self.ffn_norm_after, (whole(f"{prefix}.post_feedforward_layernorm.weight", (h,)),)))
        if self.qkv is not None and self.qkv.bias is not None:
            specs.append(WeightSpec(self.qkv.bias, self._qkv_sources(cfg, tp, att, "bias")))
        if self.q_norm is not None:  # (whole: under TP the projection norm is refused, the per-head one replicated)
            specs.append(WeightSpec(self.q_norm, (whole(f"{att}.q_norm.weight", tuple(self.q_norm.shape)),)))
        if self.k_norm is not None:
            specs.append(WeightSpec(self.k_norm, (whole(f"{att}.k_norm.weight", tuple(self.k_norm.shape)),)))
        if self.o_bias is not None:
            specs.append(WeightSpec(self.o_bias, (whole(f"{att}.o_proj.bias", (h,)),)))
        if self.sinks is not None:
            specs.append(WeightSpec(self.sinks, (rows(f"{att}.sinks", (cfg.num_heads,), tp.head_start, tp.heads),)))
        if self.gate_up is not None and self.gate_up.bias is not None:
            specs.append(WeightSpec(self.gate_up.bias, self._gate_up_sources(cfg, tp, mlp, "bias")))
            specs.append(WeightSpec(self.down_bias, (whole(f"{mlp}.down_proj.bias", (h,)),)))
        return specs

    def _gemma4_specs(self, cfg: ModelConfig, prefix: str) -> list[WeightSpec]:
        """The experts' norms beside the MLP, the per-layer input's gate, projection and norm, the
        layer's scalar: where the layer has them."""
        h, specs = cfg.hidden_size, []
        if self.beside is not None:
            names = ("pre_feedforward_layernorm_2", "post_feedforward_layernorm_1", "post_feedforward_layernorm_2")
            specs += [WeightSpec(w, (whole(f"{prefix}.{n}.weight", (h,)),)) for w, n in zip(self.beside, names)]
        if self.pl_gate is not None:
            w = cfg.per_layer_input.width
            specs.append(WeightSpec(self.pl_gate.weight, (whole(f"{prefix}.per_layer_input_gate.weight", (w, h)),)))
            specs.append(WeightSpec(self.pl_proj.weight, (whole(f"{prefix}.per_layer_projection.weight", (h, w)),)))
            specs.append(WeightSpec(self.pl_norm, (whole(f"{prefix}.post_per_layer_input_norm.weight", (h,)),)))
        if self.scalar is not None:
            specs.append(WeightSpec(self.scalar, (whole(f"{prefix}.layer_scalar", (1,)),)))
        return specs

    def _qkv_sources(self, cfg: ModelConfig, tp: TPLayout, att: str, kind: str) -> tuple:
        """This rank's rows of q, k and v ("weight" or "bias"), stored apart or fused (q alone for a
        layer reading another's KV; q and k where the values are the keys' projection)."""
        h, d = cfg.hidden_size, self.head_dim
        q_full, kv_full = cfg.num_heads * d, cfg.layer_kv_heads(self.index) * d
        shape = (lambda n: (n, h)) if kind == "weight" else (lambda n: (n,))
        if not self.reads_kv or self.v_from_k:
            q = rows(f"{att}.q_proj.{kind}", shape(q_full), tp.head_start * d, self.q_size)
            k = rows(f"{att}.k_proj.{kind}", shape(kv_full), tp.kv_head_start * d, self.kv_size)
            return (q,) if not self.reads_kv else (q, k)
        if cfg.attn_output_gate and kind == "weight":  # q_proj: per head its query's rows, then its gate's
            d2 = 2 * d
            return (
                rows(f"{att}.q_proj.weight", shape(2 * q_full), tp.head_start * d2, 2 * self.q_size),
                rows(f"{att}.k_proj.weight", shape(kv_full), tp.kv_head_start * d, self.kv_size),
                rows(f"{att}.v_proj.weight", shape(kv_full), tp.kv_head_start * d, self.kv_size),
            )
        if cfg.fused_projections:  # q, k and v: rows of one tensor
            name, fused = f"{att}.qkv_proj.{kind}", shape(q_full + 2 * kv_full)
            return (
                rows(name, fused, tp.head_start * d, self.q_size),
                rows(name, fused, q_full + tp.kv_head_start * d, self.kv_size),
                rows(name, fused, q_full + kv_full + tp.kv_head_start * d, self.kv_size),
            )
        return (
            rows(f"{att}.q_proj.{kind}", shape(q_full), tp.head_start * d, self.q_size),
            rows(f"{att}.k_proj.{kind}", shape(kv_full), tp.kv_head_start * d, self.kv_size),
            rows(f"{att}.v_proj.{kind}", shape(kv_full), tp.kv_head_start * d, self.kv_size),
        )

    def _gate_up_sources(self, cfg: ModelConfig, tp: TPLayout, mlp: str, kind: str) -> tuple:
        """This rank's rows of the gate and up projections, stored apart or fused."""
        h, inter, wide = cfg.hidden_size, cfg.intermediate_size, self.wide
        if wide > 1:  # (Gemma 4's wide layers: their own rows, stored apart)
            return tuple(
                rows(f"{mlp}.{n}_proj.{kind}", (wide * inter, h), wide * tp.intermediate_start, wide * tp.intermediate)
                for n in ("gate", "up")
            )
        shape = (inter, h) if kind == "weight" else (inter,)
        if cfg.fused_projections:  # gate then up: rows of one tensor
            name, fused = f"{mlp}.gate_up_proj.{kind}", (2 * inter, *shape[1:])
            return (
                rows(name, fused, tp.intermediate_start, tp.intermediate),
                rows(name, fused, inter + tp.intermediate_start, tp.intermediate),
            )
        return tuple(
            rows(f"{mlp}.{n}_proj.{kind}", shape, tp.intermediate_start, tp.intermediate) for n in ("gate", "up")
        )


class DecoderForCausalLM(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        tp: TPLayout,
        comm,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device,
        stage: StageLayout | None = None,
    ):
        """`stage`: a pipeline stage's layers only (and the ends on the first); None: the whole model."""
        super().__init__()
        if cfg.qk_norm == "projection" and tp.heads != cfg.num_heads:
            raise ValueError(
                f"{cfg.architecture}: its q/k norms span every head, which tensor parallelism splits "
                f"across ranks; run it on one rank per engine (data-parallel groups: --tp 1)"
            )
        self.stage = stage = stage or StageLayout.whole(cfg)
        self.cfg, self.tp, self.comm = cfg, tp, comm
        p = lambda *shape: new_param(*shape, dtype=dtype, device=device)  # noqa: E731
        ends = stage.has_ends
        # this rank's vocabulary block (every stage's where per-layer inputs read the embeddings)
        self.embed = p(tp.vocab, cfg.hidden_size) if ends or cfg.per_layer_input else None
        self.per_layer = PerLayerInputs(cfg, stage.layers, dtype, device) if cfg.per_layer_input else None
        self.windows = tuple(cfg.sliding_windows[n] for n in stage.layers)  # this stage's layers' windows
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, tp, n, cfg.sliding_windows[n], dtype, device) for n in stage.layers
        )
        self.norm = p(cfg.hidden_size) if ends else None
        self.lm_head = Linear(tp.vocab, cfg.hidden_size, False, dtype, device) if ends else None
        # (Gemma 4: the full-attention layers' wider heads, all of each head in the tables)
        wide = dataclasses.replace(cfg, rotary_dim=cfg.global_head_dim) if cfg.global_head_dim else cfg
        self.rotary = Rotary(wide, max_len, dtype, device)
        # sliding-window layers that rotate with a base of their own
        self.local_rotary = Rotary(cfg, max_len, dtype, device, local=True) if cfg.local_rope_theta else None
        # the embeddings' factor: a Python float, or rounded to the model's dtype as the reference rounds it
        self.embed_scale = cfg.embed_scale
        if cfg.embed_scale is not None and cfg.embed_scale_rounded:
            self.embed_scale = torch.tensor(cfg.embed_scale, dtype=dtype, device=device)
        # offset + weight, or the weight, in float32 and rounded once; else the normalised rows rounded first
        if cfg.norm_exact_float32:
            self.norm_fn = float32_rms_norm
        elif cfg.norm_offset:
            self.norm_fn = functools.partial(offset_rms_norm, offset=cfg.norm_offset)
        else:
            self.norm_fn = wide_weight_rms_norm if cfg.norm_float32 else rms_norm
        self.act = activation(cfg.hidden_act)

    def weight_specs(self) -> list[WeightSpec]:
        cfg, tp, h, v = self.cfg, self.tp, self.cfg.hidden_size, self.cfg.vocab_size
        vocab_block = lambda name: (rows(name, (v, h), tp.vocab_start, tp.vocab_real),)  # noqa: E731
        specs = []
        for n, layer in zip(self.stage.layers, self.layers):
            specs += layer.weight_specs(cfg, tp, f"model.layers.{n}")
        if self.per_layer is not None:
            specs += self.per_layer.weight_specs()
            if not self.stage.has_ends:
                specs.append(WeightSpec(self.embed, vocab_block("model.embed_tokens.weight"), pad=True))
        if self.stage.has_ends:
            specs.append(WeightSpec(self.embed, vocab_block("model.embed_tokens.weight"), pad=True))
            specs.append(WeightSpec(self.norm, (whole("model.norm.weight", (h,)),)))
            # Tied embeddings: the LM head is read from the embedding tensor (a second copy, so that it
            # can be packed for the GEMM while the embedding stays a plain lookup table).
            head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
            specs.append(WeightSpec(self.lm_head.weight, vocab_block(head), pad=True))
        return specs

    def forward(self, batch: ForwardBatch, kv: Sequence[torch.Tensor]) -> torch.Tensor:
        """One fused iteration. kv: per layer [2, slots, kv_heads, positions, head_dim] (this rank's
        heads; a sliding-window layer's rows as `batch.window` places them) -> logits [B, vocab
        block of this rank]."""
        return self.head(self.run_layers(self.embed_tokens(batch), batch, kv)[batch.sample_rows])

    def embed_tokens(self, batch: ForwardBatch) -> torch.Tensor:
        """[T] token ids -> [T, hidden] (the first stage)."""
        hidden = vocab_embedding(batch.input_ids, self.embed, self.tp, self.comm)  # [T, hidden]
        if self.embed_scale is not None:
            hidden = hidden * self.embed_scale
        return hidden

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B, hidden] residual rows -> [B, vocab block of this rank] (the first stage)."""
        logits = self.lm_head(self.final_norm(hidden))
        if self.cfg.logit_scale is not None:
            logits = logits / self.cfg.logit_scale
        cap = self.cfg.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B, hidden] residual rows -> the model's last norm of them: what the head reads, and
        what embeddings pool (the native step's float32 rows: normed in float32)."""
        weight = self.norm if hidden.dtype == self.norm.dtype else self.norm.to(hidden.dtype)
        return self.norm_fn(hidden, weight, self.cfg.norm_eps)

    def run_layers(self, hidden: torch.Tensor, batch: ForwardBatch, kv: Sequence[torch.Tensor]) -> torch.Tensor:
        """This stage's layers over the residual rows [T, hidden] -> [T, hidden]. kv: per layer of
        the stage, as forward's."""
        eps, norm = self.cfg.norm_eps, self.norm_fn
        tables = self.rotary.tables(batch.positions)  # the same positions in every layer
        local_tables = self.local_rotary.tables(batch.positions) if self.local_rotary is not None else None
        # (Gemma 4) [T, stage layers, width]: each layer's own input, from the tokens and their embeddings
        # (the first stage is given those embeddings; a later one looks them up itself)
        per_layer = None
        if self.per_layer is not None:
            embedded = hidden if self.stage.has_ends else self.embed_tokens(batch)
            per_layer = self.per_layer(batch.input_ids, embedded)
        for n, layer in enumerate(self.layers):
            x = hidden if layer.input_norm is None else norm(hidden, layer.input_norm, eps)
            if layer.linear is not None:  # (Qwen3.5) kv[n]: the layer's (conv, recurrent) state
                out = all_reduce(layer.linear(x, batch, kv[n]), self.comm)
            else:
                out = self._attention(layer, x, batch, kv[n], local_tables if layer.local_rope else tables)
            if layer.attn_norm_after is not None:  # (four norms) normed, added, then normed again for the MLP
                hidden = self._add(hidden, norm(out, layer.attn_norm_after, eps))
                x = norm(hidden, layer.post_norm, eps)
            elif layer.input_norm is None:  # (norms after only) normed, then added; the MLP reads the sum as it is
                hidden = self._add(hidden, norm(out, layer.post_norm, eps))
                x = hidden
            else:
                hidden = self._add(hidden, out)
                x = norm(hidden, layer.post_norm, eps)
            out = self._mlp(layer, x, hidden)
            hidden = self._add(hidden, out if layer.ffn_norm_after is None else norm(out, layer.ffn_norm_after, eps))
            if per_layer is not None:  # gelu(gate(h)) times the layer's input, projected back, normed, added
                gated = self.act(layer.pl_gate(hidden)) * per_layer[:, n]  # [T, width]
                hidden = hidden + norm(layer.pl_proj(gated), layer.pl_norm, eps)
            if layer.scalar is not None:
                hidden = hidden * layer.scalar
        return hidden

    def _add(self, hidden: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The residual add of a block's output [T, hidden] (times the residual scale, if any)."""
        scale = self.cfg.residual_scale
        return hidden + (out if scale is None else out * scale)

    def _attention(
        self, layer: DecoderLayer, x: torch.Tensor, batch: ForwardBatch, kv: torch.Tensor, tables: tuple
    ) -> torch.Tensor:
        """Attention over the normed rows x [T, hidden] -> its output [T, hidden] (all-reduced, o's
        bias added); this row's keys and values written to kv ([2, slots, kv_heads, positions, head_dim])."""
        cfg, tp, norm, d = self.cfg, layer.tp, self.norm_fn, layer.head_dim
        tokens = x.shape[0]
        qk_heads = tp.heads + (tp.kv_heads if layer.reads_kv else 0)
        qkv = layer.qkv(x)  # [T, q + 2 kv]; with an output gate [T, (q + gate) + 2 kv]; [T, q] reading another's KV
        gate = None
        if layer.gate_size:  # per head [query, gate]: the queries to the front, the gates apart
            q_gate = qkv[:, : 2 * layer.q_size].view(tokens, tp.heads, 2, d)
            gate = q_gate[:, :, 1].reshape(tokens, layer.q_size)
            qkv = torch.cat((q_gate[:, :, 0].reshape(tokens, layer.q_size), qkv[:, 2 * layer.q_size :]), dim=1)
        kv_width = layer.kv_size if layer.reads_kv else 0
        qk = qkv[:, : layer.q_size + kv_width].view(tokens, qk_heads, d)
        # (Gemma 4) values that are the keys' projection: taken before the keys' norm and RoPE
        v = qkv[:, layer.q_size : layer.q_size + kv_width] if layer.v_from_k else qkv[:, layer.q_size + kv_width :]
        if cfg.qk_norm == "head":  # [T, heads, head_dim] and [T, kv_heads, head_dim], each head alone
            q_normed = norm(qk[:, : tp.heads], layer.q_norm, cfg.norm_eps)
            k_normed = norm(qk[:, tp.heads :], layer.k_norm, cfg.norm_eps) if layer.reads_kv else qk[:, tp.heads :]
            qk = torch.cat((q_normed, k_normed), dim=1)
        elif cfg.qk_norm == "projection":  # [T, heads * head_dim] and [T, kv_heads * head_dim], each whole
            q_flat, k_flat = qk.flatten(1).split((layer.q_size, layer.kv_size), dim=1)
            qk = torch.cat(
                (norm(q_flat, layer.q_norm, cfg.norm_eps), norm(k_flat, layer.k_norm, cfg.norm_eps)), dim=1
            ).view(tokens, qk_heads, d)
        if layer.rope:  # q and k rotated together: [T, heads + kv_heads, head_dim]
            qk = (self.local_rotary if layer.local_rope else self.rotary)(qk, batch.positions, tables)
        q, k = qk[:, : tp.heads], qk[:, tp.heads :]
        rows = batch.window if batch.window is not None and layer.attn_opts.window is not None else batch
        if layer.reads_kv:  # (else an earlier layer wrote this iteration's keys and values already)
            v = v.view(tokens, tp.kv_heads, d)
            write_kv(kv[0], kv[1], k, float32_rms_norm(v, None, cfg.norm_eps) if cfg.v_norm else v, rows)
        attn = attention(q, kv[0], kv[1], rows, layer.attn_opts)  # [T, heads * head_dim]
        if gate is not None:
            attn = attn * torch.sigmoid(gate)
        out = all_reduce(layer.o(attn), self.comm)  # [T, hidden]
        return out if layer.o_bias is None else out + layer.o_bias

    def _mlp(self, layer: DecoderLayer, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The MLP (or the experts) over the normed x [T, hidden] -> [T, hidden] (all-reduced,
        down's bias added). (Gemma 4) Experts beside the MLP: the router reads the residual rows, the
        experts their own norm of it; each output normed, the two added."""
        if layer.experts is not None and layer.beside is None:  # this rank's columns of each chosen expert
            out = all_reduce(layer.experts(x), self.comm)
        else:
            gate, up = layer.gate_up(x).chunk(2, dim=-1)  # [T, intermediate / ranks] each
            out = all_reduce(layer.down(self.act(gate) * up), self.comm)
        if layer.beside is not None:
            eps, (before, after_mlp, after_experts) = self.cfg.norm_eps, layer.beside
            experts = all_reduce(layer.experts(self.norm_fn(residual, before, eps), route_input=residual), self.comm)
            out = self.norm_fn(out, after_mlp, eps) + self.norm_fn(experts, after_experts, eps)
        return out if layer.down_bias is None else out + layer.down_bias
