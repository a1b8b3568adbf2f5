"""The tensor half of embeddings (models/pooling.py says how a model pools): one input's kept
rows -> its vector. Called once per input, on all of its rows at once, so that a vector never
depends on how its prompt was cut into chunks or on what else shared its iterations."""

from __future__ import annotations

import torch

from flover.models.pooling import Pooling


def pool(rows: torch.Tensor, pooling: Pooling, dimensions: int | None = None) -> torch.Tensor:
    """rows [n, hidden]: an input's kept rows in prompt order (its final hidden states, normed as
    the model's last norm leaves them) -> its vector [dimensions or hidden] (at least float32).
    `dimensions`: the first so many components (Matryoshka), normalized after the cut."""
    rows = rows.to(torch.promote_types(rows.dtype, torch.float32))
    if pooling.mode in ("cls", "last"):
        vector = rows[0]
    elif pooling.mode == "max":
        vector = rows.max(dim=0).values
    else:
        vector = rows.sum(dim=0) / (rows.shape[0] if pooling.mode == "mean" else rows.shape[0] ** 0.5)
    if dimensions is not None:
        vector = vector[:dimensions]
    if pooling.normalize:
        vector = torch.nn.functional.normalize(vector, p=2, dim=0)
    return vector
