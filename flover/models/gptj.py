"""GPT-J (the Flover paper's model): parallel attention + MLP after one LayerNorm, partial
interleaved rotary, biased MLP and LM head. Attention scores in float32, as in transformers.

Tensor parallelism needs a single all-reduce per layer: the attention-out and MLP-out partial
sums are added on each rank first, reduced once, then the MLP bias and the residual are added.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from flover.models.attention import AttentionOptions, ForwardBatch, attention, write_kv
from flover.models.layers import Linear, Rotary, activation, all_reduce, cols, new_param, rows, vocab_embedding, whole
from flover.models.model_config import ModelConfig
from flover.models.safetensors_reader import WeightSpec
from flover.models.tp_layout import TPLayout


class GPTJLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPLayout, dtype: torch.dtype, device: torch.device):
        super().__init__()
        h, local = cfg.hidden_size, tp.heads * cfg.head_dim
        p = lambda *shape: new_param(*shape, dtype=dtype, device=device)  # noqa: E731
        self.ln_weight, self.ln_bias = p(h), p(h)
        self.qkv = Linear(3 * local, h, False, dtype, device)  # q, k, v fused: one GEMM
        self.out = Linear(h, local, False, dtype, device)
        self.fc_in = Linear(tp.intermediate, h, True, dtype, device)
        self.fc_out = Linear(h, tp.intermediate, False, dtype, device)
        self.fc_out_bias = p(h)

    def weight_specs(self, cfg: ModelConfig, tp: TPLayout, prefix: str) -> list[WeightSpec]:
        h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
        start, count = tp.head_start * d, tp.heads * d
        return [
            WeightSpec(self.ln_weight, (whole(f"{prefix}.ln_1.weight", (h,)),)),
            WeightSpec(self.ln_bias, (whole(f"{prefix}.ln_1.bias", (h,)),)),
            WeightSpec(
                self.qkv.weight, tuple(rows(f"{prefix}.attn.{n}_proj.weight", (h, h), start, count) for n in "qkv")
            ),
            WeightSpec(self.out.weight, (cols(f"{prefix}.attn.out_proj.weight", (h, h), start, count),)),
            WeightSpec(
                self.fc_in.weight, (rows(f"{prefix}.mlp.fc_in.weight", (i, h), tp.intermediate_start, tp.intermediate),)
            ),
            WeightSpec(
                self.fc_in.bias, (rows(f"{prefix}.mlp.fc_in.bias", (i,), tp.intermediate_start, tp.intermediate),)
            ),
            WeightSpec(
                self.fc_out.weight,
                (cols(f"{prefix}.mlp.fc_out.weight", (h, i), tp.intermediate_start, tp.intermediate),),
            ),
            WeightSpec(self.fc_out_bias, (whole(f"{prefix}.mlp.fc_out.bias", (h,)),)),
        ]


class GPTJForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPLayout, comm, max_len: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.cfg, self.tp, self.comm = cfg, tp, comm
        h = cfg.hidden_size
        p = lambda *shape: new_param(*shape, dtype=dtype, device=device)  # noqa: E731
        self.embed = p(tp.vocab, h)
        self.layers = nn.ModuleList(GPTJLayer(cfg, tp, dtype, device) for _ in range(cfg.num_layers))
        self.ln_f_weight, self.ln_f_bias = p(h), p(h)
        self.lm_head = Linear(tp.vocab, h, True, dtype, device)
        self.rotary = Rotary(cfg, max_len, dtype, device)
        self.act = activation(cfg.hidden_act)
        self.attn_opts = AttentionOptions(scores_dtype=torch.float32)

    def weight_specs(self) -> list[WeightSpec]:
        cfg, tp, h, v = self.cfg, self.tp, self.cfg.hidden_size, self.cfg.vocab_size
        head = "transformer.wte.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        specs = [
            WeightSpec(self.embed, (rows("transformer.wte.weight", (v, h), tp.vocab_start, tp.vocab_real),), pad=True),
            WeightSpec(self.ln_f_weight, (whole("transformer.ln_f.weight", (h,)),)),
            WeightSpec(self.ln_f_bias, (whole("transformer.ln_f.bias", (h,)),)),
            WeightSpec(self.lm_head.weight, (rows(head, (v, h), tp.vocab_start, tp.vocab_real),), pad=True),
            WeightSpec(self.lm_head.bias, (rows("lm_head.bias", (v,), tp.vocab_start, tp.vocab_real),), pad=True),
        ]
        for n, layer in enumerate(self.layers):
            specs += layer.weight_specs(cfg, tp, f"transformer.h.{n}")
        return specs

    def forward(self, batch: ForwardBatch, kv: Sequence[torch.Tensor]) -> torch.Tensor:
        """One fused iteration. kv: per layer [2, slots, heads, seq, head_dim] (this rank's heads)
        -> logits [B, vocab block of this rank]."""
        cfg, tp, comm = self.cfg, self.tp, self.comm
        tokens, h = batch.input_ids.shape[0], cfg.hidden_size
        hidden = vocab_embedding(batch.input_ids, self.embed, tp, comm)  # [T, hidden]
        for n, layer in enumerate(self.layers):
            x = F.layer_norm(hidden, (h,), layer.ln_weight, layer.ln_bias, cfg.norm_eps)
            q, k, v = layer.qkv(x).view(tokens, 3, tp.heads, cfg.head_dim).unbind(1)
            q, k = self.rotary(q, batch.positions), self.rotary(k, batch.positions)
            write_kv(kv[n][0], kv[n][1], k, v, batch)
            attn = layer.out(attention(q, kv[n][0], kv[n][1], batch, self.attn_opts))
            mlp = layer.fc_out(self.act(layer.fc_in(x)))
            partial = all_reduce(attn + mlp, comm)  # the block's one all-reduce
            hidden = partial + layer.fc_out_bias + hidden
        last = F.layer_norm(hidden[batch.sample_rows], (h,), self.ln_f_weight, self.ln_f_bias, cfg.norm_eps)
        return self.lm_head(last)  # [B, vocab block]
