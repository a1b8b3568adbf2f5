"""Qwen3.5 / 3.6 (dense): three of every four layers Gated DeltaNet linear attention
(models/gated_deltanet.py), every fourth full attention with an output gate (q_proj yields the
query and a gate per head), q/k normed per head, RoPE over a quarter of each head (the text
positions of its multimodal sections: one RoPE), every RMSNorm multiplying (1 + weight) in float32.
Hub checkpoints are Qwen3_5ForConditionalGeneration (text_config; weights under
model.language_model, which the reader serves as model.*); the vision tower and the MTP head are
not read."""

import dataclasses

from flover.models.families._shared import Family, decoder_fields, own_head_dim
from flover.models.model_config import CheckpointError, LinearAttentionConfig, check_sizes

# llama.cpp's names of a DeltaNet layer's tensors (and of the gated q_proj: attn_q holds both)
GGUF_NAMES = {
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
    "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight",
    "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.A": "ssm_a",
    "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
}


def default_pattern(layers: int, interval: int) -> list[bool]:
    """Which layers are recurrent where a checkpoint does not list them: all but every
    interval-th (transformers' and llama.cpp's default)."""
    return [(i + 1) % interval != 0 for i in range(layers)]


def layer_types(raw: dict) -> list[str]:
    layers = raw["num_hidden_layers"]
    interval = raw.get("full_attention_interval", 4)
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
        raise ValueError(f"full_attention_interval {interval!r} must be a positive integer")
    types = raw.get("layer_types") or [
        "linear_attention" if recurrent else "full_attention" for recurrent in default_pattern(layers, interval)
    ]
    if len(types) != layers or not set(types) <= {"linear_attention", "full_attention"}:
        raise ValueError("layer_types must name linear_attention or full_attention for every layer")
    return types


def linear_attention(raw: dict) -> LinearAttentionConfig:
    sizes = {k: raw.get(k, d) for k, d in (("linear_num_key_heads", 16), ("linear_num_value_heads", 32))}
    sizes |= {k: raw.get(k, 128) for k in ("linear_key_head_dim", "linear_value_head_dim")}
    check_sizes(sizes, "config.json")
    types = layer_types(raw)
    return LinearAttentionConfig(
        layers=frozenset(i for i, t in enumerate(types) if t == "linear_attention"),
        key_heads=sizes["linear_num_key_heads"],
        value_heads=sizes["linear_num_value_heads"],
        key_dim=sizes["linear_key_head_dim"],
        value_dim=sizes["linear_value_head_dim"],
        conv_kernel=raw.get("linear_conv_kernel_dim", 4),
    )


FEATURES = dict(qk_norm="head", norm_offset=1.0, norm_float32=True, attn_output_gate=True)


def from_hf(raw: dict) -> dict:
    raw = {"partial_rotary_factor": 0.25, "head_dim": 256, **raw}  # (Qwen3_5TextConfig's defaults)
    return decoder_fields(raw) | FEATURES | dict(linear_attention=linear_attention(raw))


def gguf_linear_attention(file, layers: int) -> LinearAttentionConfig:
    """As llama.cpp reads a qwen35 file: the recurrent layers listed (else every layer but each
    full_attention_interval-th), the ssm sizes; value heads in its tiled order, A = -exp(A_log)."""
    a = file.arch
    listed = file.get(f"{a}.attention.recurrent_layers")
    interval = file.integer(f"{a}.full_attention_interval", 4)
    if listed is not None:
        recurrent = [bool(x) for x in listed][:layers]
    else:
        recurrent = default_pattern(layers, interval)
    key_heads = file.integer(f"{a}.ssm.group_count", required=True)
    value_heads = file.integer(f"{a}.ssm.time_step_rank", required=True)
    inner = file.integer(f"{a}.ssm.inner_size", required=True)
    if inner % value_heads:
        raise ValueError(f"{a}.ssm.inner_size {inner} is not a multiple of {value_heads} value heads")
    return LinearAttentionConfig(
        layers=frozenset(i for i, r in enumerate(recurrent) if r),
        key_heads=key_heads,
        value_heads=value_heads,
        key_dim=file.integer(f"{a}.ssm.state_size", required=True),
        value_dim=inner // value_heads,
        conv_kernel=file.integer(f"{a}.ssm.conv_kernel", 4),
        tiled=True,
        decay_stored="A",
    )


def from_gguf(file, cfg):
    a = file.arch
    rotary = file.integer(f"{a}.rope.dimension_count", cfg.head_dim // 4)
    try:
        la = gguf_linear_attention(file, cfg.num_layers)
    except ValueError as e:
        raise CheckpointError(f"{file.path}: {e}") from None
    return dataclasses.replace(cfg, **FEATURES, rotary_dim=rotary, linear_attention=la)


def test_gguf_metadata(config: dict) -> dict:
    """What llama.cpp's converter writes of a config.json beyond the common keys."""
    la = linear_attention(config)
    return {
        "qwen35.ssm.conv_kernel": la.conv_kernel,
        "qwen35.ssm.state_size": la.key_dim,
        "qwen35.ssm.group_count": la.key_heads,
        "qwen35.ssm.time_step_rank": la.value_heads,
        "qwen35.ssm.inner_size": la.value_heads * la.value_dim,
        "qwen35.attention.recurrent_layers": [i in la.layers for i in range(config["num_hidden_layers"])],
        "qwen35.full_attention_interval": config.get("full_attention_interval", 4),
    }


def test_gguf_tensors(config: dict, tensors: dict) -> dict:
    """The DeltaNet tensors (numpy, Hugging Face names) as the converter writes them: A as
    -exp(A_log), the conv squeezed to [channels, K], value heads from grouped to tiled order."""
    import numpy as np
    import torch

    la = linear_attention(config)
    r, kh = la.value_heads // la.key_heads, la.key_heads

    def tiled(x, dim: int, per_head: int):  # [.., (kh, r, d), ..] -> [.., (r, kh, d), ..]
        shape = list(x.shape)
        grouped = x.reshape(*shape[:dim], kh, r, per_head, *shape[dim + 1 :])
        return np.ascontiguousarray(np.swapaxes(grouped, dim, dim + 1)).reshape(shape)

    out = {}
    for name, x in tensors.items():
        if ".linear_attn." in name and r > 1:
            qk = 2 * la.key_heads * la.key_dim
            if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
                x = np.concatenate([x[:qk], tiled(x[qk:], 0, la.value_dim)])
            elif name.endswith("in_proj_z.weight"):
                x = tiled(x, 0, la.value_dim)
            elif name.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
                x = tiled(x, 0, 1)
            elif name.endswith("out_proj.weight"):
                x = tiled(x, 1, la.value_dim)
        if name.endswith("linear_attn.A_log"):  # (in torch, as the converter: numpy's exp rounds otherwise)
            name, x = name.removesuffix("_log"), -torch.from_numpy(x).float().exp().numpy()
        if name.endswith("linear_attn.conv1d.weight"):
            x = x[:, 0]
        out[name] = x
    return out


def test_kwargs(preset: dict, eos_id: int) -> dict:
    """Four layers (three DeltaNet, one full attention) of the preset's width."""
    return own_head_dim(preset, eos_id) | dict(
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=32
    )


FAMILY = Family(
    name="qwen3_5",
    hf_architectures=("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"),
    from_hf=from_hf,
    gguf_arch="qwen35",
    from_gguf=from_gguf,
    gguf_names=GGUF_NAMES,
    test_config="Qwen3_5TextConfig",
    test_kwargs=test_kwargs,
    test_gguf_metadata=test_gguf_metadata,
    test_gguf_tensors=test_gguf_tensors,
    number_fields=("linear_conv_kernel_dim", "full_attention_interval"),
)
