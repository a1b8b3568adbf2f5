"""gpt-oss: attention sinks (a learned logit per head in each softmax's denominator), q/k/v/o
biases, a window every other layer, YaRN; experts in every layer: a router with a bias taking a
softmax over its top k, experts with biases and the clamped SwiGLU, stacked in the checkpoint."""

import dataclasses
import math

from flover.models.families._shared import Family, check_yarn, decoder_fields, expert_counts, own_head_dim
from flover.models.model_config import CheckpointError, MoEConfig

ROUTING = dict(router="router", router_bias=True, softmax_after_topk=True, expert_bias=True, norm_topk_prob=False)


def from_hf(raw: dict) -> dict:
    experts, top_k = expert_counts(raw)
    limit, alpha = raw.get("swiglu_limit", 7.0), raw.get("swiglu_alpha", 1.702)
    if not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0 for v in (limit, alpha)
    ):
        raise ValueError(f"swiglu_limit {limit!r} and swiglu_alpha {alpha!r} must be positive numbers")
    moe = MoEConfig(
        experts=experts,
        top_k=top_k,
        intermediate=raw["intermediate_size"],
        layers=frozenset(range(raw["num_hidden_layers"])),
        swiglu_limit=float(limit),
        swiglu_alpha=float(alpha),
        stacked="interleaved",
        **ROUTING,
    )
    return decoder_fields(raw) | dict(moe=moe, attn_sinks=True)


def from_gguf(file, cfg):
    """As llama.cpp reads a gpt-oss file: a window every other layer from the first (its pattern
    of 2), YaRN (the factor and original length in the metadata; its correction range not
    truncated, as gpt-oss's own config says), the clamped SwiGLU at llama.cpp's fixed 7 and 1.702."""
    a, window = file.arch, cfg.sliding_windows[0]
    if cfg.moe is None:
        raise CheckpointError(f"{file.path}: a gpt-oss file without {a}.expert_count")
    scaling = None
    if file.get(f"{a}.rope.scaling.type") == "yarn":
        scaling = dict(
            rope_type="yarn",
            factor=file.number(f"{a}.rope.scaling.factor", None),
            original_max_position_embeddings=file.integer(f"{a}.rope.scaling.original_context_length", required=True),
            beta_fast=file.number(f"{a}.rope.scaling.yarn_beta_fast", 32.0),
            beta_slow=file.number(f"{a}.rope.scaling.yarn_beta_slow", 1.0),
            truncate=False,
        )
        check_yarn(scaling, str(file.path))
    moe = dataclasses.replace(cfg.moe, swiglu_limit=7.0, swiglu_alpha=1.702, **ROUTING)
    windows = tuple(window if i % 2 == 0 else None for i in range(cfg.num_layers)) if window else cfg.sliding_windows
    return dataclasses.replace(
        cfg, qkv_bias=True, o_bias=True, attn_sinks=True, rope_scaling=scaling, sliding_windows=windows, moe=moe
    )


FAMILY = Family(
    name="gpt_oss",
    hf_architectures=("GptOssForCausalLM",),
    from_hf=from_hf,
    gguf_arch="gpt-oss",
    gguf_rope_types=("none", "linear", "yarn"),
    from_gguf=from_gguf,
    gguf_names={
        "post_attention_layernorm.weight": "post_attention_norm.weight",
        "self_attn.o_proj.bias": "attn_output.bias",
        "self_attn.sinks": "attn_sinks.weight",
    },
    number_fields=("swiglu_limit", "swiglu_alpha"),
    test_config="GptOssConfig",
    test_kwargs=own_head_dim,
)
