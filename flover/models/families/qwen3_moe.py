"""Qwen3-MoE: Qwen3's attention; experts (a softmax over all in float32, the top k, renormalised
where norm_topk_prob) in every decoder_sparse_step-th layer not in mlp_only_layers."""

import dataclasses

from flover.models.families import qwen3
from flover.models.families._shared import Family, expert_counts, own_head_dim
from flover.models.model_config import MoEConfig, check_sizes


def from_hf(raw: dict) -> dict:
    layers, step = raw["num_hidden_layers"], raw.get("decoder_sparse_step", 1)
    experts, top_k = expert_counts(raw)
    check_sizes({"moe_intermediate_size": raw["moe_intermediate_size"]}, "config.json")
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"decoder_sparse_step {step!r} must be a positive integer")
    dense = set(raw.get("mlp_only_layers") or ())
    moe = MoEConfig(
        experts=experts,
        top_k=top_k,
        intermediate=raw["moe_intermediate_size"],
        norm_topk_prob=raw.get("norm_topk_prob") or False,
        layers=frozenset(i for i in range(layers) if i not in dense and (i + 1) % step == 0),
    )
    return qwen3.from_hf(raw) | dict(moe=moe)


def from_gguf(file, cfg):
    """Its experts as every GGUF file's (gguf_file.GGUFFile._experts); it must have them."""
    if cfg.moe is None:
        file.require(f"{file.arch}.expert_count")
    return dataclasses.replace(cfg, qk_norm="head")


FAMILY = Family(
    name="qwen3_moe",
    hf_architectures=("Qwen3MoeForCausalLM",),
    from_hf=from_hf,
    gguf_arch="qwen3moe",
    from_gguf=from_gguf,
    test_config="Qwen3MoeConfig",
    test_kwargs=own_head_dim,
)
