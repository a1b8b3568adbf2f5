"""The tensor half of embeddings (models/pooling.py says how a model pools): an input's kept rows,
as its prompt chunks bring them, -> its vector.

A vector never depends on how its prompt was cut into chunks or on what else shared its
iterations: rows are summed in blocks of BLOCK positions aligned at position 0, each block at
once when it is whole, and the block sums in order at the end (a chunk boundary changes no
sum); a maximum is exact in any order. What an input holds meanwhile is bounded: its block sums
and at most BLOCK - 1 rows (not its whole prompt's rows: 512 MiB for 32k positions of 4,096)."""

from __future__ import annotations

from pathlib import Path

import torch

from flover.models.model_config import CheckpointError
from flover.models.pooling import DenseConfig, Pooling

BLOCK = 64  # positions summed together


class PooledRows:
    """One input's rows so far, reduced as far as its pooling allows."""

    def __init__(self, pooling: Pooling):
        self.pooling = pooling
        self.count = 0  # rows taken
        self.sums: list[torch.Tensor] = []  # float64 [hidden] per whole block
        self.tail: torch.Tensor | None = None  # rows of the unfinished block [< BLOCK, hidden]
        self.kept: torch.Tensor | None = None  # cls / last: its row; max: the maximum so far

    def add(self, rows: torch.Tensor) -> None:
        """rows [n, hidden]: the next kept rows, in prompt order (a view of the iteration's: copied)."""
        self.count += rows.shape[0]
        mode = self.pooling.mode
        if mode in ("cls", "last"):
            self.kept = rows[-1].clone()
        elif mode == "max":
            top = rows.max(dim=0).values
            self.kept = top if self.kept is None else torch.maximum(self.kept, top)
        else:
            rows = rows if self.tail is None else torch.cat((self.tail, rows))
            whole = rows.shape[0] // BLOCK * BLOCK
            self.sums += list(rows[:whole].view(-1, BLOCK, rows.shape[1]).to(torch.float64).sum(dim=1))
            self.tail = rows[whole:].clone() if whole < rows.shape[0] else None

    def vector(self, dimensions: int | None = None, dense: "DenseStack | None" = None) -> torch.Tensor:
        """The input's vector [dimensions or width] (at least float32): through the model's Dense
        modules if any, then the first `dimensions` components (Matryoshka), normalized after the
        cut where the model normalizes."""
        mode = self.pooling.mode
        if mode in ("cls", "last", "max"):
            vector = self.kept.to(torch.promote_types(self.kept.dtype, torch.float32))
        else:
            sums = self.sums + ([self.tail.to(torch.float64).sum(dim=0)] if self.tail is not None else [])
            total = torch.stack(sums).sum(dim=0)  # [hidden] float64, the blocks in order
            vector = total / (self.count if mode == "mean" else self.count**0.5)
        if dense is not None:
            vector = dense(vector)
        if dimensions is not None:
            vector = vector[:dimensions]
        if self.pooling.normalize:
            vector = torch.nn.functional.normalize(vector, p=2, dim=0)
        return vector


class DenseStack:
    """sentence-transformers' Dense modules after the pooling (EmbeddingGemma's two projections),
    read from their own safetensors files (or the GGUF file that holds them) and run on one pooled
    vector at a time, in its dtype."""

    def __init__(self, pooling: Pooling, hidden: int):
        self.layers = []
        width, opened = hidden, {}  # (a GGUF file's header parsed once for all its layers)
        for config in pooling.dense:
            weight, bias = _dense_tensors(config, opened)
            if (
                config.in_features != width
                or weight is None
                or tuple(weight.shape) != (config.out_features, width)
                or (bias is None) == config.bias
                or (bias is not None and tuple(bias.shape) != (config.out_features,))
            ):
                raise CheckpointError(
                    f"{config.weights}: its Dense weights do not map {width} components to {config.out_features}"
                )
            self.layers.append((weight, bias, config.activation))
            width = config.out_features
        self.width = width  # of the vectors it makes

    def __call__(self, vector: torch.Tensor) -> torch.Tensor:
        """[in] -> [out], each layer in the vector's dtype (float64 where the reference check asks)."""
        for weight, bias, activation in self.layers:
            vector = torch.nn.functional.linear(
                vector, weight.to(vector.dtype), None if bias is None else bias.to(vector.dtype)
            )
            vector = torch.tanh(vector) if activation == "tanh" else vector
        return vector


def _dense_tensors(config: DenseConfig, opened: dict) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A Dense module's weight and bias (None where absent), float32 or as stored; `opened`: the
    GGUF files read so far, by path."""
    from safetensors import SafetensorError, safe_open

    from flover.models.gguf_file import GGUFFile, is_gguf
    from flover.models.safetensors_reader import CheckpointReader, Source

    if Path(config.weights).is_dir():  # (a decoder scorer's head, among the model's own tensors)
        reader = CheckpointReader(config.weights)
        names = (config.weight_name, config.bias_name)
        return tuple(reader.read(Source(n, reader.shape(n))) if reader.has(n) else None for n in names)
    if is_gguf(config.weights):
        if config.weights not in opened:
            opened[config.weights] = GGUFFile(config.weights)
        tensors = opened[config.weights].tensors
        found = (tensors.get(config.weight_name), tensors.get(config.bias_name) if config.bias else None)
        return tuple(None if t is None else torch.from_numpy(t.dequantize()) for t in found)
    try:
        with safe_open(config.weights, framework="pt") as f:
            names = set(f.keys())
            return tuple(f.get_tensor(n) if n in names else None for n in (config.weight_name, config.bias_name))
    except (OSError, SafetensorError) as e:
        raise CheckpointError(f"{config.weights}: cannot read the Dense weights ({e})") from None
