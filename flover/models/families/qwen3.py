"""Qwen3: Qwen2 without biases, an RMSNorm over each head of q and of k before RoPE."""

import dataclasses

from flover.models.families._shared import Family, decoder_fields, own_head_dim


def from_hf(raw: dict) -> dict:
    return decoder_fields(raw, windows="opt_in") | dict(qk_norm="head")


FAMILY = Family(
    name="qwen3",
    hf_architectures=("Qwen3ForCausalLM",),
    from_hf=from_hf,
    gguf_arch="qwen3",
    from_gguf=lambda file, cfg: dataclasses.replace(cfg, qk_norm="head"),
    test_config="Qwen3Config",
    test_kwargs=own_head_dim,
)
