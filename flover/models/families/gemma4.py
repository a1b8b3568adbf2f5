"""Gemma 4 (text): Gemma 3's four norms a layer (plain weights, every norm in float32), GeGLU, the
embeddings times sqrt(hidden), q and k normed per head and the values too (no weight), scores
unscaled; sliding-window layers with their own RoPE base, full-attention layers with heads of
their own width (512) and kv heads (with attention_k_eq_v: fewer, their values their keys'
projection), RoPE over a quarter of each such head ("proportional": the other pairs do not
turn); each layer's output times a learned scalar; the logits soft-capped.
E-series (E2B, E4B): per-layer inputs (models/per_layer_inputs.py); the last num_kv_shared_layers
layers read the KV of the last earlier layer of their kind and store none (their MLP twice as
wide with use_double_wide_mlp). 26B-A4B: experts beside every layer's MLP (enable_moe_block).
Hub checkpoints are Gemma4ForConditionalGeneration (text_config; model.language_model.*, served as
model.*); the vision and audio towers are not read."""

import dataclasses
import re

from flover.models.families._shared import Family, sizes
from flover.models.model_config import CheckpointError, MoEConfig, PerLayerInputConfig, check_sizes

KINDS = ("sliding_attention", "full_attention")


def layer_types(raw: dict) -> list[str]:
    layers = raw["num_hidden_layers"]
    types = raw.get("layer_types") or [
        "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)
    ]
    if len(types) != layers or not set(types) <= set(KINDS):
        raise ValueError("layer_types must name sliding_attention or full_attention for every layer")
    return types[:-1] + ["full_attention"]  # (the last layer is always global, as transformers forces it)


def global_sizes(raw: dict, types: list[str]) -> tuple[int, int]:
    """(head_dim, kv heads) of the full-attention layers: a saved config's per_layer_config, else
    global_head_dim and (with attention_k_eq_v) num_global_key_value_heads."""
    kv = raw.get("num_key_value_heads") or raw["num_attention_heads"]
    overrides = raw.get("per_layer_config")
    if overrides is None:
        global_kv = raw.get("num_global_key_value_heads") if raw.get("attention_k_eq_v") else None
        return raw.get("global_head_dim", 512), global_kv or kv
    if not isinstance(overrides, dict):
        raise ValueError("per_layer_config must map layers to their sizes")
    found = set()
    for n, kind in enumerate(types):
        entry = overrides.get(str(n), overrides.get(n, {}))
        if not isinstance(entry, dict) or not set(entry) <= {"head_dim", "num_key_value_heads"}:
            raise ValueError(f"per_layer_config of layer {n}: only head_dim and num_key_value_heads are read")
        if kind == "sliding_attention" and entry:
            raise ValueError(f"per_layer_config of layer {n}: a sliding-window layer's sizes are the model's")
        if kind == "full_attention":
            found.add((entry.get("head_dim", raw.get("head_dim")), entry.get("num_key_value_heads", kv)))
    if len(found) != 1:
        raise ValueError("per_layer_config: every full-attention layer must have the same head_dim and kv heads")
    return found.pop()


def kv_sources(raw: dict, types: list[str]) -> tuple[int, ...]:
    """Each layer's KV: its own, or (the last num_kv_shared_layers) the last earlier layer of its kind's."""
    layers, shared = raw["num_hidden_layers"], raw.get("num_kv_shared_layers", 0) or 0
    if isinstance(shared, bool) or not isinstance(shared, int) or not 0 <= shared < layers:
        raise ValueError(f"num_kv_shared_layers {shared!r} must be an integer in [0, {layers})")
    first = layers - shared
    if shared and not set(types[first:]) <= set(types[:first]):
        raise ValueError("a layer sharing KV needs an earlier layer of its kind that keeps its own")
    last = {kind: max((n for n in range(first) if types[n] == kind), default=None) for kind in KINDS}
    return tuple(n if n < first else last[types[n]] for n in range(layers))


def rope_parameters(raw: dict) -> tuple[dict, dict]:
    """(the full-attention layers', the sliding-window layers') RoPE parameters."""
    params = raw.get("rope_parameters") or {}
    full = params.get("full_attention") or {"rope_type": "proportional", "partial_rotary_factor": 0.25}
    local = params.get("sliding_attention") or {}
    if full.get("rope_type", "default") not in ("default", "proportional"):
        raise ValueError(f"the full-attention layers' rope_type {full.get('rope_type')!r} (default, proportional)")
    if local.get("rope_type", "default") != "default" or local.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("the sliding-window layers' RoPE must be plain over whole heads (rope_type default)")
    for p in (full, local):
        for key in ("rope_theta", "partial_rotary_factor", "factor"):
            value = p.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                raise ValueError(f"rope_parameters {key} must be a positive number, got {value!r}")
    return full, local


def moe(raw: dict, layers: int) -> MoEConfig | None:
    if not raw.get("enable_moe_block"):
        return None
    counts = {k: raw.get(k) for k in ("num_experts", "top_k_experts", "moe_intermediate_size")}
    check_sizes(counts, "config.json")
    if counts["top_k_experts"] > counts["num_experts"]:
        raise ValueError(f"top_k_experts {counts['top_k_experts']} of {counts['num_experts']} experts")
    return MoEConfig(
        experts=counts["num_experts"],
        top_k=counts["top_k_experts"],
        intermediate=counts["moe_intermediate_size"],
        norm_topk_prob=True,
        layers=frozenset(range(layers)),
        block="",
        router="router.proj",
        weights_float32=True,
        stacked="halves",
        beside_mlp=True,
        router_scaled=True,
    )


FEATURES = dict(
    qk_norm="head",
    v_norm=True,
    norm_layout="sandwich",
    norm_float32=True,
    norm_exact_float32=True,
    attn_scale=1.0,
    layer_scalar=True,
)


def from_hf(raw: dict) -> dict:
    if raw.get("use_bidirectional_attention") == "all":
        raise ValueError("use_bidirectional_attention 'all' (an encoder) is not a generation model")
    types = layer_types(raw)
    layers, head_dim = raw["num_hidden_layers"], raw.get("head_dim", 256)
    global_dim, global_kv = global_sizes(raw, types)
    full, local = rope_parameters(raw)
    sources = kv_sources(raw, types)
    window = raw.get("sliding_window", 512)
    width = raw.get("hidden_size_per_layer_input") or 0
    scaling = None
    if full.get("rope_type") == "proportional":
        scaling = {"rope_type": "proportional", "partial_rotary_factor": full.get("partial_rotary_factor", 1.0)}
        scaling |= {"factor": full["factor"]} if full.get("factor") is not None else {}
    return dict(
        **sizes(raw, head_dim, 131_072),
        **FEATURES,
        hidden_act=raw.get("hidden_activation") or "gelu_pytorch_tanh",
        embed_scale=raw["hidden_size"] ** 0.5,
        embed_scale_rounded=True,
        tie_word_embeddings=raw.get("tie_word_embeddings", True),
        rope_theta=float(full.get("rope_theta", 1_000_000.0)),
        rope_scaling=scaling,
        rotary_dim=head_dim,
        local_rope_theta=float(local.get("rope_theta", 10_000.0)),
        qkv_bias=raw.get("attention_bias", False),
        o_bias=raw.get("attention_bias", False),
        mlp_bias=False,
        sliding_windows=tuple(window if t == "sliding_attention" else None for t in types),
        global_head_dim=global_dim,
        global_kv_heads=global_kv,
        global_k_eq_v=bool(raw.get("attention_k_eq_v")),
        kv_sources=sources if any(s != n for n, s in enumerate(sources)) else (),
        wide_mlp_layers=frozenset(n for n, s in enumerate(sources) if s != n and raw.get("use_double_wide_mlp")),
        per_layer_input=PerLayerInputConfig(width, raw.get("vocab_size_per_layer_input", raw["vocab_size"]))
        if width
        else None,
        final_softcap=raw.get("final_logit_softcapping"),
        moe=moe(raw, layers),
    )


GGUF_NAMES = {
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "pre_feedforward_layernorm_2.weight": "pre_ffw_norm_2.weight",
    "post_feedforward_layernorm_1.weight": "post_ffw_norm_1.weight",
    "post_feedforward_layernorm_2.weight": "post_ffw_norm_2.weight",
    "per_layer_input_gate.weight": "inp_gate.weight",
    "per_layer_projection.weight": "proj.weight",
    "post_per_layer_input_norm.weight": "post_norm.weight",
    "layer_scalar": "layer_output_scale.weight",
    "router.proj.weight": "ffn_gate_inp.weight",
    "router.scale": "ffn_gate_inp.scale",
    "router.per_expert_scale": "ffn_down_exps.scale",
}
GGUF_GLOBAL_NAMES = {
    "model.embed_tokens_per_layer.weight": "per_layer_token_embd.weight",
    "model.per_layer_model_projection.weight": "per_layer_model_proj.weight",
    "model.per_layer_projection_norm.weight": "per_layer_proj_norm.weight",
}


def per_layer(file, key: str, count: int, default: int) -> list[int]:
    """A per-layer integer field (an array), or one value for every layer."""
    value = file.get(key, default)
    values = value if isinstance(value, list) else [value] * count
    if len(values) != count or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
        raise CheckpointError(f"{file.path}: metadata {key!r} must be a positive integer, or one per layer")
    return values


def from_gguf(file, cfg):
    """As llama.cpp reads a gemma4 file: the sliding layers by the pattern (flags), their head
    size (key_length_swa; key_length is the full layers'), the kv heads and MLP widths per layer,
    the full layers' RoPE through rope_freqs (1 for the turning pairs, 1e30 for the others), the
    shared layers (shared_kv_layers), per-layer inputs (embedding_length_per_layer_input)."""
    a, layers = file.arch, cfg.num_layers
    pattern = file.get(f"{a}.attention.sliding_window_pattern")
    if not isinstance(pattern, list) or len(pattern) != layers or not all(isinstance(f, bool) for f in pattern):
        raise CheckpointError(f"{file.path}: {a}.attention.sliding_window_pattern needs a flag per layer")
    types = ["sliding_attention" if f else "full_attention" for f in pattern]
    head_dim = file.integer(f"{a}.attention.key_length_swa", required=True)
    kv = per_layer(file, f"{a}.attention.head_count_kv", layers, cfg.num_heads)
    widths = per_layer(file, f"{a}.feed_forward_length", layers, cfg.intermediate_size)
    raw = {"num_hidden_layers": layers, "num_kv_shared_layers": file.integer(f"{a}.attention.shared_kv_layers", 0)}
    try:
        sources = kv_sources(raw, types)
    except ValueError as e:
        raise CheckpointError(f"{file.path}: {e}") from None
    global_kv = {kv[n] for n, t in enumerate(types) if t == "full_attention"}
    if (
        len(global_kv) != 1
        or len({kv[n] for n, t in enumerate(types) if t != "full_attention"} | {cfg.num_kv_heads}) != 1
    ):
        raise CheckpointError(f"{file.path}: {a}.attention.head_count_kv must be one count per kind of layer")
    wide = frozenset(n for n, w in enumerate(widths) if w != cfg.intermediate_size)
    if any(widths[n] != 2 * cfg.intermediate_size for n in wide):
        raise CheckpointError(f"{file.path}: {a}.feed_forward_length: a layer's MLP is 1 or 2 times the first's")
    width = file.integer(f"{a}.embedding_length_per_layer_input", 0)
    table = file.tensors.get("per_layer_token_embd.weight")
    if width and table is None:
        raise CheckpointError(f"{file.path}: per-layer inputs of {width} but no per_layer_token_embd.weight")
    window = file.integer(f"{a}.attention.sliding_window", required=True)
    global_kv_heads = global_kv.pop()
    moe = cfg.moe and dataclasses.replace(
        cfg.moe, block="", router="router.proj", weights_float32=True, beside_mlp=True, router_scaled=True
    )
    return dataclasses.replace(
        cfg,
        **FEATURES,
        hidden_act="gelu_pytorch_tanh",
        embed_scale=cfg.hidden_size**0.5,
        embed_scale_rounded=True,
        head_dim=head_dim,
        rotary_dim=head_dim,
        local_rope_theta=file.number(f"{a}.rope.freq_base_swa", 10_000.0),
        sliding_windows=tuple(window if t == "sliding_attention" else None for t in types),
        global_head_dim=cfg.head_dim,
        global_kv_heads=global_kv_heads,
        # (values its keys' where a full layer keeping KV has no attn_v)
        global_k_eq_v=any(f"blk.{n}.attn_v.weight" not in file.tensors for n in range(layers) if sources[n] == n),
        kv_sources=sources if any(s != n for n, s in enumerate(sources)) else (),
        wide_mlp_layers=wide,
        per_layer_input=PerLayerInputConfig(width, table.shape[0]) if width and table else None,
        final_softcap=file.get(f"{a}.final_logit_softcapping"),
        moe=moe,
    )


def test_gguf_metadata(config: dict) -> dict:
    """What llama.cpp's converter writes of a config.json beyond the common keys."""
    fields = from_hf(config)
    layers, types = config["num_hidden_layers"], layer_types(config)
    full, local = rope_parameters(config)
    kv = [fields["global_kv_heads"] if t == "full_attention" else fields["num_kv_heads"] for t in types]
    widths = [config["intermediate_size"] * (2 if n in fields["wide_mlp_layers"] else 1) for n in range(layers)]
    out = {
        "gemma4.feed_forward_length": widths if fields["wide_mlp_layers"] else config["intermediate_size"],
        "gemma4.attention.head_count_kv": kv if len(set(kv)) > 1 else kv[0],
        "gemma4.attention.key_length": fields["global_head_dim"],
        "gemma4.attention.value_length": fields["global_head_dim"],
        "gemma4.attention.key_length_swa": fields["head_dim"],
        "gemma4.attention.value_length_swa": fields["head_dim"],
        "gemma4.attention.sliding_window": config["sliding_window"],
        "gemma4.attention.sliding_window_pattern": [t == "sliding_attention" for t in types],
        "gemma4.attention.shared_kv_layers": config.get("num_kv_shared_layers") or 0,
        "gemma4.embedding_length_per_layer_input": config.get("hidden_size_per_layer_input") or 0,
        "gemma4.rope.freq_base": float(full.get("rope_theta", 1_000_000.0)),
        "gemma4.rope.freq_base_swa": float(local.get("rope_theta", 10_000.0)),
        "gemma4.rope.dimension_count": fields["global_head_dim"],
        "gemma4.rope.dimension_count_swa": fields["head_dim"],
    }
    if config.get("final_logit_softcapping"):
        out["gemma4.final_logit_softcapping"] = float(config["final_logit_softcapping"])
    if fields["moe"] is not None:
        out["gemma4.expert_count"] = fields["moe"].experts
        out["gemma4.expert_used_count"] = fields["moe"].top_k
        out["gemma4.expert_feed_forward_length"] = fields["moe"].intermediate
    return out


def test_gguf_tensors(config: dict, tensors: dict) -> dict:
    """The converter's extra tensors: the full layers' RoPE factors (1 for the pairs that turn,
    1e30 for the others) and each layer's experts, stacked as transformers stacks them, under their
    GGUF names."""
    import numpy as np

    fields = from_hf(config)
    half = fields["global_head_dim"] // 2
    turned = int(fields["global_head_dim"] * fields["rope_scaling"]["partial_rotary_factor"] / 2)
    out = {"rope_freqs.weight": np.array([1.0] * turned + [1e30] * (half - turned), dtype=np.float32)}
    for name, x in tensors.items():
        m = re.match(r"model\.layers\.(\d+)\.experts\.(gate_up_proj|down_proj)$", name)
        if m:
            name = f"blk.{m.group(1)}.ffn_{'gate_up' if m.group(2) == 'gate_up_proj' else 'down'}_exps.weight"
        out[name] = x
    return out


def test_kwargs(preset: dict, eos_id: int) -> dict:
    """Five layers of the preset's width: sliding, sliding, full, then two reading the KV of the
    last sliding and the full one (their MLPs twice as wide); heads of 16, global ones of 32 and
    one kv head; per-layer inputs of 8; a window of 8; logits capped at 30."""
    return dict(
        hidden_size=preset["hidden_size"],
        num_hidden_layers=5,
        num_attention_heads=preset["num_heads"],
        num_key_value_heads=preset["num_kv_heads"],
        intermediate_size=preset["intermediate_size"],
        max_position_embeddings=preset["max_position_embeddings"],
        pad_token_id=eos_id,
        head_dim=16,
        global_head_dim=32,
        sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
        },
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=preset["vocab_size"],
        num_kv_shared_layers=2,
        use_double_wide_mlp=True,
        final_logit_softcapping=30.0,
    )


FAMILY = Family(
    name="gemma4",
    hf_architectures=("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"),
    from_hf=from_hf,
    gguf_arch="gemma4",
    from_gguf=from_gguf,
    gguf_names=GGUF_NAMES,
    gguf_global_names=GGUF_GLOBAL_NAMES,
    test_config="Gemma4TextConfig",
    test_kwargs=test_kwargs,
    test_gguf_metadata=test_gguf_metadata,
    test_gguf_tensors=test_gguf_tensors,
    number_fields=(
        "global_head_dim",
        "num_global_key_value_heads",
        "hidden_size_per_layer_input",
        "vocab_size_per_layer_input",
        "num_kv_shared_layers",
        "final_logit_softcapping",
        "num_experts",
        "top_k_experts",
        "moe_intermediate_size",
    ),
)
