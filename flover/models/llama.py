"""The Llama family: Llama, Mistral, Qwen2 (GQA, RoPE, optional QKV/MLP biases, sliding window)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flover.models.attention import AttentionOptions, ForwardBatch, attention, write_kv
from flover.models.config import ModelConfig
from flover.models.layers import Rotary, activation, new_param, rms_norm
from flover.models.loader import Source, WeightSpec


class LlamaLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, window: int | None, dtype: torch.dtype, device: torch.device):
        super().__init__()
        h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
        self.q_size, self.kv_size = cfg.num_heads * d, cfg.num_kv_heads * d
        p = lambda *shape: new_param(*shape, dtype=dtype, device=device)  # noqa: E731
        self.input_norm = p(h)
        self.qkv = p(self.q_size + 2 * self.kv_size, h)  # q, k and v projections fused: one GEMM
        self.qkv_bias = p(self.q_size + 2 * self.kv_size) if cfg.qkv_bias else None
        self.o = p(h, self.q_size)
        self.o_bias = p(h) if cfg.o_bias else None
        self.post_norm = p(h)
        self.gate_up = p(2 * i, h)  # gate and up projections fused
        self.gate_up_bias = p(2 * i) if cfg.mlp_bias else None
        self.down = p(h, i)
        self.down_bias = p(h) if cfg.mlp_bias else None
        self.attn_opts = AttentionOptions(window=window)

    def weight_specs(self, cfg: ModelConfig, prefix: str) -> list[WeightSpec]:
        h, i = cfg.hidden_size, cfg.intermediate_size
        att, mlp = f"{prefix}.self_attn", f"{prefix}.mlp"
        def qkv(kind: str) -> tuple[Source, ...]:
            shape = (lambda rows: (rows, h)) if kind == "weight" else (lambda rows: (rows,))
            sizes = (("q", self.q_size), ("k", self.kv_size), ("v", self.kv_size))
            return tuple(Source(f"{att}.{name}_proj.{kind}", shape(rows)) for name, rows in sizes)

        specs = [
            WeightSpec(self.input_norm, (Source(f"{prefix}.input_layernorm.weight", (h,)),)),
            WeightSpec(self.qkv, qkv("weight"), shard_dim=0),
            WeightSpec(self.o, (Source(f"{att}.o_proj.weight", (h, self.q_size)),), shard_dim=1),
            WeightSpec(self.post_norm, (Source(f"{prefix}.post_attention_layernorm.weight", (h,)),)),
            WeightSpec(self.gate_up, (Source(f"{mlp}.gate_proj.weight", (i, h)),
                                      Source(f"{mlp}.up_proj.weight", (i, h))), shard_dim=0),
            WeightSpec(self.down, (Source(f"{mlp}.down_proj.weight", (h, i)),), shard_dim=1),
        ]
        if self.qkv_bias is not None:
            specs.append(WeightSpec(self.qkv_bias, qkv("bias"), shard_dim=0))
        if self.o_bias is not None:
            specs.append(WeightSpec(self.o_bias, (Source(f"{att}.o_proj.bias", (h,)),)))
        if self.gate_up_bias is not None:
            specs.append(WeightSpec(self.gate_up_bias, (Source(f"{mlp}.gate_proj.bias", (i,)),
                                                        Source(f"{mlp}.up_proj.bias", (i,))), shard_dim=0))
            specs.append(WeightSpec(self.down_bias, (Source(f"{mlp}.down_proj.bias", (h,)),)))
        return specs


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_len: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.cfg = cfg
        p = lambda *shape: new_param(*shape, dtype=dtype, device=device)  # noqa: E731
        self.embed = p(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaLayer(cfg, w, dtype, device) for w in cfg.sliding_windows)
        self.norm = p(cfg.hidden_size)
        self.lm_head = self.embed if cfg.tie_word_embeddings else p(cfg.vocab_size, cfg.hidden_size)
        self.rotary = Rotary(cfg, max_len, dtype, device)
        self.act = activation(cfg.hidden_act)

    def weight_specs(self) -> list[WeightSpec]:
        cfg, h, v = self.cfg, self.cfg.hidden_size, self.cfg.vocab_size
        specs = [WeightSpec(self.embed, (Source("model.embed_tokens.weight", (v, h)),), shard_dim=0),
                 WeightSpec(self.norm, (Source("model.norm.weight", (h,)),))]
        for n, layer in enumerate(self.layers):
            specs += layer.weight_specs(cfg, f"model.layers.{n}")
        if not cfg.tie_word_embeddings:
            specs.append(WeightSpec(self.lm_head, (Source("lm_head.weight", (v, h)),), shard_dim=0))
        return specs

    def forward(self, batch: ForwardBatch, kv: torch.Tensor) -> torch.Tensor:
        """One fused iteration. kv: [layers, 2, slots, kv_heads, seq, head_dim] -> logits [B, vocab]."""
        cfg = self.cfg
        tokens = batch.input_ids.shape[0]
        hidden = F.embedding(batch.input_ids, self.embed)  # [T, hidden]
        for n, layer in enumerate(self.layers):
            x = rms_norm(hidden, layer.input_norm, cfg.norm_eps)
            qkv = F.linear(x, layer.qkv, layer.qkv_bias)  # [T, q + 2 kv]
            q, k, v = qkv.split([layer.q_size, layer.kv_size, layer.kv_size], dim=-1)
            q = self.rotary(q.view(tokens, cfg.num_heads, cfg.head_dim), batch.positions)
            k = self.rotary(k.view(tokens, cfg.num_kv_heads, cfg.head_dim), batch.positions)
            write_kv(kv[n, 0], kv[n, 1], k, v.view(tokens, cfg.num_kv_heads, cfg.head_dim), batch)
            attn = attention(q, kv[n, 0], kv[n, 1], batch, layer.attn_opts)  # [T, heads * head_dim]
            hidden = hidden + F.linear(attn, layer.o, layer.o_bias)
            x = rms_norm(hidden, layer.post_norm, cfg.norm_eps)
            gate, up = F.linear(x, layer.gate_up, layer.gate_up_bias).chunk(2, dim=-1)  # [T, inter] each
            hidden = hidden + F.linear(self.act(gate) * up, layer.down, layer.down_bias)
        last = rms_norm(hidden[batch.sample_rows], self.norm, cfg.norm_eps)  # [B, hidden]
        return F.linear(last, self.lm_head)  # [B, vocab]
