"""BERT-family text encoders (all-MiniLM, BGE, E5, GTE; families/bert.py): absolute position and
token-type embeddings, post-norm blocks (LayerNorm after each residual add), erf GELU, and
attention that sees every token of its own input both ways. An encoder keeps no KV: each input
comes whole in one iteration (the scheduler never cuts it), and its rows attend to their own
input's rows only, computed in that iteration. It makes vectors (runner/pooling.py), never text.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from flover.models.attention import ForwardBatch
from flover.models.layers import Linear, activation, new_param, whole
from flover.models.model_config import CheckpointError, ModelConfig
from flover.models.safetensors_reader import WeightSpec
from flover.models.tp_layout import TPLayout

QKV = ("query", "key", "value")
CLASSIFIER_NAMES = ("classifier.dense", "classifier.out_proj")  # RoBERTa's head


class EncoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        p = lambda *shape: new_param(*shape, dtype=dtype, device=device)  # noqa: E731
        self.qkv = Linear(3 * h, h, True, dtype, device)  # q, k, v fused: one GEMM
        self.o = Linear(h, h, True, dtype, device)
        self.attn_norm_weight, self.attn_norm_bias = p(h), p(h)  # the LayerNorm after attention's residual add
        self.up = Linear(i, h, True, dtype, device)
        self.down = Linear(h, i, True, dtype, device)
        self.mlp_norm_weight, self.mlp_norm_bias = p(h), p(h)  # and after the MLP's

    def weight_specs(self, cfg: ModelConfig, prefix: str) -> list[WeightSpec]:
        h, i = cfg.hidden_size, cfg.intermediate_size
        attn = f"{prefix}.attention"
        return [
            WeightSpec(self.qkv.weight, tuple(whole(f"{attn}.self.{n}.weight", (h, h)) for n in QKV)),
            WeightSpec(self.qkv.bias, tuple(whole(f"{attn}.self.{n}.bias", (h,)) for n in QKV)),
            WeightSpec(self.o.weight, (whole(f"{attn}.output.dense.weight", (h, h)),)),
            WeightSpec(self.o.bias, (whole(f"{attn}.output.dense.bias", (h,)),)),
            WeightSpec(self.attn_norm_weight, (whole(f"{attn}.output.LayerNorm.weight", (h,)),)),
            WeightSpec(self.attn_norm_bias, (whole(f"{attn}.output.LayerNorm.bias", (h,)),)),
            WeightSpec(self.up.weight, (whole(f"{prefix}.intermediate.dense.weight", (i, h)),)),
            WeightSpec(self.up.bias, (whole(f"{prefix}.intermediate.dense.bias", (i,)),)),
            WeightSpec(self.down.weight, (whole(f"{prefix}.output.dense.weight", (h, i)),)),
            WeightSpec(self.down.bias, (whole(f"{prefix}.output.dense.bias", (h,)),)),
            WeightSpec(self.mlp_norm_weight, (whole(f"{prefix}.output.LayerNorm.weight", (h,)),)),
            WeightSpec(self.mlp_norm_bias, (whole(f"{prefix}.output.LayerNorm.bias", (h,)),)),
        ]


class BertEncoder(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPLayout, comm, max_len: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        if tp.size > 1:
            raise CheckpointError(f"{cfg.architecture}: an encoder runs on one rank (no --tp)")
        self.cfg, self.tp, self.comm = cfg, tp, comm
        h = cfg.hidden_size
        p = lambda *shape: new_param(*shape, dtype=dtype, device=device)  # noqa: E731
        self.embed = p(cfg.vocab_size, h)
        self.positions = p(cfg.max_position_embeddings + cfg.position_offset, h)
        self.token_type = p(max(cfg.token_types, 1), h)  # row 0 for an input, 1 for a pair's second part
        self.embed_norm_weight, self.embed_norm_bias = p(h), p(h)
        self.layers = nn.ModuleList(EncoderLayer(cfg, dtype, device) for _ in range(cfg.num_layers))
        self.act = activation(cfg.hidden_act)
        if cfg.classifier is not None:  # a cross-encoder's head: dense + tanh, then to its labels
            # (plain tensors: it runs on one pooled row at a time, in that row's dtype)
            self.head_weights = nn.ParameterList([p(h, h), p(h), p(cfg.num_labels, h), p(cfg.num_labels)])

    def weight_specs(self) -> list[WeightSpec]:
        cfg, h = self.cfg, self.cfg.hidden_size
        e = "embeddings"
        specs = [
            WeightSpec(self.embed, (whole(f"{e}.word_embeddings.weight", (cfg.vocab_size, h)),)),
            WeightSpec(self.positions, (whole(f"{e}.position_embeddings.weight", tuple(self.positions.shape)),)),
            WeightSpec(self.token_type, (whole(f"{e}.token_type_embeddings.weight", tuple(self.token_type.shape)),)),
            WeightSpec(self.embed_norm_weight, (whole(f"{e}.LayerNorm.weight", (h,)),)),
            WeightSpec(self.embed_norm_bias, (whole(f"{e}.LayerNorm.bias", (h,)),)),
        ]
        for n, layer in enumerate(self.layers):
            specs += layer.weight_specs(cfg, f"encoder.layer.{n}")
        if cfg.classifier is not None:
            dense, out = ("pooler.dense", "classifier") if cfg.classifier == "pooler" else CLASSIFIER_NAMES
            names = (f"{dense}.weight", f"{dense}.bias", f"{out}.weight", f"{out}.bias")
            specs += [WeightSpec(w, (whole(n, tuple(w.shape)),)) for w, n in zip(self.head_weights, names)]
        return specs

    def forward(self, batch: ForwardBatch, kv: Sequence[torch.Tensor]) -> torch.Tensor:
        return self.head(self.run_layers(self.embed_tokens(batch), batch, kv)[batch.sample_rows])

    def embed_tokens(self, batch: ForwardBatch) -> torch.Tensor:
        """[T] token ids at their positions -> [T, hidden] (word + position + token type, normed)."""
        types = self.token_type[0] if batch.token_types is None else self.token_type[batch.token_types]
        x = self.embed[batch.input_ids] + self.positions[batch.positions + self.cfg.position_offset] + types
        return self._norm(x, self.embed_norm_weight, self.embed_norm_bias)

    def run_layers(self, hidden: torch.Tensor, batch: ForwardBatch, kv: Sequence[torch.Tensor]) -> torch.Tensor:
        """[T, hidden] -> [T, hidden] after every layer. (`kv`: none is kept; every input is whole.)"""
        for layer in self.layers:
            attn = layer.o(self._attention(layer, hidden, batch))
            hidden = self._norm(hidden + attn, layer.attn_norm_weight, layer.attn_norm_bias)
            mlp = layer.down(self.act(layer.up(hidden)))
            hidden = self._norm(hidden + mlp, layer.mlp_norm_weight, layer.mlp_norm_bias)
        return hidden

    def _attention(self, layer: EncoderLayer, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Each input's rows [L, hidden] attend to all of that input's rows -> [T, hidden]."""
        cfg = self.cfg
        heads, d = cfg.num_heads, cfg.head_dim
        qkv = layer.qkv(x).view(x.shape[0], 3, heads, d)  # [T, 3, heads, d]
        out = []
        for span in batch.prefills:
            if span.start_pos != 0:  # (the scheduler admits encoder inputs whole)
                raise RuntimeError("an encoder input came cut into chunks")
            q, k, v = qkv[None, span.token_start : span.token_start + span.length].permute(2, 0, 3, 1, 4)
            # [1, heads, L, d] each: 4-D inputs take PyTorch's fused CPU kernel (3-D ones its unfused math)
            attended = F.scaled_dot_product_attention(q, k, v)[0]  # [heads, L, d]
            out.append(attended.transpose(0, 1).reshape(span.length, heads * d))
        return torch.cat(out) if len(out) > 1 else out[0]

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), weight, bias, self.cfg.norm_eps)

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last layer's rows as they are (its own LayerNorm was its last step)."""
        return hidden

    def classify(self, first: torch.Tensor) -> torch.Tensor:
        """A cross-encoder's first row [hidden] -> its label scores [num_labels] (the row's dtype:
        float64 where the reference check asks)."""
        dense_w, dense_b, out_w, out_b = (w.to(first.dtype) for w in self.head_weights)
        return F.linear(torch.tanh(F.linear(first, dense_w, dense_b)), out_w, out_b)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """No token is ever sampled from an encoder: [B, 0]."""
        return hidden.new_zeros(hidden.shape[0], 0)
