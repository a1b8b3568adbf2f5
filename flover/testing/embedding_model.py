"""Embedding checkpoints for tests and benchmarks, as sentence-transformers directories (modules.json,
1_Pooling/config.json, Normalize), so that `sentence_transformers.SentenceTransformer(dir)` is
the reference: a decoder checkpoint made one (as Qwen3-Embedding's is), and small random BERT
encoders (as all-MiniLM, BGE, E5 are) with a WordPiece tokenizer trained here."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

# our pooling modes -> sentence-transformers' Pooling config key
ST_POOLING_KEYS = {
    "mean": "pooling_mode_mean_tokens",
    "cls": "pooling_mode_cls_token",
    "last": "pooling_mode_lasttoken",
    "max": "pooling_mode_max_tokens",
    "mean_sqrt_len": "pooling_mode_mean_sqrt_len_tokens",
}


def as_sentence_transformer(src: str | Path, out: str | Path, mode: str, normalize: bool = True) -> Path:
    """A copy of the checkpoint directory `src` at `out` that pools as `mode` (normalized or not);
    its tokenizer pads with its EOS (sentence-transformers pads a batch)."""
    out = Path(out)
    if Path(src).resolve() != out.resolve():
        shutil.copytree(src, out, dirs_exist_ok=True)
    hidden = json.loads((out / "config.json").read_text())["hidden_size"]
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (out / "modules.json").write_text(json.dumps(modules, indent=1))
    (out / "1_Pooling").mkdir(exist_ok=True)
    (out / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": hidden, ST_POOLING_KEYS[mode]: True})
    )
    tokenizer_config = out / "tokenizer_config.json"
    config = json.loads(tokenizer_config.read_text())
    config.setdefault("pad_token", config.get("eos_token"))
    tokenizer_config.write_text(json.dumps(config, indent=1))
    return out


def train_wordpiece(vocab_size: int, seed: int = 0):
    """A BERT-style (uncased WordPiece, [CLS] ... [SEP]) tokenizer trained on the test corpus."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    from flover.testing.tiny_model import corpus

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=specials)
    tok.train_from_iterator(corpus(seed=seed), trainer)
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    return tok


def train_unigram(vocab_size: int, seed: int = 0):
    """An XLM-RoBERTa-style tokenizer (SentencePiece's unigram model, words marked with U+2581, runs
    of spaces merged; `<s> a </s>` and `<s> a </s></s> b </s>`) trained on the test corpus."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    from flover.testing.tiny_model import corpus

    specials = ["<s>", "<pad>", "</s>", "<unk>"]
    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.Sequence([normalizers.Strip(), normalizers.Replace(Regex(" {2,}"), " ")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    trainer = trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=specials, unk_token="<unk>")
    tok.train_from_iterator(corpus(seed=seed), trainer)
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", bos), ("</s>", eos)]
    )
    return tok


def make_tiny_bert(out: str | Path, mode: str = "mean", seed: int = 0, **config) -> Path:
    """A random BertModel (transformers, fixed seed; `config` overrides its sizes) with a trained
    WordPiece tokenizer, as a sentence-transformers directory pooling as `mode`, normalized."""
    import torch
    import transformers

    out = Path(out)
    tok = train_wordpiece(512, seed)
    sizes = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
    bert = transformers.BertConfig(vocab_size=tok.get_vocab_size(), max_position_embeddings=128, **{**sizes, **config})
    torch.manual_seed(seed)
    transformers.BertModel(bert, add_pooling_layer=False).save_pretrained(out)
    fast = transformers.BertTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]"
    )
    fast.save_pretrained(out)
    return as_sentence_transformer(out, out, mode)


def make_tiny_nomic_bert(out: str | Path, seed: int = 0) -> Path:
    """A random NomicBertModel (transformers: RoPE, SwiGLU, no biases) with a trained WordPiece
    tokenizer, as a sentence-transformers directory (mean pooling, normalized), 128 positions."""
    import torch
    import transformers

    out = Path(out)
    tok = train_wordpiece(512, seed)
    sizes = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96)
    config = transformers.NomicBertConfig(vocab_size=tok.get_vocab_size(), max_position_embeddings=128, **sizes)
    torch.manual_seed(seed)
    model = transformers.NomicBertModel(config)
    _randomize_biases_and_norms(model)
    model.save_pretrained(out)
    fast = transformers.BertTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]"
    )
    fast.save_pretrained(out)
    return as_sentence_transformer(out, out, "mean")


def as_nomic_upload(model_dir: Path) -> Path:
    """A NomicBertModel directory rewritten in place as nomic-ai's uploads are: GPT-2-style config
    keys, twice the positions it was trained for stated as n_positions (as v1.5's 8192 and 2048);
    transformers already saves the tensors under their remote code's names."""
    config = json.loads((model_dir / "config.json").read_text())
    legacy = {
        "architectures": ["NomicBertModel"],
        "model_type": "nomic_bert",
        "n_embd": config["hidden_size"],
        "n_head": config["num_attention_heads"],
        "n_layer": config["num_hidden_layers"],
        "n_inner": config["intermediate_size"],
        "n_positions": 2 * config["max_position_embeddings"],
        "max_trained_positions": config["max_position_embeddings"],
        "vocab_size": config["vocab_size"],
        "type_vocab_size": config["type_vocab_size"],
        "layer_norm_epsilon": config["layer_norm_eps"],
        "rotary_emb_base": (config.get("rope_parameters") or {}).get("rope_theta", 1000),
        "rotary_emb_fraction": 1.0,
        "rotary_emb_interleaved": False,
        "rotary_scaling_factor": None,
        "activation_function": "swiglu",
        "qkv_proj_bias": False,
        "mlp_fc1_bias": False,
        "mlp_fc2_bias": False,
        "prenorm": False,
        "causal": False,
        "pad_token_id": config.get("pad_token_id", 0),
    }
    (model_dir / "config.json").write_text(json.dumps(legacy, indent=1))
    return model_dir


def _randomize_biases_and_norms(model) -> None:
    """transformers zeroes biases and sets LayerNorms to ones: make them count (BERT's `LayerNorm`,
    nomic-bert's `post_attention_layernorm` too)."""
    import torch

    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if name.endswith("bias") or "layernorm" in name.lower():
                tensor.normal_(0.0 if name.endswith("bias") else 1.0, 0.1)


def make_tiny_xlm_roberta(out: str | Path, reranker: bool = False, seed: int = 0) -> Path:
    """A random XLM-RoBERTa with the unigram tokenizer (train_unigram), as BGE's are saved:
    bge-m3's kind (XLMRobertaModel as a sentence-transformers directory: CLS pooling, normalized)
    or, `reranker`, bge-reranker's (XLMRobertaForSequenceClassification, one label). Padding id 1,
    so positions start at 2."""
    import torch
    import transformers

    out = Path(out)
    tok = train_unigram(512, seed)
    sizes = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
    ids = dict(
        pad_token_id=tok.token_to_id("<pad>"), bos_token_id=tok.token_to_id("<s>"), eos_token_id=tok.token_to_id("</s>")
    )
    config = transformers.XLMRobertaConfig(
        vocab_size=tok.get_vocab_size(), max_position_embeddings=130, type_vocab_size=1, num_labels=1, **ids, **sizes
    )
    torch.manual_seed(seed)
    model = (transformers.XLMRobertaForSequenceClassification if reranker else transformers.XLMRobertaModel)(config)
    _randomize_biases_and_norms(model)
    model.save_pretrained(out)
    specials = dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>", cls_token="<s>")
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, sep_token="</s>", **specials).save_pretrained(out)
    return out if reranker else as_sentence_transformer(out, out, "cls")


def make_tiny_cross_encoder(out: str | Path, kind: str = "bert", labels: int = 1, seed: int = 0) -> Path:
    """A random reranker as sentence-transformers' CrossEncoder saves one: BertForSequenceClassification
    (ms-marco-MiniLM's kind: pair tokens of type 1 after the first [SEP]) or, `kind` "xlm-roberta",
    XLMRobertaForSequenceClassification (BGE-reranker's: positions after the padding id, one token
    type, `[CLS] a [SEP] [SEP] b [SEP]` as RoBERTa's `<s> a </s></s> b </s>`)."""
    import torch
    import transformers
    from tokenizers import processors

    out = Path(out)
    tok = train_wordpiece(512, seed)
    sizes = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, num_labels=labels)
    torch.manual_seed(seed)
    if kind == "bert":
        config = transformers.BertConfig(vocab_size=tok.get_vocab_size(), max_position_embeddings=128, **sizes)
        model = transformers.BertForSequenceClassification(config)
    else:
        cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]",
            pair="[CLS] $A [SEP] [SEP] $B [SEP]",
            special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
        )
        config = transformers.XLMRobertaConfig(
            vocab_size=tok.get_vocab_size(), max_position_embeddings=130, type_vocab_size=1, pad_token_id=0, **sizes
        )
        model = transformers.XLMRobertaForSequenceClassification(config)
    _randomize_biases_and_norms(model)
    model.save_pretrained(out)
    tokenizer = (
        transformers.BertTokenizerFast if kind == "bert" else transformers.PreTrainedTokenizerFast
    )  # (types or none)
    tokenizer(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]"
    ).save_pretrained(out)
    return out


def make_tiny_embedding_gemma(
    out: str | Path, seed: int = 0, window: int = 8, layers: int = 3, out_width: int = 48
) -> Path:
    """A random EmbeddingGemma (Gemma3TextModel with attention both ways: sliding-window layers of
    `window` (keys less than window // 2 + 1 away on either side), every 6th and the last one
    global) as its sentence-transformers directory: mean pooling, two Dense projections
    (64 -> 128 -> out_width, no bias, no activation), Normalize."""
    import torch
    import transformers
    from safetensors.torch import save_file

    from flover.testing.tiny_model import EOS, train_tokenizer

    out = Path(out)
    tok = train_tokenizer(512, seed)
    config = transformers.Gemma3TextConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        sliding_window=window,
        layer_types=["full_attention" if i % 6 == 5 or i == layers - 1 else "sliding_attention" for i in range(layers)],
        query_pre_attn_scalar=16,
        use_bidirectional_attention=True,
    )
    torch.manual_seed(seed)
    model = transformers.Gemma3TextModel(config)
    with torch.no_grad():  # (norm weights start at zero, as (1 + w): make them count)
        for name, tensor in model.named_parameters():
            if "norm" in name:
                tensor.normal_(0.0, 0.2)
    model.save_pretrained(out)
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=EOS
    ).save_pretrained(out)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"},
        {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"},
        {"idx": 4, "name": "4", "path": "4_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (out / "modules.json").write_text(json.dumps(modules, indent=1))
    (out / "1_Pooling").mkdir(exist_ok=True)
    (out / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 64, ST_POOLING_KEYS["mean"]: True})
    )
    for module, (n_in, n_out) in (("2_Dense", (64, 128)), ("3_Dense", (128, out_width))):
        (out / module).mkdir(exist_ok=True)
        dense = {"in_features": n_in, "out_features": n_out, "bias": False}
        dense["activation_function"] = "torch.nn.modules.linear.Identity"
        (out / module / "config.json").write_text(json.dumps(dense))
        save_file({"linear.weight": torch.randn(n_out, n_in) / n_in**0.5}, str(out / module / "model.safetensors"))
    return out


# Qwen3-Reranker's prompt as a chat template that carries sentence-transformers' query / document roles
RERANKER_TEMPLATE = (
    "{%- set ns = namespace(query='', document='') -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'query' -%}{%- set ns.query = m.content -%}"
    "{%- elif m.role == 'document' -%}{%- set ns.document = m.content -%}{%- endif -%}"
    "{%- endfor -%}"
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
    'provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n<Instruct>: Given a '
    "web search query, retrieve relevant passages that answer the query\n<Query>: {{ ns.query }}\n<Document>: "
    "{{ ns.document }}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    "{{ '' }}"  # (else jinja drops the source's last newline)
)


def as_logit_score_reranker(src: str | Path, out: str | Path, true_id: int, false_id: int | None) -> Path:
    """A copy of the decoder checkpoint `src` at `out` as sentence-transformers' CrossEncoder saves
    a decoder reranker (Qwen3-Reranker's kind): a Transformer module, then LogitScore (the score
    is the last position's logit of `true_id` minus `false_id`'s, then sigmoid), and a chat
    template that renders a (query, document) pair as Qwen3-Reranker's prompt."""
    out = Path(out)
    shutil.copytree(src, out, dirs_exist_ok=True)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.base.modules.transformer.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_LogitScore",
            "type": "sentence_transformers.cross_encoder.modules.logit_score.LogitScore",
        },
    ]
    (out / "modules.json").write_text(json.dumps(modules, indent=1))
    (out / "1_LogitScore").mkdir(exist_ok=True)
    score = {"true_token_id": true_id, "false_token_id": false_id, "module_input_name": "causal_logits"}
    (out / "1_LogitScore" / "config.json").write_text(json.dumps(score))
    forward = {"method": "forward", "method_output_name": "logits"}
    st = {
        "transformer_task": "text-generation",
        "modality_config": {"text": forward, "message": {**forward, "format": "flat"}},
        "module_output_name": "causal_logits",
    }
    (out / "sentence_bert_config.json").write_text(json.dumps(st))
    (out / "config_sentence_transformers.json").write_text(
        json.dumps({"model_type": "CrossEncoder", "activation_fn": "torch.nn.modules.activation.Sigmoid"})
    )
    tokenizer_config = out / "tokenizer_config.json"
    config = json.loads(tokenizer_config.read_text())
    config.update(chat_template=RERANKER_TEMPLATE, pad_token=config.get("pad_token") or config.get("eos_token"))
    tokenizer_config.write_text(json.dumps(config, indent=1))
    (out / "chat_template.jinja").unlink(missing_ok=True)
    return out


def as_causal_reranker(src: str | Path, out: str | Path, seed: int = 0) -> Path:
    """A copy of the decoder checkpoint `src` at `out` as Qwen3-Reranker's uploads are: a causal LM
    and nothing else (no modules.json: sentence-transformers' CrossEncoder then scores a pair by the
    last position's logit of "yes" minus "no"), with "yes" and "no" added to its vocabulary (the
    embedding grown to hold them) and a chat template that renders a (query, document) pair."""
    import torch
    import transformers

    out = Path(out)
    torch.manual_seed(seed)  # (the grown embedding's rows are drawn)
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(src)
    tokenizer.add_tokens(["yes", "no"])
    model.resize_token_embeddings(len(tokenizer))
    tokenizer.chat_template = RERANKER_TEMPLATE
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def as_sequence_scorer(src: str | Path, out: str | Path, chat_template: bool = True, seed: int = 0) -> Path:
    """The decoder checkpoint `src` as a *ForSequenceClassification at `out`, as the "seq-cls"
    conversions of Qwen3-Reranker are saved: its base model and a `score` head [1, hidden] on the
    last token, no LM head; with `chat_template`, Qwen3-Reranker's prompt as the template
    (sentence-transformers then renders a pair through it), else none (the tokenizer's pair)."""
    import torch
    import transformers

    out = Path(out)
    causal = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    config = causal.config
    config.architectures = [type(causal).__name__.replace("ForCausalLM", "ForSequenceClassification")]
    config.num_labels, config.pad_token_id = 1, config.eos_token_id
    torch.manual_seed(seed)
    scorer = transformers.AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    scorer.model.load_state_dict(causal.model.state_dict())
    scorer.save_pretrained(out)
    tokenizer = transformers.AutoTokenizer.from_pretrained(src)
    tokenizer.chat_template = RERANKER_TEMPLATE if chat_template else None
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    tokenizer.save_pretrained(out)
    if not chat_template:
        (out / "chat_template.jinja").unlink(missing_ok=True)
    return out


# what llama.cpp's converter names BERT's tensors (written out here, not taken from families/bert.py:
# the test files check that family's names against an independent table)
CONVERTER_BERT_NAMES = {
    "embeddings.word_embeddings": "token_embd",
    "embeddings.position_embeddings": "position_embd",
    "embeddings.token_type_embeddings": "token_types",
    "embeddings.LayerNorm": "token_embd_norm",
    "attention.self.query": "attn_q",
    "attention.self.key": "attn_k",
    "attention.self.value": "attn_v",
    "attention.output.dense": "attn_output",
    "attention.output.LayerNorm": "attn_output_norm",
    "intermediate.dense": "ffn_up",
    "output.dense": "ffn_down",
    "output.LayerNorm": "layer_output_norm",
}


def write_bert_gguf(model_dir: str | Path, out: str | Path, pooling_type: int | None = 1, qtype: str = "F32") -> Path:
    """A BERT directory (make_tiny_bert's) as llama.cpp's convert_hf_to_gguf.py writes it (F32): its
    `bert` metadata and tensor names, the WordPiece vocabulary with a word's first piece spelled
    with a leading U+2581 and continuations without their "##" (`pooling_type`: 1 mean, 2 cls,
    None: none written). A cross-encoder's (make_tiny_cross_encoder's BERT) as it writes one: the
    classifier as cls.output, the pooler dropped. `qtype` (e.g. Q8_0): the layers' projection
    weights in those blocks, as llama-quantize leaves such a file (the rest F32)."""
    import gguf
    from safetensors.numpy import load_file

    model_dir, out = Path(model_dir), Path(out)
    config = json.loads((model_dir / "config.json").read_text())
    w = gguf.GGUFWriter(str(out), "bert")
    _write_bert_metadata(w, config, pooling_type, config["max_position_embeddings"])
    _write_wordpiece(w, model_dir)
    _write_bert_tensors(w, load_file(model_dir / "model.safetensors"), qtype)
    return _finish(w, out)


def _write_wordpiece(w, model_dir: Path) -> None:
    """A WordPiece vocabulary as the converter writes it: a word's first piece spelled with a
    leading U+2581, continuations without their "##", BERT's specials and flags."""
    vocab = json.loads((model_dir / "tokenizer.json").read_text())["model"]["vocab"]
    specials = {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"}
    tokens, types = [], []
    for token, _ in sorted(vocab.items(), key=lambda item: item[1]):
        special = token in specials
        tokens.append(token if special else token[2:] if token.startswith("##") else "\u2581" + token)
        types.append(3 if special else 1)
    w.add_tokenizer_model("bert")
    w.add_token_list(tokens)
    w.add_token_types(types)
    for name, token in (("bos", "[CLS]"), ("eos", "[SEP]"), ("unk", "[UNK]"), ("sep", "[SEP]"), ("pad", "[PAD]")):
        getattr(w, f"add_{name}_token_id")(vocab[token])
    w.add_add_bos_token(True)
    w.add_add_eos_token(True)
    w.add_bool("tokenizer.ggml.normalizer.lowercase", True)


# nomic-ai's tensor names -> llama.cpp's (its converter's NomicBertModel)
CONVERTER_NOMIC_NAMES = {
    "attn.Wqkv": "attn_qkv",
    "attn.out_proj": "attn_output",
    "norm1": "attn_output_norm",
    "mlp.fc11": "ffn_up",
    "mlp.fc12": "ffn_gate",
    "mlp.fc2": "ffn_down",
    "norm2": "layer_output_norm",
}


def write_nomic_bert_gguf(model_dir: str | Path, out: str | Path, pooling_type: int = 1) -> Path:
    """A nomic-bert directory (make_tiny_nomic_bert's) as llama.cpp's converter writes it (F32):
    `nomic-bert` metadata with its RoPE base, the WordPiece vocabulary as write_bert_gguf's, and
    the tensors under its names (q / k / v fused as attn_qkv, fc11 up, fc12 gate)."""
    import gguf
    from safetensors.numpy import load_file

    model_dir, out = Path(model_dir), Path(out)
    config = json.loads((model_dir / "config.json").read_text())
    w = gguf.GGUFWriter(str(out), "nomic-bert")
    _write_bert_metadata(w, config, pooling_type, config["max_position_embeddings"])
    w.add_rope_freq_base(float((config.get("rope_parameters") or {}).get("rope_theta", 1000.0)))
    _write_wordpiece(w, model_dir)
    for name, tensor in load_file(model_dir / "model.safetensors").items():
        if name.startswith("encoder.layers."):
            _, _, n, stem = name.split(".", 3)
            stem, kind = stem.rsplit(".", 1)
            name = f"blk.{n}.{CONVERTER_NOMIC_NAMES[stem]}.{kind}"
        else:
            name = {
                "embeddings.word_embeddings.weight": "token_embd.weight",
                "embeddings.token_type_embeddings.weight": "token_types.weight",
                "emb_ln.weight": "token_embd_norm.weight",
                "emb_ln.bias": "token_embd_norm.bias",
            }[name]
        w.add_tensor(name, tensor.astype("float32"))
    return _finish(w, out)


def write_xlm_roberta_gguf(
    model_dir: str | Path, out: str | Path, pooling_type: int | None = None, charsmap: bytes = b""
) -> Path:
    """An XLM-RoBERTa directory (make_tiny_xlm_roberta's) as the converter writes one (F32): arch
    `bert`, the unigram vocabulary as tokenizer model "t5" (pieces, scores, add_space_prefix,
    remove_extra_whitespaces; the test tokenizer has no precompiled `charsmap`: one only where
    given), add_sep, the position table without its first pad_token_id + 1 rows, the head as cls
    / cls.output."""
    import gguf
    from safetensors.numpy import load_file

    model_dir, out = Path(model_dir), Path(out)
    config = json.loads((model_dir / "config.json").read_text())
    model = json.loads((model_dir / "tokenizer.json").read_text())["model"]
    pieces = [piece for piece, _ in model["vocab"]]
    offset = config["pad_token_id"] + 1
    w = gguf.GGUFWriter(str(out), "bert")
    _write_bert_metadata(w, config, pooling_type, config["max_position_embeddings"] - offset)
    w.add_tokenizer_model("t5")
    w.add_tokenizer_pre("default")
    w.add_token_list(pieces)
    w.add_token_scores([float(score) for _, score in model["vocab"]])
    kinds = {"<s>": 3, "<pad>": 3, "</s>": 3, "<unk>": 2}
    w.add_token_types([kinds.get(piece, 1) for piece in pieces])
    w.add_add_space_prefix(True)
    w.add_remove_extra_whitespaces(True)
    if charsmap:
        w.add_precompiled_charsmap(charsmap)
    for name, token in (("bos", "<s>"), ("eos", "</s>"), ("unk", "<unk>"), ("sep", "</s>"), ("pad", "<pad>")):
        getattr(w, f"add_{name}_token_id")(pieces.index(token))
    w.add_add_bos_token(True)
    w.add_add_eos_token(True)
    w.add_add_sep_token(True)
    tensors = load_file(model_dir / "model.safetensors")
    for name in ("embeddings.position_embeddings.weight", "roberta.embeddings.position_embeddings.weight"):
        if name in tensors:
            tensors[name] = tensors[name][offset:]
    _write_bert_tensors(w, tensors)
    return _finish(w, out)


def _write_bert_metadata(w, config: dict, pooling_type: int | None, positions: int) -> None:
    import gguf

    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(positions)
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_layer_norm_eps(config["layer_norm_eps"])
    w.add_causal_attention(False)
    if pooling_type is not None:
        w.add_pooling_type(gguf.PoolingType(pooling_type))


def _finish(w, out: Path) -> Path:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


# a cross-encoder's head -> the converter's names (BERT's classifier alone is the output projection)
CONVERTER_HEAD_NAMES = {"classifier.dense": "cls", "classifier.out_proj": "cls.output", "classifier": "cls.output"}


def _write_bert_tensors(w, tensors: dict, qtype: str = "F32") -> None:
    """A BERT's tensors under the converter's names (a cross-encoder's head as cls / cls.output,
    the pooler dropped); the layers' 2-D weights as `qtype`."""
    import gguf

    names, quantized = CONVERTER_BERT_NAMES, gguf.GGMLQuantizationType[qtype]
    for name, tensor in tensors.items():
        name = name.removeprefix("bert.").removeprefix("roberta.")
        if name.startswith("pooler.") or name.endswith("position_ids"):
            continue
        stem, kind = name.rsplit(".", 1)
        if stem in CONVERTER_HEAD_NAMES:
            gguf_name = f"{CONVERTER_HEAD_NAMES[stem]}.{kind}"
        elif stem.startswith("encoder.layer."):
            _, _, layer, rest = stem.split(".", 3)
            gguf_name = f"blk.{layer}.{names[rest]}.{kind}"
        else:
            gguf_name = f"{names[stem]}.{kind}"
        if gguf_name.startswith("blk.") and tensor.ndim == 2 and qtype != "F32":
            w.add_tensor(gguf_name, gguf.quants.quantize(tensor.astype("float32"), quantized), raw_dtype=quantized)
        else:
            w.add_tensor(gguf_name, tensor.astype("float32"))


def write_embedding_gemma_gguf(model_dir: str | Path, out: str | Path, qtype: str = "F32") -> Path:
    """An EmbeddingGemma directory (make_tiny_embedding_gemma's, 6 layers: llama.cpp's layer pattern)
    as llama.cpp's converter writes it with --sentence-transformers-dense-modules: a
    `gemma-embedding` file with its pooling type and the Dense weights as dense_2 / dense_3."""
    import gguf
    from safetensors.numpy import load_file

    from flover.testing.tiny_model import write_gguf

    model_dir = Path(model_dir)

    def pooling_and_dense(w):
        w.add_pooling_type(gguf.PoolingType.MEAN)
        for module, name in (("2_Dense", "dense_2"), ("3_Dense", "dense_3")):
            weight = load_file(model_dir / module / "model.safetensors")["linear.weight"]
            w.add_tensor(f"{name}.weight", weight.astype("float32"))

    return write_gguf(model_dir, out, qtype, arch="gemma-embedding", extra=pooling_and_dense)


# the rerank prompt llama.cpp's converter stores in a Qwen3 reranker's file (RERANKER_TEMPLATE's text)
LLAMA_RERANK_PROMPT = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
    'provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n<Instruct>: Given a '
    "web search query, retrieve relevant passages that answer the query\n<Query>: {query}\n<Document>: "
    "{document}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
)


def write_qwen3_reranker_gguf(
    model_dir: str | Path, out: str | Path, true_id: int, false_id: int, prompt: str | None = LLAMA_RERANK_PROMPT
) -> Path:
    """A Qwen3 directory as llama.cpp's converter writes a Qwen3-Reranker (F32): rank pooling, the
    labels yes and no, its rerank `prompt` (None: none), cls.output = the LM head's rows of
    `true_id` and `false_id`; an untied LM head itself dropped (as the converter drops it)."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    from flover.testing.tiny_model import write_gguf

    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    tensors = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    tied = config.get("tie_word_embeddings", False)
    head = tensors["model.embed_tokens.weight" if tied else "lm_head.weight"].astype(np.float32)

    def rank(w):
        w.add_pooling_type(gguf.PoolingType.RANK)
        w.add_classifier_output_labels(["yes", "no"])
        if prompt is not None:
            w.add_chat_template([{"name": "rerank", "template": prompt}])
        w.add_tensor("cls.output.weight", np.stack([head[true_id], head[false_id]]))

    return write_gguf(model_dir, out, "F32", extra=rank, skip=("lm_head.weight",))
