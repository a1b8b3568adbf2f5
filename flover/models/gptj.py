"""GPT-J (the Flover paper's model): parallel attention + MLP after one LayerNorm, partial
interleaved rotary, biased MLP and LM head. Attention scores in float32, as in transformers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flover.models.attention import AttentionOptions, ForwardBatch, attention, write_kv
from flover.models.config import ModelConfig
from flover.models.layers import Linear, Rotary, activation, new_param
from flover.models.loader import Source, WeightSpec


class GPTJLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        p = lambda *shape: new_param(*shape, dtype=dtype, device=device)  # noqa: E731
        self.ln_weight, self.ln_bias = p(h), p(h)
        self.qkv = Linear(3 * h, h, False, dtype, device)  # q, k, v fused: one GEMM
        self.out = Linear(h, h, False, dtype, device)
        self.fc_in = Linear(i, h, True, dtype, device)
        self.fc_out = Linear(h, i, True, dtype, device)

    def weight_specs(self, cfg: ModelConfig, prefix: str) -> list[WeightSpec]:
        h, i = cfg.hidden_size, cfg.intermediate_size
        one = lambda param, name, shape, dim=None: WeightSpec(param, (Source(f"{prefix}.{name}", shape),), dim)  # noqa: E731
        return [
            one(self.ln_weight, "ln_1.weight", (h,)),
            one(self.ln_bias, "ln_1.bias", (h,)),
            WeightSpec(self.qkv.weight, tuple(Source(f"{prefix}.attn.{n}_proj.weight", (h, h)) for n in "qkv"),
                       shard_dim=0),
            one(self.out.weight, "attn.out_proj.weight", (h, h), 1),
            one(self.fc_in.weight, "mlp.fc_in.weight", (i, h), 0),
            one(self.fc_in.bias, "mlp.fc_in.bias", (i,), 0),
            one(self.fc_out.weight, "mlp.fc_out.weight", (h, i), 1),
            one(self.fc_out.bias, "mlp.fc_out.bias", (h,)),
        ]


class GPTJForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_len: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.cfg = cfg
        h, v = cfg.hidden_size, cfg.vocab_size
        p = lambda *shape: new_param(*shape, dtype=dtype, device=device)  # noqa: E731
        self.embed = p(v, h)
        self.layers = nn.ModuleList(GPTJLayer(cfg, dtype, device) for _ in range(cfg.num_layers))
        self.ln_f_weight, self.ln_f_bias = p(h), p(h)
        self.lm_head = Linear(v, h, True, dtype, device)
        self.rotary = Rotary(cfg, max_len, dtype, device)
        self.act = activation(cfg.hidden_act)
        self.attn_opts = AttentionOptions(scores_dtype=torch.float32)

    def weight_specs(self) -> list[WeightSpec]:
        cfg, h, v = self.cfg, self.cfg.hidden_size, self.cfg.vocab_size
        specs = [
            WeightSpec(self.embed, (Source("transformer.wte.weight", (v, h)),), shard_dim=0),
            WeightSpec(self.ln_f_weight, (Source("transformer.ln_f.weight", (h,)),)),
            WeightSpec(self.ln_f_bias, (Source("transformer.ln_f.bias", (h,)),)),
            WeightSpec(self.lm_head.bias, (Source("lm_head.bias", (v,)),), shard_dim=0),
        ]
        for n, layer in enumerate(self.layers):
            specs += layer.weight_specs(cfg, f"transformer.h.{n}")
        head = "transformer.wte.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        specs.append(WeightSpec(self.lm_head.weight, (Source(head, (v, h)),), shard_dim=0))
        return specs

    def forward(self, batch: ForwardBatch, kv: torch.Tensor) -> torch.Tensor:
        """One fused iteration. kv: [layers, 2, slots, heads, seq, head_dim] -> logits [B, vocab]."""
        cfg = self.cfg
        tokens, h = batch.input_ids.shape[0], cfg.hidden_size
        hidden = F.embedding(batch.input_ids, self.embed)  # [T, hidden]
        for n, layer in enumerate(self.layers):
            x = F.layer_norm(hidden, (h,), layer.ln_weight, layer.ln_bias, cfg.norm_eps)
            q, k, v = layer.qkv(x).view(tokens, 3, cfg.num_heads, cfg.head_dim).unbind(1)
            q, k = self.rotary(q, batch.positions), self.rotary(k, batch.positions)
            write_kv(kv[n, 0], kv[n, 1], k, v, batch)
            attn = layer.out(attention(q, kv[n, 0], kv[n, 1], batch, self.attn_opts))
            mlp = layer.fc_out(self.act(layer.fc_in(x)))
            hidden = attn + mlp + hidden  # parallel block, summed in transformers' order
        last = F.layer_norm(hidden[batch.sample_rows], (h,), self.ln_f_weight, self.ln_f_bias, cfg.norm_eps)
        return self.lm_head(last)  # [B, vocab]
