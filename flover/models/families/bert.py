"""BERT-family text encoders (all-MiniLM, BGE, E5, GTE as sentence-transformers save them:
BertModel's tensors at the top level; and llama.cpp's `bert` GGUF files): embeddings only, never text. Their graph is
models/bert.py's (absolute positions, post-norm LayerNorms, erf GELU, attention both ways within
an input); their pooling is the directory's modules.json (models/pooling.py).

Cross-encoders (rerankers: ms-marco-MiniLM as BertForSequenceClassification, BGE-reranker as
XLMRobertaForSequenceClassification) are the same encoder with a head on the first row: they
score a (query, document) pair read as one input. RoBERTa's differ only in where positions
start in their table (after the padding id) and in the head's names."""

import dataclasses

from flover.models.families._shared import Family, sizes
from flover.models.model_config import CheckpointError, ModelConfig, sequence_classifier_labels


def bert_fields(raw: dict) -> dict:
    if raw.get("position_embedding_type", "absolute") != "absolute":
        raise CheckpointError(
            f"config.json: position_embedding_type {raw['position_embedding_type']!r}: absolute positions only"
        )
    if raw.get("is_decoder") or raw.get("add_cross_attention"):
        raise CheckpointError("config.json: a BERT decoder or cross-attention is not an encoder flover serves")
    heads = raw["num_attention_heads"]
    head_dim = raw["hidden_size"] // heads
    if head_dim * heads != raw["hidden_size"]:
        raise CheckpointError(f"config.json: hidden_size {raw['hidden_size']} is not a multiple of {heads} heads")
    offset = raw.get("pad_token_id", 1) + 1 if raw.get("model_type") in ROBERTA_TYPES else 0
    given = sizes(raw, head_dim, 512)
    return dict(
        **{
            **given,
            "norm_eps": raw.get("layer_norm_eps", 1e-12),
            "max_position_embeddings": given["max_position_embeddings"] - offset,  # (positions served)
        },
        position_offset=offset,
        **classifier_fields(raw),
        hidden_act=raw.get("hidden_act", "gelu"),
        tie_word_embeddings=False,
        rope_theta=10000.0,  # (no RoPE: absolute position embeddings)
        rope_scaling=None,
        rotary_dim=head_dim,
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
        sliding_windows=(None,) * raw["num_hidden_layers"],
        norm_layout="post",
        gated_mlp=False,
        encoder=True,
        token_types=raw.get("type_vocab_size", 2),
    )


ROBERTA_TYPES = ("roberta", "xlm-roberta")


def classifier_fields(raw: dict) -> dict:
    """A *ForSequenceClassification's head: BERT's pooler and classifier, or RoBERTa's
    classifier.dense and out_proj; its label count (id2label's, as transformers counts)."""
    labels = sequence_classifier_labels(raw)
    if labels is None:
        return {}
    if raw.get("problem_type") not in (None, "regression", "single_label_classification", "multi_label_classification"):
        raise CheckpointError(f"config.json: problem_type {raw['problem_type']!r} is not a classifier flover serves")
    return dict(classifier="dense" if raw.get("model_type") in ROBERTA_TYPES else "pooler", num_labels=labels)


def bert_from_gguf(file, cfg: ModelConfig) -> ModelConfig:
    """A `bert` GGUF file (llama.cpp's converter): an encoder (its causal flag false), LayerNorms,
    biases everywhere, as many token types as its token_types table has rows."""
    if file.get("bert.attention.causal", False):
        raise CheckpointError(f"{file.path}: bert.attention.causal is true: not an encoder flover serves")
    types = file.tensors.get("token_types.weight")
    return dataclasses.replace(
        cfg,
        norm_eps=file.number("bert.attention.layer_norm_epsilon", 1e-12),
        hidden_act="gelu",
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
        tie_word_embeddings=False,
        norm_layout="post",
        gated_mlp=False,
        encoder=True,
        token_types=types.shape[0] if types is not None else 2,
        eos_token_ids=(),
    )


BERT_GGUF_LAYER_NAMES = {
    f"{hf}.{kind}": f"{name}.{kind}"
    for hf, name in {
        "attention.self.query": "attn_q",
        "attention.self.key": "attn_k",
        "attention.self.value": "attn_v",
        "attention.output.dense": "attn_output",
        "attention.output.LayerNorm": "attn_output_norm",
        "intermediate.dense": "ffn_up",
        "output.dense": "ffn_down",
        "output.LayerNorm": "layer_output_norm",
    }.items()
    for kind in ("weight", "bias")
}

FAMILY = Family(
    name="bert",
    hf_architectures=(
        "BertModel",
        "BertForSequenceClassification",
        "RobertaModel",
        "RobertaForSequenceClassification",
        "XLMRobertaModel",
        "XLMRobertaForSequenceClassification",
    ),
    from_hf=bert_fields,
    gguf_arch="bert",
    from_gguf=bert_from_gguf,
    gguf_names=BERT_GGUF_LAYER_NAMES,
    gguf_global_names={
        "embeddings.word_embeddings.weight": "token_embd.weight",
        "embeddings.position_embeddings.weight": "position_embd.weight",
        "embeddings.token_type_embeddings.weight": "token_types.weight",
        "embeddings.LayerNorm.weight": "token_embd_norm.weight",
        "embeddings.LayerNorm.bias": "token_embd_norm.bias",
    },
    decoder="flover.models.bert:BertEncoder",
    native=True,  # (its own step: native/encoder_forward.c)
    layer_prefix="encoder.layer",
    weight_prefixes=("bert.", "roberta."),
    embed_name="embeddings.word_embeddings.weight",
    number_fields=("layer_norm_eps",),
)
