"""An engine's settings as the model and the machine decide them: `auto` resolved, conflicts refused.
Pure functions of the configuration and the checkpoint's description (no I/O, no state)."""

from __future__ import annotations

import dataclasses

from flover.config import EngineConfig
from flover.hardware import resolve_dtype
from flover.models import ModelConfig, runs_natively

DEFAULT_MAX_SEQ_LEN = 2048  # when neither the user nor a shorter model says otherwise


def native_step_may_run(native_forward: str, cfg: ModelConfig) -> bool:
    """Whether the native step may run this model (it can still decline: no compiler, ...): what
    `--dtype auto` and `--quantization auto` decide by, here and in the CLI."""
    return native_forward == "auto" and runs_natively(cfg)


def bfloat16_by_default(native_forward: str, cfg: ModelConfig, file_quantization: str) -> bool:
    """Whether `--dtype auto` takes bfloat16 on a CPU whose native step only widens it (no bfloat16
    arithmetic): where the native step runs the model, except an embeddings-only model (a text
    encoder, EmbeddingGemma) from 16- or 32-bit weights. Its inputs are all prompt, compute-bound,
    so widened bfloat16 would save no time and cost precision; a quantized file's codes take
    bfloat16 inputs."""
    return native_step_may_run(native_forward, cfg) and (not cfg.embeds_only or file_quantization == "file")


def resolve_config(config: EngineConfig, cfg: ModelConfig, file_quantization: str) -> EngineConfig:
    """`config` with dtype and quantization decided (no "auto" past here); ValueError when they
    conflict. `file_quantization`: what a quantized file's own codes allow ("file" or "none")."""
    native_step = native_step_may_run(config.native_forward, cfg)
    asked = config.dtype
    bf16 = bfloat16_by_default(config.native_forward, cfg, file_quantization)
    config = dataclasses.replace(config, dtype=resolve_dtype(config.dtype, config.device, bf16))
    if config.quantization == "auto":
        native_bf16 = native_step and config.dtype == "bfloat16" and config.device == "cpu"
        config = dataclasses.replace(config, quantization=file_quantization if native_bf16 else "none")
    if config.quantization != "none" and (config.dtype != "bfloat16" or config.device != "cpu"):
        chose = " (dtype auto: this CPU has no bfloat16 kernels for this model)" if asked == "auto" else ""
        raise ValueError(
            f"quantization={config.quantization!r} runs on CPU with dtype bfloat16 "
            f"(got dtype={config.dtype!r}{chose}, device={config.device!r})"
        )
    return config


def resolve_max_seq_len(config: EngineConfig, cfg: ModelConfig, suggested: int | None = None) -> int:
    """The positions a slot holds: asked for, or the model's (`suggested` by its files, e.g. a
    sentence-transformers max_seq_length) up to DEFAULT_MAX_SEQ_LEN; never more than the model knows."""
    default = min(suggested or cfg.max_position_embeddings, cfg.max_position_embeddings, DEFAULT_MAX_SEQ_LEN)
    max_seq_len = config.max_seq_len or default
    if max_seq_len > cfg.max_position_embeddings:
        raise ValueError(
            f"max_seq_len={max_seq_len} exceeds the model's max_position_embeddings={cfg.max_position_embeddings}"
        )
    return max_seq_len
