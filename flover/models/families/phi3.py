"""Phi-3 / Phi-4-mini: q, k, v stored as one qkv_proj and gate, up as one gate_up_proj; RoPE over
partial_rotary_factor of each head, LongRoPE's per-dimension factors; a window over every layer."""

import dataclasses

from flover.models.families._shared import Family, decoder_fields, eos_pad
from flover.models.model_config import CheckpointError


def from_gguf(file, cfg):
    """As llama.cpp reads a phi3 file: RoPE over rope.dimension_count dims of each head, and
    LongRoPE's factors as two tensors (rope_factors_long / _short.weight) with the original length
    and the attention factor in the metadata."""
    a = file.arch
    rotary = file.integer(f"{a}.rope.dimension_count", cfg.head_dim)
    long, short = (file.tensors.get(f"rope_factors_{kind}.weight") for kind in ("long", "short"))
    scaling = None
    if long is not None or short is not None:
        if long is None or short is None:
            raise CheckpointError(f"{file.path}: LongRoPE needs rope_factors_long.weight and rope_factors_short.weight")
        scaling = dict(
            rope_type="longrope",
            long_factor=list(file.rope_factors("rope_factors_long.weight", rotary // 2)),
            short_factor=list(file.rope_factors("rope_factors_short.weight", rotary // 2)),
            original_max_position_embeddings=file.integer(f"{a}.rope.scaling.original_context_length", required=True),
            max_position_embeddings=cfg.max_position_embeddings,
            attention_factor=file.number(f"{a}.rope.scaling.attn_factor", 1.0),
        )
    return dataclasses.replace(cfg, rotary_dim=rotary, rope_scaling=scaling, fused_projections=True)


FAMILY = Family(
    name="phi3",
    hf_architectures=("Phi3ForCausalLM",),
    from_hf=lambda raw: decoder_fields(raw, windows="every_layer") | dict(fused_projections=True),
    gguf_arch="phi3",
    from_gguf=from_gguf,
    gguf_names={"self_attn.qkv_proj.weight": "attn_qkv.weight", "mlp.gate_up_proj.weight": "ffn_up.weight"},
    test_config="Phi3Config",
    test_kwargs=eos_pad,
)
