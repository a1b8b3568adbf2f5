"""The Llama family: Llama, Mistral, Qwen2, Qwen3, SmolLM3, OLMo 2, Phi-3, Gemma 3, and the
mixtures of experts Qwen3-MoE, Mixtral and gpt-oss (models/moe.py; gpt-oss's attention sinks)
(GQA, RoPE, optional QKV/MLP biases, sliding window; Qwen3's RMSNorm over each head of q and k;
SmolLM3's layers without RoPE; OLMo 2's norms after attention and the MLP instead of before, and
q/k norms over each whole projection).

Tensor parallelism (Megatron): QKV and gate/up are split by output columns, attention-out and
down by input rows followed by one all-reduce each; biases of the row-parallel projections are
added once, after the all-reduce; embedding and LM head are split by vocabulary.
A pipeline stage (models/stage_layout.py) holds its range of layers; the first stage also the
embedding, final norm and LM head (`embed_tokens`, `run_layers` and `head`: the forward in three parts).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from flover.models.attention import AttentionOptions, ForwardBatch, attention, write_kv
from flover.models.layers import (
    Linear,
    Rotary,
    activation,
    all_reduce,
    cols,
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
from flover.models.safetensors_reader import WeightSpec
from flover.models.stage_layout import StageLayout
from flover.models.tp_layout import TPLayout


class LlamaLayer(nn.Module):
    def __init__(
        self, cfg: ModelConfig, tp: TPLayout, index: int, window: int | None, dtype: torch.dtype, device: torch.device
    ):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_size, self.kv_size = tp.heads * d, tp.kv_heads * d
        p = lambda *shape: new_param(*shape, dtype=dtype, device=device)  # noqa: E731
        lin = lambda out, inp, bias: Linear(out, inp, bias, dtype, device)  # noqa: E731
        self.input_norm = None if cfg.norm_after else p(h)  # (OLMo 2: no norm before attention or the MLP)
        self.qkv = lin(self.q_size + 2 * self.kv_size, h, cfg.qkv_bias)  # q, k, v fused: one GEMM
        # before RoPE: per head (Qwen3), or over the whole of q and of k (OLMo 2)
        norm_sizes = {"head": (d, d), "projection": (self.q_size, self.kv_size)}.get(cfg.qk_norm)
        self.q_norm, self.k_norm = (p(norm_sizes[0]), p(norm_sizes[1])) if norm_sizes else (None, None)
        self.rope = index not in cfg.nope_layers  # (SmolLM3's NoPE layers: positions only through the causal mask)
        self.local_rope = cfg.local_rope_theta is not None and window is not None  # (Gemma 3's own base)
        self.o = lin(h, self.q_size, False)
        self.o_bias = p(h) if cfg.o_bias else None
        self.post_norm = p(h)  # before the MLP; OLMo 2: after attention, before the residual add
        self.attn_norm_after = p(h) if cfg.gemma else None  # Gemma 3: after attention too, before the add
        self.ffn_norm_after = p(h) if cfg.norm_after or cfg.gemma else None  # after the MLP, before the add
        # (Qwen3-MoE, Mixtral, gpt-oss) experts in place of the dense MLP, which such a layer then has not
        moe = cfg.moe is not None and index in cfg.moe.layers
        self.experts = ExpertsMLP(cfg.moe, h, activation(cfg.hidden_act), tp, dtype, device) if moe else None
        self.gate_up = None if moe else lin(2 * tp.intermediate, h, cfg.mlp_bias)  # gate and up fused
        self.down = None if moe else lin(h, tp.intermediate, False)
        self.down_bias = p(h) if cfg.mlp_bias else None
        self.sinks = p(tp.heads) if cfg.attn_sinks else None  # (gpt-oss) this rank's heads' sink logits
        self.attn_opts = AttentionOptions(
            sinks=self.sinks,
            window=window,
            decode_in_float32=dtype in (torch.bfloat16, torch.float16) and torch.device(device).type == "cpu",
            scale=cfg.attn_scale,
        )

    def weight_specs(self, cfg: ModelConfig, tp: TPLayout, prefix: str) -> list[WeightSpec]:
        h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
        att, mlp = f"{prefix}.self_attn", f"{prefix}.mlp"
        q_full, kv_full = cfg.num_heads * d, cfg.num_kv_heads * d

        def qkv(kind: str) -> tuple:
            shape = (lambda n: (n, h)) if kind == "weight" else (lambda n: (n,))
            if cfg.fused_projections:  # (Phi-3) q, k and v: rows of one tensor
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

        def gate_up(kind: str) -> tuple:
            shape = (inter, h) if kind == "weight" else (inter,)
            if cfg.fused_projections:  # (Phi-3) gate then up: rows of one tensor
                name, fused = f"{mlp}.gate_up_proj.{kind}", (2 * inter, *shape[1:])
                return (
                    rows(name, fused, tp.intermediate_start, tp.intermediate),
                    rows(name, fused, inter + tp.intermediate_start, tp.intermediate),
                )
            return tuple(
                rows(f"{mlp}.{n}_proj.{kind}", shape, tp.intermediate_start, tp.intermediate) for n in ("gate", "up")
            )

        specs = [
            WeightSpec(self.qkv.weight, qkv("weight")),
            WeightSpec(self.o.weight, (cols(f"{att}.o_proj.weight", (h, q_full), tp.head_start * d, self.q_size),)),
            WeightSpec(
                self.post_norm,
                (whole(f"{prefix}.{'pre_feedforward' if cfg.gemma else 'post_attention'}_layernorm.weight", (h,)),),
            ),
        ]
        if self.experts is not None:
            specs += self.experts.weight_specs(prefix, h)
        else:
            specs.append(WeightSpec(self.gate_up.weight, gate_up("weight")))
            specs.append(
                WeightSpec(
                    self.down.weight,
                    (cols(f"{mlp}.down_proj.weight", (h, inter), tp.intermediate_start, tp.intermediate),),
                )
            )
        if self.input_norm is not None:
            specs.append(WeightSpec(self.input_norm, (whole(f"{prefix}.input_layernorm.weight", (h,)),)))
        if self.attn_norm_after is not None:
            specs.append(WeightSpec(self.attn_norm_after, (whole(f"{prefix}.post_attention_layernorm.weight", (h,)),)))
        if self.ffn_norm_after is not None:
            specs.append(WeightSpec(self.ffn_norm_after, (whole(f"{prefix}.post_feedforward_layernorm.weight", (h,)),)))
        if self.qkv.bias is not None:
            specs.append(WeightSpec(self.qkv.bias, qkv("bias")))
        if self.q_norm is not None:  # (whole: under TP the projection norm is refused, the per-head one replicated)
            specs.append(WeightSpec(self.q_norm, (whole(f"{att}.q_norm.weight", tuple(self.q_norm.shape)),)))
            specs.append(WeightSpec(self.k_norm, (whole(f"{att}.k_norm.weight", tuple(self.k_norm.shape)),)))
        if self.o_bias is not None:
            specs.append(WeightSpec(self.o_bias, (whole(f"{att}.o_proj.bias", (h,)),)))
        if self.sinks is not None:
            specs.append(WeightSpec(self.sinks, (rows(f"{att}.sinks", (cfg.num_heads,), tp.head_start, tp.heads),)))
        if self.gate_up is not None and self.gate_up.bias is not None:
            specs.append(WeightSpec(self.gate_up.bias, gate_up("bias")))
            specs.append(WeightSpec(self.down_bias, (whole(f"{mlp}.down_proj.bias", (h,)),)))
        return specs


class LlamaForCausalLM(nn.Module):
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
        self.embed = p(tp.vocab, cfg.hidden_size) if ends else None  # this rank's vocabulary block
        self.windows = tuple(cfg.sliding_windows[n] for n in stage.layers)  # this stage's layers' windows
        self.layers = nn.ModuleList(LlamaLayer(cfg, tp, n, cfg.sliding_windows[n], dtype, device) for n in stage.layers)
        self.norm = p(cfg.hidden_size) if ends else None
        self.lm_head = Linear(tp.vocab, cfg.hidden_size, False, dtype, device) if ends else None
        self.rotary = Rotary(cfg, max_len, dtype, device)
        # Gemma 3's sliding-window layers rotate with a base of their own
        self.local_rotary = Rotary(cfg, max_len, dtype, device, local=True) if cfg.local_rope_theta else None
        # Gemma 3's embeddings are scaled by sqrt(hidden), that factor rounded as transformers' (float32, then dtype)
        self.embed_scale = torch.tensor(cfg.hidden_size**0.5).to(device=device, dtype=dtype) if cfg.gemma else None
        # Gemma 3: (1 + weight), OLMo 2: the weight, each in float32 and rounded once; else rounded twice
        self.norm_fn = offset_rms_norm if cfg.gemma else wide_weight_rms_norm if cfg.norm_after else rms_norm
        self.act = activation(cfg.hidden_act)

    def weight_specs(self) -> list[WeightSpec]:
        cfg, tp, h, v = self.cfg, self.tp, self.cfg.hidden_size, self.cfg.vocab_size
        vocab_block = lambda name: (rows(name, (v, h), tp.vocab_start, tp.vocab_real),)  # noqa: E731
        specs = []
        for n, layer in zip(self.stage.layers, self.layers):
            specs += layer.weight_specs(cfg, tp, f"model.layers.{n}")
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
        if self.embed_scale is not None:  # (Gemma 3)
            hidden = hidden * self.embed_scale
        return hidden

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B, hidden] residual rows -> [B, vocab block of this rank] (the first stage)."""
        return self.lm_head(self.norm_fn(hidden, self.norm, self.cfg.norm_eps))

    def run_layers(self, hidden: torch.Tensor, batch: ForwardBatch, kv: Sequence[torch.Tensor]) -> torch.Tensor:
        """This stage's layers over the residual rows [T, hidden] -> [T, hidden]. kv: per layer of
        the stage, as forward's."""
        cfg, tp, comm = self.cfg, self.tp, self.comm
        tokens = batch.input_ids.shape[0]
        tables = self.rotary.tables(batch.positions)  # the same positions in every layer
        local_tables = self.local_rotary.tables(batch.positions) if self.local_rotary is not None else None
        norm = self.norm_fn
        qk_heads = tp.heads + tp.kv_heads
        for n, layer in enumerate(self.layers):
            x = hidden if layer.input_norm is None else norm(hidden, layer.input_norm, cfg.norm_eps)
            qkv = layer.qkv(x)  # [T, q + 2 kv]
            qk = qkv[:, : layer.q_size + layer.kv_size].view(tokens, qk_heads, cfg.head_dim)
            if cfg.qk_norm == "head":  # [T, heads, head_dim] and [T, kv_heads, head_dim], each head alone
                qk = torch.cat(
                    (
                        norm(qk[:, : tp.heads], layer.q_norm, cfg.norm_eps),
                        norm(qk[:, tp.heads :], layer.k_norm, cfg.norm_eps),
                    ),
                    dim=1,
                )
            elif cfg.qk_norm == "projection":  # [T, heads * head_dim] and [T, kv_heads * head_dim], each whole
                q_flat, k_flat = qk.flatten(1).split((layer.q_size, layer.kv_size), dim=1)
                qk = torch.cat(
                    (norm(q_flat, layer.q_norm, cfg.norm_eps), norm(k_flat, layer.k_norm, cfg.norm_eps)), dim=1
                ).view(tokens, qk_heads, cfg.head_dim)
            if layer.rope and layer.local_rope:
                qk = self.local_rotary(qk, batch.positions, local_tables)
            elif layer.rope:  # q and k rotated together: [T, heads + kv_heads, head_dim]
                qk = self.rotary(qk, batch.positions, tables)
            q, k = qk[:, : tp.heads], qk[:, tp.heads :]
            v = qkv[:, layer.q_size + layer.kv_size :]
            rows = batch.window if batch.window is not None and layer.attn_opts.window is not None else batch
            write_kv(kv[n][0], kv[n][1], k, v.view(tokens, tp.kv_heads, cfg.head_dim), rows)
            attn = attention(q, kv[n][0], kv[n][1], rows, layer.attn_opts)  # [T, heads * head_dim]
            out = all_reduce(layer.o(attn), comm)  # [T, hidden]
            out = out if layer.o_bias is None else out + layer.o_bias
            if layer.attn_norm_after is not None:  # Gemma 3: normed, added, then normed again for the MLP
                hidden = hidden + norm(out, layer.attn_norm_after, cfg.norm_eps)
                x = norm(hidden, layer.post_norm, cfg.norm_eps)
            elif cfg.norm_after:  # OLMo 2: normed, then added; the MLP reads the sum as it is
                hidden = hidden + norm(out, layer.post_norm, cfg.norm_eps)
                x = hidden
            else:
                hidden = hidden + out
                x = norm(hidden, layer.post_norm, cfg.norm_eps)
            if layer.experts is not None:  # (mixtures of experts) this rank's columns of each chosen expert
                out = all_reduce(layer.experts(x), comm)
            else:
                gate, up = layer.gate_up(x).chunk(2, dim=-1)  # [T, intermediate / ranks] each
                out = all_reduce(layer.down(self.act(gate) * up), comm)
            out = out if layer.down_bias is None else out + layer.down_bias
            hidden = hidden + (out if layer.ffn_norm_after is None else norm(out, layer.ffn_norm_after, cfg.norm_eps))
        return hidden
