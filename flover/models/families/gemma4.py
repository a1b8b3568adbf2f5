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

from flover.models.families._shared import Family, sizes
from flover.models.model_config import MoEConfig, PerLayerInputConfig, check_sizes

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
    native=False,
    test_config="Gemma4TextConfig",
    test_kwargs=test_kwargs,
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
