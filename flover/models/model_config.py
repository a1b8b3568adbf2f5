"""What the engine knows of a model: its sizes and its *features*, the same whatever the family or
file it came from (flover/models/families/*.py read config.json and GGUF metadata into it). No
field names a family: the decoder, the GGUF reader and the native step read features."""

from __future__ import annotations

import math
from dataclasses import dataclass


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
    scales = {"embed_scale": cfg.embed_scale, "residual_scale": cfg.residual_scale, "logit_scale": cfg.logit_scale}
    scales |= {"attn_scale": cfg.attn_scale}
    for name, value in (("norm_eps", cfg.norm_eps), ("rope_theta", cfg.rope_theta), *scales.items()):
        if value is None and name in scales:
            continue
        if isinstance(value, bool) or not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            problems.append(f"{name} {value!r} must be a positive number")
    if cfg.norm_layout not in ("pre", "post", "sandwich") or cfg.qk_norm not in ("", "head", "projection"):
        problems.append(f"norm layout {cfg.norm_layout!r} / q-k norm {cfg.qk_norm!r} unknown")
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
    problems += _linear_attention_problems(cfg) + _per_layer_shape_problems(cfg)
    if problems:
        raise CheckpointError(f"{where}: " + "; ".join(problems))


def _per_layer_shape_problems(cfg: "ModelConfig") -> list[str]:
    """(Gemma 4) the full-attention layers' own sizes, the layers reading another's KV, the soft cap."""
    check_sizes(
        {"global_head_dim": cfg.global_head_dim, "global_kv_heads": cfg.global_kv_heads}, "attention", optional=True
    )
    problems = []
    if cfg.global_head_dim and cfg.global_head_dim % 2:
        problems.append(f"global head_dim {cfg.global_head_dim}: RoPE needs an even size")
    if cfg.global_kv_heads and cfg.num_heads % cfg.global_kv_heads:
        problems.append(f"{cfg.num_heads} attention heads cannot share {cfg.global_kv_heads} global kv heads evenly")
    sources = cfg.kv_sources
    if sources and (
        len(sources) != cfg.num_layers
        or any(isinstance(s, bool) or not isinstance(s, int) or not 0 <= s <= n for n, s in enumerate(sources))
        or any(cfg.kv_source(s) != s or cfg.is_global(s) != cfg.is_global(n) for n, s in enumerate(sources))
    ):
        problems.append("each layer must read its own KV or that of an earlier layer of its kind that keeps its own")
    if not cfg.wide_mlp_layers <= set(range(cfg.num_layers)):
        problems.append(f"wide MLP layers {sorted(cfg.wide_mlp_layers)} beyond the {cfg.num_layers} layers")
    cap = cfg.final_softcap
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not 0 < cap < math.inf):
        problems.append(f"final_logit_softcapping {cap!r} must be a positive number")
    if cfg.per_layer_input is not None:
        check_sizes(
            {
                "hidden_size_per_layer_input": cfg.per_layer_input.width,
                "vocab_size_per_layer_input": cfg.per_layer_input.vocab,
            },
            "per-layer inputs",
        )
        if cfg.per_layer_input.vocab < cfg.vocab_size:
            problems.append(f"per-layer inputs for {cfg.per_layer_input.vocab} of the {cfg.vocab_size} token ids")
    return problems


def _linear_attention_problems(cfg: "ModelConfig") -> list[str]:
    la = cfg.linear_attention
    if la is None:
        return []
    check_sizes(
        {
            "linear_num_key_heads": la.key_heads,
            "linear_num_value_heads": la.value_heads,
            "linear_key_head_dim": la.key_dim,
            "linear_value_head_dim": la.value_dim,
        },
        "linear attention",
    )
    problems = []
    if la.value_heads % la.key_heads:
        problems.append(f"{la.value_heads} linear-attention value heads cannot share {la.key_heads} key heads evenly")
    if isinstance(la.conv_kernel, bool) or not isinstance(la.conv_kernel, int) or not 2 <= la.conv_kernel <= 64:
        problems.append(f"linear_conv_kernel_dim {la.conv_kernel!r} must be an integer in [2, 64]")
    if not la.layers <= set(range(cfg.num_layers)):
        problems.append(f"linear-attention layers {sorted(la.layers)} beyond the {cfg.num_layers} layers")
    return problems


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
    # how a checkpoint stacks the experts: "" one tensor each; "interleaved" (gpt-oss) [experts, in,
    # out] with gate and up alternating in out; "halves" (Gemma 4) [experts, out, in], gate's rows then up's
    stacked: str = ""
    # Qwen3.5-MoE: beside the routed experts a dense "shared expert" MLP of this width (0: none)
    # runs on every row, its output times sigmoid(shared_expert_gate(x)), added to theirs
    shared_intermediate: int = 0
    # Gemma 4: the experts run beside the dense MLP (each with a norm before and after, the two
    # outputs added), the router reads the residual RMS-normed (no weight) times a learned scale
    # and hidden^-0.5, and each chosen expert's weight is multiplied by a learned per-expert scale
    beside_mlp: bool = False
    router_scaled: bool = False

    def block_of(self, layer: str) -> str:
        """The checkpoint's name of a layer's module holding the router and the experts."""
        return f"{layer}.{self.block}" if self.block else layer


@dataclass(frozen=True)
class PerLayerInputConfig:
    """(Gemma 4's E-series) a small input per layer and token: a table of `vocab` rows of
    layers x `width` (looked up by token, times sqrt(width)) plus a projection of the scaled
    embedding (times hidden^-0.5, RMS-normed per layer), the two summed times 1/sqrt(2); each layer
    multiplies it into gelu(gate(x)) after its MLP and adds norm(proj(...)) to the residual."""

    width: int
    vocab: int


@dataclass(frozen=True)
class LinearAttentionConfig:
    """Gated DeltaNet layers (Qwen3.5 / 3.6, Qwen3-Next) in place of attention in `layers`
    (models/gated_deltanet.py): a causal depthwise conv of `conv_kernel` taps over q, k and v,
    `key_heads` q/k heads of `key_dim` and `value_heads` value heads of `value_dim` (each q/k head
    serves value_heads / key_heads of them), a recurrent state [value heads, key_dim, value_dim]
    per sequence instead of KV."""

    layers: frozenset[int]
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int
    # which value heads share a q/k head: Hugging Face's "grouped" order (value head j reads q/k
    # head j // (value_heads / key_heads)), or llama.cpp's "tiled" one (j % key_heads)
    tiled: bool = False
    # the decay rates as stored: "A_log" (Hugging Face: A = -exp(A_log)), or "A" itself (GGUF's ssm_a)
    decay_stored: str = "A_log"

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim


def sequence_classifier_labels(raw: dict) -> int | None:
    """A config.json's label count where it is a *ForSequenceClassification (a cross-encoder;
    id2label's count, as transformers counts, else 2), or None where it is no classifier."""
    architecture = (raw.get("architectures") or [""])[0]
    if not isinstance(architecture, str) or not architecture.endswith("ForSequenceClassification"):
        return None
    return raw.get("num_labels") or len(raw.get("id2label") or {}) or 2


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
    # RMSNorm of q and k before RoPE: "head" over each head (weights [head_dim]), "projection" over
    # the whole of each (weights [heads * head_dim] and [kv_heads * head_dim]), "" none
    qk_norm: str = ""
    # where the RMSNorms sit: "pre" before attention and the MLP; "post" after each, on its output
    # before the residual add (none before); "sandwich" both (four a layer)
    norm_layout: str = "pre"
    # every norm's weight multiplies in float32 and the product is rounded once (else the normalised
    # rows are rounded to the model's dtype first); its weights are stored minus `norm_offset` (the
    # norm multiplies offset + weight)
    norm_float32: bool = False
    norm_offset: float = 0.0
    # (Gemma 4) every norm in float32 whatever the dtype (float64 too), as x * (mean(x^2) + eps)^-0.5
    norm_exact_float32: bool = False
    fused_projections: bool = False  # qkv_proj and gate_up_proj stored fused
    gated_mlp: bool = True  # down(act(gate) * up); False: fc_out(act(fc_in)) (a parallel block's MLP)
    rope_interleaved: bool = False  # RoPE turns pairs (2i, 2i + 1); else the halves (rotate_half)
    # the embeddings times embed_scale (None: 1); `embed_scale_rounded`: that factor rounded to the
    # model's dtype before it multiplies (as Gemma's scaled embedding), else applied as a Python float
    embed_scale: float | None = None
    embed_scale_rounded: bool = False
    residual_scale: float | None = None  # each block's output times it before the residual add
    logit_scale: float | None = None  # the logits divided by it
    attn_scale: float | None = None  # of the scores; None: 1 / sqrt(head_dim)
    local_rope_theta: float | None = None  # RoPE base of the sliding-window layers (no scaling there)
    nope_layers: frozenset[int] = frozenset()  # layers that skip RoPE
    moe: MoEConfig | None = None  # a mixture of experts in place of the MLP of some layers
    attn_sinks: bool = False  # a learned logit per head in each softmax's denominator
    # (Qwen3.5) q_proj yields per head the query and a gate: attention's output times sigmoid(gate)
    attn_output_gate: bool = False
    linear_attention: LinearAttentionConfig | None = None  # recurrent layers in place of some attention
    # (Gemma 4) the full-attention layers' own head size and kv heads (None: as the others')
    global_head_dim: int | None = None
    global_kv_heads: int | None = None
    global_k_eq_v: bool = False  # the full-attention layers' values are their keys' projection (no v_proj)
    v_norm: bool = False  # values RMS-normed per head (no weight) before they are stored
    # per layer, the layer whose keys and values it reads: itself, or an earlier one's (it then
    # projects only queries and stores none); (): every layer its own
    kv_sources: tuple[int, ...] = ()
    wide_mlp_layers: frozenset[int] = frozenset()  # layers whose MLP is 2 x intermediate_size wide
    per_layer_input: PerLayerInputConfig | None = None
    final_softcap: float | None = None  # the logits as cap * tanh(logits / cap)
    layer_scalar: bool = False  # each layer's output times a learned scalar
    # (BERT-family encoders, models/bert.py) attention both ways within each input, no KV kept,
    # vectors made and no text; `token_types`: rows of its token-type table
    encoder: bool = False
    token_types: int = 0
    # a cross-encoder (reranker): its first row through a head to `num_labels` scores. "pooler":
    # BERT's pooler (dense, tanh) then its classifier; "dense": RoBERTa's classifier.dense, tanh, out_proj
    classifier: str | None = None
    num_labels: int = 0
    position_offset: int = 0  # position p reads row p + offset of the position table (RoBERTa's pad + 1)
    encoder_rope: bool = False  # (nomic-bert) RoPE on each head's q and k in place of a position table
    encoder_names: str = "bert"  # whose names an encoder's tensors have (models/bert.py NAMES)
    # (EmbeddingGemma) a decoder whose attention sees its whole input both ways (a sliding-window
    # layer: keys less than its window away on either side): it makes embeddings only
    bidirectional: bool = False

    @property
    def embeds_only(self) -> bool:
        """An encoder or a bidirectional decoder: each input comes whole, vectors and no text."""
        return self.encoder or self.bidirectional

    def kv_layers(self) -> list[int]:
        """The layers that keep keys and values (the others keep a recurrent state instead, or
        read another layer's)."""
        if self.encoder:
            return []
        recurrent = self.linear_attention.layers if self.linear_attention is not None else frozenset()
        return [n for n in range(self.num_layers) if n not in recurrent and self.kv_source(n) == n]

    def kv_source(self, n: int) -> int:
        return self.kv_sources[n] if self.kv_sources else n

    def is_global(self, n: int) -> bool:
        return self.sliding_windows[n] is None

    def layer_head_dim(self, n: int) -> int:
        return self.global_head_dim if self.global_head_dim and self.is_global(n) else self.head_dim

    def layer_kv_heads(self, n: int) -> int:
        return self.global_kv_heads if self.global_kv_heads and self.is_global(n) else self.num_kv_heads
