"""BERT-family text encoders (all-MiniLM, BGE, E5, GTE; families/bert.py): absolute position and
token-type embeddings, post-norm blocks (LayerNorm after each residual add), erf GELU, and
attention that sees every token of its own input both ways. An encoder keeps no KV: each input
comes whole in one iteration (the scheduler never cuts it), and its rows attend to their own
input's rows only, computed in that iteration. It makes vectors (runner/pooling.py), never text.

nomic-bert (families/nomic_bert.py) is the same block with RoPE on q and k in place of the position
table (`encoder_rope`), a SwiGLU MLP (`gated_mlp`: [gate | up] in one projection) and no biases;
its tensors' names are its family's (`NAMES`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from flover.models.attention import ForwardBatch
from flover.models.layers import Linear, Rotary, activation, new_param, whole
from flover.models.model_config import CheckpointError, ModelConfig
from flover.models.safetensors_reader import WeightSpec
from flover.models.tp_layout import TPLayout

CLASSIFIER_NAMES = ("classifier.dense", "classifier.out_proj")  # RoBERTa's head


@dataclass(frozen=True)
class EncoderNames:
    """Where a layer's tensors are, under the layer's prefix: q / k / v (one name: fused rows), o,
    [gate,] up, down (each a name; ".weight" / ".bias" follow), and the two LayerNorms."""

    qkv: tuple[str, ...]
    o: str
    mlp_in: tuple[str, ...]  # [gate, up] where the MLP is gated
    down: str
    attn_norm: str
    mlp_norm: str
    layers: str = "encoder.layer"  # the layers' prefix
    embed_norm: str = "embeddings.LayerNorm"


BERT_NAMES = EncoderNames(
    qkv=tuple(f"attention.self.{n}" for n in ("query", "key", "value")),
    o="attention.output.dense",
    mlp_in=("intermediate.dense",),
    down="output.dense",
    attn_norm="attention.output.LayerNorm",
    mlp_norm="output.LayerNorm",
)
# nomic-ai's remote code's names, which transformers' NomicBertModel also saves (it renames them only
# in memory); "encoder." is read away (families/nomic_bert.py)
NOMIC_NAMES = EncoderNames(
    qkv=("attn.Wqkv",),
    o="attn.out_proj",
    mlp_in=("mlp.fc12", "mlp.fc11"),
    down="mlp.fc2",
    attn_norm="norm1",
    mlp_norm="norm2",
    layers="layers",
    embed_norm="emb_ln",
)
NAMES = {"bert": BERT_NAMES, "nomic": NOMIC_NAMES}  # by ModelConfig.encoder_names


class EncoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        p = lambda *shape: new_param(*shape, dtype=dtype, device=device)  # noqa: E731
        self.qkv = Linear(3 * h, h, cfg.qkv_bias, dtype, device)  # q, k, v fused: one GEMM
        self.o = Linear(h, h, cfg.o_bias, dtype, device)
        self.attn_norm_weight, self.attn_norm_bias = p(h), p(h)  # the LayerNorm after attention's residual add
        self.up = Linear((2 if cfg.gated_mlp else 1) * i, h, cfg.mlp_bias, dtype, device)  # ([gate | up])
        self.down = Linear(h, i, cfg.mlp_bias, dtype, device)
        self.mlp_norm_weight, self.mlp_norm_bias = p(h), p(h)  # and after the MLP's

    def weight_specs(self, cfg: ModelConfig, prefix: str, names: EncoderNames) -> list[WeightSpec]:
        h, i = cfg.hidden_size, cfg.intermediate_size

        def linear(lin: Linear, stems: tuple[str, ...], rows: int, cols: int) -> list[WeightSpec]:
            out = rows // len(stems)  # (each stem's rows)
            specs = [WeightSpec(lin.weight, tuple(whole(f"{prefix}.{n}.weight", (out, cols)) for n in stems))]
            if lin.bias is not None:
                specs.append(WeightSpec(lin.bias, tuple(whole(f"{prefix}.{n}.bias", (out,)) for n in stems)))
            return specs

        def norm(weight, bias, stem: str) -> list[WeightSpec]:
            return [
                WeightSpec(w, (whole(f"{prefix}.{stem}.{kind}", (h,)),))
                for w, kind in ((weight, "weight"), (bias, "bias"))
            ]

        return [
            *linear(self.qkv, names.qkv, 3 * h, h),
            *linear(self.o, (names.o,), h, h),
            *norm(self.attn_norm_weight, self.attn_norm_bias, names.attn_norm),
            *linear(self.up, names.mlp_in, self.up.weight.shape[0], h),
            *linear(self.down, (names.down,), h, i),
            *norm(self.mlp_norm_weight, self.mlp_norm_bias, names.mlp_norm),
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
        # absolute positions: a table; nomic-bert's: RoPE on q and k
        self.positions = None if cfg.encoder_rope else p(cfg.max_position_embeddings + cfg.position_offset, h)
        self.rotary = Rotary(cfg, max_len, dtype, device) if cfg.encoder_rope else None
        self.names = NAMES[cfg.encoder_names]
        self.token_type = p(max(cfg.token_types, 1), h)  # row 0 for an input, 1 for a pair's second part
        self.embed_norm_weight, self.embed_norm_bias = p(h), p(h)
        self.layers = nn.ModuleList(EncoderLayer(cfg, dtype, device) for _ in range(cfg.num_layers))
        self.act = activation(cfg.hidden_act)
        if cfg.classifier is not None:  # a cross-encoder's head: dense + tanh, then to its labels
            # (plain tensors: it runs on one pooled row at a time, in that row's dtype)
            self.head_weights = nn.ParameterList([p(h, h), p(h), p(cfg.num_labels, h), p(cfg.num_labels)])

    def weight_specs(self) -> list[WeightSpec]:
        cfg, h, names = self.cfg, self.cfg.hidden_size, self.names
        e = "embeddings"
        specs = [
            WeightSpec(self.embed, (whole(f"{e}.word_embeddings.weight", (cfg.vocab_size, h)),)),
            WeightSpec(self.token_type, (whole(f"{e}.token_type_embeddings.weight", tuple(self.token_type.shape)),)),
            WeightSpec(self.embed_norm_weight, (whole(f"{names.embed_norm}.weight", (h,)),)),
            WeightSpec(self.embed_norm_bias, (whole(f"{names.embed_norm}.bias", (h,)),)),
        ]
        if self.positions is not None:
            specs.append(
                WeightSpec(self.positions, (whole(f"{e}.position_embeddings.weight", tuple(self.positions.shape)),))
            )
        for n, layer in enumerate(self.layers):
            specs += layer.weight_specs(cfg, f"{names.layers}.{n}", names)
        if cfg.classifier is not None:
            dense, out = ("pooler.dense", "classifier") if cfg.classifier == "pooler" else CLASSIFIER_NAMES
            names = (f"{dense}.weight", f"{dense}.bias", f"{out}.weight", f"{out}.bias")
            specs += [WeightSpec(w, (whole(n, tuple(w.shape)),)) for w, n in zip(self.head_weights, names)]
        return specs

    def forward(self, batch: ForwardBatch, kv: Sequence[torch.Tensor]) -> torch.Tensor:
        return self.head(self.run_layers(self.embed_tokens(batch), batch, kv)[batch.sample_rows])

    def embed_tokens(self, batch: ForwardBatch) -> torch.Tensor:
        """[T] token ids at their positions -> [T, hidden] (word + position + token type, normed;
        nomic-bert's: no position row)."""
        types = self.token_type[0] if batch.token_types is None else self.token_type[batch.token_types]
        x = self.embed[batch.input_ids]
        if self.positions is not None:
            x = x + self.positions[batch.positions + self.cfg.position_offset]
        x = x + types
        return self._norm(x, self.embed_norm_weight, self.embed_norm_bias)

    def run_layers(self, hidden: torch.Tensor, batch: ForwardBatch, kv: Sequence[torch.Tensor]) -> torch.Tensor:
        """[T, hidden] -> [T, hidden] after every layer. (`kv`: none is kept; every input is whole.)"""
        for layer in self.layers:
            attn = layer.o(self._attention(layer, hidden, batch))
            hidden = self._norm(hidden + attn, layer.attn_norm_weight, layer.attn_norm_bias)
            mlp = layer.down(self._mlp_in(layer, hidden))
            hidden = self._norm(hidden + mlp, layer.mlp_norm_weight, layer.mlp_norm_bias)
        return hidden

    def _attention(self, layer: EncoderLayer, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Each input's rows [L, hidden] attend to all of that input's rows -> [T, hidden]."""
        cfg = self.cfg
        heads, d = cfg.num_heads, cfg.head_dim
        qkv = layer.qkv(x).view(x.shape[0], 3, heads, d)  # [T, 3, heads, d]
        if self.rotary is not None:  # (nomic-bert) q and k turned by their positions
            tables = self.rotary.tables(batch.positions)
            qkv = torch.stack(
                (self.rotary(qkv[:, 0], None, tables), self.rotary(qkv[:, 1], None, tables), qkv[:, 2]), 1
            )
        out = []
        for span in batch.prefills:
            if span.start_pos != 0:  # (the scheduler admits encoder inputs whole)
                raise RuntimeError("an encoder input came cut into chunks")
            q, k, v = qkv[None, span.token_start : span.token_start + span.length].permute(2, 0, 3, 1, 4)
            # [1, heads, L, d] each: 4-D inputs take PyTorch's fused CPU kernel (3-D ones its unfused math)
            attended = F.scaled_dot_product_attention(q, k, v)[0]  # [heads, L, d]
            out.append(attended.transpose(0, 1).reshape(span.length, heads * d))
        return torch.cat(out) if len(out) > 1 else out[0]

    def _mlp_in(self, layer: EncoderLayer, x: torch.Tensor) -> torch.Tensor:
        """act(up(x)), or with a gated MLP act(gate(x)) * up(x): [T, intermediate]."""
        y = layer.up(x)
        if not self.cfg.gated_mlp:
            return self.act(y)
        gate, up = y.chunk(2, dim=-1)
        return self.act(gate) * up

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
