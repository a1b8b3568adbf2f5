"""Architectures and checkpoints: `open_checkpoint(path)` reads a Hugging Face directory or a
GGUF file; `load_model(checkpoint, ...)` returns a ready model."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from flover.models.config import LLAMA_FAMILY, CheckpointError, ModelConfig
from flover.models.config import load_model_config as _load_directory_config
from flover.models.gguf_file import GGUFFile, is_gguf
from flover.models.gptj import GPTJForCausalLM
from flover.models.layers import Linear
from flover.models.llama import LlamaForCausalLM
from flover.models.loader import CheckpointReader, load_weights
from flover.models.quant import can_quantize
from flover.models.tp_layout import TPLayout

__all__ = ["CheckpointError", "LLAMA_FAMILY", "ModelConfig", "HFDirectory", "GGUFFile", "open_checkpoint", "file_quantization", "load_model",
           "load_model_config"]


class HFDirectory:
    """A Hugging Face checkpoint directory: config.json, *.safetensors, tokenizer.json."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def model_config(self) -> ModelConfig:
        return _load_directory_config(self.path)

    def reader(self, cfg: ModelConfig) -> CheckpointReader:
        return CheckpointReader(self.path)

    def check_tensors(self, cfg: ModelConfig) -> None:
        """config.json's shape against the tensors the files hold, before anything is built from it."""
        reader = CheckpointReader(self.path)
        prefix = r"transformer\.h" if cfg.is_gptj else r"model\.layers"
        layers = {int(m.group(1)) for name in reader.files if (m := re.match(prefix + r"\.(\d+)\.", name))}
        if layers != set(range(cfg.num_layers)):
            raise CheckpointError(f"{self.path / 'config.json'}: {cfg.num_layers} layers, but the weights hold "
                                  f"{len(layers)}")
        embed = "transformer.wte.weight" if cfg.is_gptj else "model.embed_tokens.weight"
        shape = reader.shape(embed) if reader.has(embed) else None
        if shape != (cfg.vocab_size, cfg.hidden_size):
            raise CheckpointError(f"{self.path}: {embed} has shape {list(shape) if shape else None}, config.json "
                                  f"says [{cfg.vocab_size}, {cfg.hidden_size}]")


def open_checkpoint(path: str | Path) -> HFDirectory | GGUFFile:
    """A GGUF file, a Hugging Face directory, or a directory holding just one GGUF file (as a
    hub repository of GGUF files does)."""
    path = Path(path)
    if path.is_dir() and not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return GGUFFile(ggufs[0])
        if len(ggufs) > 1:
            raise CheckpointError(f"{path}: holds {len(ggufs)} GGUF files ({', '.join(g.name for g in ggufs[:4])}); "
                                  f"pass one of them as --model")
    return GGUFFile(path) if is_gguf(path) else HFDirectory(path)


def load_model_config(path: str | Path) -> ModelConfig:
    return open_checkpoint(path).model_config()


def model_class(cfg: ModelConfig):
    return LlamaForCausalLM if cfg.architecture in LLAMA_FAMILY else GPTJForCausalLM


# GGUF block types whose codes the native step runs as they are (`--quantization auto`): Q4_1's
# grid (scale and minimum per 32 inputs) is int4's, and quantizing its values gives back its codes
FILE_QUANTIZATION = {"Q4_1": "int4"}


def file_quantization(checkpoint: HFDirectory | GGUFFile) -> str:
    """The weight-only mode that keeps a quantized file's projections in their own codes, or
    "none" (16-bit sources; GGUF types not in FILE_QUANTIZATION run dequantized)."""
    if not isinstance(checkpoint, GGUFFile):
        return "none"
    modes = {FILE_QUANTIZATION.get(t, "none") for t in checkpoint.projection_types()}
    return modes.pop() if len(modes) == 1 else "none"


def load_model(checkpoint: str | HFDirectory | GGUFFile, dtype: torch.dtype, device: torch.device, max_len: int,
               cfg: ModelConfig | None = None, tp: TPLayout | None = None, comm=None,
               pack_hint: int = 32, quantization: str = "none", pack: bool = True) -> torch.nn.Module:
    """Build the model (this rank's shard of it), fill it from the checkpoint, optionally give the
    projections a weight-only quantized copy (models/quant.py), and repack the projection weights
    for the device's fastest GEMM (`pack_hint`: typical rows per GEMM). `pack=False` leaves them
    row-major (and int4's codes unpacked) for the native step (flover/native/forward.py), which
    makes copies of its own; the caller then calls pack_projections or release_projections."""
    if isinstance(checkpoint, (str, Path)):
        checkpoint = open_checkpoint(checkpoint)
    cfg = cfg or checkpoint.model_config()
    checkpoint.check_tensors(cfg)
    tp = tp or TPLayout.build(cfg)
    model = model_class(cfg)(cfg, tp, comm, max_len, dtype, device)
    with torch.no_grad():
        take = _quantize_as_read(model, quantization, keep_codes=not pack) if quantization != "none" else None
        load_weights(checkpoint.reader(cfg), model.weight_specs(), take)
        if quantization != "none":
            head = not (isinstance(checkpoint, GGUFFile) and checkpoint.head_is_quantized())
            quantize_projections(model, quantization, keep_codes=not pack, head=head)  # the LM head
    if pack:
        pack_projections(model, pack_hint)
    return model.eval()


def pack_projections(model: torch.nn.Module, pack_hint: int = 32) -> None:
    """Repack every projection for the device's GEMM (the row-major weight is released) and drop
    int4 codes kept for the native step."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, Linear):
                if module.quantized is not None:
                    module.quantized.codes = None
                module.pack(pack_hint)


def release_projections(model: torch.nn.Module) -> None:
    """Release every projection's weights (the native step holds copies of its own, and runs
    every iteration): the PyTorch forward can no longer run (Linear.forward says so)."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.release()


def _quantize_as_read(model: torch.nn.Module, mode: str, keep_codes: bool):
    """load_weights' `take`: every layer projection quantized from its values as read, before
    they round to the model's 16 bits (a Q4_1 file's values give back its codes exactly)."""
    owners = {id(m.weight): (name, m) for name, m in model.named_modules() if isinstance(m, Linear) and name != "lm_head"}

    def take(spec, values: torch.Tensor) -> bool:
        if id(spec.param) not in owners:
            return False
        name, module = owners[id(spec.param)]
        why = can_quantize(values, mode)
        if why is not None:
            raise CheckpointError(f"--quantization {mode}: {name}: {why}")
        module.quantize(mode, keep_codes, values=values)
        return True

    return take


def quantize_projections(model: torch.nn.Module, mode: str, keep_codes: bool = False, head: bool = True) -> None:
    """Every projection in `mode` (those load_model has not quantized as read); the LM head in
    int8 whatever the mode (the logits are the most sensitive product, and llama.cpp's 4-bit
    files keep it in 8 bits too), unless `head` is False: a GGUF file's head already in blocks of
    8 bits or fewer (Q8_0's scale per 32 weights) keeps its values in 16 bits, as quantizing it
    again per row lost SmolLM2's answers."""
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or module.quantized is not None or name == "lm_head" and not head:
            continue
        head_or_layer = "int8" if name == "lm_head" else mode
        why = can_quantize(module.weight, head_or_layer)
        if why is not None:
            raise CheckpointError(f"--quantization {mode}: {name}: {why}")
        module.quantize(head_or_layer, keep_codes)
