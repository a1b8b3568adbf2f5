"""Gemma 3 (text): four norms a layer (before and after attention and the MLP), each multiplying
(1 + weight) in float32; the embeddings times sqrt(hidden); GeGLU; q and k normed per head; its
own score scale (query_pre_attn_scalar); sliding-window layers with a RoPE base of their own.
EmbeddingGemma is this model with attention both ways (use_bidirectional_attention): embeddings only."""

import dataclasses

from flover.models.families._shared import Family, rope, sizes
from flover.models.model_config import CheckpointError

SWA_PATTERN = 6  # every 6th layer global unless the file says (llama.cpp's default too)


def features(hidden: int) -> dict:
    return dict(
        qk_norm="head",
        norm_layout="sandwich",
        norm_float32=True,
        norm_offset=1.0,
        embed_scale=hidden**0.5,
        embed_scale_rounded=True,
        hidden_act="gelu_pytorch_tanh",
    )


def from_hf(raw: dict) -> dict:
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if raw.get(key) is not None:
            raise ValueError(f"{key} (Gemma 2's soft-capping) is not supported")
    layers, heads = raw["num_hidden_layers"], raw["num_attention_heads"]
    types = raw.get("layer_types") or [
        "sliding_attention" if (i + 1) % raw.get("sliding_window_pattern", SWA_PATTERN) else "full_attention"
        for i in range(layers)
    ]
    if len(types) != layers or not set(types) <= {"sliding_attention", "full_attention"}:
        raise ValueError("layer_types must name sliding_attention or full_attention for every layer")
    params = raw.get("rope_parameters") or {}
    full = params.get("full_attention") or {
        "rope_theta": raw.get("rope_theta", 1_000_000.0),
        **(raw.get("rope_scaling") or {}),
    }
    local = params.get("sliding_attention") or {"rope_theta": raw.get("rope_local_base_freq", 10_000.0)}
    if local.get("rope_type", "default") != "default":
        raise ValueError("the sliding-window layers' RoPE must be plain (rope_type default)")
    theta, scaling = rope({"rope_parameters": full})
    head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
    window = raw.get("sliding_window")
    both_ways = bool(raw.get("use_bidirectional_attention"))
    if both_ways and window:  # (EmbeddingGemma) keys less than window // 2 + 1 away on either side, as transformers
        window = window // 2 + 1
    return dict(
        **sizes(raw, head_dim, 131_072),
        **features(raw["hidden_size"]),
        tie_word_embeddings=raw.get("tie_word_embeddings", True),
        rope_theta=theta,
        rope_scaling=scaling,
        rotary_dim=head_dim,
        qkv_bias=raw.get("attention_bias", False),
        o_bias=raw.get("attention_bias", False),
        mlp_bias=False,
        sliding_windows=tuple(window if t == "sliding_attention" and window else None for t in types),
        attn_scale=float(raw.get("query_pre_attn_scalar", 256)) ** -0.5,
        local_rope_theta=float(local.get("rope_theta", 10_000.0)),
        bidirectional=both_ways,
    ) | ({"hidden_act": raw["hidden_activation"]} if raw.get("hidden_activation") else {})


def from_gguf(file, cfg):
    """As llama.cpp reads a gemma3 file: the local layers by the sliding-window pattern (an array
    of flags, or every n-th layer global: 6), their RoPE base, the score scale (1 / sqrt(head_dim);
    27B's 62 layers: of hidden / heads, the query_pre_attn_scalar the file does not store). Its
    norm weights hold w + 1 (the reader takes norm_offset off). A gemma-embedding file is
    EmbeddingGemma's: the same layers with attention both ways."""
    a, window = file.arch, cfg.sliding_windows[0]
    if file.get(f"{a}.final_logit_softcapping") is not None:
        raise CheckpointError(f"{file.path}: {a}.final_logit_softcapping (soft-capping) is not supported")
    pattern = file.get(f"{a}.attention.sliding_window_pattern", SWA_PATTERN)
    if isinstance(pattern, list):
        if len(pattern) != cfg.num_layers or not all(isinstance(f, (bool, int)) for f in pattern):
            raise CheckpointError(f"{file.path}: {a}.attention.sliding_window_pattern needs a flag per layer")
        local = [bool(f) for f in pattern]
    elif isinstance(pattern, int) and not isinstance(pattern, bool) and pattern >= 1:
        local = [i % pattern < pattern - 1 for i in range(cfg.num_layers)]
    else:
        raise CheckpointError(f"{file.path}: {a}.attention.sliding_window_pattern must be a positive integer")
    scalar = cfg.hidden_size / cfg.num_heads if cfg.num_layers == 62 else cfg.head_dim
    both_ways = a == "gemma-embedding"  # (its window as config.json's: halved as from_hf halves it)
    if both_ways and window:
        window = window // 2 + 1
    return dataclasses.replace(
        cfg,
        **features(cfg.hidden_size),
        attn_scale=float(scalar) ** -0.5,
        local_rope_theta=file.number(f"{a}.rope.freq_base_swa", 10000.0),
        sliding_windows=tuple(window if window and is_local else None for is_local in local),
        bidirectional=both_ways,
    )


FAMILY = Family(
    name="gemma3",
    hf_architectures=("Gemma3ForCausalLM", "Gemma3TextModel"),  # (the latter: EmbeddingGemma's, as it saves)
    from_hf=from_hf,
    gguf_arch="gemma3",
    gguf_other_arches=("gemma-embedding",),  # (EmbeddingGemma: attention both ways, embeddings only)
    from_gguf=from_gguf,
    gguf_names={
        "post_attention_layernorm.weight": "post_attention_norm.weight",
        "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    },
    number_fields=("query_pre_attn_scalar", "rope_local_base_freq"),
    test_config="Gemma3TextConfig",
)
