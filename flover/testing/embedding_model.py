"""Embedding checkpoints for tests and benchmarks: a decoder checkpoint directory made a
sentence-transformers one (modules.json, 1_Pooling/config.json, Normalize), as Qwen3-Embedding's
is, so that `sentence_transformers.SentenceTransformer(dir)` is the reference."""

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
