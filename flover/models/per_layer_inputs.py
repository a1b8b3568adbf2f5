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

from flover.models.layers import cols, float32_rms_norm, new_param, rows, whole
from flover.models.model_config import CheckpointError, ModelConfig
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
        # [stage layers x width, hidden]: a plain weight (not a Linear: the native step, which releases
        # those, calls this module every iteration; 27 MB for E2B as bfloat16)
        self.projection = new_param(columns, cfg.hidden_size, dtype=dtype, device=device)
        self.norm = new_param(pl.width, dtype=dtype, device=device)
        # as the reference scales its embeddings: sqrt(width) rounded to the model's dtype
        self.table_scale = torch.tensor(pl.width**0.5, dtype=dtype, device=device)
        self.codes = None  # the file's table: its rows read as tokens ask for them (keep_codes)

    def table_source(self):
        pl, cfg = self.cfg.per_layer_input, self.cfg
        total, start, count = cfg.num_layers * pl.width, self.layers.start * pl.width, len(self.layers) * pl.width
        return cols(TABLE, (pl.vocab, total), start, count)

    def keep_codes(self, reader) -> bool:
        """Read the table a row at a time from the file (a GGUF file's codes, a safetensors file's
        memory map) instead of holding it whole (E2B's: 262,144 x 35 x 256 values, 4.7 GB as
        bfloat16); False where the file cannot. Its values are checked finite here, once."""
        codes = reader.row_table(self.table_source()) if hasattr(reader, "row_table") else None
        if codes is None:
            return False
        if not codes.finite():
            raise CheckpointError(f"{reader.dir}: tensor {TABLE!r} holds values that are not finite (NaN or infinity)")
        self.codes, self.table = codes, nn.Parameter(self.table.new_empty(0, 0), requires_grad=False)
        return True

    def weight_specs(self) -> list[WeightSpec]:
        cfg, pl = self.cfg, self.cfg.per_layer_input
        total, start, count = cfg.num_layers * pl.width, self.layers.start * pl.width, len(self.layers) * pl.width
        table = [] if self.codes is not None else [WeightSpec(self.table, (self.table_source(),))]
        return [
            *table,
            WeightSpec(self.projection, (rows(PROJECTION, (total, cfg.hidden_size), start, count),)),
            WeightSpec(self.norm, (whole(NORM, (pl.width,)),)),
        ]

    def by_token(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] -> the table's rows, scaled: [T, stage layers, width] (the native step adds the rest)."""
        if self.codes is not None:  # (rounded to the dtype as a loaded table is, then scaled)
            rows = torch.from_numpy(self.codes.rows(ids.cpu().numpy()))
            rows = rows.to(self.table_scale.device, self.table_scale.dtype)
        else:
            rows = F.embedding(ids, self.table)
        return (rows * self.table_scale).view(ids.shape[0], len(self.layers), self.width)

    def forward(self, ids: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """ids [T], the scaled embeddings [T, hidden] -> [T, stage layers, width]."""
        tokens, by_token = ids.shape[0], self.by_token(ids)
        projected = F.linear(embedded, self.projection) * self.cfg.hidden_size**-0.5
        projected = float32_rms_norm(projected.view(tokens, len(self.layers), self.width), self.norm, self.cfg.norm_eps)
        return (projected + by_token) * 2.0**-0.5
