"""One normalized view of a Hugging Face `config.json` (transformers v4 and v5 layouts)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

LLAMA_FAMILY = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED = LLAMA_FAMILY + ("GPTJForCausalLM",)


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be served; the message names the file."""


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
    try:
        cfg = _parse_gptj(raw) if arch == "GPTJForCausalLM" else _parse_llama(raw, arch)
    except KeyError as e:
        raise CheckpointError(f"{path}: missing field {e.args[0]!r} for {arch}") from None
    eos, bos = _special_ids(Path(model_dir), raw)
    return ModelConfig(architecture=arch, eos_token_ids=eos, bos_token_id=bos,
                       checkpoint_dtype=raw.get("dtype") or raw.get("torch_dtype"), **cfg)


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
    if rope_type not in ("linear", "llama3"):
        raise CheckpointError(f"config.json: rope_type {rope_type!r} is not supported (default, linear, llama3)")
    return float(theta), {k: v for k, v in merged.items() if k != "rope_theta"} | {"rope_type": rope_type}


def _parse_llama(raw: dict, arch: str) -> dict:
    heads = raw["num_attention_heads"]
    head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
    if raw.get("partial_rotary_factor", 1.0) != 1.0:
        raise CheckpointError("config.json: partial_rotary_factor != 1 is not supported for the Llama family")
    theta, scaling = _rope(raw)
    layers = raw["num_hidden_layers"]
    window = raw.get("sliding_window")
    layer_types = raw.get("layer_types")
    if arch == "Qwen2ForCausalLM" and not raw.get("use_sliding_window", False):
        window = None
    if window is None:
        windows = (None,) * layers
    elif layer_types:
        windows = tuple(window if t == "sliding_attention" else None for t in layer_types)
    elif arch == "MistralForCausalLM":
        windows = (window,) * layers
    else:
        max_full = raw.get("max_window_layers", layers)
        windows = tuple(window if i >= max_full else None for i in range(layers))
    attention_bias = raw.get("attention_bias", False)
    return dict(
        hidden_size=raw["hidden_size"],
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        intermediate_size=raw["intermediate_size"],
        vocab_size=raw["vocab_size"],
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        norm_eps=raw.get("rms_norm_eps", 1e-6),
        hidden_act=raw.get("hidden_act", "silu"),
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
        rope_theta=theta,
        rope_scaling=scaling,
        rotary_dim=head_dim,
        qkv_bias=True if arch == "Qwen2ForCausalLM" else attention_bias,
        o_bias=False if arch == "Qwen2ForCausalLM" else attention_bias,
        mlp_bias=raw.get("mlp_bias", False),
        sliding_windows=windows,
    )


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
