"""Per-layer inputs (Gemma 4's E-series, "PLE"): besides the residual stream, every layer gets a
small input of its own per token, made once per iteration from the token (a second embedding
table, [vocab, layers x width]) and from the scaled embedding (a projection to layers x width,
RMS-normed per layer); each layer gates it into the residual after its MLP (models/decoder.py).

Every rank computes all of it (the widths are small: 256 a layer); a pipeline stage only its
own layers' columns of the table and the projection.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flover.models.layers import Linear, cols, float32_rms_norm, new_param, rows, whole
from flover.models.model_config import ModelConfig
from flover.models.safetensors_reader import WeightSpec

TABLE = "model.embed_tokens_per_layer.weight"
PROJECTION = "model.per_layer_model_projection.weight"
NORM = "model.per_layer_projection_norm.weight"


class PerLayerInputs(nn.Module):
    def __init__(self, cfg: ModelConfig, layers: range, dtype: torch.dtype, device: torch.device):
        """`layers`: the layers whose inputs this rank makes (a pipeline stage's)."""
        super().__init__()
        pl = cfg.per_layer_input
        self.cfg, self.layers, self.width = cfg, layers, pl.width
        columns = len(layers) * pl.width
        self.table = new_param(pl.vocab, columns, dtype=dtype, device=device)  # [vocab, stage layers x width]
        self.projection = Linear(columns, cfg.hidden_size, False, dtype, device)
        self.norm = new_param(pl.width, dtype=dtype, device=device)
        # as the reference scales its embeddings: sqrt(width) rounded to the model's dtype
        self.table_scale = torch.tensor(pl.width**0.5, dtype=dtype, device=device)

    def weight_specs(self) -> list[WeightSpec]:
        cfg, pl = self.cfg, self.cfg.per_layer_input
        total, start, count = cfg.num_layers * pl.width, self.layers.start * pl.width, len(self.layers) * pl.width
        return [
            WeightSpec(self.table, (cols(TABLE, (pl.vocab, total), start, count),)),
            WeightSpec(self.projection.weight, (rows(PROJECTION, (total, cfg.hidden_size), start, count),)),
            WeightSpec(self.norm, (whole(NORM, (pl.width,)),)),
        ]

    def forward(self, ids: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """ids [T], the scaled embeddings [T, hidden] -> [T, stage layers, width]."""
        tokens = ids.shape[0]
        by_token = (F.embedding(ids, self.table) * self.table_scale).view(tokens, len(self.layers), self.width)
        projected = self.projection(embedded) * self.cfg.hidden_size**-0.5
        projected = float32_rms_norm(projected.view(tokens, len(self.layers), self.width), self.norm, self.cfg.norm_eps)
        return (projected + by_token) * 2.0**-0.5
