"""What every family file uses: the `Family` record the registry holds, and the config.json
fields the families of the one decoder (models/decoder.py) name alike."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from flover.models.model_config import CheckpointError, ModelConfig, check_sizes

DECODER = "flover.models.decoder:DecoderForCausalLM"


@dataclass(frozen=True)
class Family:
    """One family of models, as its file (flover/models/families/<name>.py) states it.

    `from_hf(config.json) -> ModelConfig's fields` (all but the architecture, the special ids and
    the dtype); `from_gguf(file, cfg) -> cfg` adjusts the fields every GGUF file names alike
    (gguf_file.GGUFFile.model_config) for what this family's files hold beyond them. GGUF files
    of `gguf_arch` are this family's where `gguf_claims(file)` says so (several families share
    one, as llama.cpp writes Mistral and Mixtral as llama; None: every file of that arch not
    claimed by another)."""

    name: str  # the file's name; `flover make-model --arch` and the tests call it so
    hf_architectures: tuple[str, ...]  # config.json "architectures" it serves
    from_hf: Callable[[dict], dict]
    gguf_arch: str | None = None  # general.architecture of its GGUF files (None: none read)
    gguf_other_arches: tuple[str, ...] = ()  # the converter's other names for its models (gemma-embedding)
    from_gguf: Callable[[Any, ModelConfig], ModelConfig] | None = None
    gguf_claims: Callable[[Any], bool] | None = None
    gguf_qk_permuted: bool = False  # llama.cpp's converter permuted Q and K's rows for its RoPE
    gguf_names: Mapping[str, str] = field(default_factory=dict)  # layer tensor: HF name -> GGUF name, its own
    gguf_global_names: Mapping[str, str] = field(default_factory=dict)  # and its own tensors outside the layers
    gguf_rope_types: tuple[str, ...] = ("none", "linear")  # the rope.scaling.type its files may state
    decoder: str = DECODER  # "module:class" of its graph (imported when a model is built: torch)
    native: bool = True  # the native step runs it (its features are the decoder's)
    layer_prefix: str = "model.layers"  # of its checkpoints' layer tensors
    embed_name: str = "model.embed_tokens.weight"
    # a task model's prefix of its base model's tensors (BertForSequenceClassification's `bert.`),
    # read as if it were absent
    weight_prefixes: tuple[str, ...] = ()
    # tiny random checkpoints (flover.testing.tiny_model): transformers' config class, and the keywords
    # that class needs beyond the common sizes (preset, eos id -> keywords)
    test_config: str = ""
    test_kwargs: Callable[[dict, int], dict] | None = None
    # what llama.cpp's converter writes of config.json beyond the common keys, as {GGUF key: a
    # float, an int or a list of bools}, and its tensors (numpy, Hugging Face names) as it
    # transforms them (flover.testing.tiny_model.write_gguf writes both into test files)
    test_gguf_metadata: Callable[[dict], dict] | None = None
    test_gguf_tensors: Callable[[dict, dict], dict] | None = None
    number_fields: tuple[str, ...] = ()  # its own config.json fields, each a number where present

    @property
    def gguf_arches(self) -> tuple[str, ...]:
        """Every general.architecture its GGUF files carry."""
        return (self.gguf_arch, *self.gguf_other_arches) if self.gguf_arch else ()

    def decoder_class(self):
        import importlib

        module, name = self.decoder.split(":")
        return getattr(importlib.import_module(module), name)


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
)
FLAG_FIELDS = ("norm_topk_prob", "tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window")


def check_fields(raw: dict, where: str, numbers: tuple[str, ...] = ()) -> None:
    """config.json's sizes, numbers and flags each of its type and bounds where present, before any
    is used (a layer count builds per-layer tuples)."""
    check_sizes({key: raw[key] for key in REQUIRED_SIZES if key in raw}, where)
    check_sizes({key: raw.get(key) for key in OPTIONAL_SIZES}, where, optional=True)
    for key in NUMBER_FIELDS + numbers:
        value = raw.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise CheckpointError(f"{where}: {key} must be a number, got {value!r}")
    for key in FLAG_FIELDS:
        value = raw.get(key)
        if value is not None and not isinstance(value, bool):
            raise CheckpointError(f"{where}: {key} must be true or false, got {value!r}")


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError(f"{path}: not found (a Hugging Face checkpoint directory holds config.json)")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None


def rope(raw: dict) -> tuple[float, dict | None]:
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


def decoder_fields(raw: dict, windows: str = "from_layer") -> dict:
    """The fields a config.json of the decoder's families names alike. `windows`: which layers
    a `sliding_window` applies to: "from_layer" those from max_window_layers on (or of
    layer_types' "sliding_attention"), "every_layer", "opt_in" as "from_layer" but only where
    use_sliding_window is true."""
    heads = raw["num_attention_heads"]
    head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
    partial = (raw.get("rope_parameters") or {}).get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if isinstance(partial, bool) or not isinstance(partial, (int, float)) or not 0 < partial <= 1:
        raise CheckpointError(f"config.json: partial_rotary_factor must be in (0, 1], got {partial!r}")
    theta, scaling = rope(raw)
    attention_bias = raw.get("attention_bias", False)
    return dict(
        **sizes(raw, head_dim, 2048),
        hidden_act=raw.get("hidden_act", "silu"),
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
        rope_theta=theta,
        rope_scaling=scaling,
        rotary_dim=int(head_dim * partial),  # (Phi-4-mini: 3/4 of each head, rotate-half over those)
        qkv_bias=attention_bias,
        o_bias=attention_bias,
        mlp_bias=raw.get("mlp_bias", False),
        sliding_windows=layer_windows(raw, windows),
    )


def layer_windows(raw: dict, rule: str) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: full attention), by decoder_fields' `windows` rule."""
    layers, window, layer_types = raw["num_hidden_layers"], raw.get("sliding_window"), raw.get("layer_types")
    if window is None or rule == "opt_in" and not raw.get("use_sliding_window"):
        return (None,) * layers
    if layer_types:
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if rule == "every_layer":  # (as transformers' Mistral and Phi-3)
        return (window,) * layers
    max_full = raw.get("max_window_layers", layers)
    return tuple(window if i >= max_full else None for i in range(layers))


def expert_counts(raw: dict) -> tuple[int, int]:
    """(experts, experts a token) of a config.json, each a size within bounds, k at most the experts.
    (The hub's Qwen3-MoE configs say num_experts; transformers 5 and the others num_local_experts.)"""
    key = "num_experts" if "num_experts" in raw else "num_local_experts"
    experts, top_k = raw[key], raw["num_experts_per_tok"]
    check_sizes({key: experts, "num_experts_per_tok": top_k}, "config.json")
    if top_k > experts:
        raise ValueError(f"num_experts_per_tok {top_k} of {experts} experts")
    return experts, top_k


def sizes(raw: dict, head_dim: int, max_positions: int) -> dict:
    """The sizes every config.json of the decoder's families names alike."""
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


def special_ids(model_dir: Path, raw: dict) -> tuple[tuple[int, ...], int | None]:
    """EOS ids: generation_config.json wins over config.json (as in transformers' generate)."""
    gen_path = model_dir / "generation_config.json"
    gen = read_json(gen_path) if gen_path.is_file() else {}
    eos = gen.get("eos_token_id", raw.get("eos_token_id"))
    bos = gen.get("bos_token_id", raw.get("bos_token_id"))
    if eos is None:
        eos_ids: tuple[int, ...] = ()
    elif isinstance(eos, int):
        eos_ids = (eos,)
    else:
        eos_ids = tuple(int(e) for e in eos)
    return eos_ids, bos


def decoder_test_kwargs(preset: dict, eos_id: int) -> dict:
    """A tiny checkpoint's sizes as the decoder's families' transformers configs name them."""
    return dict(
        hidden_size=preset["hidden_size"],
        num_hidden_layers=preset["num_layers"],
        num_attention_heads=preset["num_heads"],
        num_key_value_heads=preset["num_kv_heads"],
        intermediate_size=preset["intermediate_size"],
        max_position_embeddings=preset["max_position_embeddings"],
    )


def own_head_dim(preset: dict, eos_id: int) -> dict:
    """decoder_test_kwargs for a config class with a head_dim default of its own (128, 64): the preset's."""
    return decoder_test_kwargs(preset, eos_id) | dict(head_dim=preset["hidden_size"] // preset["num_heads"])


def eos_pad(preset: dict, eos_id: int) -> dict:
    """decoder_test_kwargs for a config class whose default pad id lies outside a small vocabulary."""
    return decoder_test_kwargs(preset, eos_id) | dict(pad_token_id=eos_id)
