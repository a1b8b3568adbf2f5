"""Checkpoints without torch: which file or directory a model is, its config, its tokenizer's
source, how its projections are stored (the HTTP front reads these and never imports torch)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

from flover.models.families import family_of
from flover.models.families import load_model_config as read_directory_config
from flover.models.gguf_file import GGUFFile, is_gguf
from flover.models.gguf_grids import BLOCK_TYPES
from flover.models.model_config import CheckpointError, ModelConfig
from flover.models.pooling import Pooling, directory_pooling, sentence_max_tokens

if TYPE_CHECKING:  # the tensor reader imports torch: only when weights are read
    from flover.models.safetensors_reader import CheckpointReader


def stacked_experts(cfg: ModelConfig) -> dict:
    """Each expert's per-expert names (models/moe.py asks for) -> where a checkpoint that stacks
    the experts (gpt-oss: mlp.experts.gate_up_proj [experts, hidden, 2 inter], ...; Gemma 4:
    experts.gate_up_proj [experts, 2 inter, hidden], ...) keeps them."""
    from flover.models.safetensors_reader import Stacked

    moe = cfg.moe
    if moe is None or not moe.stacked:
        return {}
    names = {}
    gate, up, down = moe.projections
    for i in sorted(moe.layers):
        block = f"{moe.block_of(f'model.layers.{i}')}.experts"
        for e in range(moe.experts):
            for projection, stack, part in (
                (gate, "gate_up_proj", "gate"),
                (up, "gate_up_proj", "up"),
                (down, "down_proj", "down"),
            ):
                names[f"{block}.{e}.{projection}.weight"] = Stacked(f"{block}.{stack}", e, part, moe.stacked)
                names[f"{block}.{e}.{projection}.bias"] = Stacked(f"{block}.{stack}_bias", e, part, moe.stacked)
    return names


class HFDirectory:
    """A Hugging Face checkpoint directory: config.json, *.safetensors, tokenizer.json."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def model_config(self) -> ModelConfig:
        return read_directory_config(self.path)

    def pooling(self) -> Pooling | None:
        """How it makes embeddings, where it is a sentence-transformers directory."""
        return directory_pooling(self.path)

    def default_max_tokens(self) -> int | None:
        """The positions its own files suggest (a sentence-transformers max_seq_length), if any."""
        return sentence_max_tokens(self.path)

    def reader(self, cfg: ModelConfig) -> CheckpointReader:
        from flover.models.safetensors_reader import CheckpointReader

        return CheckpointReader(self.path, stacked_experts(cfg), family_of(cfg).weight_prefixes)

    def check_tensors(self, cfg: ModelConfig) -> None:
        """config.json's shape against the tensors the files hold, before anything is built from it."""
        reader = self.reader(cfg)
        family = family_of(cfg)
        prefix = re.escape(family.layer_prefix)
        layers = {int(m.group(1)) for name in reader.files if (m := re.match(prefix + r"\.(\d+)\.", name))}
        if layers != set(range(cfg.num_layers)):
            raise CheckpointError(
                f"{self.path / 'config.json'}: {cfg.num_layers} layers, but the weights hold {len(layers)}"
            )
        embed = family.embed_name
        shape = reader.shape(embed) if reader.has(embed) else None
        if shape != (cfg.vocab_size, cfg.hidden_size):
            raise CheckpointError(
                f"{self.path}: {embed} has shape {list(shape) if shape else None}, config.json "
                f"says [{cfg.vocab_size}, {cfg.hidden_size}]"
            )


def open_checkpoint(path: str | Path) -> HFDirectory | GGUFFile:
    """A GGUF file, a Hugging Face directory, or a directory holding just one GGUF file (as a
    hub repository of GGUF files does)."""
    path = Path(path)
    if path.is_dir() and not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return GGUFFile(ggufs[0])
        if len(ggufs) > 1:
            raise CheckpointError(
                f"{path}: holds {len(ggufs)} GGUF files ({', '.join(g.name for g in ggufs[:4])}); "
                f"pass one of them as --model"
            )
    return GGUFFile(path) if is_gguf(path) else HFDirectory(path)


def load_model_config(path: str | Path) -> ModelConfig:
    return open_checkpoint(path).model_config()


def file_quantization(checkpoint: HFDirectory | GGUFFile) -> str:
    """The weight-only mode that keeps a quantized file's projections in their own codes ("file":
    every projection in a block type of models/gguf_grids.py, as Q4_K_M's Q4_K, Q6_K and Q5_0 are),
    or "none" (16-bit sources, and files with other types, which run dequantized)."""
    if not isinstance(checkpoint, GGUFFile):
        return "none"
    types = checkpoint.projection_types()
    return "file" if types and types <= set(BLOCK_TYPES) else "none"
