"""Granite 3 (IBM): Llama with four scalars of its own: the embeddings times embedding_multiplier,
each block's output times residual_multiplier before the residual add, the scores times
attention_multiplier (in place of 1 / sqrt(head_dim)), the logits divided by logits_scaling.
llama.cpp's converter permutes Q and K's rows (as Llama's) and writes the scalars as
granite.embedding_scale, .residual_scale, .attention.scale and .logit_scale."""

import dataclasses

from flover.models.families._shared import Family, decoder_fields

SCALES = dict(  # ModelConfig's field -> (config.json's name, the GGUF key after "granite.")
    embed_scale=("embedding_multiplier", "embedding_scale"),
    residual_scale=("residual_multiplier", "residual_scale"),
    attn_scale=("attention_multiplier", "attention.scale"),
    logit_scale=("logits_scaling", "logit_scale"),
)


def from_hf(raw: dict) -> dict:
    return decoder_fields(raw) | {feature: raw.get(name) for feature, (name, _) in SCALES.items()}


def from_gguf(file, cfg):
    """A scale the file leaves out is 1 (the converter writes only those set; a missing attention
    scale: 1 / sqrt(head_dim), as llama.cpp's)."""
    scales = {feature: file.get(f"{file.arch}.{key}") for feature, (_, key) in SCALES.items()}
    scales = {feature: file.number(f"{file.arch}.{SCALES[feature][1]}", 1.0) for feature, v in scales.items() if v}
    return dataclasses.replace(cfg, **scales)


def gguf_metadata(raw: dict) -> dict:
    """As the converter writes them: each scale config.json sets (and is not 0)."""
    return {f"granite.{key}": float(raw[name]) for name, key in SCALES.values() if raw.get(name)}


FAMILY = Family(
    name="granite",
    hf_architectures=("GraniteForCausalLM",),
    from_hf=from_hf,
    gguf_arch="granite",
    gguf_qk_permuted=True,
    from_gguf=from_gguf,
    number_fields=tuple(name for name, _ in SCALES.values()),
    test_config="GraniteConfig",
    test_gguf_metadata=gguf_metadata,
)
