"""GPT-J (the Flover paper's model): its own graph (models/gptj.py: attention and the MLP in
parallel after one LayerNorm, biased MLP and LM head), interleaved partial RoPE, its own tensor
names. The native step does not run it; no GGUF files are read for it."""

from flover.models.families._shared import Family


def from_hf(raw: dict) -> dict:
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
        rope_interleaved=True,
        qkv_bias=False,
        o_bias=False,
        mlp_bias=True,
        gated_mlp=False,
        sliding_windows=(None,) * layers,
    )


def test_kwargs(preset: dict, eos_id: int) -> dict:
    return dict(
        n_embd=preset["hidden_size"],
        n_layer=preset["num_layers"],
        n_head=preset["num_heads"],
        n_inner=preset["intermediate_size"],
        n_positions=preset["max_position_embeddings"],
        rotary_dim=preset.get("rotary_dim", preset["hidden_size"] // preset["num_heads"] // 2),
    )


FAMILY = Family(
    name="gptj",
    hf_architectures=("GPTJForCausalLM",),
    from_hf=from_hf,
    decoder="flover.models.gptj:GPTJForCausalLM",
    native=False,
    layer_prefix="transformer.h",
    embed_name="transformer.wte.weight",
    test_config="GPTJConfig",
    test_kwargs=test_kwargs,
)
