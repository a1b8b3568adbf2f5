"""Building a model from a checkpoint: the architecture's modules filled with its weights,
optionally quantized, packed for the device's GEMM or left row-major for the native step."""

from __future__ import annotations

from pathlib import Path

import torch

from flover.models.checkpoint import GGUFFile, HFDirectory, open_checkpoint
from flover.models.decoder import DecoderForCausalLM
from flover.models.families import family_of
from flover.models.gguf_grids import BLOCK_TYPES
from flover.models.layers import Linear
from flover.models.model_config import CheckpointError, ModelConfig
from flover.models.quant import can_quantize
from flover.models.safetensors_reader import load_weights
from flover.models.stage_layout import StageLayout
from flover.models.tp_layout import TPLayout


def model_class(cfg: ModelConfig):
    """The graph of the model's family (models/decoder.py for every family but GPT-J)."""
    return family_of(cfg).decoder_class()


def load_model(
    checkpoint: str | HFDirectory | GGUFFile,
    dtype: torch.dtype,
    device: torch.device,
    max_len: int,
    cfg: ModelConfig | None = None,
    tp: TPLayout | None = None,
    comm=None,
    pack_hint: int = 32,
    quantization: str = "none",
    pack: bool = True,
    stage: StageLayout | None = None,
) -> torch.nn.Module:
    """Build the model (this rank's shard of it), fill it from the checkpoint, optionally give the
    projections a weight-only quantized copy (models/quant.py), and repack the projection weights
    for the device's fastest GEMM (`pack_hint`: typical rows per GEMM). `pack=False` leaves them
    row-major (and int4's codes unpacked) for the native step (flover/native/forward.py), which
    makes copies of its own; the caller then calls pack_projections or release_projections.
    `stage`: a pipeline stage's part of the model only (models/stage_layout.py)."""
    if isinstance(checkpoint, (str, Path)):
        checkpoint = open_checkpoint(checkpoint)
    cfg = cfg or checkpoint.model_config()
    checkpoint.check_tensors(cfg)
    tp = tp or TPLayout.build(cfg)
    if stage is not None and stage.count > 1:
        if model_class(cfg) is not DecoderForCausalLM:
            raise CheckpointError(f"{cfg.architecture}: pipeline stages (--pp) run models/decoder.py's families only")
        model = DecoderForCausalLM(cfg, tp, comm, max_len, dtype, device, stage)
    else:
        model = model_class(cfg)(cfg, tp, comm, max_len, dtype, device)
    if quantization == "file" and not isinstance(checkpoint, GGUFFile):
        raise CheckpointError(f"--quantization file keeps a GGUF file's codes; {checkpoint.path} is not one")
    with torch.no_grad():
        reader = checkpoint.reader(cfg)
        if getattr(model, "per_layer", None) is not None:  # (Gemma 4: its big table left in the file)
            model.per_layer.keep_codes(reader)
        take = _quantize_as_read(model, quantization, not pack, reader) if quantization != "none" else None
        load_weights(reader, model.weight_specs(), take)
        if quantization != "none":
            head = not (isinstance(checkpoint, GGUFFile) and checkpoint.head_is_quantized())
            quantize_projections(model, quantization, keep_codes=not pack, head=head)  # the LM head
    if pack:
        pack_projections(model, pack_hint)
    if isinstance(checkpoint, GGUFFile):
        checkpoint.drop_resident_pages()
    return model.eval()


def pack_projections(model: torch.nn.Module, pack_hint: int = 32) -> None:
    """Repack every projection for the device's GEMM (the row-major weight is released) and drop
    int4 codes kept for the native step."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, Linear):
                if module.quantized is not None and module.quantized.mode == "file":
                    module.quantized = None  # only the native step runs a file's codes
                elif module.quantized is not None:
                    module.quantized.codes = None
                module.pack(pack_hint)


def release_projections(model: torch.nn.Module) -> None:
    """Release every projection's weights (the native step holds copies of its own, and runs
    every iteration): the PyTorch forward can no longer run (Linear.forward says so)."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.release()


def _quantize_as_read(model: torch.nn.Module, mode: str, keep_codes: bool, reader):
    """load_weights' `take`: every layer projection quantized from its values as read, before
    they round to the model's 16 bits. A GGUF file's tensors keep their own grids (`read_grid`):
    every one under "file" (the LM head's too, where its blocks are of those types), the 4-bit
    ones (Q4_0, Q4_1, Q4_K) under int4."""
    owners = {
        id(m.weight): (name, m)
        for name, m in model.named_modules()
        if isinstance(m, Linear) and (name != "lm_head" or mode == "file")
    }

    def take(spec, values: torch.Tensor) -> bool:
        if id(spec.param) not in owners:
            return False
        name, module = owners[id(spec.param)]
        if name == "lm_head":  # "file": a head in blocks keeps them too (else quantize_projections decides)
            grid = reader.read_grid(spec.sources[0]) if hasattr(reader, "read_grid") else None
            if grid is None:
                return False
            module.quantize(mode, keep_codes, values=values, grids=[grid])
            return True
        why = can_quantize(values, mode)
        if why is not None:
            raise CheckpointError(f"--quantization {mode}: {name}: {why}")
        grids = [reader.read_grid(src) for src in spec.sources] if hasattr(reader, "read_grid") else []
        if mode == "file":
            if not grids or any(g is None for g in grids):
                src = spec.sources[[g is None for g in grids].index(True)] if grids else spec.sources[0]
                raise CheckpointError(
                    f"--quantization file: {src.name} is not in blocks whose codes flover runs "
                    f"(it runs {', '.join(BLOCK_TYPES)})"
                )
            module.quantize(mode, keep_codes, values=values, grids=grids)
        elif mode == "int4" and grids and all(g is not None and g.bits == 4 for g in grids):
            module.quantize(mode, keep_codes, grids=grids)
        else:
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
        if mode == "file" and name != "lm_head":
            raise CheckpointError(f"--quantization file: {name} was not read from the file's blocks")
        head_or_layer = "int8" if name == "lm_head" else mode
        why = can_quantize(module.weight, head_or_layer)
        if why is not None:
            raise CheckpointError(f"--quantization {mode}: {name}: {why}")
        module.quantize(head_or_layer, keep_codes)
