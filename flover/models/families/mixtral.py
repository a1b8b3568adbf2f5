"""Mixtral: Mistral's attention; experts in every layer (`block_sparse_moe`, w1 w3 w2), the top k
renormalised, the routing weights multiplied in float32. llama.cpp writes it as a llama file
with experts (ffn_*_exps)."""

import dataclasses

from flover.models.families._shared import Family, decoder_fields, expert_counts
from flover.models.model_config import MoEConfig


def from_hf(raw: dict) -> dict:
    experts, top_k = expert_counts(raw)
    moe = MoEConfig(
        experts=experts,
        top_k=top_k,
        intermediate=raw["intermediate_size"],
        norm_topk_prob=True,
        layers=frozenset(range(raw["num_hidden_layers"])),
        block="block_sparse_moe",
        projections=("w1", "w3", "w2"),
        weights_float32=True,
    )
    return decoder_fields(raw, windows="every_layer") | dict(moe=moe)


FAMILY = Family(
    name="mixtral",
    hf_architectures=("MixtralForCausalLM",),
    from_hf=from_hf,
    gguf_arch="llama",
    gguf_claims=lambda file: file.has_experts(),
    gguf_qk_permuted=True,
    from_gguf=lambda file, cfg: dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, weights_float32=True)),
    test_config="MixtralConfig",
)
