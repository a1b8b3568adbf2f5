"""Architectures and checkpoints: `open_checkpoint(path)` reads a Hugging Face directory or a
GGUF file (models/checkpoint.py, no torch); `load_model(checkpoint, ...)` returns a ready model
(models/build.py, imported when first asked for, so that the HTTP front never loads torch)."""

from __future__ import annotations

import importlib

from flover.models.checkpoint import HFDirectory, file_quantization, load_model_config, open_checkpoint
from flover.models.families import FAMILIES, family_of, runs_natively
from flover.models.gguf_file import GGUFFile
from flover.models.model_config import CheckpointError, ModelConfig

__all__ = [
    "CheckpointError",
    "FAMILIES",
    "family_of",
    "runs_natively",
    "ModelConfig",
    "HFDirectory",
    "GGUFFile",
    "open_checkpoint",
    "file_quantization",
    "load_model",
    "load_model_config",
    "model_class",
    "pack_projections",
    "release_projections",
    "quantize_projections",
]
_LOADING = {"load_model", "model_class", "pack_projections", "release_projections", "quantize_projections"}


def __getattr__(name: str):
    if name in _LOADING:
        return getattr(importlib.import_module("flover.models.build"), name)
    raise AttributeError(f"module 'flover.models' has no attribute {name!r}")
