"""The Llama family: Llama, Mistral, Qwen2 (GQA, RoPE, optional QKV/MLP biases, sliding window)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flover.models.attention import AttentionOptions, ForwardBatch, attention, write_kv
from flover.models.config import ModelConfig
from flover.models.layers import Linear, Rotary, activation, new_param, rms_norm
from flover.models.loader import Source, WeightSpec


class LlamaLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, window: int | None, dtype: torch.dtype, device: torch.device):
        super().__init__()
        h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
        self.q_size, self.kv_size = cfg.num_heads * d, cfg.num_kv_heads * d
        p = lambda *shape: new_param(*shape, dtype=dtype, device=device)  # noqa: E731
        self.input_norm = p(h)
        lin = lambda out, inp, bias: Linear(out, inp, bias, dtype, device)  # noqa: E731
        self.qkv = lin(self.q_size + 2 * self.kv_size, h, cfg.qkv_bias)  # q, k, v fused: one GEMM
        self.o = lin(h, self.q_size, cfg.o_bias)
        self.post_norm = p(h)
        self.gate_up = lin(2 * i, h, cfg.mlp_bias)  # gate and up projections fused
        self.down = lin(h, i, cfg.mlp_bias)
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
            WeightSpec(self.qkv.weight, qkv("weight"), shard_dim=0),
            WeightSpec(self.o.weight, (Source(f"{att}.o_proj.weight", (h, self.q_size)),), shard_dim=1),
            WeightSpec(self.post_norm, (Source(f"{prefix}.post_attention_layernorm.weight", (h,)),)),
            WeightSpec(self.gate_up.weight, (Source(f"{mlp}.gate_proj.weight", (i, h)),
                                             Source(f"{mlp}.up_proj.weight", (i, h))), shard_dim=0),
            WeightSpec(self.down.weight, (Source(f"{mlp}.down_proj.weight", (h, i)),), shard_dim=1),
        ]
        if self.qkv.bias is not None:
            specs.append(WeightSpec(self.qkv.bias, qkv("bias"), shard_dim=0))
        if self.o.bias is not None:
            specs.append(WeightSpec(self.o.bias, (Source(f"{att}.o_proj.bias", (h,)),)))
        if self.gate_up.bias is not None:
            specs.append(WeightSpec(self.gate_up.bias, (Source(f"{mlp}.gate_proj.bias", (i,)),
                                                        Source(f"{mlp}.up_proj.bias", (i,))), shard_dim=0))
            specs.append(WeightSpec(self.down.bias, (Source(f"{mlp}.down_proj.bias", (h,)),)))
        return specs


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_len: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.cfg = cfg
        p = lambda *shape: new_param(*shape, dtype=dtype, device=device)  # noqa: E731
        self.embed = p(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaLayer(cfg, w, dtype, device) for w in cfg.sliding_windows)
        self.norm = p(cfg.hidden_size)
        self.lm_head = Linear(cfg.vocab_size, cfg.hidden_size, False, dtype, device)
        self.rotary = Rotary(cfg, max_len, dtype, device)
        self.act = activation(cfg.hidden_act)

    def weight_specs(self) -> list[WeightSpec]:
        cfg, h, v = self.cfg, self.cfg.hidden_size, self.cfg.vocab_size
        specs = [WeightSpec(self.embed, (Source("model.embed_tokens.weight", (v, h)),), shard_dim=0),
                 WeightSpec(self.norm, (Source("model.norm.weight", (h,)),))]
        for n, layer in enumerate(self.layers):
            specs += layer.weight_specs(cfg, f"model.layers.{n}")
        # Tied embeddings: the LM head is read from the embedding tensor (a second copy, so that it
        # can be packed for the GEMM while the embedding stays a plain lookup table).
        head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        specs.append(WeightSpec(self.lm_head.weight, (Source(head, (v, h)),), shard_dim=0))
        return specs

    def forward(self, batch: ForwardBatch, kv: torch.Tensor) -> torch.Tensor:
        """One fused iteration. kv: [layers, 2, slots, kv_heads, seq, head_dim] -> logits [B, vocab]."""
        cfg = self.cfg
        tokens = batch.input_ids.shape[0]
        hidden = F.embedding(batch.input_ids, self.embed)  # [T, hidden]
        for n, layer in enumerate(self.layers):
            x = rms_norm(hidden, layer.input_norm, cfg.norm_eps)
            qkv = layer.qkv(x)  # [T, q + 2 kv]
            q, k, v = qkv.split([layer.q_size, layer.kv_size, layer.kv_size], dim=-1)
            q = self.rotary(q.view(tokens, cfg.num_heads, cfg.head_dim), batch.positions)
            k = self.rotary(k.view(tokens, cfg.num_kv_heads, cfg.head_dim), batch.positions)
            write_kv(kv[n, 0], kv[n, 1], k, v.view(tokens, cfg.num_kv_heads, cfg.head_dim), batch)
            attn = attention(q, kv[n, 0], kv[n, 1], batch, layer.attn_opts)  # [T, heads * head_dim]
            hidden = hidden + layer.o(attn)
            x = rms_norm(hidden, layer.post_norm, cfg.norm_eps)
            gate, up = layer.gate_up(x).chunk(2, dim=-1)  # [T, inter] each
            hidden = hidden + layer.down(self.act(gate) * up)
        last = rms_norm(hidden[batch.sample_rows], self.norm, cfg.norm_eps)  # [B, hidden]
        return self.lm_head(last)  # [B, vocab]
