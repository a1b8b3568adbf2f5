"""Architectures and the checkpoint loader: `load_model(dir, ...)` returns a ready model."""

from __future__ import annotations

import torch

from flover.models.config import LLAMA_FAMILY, CheckpointError, ModelConfig, load_model_config
from flover.models.gptj import GPTJForCausalLM
from flover.models.layers import Linear
from flover.models.llama import LlamaForCausalLM
from flover.models.loader import CheckpointReader, load_weights
from flover.parallel.layout import TPLayout

__all__ = ["CheckpointError", "ModelConfig", "load_model", "load_model_config"]


def model_class(cfg: ModelConfig):
    return LlamaForCausalLM if cfg.architecture in LLAMA_FAMILY else GPTJForCausalLM


def load_model(model_dir: str, dtype: torch.dtype, device: torch.device, max_len: int,
               cfg: ModelConfig | None = None, tp: TPLayout | None = None, comm=None,
               pack_hint: int = 32) -> torch.nn.Module:
    """Build the model (this rank's shard of it) for `model_dir`, fill it from the safetensors
    files, and repack the projection weights for the device's fastest GEMM (`pack_hint`: typical
    rows per GEMM)."""
    cfg = cfg or load_model_config(model_dir)
    tp = tp or TPLayout.build(cfg)
    reader = CheckpointReader(model_dir)
    model = model_class(cfg)(cfg, tp, comm, max_len, dtype, device)
    with torch.no_grad():
        load_weights(reader, model.weight_specs())
        for module in model.modules():
            if isinstance(module, Linear):
                module.pack(pack_hint)
    return model.eval()
