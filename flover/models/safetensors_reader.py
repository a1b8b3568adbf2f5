"""Reads safetensors checkpoints into a model's parameters.

A model lists `WeightSpec`s: which parameter is filled from which checkpoint tensors (several
for fused projections such as QKV), each with the slice this tensor-parallel rank holds. Each
rank reads only its own slices (`safe_open(...).get_slice`), so no rank holds the whole model.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from flover.models.model_config import CheckpointError


@dataclass(frozen=True)
class Source:
    name: str  # tensor name in the checkpoint
    shape: tuple[int, ...]  # its full (unsharded) shape, checked before reading
    dim: int | None = None  # the dimension this rank takes a slice of; None = the whole tensor
    start: int = 0
    stop: int | None = None


@dataclass(frozen=True)
class Stacked:
    """Where one expert's tensor lies in a checkpoint that stacks them, read as the per-expert
    [out, in] / [out] tensor. Layout "interleaved" (gpt-oss): weights [experts, in, out] (gate
    and up interleaved in out: every other column from 0 and from 1), biases [experts, out];
    "halves" (Gemma 4): weights [experts, out, in], gate's rows then up's."""

    name: str
    expert: int
    part: str  # "gate", "up" or "down"
    layout: str = "interleaved"


@dataclass(frozen=True)
class WeightSpec:
    param: torch.Tensor  # filled in place; sources are concatenated along dim 0
    sources: tuple[Source, ...]
    pad: bool = False  # fewer rows than the parameter: zero the rest (last vocabulary block)


LANGUAGE_MODEL = "model.language_model."


class CheckpointReader:
    """Maps tensor names to the safetensors file holding them."""

    def __init__(
        self, model_dir: str | Path, stacked: dict[str, Stacked] | None = None, prefixes: tuple[str, ...] = ()
    ):
        """`stacked`: per-expert names the model asks for -> where they lie in stacked tensors;
        `prefixes`: a task model's prefixes of its base model's names, read without them."""
        self.dir = Path(model_dir)
        self._handles: dict[Path, object] = {}
        self.files = self._weight_map()
        self.stacked = stacked or {}
        # a multimodal checkpoint's language model (model.language_model.*) read as model.*
        aliases = {"model." + n.removeprefix(LANGUAGE_MODEL): n for n in self.files if n.startswith(LANGUAGE_MODEL)}
        aliases |= {n.removeprefix(p): n for p in prefixes for n in self.files if n.startswith(p)}
        if any(n.startswith("layers.") for n in self.files):  # a base model's (Gemma3TextModel, Qwen3Model)
            aliases |= {"model." + n: n for n in self.files}
        self.stored = {alias: name for alias, name in aliases.items() if alias not in self.files}
        self.files |= {alias: self.files[name] for alias, name in self.stored.items()}

    def _weight_map(self) -> dict[str, Path]:
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: not a safetensors index ({e})") from None
            return {name: self.dir / file for name, file in weight_map.items()}
        files = sorted(self.dir.glob("*.safetensors"))
        if not files:
            hint = " (convert .bin weights to safetensors first)" if any(self.dir.glob("*.bin")) else ""
            raise CheckpointError(f"{self.dir}: no *.safetensors files{hint}")
        mapping = {}
        for file in files:
            for name in self._open(file).keys():
                mapping[name] = file
        return mapping

    def _open(self, file: Path):
        if file not in self._handles:
            try:
                self._handles[file] = safe_open(str(file), framework="pt")
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"{file}: cannot read safetensors file ({e})") from None
        return self._handles[file]

    def row_table(self, source: Source) -> "SafetensorsRows | None":
        """A 2-D float tensor read a row at a time from its file's memory map (Gemma 4's per-layer
        embeddings: 4.7 GB for E2B, a few rows an iteration used): `source`'s columns of the rows
        asked for; None where the tensor cannot be (a stored dtype other than F32 / F16 / BF16)."""
        if source.name not in self.files or source.name in self.stacked:
            return None
        file, stored = self.files[source.name], self.stored.get(source.name, source.name)
        try:
            with open(file, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                entry = json.loads(f.read(size))[stored]
            kind = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}[entry["dtype"]]
            begin, end = entry["data_offsets"]
            shape = tuple(entry["shape"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if (
            shape != tuple(source.shape)
            or len(shape) != 2
            or end - begin != shape[0] * shape[1] * np.dtype(kind).itemsize
        ):
            return None
        data = np.memmap(file, dtype=kind, mode="r", offset=8 + size + begin, shape=shape)
        start, stop = (source.start, source.stop) if source.dim == 1 else (0, shape[1])
        return SafetensorsRows(data, entry["dtype"], start, stop)

    def has(self, name: str) -> bool:
        return name in self.files or (name in self.stacked and self.stacked[name].name in self.files)

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape from its file's header (nothing is read)."""
        try:
            return tuple(self._open(self.files[name]).get_slice(self.stored.get(name, name)).get_shape())
        except SafetensorError as e:
            raise CheckpointError(f"{self.files[name]}: cannot read tensor {name!r} ({e})") from None

    def _file(self, name: str) -> Path:
        if name not in self.files:
            raise CheckpointError(f"{self.dir}: tensor {name!r} is missing from the checkpoint")
        return self.files[name]

    @staticmethod
    def _finite(tensor: torch.Tensor, file: Path, name: str) -> torch.Tensor:
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise CheckpointError(f"{file}: tensor {name!r} holds values that are not finite (NaN or infinity)")
        return tensor

    def read(self, source: Source) -> torch.Tensor:
        if source.name in self.stacked:
            return self._read_stacked(source, self.stacked[source.name])
        file = self._file(source.name)
        try:
            view = self._open(file).get_slice(self.stored.get(source.name, source.name))
            shape = tuple(view.get_shape())
            if shape != source.shape:
                raise CheckpointError(
                    f"{file}: tensor {source.name!r} has shape {list(shape)}, expected {list(source.shape)}"
                )
            if source.dim is None:
                tensor = view[:]
            else:
                tensor = view[
                    tuple(
                        slice(source.start, source.stop) if d == source.dim else slice(None) for d in range(len(shape))
                    )
                ]
        except SafetensorError as e:
            raise CheckpointError(f"{file}: cannot read tensor {source.name!r} ({e})") from None
        return self._finite(tensor, file, source.name)

    def _read_stacked(self, source: Source, where: Stacked) -> torch.Tensor:
        """One expert's tensor out of a stacked one, transposed to [out, in], then this rank's slice."""
        file = self._file(where.name)
        try:
            view = self._open(file).get_slice(where.name)
            shape = tuple(view.get_shape())
            if len(shape) not in (2, 3) or where.expert >= shape[0]:
                raise CheckpointError(f"{file}: tensor {where.name!r} has shape {list(shape)}, expected [experts, ...]")
            tensor = view[where.expert]
        except SafetensorError as e:
            raise CheckpointError(f"{file}: cannot read tensor {where.name!r} ({e})") from None
        if where.layout == "halves":
            if where.part in ("gate", "up"):
                tensor = tensor.chunk(2, dim=0)[0 if where.part == "gate" else 1]
            tensor = tensor.contiguous()
        else:
            if where.part in ("gate", "up"):
                tensor = tensor[..., 0 if where.part == "gate" else 1 :: 2]
            tensor = tensor.t().contiguous() if tensor.dim() == 2 else tensor.contiguous()
        if tuple(tensor.shape) != source.shape:
            raise CheckpointError(
                f"{file}: {where.name!r} gives expert {where.expert}'s {where.part} of shape {list(tensor.shape)}, "
                f"expected {list(source.shape)}"
            )
        self._finite(tensor, file, where.name)
        if source.dim is None:
            return tensor
        return tensor.narrow(source.dim, source.start, (source.stop or tensor.shape[source.dim]) - source.start)


@dataclass
class SafetensorsRows:
    """Rows of a memory-mapped safetensors tensor as float32 on demand: columns [start, stop)."""

    data: np.ndarray
    dtype: str  # "F32", "F16" or "BF16" (stored as uint16)
    start: int
    stop: int

    def rows(self, ids: np.ndarray) -> np.ndarray:
        picked = self.data[ids, self.start : self.stop]
        if self.dtype == "BF16":
            return (picked.astype(np.uint32) << 16).view(np.float32)
        return picked.astype(np.float32)

    def finite(self, chunk: int = 4096) -> bool:
        """Whether every value is finite (checked once at load, a chunk of rows at a time)."""
        n = self.data.shape[0]
        return all(np.isfinite(self.rows(np.arange(at, min(at + chunk, n)))).all() for at in range(0, n, chunk))


def load_weights(
    reader: CheckpointReader, specs: list[WeightSpec], take: Callable[[WeightSpec, torch.Tensor], bool] | None = None
) -> None:
    """Each spec's parameter from its sources. `take(spec, values)`: offered the values as read
    (float32 for GGUF files) before they are rounded into the parameter; True if it has filled
    the parameter itself."""
    for spec in specs:
        parts = [reader.read(src) for src in spec.sources]
        tensor = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        if spec.pad and tensor.shape[0] < spec.param.shape[0]:
            spec.param[tensor.shape[0] :].zero_()
            target = spec.param[: tensor.shape[0]]
        else:
            target = spec.param
        if tuple(tensor.shape) != tuple(target.shape):
            names = ", ".join(s.name for s in spec.sources)
            raise CheckpointError(
                f"{reader.dir}: {names} give shape {list(tensor.shape)}, the model expects {list(spec.param.shape)}"
            )
        if take is not None and target is spec.param and take(spec, tensor):
            continue
        target.copy_(tensor)
