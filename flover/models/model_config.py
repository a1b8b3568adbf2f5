"""One normalized view of a Hugging Face `config.json` (transformers v4 and v5 layouts)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

LLAMA_FAMILY = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "SmolLM3ForCausalLM",
    "Olmo2ForCausalLM",
    "Phi3ForCausalLM",
    "Gemma3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "GptOssForCausalLM",
)
SUPPORTED = LLAMA_FAMILY + ("GPTJForCausalLM",)


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be served; the message names the file."""


# What a model file may claim (well beyond any real model): more is refused before anything is
# built from it, so a careless or hostile header cannot make flover allocate gigabytes.
MAX_LAYERS = 1024
MAX_WIDTH = 1 << 18  # hidden, intermediate, head and window sizes
MAX_VOCAB = 1 << 22
MAX_POSITIONS = 1 << 24
MAX_EXPERTS = 1024  # (Qwen3-Next has 512)
SIZE_BOUNDS = {
    "experts": MAX_EXPERTS,  # num_experts, num_local_experts, num_experts_per_tok
    "expert_count": MAX_EXPERTS,
    "expert_used_count": MAX_EXPERTS,
    "layers": MAX_LAYERS,
    "block_count": MAX_LAYERS,
    "n_layer": MAX_LAYERS,
    "vocab": MAX_VOCAB,
    "position": MAX_POSITIONS,
    "context_length": MAX_POSITIONS,
    "n_positions": MAX_POSITIONS,
}


def check_sizes(sizes: dict, where: str, optional: bool = False) -> None:
    """Each named size a positive integer within its bound (`optional`: None is absent, its
    default applies)."""
    for name, value in sizes.items():
        high = next((b for key, b in SIZE_BOUNDS.items() if key in name), MAX_WIDTH)
        if value is None and optional:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
            raise CheckpointError(f"{where}: {name} must be an integer in [1, {high}], got {value!r}")


def validate_model_config(cfg: "ModelConfig", where: str) -> None:
    """What every forward assumes of a model's shape, for Hugging Face and GGUF files alike,
    checked before any weight is read."""
    check_sizes(
        {
            "hidden_size": cfg.hidden_size,
            "num_layers": cfg.num_layers,
            "num_heads": cfg.num_heads,
            "num_kv_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim,
            "rotary_dim": cfg.rotary_dim,
            "intermediate_size": cfg.intermediate_size,
            "vocab_size": cfg.vocab_size,
            "max_position_embeddings": cfg.max_position_embeddings,
        },
        where,
    )
    problems = []
    if cfg.num_heads % cfg.num_kv_heads:
        problems.append(f"{cfg.num_heads} attention heads cannot share {cfg.num_kv_heads} key/value heads evenly")
    if cfg.head_dim % 2 or cfg.rotary_dim % 2 or cfg.rotary_dim > cfg.head_dim:
        problems.append(
            f"head_dim {cfg.head_dim} / rotary_dim {cfg.rotary_dim}: RoPE needs even sizes, rotary_dim <= head_dim"
        )
    if cfg.max_position_embeddings < 2:
        problems.append(f"max_position_embeddings {cfg.max_position_embeddings}: no prompt and answer fit")
    for name, value in (("norm_eps", cfg.norm_eps), ("rope_theta", cfg.rope_theta)):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            problems.append(f"{name} {value!r} must be a positive number")
    if len(cfg.sliding_windows) != cfg.num_layers or any(
        w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1) for w in cfg.sliding_windows
    ):
        problems.append("the sliding windows must be positive integers, one per layer")
    moe = cfg.moe
    if moe is not None:
        check_sizes(
            {"experts": moe.experts, "experts_per_token": moe.top_k, "expert_intermediate": moe.intermediate}, where
        )
        if moe.top_k > moe.experts or not moe.layers <= set(range(cfg.num_layers)):
            problems.append(f"{moe.top_k} experts a token of {moe.experts}, in layers {sorted(moe.layers)}")
    if problems:
        raise CheckpointError(f"{where}: " + "; ".join(problems))


@dataclass(frozen=True)
class MoEConfig:
    """Experts in place of a layer's MLP: a router picks `top_k` of `experts` MLPs per token
    (softmax over all experts in float32, the top k taken, renormalised if `norm_topk_prob`), each
    of `intermediate` width; `layers` lists the layers that have them (the others: a dense MLP)."""

    experts: int
    top_k: int
    intermediate: int
    norm_topk_prob: bool
    layers: frozenset[int]
    # the checkpoint's names: the layer's module holding `gate` (the router) and `experts`, and each
    # expert's gate, up and down projections (Qwen3-MoE's; Mixtral: block_sparse_moe, w1 w3 w2)
    block: str = "mlp"
    projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    # the routing weights multiply in float32, the product rounded once (Mixtral); else they are
    # rounded to the model's dtype first (Qwen3-MoE)
    weights_float32: bool = False
    # gpt-oss: the router (named `router`) has a bias and takes a softmax over the top k logits only
    # (in the model's dtype); the experts have biases; their activation is the clamped SwiGLU
    # (gate clamped above, up on both sides at swiglu_limit; (up + 1) * gate * sigmoid(alpha gate));
    # the checkpoint stacks the experts ([experts, in, out], gate and up interleaved)
    router: str = "gate"
    router_bias: bool = False
    softmax_after_topk: bool = False
    expert_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    stacked: bool = False


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    norm_eps: float
    hidden_act: str
    tie_word_embeddings: bool
    rope_theta: float
    rope_scaling: dict | None  # rope_type and its parameters, None for plain RoPE
    rotary_dim: int  # dims of each head that are rotated (GPT-J: partial rotary)
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_windows: tuple[int | None, ...]  # per layer; None = full attention
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    checkpoint_dtype: str | None
    # RMSNorm of q and k before RoPE: "head" over each head (Qwen3, weights [head_dim]), "projection"
    # over the whole of each (OLMo 2, weights [heads * head_dim] and [kv_heads * head_dim]), "" none
    qk_norm: str = ""
    norm_after: bool = False  # norms after attention and the MLP, none before (OLMo 2)
    fused_projections: bool = False  # qkv_proj and gate_up_proj stored fused (Phi-3)
    # Gemma 3: embeddings times sqrt(hidden); every RMSNorm times (1 + weight) in float32, rounded once;
    # norms before and after attention and the MLP; its own score scale; local layers' own RoPE base
    gemma: bool = False
    attn_scale: float | None = None  # None: 1 / sqrt(head_dim)
    local_rope_theta: float | None = None  # RoPE base of the sliding-window layers (no scaling there)
    nope_layers: frozenset[int] = frozenset()  # layers that skip RoPE (SmolLM3's every 4th)
    # a mixture of experts in place of the MLP of some layers (Qwen3-MoE, Mixtral, gpt-oss)
    moe: MoEConfig | None = None
    attn_sinks: bool = False  # a learned logit per head in each softmax's denominator (gpt-oss)

    @property
    def is_gptj(self) -> bool:
        return self.architecture == "GPTJForCausalLM"


def load_model_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    raw = _read_json(path)
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED), None)
    if arch is None:
        raise CheckpointError(
            f"{path}: architecture {archs or raw.get('model_type')!r} is not supported; "
            f"flover serves {', '.join(SUPPORTED)}"
        )
    # Sizes first, before any is used (a layer count builds per-layer tuples).
    check_sizes({key: raw[key] for key in REQUIRED_SIZES if key in raw}, str(path))
    check_sizes({key: raw.get(key) for key in OPTIONAL_SIZES}, str(path), optional=True)
    for key in NUMBER_FIELDS:
        value = raw.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise CheckpointError(f"{path}: {key} must be a number, got {value!r}")
    for key in FLAG_FIELDS:
        value = raw.get(key)
        if value is not None and not isinstance(value, bool):
            raise CheckpointError(f"{path}: {key} must be true or false, got {value!r}")
    try:
        if arch == "GPTJForCausalLM":
            cfg = _parse_gptj(raw)
        elif arch == "Gemma3ForCausalLM":
            cfg = _parse_gemma3(raw)
        elif arch == "Qwen3MoeForCausalLM":
            cfg = {**_parse_llama(raw, "Qwen3ForCausalLM"), **_parse_moe(raw)}
        elif arch == "MixtralForCausalLM":
            cfg = {**_parse_llama(raw, "MistralForCausalLM"), **_parse_mixtral(raw)}
        elif arch == "GptOssForCausalLM":
            cfg = {**_parse_llama(raw, arch), **_parse_gpt_oss(raw)}
        else:
            cfg = _parse_llama(raw, arch)
    except KeyError as e:
        raise CheckpointError(f"{path}: missing field {e.args[0]!r} for {arch}") from None
    except (TypeError, ValueError, ZeroDivisionError, AttributeError) as e:
        raise CheckpointError(f"{path}: malformed ({e})") from None
    try:
        eos, bos = _special_ids(Path(model_dir), raw)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: eos_token_id / bos_token_id must be integers ({e})") from None
    config = ModelConfig(
        architecture=arch,
        eos_token_ids=eos,
        bos_token_id=bos,
        checkpoint_dtype=raw.get("dtype") or raw.get("torch_dtype"),
        **cfg,
    )
    validate_model_config(config, str(path))
    return config


# config.json sizes: present ones must be valid; the optional ones may be null (their default applies)
REQUIRED_SIZES = (
    "hidden_size",
    "num_attention_heads",
    "num_hidden_layers",
    "intermediate_size",
    "vocab_size",
    "max_position_embeddings",
    "n_embd",
    "n_head",
    "n_layer",
    "n_positions",
)
OPTIONAL_SIZES = ("num_key_value_heads", "head_dim", "n_inner", "rotary_dim", "sliding_window")
# config.json fields each a JSON number / true or false where present ("false" is a string, and true to Python)
NUMBER_FIELDS = (
    "rms_norm_eps",
    "layer_norm_epsilon",
    "rope_theta",
    "partial_rotary_factor",
    "swiglu_limit",
    "swiglu_alpha",
    "query_pre_attn_scalar",
    "rope_local_base_freq",
)
FLAG_FIELDS = ("norm_topk_prob", "tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window")


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError(f"{path}: not found (a Hugging Face checkpoint directory holds config.json)")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None


def _rope(raw: dict) -> tuple[float, dict | None]:
    """v5 keeps RoPE settings in `rope_parameters`; v4 in `rope_theta` + `rope_scaling`."""
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or {}
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    merged = {**scaling, **params}
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type not in ("linear", "llama3", "longrope", "yarn"):
        raise CheckpointError(
            f"config.json: rope_type {rope_type!r} is not supported (default, linear, llama3, longrope, yarn)"
        )
    scaling = {k: v for k, v in merged.items() if k not in ("rope_theta", "partial_rotary_factor")}
    if rope_type == "yarn":  # (gpt-oss; without a factor: the length ratio, as transformers)
        original = scaling.get("original_max_position_embeddings")
        if scaling.get("factor") is None and isinstance(original, int) and original > 0:
            scaling["factor"] = raw.get("max_position_embeddings", original) / original
        check_yarn(scaling, "config.json")
    if rope_type == "longrope":  # (Phi-3: the original length at the top level)
        scaling.setdefault("original_max_position_embeddings", raw.get("original_max_position_embeddings"))
        scaling.setdefault("max_position_embeddings", raw.get("max_position_embeddings"))
        _check_longrope(scaling)
    return float(theta), scaling | {"rope_type": rope_type}


def check_yarn(scaling: dict, where: str) -> None:
    """YaRN's settings: a positive, finite factor and an original length (config.json, GGUF files)."""
    factor, original = scaling.get("factor"), scaling.get("original_max_position_embeddings")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor <= 0:
        raise CheckpointError(f"{where}: yarn needs a positive factor, got {factor!r}")
    if isinstance(original, bool) or not isinstance(original, int) or original < 1:
        raise CheckpointError(f"{where}: yarn needs original_max_position_embeddings, a positive integer")


def _check_longrope(scaling: dict) -> None:
    """LongRoPE's factors: one positive number per rotated pair, an original length."""
    for key in ("short_factor", "long_factor"):
        factors = scaling.get(key)
        if not isinstance(factors, list) or not all(
            isinstance(f, (int, float)) and not isinstance(f, bool) and math.isfinite(f) and f > 0 for f in factors
        ):
            raise CheckpointError(f"config.json: rope {key} must be a list of positive numbers")
    original = scaling.get("original_max_position_embeddings")
    if isinstance(original, bool) or not isinstance(original, int) or original < 1:
        raise CheckpointError("config.json: longrope needs original_max_position_embeddings, a positive integer")


def _parse_llama(raw: dict, arch: str) -> dict:
    heads = raw["num_attention_heads"]
    head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
    partial = (raw.get("rope_parameters") or {}).get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if isinstance(partial, bool) or not isinstance(partial, (int, float)) or not 0 < partial <= 1:
        raise CheckpointError(f"config.json: partial_rotary_factor must be in (0, 1], got {partial!r}")
    theta, scaling = _rope(raw)
    layers = raw["num_hidden_layers"]
    window = raw.get("sliding_window")
    layer_types = raw.get("layer_types")
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "SmolLM3ForCausalLM") and not raw.get("use_sliding_window"):
        window = None
    if window is None:
        windows = (None,) * layers
    elif layer_types:
        windows = tuple(window if t == "sliding_attention" else None for t in layer_types)
    elif arch in ("MistralForCausalLM", "Phi3ForCausalLM"):  # (every layer, as transformers' Phi-3)
        windows = (window,) * layers
    else:
        max_full = raw.get("max_window_layers", layers)
        windows = tuple(window if i >= max_full else None for i in range(layers))
    attention_bias = raw.get("attention_bias", False)
    return dict(
        **_sizes(raw, head_dim, 2048),
        hidden_act=raw.get("hidden_act", "silu"),
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
        rope_theta=theta,
        rope_scaling=scaling,
        rotary_dim=int(head_dim * partial),  # (Phi-4-mini: 3/4 of each head, rotate-half over those)
        qkv_bias=True if arch == "Qwen2ForCausalLM" else attention_bias,
        o_bias=False if arch == "Qwen2ForCausalLM" else attention_bias,
        mlp_bias=raw.get("mlp_bias", False),
        sliding_windows=windows,
        qk_norm={"Qwen3ForCausalLM": "head", "Olmo2ForCausalLM": "projection"}.get(arch, ""),
        norm_after=arch == "Olmo2ForCausalLM",
        fused_projections=arch == "Phi3ForCausalLM",
        nope_layers=_nope_layers(raw, layers) if arch == "SmolLM3ForCausalLM" else frozenset(),
    )


def _parse_moe(raw: dict) -> dict:
    """Qwen3-MoE's experts: in every decoder_sparse_step-th layer not in mlp_only_layers."""
    layers, step = raw["num_hidden_layers"], raw.get("decoder_sparse_step", 1)
    experts, top_k = _expert_counts(raw)
    check_sizes({"moe_intermediate_size": raw["moe_intermediate_size"]}, "config.json")
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"decoder_sparse_step {step!r} must be a positive integer")
    dense = set(raw.get("mlp_only_layers") or ())
    return dict(
        moe=MoEConfig(
            experts=experts,
            top_k=top_k,
            intermediate=raw["moe_intermediate_size"],
            norm_topk_prob=raw.get("norm_topk_prob") or False,
            layers=frozenset(i for i in range(layers) if i not in dense and (i + 1) % step == 0),
        )
    )


def _expert_counts(raw: dict) -> tuple[int, int]:
    """(experts, experts a token) of a config.json, each a size within bounds, k at most the experts.
    (The hub's Qwen3-MoE configs say num_experts; transformers 5 and the others num_local_experts.)"""
    key = "num_experts" if "num_experts" in raw else "num_local_experts"
    experts, top_k = raw[key], raw["num_experts_per_tok"]
    check_sizes({key: experts, "num_experts_per_tok": top_k}, "config.json")
    if top_k > experts:
        raise ValueError(f"num_experts_per_tok {top_k} of {experts} experts")
    return experts, top_k


def _parse_mixtral(raw: dict) -> dict:
    """Mixtral's experts: in every layer, intermediate_size wide, top k renormalised."""
    experts, top_k = _expert_counts(raw)
    return dict(
        moe=MoEConfig(
            experts=experts,
            top_k=top_k,
            intermediate=raw["intermediate_size"],
            norm_topk_prob=True,
            layers=frozenset(range(raw["num_hidden_layers"])),
            block="block_sparse_moe",
            projections=("w1", "w3", "w2"),
            weights_float32=True,
        )
    )


def _parse_gpt_oss(raw: dict) -> dict:
    """gpt-oss: experts in every layer (router with a bias, softmax over the top k, experts with
    biases and the clamped SwiGLU), attention sinks."""
    experts, top_k = _expert_counts(raw)
    limit, alpha = raw.get("swiglu_limit", 7.0), raw.get("swiglu_alpha", 1.702)
    if not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0 for v in (limit, alpha)
    ):
        raise ValueError(f"swiglu_limit {limit!r} and swiglu_alpha {alpha!r} must be positive numbers")
    return dict(
        moe=MoEConfig(
            experts=experts,
            top_k=top_k,
            intermediate=raw["intermediate_size"],
            norm_topk_prob=False,
            layers=frozenset(range(raw["num_hidden_layers"])),
            router="router",
            router_bias=True,
            softmax_after_topk=True,
            expert_bias=True,
            swiglu_limit=float(limit),
            swiglu_alpha=float(alpha),
            stacked=True,
        ),
        attn_sinks=True,
    )


def _sizes(raw: dict, head_dim: int, max_positions: int) -> dict:
    """The sizes every config.json of the Llama family names alike."""
    heads = raw["num_attention_heads"]
    return dict(
        hidden_size=raw["hidden_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        intermediate_size=raw["intermediate_size"],
        vocab_size=raw["vocab_size"],
        max_position_embeddings=raw.get("max_position_embeddings", max_positions),
        norm_eps=raw.get("rms_norm_eps", 1e-6),
    )


def _parse_gemma3(raw: dict) -> dict:
    """Gemma 3 (text): the Llama fields, named its way, and what it adds."""
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if raw.get(key) is not None:
            raise ValueError(f"{key} (Gemma 2's soft-capping) is not supported")
    layers, heads = raw["num_hidden_layers"], raw["num_attention_heads"]
    types = raw.get("layer_types") or [
        "sliding_attention" if (i + 1) % raw.get("sliding_window_pattern", 6) else "full_attention"
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
    theta, scaling = _rope({"rope_parameters": full})
    head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
    window = raw.get("sliding_window")
    return dict(
        **_sizes(raw, head_dim, 131_072),
        hidden_act=raw.get("hidden_activation", "gelu_pytorch_tanh"),
        tie_word_embeddings=raw.get("tie_word_embeddings", True),
        rope_theta=theta,
        rope_scaling=scaling,
        rotary_dim=head_dim,
        qkv_bias=raw.get("attention_bias", False),
        o_bias=raw.get("attention_bias", False),
        mlp_bias=False,
        sliding_windows=tuple(window if t == "sliding_attention" and window else None for t in types),
        qk_norm="head",
        gemma=True,
        attn_scale=float(raw.get("query_pre_attn_scalar", 256)) ** -0.5,
        local_rope_theta=float(local.get("rope_theta", 10_000.0)),
    )


def _nope_layers(raw: dict, layers: int) -> frozenset[int]:
    """SmolLM3's layers without RoPE: `no_rope_layers` (1: RoPE, 0: none, one per layer), else
    every `no_rope_layer_interval`-th layer (4 by default), as transformers builds the list."""
    flags = raw.get("no_rope_layers")
    if flags is None:
        interval = raw.get("no_rope_layer_interval", 4)
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"no_rope_layer_interval must be a positive integer, got {interval!r}")
        flags = [int((i + 1) % interval != 0) for i in range(layers)]
    if (
        not isinstance(flags, list)
        or len(flags) != layers
        or any(f not in (0, 1) or isinstance(f, float) for f in flags)
    ):
        raise ValueError(f"no_rope_layers must list 0 or 1 for each of the {layers} layers")
    return frozenset(i for i, use_rope in enumerate(flags) if not use_rope)


def _parse_gptj(raw: dict) -> dict:
    hidden = raw.get("n_embd", raw.get("hidden_size"))
    heads = raw.get("n_head", raw.get("num_attention_heads"))
    if hidden is None or heads is None:
        raise KeyError("n_embd" if hidden is None else "n_head")
    head_dim = hidden // heads
    layers = raw.get("n_layer", raw.get("num_hidden_layers"))
    if layers is None:
        raise KeyError("n_layer")
    return dict(
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=head_dim,
        intermediate_size=raw.get("n_inner") or 4 * hidden,
        vocab_size=raw["vocab_size"],
        max_position_embeddings=raw.get("n_positions", raw.get("max_position_embeddings", 2048)),
        norm_eps=raw.get("layer_norm_epsilon", 1e-5),
        hidden_act=raw.get("activation_function", "gelu_new"),
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
        rope_theta=10000.0,  # fixed in GPT-J
        rope_scaling=None,
        rotary_dim=raw.get("rotary_dim") or head_dim,
        qkv_bias=False,
        o_bias=False,
        mlp_bias=True,
        sliding_windows=(None,) * layers,
    )


def _special_ids(model_dir: Path, raw: dict) -> tuple[tuple[int, ...], int | None]:
    """EOS ids: generation_config.json wins over config.json (as in transformers' generate)."""
    gen_path = model_dir / "generation_config.json"
    gen = _read_json(gen_path) if gen_path.is_file() else {}
    eos = gen.get("eos_token_id", raw.get("eos_token_id"))
    bos = gen.get("bos_token_id", raw.get("bos_token_id"))
    if eos is None:
        eos_ids: tuple[int, ...] = ()
    elif isinstance(eos, int):
        eos_ids = (eos,)
    else:
        eos_ids = tuple(int(e) for e in eos)
    return eos_ids, bos
