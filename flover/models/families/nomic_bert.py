"""nomic-bert text encoders (nomic-embed-text v1 / v1.5, Ollama's default embedding model): BERT's
post-norm blocks, token types and LayerNorms, with RoPE on q and k in place of a position table, a
SwiGLU MLP and no biases (models/bert.py's graph: `encoder_rope`, `gated_mlp`).

Directories: nomic-ai's own uploads (GPT-2-style config keys, `n_embd` ...) and transformers'
NomicBertModel's (its config keys); both hold the tensors under nomic-ai's remote code's names (a
fused `attn.Wqkv`, `mlp.fc11` up / `fc12` gate / `fc2`, `norm1`, `norm2`, `emb_ln`, layers under
`encoder.`), which transformers renames only in memory. And llama.cpp's `nomic-bert` GGUF files."""

import dataclasses

from flover.models.families._shared import Family
from flover.models.model_config import CheckpointError, ModelConfig

# nomic-ai's config keys -> transformers'
LEGACY_SIZES = {
    "n_embd": "hidden_size",
    "n_head": "num_attention_heads",
    "n_layer": "num_hidden_layers",
    "n_inner": "intermediate_size",
    "n_positions": "max_position_embeddings",
}


def nomic_fields(raw: dict) -> dict:
    legacy = "n_embd" in raw
    if legacy:
        _refuse_legacy_variants(raw)
        raw = {**raw, **{new: raw[old] for old, new in LEGACY_SIZES.items() if old in raw}}
        raw.setdefault("intermediate_size", 4 * raw["hidden_size"])
    heads, hidden = raw["num_attention_heads"], raw["hidden_size"]
    head_dim = raw.get("head_dim") or hidden // heads
    if head_dim * heads != hidden:
        raise CheckpointError(f"config.json: hidden size {hidden} is not {heads} heads of {head_dim}")
    params = raw.get("rope_parameters") or {}
    if params.get("rope_type", "default") != "default":
        raise CheckpointError(f"config.json: rope_type {params['rope_type']!r}: plain RoPE only")
    theta = raw.get("rotary_emb_base") if legacy else params.get("rope_theta", raw.get("rope_theta"))
    # (v1 / v1.5 say 8192 positions and were trained for 2048: llama.cpp's converter reads them so too)
    if legacy and isinstance(raw.get("max_trained_positions"), int):
        raw["max_position_embeddings"] = min(raw["max_position_embeddings"], raw["max_trained_positions"])
    biases = (raw.get("qkv_proj_bias", True), raw.get("mlp_fc1_bias", True)) if legacy else (False, False)
    if legacy and raw.get("mlp_fc1_bias", True) != raw.get("mlp_fc2_bias", True):
        raise CheckpointError("config.json: mlp_fc1_bias and mlp_fc2_bias differ: one MLP bias setting only")
    return dict(
        hidden_size=hidden,
        num_layers=raw["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=head_dim,
        intermediate_size=raw["intermediate_size"],
        vocab_size=raw["vocab_size"],
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        norm_eps=raw.get("layer_norm_epsilon" if legacy else "layer_norm_eps", 1e-12),
        hidden_act="silu" if legacy else raw.get("hidden_act", "silu"),
        tie_word_embeddings=False,
        rope_theta=float(theta if theta is not None else 1000.0),
        rope_scaling=None,
        rotary_dim=head_dim,
        qkv_bias=biases[0],
        o_bias=biases[0],
        mlp_bias=biases[1],
        sliding_windows=(None,) * raw["num_hidden_layers"],
        norm_layout="post",
        gated_mlp=True,
        encoder=True,
        encoder_rope=True,
        encoder_names="nomic",
        token_types=raw.get("type_vocab_size", 2),
    )


def _refuse_legacy_variants(raw: dict) -> None:
    """What nomic-ai's remote code can be configured to do that these encoders do not."""
    refused = {
        "prenorm": raw.get("prenorm", False),
        "parallel_block": raw.get("parallel_block", False),
        "use_rms_norm": raw.get("use_rms_norm", False),
        "rotary_emb_interleaved": raw.get("rotary_emb_interleaved", False),
        "rotary_scaling_factor": raw.get("rotary_scaling_factor") is not None,
        "rotary_emb_fraction": raw.get("rotary_emb_fraction", 1.0) != 1.0,
        "rotary_emb_scale_base": raw.get("rotary_emb_scale_base") is not None,
        "moe_every_n_layers (nomic-embed-text-v2-moe)": bool(raw.get("moe_every_n_layers") or raw.get("num_experts")),
        "causal": raw.get("causal", False),
    }
    if raw.get("activation_function", "swiglu") != "swiglu":
        refused[f"activation_function {raw['activation_function']!r}"] = True
    named = [name for name, on in refused.items() if on]
    if named:
        raise CheckpointError(f"config.json: {', '.join(named)}: not a nomic-bert flover serves")


def nomic_from_gguf(file, cfg: ModelConfig) -> ModelConfig:
    """llama.cpp's `nomic-bert` file: nomic-ai's layout (a fused attn_qkv), no biases, RoPE at the
    file's base, as many token types as its token_types table has rows."""
    if file.get("nomic-bert.attention.causal", False):
        raise CheckpointError(f"{file.path}: nomic-bert.attention.causal is true: not an encoder flover serves")
    types = file.tensors.get("token_types.weight")
    return dataclasses.replace(
        cfg,
        norm_eps=file.number("nomic-bert.attention.layer_norm_epsilon", 1e-12),
        rope_theta=file.number("nomic-bert.rope.freq_base", 1000.0),
        hidden_act="silu",
        qkv_bias="blk.0.attn_qkv.bias" in file.tensors,
        o_bias="blk.0.attn_output.bias" in file.tensors,
        mlp_bias="blk.0.ffn_up.bias" in file.tensors,
        tie_word_embeddings=False,
        norm_layout="post",
        gated_mlp=True,
        encoder=True,
        encoder_rope=True,
        encoder_names="nomic",
        token_types=types.shape[0] if types is not None else 2,
        eos_token_ids=(),
    )


FAMILY = Family(
    name="nomic_bert",
    hf_architectures=("NomicBertModel",),
    from_hf=nomic_fields,
    gguf_arch="nomic-bert",
    from_gguf=nomic_from_gguf,
    gguf_names={
        f"{hf}.{kind}": f"{name}.{kind}"
        for hf, name in {
            "attn.Wqkv": "attn_qkv",
            "attn.out_proj": "attn_output",
            "norm1": "attn_output_norm",
            "mlp.fc11": "ffn_up",
            "mlp.fc12": "ffn_gate",
            "mlp.fc2": "ffn_down",
            "norm2": "layer_output_norm",
        }.items()
        for kind in ("weight", "bias")
    },
    gguf_global_names={
        "embeddings.word_embeddings.weight": "token_embd.weight",
        "embeddings.token_type_embeddings.weight": "token_types.weight",
        "emb_ln.weight": "token_embd_norm.weight",
        "emb_ln.bias": "token_embd_norm.bias",
    },
    decoder="flover.models.bert:BertEncoder",
    layer_prefix="layers",
    weight_prefixes=("encoder.",),  # (nomic-ai's uploads: encoder.layers.N)
    embed_name="embeddings.word_embeddings.weight",
    number_fields=("layer_norm_eps", "rotary_emb_base"),
)
