"""Embeddings: how a model turns the final hidden rows of one input into one vector.

Where the pooling comes from: a sentence-transformers directory says it (modules.json lists a
Pooling module, whose config.json names the mode, and maybe a Normalize module); llama.cpp's GGUF
files say it in `<arch>.pooling_type` (its server normalizes them); `--pooling` chooses one for
any decoder (normalized, as every peer's embeddings endpoint is). The tensor half is
runner/pooling.py (this file is read where torch is not imported: the HTTP front).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from flover.config import POOLING_MODES, RANK, is_int  # ("last": the last token's row, as Qwen3-Embedding's)
from flover.models.model_config import CheckpointError, sequence_classifier_labels

# sentence-transformers' Pooling config keys -> our modes
_ST_MODES = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_lasttoken": "last",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
}
# llama.cpp's LLAMA_POOLING_TYPE_*: 1 mean, 2 cls, 3 last (0 none; 4 rank is a reranker's)
_GGUF_MODES = {1: "mean", 2: "cls", 3: "last"}
GGUF_RANK = 4


# a cross-encoder's activation on its label scores (sentence-transformers' CrossEncoder default:
# sigmoid for one label, none for more; its config.json may name one). "softmax" (llama.cpp's
# Qwen3 rerankers: two labels, yes and no): the first label's share, sigmoid of the difference
ACTIVATIONS = {
    "torch.nn.modules.activation.Sigmoid": "sigmoid",
    "torch.nn.modules.linear.Identity": "none",
}


@dataclass(frozen=True)
class Pooling:
    mode: str  # one of POOLING_MODES
    normalize: bool  # each vector divided by its Euclidean length
    source: str  # where it was read (said in the log and in errors)
    # a cross-encoder (reranker): the pooled row goes through the model's head to label scores,
    # then `activation` ("sigmoid" or "none"); its requests are (query, document) pairs
    classify: bool = False
    activation: str = "none"
    # a decoder reranker's (sentence-transformers' LogitScore, as Qwen3-Reranker's): the score is the
    # last row's logit of the first token minus the second's (None: that logit alone); its pairs
    # are rendered by the chat template as a query and a document message
    logit_tokens: tuple[int, int | None] | None = None
    # sentence-transformers' Dense modules after the pooling, in order (EmbeddingGemma's); a
    # reranker GGUF file's: its head (cls, cls.output) on the pooled row, in place of the model's
    dense: tuple["DenseConfig", ...] = ()
    # llama.cpp's rerank prompt (tokenizer.chat_template.rerank: text with {query} and {document});
    # its pairs are that text, and the model scores pairs only (its converter dropped the LM head)
    pair_template: str | None = None
    # a decoder scorer's pairs go through its chat template as a query and a document message, where
    # its tokenizer has one (else they are joined as the tokenizer joins a pair), as sentence-transformers'
    chat_pairs: bool = False
    # the model's files hold no LM head (a reranker GGUF file, a *ForSequenceClassification): no text
    scores_only: bool = False

    @property
    def scores(self) -> int | None:
        """A reranker's label scores a pair (None: the model's head says: num_labels)."""
        if self.logit_tokens is not None or self.activation == "softmax":
            return 1
        return self.dense[-1].out_features if self.classify and self.dense else None

    @property
    def every_row(self) -> bool:
        """Whether every prompt row is pooled (else one: the first or the last)."""
        return self.mode not in ("cls", "last")


def _checked_mode(mode: str, source: str) -> str:
    if mode not in POOLING_MODES:
        raise CheckpointError(f"{source}: pooling {mode!r} is not one of {', '.join(POOLING_MODES)}")
    return mode


def classifier_pooling(path: Path) -> Pooling | None:
    """A cross-encoder directory's (config.json: a *ForSequenceClassification): its first row
    through its head, then sigmoid for one label (none for more) unless its config.json names
    sentence-transformers' activation. None: the directory is no classifier."""
    config_file = path / "config.json"
    try:
        config = json.loads(config_file.read_text())
        labels = sequence_classifier_labels(config)
    except (OSError, ValueError, AttributeError, TypeError):
        return None  # (reading the model's config names what is wrong)
    if labels is None:
        return None
    named = (config.get("sentence_transformers") or {}).get("activation_fn")
    named = named or config.get("sbert_ce_default_activation_function")
    activation = _activation(path, named, labels)
    from flover.models.families import decoder_scorer

    if decoder_scorer(config.get("architectures")) is not None:
        return _decoder_scorer_pooling(path, config, labels, activation)
    return Pooling("cls", False, str(config_file), classify=True, activation=activation)


def _decoder_scorer_pooling(path: Path, config: dict, labels: int, activation: str) -> Pooling:
    """A decoder's *ForSequenceClassification (Qwen3-Reranker's seq-cls conversions): its last row
    (after the final norm) through its `score` head [labels, hidden], no bias; the pairs as
    sentence-transformers' CrossEncoder renders them (the chat template's query and document
    messages where the tokenizer has a template, else the tokenizer's own pair). It has no LM head."""
    hidden = config.get("hidden_size") or (config.get("text_config") or {}).get("hidden_size")
    score = DenseConfig(path, hidden, labels, False, "none", "score.weight", "score.bias")  # (in the model's files)
    return Pooling(
        "last", False, str(path / "config.json"), True, activation, dense=(score,), chat_pairs=True, scores_only=True
    )


def _activation(path: Path, named: str | None, labels: int) -> str:
    """A cross-encoder's activation: the one its files name (sentence-transformers 6 writes it in
    config_sentence_transformers.json, earlier ones in config.json), else sigmoid for one label."""
    st_file = path / "config_sentence_transformers.json"
    if named is None and st_file.is_file():
        try:
            named = json.loads(st_file.read_text()).get("activation_fn")
        except (ValueError, AttributeError) as e:
            raise CheckpointError(f"{st_file}: not a sentence-transformers config ({e!r})") from None
    if named is not None and named not in ACTIVATIONS:
        raise CheckpointError(f"{path}: activation_fn {named!r} is not one of {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[named] if named else "sigmoid" if labels == 1 else "none"


def _logit_score(path: Path, module_dir: str) -> Pooling:
    """A decoder reranker's LogitScore module (its true and false token ids)."""
    config_file = path / module_dir / "config.json"
    try:
        config = json.loads(config_file.read_text())
        true, false = config["true_token_id"], config.get("false_token_id")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{config_file}: cannot read the LogitScore config ({e!r})") from None
    if not is_int(true) or not (false is None or is_int(false)):
        raise CheckpointError(f"{config_file}: true_token_id / false_token_id must be token ids")
    activation = _activation(path, None, 1)
    return Pooling("last", False, str(config_file), classify=True, activation=activation, logit_tokens=(true, false))


def directory_pooling(path: Path) -> Pooling | None:
    """A sentence-transformers directory's pooling (modules.json), a cross-encoder's, or None
    when it has none."""
    classifier = classifier_pooling(path)
    if classifier is not None:
        return classifier
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return None
    try:
        modules = json.loads(modules_file.read_text())
        order = [(m["type"].rsplit(".", 1)[-1], m.get("path", "")) for m in modules]
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise CheckpointError(f"{modules_file}: not a sentence-transformers module list ({e!r})") from None
    kinds = dict(order)
    if [kind for kind, _ in order] == ["Transformer", "LogitScore"]:
        return _logit_score(path, kinds["LogitScore"])
    if "Pooling" not in kinds:
        return None
    names = [kind for kind, _ in order]
    dense = tuple(where for kind, where in order if kind == "Dense")
    expected = ["Transformer", "Pooling", *["Dense"] * len(dense), *(["Normalize"] if "Normalize" in kinds else [])]
    if names != expected:  # (a Dense module's own file: dense_config)
        raise CheckpointError(
            f"{modules_file}: modules {', '.join(names)}; supported: Transformer, Pooling, Dense..., Normalize"
        )
    config_file = path / kinds["Pooling"] / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{config_file}: cannot read the pooling config ({e!r})") from None
    modes = [mode for key, mode in _ST_MODES.items() if config.get(key)]
    if len(modes) != 1 or not config.get("include_prompt", True):
        raise CheckpointError(f"{config_file}: one pooling mode with the whole prompt is supported; it asks {config}")
    dense_configs = tuple(dense_config(path / d) for d in dense)
    return Pooling(modes[0], "Normalize" in kinds, str(modules_file), dense=dense_configs)


# a Dense module's activation_function (sentence-transformers' names) -> ours
DENSE_ACTIVATIONS = {"torch.nn.modules.linear.Identity": "none", "torch.nn.modules.activation.Tanh": "tanh"}


@dataclass(frozen=True)
class DenseConfig:
    """One of sentence-transformers' Dense modules after the pooling (EmbeddingGemma's projections):
    from its directory, or as llama.cpp's converter stores it in a GGUF file (dense_2, dense_3)."""

    weights: Path  # its model.safetensors (or the GGUF file, or the model's directory: its tensors)
    in_features: int
    out_features: int
    bias: bool
    activation: str  # "none" or "tanh"
    weight_name: str = "linear.weight"  # [out, in]
    bias_name: str = "linear.bias"  # [out], where `bias`


def dense_config(module_dir: Path) -> DenseConfig:
    config_file = module_dir / "config.json"
    try:
        config = json.loads(config_file.read_text())
        dims = config["in_features"], config["out_features"]
        bias, named = config.get("bias", True), config.get("activation_function", "torch.nn.modules.activation.Tanh")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{config_file}: cannot read the Dense config ({e!r})") from None
    if not all(is_int(d) and d > 0 for d in dims) or not isinstance(bias, bool):
        raise CheckpointError(f"{config_file}: in_features / out_features must be positive integers, bias a bool")
    if named not in DENSE_ACTIVATIONS or config.get("use_residual"):
        raise CheckpointError(f"{config_file}: activation {named!r} (or a residual) is not supported")
    return DenseConfig(module_dir / "model.safetensors", *dims, bias, DENSE_ACTIVATIONS[named])


def gguf_pooling(pooling_type: int | None, source: str) -> Pooling | None:
    """llama.cpp's `<arch>.pooling_type` (None or 0: the file is no embedding model)."""
    if not pooling_type:
        return None
    if pooling_type not in _GGUF_MODES:
        raise CheckpointError(f"{source}: pooling_type {pooling_type} is not supported (1 mean, 2 cls, 3 last, 4 rank)")
    return Pooling(_GGUF_MODES[pooling_type], True, source)


RANK_TOKENS = ("yes", "no")  # sentence-transformers' default LogitScore tokens for a causal LM


def chosen_pooling(
    asked: str | None, found: Pooling | None, token_id: Callable[[str], int | None] = lambda _: None
) -> Pooling | None:
    """`--pooling` over what the checkpoint says (the checkpoint's normalization kept). "rank": the
    model as a reranker, as sentence-transformers' CrossEncoder loads a causal LM's directory
    (Qwen3-Reranker's uploads): the last row's logit of "yes" minus "no", then sigmoid (`token_id`:
    the tokenizer's lookup of a vocabulary entry)."""
    if asked is None:
        return found
    if found is not None and found.classify:
        raise CheckpointError(
            f"--pooling: {found.source} is a reranker (a cross-encoder): it scores pairs with its own head"
        )
    if asked == RANK:
        ids = [token_id(token) for token in RANK_TOKENS]
        if None in ids:
            missing = [token for token, i in zip(RANK_TOKENS, ids) if i is None]
            raise CheckpointError(f"--pooling rank: the vocabulary has no {' or '.join(map(repr, missing))} token")
        return Pooling("last", False, "--pooling rank", classify=True, activation="sigmoid", logit_tokens=tuple(ids))
    mode = _checked_mode(asked, "--pooling")
    return Pooling(mode, True if found is None else found.normalize, "--pooling")


def pair_kind(pooling: Pooling | None, vocab_size: int, chat_template: bool = False) -> str | None:
    """How a reranker takes its (query, document) pairs (Intake.pairs): "tokenizer" (a cross-encoder),
    "template" (a decoder's: its LogitScore, whose token ids must be the model's, its GGUF file's
    rerank prompt, or a decoder scorer's where the tokenizer has a `chat_template`); None: not a
    reranker."""
    if pooling is None or not pooling.classify:
        return None
    if pooling.pair_template is not None or pooling.chat_pairs and chat_template:
        return "template"
    if pooling.logit_tokens is None:
        return "tokenizer"
    if not all(t is None or 0 <= t < vocab_size for t in pooling.logit_tokens):
        raise CheckpointError(
            f"{pooling.source}: token ids {pooling.logit_tokens} outside the vocabulary ({vocab_size})"
        )
    return "template"


def pooled_rows(pooling: Pooling, start: int, length: int, prompt_len: int) -> range:
    """Of a prompt chunk at positions [start, start + length), the offsets of the rows to keep."""
    if pooling.every_row:
        return range(length)
    at = 0 if pooling.mode == "cls" else prompt_len - 1
    return range(at - start, at - start + 1) if start <= at < start + length else range(0)


def sentence_max_tokens(path: Path) -> int | None:
    """A sentence-transformers directory's max_seq_length (sentence_bert_config.json): the tokens
    its inputs are cut to there, and the positions flover gives them by default; None: unsaid."""
    config_file = path / "sentence_bert_config.json"
    if not config_file.is_file():
        return None
    try:
        value = json.loads(config_file.read_text()).get("max_seq_length")
    except (ValueError, AttributeError) as e:
        raise CheckpointError(f"{config_file}: not a sentence-transformers config ({e!r})") from None
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise CheckpointError(f"{config_file}: max_seq_length must be a positive integer, got {value!r}")
    return value


def cosine(a: list[float], b: list[float]) -> float:
    """Two vectors' cosine similarity (an embedding model's score of a pair; 0 for a zero vector)."""
    dot = math.fsum(x * y for x, y in zip(a, b))
    norm = math.sqrt(math.fsum(x * x for x in a)) * math.sqrt(math.fsum(y * y for y in b))
    return dot / norm if norm else 0.0
