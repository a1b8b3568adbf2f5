"""Qwen2 / Qwen2.5: biases on q, k and v (none on o); a window only where use_sliding_window."""

import dataclasses

from flover.models.families._shared import Family, decoder_fields


def from_hf(raw: dict) -> dict:
    return decoder_fields(raw, windows="opt_in") | dict(qkv_bias=True, o_bias=False)


FAMILY = Family(
    name="qwen2",
    hf_architectures=("Qwen2ForCausalLM",),
    from_hf=from_hf,
    gguf_arch="qwen2",
    from_gguf=lambda file, cfg: dataclasses.replace(cfg, qkv_bias=True),
    test_config="Qwen2Config",
)
